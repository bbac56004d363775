"""Per-shard work in parallel threads, results in input order, with an optional progress bar."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Final, TypeVar

from detdata.base.progress import progress as shown

T = TypeVar("T")
R = TypeVar("R")

#: chunks per thread: enough to balance uneven items, few enough that the pool's
#: per-task cost (a future, two locks: ~10-100 us) does not dominate tiny items
_CHUNKS_PER_THREAD: Final = 16


def map_in_threads(
    fn: Callable[[T], R],
    items: Sequence[T],
    *,
    threads: int,
    desc: str = "",
    progress: bool | None = False,
) -> list[R]:
    """``[fn(item) for item in items]`` computed in ``max(1, threads)`` threads, in
    contiguous chunks; every item is run and the first exception (in input order) raised
    once all have finished. ``progress``: `detdata.base.progress`.
    """
    items = list(items)
    workers = max(1, threads)
    size = max(1, -(-len(items) // (workers * _CHUNKS_PER_THREAD)))
    chunks = [items[i : i + size] for i in range(0, len(items), size)]

    def run(chunk: list[T]) -> list[tuple[bool, Any]]:
        out: list[tuple[bool, Any]] = []
        for item in chunk:
            try:
                out.append((True, fn(item)))
            except Exception as exc:  # kept in place; raised in input order below
                out.append((False, exc))
        return out

    results: list[R] = []
    first: BaseException | None = None
    with (
        ThreadPoolExecutor(max_workers=workers) as pool,
        shown(len(items), desc, unit="shard", enabled=progress) as update,
    ):
        for done in pool.map(run, chunks):
            update(len(done))
            for ok, value in done:
                if ok:
                    results.append(value)
                elif first is None:
                    first = value
    if first is not None:
        raise first
    return results
