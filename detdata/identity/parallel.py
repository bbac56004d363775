"""Per-shard work in parallel threads, results in input order, with an optional progress bar."""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar, cast

T = TypeVar("T")
R = TypeVar("R")


def map_in_threads(
    fn: Callable[[T], R],
    items: Sequence[T],
    *,
    threads: int,
    desc: str = "",
    progress: bool | None = False,
) -> list[R]:
    """``[fn(item) for item in items]`` computed in ``max(1, threads)`` threads.

    Every item is run; the first exception (in input order) is raised once all
    have finished. ``progress``: a tqdm bar on stderr (``None``: only when stderr
    is a terminal).
    """
    with ThreadPoolExecutor(max_workers=max(1, threads)) as pool:
        return list(_progress(pool.map(fn, items), len(items), desc, progress))


def _progress(it: Iterable[R], total: int, desc: str, progress: bool | None) -> Iterable[R]:
    show = sys.stderr.isatty() if progress is None else progress
    if not show:
        return it
    from tqdm import tqdm

    return cast(Iterable[R], tqdm(it, total=total, desc=desc, unit="shard"))
