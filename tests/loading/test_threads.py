"""`detdata.loading.threads.threaded_batches`: order, errors with positions, no hang, cleanup."""

from __future__ import annotations

import itertools
import os
import random
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from detdata.base.errors import ConfigError
from detdata.loading.threads import threaded_batches

B = 8
ROOT = Path(__file__).resolve().parents[2]


def positions(count: int | None, start: int = 0) -> Iterator[np.ndarray]:
    steps = itertools.count() if count is None else range(count)
    for k in steps:
        yield np.arange(start + k * B, start + (k + 1) * B, dtype=np.int64)


def jittery(pos: np.ndarray) -> np.ndarray:
    """A fetch whose duration varies so that later batches often finish first."""
    time.sleep(random.Random(int(pos[0])).random() * 0.003)
    return pos * 10


@pytest.mark.parametrize(("threads", "prefetch"), [(1, 1), (2, 2), (3, 8), (8, 3)])
def test_order_is_exactly_the_order_of_positions(threads: int, prefetch: int) -> None:
    got = list(threaded_batches(jittery, positions(60), num_threads=threads, ahead=prefetch))
    assert len(got) == 60
    for k, batch in enumerate(got):
        np.testing.assert_array_equal(batch, np.arange(k * B, (k + 1) * B) * 10)


def test_infinite_positions_are_pulled_lazily_and_bounded_by_prefetch() -> None:
    pulled = 0

    def counting() -> Iterator[np.ndarray]:
        nonlocal pulled
        for pos in positions(None):
            pulled += 1
            yield pos

    gen = threaded_batches(lambda p: p, counting(), num_threads=2, ahead=4)
    first = [next(gen) for _ in range(5)]
    assert [int(b[0]) for b in first] == [0, 8, 16, 24, 32]
    assert pulled <= 5 + 4
    gen.close()


def test_fetch_error_reaches_the_caller_with_its_positions_after_earlier_batches() -> None:
    def fetch(pos: np.ndarray) -> np.ndarray:
        if pos[0] == 5 * B:
            raise OSError("disk on fire")
        return pos

    got = []
    with pytest.raises(OSError, match="disk on fire") as info:
        for batch in threaded_batches(fetch, positions(20), num_threads=3, ahead=6):
            got.append(int(batch[0]))
    assert got == [k * B for k in range(5)]
    notes = "\n".join(getattr(info.value, "__notes__", []))
    assert f"[{5 * B}..{6 * B - 1}]" in notes and f"{B} positions" in notes


def test_error_from_the_positions_iterator_comes_after_the_batches_before_it() -> None:
    def broken() -> Iterator[np.ndarray]:
        yield from positions(3)
        raise ValueError("bad schedule")

    got = []
    with pytest.raises(ValueError, match="bad schedule"):
        for batch in threaded_batches(lambda p: p, broken(), num_threads=2, ahead=8):
            got.append(int(batch[0]))
    assert got == [0, 8, 16]


def test_closing_early_does_not_hang_and_leaves_no_threads() -> None:
    release = threading.Event()
    started = threading.Event()

    def slow(pos: np.ndarray) -> np.ndarray:
        if pos[0] > 0:
            started.set()
            release.wait(5)
        return pos

    before = {t.ident for t in threading.enumerate()}
    gen = threaded_batches(slow, positions(None), num_threads=2, ahead=4)
    assert int(next(gen)[0]) == 0
    assert started.wait(5)
    release.set()
    t0 = time.monotonic()
    gen.close()
    assert time.monotonic() - t0 < 5
    time.sleep(0.05)
    leftover = [
        t
        for t in threading.enumerate()
        if t.ident not in before and t.name.startswith("detdata-read")
    ]
    assert leftover == []


def test_a_failing_batch_does_not_hang_while_others_are_still_running() -> None:
    def fetch(pos: np.ndarray) -> np.ndarray:
        if pos[0] == 0:
            raise RuntimeError("first batch fails")
        time.sleep(0.01)
        return pos

    t0 = time.monotonic()
    with pytest.raises(RuntimeError, match="first batch fails"):
        list(threaded_batches(fetch, positions(None), num_threads=2, ahead=4))
    assert time.monotonic() - t0 < 5


def test_empty_positions_yield_nothing() -> None:
    assert list(threaded_batches(lambda p: p, iter([]), num_threads=2, ahead=2)) == []


@pytest.mark.parametrize(("threads", "prefetch"), [(0, 1), (1, 0), (True, 2), (2, 1.5)])
def test_bad_arguments_are_refused(threads: object, prefetch: object) -> None:
    with pytest.raises(ConfigError):
        threaded_batches(lambda p: p, positions(1), num_threads=threads, ahead=prefetch)  # type: ignore[arg-type]


def test_detdata_stream_read_from_threads_matches_the_serial_read(token_shards) -> None:  # type: ignore[no-untyped-def]
    import detdata
    from detdata.datasets.tokens import TokenWindows

    ds = TokenWindows(detdata.build_manifest(str(token_shards), progress=False), 16)
    stream = detdata.OrderedStream(ds, seed=7)
    serial = [stream.fetch(p)["tokens"] for p in positions(40)]
    threaded = list(threaded_batches(stream.fetch, positions(40), num_threads=3, ahead=6))
    for a, b in zip(serial, threaded, strict=True):
        np.testing.assert_array_equal(a, b["tokens"])


DROPPED_IN_A_COLLECTION = """
import gc, threading, time
import numpy as np
import detdata

ds = detdata.ArrayDataset({"x": np.arange(4000, dtype=np.int64)})
before = threading.active_count()
loader = detdata.DataLoader(
    ds, global_batch_size=8, seed=0, num_workers=2,
    options=detdata.LoaderOptions(
        total_samples=4000, read=detdata.ReadOptions(worker_mode="thread")
    ),
)
it = iter(loader)
first = next(it)
cycle = [it, loader]
cycle.append(cycle)  # only the cyclic garbage collector frees the iterator
del it, loader, cycle
with threading._shutdown_locks_lock:  # held by a thread starting or being joined
    gc.collect()
deadline = time.monotonic() + 20
while threading.active_count() > before and time.monotonic() < deadline:
    time.sleep(0.05)
print("threads left", threading.active_count() - before)
"""


def test_an_iterator_dropped_in_a_collection_never_deadlocks_and_leaves_no_thread(
    tmp_path: Path,
) -> None:
    """The cyclic GC may run while threading's shutdown lock is held (a thread starting or
    being joined); an abandoned thread-mode iterator freed then must not join its readers
    (that deadlocked: CI hung in test_order_is_exactly_the_order_of_positions)."""
    script = tmp_path / "dropped.py"
    script.write_text(DROPPED_IN_A_COLLECTION)
    proc = subprocess.run(
        [sys.executable, str(script)],
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.strip().splitlines()[-1] == "threads left 0", proc.stdout
