"""Bounded open shard handles: per dataset (`HandleLRU`) and per process (`ProcessHandles`,
bounded by `set_max_open_shards`). The least recently used handle is dropped to make room
and re-opened on its next use; the bounds never change the bytes read.
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
    """The process-wide budget of open shard handles, shared by every `HandleLRU` given it:
    ``(owner, shard)`` pairs, least recently used first, at most `capacity`; a put over it
    evicts the least recently used handle of *any* owner. Owners are held weakly (a dead
    one's entries are purged at the next put); a forked child starts empty (`after_fork`).
    """

    def __init__(self, bound: int = DEFAULT_MAX_OPEN_SHARDS) -> None:
        self.bound = check_positive_int(bound, "max_open_shards")
        self._capacity = self.bound
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
    """Bound the shards with an open handle in this process, over all datasets together:
    the budget is ``max(bound, the largest max_open_shards of a live dataset)`` (None: the
    default, `DEFAULT_MAX_OPEN_SHARDS`). Lowering it evicts at once. Per process: a worker
    starts with the default unless it calls this (e.g. in ``worker_init_fn``). Never
    changes the bytes read.
    """
    PROCESS_HANDLES.set_bound(DEFAULT_MAX_OPEN_SHARDS if bound is None else bound)


class HandleLRU(Generic[H]):
    """At most ``capacity`` open handles keyed by shard, least recently used evicted first;
    all owners of ``budget`` (`ProcessHandles`) together also stay within it (a put may
    evict another owner's handle: its ``forget(shard)`` runs). A dropped handle is
    only unreferenced, closed when its last user lets it go, so an eviction never breaks a
    read in progress. Thread-safe: order changes and ``forget`` run under the budget's
    lock, so a late forget never drops the record of a handle reopened meanwhile.
    """

    def __init__(
        self,
        capacity: int,
        *,
        budget: ProcessHandles,
        forget: Callable[[int], object] | None = None,
    ) -> None:
        self.capacity = capacity
        self.evictions = 0
        self._items: OrderedDict[int, H] = OrderedDict()
        self._budget = budget
        self._forget = forget
        self._token = budget.register(self)

    def __len__(self) -> int:
        return len(self._items)

    @property
    def full(self) -> bool:
        """Would a new handle evict another (this LRU's, or any owner's)?"""
        return len(self._items) >= self.capacity or self._budget.full

    def keys(self) -> list[int]:
        """Shards with an open handle, least recently used first."""
        with self._budget.lock:  # made anew in a forked child
            return list(self._items)

    def get(self, shard: int) -> H | None:
        """The handle of ``shard`` (now the most recently used), or None."""
        handle = self._items.get(shard)
        if handle is None:
            return None
        # under the lock: a put/purge iterating the budget's order must not see it move
        with self._budget.lock:
            try:
                self._items.move_to_end(shard)
                self._budget.order.move_to_end((self._token, shard))
            except KeyError:  # evicted by another thread meanwhile: still valid for this read
                pass
        return handle

    def put(self, shard: int, handle: H) -> list[int]:
        """Hold ``handle`` for ``shard`` as the most recently used; returns the shards whose
        handles were evicted to stay within ``capacity`` (and the budget)."""
        evicted: list[int] = []
        budget = self._budget
        with self._budget.lock:
            self._items[shard] = handle
            self._items.move_to_end(shard)
            budget._purge_locked()
            budget.order[(self._token, shard)] = None
            budget.order.move_to_end((self._token, shard))
            while len(self._items) > self.capacity:
                old = self._items.popitem(last=False)[0]
                evicted.append(old)
                budget.order.pop((self._token, old), None)
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
        with self._budget.lock:
            self._budget.order.pop((self._token, shard), None)
            return self._items.pop(shard, None)

    # the budget's side (called under its lock) ------------------------------------------
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
