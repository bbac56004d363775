"""Bounded open shard handles: per dataset (`HandleLRU`) and per process (`ProcessHandles`).

Open handles of a shard dataset (memory maps, readers; each holds at most one descriptor
and one mapping) live in a `HandleLRU` of at most ``max_open_shards`` (default
`DEFAULT_MAX_OPEN_SHARDS`) shards per dataset, whatever the number of shards read: the
least recently used handle is dropped (closed when its last reference goes) to make room,
and re-opened on its next use. The bound is also process-wide: every reader's LRU shares
this process's `ProcessHandles` budget, so all datasets of a process together (the N
sources of a `detdata.Mixture`, several loaders, reader threads) hold at most
``max(set_max_open_shards bound (default 128), the largest max_open_shards of a live
dataset)`` handles; a put over it evicts the least recently used handle of any dataset. A
forked child starts with no handles (its inherited ones are dropped at the fork). The
bounds never change the bytes read.
"""

from __future__ import annotations

import itertools
import os
import threading
import weakref
from collections import OrderedDict
from collections.abc import Callable
from typing import Any, Final, Generic, TypeVar

from detdata.base.checks import check_positive_int

#: Default bound of the shards with an open handle per process (``max_open_shards``): well
#: under the usual 1,024-descriptor soft limit, with room for a few readers in one process.
DEFAULT_MAX_OPEN_SHARDS: Final = 128

H = TypeVar("H")


class ProcessHandles:
    """The process-wide budget of open shard handles, shared by every `HandleLRU` given it.

    It orders ``(owner, shard)`` pairs of all its owners least recently used first and holds
    at most `capacity` of them: ``max(bound, the largest capacity of a live owner)``, where
    ``bound`` is set with `set_bound` (`set_max_open_shards` for the process's budget). A put
    that goes over it evicts the least recently used handle of *any* owner (the owner's
    ``forget`` callback runs). Owners are held weakly: a dead owner's entries are purged at
    the next put. After a fork the child starts empty (`after_fork`: every owner's handles
    are dropped, the lock made anew), as the per-process file system state does.
    """

    def __init__(self, bound: int = DEFAULT_MAX_OPEN_SHARDS) -> None:
        self.bound = check_positive_int(bound, "max_open_shards")
        self._capacity = self.bound
        self.evictions = 0
        self.lock = threading.Lock()
        self.order: OrderedDict[tuple[int, int], None] = OrderedDict()
        self._owners: dict[int, weakref.ref[HandleLRU[Any]]] = {}
        self._caps: dict[int, int] = {}
        self._dead: list[int] = []  # appended by weakref callbacks (any thread, even mid-put)
        self._tokens = itertools.count()

    def __len__(self) -> int:
        return len(self.order)

    @property
    def capacity(self) -> int:
        """The most handles all owners together hold: ``max(bound, live owners' capacities)``."""
        if self._dead:
            with self.lock:
                self._purge_locked()
        return self._capacity

    @property
    def full(self) -> bool:
        """Would one more handle (of any owner) evict another?"""
        return len(self.order) >= self.capacity

    def register(self, owner: HandleLRU[Any]) -> int:
        """Add ``owner`` (held weakly); returns its token."""
        token = next(self._tokens)
        dead = self._dead
        with self.lock:
            self._owners[token] = weakref.ref(owner, lambda _: dead.append(token))
            self._caps[token] = owner.capacity
            self._resize_locked()
        return token

    def set_bound(self, bound: int) -> None:
        """Change the bound; evicts at once down to the new `capacity`."""
        bound = check_positive_int(bound, "max_open_shards")
        with self.lock:
            self.bound = bound
            self._purge_locked()
            self._resize_locked()
            self._shrink_locked(-1)

    def after_fork(self) -> None:
        """In a forked child: a new lock, no handles (each owner's are dropped), same bound."""
        self.lock = threading.Lock()
        for ref in list(self._owners.values()):
            owner = ref()
            if owner is not None:
                owner._drop_all()
        self.order.clear()

    # under the lock ----------------------------------------------------------------
    def _resize_locked(self) -> None:
        self._capacity = max([self.bound, *self._caps.values()])

    def _purge_locked(self) -> None:
        dead = set()
        while self._dead:
            dead.add(self._dead.pop())
        if not dead:
            return
        for token in dead:
            self._owners.pop(token, None)
            self._caps.pop(token, None)
        for key in [k for k in list(self.order) if k[0] in dead]:  # a snapshot (C-level copy)
            del self.order[key]
        self._resize_locked()

    def _shrink_locked(self, token: int) -> list[int]:
        """Evict down to `capacity`; returns the evicted shards of owner ``token``."""
        mine: list[int] = []
        while len(self.order) > self._capacity:
            (owner_token, shard), _ = self.order.popitem(last=False)
            self.evictions += 1
            if owner_token == token:
                mine.append(shard)
                continue
            ref = self._owners.get(owner_token)
            owner = ref() if ref is not None else None
            if owner is not None:
                owner._evicted(shard)
        return mine


#: This process's budget of open shard handles (all `ShardReader` instances share it).
PROCESS_HANDLES: Final = ProcessHandles()
os.register_at_fork(after_in_child=PROCESS_HANDLES.after_fork)


def set_max_open_shards(bound: int | None) -> None:
    """Bound the shards with an open handle in this process, over all datasets together.

    The process budget is ``max(bound, the largest max_open_shards of a live dataset)``
    (None restores the default, `DEFAULT_MAX_OPEN_SHARDS`), so a dataset's own
    ``max_open_shards`` is always honoured while any number of datasets (the sources of a
    `detdata.Mixture`, several loaders) together hold at most the budget. Lowering it
    evicts at once. Per process: a forked or spawned worker starts with the default
    unless it calls this itself (e.g. in ``worker_init_fn``). Never changes the bytes read.
    """
    PROCESS_HANDLES.set_bound(DEFAULT_MAX_OPEN_SHARDS if bound is None else bound)


def process_max_open_shards() -> int:
    """This process's budget of shards with an open handle (see `set_max_open_shards`)."""
    return PROCESS_HANDLES.capacity


def process_open_shards() -> int:
    """Shards with an open handle in this process, over every dataset (<= the budget)."""
    return len(PROCESS_HANDLES)


class HandleLRU(Generic[H]):
    """At most ``capacity`` open handles keyed by shard index, least recently used evicted first.

    ``get`` marks a handle most recently used; ``put`` adds (or replaces) one and, when
    more than ``capacity`` are held, drops the least recently used ones and returns
    their shards. With a ``budget`` (a `ProcessHandles`; every `ShardReader` uses the
    process's), the handles of all its owners together also stay within the budget's
    capacity: a put may evict another owner's handle (that owner's ``forget(shard)``
    runs, and its `evictions` counts it). A dropped handle is only unreferenced: it is
    closed when its last user (e.g. a reader thread still gathering from it) lets it go,
    so eviction never invalidates a read in progress. Thread-safe: ``get``/``put``/``pop``
    hold the (budget's) lock while they change the order (``get`` once per touched shard
    per read), and ``forget`` runs under it too, so an eviction's late forget can never
    drop the copy record of a handle another thread has reopened meanwhile.
    """

    def __init__(
        self,
        capacity: int,
        *,
        budget: ProcessHandles | None = None,
        forget: Callable[[int], object] | None = None,
    ) -> None:
        self.capacity = capacity
        self.evictions = 0
        self._items: OrderedDict[int, H] = OrderedDict()
        self._budget = budget
        self._forget = forget
        self._lock = threading.Lock() if budget is None else budget.lock
        self._token = -1 if budget is None else budget.register(self)

    def __len__(self) -> int:
        return len(self._items)

    @property
    def full(self) -> bool:
        """Would a new handle evict another (this LRU's, or, with a budget, any owner's)?"""
        if len(self._items) >= self.capacity:
            return True
        return self._budget is not None and self._budget.full

    def keys(self) -> list[int]:
        """Shards with an open handle, least recently used first."""
        with self._lock_now():
            return list(self._items)

    def get(self, shard: int) -> H | None:
        """The handle of ``shard`` (now the most recently used), or None."""
        handle = self._items.get(shard)
        if handle is None:
            return None
        # under the lock: a put/purge iterating the budget's order must not see it move
        with self._lock_now():
            try:
                self._items.move_to_end(shard)
                if self._budget is not None:
                    self._budget.order.move_to_end((self._token, shard))
            except KeyError:  # evicted by another thread meanwhile: still valid for this read
                pass
        return handle

    def put(self, shard: int, handle: H) -> list[int]:
        """Hold ``handle`` for ``shard`` as the most recently used; returns the shards whose
        handles were evicted to stay within ``capacity`` (and the budget)."""
        evicted: list[int] = []
        budget = self._budget
        with self._lock_now():
            self._items[shard] = handle
            self._items.move_to_end(shard)
            if budget is not None:
                budget._purge_locked()
                budget.order[(self._token, shard)] = None
                budget.order.move_to_end((self._token, shard))
            while len(self._items) > self.capacity:
                old = self._items.popitem(last=False)[0]
                evicted.append(old)
                if budget is not None:
                    budget.order.pop((self._token, old), None)
            if budget is not None:
                for old in budget._shrink_locked(self._token):
                    self._items.pop(old, None)
                    evicted.append(old)
            self.evictions += len(evicted)
            # under the lock: a late forget must not drop the record of a handle reopened
            # (and put) by another thread meanwhile
            if self._forget is not None:
                for old in evicted:
                    self._forget(old)
        return evicted

    def pop(self, shard: int) -> H | None:
        """Forget the handle of ``shard`` (not counted as an eviction); returns it, or None."""
        with self._lock_now():
            if self._budget is not None:
                self._budget.order.pop((self._token, shard), None)
            return self._items.pop(shard, None)

    # the budget's side (called under its lock) ------------------------------------------
    def _lock_now(self) -> threading.Lock:
        """The lock to take now (a budget's lock is made anew in a forked child)."""
        return self._lock if self._budget is None else self._budget.lock

    def _evicted(self, shard: int) -> None:
        """Another owner's put evicted ``shard``'s handle from the shared budget."""
        if self._items.pop(shard, None) is not None:
            self.evictions += 1
        if self._forget is not None:
            self._forget(shard)

    def _drop_all(self) -> None:
        """Drop every handle (a forked child must not keep its parent's)."""
        shards = list(self._items)
        self._items.clear()
        if self._forget is not None:
            for shard in shards:
                self._forget(shard)
