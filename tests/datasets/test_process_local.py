"""`detdata.datasets.process_local.PerProcess`: one value per process, made at the first
``get``; made again in a forked child, after an unpickle and after ``reset``; never pickled;
made once when threads ask at the same time. The reference is what each ``make`` call
returned and how often it ran, recorded here."""

from __future__ import annotations

import multiprocessing
import os
import pickle
import threading
import time
from itertools import count

from detdata.datasets.process_local import PerProcess


def test_a_value_is_made_once_per_process_until_reset() -> None:
    made = count()
    holder: PerProcess[tuple[int, int]] = PerProcess()
    first = holder.get(lambda: (os.getpid(), next(made)))
    assert holder.get(lambda: (os.getpid(), next(made))) is first == (os.getpid(), 0)
    holder.reset()
    assert holder.get(lambda: (os.getpid(), next(made))) == (os.getpid(), 1)


def test_an_unpickled_holder_is_empty_and_the_value_never_travels() -> None:
    holder: PerProcess[object] = PerProcess()
    unpicklable = threading.Lock()  # a handle-like value: pickling it would raise
    assert holder.get(lambda: unpicklable) is unpicklable
    blob = pickle.dumps(holder)
    assert b"Lock" not in blob
    again = pickle.loads(blob)
    assert again.get(lambda: "made again") == "made again"
    assert holder.get(lambda: "not made") is unpicklable  # the original keeps its own


def _child(holder: PerProcess[tuple[int, str]], out: multiprocessing.Queue) -> None:  # type: ignore[type-arg]
    out.put(holder.get(lambda: (os.getpid(), "child")))


def test_a_forked_child_makes_its_own_value() -> None:
    holder: PerProcess[tuple[int, str]] = PerProcess()
    parent = holder.get(lambda: (os.getpid(), "parent"))
    ctx = multiprocessing.get_context("fork")
    out = ctx.Queue()
    proc = ctx.Process(target=_child, args=(holder, out))
    proc.start()
    got = out.get(timeout=60)
    proc.join(timeout=60)
    assert proc.exitcode == 0
    assert got == (proc.pid, "child") and got != parent
    assert holder.get(lambda: (os.getpid(), "not made")) == parent  # the parent's is untouched


def test_threads_asking_at_once_get_one_value() -> None:
    made = count()
    holder: PerProcess[int] = PerProcess()
    start = threading.Barrier(8)
    got: list[int] = []

    def make() -> int:
        time.sleep(0.05)  # slow: the other threads arrive while it runs
        return next(made)

    def ask() -> None:
        start.wait(timeout=30)
        got.append(holder.get(make))

    threads = [threading.Thread(target=ask) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=30)
    assert got == [0] * 8 and next(made) == 1
