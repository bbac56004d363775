"""The benchmarks' one clock: a stopwatch, best-of-N, mean per call, medians, and profiles.

Every time is wall time from `time.perf_counter`, in seconds. Which statistic a
benchmark reports is its own choice: the shortest of N calls (`best_of`: noise
only ever adds time), the mean of consecutive calls (`mean_of`: steady-state
cost, warm-up excluded), or a median over interleaved rounds (`median`,
`middle`: robust to one disturbed round).
"""

from __future__ import annotations

import cProfile
import io
import pstats
import statistics
import time
from collections.abc import Callable, Iterable, Sequence
from typing import TypeVar

T = TypeVar("T")


class Stopwatch:
    """Wall time spent inside ``with`` blocks, summed over every entry into ``seconds``.

    `elapsed` also counts the block still running (for loops that stop on a time budget).
    """

    def __init__(self) -> None:
        self.seconds = 0.0
        self._start: float | None = None

    def __enter__(self) -> Stopwatch:
        self._start = time.perf_counter()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.seconds = self.elapsed()
        self._start = None

    def elapsed(self) -> float:
        """``seconds`` plus the time since the running block began (if one is running)."""
        if self._start is None:
            return self.seconds
        return self.seconds + time.perf_counter() - self._start


def best_of(
    fn: Callable[[], object],
    repeats: int = 3,
    *,
    min_seconds: float = 0.0,
    sync: Callable[[], object] | None = None,
) -> float:
    """Shortest wall time of one call of ``fn``.

    ``fn`` runs ``repeats`` (>= 1) times, then again until ``min_seconds`` have passed
    since the first call began. ``sync`` (e.g. a device synchronize) runs before each
    call and again before its clock stops, so work that ``fn`` queued is counted.
    """
    if repeats < 1:
        raise ValueError(f"repeats must be >= 1, got {repeats}")
    best = float("inf")
    deadline = time.perf_counter() + min_seconds
    done = 0
    while done < repeats or time.perf_counter() <= deadline:
        if sync is not None:
            sync()
        t0 = time.perf_counter()
        fn()
        if sync is not None:
            sync()
        best = min(best, time.perf_counter() - t0)
        done += 1
    return best


def mean_of(fn: Callable[[], object], calls: int, *, warmup: int = 1) -> float:
    """Mean wall time of a call of ``fn`` over ``calls`` consecutive calls (timed as one block),
    after ``warmup`` untimed calls."""
    if calls < 1:
        raise ValueError(f"calls must be >= 1, got {calls}")
    for _ in range(warmup):
        fn()
    with Stopwatch() as clock:
        for _ in range(calls):
            fn()
    return clock.seconds / calls


def median(values: Iterable[float | None]) -> float | None:
    """`statistics.median` of the values that are not None (None when there are none)."""
    present = [v for v in values if v is not None]
    return statistics.median(present) if present else None


def middle(rounds: Sequence[T], key: Callable[[T], float]) -> T:
    """The round at the median of ``key`` (the upper one of two for an even count): a real
    round, not an average, so all its fields come from the same measurement."""
    return sorted(rounds, key=key)[len(rounds) // 2]


def profile(fn: Callable[[], object], calls: int, top: int) -> str:
    """cProfile of ``calls`` calls of ``fn``: the ``top`` functions by own time, blank lines
    dropped."""
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(calls):
        fn()
    prof.disable()
    text = io.StringIO()
    pstats.Stats(prof, stream=text).sort_stats("tottime").print_stats(top)
    return "\n".join(line for line in text.getvalue().splitlines() if line.strip())
