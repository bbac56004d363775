"""Order-preserving thread pool for batch reads (an alternative to worker processes: batched
reads release the GIL, and batches need no inter-process transfer).

Closing (or dropping) a `threaded_batches` generator cancels reads not yet started and
waits for running ones, so no thread outlives it; except when the cyclic garbage collector
finalises it (inside threading's shutdown lock joining deadlocks): the threads end alone.
"""

from __future__ import annotations

import collections
import gc
from collections.abc import Callable, Generator, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TypeVar

import numpy as np
import numpy.typing as npt

from detdata.base.checks import check_positive_int

T = TypeVar("T")

#: True while the cyclic garbage collector runs (`_collecting`, a ``gc`` callback)
_IN_COLLECTION = False


def _collecting(phase: str, info: dict[str, int]) -> None:
    global _IN_COLLECTION
    _IN_COLLECTION = phase == "start"


gc.callbacks.append(_collecting)
Positions = npt.NDArray[np.int64] | list[npt.NDArray[np.int64]]
P = TypeVar("P", bound=Positions)


def describe_positions(positions: Positions) -> str:
    """Short text naming a position array (or a group of them): ``[first..last] (n positions)``."""
    arr = (
        np.concatenate(positions)
        if isinstance(positions, list) and positions
        else np.asarray(positions)
    )
    if arr.size == 0:
        return "[] (0 positions)"
    return f"[{int(arr.flat[0])}..{int(arr.flat[-1])}] ({arr.size} positions)"


def threaded_batches(
    fetch: Callable[[P], T], positions: Iterator[P], num_threads: int, ahead: int
) -> Generator[T, None, None]:
    """``fetch(p)`` for each ``p`` of ``positions`` (pulled lazily from the calling thread;
    may be infinite), on ``num_threads`` threads, in order, at most ``ahead`` ahead. A
    ``fetch`` error is raised when its batch is due, with a note naming the positions; a
    ``positions`` error after the batches before it."""
    check_positive_int(num_threads, "num_threads")
    check_positive_int(ahead, "ahead")
    return _generate(fetch, positions, num_threads, ahead)


def _generate(
    fetch: Callable[[P], T], positions: Iterator[P], num_threads: int, ahead: int
) -> Generator[T, None, None]:
    source = iter(positions)
    pending: collections.deque[tuple[P, Future[T]]] = collections.deque()
    pool = ThreadPoolExecutor(max_workers=num_threads, thread_name_prefix="detdata-read")
    exhausted = False
    source_error: BaseException | None = None

    def submit_next() -> None:
        nonlocal exhausted, source_error
        if exhausted:
            return
        try:
            pos = next(source)
        except StopIteration:
            exhausted = True
            return
        except BaseException as exc:  # raised after the batches submitted before it
            exhausted, source_error = True, exc
            return
        pending.append((pos, pool.submit(fetch, pos)))

    try:
        while len(pending) < ahead and not exhausted:
            submit_next()
        while pending:
            pos, future = pending.popleft()
            try:
                result = future.result()
            except Exception as exc:
                exc.add_note(
                    f"detdata: while reading positions {describe_positions(pos)} in a reader thread"
                )
                raise
            submit_next()
            yield result
        if source_error is not None:
            raise source_error
    finally:
        for _, future in pending:
            future.cancel()
        # never join from a collection (module docstring): it may hold threading's locks
        pool.shutdown(wait=not _IN_COLLECTION, cancel_futures=True)
