"""The document table of `Documents`: its units (`Unit`: a token file or the token column
of a table shard, planned by `UnitPlanner`), each unit's document starts
(`megatron_starts`, `eod_starts`, `table_starts`) and the checks of a stored table
(`check_stored_table`; docs/design.md, "Documents and packing").
"""

from __future__ import annotations

import mmap
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any, Final

import numpy as np
import numpy.typing as npt

from detdata.base.errors import ConfigError, FormatError
from detdata.base.lazy import pa
from detdata.base.types import IntArray
from detdata.identity.formats import (
    MEGATRON_HEADER_BYTES,
    TABLE_FORMATS,
    TOKEN_DTYPES,
    Format,
    megatron_index_path,
    parse_megatron_header,
)
from detdata.identity.manifest import Manifest

#: The algorithm that cuts documents (part of a `Documents` identity and of the table's key).
ALGORITHM: Final = "documents-v1"
#: Tokens scanned per pass when looking for ``eod_token`` (bounded memory).
_SCAN: Final = 1 << 24


@dataclass(frozen=True)
class Unit:
    """One token space of the corpus: a token file, or the token column of a table shard.

    ``shard``: the manifest shard holding the tokens (the ``.bin`` of a Megatron
    pair); ``index``: the ``.idx`` shard of a pair (else -1); ``groups``: tokens per
    row group / record batch (tables only).
    """

    shard: int
    index: int
    kind: str  # "megatron", "eod" or "table"
    dtype: str
    tokens: int
    groups: tuple[int, ...] = ()


@dataclass(frozen=True)
class UnitPlanner:
    """Plans the units of ``manifest`` (`units`). ``eod_token`` / ``column`` are required
    where shards of their kind are, refused otherwise; ``table_schema(shard)`` is the
    checked Arrow schema of a table shard (it opens the file)."""

    manifest: Manifest
    eod_token: int | None
    column: str | None
    table_schema: Callable[[int], pa.Schema]

    def units(self) -> list[Unit]:
        """The token spaces of the manifest in path order."""
        values, _ = self.manifest.codes("format")
        pairs = Format.MEGATRON_IDX.value in values
        units = self._plan_pairs() if pairs else self._plan_singles()
        self._check_kinds({u.kind for u in units})
        return units

    def _plan_singles(self) -> list[Unit]:
        """One unit per shard of a manifest without Megatron indexes. A shard's checks
        depend only on its format with its dtype or schema fingerprint, so each is made
        once, on the first shard of each kind (the error names the first that fails)."""
        m = self.manifest
        values, fmt = m.codes("format")
        _, dtype = m.codes("dtype")
        _, schema = m.codes("schema")
        table = np.isin(fmt, [i for i, v in enumerate(values) if Format(v) in TABLE_FORMATS])
        token = np.isin(
            fmt, [i for i, v in enumerate(values) if Format(v) in (Format.NPY, Format.BIN)]
        )
        # one key per check: (kind, dtype or schema); a table without a fingerprint alone
        key = np.where(table, schema, dtype).astype(np.int64)
        alone = table & (schema < 0)
        key[alone] = -2 - np.flatnonzero(alone)
        key = key * 3 + np.where(table, 1, np.where(token, 0, 2))
        _, first, inverse = np.unique(key, return_index=True, return_inverse=True)
        planned: dict[int, Unit] = {}
        for i in sorted(first.tolist()):
            if table[i]:
                planned[i] = self._table_unit(i)
            elif token[i]:
                planned[i] = self._eod_unit(i)
            else:  # text (jsonl) shards: documents to tokenise, read by TextDocuments
                raise FormatError(
                    f"shard {m.shards[i].path}: a {values[fmt[i]]} text shard, not tokens; "
                    "hint: read raw text with TextDocuments(manifest, tokenizer) (tokenised "
                    "when read; PackedWindows packs it as Documents)"
                )
        reps = [planned[i] for i in first.tolist()]
        tokens = np.where(table, 0, m.samples_per_shard()).tolist()
        return [
            Unit(i, -1, reps[k].kind, reps[k].dtype, t)
            for i, (k, t) in enumerate(zip(inverse.reshape(-1).tolist(), tokens, strict=True))
        ]

    def _plan_pairs(self) -> list[Unit]:
        """The units of a manifest with Megatron indexes (shard by shard)."""
        shards = self.manifest.shards
        by_path = {s.path: i for i, s in enumerate(shards)}
        units: list[Unit] = []
        for i, entry in enumerate(shards):
            if entry.format is Format.MEGATRON_IDX:
                continue  # planned with its .bin
            idx = by_path.get(megatron_index_path(entry.path), -1)
            paired = idx >= 0 and shards[idx].format is Format.MEGATRON_IDX
            if paired and entry.path.endswith(".bin"):
                units.append(self._megatron_unit(i, idx))
            elif entry.format in (Format.NPY, Format.BIN):
                units.append(self._eod_unit(i))
            elif entry.format in TABLE_FORMATS:
                units.append(self._table_unit(i))
            else:  # pragma: no cover - every format is handled above
                raise FormatError(f"shard {entry.path}: format {entry.format.value} unknown")
        for entry in shards:
            if entry.format is Format.MEGATRON_IDX and entry.path.endswith(".idx"):
                if entry.path[: -len(".idx")] + ".bin" not in by_path:
                    raise FormatError(
                        f"shard {entry.path}: a Megatron index without its data file "
                        f"{entry.path[: -len('.idx')]}.bin in the manifest; hint: build the "
                        "manifest over both files of each .bin/.idx pair"
                    )
            elif entry.format is Format.MEGATRON_IDX:
                raise FormatError(f"shard {entry.path}: a Megatron index must be named *.idx")
        return units

    def _check_kinds(self, kinds: set[str]) -> None:
        """``eod_token`` / ``column`` given only where shards of their kind are."""
        if self.eod_token is not None and "eod" not in kinds:
            raise ConfigError(
                f"eod_token={self.eod_token} was given but manifest {self.manifest.id[:15]}… "
                "has no plain token shard (Megatron pairs and tables carry their own "
                "boundaries); hint: leave eod_token out"
            )
        if self.column is not None and "table" not in kinds:
            raise ConfigError(
                f"column={self.column!r} was given but the manifest has no table shard; "
                "hint: leave column out"
            )
        if not kinds:
            raise ConfigError(f"manifest {self.manifest.id} has no document shards")

    def _megatron_unit(self, shard: int, index: int) -> Unit:
        data, idx = self.manifest.shards[shard], self.manifest.shards[index]
        if data.format is not Format.BIN or data.dtype != idx.dtype:
            raise FormatError(
                f"shard {data.path}: the data file of Megatron index {idx.path} must be a "
                f"'bin' shard of dtype {idx.dtype!r} (the .idx header's), found "
                f"{data.format.value!r} {data.dtype!r}; hint: rebuild the manifest without "
                "format=/dtype= (they are read from the .idx)"
            )
        return Unit(shard, index, "megatron", str(data.dtype), data.num_samples)

    def _eod_unit(self, shard: int) -> Unit:
        entry = self.manifest.shards[shard]
        if self.eod_token is None:
            raise ConfigError(
                f"shard {entry.path}: a token shard without a Megatron .idx; its document "
                "boundaries need eod_token= (the end-of-document token id)"
            )
        if entry.dtype not in TOKEN_DTYPES:
            raise FormatError(f"shard {entry.path}: dtype {entry.dtype!r} is not a token dtype")
        info = np.iinfo(np.dtype(entry.dtype))
        if not int(info.min) <= self.eod_token <= int(info.max):
            raise ConfigError(
                f"eod_token={self.eod_token} cannot occur in shard {entry.path}: its "
                f"{entry.dtype} tokens are in [{int(info.min)}, {int(info.max)}] (every "
                "shard would be one document); hint: pass the tokenizer's end-of-document id"
            )
        return Unit(shard, -1, "eod", str(entry.dtype), entry.num_samples)

    def _table_unit(self, shard: int) -> Unit:
        entry = self.manifest.shards[shard]
        if self.column is None:
            raise ConfigError(
                f"shard {entry.path}: a {entry.format.value} shard; its documents are the rows "
                "of a token-list column: pass column= (e.g. column='input_ids')"
            )
        kind = self.table_schema(shard).field(self.column).type
        value = kind.value_type
        if not pa.types.is_integer(value):
            raise FormatError(
                f"shard {entry.path} column {self.column!r}: lists of {value}, not of "
                "integer token ids"
            )
        # from the type itself: pyarrow < 16's to_pandas_dtype() imports pandas (found by the
        # lower-bound run, tests/test_lean_install.py)
        sign = "i" if pa.types.is_signed_integer(value) else "u"
        return Unit(shard, -1, "table", np.dtype(f"{sign}{value.bit_width // 8}").name, 0)


def megatron_starts(manifest: Manifest, unit: Unit, raw: mmap.mmap) -> IntArray:
    """Local document starts of Megatron pair ``unit`` (ending with its token count) from
    ``raw``, its ``.idx`` bytes; `FormatError` unless it describes its ``.bin`` exactly."""
    entry = manifest.shards[unit.index]
    header = parse_megatron_header(raw[:MEGATRON_HEADER_BYTES], rel=entry.path)
    s, d = header.sequences, header.document_index
    if len(raw) != header.nbytes:
        raise FormatError(f"shard {entry.path}: {len(raw)} bytes, its header says {header.nbytes}")
    at = MEGATRON_HEADER_BYTES
    sizes = np.frombuffer(raw, dtype="<i4", count=s, offset=at).astype(np.int64)
    pointers = np.frombuffer(raw, dtype="<i8", count=s, offset=at + 4 * s).astype(np.int64)
    doc_index = np.frombuffer(raw, dtype="<i8", count=d, offset=at + 12 * s).astype(np.int64)
    itemsize = np.dtype(unit.dtype).itemsize
    seq_starts = np.zeros(s + 1, dtype=np.int64)
    np.cumsum(sizes, out=seq_starts[1:])
    problem = None
    if s and int(sizes.min()) < 0:
        problem = "a negative sequence size"
    elif not np.array_equal(pointers, seq_starts[:-1] * itemsize):
        bad = int(np.flatnonzero(pointers != seq_starts[:-1] * itemsize)[0])
        problem = (
            f"sequence {bad} starts at byte {int(pointers[bad])}, not right after the "
            f"previous one (byte {int(seq_starts[bad]) * itemsize})"
        )
    elif int(seq_starts[-1]) != unit.tokens:
        problem = (
            f"its sizes add up to {int(seq_starts[-1])} tokens, the .bin "
            f"{manifest.shards[unit.shard].path} has {unit.tokens}"
        )
    elif d == 0 or int(doc_index[0]) != 0 or int(doc_index[-1]) != s:
        problem = f"its document index must run from 0 to the sequence count {s}"
    elif d > 1 and bool((np.diff(doc_index) < 0).any()):
        problem = "its document index decreases"
    if problem is not None:
        raise FormatError(
            f"shard {entry.path}: the Megatron index does not describe its .bin: "
            f"{problem}; hint: rewrite the pair with Megatron's IndexedDatasetBuilder"
        )
    result: IntArray = seq_starts[doc_index]
    return result


def eod_starts(tokens: np.ndarray[Any, Any], count: int, eod_token: int) -> IntArray:
    """Local document starts of a plain token file of ``count`` ``tokens`` (ending with
    ``count``): a document ends after each ``eod_token``; the tokens after the last one are
    one more document. Scanned `_SCAN` tokens at a time (bounded memory)."""
    ends: list[npt.NDArray[np.int64]] = []
    for a in range(0, count, _SCAN):
        chunk = tokens[a : a + _SCAN]
        ends.append(np.flatnonzero(chunk == eod_token).astype(np.int64) + (a + 1))
    found = np.concatenate([np.zeros(1, dtype=np.int64), *ends])
    if found[-1] != count:
        found = np.append(found, np.int64(count))
    return found


def table_starts(
    unit: Unit, where: str, column: str, groups: Iterable[pa.ListArray]
) -> tuple[IntArray, Unit]:
    """Local document starts of table ``unit`` (one row, one document; ``where`` names its
    shard) from its ``column``'s row groups / record batches ``groups`` in file order, and the
    unit with its token and row-group token counts. Null lists or tokens: `FormatError`."""
    lengths: list[npt.NDArray[np.int64]] = []
    sizes: list[int] = []
    for g, values in enumerate(groups):
        if values.null_count or values.flatten().null_count:
            raise FormatError(
                f"shard {where} column {column!r}: null lists or null tokens in "
                f"row group {g}; every row must be a list of token ids"
            )
        offsets = np.asarray(values.offsets, dtype=np.int64)
        lengths.append(np.diff(offsets))
        sizes.append(int(offsets[-1] - offsets[0]))
    flat = np.concatenate([np.zeros(1, dtype=np.int64), *lengths])
    starts: IntArray = np.cumsum(flat)
    return starts, Unit(unit.shard, -1, "table", unit.dtype, int(starts[-1]), tuple(sizes))


def table_meta(units: list[Unit]) -> dict[str, Any]:
    """The record stored with a document table: the units' token and row-group counts."""
    return {"tokens": [u.tokens for u in units], "groups": [list(u.groups) for u in units]}


def check_stored_table(
    manifest: Manifest, units: list[Unit], starts: np.ndarray[Any, Any], meta: Mapping[str, Any]
) -> tuple[str | None, list[Unit]]:
    """What is wrong with a stored document table and its record (None: nothing), and the
    units recomputed from it and the manifest (`table_units`; the rules: docs/design.md,
    "Documents and packing")."""
    if starts.dtype != np.int64 or starts.ndim != 1 or starts.shape[0] < 1:
        return f"array {starts.dtype} of shape {starts.shape}, expected 1-D int64", []
    if int(starts[0]) != 0 or bool((np.diff(starts) < 0).any()):
        return "document starts do not run non-decreasing from 0", []
    try:
        done = table_units(manifest, units, starts)
    except ValueError as exc:
        return str(exc), []
    want = table_meta(done)
    for key in sorted(set(want) | set(meta)):
        if meta.get(key) != want.get(key):
            return f"meta.{key}: expected {want.get(key)!r}, found {meta.get(key)!r}", []
    return None, done


def table_units(manifest: Manifest, units: list[Unit], starts: np.ndarray[Any, Any]) -> list[Unit]:
    """``units`` with token and row-group counts recomputed from ``starts`` (non-decreasing)
    and the manifest; a `ValueError` says where they disagree."""
    kinds = {u.kind for u in units}
    if kinds == {"table"}:
        return _tables_only(manifest, units, starts)
    if kinds == {"eod"}:
        return _eod_only(manifest, units, starts)
    return _units_one_by_one(manifest, units, starts)


def stored_dtype(units: list[Unit]) -> np.dtype[Any]:
    """The common type of the units' stored tokens (every token id fits it)."""
    return np.dtype(np.result_type(*[np.dtype(d) for d in sorted({u.dtype for u in units})]))


def common_dtype(units: list[Unit], out_dtype: str | None) -> np.dtype[Any]:
    """The dtype gathered tokens are delivered in: ``out_dtype``, else the stored type widened
    to int32 or int64 (as `TokenWindows`; ``nn.Embedding`` refuses ``torch.uint16``)."""
    found = sorted({u.dtype for u in units})
    common = stored_dtype(units)
    if out_dtype is None:
        widened = np.result_type(common, np.int32)
        return np.dtype(widened) if widened.kind == "i" else common
    want = np.dtype(out_dtype)
    narrow = [d for d in found if not np.can_cast(d, want, casting="safe")]
    if want.kind not in "iu" or narrow:
        raise ConfigError(
            f"out_dtype {want.name} cannot hold the tokens of dtype {narrow or want.name}; "
            f"hint: use {common.name} or wider"
        )
    return want


def _tables_only(manifest: Manifest, units: list[Unit], starts: np.ndarray[Any, Any]) -> list[Unit]:
    """`table_units` when every unit is a table: rows and row groups from the columns."""
    n = int(starts.shape[0]) - 1
    shards = np.fromiter((u.shard for u in units), np.int64, len(units))
    counts, sizes = manifest.row_groups_per_shard()
    ends = np.concatenate([[0], np.cumsum(np.maximum(counts, 0))])
    per = np.maximum(counts, 0)[shards]
    first = np.concatenate([[0], np.cumsum(per)[:-1]]).astype(np.int64)
    picks = np.repeat(ends[shards] - first, per) + np.arange(int(per.sum()), dtype=np.int64)
    group_rows = sizes[picks]
    at = np.concatenate([[0], np.cumsum(group_rows)]).astype(np.int64)
    rows = at[first + per] - at[first]
    doc_end = np.cumsum(rows)
    bad = (rows != manifest.samples_per_shard()[shards]) | (doc_end > n)
    if bad.any():
        i = int(np.flatnonzero(bad)[0])
        entry = manifest.shards[int(shards[i])]
        raise ValueError(f"shard {entry.path}: its {entry.num_samples} rows do not fit")
    if int(doc_end[-1]) != n:
        raise ValueError(f"{n - int(doc_end[-1])} documents past the manifest's last shard")
    group_tokens = np.diff(starts[at]).tolist()
    unit_tokens = (starts[doc_end] - starts[doc_end - rows]).tolist()
    return [
        Unit(u.shard, -1, "table", u.dtype, t, tuple(group_tokens[a : a + c]))
        for u, t, a, c in zip(units, unit_tokens, first.tolist(), per.tolist(), strict=True)
    ]


def _eod_only(manifest: Manifest, units: list[Unit], starts: np.ndarray[Any, Any]) -> list[Unit]:
    """`table_units` when every unit is a plain token shard (eod documents are never empty:
    a unit ends at the first start equal to its end)."""
    n = int(starts.shape[0]) - 1
    ends = np.cumsum(np.fromiter((u.tokens for u in units), np.int64, len(units)))
    stop = np.maximum.accumulate(np.searchsorted(starts, ends, side="left"))
    bad = (stop > n) | (starts[np.minimum(stop, n)] != ends)
    if bad.any():
        unit = units[int(np.flatnonzero(bad)[0])]
        raise ValueError(
            f"shard {manifest.shards[unit.shard].path}: its documents do not end at its "
            f"{unit.tokens} tokens"
        )
    if int(stop[-1]) != n:
        raise ValueError(f"{n - int(stop[-1])} documents past the manifest's last shard")
    return list(units)


def _units_one_by_one(
    manifest: Manifest, units: list[Unit], starts: np.ndarray[Any, Any]
) -> list[Unit]:
    """`table_units` unit by unit (Megatron pairs, or token shards with tables)."""
    n = int(starts.shape[0]) - 1
    doc, token = 0, 0
    done: list[Unit] = []
    for unit in units:
        entry = manifest.shards[unit.shard]
        if unit.kind == "table":
            rows = list(entry.row_groups or ())
            if sum(rows) != entry.num_samples or doc + sum(rows) > n:
                raise ValueError(f"shard {entry.path}: its {entry.num_samples} rows do not fit")
            edges = doc + np.concatenate([[0], np.cumsum(rows, dtype=np.int64)])
            groups = tuple(int(g) for g in np.diff(starts[edges]))
            doc, end = int(edges[-1]), int(starts[int(edges[-1])])
            done.append(Unit(unit.shard, -1, "table", unit.dtype, end - token, groups))
            token = end
            continue
        end = token + unit.tokens
        if unit.kind == "megatron":
            stop = doc + manifest.shards[unit.index].num_samples
        else:  # eod documents are never empty: the unit ends at the first start == end
            stop = doc + int(np.searchsorted(starts[doc:], end, side="left"))
        if stop > n or int(starts[stop]) != end:
            raise ValueError(
                f"shard {entry.path}: its documents do not end at its {unit.tokens} tokens"
            )
        doc, token = stop, end
        done.append(unit)
    if doc != n:
        raise ValueError(f"{n - doc} documents past the manifest's last shard")
    return done
