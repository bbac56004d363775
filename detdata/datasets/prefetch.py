"""`CacheAhead`: fill the shard cache from the known future of the order (docs/design.md
"Remote reads: coalescing and lookahead prefetch": the window, its bound, releases).

Shards are mapped `PLAN_CHUNK` micro steps at a time. A queued fill of a released copy is
cancelled. A failed fill is logged and dropped: the reader fetches the shard itself and
raises at the batch that needs it. `close` cancels queued fills without waiting for running
ones (an unclosed one is closed at exit). Prefetch decides only when a copy is filled,
never a byte.
"""

from __future__ import annotations

import atexit
import collections
import queue
import threading
import weakref
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any, Final, Protocol, runtime_checkable

import numpy as np
import numpy.typing as npt

from detdata.base.checks import check_count
from detdata.base.redact import get_logger
from detdata.base.types import IntArray
from detdata.datasets.capabilities import HasOrigins
from detdata.datasets.shard_files import ShardFiles

log: Final = get_logger("detdata.prefetch")
#: Default number of shard downloads in flight.
DEFAULT_CONNECTIONS: Final = 4
#: Micro steps whose shards the lookahead maps at once (one vectorised `shard_uses_of_steps`).
PLAN_CHUNK: Final = 64

Key = tuple[int, int]  # (reader index in `CacheAhead.readers`, shard)
_Work = queue.SimpleQueue[tuple[Future[None], Callable[[], None]] | None]
#: Every open `CacheAhead` of this process: closed at exit (their queued fills cancelled).
_OPEN: weakref.WeakSet[CacheAhead] = weakref.WeakSet()


@runtime_checkable
class ShardReader(Protocol):
    """What the lookahead needs of a dataset (`TokenWindows`, `TableRows`): its shard
    files (``files``, a `ShardFiles`) and the shard of each sample id (``locate``)."""

    files: ShardFiles

    def locate(self, ids: npt.ArrayLike) -> tuple[IntArray, ...]: ...


def _run_fills(work: _Work) -> None:
    """A fill thread: run queued fills (FIFO) until the stop mark (None)."""
    while True:
        item = work.get()
        if item is None:
            return
        future, fill = item
        if not future.set_running_or_notify_cancel():
            continue  # cancelled while queued
        try:
            fill()
        except BaseException as exc:  # _fill logs its own errors; this is a last resort
            future.set_exception(exc)
        else:
            future.set_result(None)


def _stop_fills(work: _Work, threads: int) -> None:
    """Cancel every fill still queued on ``work`` and stop its ``threads`` (no waiting)."""
    while True:
        try:
            item = work.get_nowait()
        except queue.Empty:
            break
        if item is not None:
            item[0].cancel()
    for _ in range(threads):
        work.put(None)


@atexit.register
def _close_all() -> None:
    for ahead in list(_OPEN):
        ahead.close()


def cached_readers(stream: object) -> list[ShardReader]:
    """The shard readers of ``stream`` that read through a shard cache, in source order: of
    a `HasOrigins` stream's datasets, else of ``stream`` itself (a dataset, or a stream that
    does not say: then nothing is prefetched, the documented default)."""
    found: list[object] = [stream]
    if isinstance(stream, HasOrigins):
        found = list(stream.origins(np.empty(0, dtype=np.int64)).datasets)
    return [r for r in found if isinstance(r, ShardReader) and r.files.uses_shard_cache()]


def shard_uses(stream: Any, positions: IntArray, readers: list[ShardReader]) -> list[Key]:
    """``(reader index, shard)`` read at ``positions`` of ``stream`` (a `HasOrigins` stream,
    else a dataset), in order of first use; only readers in ``readers`` count."""
    return shard_uses_of_steps(stream, [positions], readers)[0]


def shard_uses_of_steps(
    stream: Any, steps: list[IntArray], readers: list[ShardReader]
) -> list[list[Key]]:
    """`shard_uses` of each position array in ``steps``, with one vectorised mapping."""
    if not steps:
        return []
    arrays = [np.asarray(p, dtype=np.int64).reshape(-1) for p in steps]
    step_of = np.repeat(np.arange(len(arrays), dtype=np.int64), [len(a) for a in arrays])
    which, shard = _shards_at(stream, np.concatenate(arrays), readers)
    keep = which >= 0
    which, shard, step_of = which[keep], shard[keep], step_of[keep]
    out: list[list[Key]] = [[] for _ in arrays]
    if not len(which):
        return out
    combined = which * (1 << 40) + shard
    # first occurrence of each (step, key), in position order within each step
    order = np.lexsort((np.arange(len(combined)), combined, step_of))
    s, c = step_of[order], combined[order]
    new = np.ones(len(order), dtype=bool)
    new[1:] = (s[1:] != s[:-1]) | (c[1:] != c[:-1])
    first = np.sort(order[new])
    for j, w, sh in zip(
        step_of[first].tolist(), which[first].tolist(), shard[first].tolist(), strict=True
    ):
        out[j].append((w, sh))
    return out


def _shards_at(
    stream: object, pos: IntArray, readers: list[ShardReader]
) -> tuple[IntArray, IntArray]:
    """``(reader index or -1, shard)`` of each position of ``stream`` (`cached_readers`)."""
    index = {id(r): i for i, r in enumerate(readers)}
    if isinstance(stream, HasOrigins):
        found = stream.origins(pos)
        ids = found.ids
        which = np.asarray([index.get(id(d), -1) for d in found.datasets], dtype=np.int64)
        which = which[found.source]
    else:  # a dataset: positions are its ids
        ids = np.asarray(pos).reshape(-1)
        which = np.full(ids.shape, index.get(id(stream), -1), dtype=np.int64)
    shard = np.full(ids.shape, -1, dtype=np.int64)
    for i in np.unique(which[which >= 0]).tolist():
        sel = which == i
        shard[sel] = readers[i].locate(ids[sel])[0]
    return which, shard


@dataclass
class CacheAheadStats:
    """Counters of one `CacheAhead` (this process)."""

    submitted: int = 0  # shard fills queued
    failed: int = 0  # fills that raised (the reader fetches again and reports)
    released: int = 0  # copies released after their last use in the window
    shrunk: int = 0  # times the window stopped short of `steps` to stay under the bound
    max_window_bytes: int = 0


class CacheAhead:
    """Fills the shard cache ahead of the consumer. ``positions_of(j)``: the positions this
    rank reads at micro step ``j``; ``stop``: the first micro step never read (None:
    endless). Call `advance` with the micro step about to be delivered; `close` when done.
    """

    def __init__(
        self,
        stream: Any,
        positions_of: Callable[[int], IntArray],
        *,
        steps: int,
        connections: int = DEFAULT_CONNECTIONS,
        stop: int | None = None,
    ) -> None:
        self.stream = stream
        self.positions_of = positions_of
        self.steps = check_count(steps, "ReadOptions.steps_ahead", minimum=1)
        self.connections = check_count(
            connections, "ReadOptions.steps_ahead_connections", maximum=256
        )
        self.stop = stop
        self.readers = cached_readers(stream)
        self.stats = CacheAheadStats()
        self._budget = {r.files.cache_dir: r.files.shard_cache_bytes for r in self.readers}
        self._window_bytes: dict[str | None, int] = collections.defaultdict(int)
        self._plan: collections.deque[tuple[int, list[Key]]] = collections.deque()
        self._last_use: dict[Key, int] = {}
        self._futures: dict[Key, Future[None]] = {}
        self._next = 0  # the first micro step not planned yet
        # (step, shard_uses) of the steps from `_next` on, computed ahead (`_uses`)
        self._uses_ahead: collections.deque[tuple[int, list[Key]]] = collections.deque()
        self._lock = threading.Lock()
        self._work: _Work = queue.SimpleQueue()
        self._stopper: Callable[[], object] | None = None  # stops the fill threads (once)
        self._closed = False

    @property
    def active(self) -> bool:
        """Does some reader use a shard cache (anything to prefetch)?"""
        return bool(self.readers)

    def window_bytes(self) -> int:
        """Bytes of the distinct shards in the window now (all cache directories)."""
        return sum(self._window_bytes.values())

    # the consumer's side ----------------------------------------------------------
    def advance(self, step: int) -> None:
        """The consumer is about to read micro step ``step``: release shards whose last use
        in the window is behind it, then extend the window and queue new fills."""
        if not self.active or self._closed:
            return
        if (self._plan and self._plan[0][0] > step) or step > self._next:
            self._restart(step)  # a jump (resume elsewhere): plan afresh from here
        while self._plan and self._plan[0][0] < step:
            done, keys = self._plan.popleft()
            for key in keys:
                if self._last_use.get(key) == done:
                    self._release(key)
        self._extend(step)

    def close(self) -> None:
        """Cancel queued fills and stop the fill threads (running fills are not waited for)."""
        if self._closed:
            return
        self._closed = True
        _OPEN.discard(self)
        for future in list(self._futures.values()):
            future.cancel()
        if self._stopper is not None:
            self._stopper()

    # planning -----------------------------------------------------------------------
    def _restart(self, step: int) -> None:
        for key in list(self._last_use):
            self._release(key)
        self._plan.clear()
        self._next = step

    def _uses(self, step: int) -> list[Key]:
        """`shard_uses` of micro step ``step``; mapped with the next `PLAN_CHUNK` - 1 steps
        (never past ``stop``), which are kept until planned."""
        uses = self._uses_ahead
        if uses and uses[0][0] != step:
            uses.clear()  # a restart elsewhere
        if not uses:
            end = step + PLAN_CHUNK
            if self.stop is not None:
                end = min(end, self.stop)
            steps = list(range(step, max(end, step + 1)))
            found = shard_uses_of_steps(
                self.stream, [self.positions_of(j) for j in steps], self.readers
            )
            uses.extend(zip(steps, found, strict=True))
        return uses.popleft()[1]

    def _extend(self, step: int) -> None:
        horizon = step + self.steps
        if self.stop is not None:
            horizon = min(horizon, self.stop)
        while self._next < horizon:
            keys = self._uses(self._next)
            new = [k for k in keys if k not in self._last_use]
            extra: dict[str | None, int] = collections.defaultdict(int)
            for k in new:
                reader = self.readers[k[0]]
                extra[reader.files.cache_dir] += reader.files.manifest.shards[k[1]].bytes
            over = any(self._window_bytes[d] + b > self._budget.get(d, 0) for d, b in extra.items())
            if over and self._plan:  # the step about to be read is always planned
                self.stats.shrunk += 1
                self._uses_ahead.appendleft((self._next, keys))  # planned at a later advance
                break
            for d, b in extra.items():
                self._window_bytes[d] += b
            self.stats.max_window_bytes = max(self.stats.max_window_bytes, self.window_bytes())
            for k in keys:
                self._last_use[k] = self._next
            self._plan.append((self._next, keys))
            for k in new:
                self._submit(k)
            self._next += 1

    # fills and releases -----------------------------------------------------------
    def _submit(self, key: Key) -> None:
        if self._stopper is None:
            _OPEN.add(self)
            self._stopper = weakref.finalize(self, _stop_fills, self._work, self.connections)
            for i in range(self.connections):
                name = f"detdata-prefetch-{i}"
                threading.Thread(
                    target=_run_fills, args=(self._work,), name=name, daemon=True
                ).start()
        self.stats.submitted += 1
        future: Future[None] = Future()
        self._work.put((future, lambda: self._fill(key)))
        self._futures[key] = future

    def _fill(self, key: Key) -> None:
        reader = self.readers[key[0]]
        try:
            reader.files.prefetch_copy(key[1])
        except Exception as exc:
            with self._lock:
                self.stats.failed += 1
            log.warning(
                "detdata: background prefetch of shard %s failed (%s: %s); the batch that "
                "needs it fetches it again and raises if that fails too",
                reader.files.manifest.shards[key[1]].path,
                type(exc).__name__,
                exc,
            )

    def _release(self, key: Key) -> None:
        reader = self.readers[key[0]]
        self._last_use.pop(key, None)
        self._window_bytes[reader.files.cache_dir] -= reader.files.manifest.shards[key[1]].bytes
        self.stats.released += 1
        future = self._futures.pop(key, None)
        if future is not None and not future.done():
            if future.cancel():
                return
            last_use = self._last_use

            def release_later(_: object) -> None:
                if key not in last_use:  # planned again meanwhile: it is in the window
                    reader.files.release_copy(key[1])

            future.add_done_callback(release_later)
            return
        reader.files.release_copy(key[1])
