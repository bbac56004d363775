"""The row groups of a `TableRows`: where each row is (`GroupIndex`) and the per-process
cache of decoded row groups (`GroupSlots`, sized by `auto_cache_row_groups`)."""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from detdata.base.types import IntArray
from detdata.identity.manifest import Manifest
from detdata.order.choice import LocalityOrder, LocalityUnit, OrderChoice

Columns = dict[str, np.ndarray[Any, Any]]


@dataclass(frozen=True)
class GroupIndex:
    """The row groups of a table manifest, numbered shard after shard (global groups):
    ``starts`` (the first row id of each), ``shard`` (its shard), ``shard_first`` (the
    first global group of each shard), ``per_shard`` (groups per shard) and ``max_rows``
    (rows of the largest group)."""

    starts: IntArray
    shard: IntArray
    shard_first: IntArray
    per_shard: list[int]
    max_rows: int

    @classmethod
    def of(cls, manifest: Manifest) -> GroupIndex:
        """From the manifest's columns (mapped for the fast form): no per-shard Python, no
        entry built, no file read."""
        counts, flat = manifest.row_groups_per_shard()
        counts = np.maximum(counts, 0)  # every shard has row groups (checked by its reader)
        first = np.concatenate([[0], np.cumsum(counts)[:-1]])
        return cls(
            starts=np.concatenate([[0], np.cumsum(flat)[:-1]]).astype(np.int64),
            shard=np.repeat(np.arange(counts.shape[0], dtype=np.int64), counts),
            shard_first=first.astype(np.int64),
            per_shard=counts.tolist(),
            max_rows=int(flat.max()) if flat.size else 0,
        )

    def in_shard(self, group: int) -> tuple[int, int]:
        """``(shard, row group in shard)`` of global row group ``group``."""
        shard = int(self.shard[group])
        return shard, group - int(self.shard_first[shard])


def auto_cache_row_groups(choice: OrderChoice | None, groups_per_shard: Sequence[int]) -> int:
    """The row groups a `TableRows` with the default ``cache_row_groups`` caches when read
    in ``choice`` (None: as if shuffled globally): every row group for a global shuffle,
    ``2k`` for ``window_row_groups=k`` (a read may cross into the next window), twice the
    row groups of the ``k`` largest shards for ``window_shards=k``; capped at all row
    groups (docs/design.md, section 2)."""
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
    model: `tests/datasets/lru_model.py`) keyed ``(shard, row group in shard)``.

    At most ``max_groups`` groups (0: no caching) and ``max_bytes`` bytes (``nbytes``);
    ``put`` evicts least recently used groups until both hold; a group charged more than
    ``max_bytes`` is not kept. With ``whole_if_fits`` the count bound is raised to every
    row group once the first group shows that they all fit ``max_bytes``.

    When every row group fits both bounds, groups are copied into slots of one array per
    column (``rows_per_slot`` rows each, the largest group's), so a batch of cached groups
    is one ``take`` per column (`gather`); a slotted group is charged the slot's bytes (8
    a row for object columns) plus the Arrow bytes of its string/ragged values, and the
    slot arrays grow by doubling within ``max_bytes`` (``pool_bytes``). Otherwise, or once
    a group does not match the slot layout (the slots are then given up), groups keep
    their own arrays and bytes. Slots are reused: a `Group` from ``get`` is valid until
    the next ``put``. Thread-safe (one lock).
    """

    def __init__(
        self, max_groups: int, max_bytes: int, index: GroupIndex, *, whole_if_fits: bool = False
    ) -> None:
        self.max_groups = max_groups
        self.whole_if_fits = whole_if_fits
        self.max_bytes = max_bytes
        self.nbytes = 0
        self.rows_per_slot = index.max_rows
        self._index = index
        total = int(index.shard.size)
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
        self._reserve = 0  # groups a read is about to insert (`reserve`)
        self._lock = threading.Lock()

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
            return [self._index.in_shard(g) for g in self._entries]

    def get(self, key: tuple[int, int]) -> Group | None:
        """The cached group (marked most recently used), or None."""
        with self._lock:
            return self._use(self._global(key))

    def put(self, key: tuple[int, int], item: Group) -> None:
        """Cache ``item`` as the most recently used group, evicting LRU groups to fit."""
        self.insert(self._global(key), item)

    def insert(self, g: int, item: Group) -> None:
        """`put` by global row group index."""
        if self.max_groups == 0:
            return
        rows = len(next(iter(item.columns.values()))) if item.columns else 0
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
            self._touch(g)

    def reserve(self, groups: int) -> None:
        """A read is about to `insert` up to ``groups`` groups: the next growth of the slot
        arrays makes room for them at once (within the bounds)."""
        with self._lock:
            self._reserve = max(0, int(groups))

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
        when inserting them cannot evict (slots and fixed-width columns only); else None.
        Inserting them, then a `gather`, leaves the cache as a visit in that order would."""
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
            found = self._use(group)
            return None if found is None else {n: c[rows] for n, c in found.columns.items()}

    def _use(self, g: int) -> Group | None:
        """Cached group ``g`` (a slot's as views), marked most recently used; or None."""
        entry = self._entries.get(g)
        if entry is None:
            return None
        self._touch(g)
        if entry.group is not None:
            return entry.group
        a = entry.slot * self.rows_per_slot
        return Group({n: col[a : a + entry.rows] for n, col in self._pool.items()}, entry.nbytes)

    def _global(self, key: tuple[int, int]) -> int:
        return int(self._index.shard_first[key[0]]) + int(key[1])

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
            total = int(self._index.shard.size)
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
        """Drop the slots: each slotted group gets its own arrays, charged their own bytes."""
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
            wanted = max(4, 2 * self._slots, self._slots + self._reserve)
            grown = min(self._max_slots, wanted)
            self._reserve = 0
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
