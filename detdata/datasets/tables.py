"""Rows of Parquet / Arrow IPC shards as samples (`TableRows`). Column kinds:
`detdata.datasets.arrow_numpy`; the row-group cache and its sizing from the announced
order: `detdata.datasets.rowgroups` (docs/design.md, section 2). Nothing returned aliases
the cache.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Sequence
from typing import Any, Final, Never

import numpy as np
import numpy.typing as npt
from fsspec.implementations.local import LocalFileSystem

from detdata.base.checks import check_positive_int
from detdata.base.errors import ConfigError, FormatError
from detdata.base.groupby import stable_groups
from detdata.base.lazy import ipc, pa, pq
from detdata.base.types import Batch, IntArray
from detdata.datasets.arrow_numpy import (
    arrow_kind,
    check_column_type,
    one_chunk,
    to_numpy,
)
from detdata.datasets.base import check_ids
from detdata.datasets.batch_columns import describe_column, object_array
from detdata.datasets.capabilities import DatasetInfo
from detdata.datasets.process_local import PerProcess, pickled_state
from detdata.datasets.rowgroups import Columns, Group, GroupIndex, GroupSlots, auto_cache_row_groups
from detdata.datasets.shard_files import ShardFiles, resolve_manifest
from detdata.datasets.shard_storage import Storage, checked_storage
from detdata.identity.entry import ShardEntry
from detdata.identity.formats import TABLE_FORMATS, Format
from detdata.identity.manifest import Manifest
from detdata.order.choice import OrderChoice
from detdata.storage.fs import filesystem, join

#: Default bound of the in-memory cache of decoded row groups (``row_group_cache_bytes``).
DEFAULT_ROW_GROUP_CACHE_BYTES: Final = 1 << 30
#: Local Parquet shards of at least this many bytes are memory-mapped; smaller ones are
#: read with ``pread`` (measured: a map + unmap costs more than it saves below ~256 KiB).
PARQUET_MAP_MIN_BYTES: Final = 256 << 10


class TableRows(DatasetInfo):
    """Rows of a Parquet / Arrow IPC manifest; ``read(ids)`` -> one array per column.

    All shards must share one schema fingerprint (`FormatError` naming two shards and the
    differing fields otherwise). ``columns`` selects columns (default: all, in schema
    order); ``ragged`` names list columns to return as object arrays of 1-D arrays.
    Decoded row groups are kept per process (`GroupSlots`, ``self.cache``): at most
    ``cache_row_groups`` groups (None: every group when they all fit, else
    `auto_cache_row_groups` of the order announced through `use_order`; ``cache_groups``
    is that count) and ``row_group_cache_bytes`` bytes (default 1 GiB).

    ``storage``: where and how shards are read (`Storage`; default without a shard cache).
    Neither the caches nor their bounds change the rows read or ``identity()``. `Storage`'s
    fields given directly, and ``cache_bytes=``, are refused naming what to pass. Pickled
    with its parameters, manifest and ``files`` only.
    """

    def __init__(
        self,
        manifest: Manifest | str,
        columns: Sequence[str] | None = None,
        *,
        cache_row_groups: int | None = None,
        row_group_cache_bytes: int | None = None,
        ragged: Sequence[str] = (),
        storage: Storage | None = None,
        **refused: Never,
    ) -> None:
        if "cache_bytes" in refused:  # its old meaning here; everywhere else shard_cache_bytes
            raise ConfigError(
                "TableRows(cache_bytes=...) is no longer accepted: here it was the old "
                "name of row_group_cache_bytes, elsewhere of Storage.shard_cache_bytes; hint: "
                "pass row_group_cache_bytes=... for decoded row groups in memory, or "
                "storage=Storage(cache_dir=..., shard_cache_bytes=...) for the disk cache"
            )
        storage = checked_storage("TableRows", storage, refused)
        self.storage = storage.with_default_cache(None)  # no copies unless asked for
        self.manifest = resolve_manifest(manifest, self.storage)
        self.files = ShardFiles(self.manifest, self.storage, self.manifest.bytes_per_shard())
        self.cache_row_groups: int | None = (
            None
            if cache_row_groups is None
            else check_positive_int(cache_row_groups, "cache_row_groups", minimum=0)
        )
        self._order_choice: OrderChoice | None = None  # announced by use_order
        if row_group_cache_bytes is None:
            row_group_cache_bytes = DEFAULT_ROW_GROUP_CACHE_BYTES
        self.row_group_cache_bytes = check_positive_int(
            row_group_cache_bytes, "row_group_cache_bytes", minimum=0
        )
        shards = self.manifest.shards
        if not shards:
            raise ConfigError(
                f"manifest {self.manifest.id} has no shards; TableRows needs table shards"
            )
        _check_table_shards(self.manifest)
        self._check_same_schema()
        schema = self._read_schema(0)
        self.columns: tuple[str, ...] = _select_columns(schema, columns, shards[0].path)
        self.ragged: tuple[str, ...] = _check_ragged(schema, self.columns, ragged)
        for name in self.columns:
            check_column_type(schema.field(name), shards[0].path)
        self._types: dict[str, str | None] = {
            n: arrow_kind(schema.field(n).type, n in self.ragged) for n in self.columns
        }
        self._num = self.manifest.num_samples
        if self._num == 0:
            raise ConfigError(
                f"manifest {self.manifest.id}: {len(shards)} shard(s) with 0 rows; "
                "the dataset is empty"
            )
        self._index = GroupIndex.of(self.manifest)
        self._local: PerProcess[GroupSlots] = PerProcess()
        self._io_lock: PerProcess[threading.Lock] = PerProcess()  # remote readers share a handle

    def _check_same_schema(self) -> None:
        """`FormatError` naming the first shard whose schema differs from the first's."""
        shards = self.manifest.shards
        _, codes = self.manifest.codes("schema")
        differ = np.flatnonzero(codes != codes[0])
        if differ.size:
            index = int(differ[0])
            first, shard = shards[0], shards[index]
            if shard.schema != first.schema:
                diff = _schema_diff(self._read_schema(0), self._read_schema(index))
                raise FormatError(
                    f"shards {first.path} and {shard.path} have different schemas "
                    f"({first.schema} vs {shard.schema}); differing fields: {diff}; "
                    "hint: rewrite the shards with one schema or build separate "
                    "manifests and mix them"
                )

    def _read_schema(self, index: int) -> pa.Schema:
        shard = self.manifest.shards[index]
        fs, root = filesystem(self.manifest.root or "", **self.storage.fs_options)

        def read(_timeout: float | None) -> pa.Schema:
            with fs.open(join(root, shard.path), "rb") as fh:
                if shard.format is Format.PARQUET:
                    return pq.ParquetFile(fh).schema_arrow
                return ipc.open_file(fh).schema

        if isinstance(fs, LocalFileSystem):
            return read(None)
        return self.storage.retry.run(
            read, what="schema read", shard=shard.path, url=self.manifest.url(shard)
        )

    def __getstate__(self) -> dict[str, Any]:
        return pickled_state(self, ("_index",))  # made again from the manifest's columns

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._index = GroupIndex.of(self.manifest)
        self.files.attach(self.manifest.bytes_per_shard())

    def _new_cache(self) -> GroupSlots:
        whole = self.cache_row_groups is None
        return GroupSlots(
            self.cache_groups, self.row_group_cache_bytes, self._index, whole_if_fits=whole
        )

    @property
    def cache(self) -> GroupSlots:
        """This process's cache of decoded row groups (`GroupSlots`)."""
        return self._local.get(self._new_cache)

    @property
    def cache_groups(self) -> int:
        """``cache_row_groups``, else `auto_cache_row_groups` of the announced order (the
        cache may raise it to every row group: ``cache.max_groups``)."""
        if self.cache_row_groups is not None:
            return self.cache_row_groups
        return auto_cache_row_groups(self._order_choice, self._index.per_shard)

    def use_order(self, choice: OrderChoice) -> None:
        """Announce the order this dataset is read in (`OrderedStream` does), to size the
        default cache for it; never changes what is read. The last announced order wins."""
        before = self.cache_groups
        self._order_choice = choice
        if self.cache_groups != before:
            self._local.reset()  # a new, empty cache with the new bound

    @property
    def num_samples(self) -> int:
        """Total rows over all shards."""
        return self._num

    def __len__(self) -> int:
        """`num_samples` (samples of one epoch), as torch's ``len(dataset)``."""
        return self.num_samples

    @property
    def shard_sizes(self) -> tuple[int, ...]:
        """Rows per shard in manifest (id) order: what `LocalityOrder` windows."""
        return tuple(self.manifest.samples_per_shard().tolist())

    @property
    def row_group_sizes(self) -> tuple[int, ...]:
        """Rows per row group in id order: what ``LocalityOrder(window_row_groups=k)``
        windows."""
        return tuple(self.manifest.row_groups_per_shard()[1].tolist())

    def identity(self) -> dict[str, Any]:
        """Plain JSON pinning the manifest and the selected columns."""
        ident: dict[str, Any] = {
            "type": "table_rows",
            "manifest": self.manifest.id,
            "columns": list(self.columns),
            "num_samples": self._num,
        }
        if self.ragged:
            ident["ragged"] = list(self.ragged)
        return ident

    def locate(self, ids: npt.ArrayLike) -> tuple[IntArray, IntArray, IntArray]:
        """``(shard, row group in shard, row in group)`` int64 arrays for row ids (checked)."""
        arr = check_ids(ids, self._num, self._what())
        index = self._index
        group = np.searchsorted(index.starts, arr, side="right").astype(np.int64) - 1
        shard = index.shard[group]
        return shard, group - index.shard_first[shard], arr - index.starts[group]

    def read(self, ids: npt.ArrayLike) -> Batch:
        """One array per selected column, rows in the order of ``ids``; every array (and
        row of a ragged column) is new memory owned by the batch."""
        arr = check_ids(ids, self._num, self._what())
        index, cache = self._index, self.cache
        if arr.size == 0:
            return {name: self._empty(name) for name in self.columns}
        if cache.pool_bytes:
            group = index.starts.searchsorted(arr, "right") - 1
            in_group = arr - index.starts[group]
            fast = cache.gather(group, in_group, self.columns)
            if fast is not None:
                return self._own(fast)
            # slots that cannot evict: decode the missing groups into them, then one gather
            # (no per-group copies of the cached ones); the cache ends as after the visit below
            todo = cache.missing(group)
            if todo is not None:
                cache.reserve(todo.size)
                for g in todo.tolist():
                    cache.insert(g, self._decode(*index.in_shard(g)))
                fast = cache.gather(group, in_group, self.columns)
                if fast is not None:
                    return self._own(fast)
        order, group, spans = stable_groups(index.starts.searchsorted(arr, "right") - 1)
        rows = arr[order] - index.starts[group]
        parts: list[Columns | None] = [None] * len(spans)
        cache.reserve(len(spans))
        # groups in order of first use (``order[a]``: a run's first id): the last window's
        # groups are then the most recently used when an ordered stream continues
        for i in sorted(range(len(spans)), key=lambda i: int(order[spans[i][1]])):
            g, a, b = spans[i]
            part = cache.take_rows(g, rows[a:b])
            if part is None:
                decoded = self._decode(*index.in_shard(g))
                part = {name: decoded.columns[name][rows[a:b]] for name in self.columns}
                cache.insert(g, decoded)
            parts[i] = part
        done = [p for p in parts if p is not None]
        return self._own(
            {name: self._assemble(name, [p[name] for p in done], order) for name in self.columns}
        )

    def _own(self, batch: Batch) -> Batch:
        """``batch`` with the rows of ragged columns copied (a gather copies no row)."""
        for name in self.ragged:
            batch[name] = object_array([row.copy() for row in batch[name].tolist()])
        return batch

    def schema(self) -> dict[str, str]:
        """Column -> what `read` delivers in it (`describe_column` form: ``'int64'``,
        ``'float32 (3,)'``, ``'list<int32>'``, ``'str'``, ...). From the Arrow schema, except
        the width of a non-ragged variable-length list column, read from row 0."""
        if any(t is None for t in self._types.values()):
            first = self.read(np.zeros(1, dtype=np.int64))
            self._types = {
                n: describe_column(first[n]) if t is None else t for n, t in self._types.items()
            }
        return {n: str(t) for n, t in self._types.items()}

    def _what(self) -> str:
        return f"TableRows({self.manifest.id[:15]}…)"

    def _assemble(
        self, name: str, parts: list[np.ndarray[Any, Any]], order: IntArray
    ) -> np.ndarray[Any, Any]:
        widths = {p.shape[1:] for p in parts}
        if len(widths) > 1:
            raise FormatError(
                f"column {name!r}: rows of one batch come from row groups with "
                f"different list lengths {sorted(w[0] for w in widths)}; hint: pad "
                "the column to one length, or name it in ragged="
            )
        stacked = np.concatenate(parts) if len(parts) > 1 else parts[0]
        out = np.empty_like(stacked)
        out[order] = stacked
        return out

    def _empty(self, name: str) -> np.ndarray[Any, Any]:
        """A 0-row array for an empty ``ids`` (decodes the first non-empty row group)."""
        first = int(np.searchsorted(self._index.starts, 0, side="right")) - 1
        key = self._index.in_shard(first)
        group = self.cache.get(key)
        if group is None:
            group = self._decode(*key)
            self.cache.put(key, group)
        return group.columns[name][:0].copy()

    def _reader(self, shard: int, local_path: str | None = None) -> Any:
        """The open reader of ``shard`` (kept in the handle LRU): of the local file
        ``local_path`` (checked first, `check_file`), else of its verified cached copy
        (filled if needed), else of the remote file. Local Parquet is read without
        pre-buffering (it only coalesces remote reads and costs ~100 us locally), the file
        mapped from `PARQUET_MAP_MIN_BYTES`; local Arrow IPC is always mapped."""
        files = self.files
        if local_path is not None:
            files.check_file(shard, local_path)
        reader = files.local().handles.get(shard)
        if reader is not None:
            return reader
        entry = self.manifest.shards[shard]
        is_parquet = entry.format is Format.PARQUET
        if local_path is not None and is_parquet:
            mapped = files.sizes[shard] >= PARQUET_MAP_MIN_BYTES
            reader = pq.ParquetFile(local_path, memory_map=mapped, pre_buffer=False)
        elif local_path is not None:
            reader = ipc.open_file(pa.memory_map(local_path))
        elif files.uses_shard_cache():  # a local copy: nothing to coalesce
            source, _ = files.open_copy(shard, _map_copy)
            reader = (
                pq.ParquetFile(source, pre_buffer=False) if is_parquet else ipc.open_file(source)
            )
        else:
            fs, root = files.filesystem()
            source = fs.open(join(root, entry.path), "rb")
            reader = pq.ParquetFile(source) if is_parquet else ipc.open_file(source)
        files.keep(shard, reader)
        return reader

    def _read_arrays(self, shard: int, group: int, reader: Any) -> dict[str, Any]:
        if self.manifest.shards[shard].format is Format.PARQUET:
            table = reader.read_row_group(group, columns=list(self.columns), use_threads=False)
            return {n: one_chunk(table.column(n)) for n in self.columns}
        batch = reader.get_batch(group)
        return {n: batch.column(n) for n in self.columns}

    def _decode(self, shard: int, group: int) -> Group:
        entry, files = self.manifest.shards[shard], self.files
        with self._io_lock.get(threading.Lock):
            fs, root = files.filesystem()
            if isinstance(fs, LocalFileSystem):
                reader = self._reader(shard, join(root, entry.path))  # checks the file
                arrays = self._read_arrays(shard, group, reader)
            elif files.uses_shard_cache():
                files.refresh_copies((shard,))
                files.check_file(shard, files.copy_path(shard))
                arrays = self._read_arrays(shard, group, self._reader(shard))
            else:

                def attempt(_timeout: float | None) -> dict[str, Any]:
                    try:
                        return self._read_arrays(shard, group, self._reader(shard))
                    except Exception:
                        files.forget(shard)  # re-open on the next attempt
                        raise

                arrays = self.storage.retry.run(
                    attempt,
                    what=f"row group {group} read",
                    shard=entry.path,
                    url=self.manifest.url(entry),
                )
        expected = (entry.row_groups or ())[group]
        columns: Columns = {}
        for name, array in arrays.items():
            if len(array) != expected:
                raise FormatError(
                    f"shard {entry.path} row group {group}: {len(array)} rows, the "
                    f"manifest says {expected}; hint: rebuild the manifest"
                )
            where = f"shard {entry.path} row group {group} column {name!r}"
            columns[name] = to_numpy(array, where, ragged=name in self.ragged)
        nbytes = sum(
            int(arrays[n].nbytes) if c.dtype == object else int(c.nbytes)
            for n, c in columns.items()
        )
        return Group(columns, nbytes)


def _map_copy(path: str) -> tuple[pa.MemoryMappedFile, int]:
    """A memory map of the cached copy at ``path`` (it maps the inode, even if the copy is
    evicted later) and that inode (`ShardFiles.open_copy`)."""
    return pa.memory_map(path), os.stat(path).st_ino


def _check_table_shards(manifest: Manifest) -> None:
    """`_check_table_shard` of the first shard that fails it (found from the columns)."""
    values, codes = manifest.codes("format")
    table = np.array(
        [Format(v) in TABLE_FORMATS and Format(v) is not Format.ARROW_STREAM for v in values],
        dtype=bool,
    )
    counts, sizes = manifest.row_groups_per_shard()
    ends = np.concatenate([[0], np.cumsum(np.maximum(counts, 0))])
    total = np.concatenate([[0], np.cumsum(sizes)])
    rows = total[ends[1:]] - total[ends[:-1]]
    bad = (codes < 0) | ~table[codes] | (counts < 0) | (rows != manifest.samples_per_shard())
    for index in np.flatnonzero(bad)[:1].tolist():
        _check_table_shard(manifest.shards[index])


def _check_table_shard(shard: ShardEntry) -> None:
    if shard.format is Format.ARROW_STREAM:
        raise FormatError(
            f"shard {shard.path}: format 'arrow_stream' (an Arrow IPC stream, such as a "
            "Hugging Face datasets cache file) has no index of its record batches, so "
            "TableRows cannot read its rows at random; hint: read a token-list column with "
            "Documents(manifest, column=...) (and PackedWindows), or convert the shard to "
            "an Arrow IPC file (pyarrow.ipc.new_file) or Parquet and rebuild the manifest"
        )
    if shard.format not in TABLE_FORMATS:
        raise FormatError(
            f"shard {shard.path}: format {shard.format.value!r} is not a table "
            "format (parquet, arrow); hint: use TokenWindows for token shards"
        )
    if shard.row_groups is None or sum(shard.row_groups) != shard.num_samples:
        raise FormatError(
            f"shard {shard.path}: row_groups {shard.row_groups} do not add up to "
            f"{shard.num_samples} rows; hint: rebuild the manifest"
        )


def _select_columns(
    schema: pa.Schema, columns: Sequence[str] | None, shard: str
) -> tuple[str, ...]:
    if columns is None:
        return tuple(schema.names)
    if isinstance(columns, str):
        raise ConfigError(
            f"columns must be a sequence of names, got the string {columns!r}; "
            f"hint: columns=[{columns!r}]"
        )
    chosen = tuple(columns)
    missing = [c for c in chosen if c not in schema.names]
    if missing or not chosen or len(set(chosen)) != len(chosen):
        raise ConfigError(
            f"columns {list(chosen)}: unknown {missing} or empty/duplicated; "
            f"shard {shard} has columns {schema.names}"
        )
    return chosen


def _check_ragged(
    schema: pa.Schema, columns: tuple[str, ...], ragged: Sequence[str]
) -> tuple[str, ...]:
    names = (ragged,) if isinstance(ragged, str) else tuple(ragged)
    for name in names:
        kind = schema.field(name).type if name in columns else None  # columns: in the schema
        if kind is None or not (pa.types.is_list(kind) or pa.types.is_large_list(kind)):
            raise ConfigError(
                f"ragged names {name!r}, which is not a selected list column; "
                f"selected columns: {list(columns)}"
            )
    return names


def _schema_diff(a: pa.Schema, b: pa.Schema) -> str:
    """Human-readable list of fields that differ between two schemas."""
    out = []
    for name in dict.fromkeys([*a.names, *b.names]):
        fa = a.field(name) if name in a.names else None
        fb = b.field(name) if name in b.names else None
        if fa is None or fb is None:
            out.append(f"{name!r} only in the {'first' if fb is None else 'second'}")
        elif (fa.type, fa.nullable) != (fb.type, fb.nullable):
            out.append(
                f"{name!r}: {fa.type}{'' if fa.nullable else ' not null'} vs "
                f"{fb.type}{'' if fb.nullable else ' not null'}"
            )
    if not out and a.names != b.names:
        out.append(f"column order {a.names} vs {b.names}")
    return "; ".join(out) or "none found (fingerprints differ)"
