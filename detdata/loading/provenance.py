"""Provenance: every sample of a global step, down to its shard file and byte range.

`provenance` gives a `SampleRecord` per position (rank, micro step, row, source, sample id,
``digest``, location; fields and their meaning: docs/design.md, "Provenance, exclusions, run
record"); `positions_seen` is the reverse (every position a sample was delivered at).
Within a step from ``c``, position ``c + q`` is row ``q % m`` of micro step ``q // (m * D)``
on rank ``(q // m) % D`` (docs/design.md section 4).
"""

from __future__ import annotations

import bisect
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Final

import numpy as np

from detdata.base.checks import check_count
from detdata.base.errors import CapabilityError, ConfigError
from detdata.base.hashing import digest_bytes
from detdata.base.redact import redact_value
from detdata.base.types import MAX_POSITION, Batch, IntArray
from detdata.datasets.capabilities import info, reweights
from detdata.datasets.exclusions import Excluded
from detdata.datasets.mixture import Mixture
from detdata.datasets.origins import origins
from detdata.datasets.sample_framing import framed, framed_sample
from detdata.datasets.streams import OrderedStream
from detdata.datasets.tables import TableRows
from detdata.datasets.tokens import TokenWindows
from detdata.identity.formats import disk_dtype
from detdata.loading.reweighting import weights_json
from detdata.order.feistel import GlobalOrder
from detdata.order.inverse import mixture_positions_of, positions_of
from detdata.order.locality import WindowedOrder
from detdata.order.mixing import MixtureSchedule

#: Digest framing version of `sample_digest`.
DIGEST_TAG: Final = b"detdata:sample-v1"
Decode = Callable[[Mapping[str, Any]], Any]
#: The fields of a `SampleRecord` its JSON always holds, in order (named as in the record).
_KEYS: Final = ("position", "step", "rank", "micro_step", "row", "source", "sample_id", "digest")


@dataclass(frozen=True, kw_only=True)
class SampleRecord:
    """Where one delivered sample came from: ``location`` is `locations`'s, ``replaced`` set
    through an `Excluded` stream, ``mixture_weights`` over a `Mixture` (``{source: "p/q"}`` in
    force at the position), ``text`` the ``decode`` of the sample."""

    position: int
    step: int
    rank: int
    micro_step: int
    row: int
    source: str | None
    sample_id: int
    digest: str
    location: Mapping[str, Any] = field(default_factory=dict)
    replaced: Mapping[str, Any] | None = None
    text: Any = None
    mixture_weights: Mapping[str, str] | None = None

    def __post_init__(self) -> None:
        # the redaction boundary: a location's URL never carries credentials
        object.__setattr__(self, "location", redact_value(dict(self.location)))
        if self.replaced is not None:
            object.__setattr__(self, "replaced", redact_value(dict(self.replaced)))

    def to_json(self) -> dict[str, Any]:
        """Plain JSON (locations flattened into the record)."""
        out: dict[str, Any] = {key: getattr(self, key) for key in _KEYS}
        out.update(self.location)
        if self.replaced is not None:
            out["replaced"] = dict(self.replaced)
        if self.text is not None:
            out["text"] = self.text
        if self.mixture_weights is not None:
            out["mixture_weights"] = dict(self.mixture_weights)
        return out


def _value_bytes(value: Any) -> bytes:
    """The bytes one column of one sample contributes: dtype, shape and buffer of an array;
    utf-8 of a str; a bytes value as is; a 1-D array in an object column like an array."""
    if isinstance(value, np.ndarray) and value.dtype != object:
        arr = np.ascontiguousarray(value)
        return framed(b"nd", arr.dtype.str.encode(), str(arr.shape).encode(), arr.tobytes())
    if isinstance(value, str):
        return framed(b"str", value.encode("utf-8"))
    if isinstance(value, bytes):
        return framed(b"bytes", value)
    if isinstance(value, np.generic):
        return _value_bytes(np.asarray(value))
    if value is None:
        return framed(b"none")
    raise ConfigError(
        f"cannot digest a sample column holding {type(value).__name__}; "
        "hint: numeric arrays, str and bytes are digested"
    )


def sample_digest(sample: Mapping[str, Any]) -> str:
    """``b3:<hex>`` of one sample (column -> value), framed: ``DIGEST_TAG``, then per column in
    sorted name order its name and `_value_bytes` (each part length-prefixed, u64le)."""
    return digest_bytes(framed_sample(DIGEST_TAG, sample, _value_bytes))


def row_of(batch: Batch, j: int) -> dict[str, Any]:
    """Sample ``j`` of a batch as column -> value."""
    return {k: v[j] for k, v in batch.items()}


def _token_locations(ds: TokenWindows, ids: IntArray) -> list[dict[str, Any]]:
    shard, window = ds.locate(ids)
    out = []
    for s, w in zip(shard.tolist(), window.tolist(), strict=True):
        entry = ds.manifest.shards[s]
        start = w * ds.seq_len
        size = disk_dtype(entry.dtype or "").itemsize
        offset = entry.data_offset or 0
        out.append(
            {
                "shard": entry.path,
                "url": ds.manifest.url(entry),
                "tokens": [start, start + ds.window],
                "bytes": [offset + start * size, offset + (start + ds.window) * size],
            }
        )
    return out


def _table_locations(ds: TableRows, ids: IntArray) -> list[dict[str, Any]]:
    shard, group, _ = ds.locate(ids)
    counts = np.array([s.num_samples for s in ds.manifest.shards], dtype=np.int64)
    first = np.concatenate([[0], np.cumsum(counts)[:-1]])
    out = []
    for s, g, i in zip(shard.tolist(), group.tolist(), ids.tolist(), strict=True):
        entry = ds.manifest.shards[s]
        row = i - int(first[s])
        out.append(
            {
                "shard": entry.path,
                "url": ds.manifest.url(entry),
                "rows": [row, row + 1],
                "row_group": g,
            }
        )
    return out


def locations(dataset: Any, ids: IntArray) -> list[dict[str, Any]]:
    """Shard-level location of each id of ``dataset``: `TokenWindows` (shard, url, ``tokens``
    and ``bytes`` ranges, header included) and `TableRows` (shard, url, ``rows``,
    ``row_group``) here, any other dataset by its ``provenance(ids)`` (`DatasetInfo`), else an
    empty dict per id."""
    if isinstance(dataset, TokenWindows):
        return _token_locations(dataset, ids)
    if isinstance(dataset, TableRows):
        return _table_locations(dataset, ids)
    located = info(dataset).provenance(ids)
    if located is not None:
        found = list(located)
        if len(found) != ids.size:
            raise ConfigError(
                f"{type(dataset).__name__}.provenance returned {len(found)} records for "
                f"{ids.size} ids"
            )
        return [dict(f) for f in found]
    return [{} for _ in range(ids.size)]


def provenance(
    stream: Any,
    positions: Sequence[int] | IntArray,
    *,
    step: int,
    micro_batch_size: int,
    world_size: int,
    layouts: Sequence[tuple[int, int, int]],
    first: int,
    decode: Decode | None = None,
) -> list[SampleRecord]:
    """A `SampleRecord` per position of one step (``positions`` contiguous, from the step's
    first position), in position order; reads the step's samples once (for the digests).

    Rank and micro step follow ``micro_batch_size`` x ``world_size``, or, with ``layouts``
    (``(from_position, micro_batch_size, world_size)`` ascending: the run's layout history),
    the layout in effect at each position (a step before an elastic change keeps its ranks).
    ``first``: the step's first position (``positions`` may be a later part of the step: a
    step split where the stream changed)."""
    pos = np.asarray(positions, dtype=np.int64).reshape(-1)
    starts = [int(p) for p, _, _ in layouts]
    found = origins(stream, pos)
    batch = stream.fetch(pos)
    where: list[dict[str, Any]] = [{} for _ in range(pos.size)]
    for s, dataset in enumerate(found.datasets):
        rows = np.flatnonzero(found.source == s)
        if rows.size:
            for j, loc in zip(rows.tolist(), locations(dataset, found.ids[rows]), strict=True):
                where[j] = loc
    records = []
    weights = _weights_in_force(stream, pos)
    for j in range(pos.size):
        sample = row_of(batch, j)
        q = int(pos[j]) - first
        k = bisect.bisect_right(starts, int(pos[j])) - 1
        m, d = (micro_batch_size, world_size) if k < 0 else layouts[k][1:]
        records.append(
            SampleRecord(
                position=int(pos[j]),
                step=step,
                rank=(q // m) % d,
                micro_step=q // (m * d),
                row=q % m,
                source=found.names[int(found.source[j])],
                sample_id=int(found.ids[j]),
                digest=sample_digest(sample),
                location=where[j],
                replaced=found.notes[j],
                text=None if decode is None else decode(sample),
                mixture_weights=weights[j],
            )
        )
    return records


def _weights_in_force(stream: Any, pos: IntArray) -> list[dict[str, str] | None]:
    """The mixture proportions in force at each position (`Reweights`: O(log phases) a
    position), else None each; equal maps are shared."""
    mixture = reweights(stream)
    if mixture is None:
        return [None] * pos.size
    out: list[dict[str, str] | None] = []
    last: dict[str, str] | None = None
    for p in pos.tolist():
        now = weights_json(mixture.mixture_weights_at(p))
        last = last if last == now else now
        out.append(last)
    return out


def positions_seen(stream: Any, source: str | None, sample_id: int, *, until: int) -> IntArray:
    """Every global position ``< until`` at which ``stream`` delivers sample ``sample_id`` of
    ``source`` (None for a single-dataset stream), ascending, by inverting the order per
    epoch (`detdata.order.inverse`; costs: docs/design.md, "Reverse lookup")."""
    hi = check_count(until, "until", minimum=0, maximum=MAX_POSITION)
    if isinstance(stream, Excluded):
        return _seen_excluded(stream, source, sample_id, hi)
    if isinstance(stream, OrderedStream):
        if source is not None:
            raise ConfigError(
                f"source {source!r} given, but this stream reads one dataset; hint: pass the "
                "sample id alone"
            )
        order = stream.order
        if isinstance(order, GlobalOrder):
            return positions_of(order, sample_id, until=hi)
        if isinstance(order, WindowedOrder):
            return np.asarray(order.positions_of(sample_id, until=hi), dtype=np.int64)
        raise ConfigError(
            f"positions_seen cannot invert a {type(order).__name__} order; hint: "
            "feistel-v1 (the default order), locality-v1 and mixtures are invertible"
        )
    if isinstance(stream, Mixture):
        if source not in stream.source_names:
            raise ConfigError(
                f"unknown source {source!r}; the mixture's sources are {list(stream.source_names)}"
            )
        return mixture_positions_of(
            MixtureSchedule(stream.phases),
            stream.source_names.index(source),
            stream.orders[source],
            sample_id,
            until=hi,
        )
    raise CapabilityError(
        f"positions_seen cannot invert the order of a {type(stream).__name__} (only an "
        "OrderedStream's, a Mixture's or an Excluded stream's over one); hint: use one of "
        "those",
        capability="positions_seen",
        kind=type(stream).__name__,
    )


def _seen_excluded(stream: Excluded, source: str | None, sample_id: int, until: int) -> IntArray:
    base = positions_seen(stream.stream, source, sample_id, until=until)
    s = stream.source_index(source)
    ids = np.full(base.size, sample_id, dtype=np.int64)
    parts = [base[~stream.excluded_mask(np.full(base.size, s, dtype=np.int64), ids, base)]]
    others = sorted({i for k in range(len(stream.history)) for i in stream.excluded_ids(k, s)})
    for other in others:  # where an excluded sample's replacement is this one
        at = positions_seen(stream.stream, source, other, until=until)
        if at.size:
            parts.append(at[stream.origins(at).ids == sample_id])
    return np.unique(np.concatenate(parts)).astype(np.int64)
