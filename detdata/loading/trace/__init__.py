"""Delivery evidence: one JSONL record per delivered micro batch, and the diff of two traces.

One concept per module: `digests` (what a record holds about a batch: format version,
digest sums, position runs), `write` (`TraceWriter`), `read` (`read_trace`, `Record`) and
`diff` (`assemble`, `compare`); this package names their public parts.

**Record** (format version 3), written by `TraceWriter` when a micro batch is
delivered::

    {"v": 3, "rank": 0, "step": 7, "step_at": 56, "gbs": 8, "micro": 0,
     "at": 56, "next": 60, "pos": [[56, 2]], "cols": {"x": "<i4[5]"},
     "batch_b3": {"x": "<64 hex>"},
     "restored": true}                       # only on the first record after a restore

``at`` is the loader's ``samples_consumed`` before the batch and ``next`` after
it (every rank of a step shares them). ``step`` is the global step the batch
belongs to, ``step_at`` that step's first position and ``gbs`` its global batch,
all three from the run's step <-> position map (the loader's batch schedule and its
``history``: right across a ramp-up and across a global-batch change at a resume);
``micro`` is the micro step within the step, ``(at - step_at) // (next - at)``.
A record holds ``step_at <= at < next <= step_at + gbs``. Format 2 (still read)
had no ``step_at`` or ``micro`` and assumed one constant global batch:
``step == at // gbs``, ``step_at == step * gbs``. ``pos`` lists
the batch's positions as ``[first, count]`` runs. ``cols`` describes each leaf
of the batch (dtype and trailing shape) and ``batch_b3`` holds, per leaf, the sum
modulo 2**256 of one blake3 digest per sample, each taken over the leaf's name,
description, the sample's position (int64 LE) and the sample's bytes (the digest
framing is unchanged from format 2, so format 2 and 3 traces of one run compare
equal). Because
every sample is bound to its position and sums combine in any grouping, the
records of one global step add up to the same digests whatever the micro batch
size, the number of workers or (when the ranks' records are read together) the
world size. Tensors whose dtype numpy lacks (bfloat16, float8) are hashed by
their raw bytes and described by the torch dtype name.

**Timeline.** A trace file is read in order, per rank, as a run's deliveries: what the run
trained on, step after step. A record flagged ``restored`` follows a `TraceWriter.restore`
(the loader's ``load_state_dict``): the run went back (or forward) to ``at``, and what it
delivered after the latest moment its cursor was at ``at`` is superseded by what follows;
replayed positions must carry the same bytes as before, else the trace holds a *conflict*.
A record whose ``at`` does not continue its rank's previous record without a restore is a
*discontinuity* (a *restart* when at 0: a fresh loader whose state was not loaded): the
run's next step got other data, so it is reported at the step the run should have delivered
next, and nothing the rank delivered from there on (unless a restore rolls back before it)
stands for a step. So the first divergent step is the true one whatever the lengths of the
parts, and a ``--steps`` window before it compares what was delivered there.

**Diff.** `compare` assembles each trace per global step from its final records
(all ranks) and compares the steps' positions and summed digests; the first
difference is the smallest step with a difference or with a conflict or
discontinuity in either trace, whatever the order of the records in the files.
"""

from detdata.loading.trace.diff import (
    KIND_PRIORITY,
    Block,
    Comparison,
    Finding,
    Trace,
    assemble,
    block_difference,
    blocks,
    compare,
    first_difference,
    step_digests,
)
from detdata.loading.trace.digests import (
    READABLE_VERSIONS,
    TRACE_VERSION,
    batch_digests,
    leaf_digest,
    position_runs,
)
from detdata.loading.trace.read import Record, parse_record, read_trace
from detdata.loading.trace.write import RankTrace, StepSpan, TraceWriter

__all__ = [
    "KIND_PRIORITY",
    "READABLE_VERSIONS",
    "TRACE_VERSION",
    "Block",
    "Comparison",
    "Finding",
    "RankTrace",
    "Record",
    "StepSpan",
    "Trace",
    "TraceWriter",
    "assemble",
    "batch_digests",
    "block_difference",
    "blocks",
    "compare",
    "first_difference",
    "leaf_digest",
    "parse_record",
    "position_runs",
    "read_trace",
    "step_digests",
]
