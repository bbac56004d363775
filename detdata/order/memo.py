"""Chunked memo for position -> index maps (amortised O(1) per position).

`ChunkMemo` evaluates a vectorised map (fixed cost per call: tens of numpy calls) on whole
aligned chunks of positions once and answers nearly contiguous requests from the cached
chunks; a request spanning more than ``slots`` chunks is computed directly. The values are
identical either way. Per process, never pickled, thread-safe; the arrays returned are new.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable
from typing import Final, Generic, TypeVar

import numpy as np

from detdata.base.types import IntArray

K = TypeVar("K")
V = TypeVar("V")

Fn = Callable[[IntArray], tuple[IntArray, ...]]
#: Positions per chunk: amortises feistel-v1's ~0.4 ms fixed cost a call (docs/benchmarks.md);
#: with process workers each worker computes every chunk and reads every other group of it.
CHUNK: Final = 8192


class LruCache(Generic[K, V]):
    """At most ``slots`` values by key, the least recently used evicted first. Thread-safe (a
    value is computed outside the lock); pickles empty (it is per process)."""

    def __init__(self, slots: int) -> None:
        self.slots = slots
        self._values: OrderedDict[K, V] = OrderedDict()
        self._lock = threading.Lock()

    def __reduce__(self) -> tuple[type[LruCache[K, V]], tuple[int]]:
        return (LruCache, (self.slots,))

    def __len__(self) -> int:
        return len(self._values)

    def get(self, key: K, compute: Callable[[K], V]) -> V:
        """The value of ``key``, ``compute(key)`` (then kept) when it is not cached."""
        with self._lock:  # get + move_to_end raced with another thread's eviction (KeyError)
            hit = self._values.get(key)
            if hit is not None:
                self._values.move_to_end(key)
                return hit
        value = compute(key)
        self.put(key, value)
        return value

    def put(self, key: K, value: V) -> None:
        with self._lock:
            self._values[key] = value
            self._values.move_to_end(key)
            while len(self._values) > self.slots:
                self._values.popitem(last=False)

    def items(self) -> list[tuple[K, V]]:
        with self._lock:
            return list(self._values.items())


class ChunkMemo:
    """Cache ``fn(positions) -> tuple of arrays`` (elementwise in positions) by aligned chunks."""

    def __init__(self, fn: Fn, *, chunk: int = CHUNK, slots: int = 4) -> None:
        self.fn = fn
        self.chunk = chunk
        self.slots = slots
        self._cache: LruCache[int, tuple[IntArray, ...]] = LruCache(slots)

    def forked(self, fn: Fn, since: int) -> ChunkMemo:
        """A memo of ``fn``, a map equal to this one's before position ``since`` (a mixture
        whose weights change there): the cached chunks before ``since`` are kept, the rest
        of a chunk holding ``since`` is computed with ``fn``, later chunks are dropped."""
        out = ChunkMemo(fn, chunk=self.chunk, slots=self.slots)
        for c, values in self._cache.items():
            lo = c * self.chunk
            if lo + self.chunk <= since:
                out._cache.put(c, values)
            elif lo < since:
                tail = fn(np.arange(since, lo + self.chunk, dtype=np.int64))
                out._cache.put(
                    c,
                    tuple(
                        np.concatenate((v[: since - lo], t))
                        for v, t in zip(values, tail, strict=True)
                    ),
                )
        return out

    def _chunk(self, c: int) -> tuple[IntArray, ...]:
        return self.fn(np.arange(c * self.chunk, (c + 1) * self.chunk, dtype=np.int64))

    def __call__(self, positions: IntArray) -> tuple[IntArray, ...]:
        flat = np.asarray(positions, dtype=np.int64).reshape(-1)
        if flat.size == 0:
            return self.fn(flat)
        lo, hi = int(flat.min()) // self.chunk, int(flat.max()) // self.chunk
        if hi - lo >= self.slots:
            return self.fn(flat)
        parts = [self._cache.get(c, self._chunk) for c in range(lo, hi + 1)]
        offset = flat - lo * self.chunk
        if len(parts) == 1:
            return tuple(v[offset] for v in parts[0])
        return tuple(np.concatenate([p[i] for p in parts])[offset] for i in range(len(parts[0])))
