"""`detdata.identity.parallel.map_in_threads`: the list comprehension's results, in input order,
from several threads; every item runs even when one fails, and the first failure in input
order (not in time) is raised."""

from __future__ import annotations

import threading
import time

import pytest

from detdata.identity.parallel import map_in_threads


@pytest.mark.parametrize("count", [0, 1, 7, 100, 1001])
@pytest.mark.parametrize("threads", [0, 1, 3])
def test_results_are_the_comprehension_in_input_order(count: int, threads: int) -> None:
    items = [(i * 7919) % 1009 for i in range(count)]  # not sorted: order is input order
    assert map_in_threads(lambda x: (x, x * x), items, threads=threads) == [
        (x, x * x) for x in items
    ]


def test_work_runs_in_the_asked_number_of_threads() -> None:
    seen: set[int] = set()
    lock = threading.Lock()
    both = threading.Barrier(2, timeout=30)  # passes only if two threads run at once

    def fn(x: int) -> int:
        with lock:
            first = threading.get_ident() not in seen
            seen.add(threading.get_ident())
        if first:  # each thread's first item waits for the other thread's
            both.wait()
        return x

    assert map_in_threads(fn, list(range(64)), threads=2) == list(range(64))
    assert len(seen) == 2


def test_every_item_runs_and_the_first_failure_in_input_order_is_raised() -> None:
    ran: list[int] = []
    lock = threading.Lock()

    def fn(x: int) -> int:
        if x == 3:
            time.sleep(0.2)  # fails last in time, first in input order
        with lock:
            ran.append(x)
        if x in (3, 40):
            raise ValueError(f"item {x}")
        return x

    with pytest.raises(ValueError, match=r"^item 3$"):
        map_in_threads(fn, list(range(48)), threads=4)
    assert sorted(ran) == list(range(48))
