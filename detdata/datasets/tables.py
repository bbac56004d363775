"""Rows of Parquet / Arrow IPC shards as samples.

A `TableRows` dataset numbers the rows of every shard of a manifest in path
order. ``read(ids)`` maps ids to ``(row group, row in group)`` with one
``np.searchsorted`` over the manifest's row-group sizes. When the per-process
cache (`GroupSlots`) holds every needed row group in its slots, the batch is one
``take`` per column, rows already in the requested order. Otherwise the ids are
grouped by row group (`stable_groups`) so that each needed row group is visited once,
in order of first use: it is decoded (selected
columns only) or taken from the cache, the wanted rows are gathered with a numpy
fancy index, and scattered back into the requested order.

Shuffled reads touch row groups all over the dataset: a 64-row batch over 128 row
groups needs ~50 of them. Unless the cache holds the working set (for a global
shuffle: every row group; ``cache_row_groups`` and ``row_group_cache_bytes`` large enough),
nearly every batch decodes most of its row groups (milliseconds each for Parquet).
With a cache that small, prefer small row groups or Arrow IPC shards (memory-mapped,
no decode), or read in row-group windows (``LocalityOrder(window_row_groups=k)``): a
stretch of positions then needs only ``k`` row groups, and the default cache count,
chosen from the announced order (`auto_cache_row_groups`, `TableRows.use_order`), holds
them. A read visits its row groups in order of first use (not group order), so the
last window's groups are the most recently used when the next read continues there.

Columns become numpy arrays: primitive columns 1-D; fixed-size lists and lists
whose rows all have one length 2-D ``(rows, length)`` (flattened values +
reshape, no per-row Python); strings/binary 1-D object arrays; timestamps, dates
and durations ``datetime64`` / ``timedelta64`` in the column's unit. Lists of
varying length are a `FormatError` unless the column is named in ``ragged`` (then
an object array of 1-D arrays, a slow path). Nothing returned aliases the cache:
gathers copy, and the rows of ragged columns (cached as read-only views) are
copied for each batch. ``schema()`` says what each column holds; detdata's
default collate turns each kind into torch objects (`detdata.datasets.columns`).

Remote roots: reads of a row group retry with backoff under ``retry`` (a
`RetryPolicy`; a failed attempt re-opens the shard). With ``cache_dir``, whole
shards are copied into a bounded, blake3-verified local `ShardCache` first and
read with the local (memory-mapped) readers (`detdata.datasets.shards.ShardReader`).
"""

from __future__ import annotations

import os
import threading
import warnings
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Final

import numpy as np
import numpy.typing as npt
from fsspec.implementations.local import LocalFileSystem

from detdata.base.checks import check_positive_int
from detdata.base.errors import ConfigError, FormatError
from detdata.base.groupby import stable_groups
from detdata.base.lazy import lazy_module
from detdata.base.types import Batch, IntArray
from detdata.datasets.base import check_ids
from detdata.datasets.columns import describe_column, describe_dtype
from detdata.datasets.shards import ShardReader, renamed_argument
from detdata.identity.entry import ShardEntry, Verify
from detdata.identity.formats import TABLE_FORMATS, Format
from detdata.identity.manifest import Manifest
from detdata.order.choice import LocalityOrder, LocalityUnit, OrderChoice
from detdata.storage.fs import filesystem, join
from detdata.storage.retry import RetryPolicy

if TYPE_CHECKING:
    import pyarrow as pa
    import pyarrow.ipc as ipc
    import pyarrow.parquet as pq
else:  # imported where a table is first read (base/lazy.py)
    pa = lazy_module("pyarrow", install="pyarrow>=15")
    ipc = lazy_module("pyarrow.ipc", install="pyarrow>=15")
    pq = lazy_module("pyarrow.parquet", install="pyarrow>=15")

Columns = dict[str, np.ndarray[Any, Any]]

#: Default bound of the in-memory cache of decoded row groups (``row_group_cache_bytes``).
DEFAULT_ROW_GROUP_CACHE_BYTES: Final = 1 << 30
#: Local Parquet shards of at least this many bytes are memory-mapped; smaller ones are
#: read with ``pread`` (measured: a map + unmap costs more than it saves below ~256 KiB).
PARQUET_MAP_MIN_BYTES: Final = 256 << 10


def auto_cache_row_groups(choice: OrderChoice | None, groups_per_shard: Sequence[int]) -> int:
    """The row groups a `TableRows` with the default ``cache_row_groups`` (None) caches when
    read in ``choice`` (None: not told, read as if shuffled globally), unless the whole
    decoded manifest fits ``row_group_cache_bytes``: then every row group, whatever the
    order (`GroupSlots` ``whole_if_fits``; later epochs decode nothing).

    * A global shuffle (`Order.FEISTEL_V1`, or no order): every row group of the manifest,
      the working set of a shuffled epoch (``row_group_cache_bytes`` still bounds the bytes:
      a dataset larger than that bound is re-decoded whatever the count).
    * ``LocalityOrder(window_row_groups=k)``: ``2k`` (capped at all row groups). A stretch of
      positions reads the ``k`` groups of one window, and a read that crosses into the next
      window also needs that window's ``k``: with ``2k`` cached, each row group is decoded
      once per window it lies in, i.e. once per epoch.
    * ``LocalityOrder(window_shards=k)``: twice the row groups of the ``k`` shards with the
      most row groups (a window's shards, and the next window's, whichever they are).
    """
    total = sum(groups_per_shard)
    if not isinstance(choice, LocalityOrder):
        return total
    if choice.unit is LocalityUnit.ROW_GROUPS:
        return min(total, 2 * choice.window)
    largest = sorted(groups_per_shard, reverse=True)[: choice.window]
    return min(total, 2 * sum(largest))


@dataclass(frozen=True)
class Group:
    """A decoded row group: one numpy array per selected column, and its size in bytes."""

    columns: Columns
    nbytes: int


@dataclass(slots=True)
class _Entry:
    """A cached group: its slot (``-1``: kept as its own arrays in ``group``), rows and charge."""

    slot: int
    rows: int
    nbytes: int
    group: Group | None


class GroupSlots:
    """The per-process cache of decoded row groups of a `TableRows`: a bounded LRU (the
    contract of the plain LRU model in `tests/datasets/lru_model.py`) whose groups live in
    slots of shared column arrays.

    Bounds, as for a plain LRU: at most ``max_groups`` groups and ``max_bytes``
    bytes (``nbytes``, the sum of the groups' charges); ``put`` evicts least recently
    used groups until both hold; a group charged more than ``max_bytes`` is not kept;
    ``max_groups == 0`` disables caching. Keys are ``(shard, row group in shard)``.
    With ``whole_if_fits`` (a `TableRows` with the default ``cache_row_groups``), the
    count bound is raised to every row group of the manifest when the first group shows
    that they all fit ``max_bytes`` at the slot charge below.

    Storage: when every row group of the manifest fits both bounds (at the slot charge
    below: the dataset can be cached whole, the working set of shuffled reads), groups
    are copied into slots of one array per column, ``rows_per_slot`` rows (the largest
    row group of the manifest) per slot, so a batch whose groups are all cached is ONE
    ``take`` per column (`gather`), rows already in the requested order. A group in a
    slot is charged the slot's bytes (``rows_per_slot`` rows even when the group is
    shorter; 8 bytes a row for object columns) plus the Arrow bytes of its string/ragged
    values. The slot arrays grow by doubling up to one slot per row group of the
    manifest, which fits in ``max_bytes`` (``pool_bytes``; it can be up to twice the
    slot bytes of the groups cached so far, never above ``max_bytes``). Otherwise (a
    smaller cache: most of a shuffled batch's groups must be decoded anyway, and a copy
    would only add to that), and for a group whose columns do not match the slot layout
    (a list column of another width; the slots are then given up), groups are kept as
    their own arrays, charged their own bytes, as a plain LRU does. Slots of evicted
    groups are reused, so a `Group` from ``get`` is only valid until the next ``put``.
    Thread-safe: gathers and slot changes hold one lock.
    """

    def __init__(
        self,
        max_groups: int,
        max_bytes: int,
        *,
        group_shard: IntArray,
        shard_first_group: IntArray,
        rows_per_slot: int,
        whole_if_fits: bool = False,
    ) -> None:
        self.max_groups = max_groups
        self.whole_if_fits = whole_if_fits
        self.max_bytes = max_bytes
        self.nbytes = 0
        self.rows_per_slot = rows_per_slot
        self._group_shard = group_shard
        self._first = shard_first_group
        total = int(group_shard.size)
        self._total = max(total, 1)
        self._entries: OrderedDict[int, _Entry] = OrderedDict()  # LRU first, unless _dirty
        self._stamp = np.full(total, -1, dtype=np.int64)  # last use: tick * total + group
        self._dirty = False  # slot gathers set stamps only; the order is rebuilt when needed
        self._slot_of = np.full(total, -1, dtype=np.int64)
        self._tick = 0
        self._layout: dict[str, tuple[np.dtype[Any], tuple[int, ...]]] | None = None
        self._slot_bytes = 0
        self._max_slots = 0
        self._pool: dict[str, np.ndarray[Any, Any]] = {}
        self._slots = 0  # allocated
        self._free: list[int] = []
        self._lock = threading.Lock()

    # the plain-LRU interface -------------------------------------------
    def __len__(self) -> int:
        return len(self._entries)

    @property
    def pool_bytes(self) -> int:
        """Bytes of the slot arrays allocated so far (0 without slots; ``<= max_bytes``)."""
        return self._slots * self._slot_bytes

    def keys(self) -> list[tuple[int, int]]:
        """Cached (shard, group) keys, least recently used first."""
        with self._lock:
            self._order()
            return [self._key(g) for g in self._entries]

    def get(self, key: tuple[int, int]) -> Group | None:
        """The cached group (marked most recently used), or None."""
        g = self._global(key)
        with self._lock:
            entry = self._entries.get(g)
            if entry is None:
                return None
            self._touch(g)
            if entry.group is not None:
                return entry.group
            a = entry.slot * self.rows_per_slot
            return Group(
                {n: col[a : a + entry.rows] for n, col in self._pool.items()}, entry.nbytes
            )

    def put(self, key: tuple[int, int], item: Group) -> None:
        """Cache ``item`` as the most recently used group, evicting LRU groups to fit."""
        self.insert(self._global(key), item)

    def insert(self, g: int, item: Group) -> None:
        """`put` by global row group index."""
        if self.max_groups == 0:
            return
        rows = _rows(item)
        with self._lock:
            pooled = (self._max_slots > 0 or self._layout is None) and self._fits(item, rows)
            charge = item.nbytes
            if pooled:
                fixed = sum(int(c.nbytes) for c in item.columns.values() if c.dtype != object)
                charge = self._slot_bytes + item.nbytes - fixed
            if charge > self.max_bytes:
                return
            entries = self._entries
            old = entries.pop(g, None)
            if old is not None:
                self._forget(g, old)
            if len(entries) >= self.max_groups or self.nbytes + charge > self.max_bytes:
                self._order()
                while entries and (
                    len(entries) >= self.max_groups or self.nbytes + charge > self.max_bytes
                ):
                    self._forget(*entries.popitem(last=False))  # least recently used first
            entry = _Entry(-1, rows, charge, item)
            if pooled:
                entry = _Entry(self._alloc_slot(), rows, charge, None)
                a = entry.slot * self.rows_per_slot
                for name, col in self._pool.items():
                    col[a : a + rows] = item.columns[name]
                self._slot_of[g] = entry.slot
            entries[g] = entry  # the most recently used
            self.nbytes += charge
            self._stamp[g] = self._tick * self._total + g
            self._tick += 1

    # batch reads --------------------------------------------------------------
    def gather(
        self, groups: IntArray, rows: IntArray, columns: Sequence[str]
    ) -> dict[str, np.ndarray[Any, Any]] | None:
        """Rows ``rows`` of global row groups ``groups`` (non-empty), one ``take`` per column,
        in the given order; None (nothing touched) unless every group is in a slot."""
        with self._lock:
            if not self._pool:
                return None
            slots = self._slot_of[groups]
            if int(slots.min()) < 0:
                return None
            # LRU: the groups of a batch are used in order of first use (as `TableRows.read`)
            used, first = np.unique(groups, return_index=True)
            rank = np.empty(used.size, dtype=np.int64)
            rank[first.argsort(kind="stable")] = np.arange(used.size, dtype=np.int64)
            self._stamp[used] = self._tick * self._total + rank
            self._tick += 1
            self._dirty = True
            index = slots * self.rows_per_slot + rows
            return {name: self._pool[name].take(index, axis=0) for name in columns}

    def missing(self, groups: IntArray) -> IntArray | None:
        """The global row groups of ``groups`` (non-empty) not cached, in order of first use,
        when caching them cannot evict any group: the groups sit in slots and every column
        has a fixed width (each group is then charged the slot's bytes, and the manifest's
        row groups all fit both bounds at that charge); None otherwise (no slots, or object
        columns, whose charge varies). `insert` them, then `gather` the batch: that leaves
        the cache as a visit of ``groups`` in order of first use would (`TableRows.read`)."""
        with self._lock:
            layout = self._layout
            if not self._pool or layout is None or any(d.kind == "O" for d, _ in layout.values()):
                return None
            todo = groups[self._slot_of[groups] < 0]
        if not todo.size:
            return todo
        used, first = np.unique(todo, return_index=True)
        return used[np.argsort(first, kind="stable")]

    def take_rows(self, group: int, rows: IntArray) -> Columns | None:
        """Copies of ``rows`` of one cached global row group (marked used), or None."""
        with self._lock:
            entry = self._entries.get(group)
            if entry is None:
                return None
            self._touch(group)
            if entry.group is not None:
                return {n: c[rows] for n, c in entry.group.columns.items()}
            index = rows + entry.slot * self.rows_per_slot
            return {n: c.take(index, axis=0) for n, c in self._pool.items()}

    # internals (called with the lock held) -------------------------------------
    def _global(self, key: tuple[int, int]) -> int:
        return int(self._first[key[0]]) + int(key[1])

    def _key(self, g: int) -> tuple[int, int]:
        shard = int(self._group_shard[g])
        return shard, g - int(self._first[shard])

    def _touch(self, g: int) -> None:
        self._stamp[g] = self._tick * self._total + g
        self._tick += 1
        if not self._dirty:
            self._entries.move_to_end(g)

    def _order(self) -> None:
        """Put ``_entries`` back in LRU order after slot gathers (which only set stamps)."""
        if self._dirty:
            for g in sorted(self._entries, key=self._stamp.__getitem__):
                self._entries.move_to_end(g)  # in place: callers may hold the dict
            self._dirty = False

    def _fits(self, item: Group, rows: int) -> bool:
        """Does ``item`` go into a slot? The first group fixes the layout and whether slots
        are used at all: only when every row group of the manifest fits both bounds."""
        if self._layout is None:
            layout = {n: (c.dtype, tuple(c.shape[1:])) for n, c in item.columns.items()}
            row_bytes = sum(
                d.itemsize * int(np.prod(shape, dtype=np.int64)) for d, shape in layout.values()
            )
            self._slot_bytes = self.rows_per_slot * row_bytes
            total = int(self._group_shard.size)
            fit = self.max_bytes // self._slot_bytes if self._slot_bytes else total
            if self.whole_if_fits and fit >= total:
                self.max_groups = max(self.max_groups, total)  # the whole manifest fits
            self._max_slots = total if min(self.max_groups, fit) >= total else 0
            self._layout = layout
        if self._max_slots == 0:
            return False
        if (
            rows <= self.rows_per_slot
            and item.columns.keys() == self._layout.keys()
            and all(
                item.columns[n].dtype == d and tuple(item.columns[n].shape[1:]) == shape
                for n, (d, shape) in self._layout.items()
            )
        ):
            return True
        self._unpool()  # e.g. a list column of another width: no slots from now on
        return False

    def _unpool(self) -> None:
        """Turn every group in a slot into its own arrays (charged their own bytes); drop the
        slots."""
        for g, entry in self._entries.items():
            if entry.slot < 0:
                continue
            a = entry.slot * self.rows_per_slot
            columns = {n: col[a : a + entry.rows].copy() for n, col in self._pool.items()}
            fixed = sum(int(c.nbytes) for c in columns.values() if c.dtype != object)
            charge = entry.nbytes - self._slot_bytes + fixed
            self.nbytes += charge - entry.nbytes
            self._entries[g] = _Entry(-1, entry.rows, charge, Group(columns, charge))
            self._slot_of[g] = -1
        self._pool = {}
        self._free = []
        self._slots = 0
        self._max_slots = 0

    def _alloc_slot(self) -> int:
        if not self._free:
            assert self._layout is not None and self._slots < self._max_slots  # bounds imply it
            grown = min(self._max_slots, max(4, 2 * self._slots))
            for name, (dtype, shape) in self._layout.items():
                col = np.empty((grown * self.rows_per_slot, *shape), dtype=dtype)
                old = self._pool.get(name)
                if old is not None:
                    col[: old.shape[0]] = old
                self._pool[name] = col
            self._free = list(range(grown - 1, self._slots - 1, -1))
            self._slots = grown
        return self._free.pop()

    def _forget(self, g: int, entry: _Entry) -> None:
        """Account for ``entry`` (group ``g``) having left ``_entries``; free its slot."""
        self.nbytes -= entry.nbytes
        if entry.slot >= 0:
            self._slot_of[g] = -1
            a = entry.slot * self.rows_per_slot
            for col in self._pool.values():
                if col.dtype == object:
                    col[a : a + self.rows_per_slot] = None  # drop the references
            self._free.append(entry.slot)


def _rows(item: Group) -> int:
    return len(next(iter(item.columns.values()))) if item.columns else 0


class TableRows(ShardReader):
    """Rows of a Parquet / Arrow IPC manifest; ``read(ids)`` -> one array per column.

    All shards must share one schema fingerprint (`FormatError` naming two
    shards and the differing fields otherwise). ``columns`` selects columns
    (default: all, in schema order). Decoded row groups are kept in an LRU per
    process (`GroupSlots`, ``self.cache``) of at most ``cache_row_groups`` groups and
    ``row_group_cache_bytes`` bytes (default 1 GiB, in memory). The default
    ``cache_row_groups=None`` caches every row group when they all fit
    ``row_group_cache_bytes``, and otherwise sizes the count from the order the dataset is
    read in (`auto_cache_row_groups`: every row group for a global shuffle, ``2k`` for
    ``LocalityOrder(window_row_groups=k)``), which a loader or `OrderedStream` announces
    through `use_order`; ``cache_groups`` is that count. When every row group of
    the manifest fits both bounds (each charged the size of the largest row group), cached
    groups sit in slots of one array per column and a batch of cached rows is one gather
    per column; for shuffled reads, size the cache for that (see the module docstring).
    ``ragged`` names list columns to return as object arrays of 1-D arrays
    when their rows differ in length. Pickles carry the manifest and
    parameters only; readers and caches are re-opened lazily per process.

    Remote roots: ``retry`` (a `RetryPolicy`) governs reads; ``cache_dir``
    (with ``shard_cache_bytes``, default 16 GiB, on disk; ``cache_verify="full"`` re-hashes a
    cached copy on open) copies whole shards into a verified local `ShardCache`
    (``shard_cache``). Neither changes the rows read, and no cache bound is part of
    ``identity()``. ``cache_bytes`` is the deprecated name of ``row_group_cache_bytes``
    (it always bounded the decoded row groups in memory, never the disk cache): a
    `DeprecationWarning`; passing both is a `ConfigError`.

    ``max_open_shards`` (default 128) bounds the shards with an open reader of this
    dataset per process (a `HandleLRU`: at most one descriptor and one mapping each, plus
    what cached row groups of an Arrow IPC shard still reference), and all datasets of a
    process together stay within its budget (`detdata.datasets.shards.set_max_open_shards`);
    the least recently used reader is dropped and re-opened on its next use (a Parquet
    footer read). It never changes the rows read and is not part of ``identity()``.
    """

    # pickling: parameters and manifest only, no readers, caches or locks
    _TRANSIENT = (
        *ShardReader._TRANSIENT,
        "_io_lock",
        "cache",
        "_group_starts",
        "_group_shard",
        "_shard_first_group",
        "_max_group_rows",
        "_groups_per_shard",
    )

    def __init__(
        self,
        manifest: Manifest | str,
        columns: Sequence[str] | None = None,
        *,
        cache_row_groups: int | None = None,
        row_group_cache_bytes: int | None = None,
        ragged: Sequence[str] = (),
        verify: str | Verify = Verify.QUICK,
        root: str | None = None,
        storage_options: Mapping[str, Any] | None = None,
        retry: RetryPolicy | None = None,
        cache_dir: str | os.PathLike[str] | None = None,
        shard_cache_bytes: int | None = None,
        cache_verify: str = "quick",
        cache_bytes: int | None = None,
        max_open_shards: int | None = None,
    ) -> None:
        row_bytes = renamed_argument(
            row_group_cache_bytes,
            cache_bytes,
            new="row_group_cache_bytes",
            old="cache_bytes",
            owner="TableRows",
        )
        super().__init__(
            manifest,
            verify=verify,
            root=root,
            storage_options=storage_options,
            retry=retry,
            cache_dir=cache_dir,
            shard_cache_bytes=shard_cache_bytes,
            cache_verify=cache_verify,
            max_open_shards=max_open_shards,
        )
        self.cache_row_groups: int | None = (
            None
            if cache_row_groups is None
            else check_positive_int(cache_row_groups, "cache_row_groups", minimum=0)
        )
        self._order_choice: OrderChoice | None = None  # announced by use_order
        self.row_group_cache_bytes = check_positive_int(
            DEFAULT_ROW_GROUP_CACHE_BYTES if row_bytes is None else row_bytes,
            "row_group_cache_bytes",
            minimum=0,
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
            _check_column_type(schema.field(name), shards[0].path)
        self._types: dict[str, str | None] = {
            n: _arrow_kind(schema.field(n).type, n in self.ragged) for n in self.columns
        }
        self._num = self.manifest.num_samples
        if self._num == 0:
            raise ConfigError(
                f"manifest {self.manifest.id}: {len(shards)} shard(s) with 0 rows; "
                "the dataset is empty"
            )
        self._build_index()
        self._reset_process_state()

    # construction helpers --------------------------------------------------
    def _check_same_schema(self) -> None:
        """Every shard has the first one's schema fingerprint (the manifest's column: no
        entry built); else `FormatError` naming the first that differs and the fields."""
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
        fs, root = filesystem(self.manifest.root or "", **self.storage_options)

        def read(_timeout: float | None) -> pa.Schema:
            with fs.open(join(root, shard.path), "rb") as fh:
                if shard.format is Format.PARQUET:
                    return pq.ParquetFile(fh).schema_arrow
                return ipc.open_file(fh).schema

        if isinstance(fs, LocalFileSystem):
            return read(None)
        return self.retry.run(
            read, what="schema read", shard=shard.path, url=self.manifest.url(shard)
        )

    def _build_index(self) -> None:
        """The row-group tables, from the manifest's columns (mapped for the fast form): no
        per-shard Python, no entry built, no file read."""
        super()._build_index()
        counts, flat = self.manifest.row_groups_per_shard()
        counts = np.maximum(counts, 0)  # every shard has row groups (checked at construction)
        self._group_starts = np.concatenate([[0], np.cumsum(flat)[:-1]]).astype(np.int64)
        self._group_shard = np.repeat(np.arange(counts.shape[0], dtype=np.int64), counts)
        self._groups_per_shard: list[int] = counts.tolist()
        first = np.concatenate([[0], np.cumsum(counts)[:-1]])
        self._shard_first_group = first.astype(np.int64)
        self._max_group_rows = int(flat.max()) if flat.size else 0

    def _reset_process_state(self) -> None:
        super()._reset_process_state()
        self._io_lock = threading.Lock()
        self.cache = GroupSlots(
            self.cache_groups,
            self.row_group_cache_bytes,
            group_shard=self._group_shard,
            shard_first_group=self._shard_first_group,
            rows_per_slot=self._max_group_rows,
            whole_if_fits=self.cache_row_groups is None,
        )

    def _forget_handle(self, shard: int) -> None:
        self._handles.pop(shard)

    @property
    def cache_groups(self) -> int:
        """The bound on cached row groups: ``cache_row_groups``, or with the default (None)
        the count `auto_cache_row_groups` gives for the announced order (raised to every row
        group once the cache finds that they all fit ``row_group_cache_bytes``:
        ``cache.max_groups``)."""
        if self.cache_row_groups is not None:
            return self.cache_row_groups
        return auto_cache_row_groups(self._order_choice, self._groups_per_shard)

    def use_order(self, choice: OrderChoice) -> None:
        """Announce the order this dataset is read in (`OrderedStream` does), so that the
        default ``cache_row_groups`` is sized for it. Changes what is cached, never what is
        read; the order travels with the dataset's pickle to worker processes. An explicit
        ``cache_row_groups`` is kept as given. The last announced order wins."""
        before = self.cache_groups
        self._order_choice = choice
        if self.cache_groups != before:
            self._reset_process_state()  # a new, empty cache with the new bound

    @property
    def cache_bytes(self) -> int:
        """Deprecated name of ``row_group_cache_bytes`` (a `DeprecationWarning`)."""
        warnings.warn(
            "TableRows.cache_bytes is deprecated; use row_group_cache_bytes",
            DeprecationWarning,
            stacklevel=2,
        )
        return self.row_group_cache_bytes

    # Dataset protocol --------------------------------------------------------
    @property
    def num_samples(self) -> int:
        """Total rows over all shards."""
        return self._num

    def __len__(self) -> int:
        """`num_samples` (samples of one epoch), as torch's ``len(dataset)``."""
        return self.num_samples

    @property
    def shard_sizes(self) -> tuple[int, ...]:
        """Rows per shard in manifest order (ids are laid out shard after shard): what a
        `detdata.LocalityOrder` groups into windows of shards."""
        return tuple(self.manifest.samples_per_shard().tolist())

    @property
    def row_group_sizes(self) -> tuple[int, ...]:
        """Rows per row group, shard after shard in manifest order and groups in file order
        (ids are laid out that way): what ``LocalityOrder(window_row_groups=k)`` groups
        into windows."""
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
        group = np.searchsorted(self._group_starts, arr, side="right").astype(np.int64) - 1
        shard = self._group_shard[group]
        return shard, group - self._shard_first_group[shard], arr - self._group_starts[group]

    def read(self, ids: npt.ArrayLike) -> Batch:
        """One array per selected column, rows in exactly the order of ``ids``.

        When every needed row group is cached, one gather per column from the slot
        arrays; otherwise each needed row group is decoded (or taken from the
        cache) once per call, in order of first use. Every array returned (and every row
        of a ragged column) is new memory owned by the batch: editing it never
        changes what a later read returns.
        """
        arr = check_ids(ids, self._num, self._what())
        if self._pid != os.getpid():
            self._reset_process_state()
        if arr.size == 0:
            return {name: self._empty(name) for name in self.columns}
        if self.cache.pool_bytes:
            group = self._group_starts.searchsorted(arr, "right") - 1
            in_group = arr - self._group_starts[group]
            fast = self.cache.gather(group, in_group, self.columns)
            if fast is not None:
                return self._own(fast)
            # slots that cannot evict: decode the missing groups into them, then one gather
            # (no per-group copies of the cached ones); the cache ends as after the visit below
            todo = self.cache.missing(group)
            if todo is not None:
                for g in todo.tolist():
                    shard = int(self._group_shard[g])
                    decoded = self._decode(shard, g - int(self._shard_first_group[shard]))
                    self.cache.insert(g, decoded)
                fast = self.cache.gather(group, in_group, self.columns)
                if fast is not None:
                    return self._own(fast)
        order, group, spans = stable_groups(self._group_starts.searchsorted(arr, "right") - 1)
        rows = arr[order] - self._group_starts[group]
        parts: list[Columns | None] = [None] * len(spans)
        # visit groups in order of first use in ``ids`` (``order[a]``: the first id of a run),
        # so that the groups of the last stretch of positions are the most recently used
        # when the next read begins (an ordered stream continues there): with a windowed
        # order a cache of one window's groups decodes each group once per window
        for i in sorted(range(len(spans)), key=lambda i: int(order[spans[i][1]])):
            g, a, b = spans[i]
            part = self.cache.take_rows(g, rows[a:b])
            if part is None:
                shard = int(self._group_shard[g])
                decoded = self._decode(shard, g - int(self._shard_first_group[shard]))
                part = {name: decoded.columns[name][rows[a:b]] for name in self.columns}
                self.cache.insert(g, decoded)
            parts[i] = part
        done = [p for p in parts if p is not None]
        return self._own(
            {name: self._assemble(name, [p[name] for p in done], order) for name in self.columns}
        )

    def _own(self, batch: Batch) -> Batch:
        """``batch`` with the rows of ragged columns copied (gathers copy the object arrays
        only: their rows would still be the cached row group's arrays)."""
        for name in self.ragged:
            batch[name] = _copy_rows(batch[name])
        return batch

    def schema(self) -> dict[str, str]:
        """Column -> what `read` delivers in it (`detdata.datasets.columns.describe_column` form).

        ``'int64'``, ``'float32 (3,)'`` (fixed-size lists), ``'datetime64[ms]'``
        (timestamps; dates ``'datetime64[D]'``), ``'timedelta64[us]'``, ``'str'``,
        ``'bytes'``, ``'list<int32>'`` (ragged), ``'time'`` (time of day). From the
        Arrow schema, except the width of a variable-length list column not named in
        ``ragged``, which is read from row 0 (lists of another width in other row
        groups are a `FormatError` when read, see `to_numpy`).
        """
        if any(t is None for t in self._types.values()):
            first = self.read(np.zeros(1, dtype=np.int64))
            self._types = {
                n: describe_column(first[n]) if t is None else t for n, t in self._types.items()
            }
        return {n: str(t) for n, t in self._types.items()}

    # reading -----------------------------------------------------------------
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
        first = int(np.searchsorted(self._group_starts, 0, side="right")) - 1
        return self._group(first).columns[name][:0].copy()

    def _reader(self, shard: int) -> Any:
        """The open reader of ``shard`` (opened on a miss; kept in the handle LRU)."""
        reader = self._handles.get(shard)
        if reader is None:
            fs, root = self._filesystem()
            entry = self.manifest.shards[shard]
            path = join(root, entry.path)
            if self._uses_shard_cache():
                reader = self._open_cached(shard)
            elif isinstance(fs, LocalFileSystem):
                return self._local_reader(shard, path)
            elif entry.format is Format.PARQUET:
                reader = pq.ParquetFile(fs.open(path, "rb"))
            else:
                reader = ipc.open_file(fs.open(path, "rb"))
            self._keep_handle(shard, reader)
        return reader

    def _local_reader(self, shard: int, path: str) -> Any:
        """The open reader of local ``shard`` (file ``path``; opened on a miss, kept in the
        handle LRU), after `_check_file` of ``path`` (the manifest's size, and the file this
        process first opened for the shard), before any open or read.

        Parquet without pre-buffering (it only coalesces reads for remote stores; on a small
        local file it costs ~100 us in pyarrow's I/O threads), memory-mapped from
        `PARQUET_MAP_MIN_BYTES` (below that a map and its unmap cost more than ``pread``
        saves); Arrow IPC always mapped (its batches are zero-copy views of the file)."""
        self._check_file(shard, path)
        reader = self._handles.get(shard)
        if reader is None:
            if self.manifest.shards[shard].format is Format.PARQUET:
                mapped = self._sizes[shard] >= PARQUET_MAP_MIN_BYTES
                reader = pq.ParquetFile(path, memory_map=mapped, pre_buffer=False)
            else:
                reader = ipc.open_file(pa.memory_map(path))
            self._keep_handle(shard, reader)
        return reader

    def _open_cached(self, shard: int) -> Any:
        """A local reader over the verified cached copy of ``shard`` (filled if needed)."""

        def open_path(path: str) -> tuple[pa.MemoryMappedFile, int]:
            source = pa.memory_map(path)  # maps the inode, even if it is evicted later
            return source, os.stat(path).st_ino

        source, _ = self._open_copy(shard, open_path)
        if self.manifest.shards[shard].format is Format.PARQUET:
            return pq.ParquetFile(source, pre_buffer=False)  # a local copy: nothing to coalesce
        return ipc.open_file(source)

    def _group(self, global_group: int) -> Group:
        shard = int(self._group_shard[global_group])
        local = global_group - int(self._shard_first_group[shard])
        key = (shard, local)
        cached = self.cache.get(key)
        if cached is not None:
            return cached
        decoded = self._decode(shard, local)
        self.cache.put(key, decoded)
        return decoded

    def _read_arrays(self, shard: int, group: int, reader: Any = None) -> dict[str, Any]:
        entry = self.manifest.shards[shard]
        if reader is None:
            reader = self._reader(shard)
        if entry.format is Format.PARQUET:
            table = reader.read_row_group(group, columns=list(self.columns), use_threads=False)
            return {n: _one_chunk(table.column(n)) for n in self.columns}
        batch = reader.get_batch(group)
        return {n: batch.column(n) for n in self.columns}

    def _decode(self, shard: int, group: int) -> Group:
        entry = self.manifest.shards[shard]
        with self._io_lock:  # remote readers share one seekable handle per shard
            fs, root = self._filesystem()
            if isinstance(fs, LocalFileSystem):
                reader = self._local_reader(shard, join(root, entry.path))  # checks the file
                arrays = self._read_arrays(shard, group, reader)
            elif self._uses_shard_cache():
                self._refresh_copies((shard,))
                self._check_file(shard, self._copy_files.get(shard, ("", 0))[0])
                arrays = self._read_arrays(shard, group)
            else:

                def attempt(_timeout: float | None) -> dict[str, Any]:
                    try:
                        return self._read_arrays(shard, group)
                    except Exception:
                        self._handles.pop(shard)  # re-open on the next attempt
                        raise

                arrays = self.retry.run(
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


def _one_chunk(column: pa.ChunkedArray) -> pa.Array:
    """The column as one array (no copy when it already is a single chunk)."""
    return column.chunk(0) if column.num_chunks == 1 else column.combine_chunks()


def to_numpy(array: pa.Array, where: str, *, ragged: bool = False) -> np.ndarray[Any, Any]:
    """One column as numpy: 1-D for scalars, 2-D for equal-length lists, object if ``ragged``.

    Numeric columns and list values must have no nulls (`FormatError` naming
    ``where``). Lists of varying length are a `FormatError` unless ``ragged``.
    """
    kind = array.type
    if pa.types.is_fixed_size_list(kind) or pa.types.is_list(kind) or pa.types.is_large_list(kind):
        return _list_to_numpy(array, where, ragged)
    if (
        pa.types.is_string(kind)
        or pa.types.is_large_string(kind)
        or pa.types.is_binary(kind)
        or pa.types.is_large_binary(kind)
    ):
        return np.asarray(array.to_numpy(zero_copy_only=False), dtype=object)
    if array.null_count:
        raise FormatError(
            f"{where}: {array.null_count} null value(s) in a {kind} column; hint: "
            "fill nulls when writing the shards"
        )
    return np.asarray(array.to_numpy(zero_copy_only=False))


def _list_to_numpy(array: pa.Array, where: str, ragged: bool) -> np.ndarray[Any, Any]:
    if array.null_count:
        raise FormatError(
            f"{where}: {array.null_count} null list(s); hint: write empty lists "
            "or pad instead of nulls"
        )
    rows = len(array)
    if pa.types.is_fixed_size_list(array.type):  # one length by type: nothing to compare
        size = int(array.type.list_size)
        values = array.values.slice(array.offset * size, rows * size)
        if values.null_count:
            raise FormatError(f"{where}: {values.null_count} null value(s) inside lists")
        flat = np.asarray(values.to_numpy(zero_copy_only=False))
        if ragged:
            return _object_rows(flat, np.full(rows, size, dtype=np.int64))
        return flat.reshape(rows, size)
    offsets = np.asarray(array.offsets.to_numpy(), dtype=np.int64)
    lengths = np.diff(offsets)
    values = array.values.slice(int(offsets[0]), int(offsets[-1] - offsets[0]))
    if values.null_count:
        raise FormatError(f"{where}: {values.null_count} null value(s) inside lists")
    flat = np.asarray(values.to_numpy(zero_copy_only=False))
    if ragged:
        return _object_rows(flat, lengths)
    if rows and int(lengths.min()) != int(lengths.max()):
        raise FormatError(
            f"{where}: list lengths vary from {int(lengths.min())} to "
            f"{int(lengths.max())}; only equal-length lists become 2-D arrays; hint: "
            "pad/pack to one length, store a fixed_size_list, or name the column in "
            "ragged= to get an object array"
        )
    return flat.reshape(rows, int(lengths[0]) if rows else 0)


def _object_rows(flat: np.ndarray[Any, Any], lengths: IntArray) -> np.ndarray[Any, Any]:
    """Object array of 1-D read-only views (the explicitly requested slow path for ragged
    lists). Read-only: these rows are cached; `TableRows.read` delivers copies."""
    flat.flags.writeable = False
    out = np.empty(len(lengths), dtype=object)
    bounds = np.cumsum(lengths)[:-1]
    for i, part in enumerate(np.split(flat, bounds)):
        out[i] = part
    return out


def _copy_rows(column: np.ndarray[Any, Any]) -> np.ndarray[Any, Any]:
    """A new object array whose rows are copies of ``column``'s (writable, owned by the batch)."""
    out = np.empty(len(column), dtype=object)
    for i, row in enumerate(column.tolist()):
        out[i] = row.copy()
    return out


def _arrow_kind(kind: pa.DataType, ragged: bool) -> str | None:
    """`describe_column` of what `to_numpy` makes of an Arrow type (None: a list width
    that only the data knows)."""
    if pa.types.is_string(kind) or pa.types.is_large_string(kind):
        return "str"
    if pa.types.is_binary(kind) or pa.types.is_large_binary(kind):
        return "bytes"
    if pa.types.is_time(kind):
        return "time"
    if pa.types.is_fixed_size_list(kind):
        return describe_dtype(_numpy_dtype(kind.value_type), (kind.list_size,))
    if pa.types.is_list(kind) or pa.types.is_large_list(kind):
        return f"list<{_numpy_dtype(kind.value_type).name}>" if ragged else None
    return describe_dtype(_numpy_dtype(kind))


def _numpy_dtype(kind: pa.DataType) -> np.dtype[Any]:
    """The dtype `to_numpy` gives a column of Arrow type ``kind`` (converted the same way)."""
    return np.asarray(pa.array([], type=kind).to_numpy(zero_copy_only=False)).dtype


def _check_table_shards(manifest: Manifest) -> None:
    """`_check_table_shard` of every shard, from the manifest's columns (no entry built but
    the first failing one, whose error is raised)."""
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
        raise FormatError(  # pragma: no cover - the entry check names it first
            f"shard {manifest.shards[index].path}: not a readable table shard"
        )


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
        kind = schema.field(name).type if name in schema.names else None
        if (
            name not in columns
            or kind is None
            or not (pa.types.is_list(kind) or pa.types.is_large_list(kind))
        ):
            raise ConfigError(
                f"ragged names {name!r}, which is not a selected list column; "
                f"selected columns: {list(columns)}"
            )
    return names


def _check_column_type(field: pa.Field, shard: str) -> None:
    kind = field.type
    if pa.types.is_fixed_size_list(kind) or pa.types.is_list(kind) or pa.types.is_large_list(kind):
        kind = kind.value_type
        if not (
            pa.types.is_integer(kind) or pa.types.is_floating(kind) or pa.types.is_boolean(kind)
        ):
            raise FormatError(
                f"shard {shard} column {field.name!r}: lists of {kind} are not "
                "supported (only lists of numbers/booleans); hint: drop it via columns="
            )
        return
    if pa.types.is_interval(kind):  # pyarrow's to_numpy crashes the process on intervals
        raise FormatError(
            f"shard {shard} column {field.name!r}: interval type {kind} is not "
            "supported; hint: store it as integer columns (months, days, nanoseconds) "
            "or drop it via columns="
        )
    simple = (
        pa.types.is_integer(kind)
        or pa.types.is_floating(kind)
        or pa.types.is_boolean(kind)
        or pa.types.is_temporal(kind)
        or pa.types.is_string(kind)
        or pa.types.is_large_string(kind)
        or pa.types.is_binary(kind)
        or pa.types.is_large_binary(kind)
    )
    if not simple:
        raise FormatError(
            f"shard {shard} column {field.name!r}: type {kind} is not supported; "
            "hint: select other columns via columns="
        )


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
