"""Delivery evidence: one JSONL record per delivered micro batch, and the diff of two traces.

docs/guarantees.md, "Traces", says what a trace proves and how `detdata diff` reads it.

**Record** (format version 3), written by `TraceWriter` when a micro batch is
delivered::

    {"v": 3, "rank": 0, "step": 7, "step_at": 56, "gbs": 8, "micro": 0,
     "at": 56, "next": 60, "pos": [[56, 2]], "cols": {"x": "<i4[5]"},
     "batch_b3": {"x": "<64 hex>"},
     "restored": true}                       # only on the first record after a restore

``at`` is the loader's ``samples_consumed`` before the batch and ``next`` after
it (every rank of a step shares them). ``step`` is the global step the batch
belongs to, ``step_at`` that step's first position and ``gbs`` its global batch,
all three from the run's step <-> position map; ``micro`` is the micro step within the
step, ``(at - step_at) // (next - at)``. A record holds
``step_at <= at < next <= step_at + gbs``. Format 2 (still read) had no ``step_at`` or
``micro``: ``step == at // gbs``, ``step_at == step * gbs``. ``pos`` lists
the batch's positions as ``[first, count]`` runs. ``cols`` describes each leaf
of the batch (dtype and trailing shape) and ``batch_b3`` holds, per leaf, the sum
modulo 2**256 of one blake3 digest per sample, each taken over the leaf's name,
description, the sample's position (int64 LE) and the sample's bytes (the same framing
as format 2). Because every sample is bound to its position and sums combine in any
grouping, the records of one global step add up to the same digests whatever the micro
batch size, the number of workers or the world size. Tensors whose dtype numpy lacks
(bfloat16, float8) are hashed by their raw bytes and described by the torch dtype name.
How records are replayed (restores, conflicts, discontinuities) and compared: `assemble`,
`compare`.
"""

from detdata.loading.trace.diff import (
    KIND_PRIORITY,
    Comparison,
    compare,
    step_digests,
)
from detdata.loading.trace.read import Record, parse_record, read_trace
from detdata.loading.trace.write import RankTrace, StepSpan, TraceWriter

__all__ = [
    "KIND_PRIORITY",
    "Comparison",
    "RankTrace",
    "Record",
    "StepSpan",
    "TraceWriter",
    "compare",
    "parse_record",
    "read_trace",
    "step_digests",
]
