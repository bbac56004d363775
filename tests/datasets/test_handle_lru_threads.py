"""`HandleLRU` / `ProcessHandles` under reader threads (detdata.datasets.handles).

References are the invariants stated in the docstrings, checked on a private budget:
every held handle has its entry in the budget's order, no dead owner's entry survives a
put, and a put never raises while another thread reads.
"""

from __future__ import annotations

import gc
import sys
import threading
import time
from collections.abc import Iterator

import pytest

from detdata.datasets.handles import HandleLRU, ProcessHandles


@pytest.fixture
def fast_switching() -> Iterator[None]:
    """Switch threads every microsecond: widens every race window."""
    before = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    try:
        yield
    finally:
        sys.setswitchinterval(before)


def test_get_in_a_thread_never_breaks_a_put_that_purges_dead_owners(
    fast_switching: None,
) -> None:
    budget = ProcessHandles(8192)
    live: HandleLRU[object] = HandleLRU(8192, budget=budget)
    for s in range(3000):
        live.put(s, object())
    stop = threading.Event()

    def reader() -> None:
        i = 0
        while not stop.is_set():
            live.get(i % 3000)  # moves budget entries
            i += 1

    thread = threading.Thread(target=reader)
    thread.start()
    errors: list[BaseException] = []
    began = time.monotonic()
    try:
        for k in range(150):
            gone: HandleLRU[object] = HandleLRU(8192, budget=budget)
            gone.put(0, object())
            del gone  # a dead owner: the next put purges its entries from the order
            gc.collect(0)
            try:
                live.put(5000 + k, object())
            except RuntimeError as exc:
                errors.append(exc)
            if time.monotonic() - began > 2.0:
                break
    finally:
        stop.set()
        thread.join(10)
    assert errors == []
    # every handle held is in the budget's order, and only live owners' entries are there
    shards = live.keys()
    held = {(live._token, s) for s in shards}
    assert held == set(budget.order)
    assert len(budget) <= budget.capacity


def test_a_late_forget_of_an_eviction_keeps_the_record_of_a_reopened_handle() -> None:
    """Thread A's put evicts shard 0; thread B then reopens shard 0 (its record, its put).
    A's forget of the eviction must not delete B's fresh record."""
    budget = ProcessHandles(1)
    records: dict[int, str] = {}
    in_forget, b_done = threading.Event(), threading.Event()

    def forget(shard: int) -> None:
        if shard == 0 and not in_forget.is_set():
            in_forget.set()
            b_done.wait(0.5)  # before the fix B completes here, while A is outside the lock
        records.pop(shard, None)

    lru: HandleLRU[str] = HandleLRU(1, budget=budget, forget=forget)
    records[0] = "first"
    lru.put(0, "first")

    def reopen() -> None:
        in_forget.wait(10)
        with lru._budget.lock:  # B starts once A's put has let the lock go
            pass
        records[0] = "second"  # as ShardFiles.open_copy, before the put
        lru.put(0, "second")
        b_done.set()

    thread = threading.Thread(target=reopen)
    thread.start()
    records[1] = "one"
    lru.put(1, "one")  # evicts shard 0 (capacity 1)
    thread.join(10)
    assert lru.get(0) == "second"
    assert records.get(0) == "second"
