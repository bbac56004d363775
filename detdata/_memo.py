"""Chunked memo for position -> index maps (amortised O(1) per position).

Order and mixture maps are pure functions of the position, vectorised but with
a fixed per-call cost (tens of numpy calls). A loader asks for a few dozen
positions at a time, nearly contiguous. `ChunkMemo` evaluates the map on whole
aligned chunks of positions once and answers from the cached chunks; a request
spanning more than ``slots`` chunks (random access) is computed directly. The
values are identical either way: this is a cache, never a different algorithm.
The cache is per process and never pickled.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable
from typing import Any, Final

import numpy as np
import numpy.typing as npt

IntArray = npt.NDArray[np.int64]
Fn = Callable[[IntArray], tuple[IntArray, ...]]
CHUNK: Final = 4096


class ChunkMemo:
    """Cache ``fn(positions) -> tuple of arrays`` (elementwise in positions) by aligned chunks."""

    def __init__(self, fn: Fn, *, chunk: int = CHUNK, slots: int = 4) -> None:
        self.fn = fn
        self.chunk = chunk
        self.slots = slots
        self._cache: OrderedDict[int, tuple[IntArray, ...]] = OrderedDict()

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        state["_cache"] = OrderedDict()
        return state

    def _chunk(self, c: int) -> tuple[IntArray, ...]:
        hit = self._cache.get(c)
        if hit is not None:
            self._cache.move_to_end(c)
            return hit
        values = self.fn(np.arange(c * self.chunk, (c + 1) * self.chunk, dtype=np.int64))
        self._cache[c] = values
        while len(self._cache) > self.slots:
            self._cache.popitem(last=False)
        return values

    def __call__(self, positions: IntArray) -> tuple[IntArray, ...]:
        flat = np.asarray(positions, dtype=np.int64).reshape(-1)
        if flat.size == 0:
            return self.fn(flat)
        lo, hi = int(flat.min()) // self.chunk, int(flat.max()) // self.chunk
        if hi - lo >= self.slots:
            return self.fn(flat)
        parts = [self._chunk(c) for c in range(lo, hi + 1)]
        offset = flat - lo * self.chunk
        if len(parts) == 1:
            return tuple(v[offset] for v in parts[0])
        return tuple(np.concatenate([p[i] for p in parts])[offset] for i in range(len(parts[0])))
