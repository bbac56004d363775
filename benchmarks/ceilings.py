"""The machine's ceilings, measured in the same run as the loaders.

* ``memcpy_gbs``: ``np.copyto`` of a 256 MiB buffer (bytes copied per second).
* ``page_cache_read_gbs``: reading the generated token files with ``readinto``
  (8 MiB chunks) after a warming pass, i.e. from the page cache.
* ``random_row_gather_gbs``: one numpy gather of 65,536 random 2 KiB rows from
  a warm memmap of the same files (the best a gather-based loader can do when
  it has no per-batch overhead at all).
"""

from __future__ import annotations

import time
from pathlib import Path

import numpy as np

from benchmarks.bench_data import SEQ, data_files


def _best(fn: object, repeats: int) -> float:
    assert callable(fn)
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def measure(root: Path, repeats: int = 3) -> dict[str, float]:
    size = 256 << 20
    src = np.ones(size, dtype=np.uint8)
    dst = np.empty_like(src)
    memcpy = size / _best(lambda: np.copyto(dst, src), repeats + 2) / 1e9


    files = data_files(root, "tokens")
    total = sum(p.stat().st_size for p in files)
    buf = bytearray(8 << 20)
    view = memoryview(buf)

    def read_all() -> None:
        for path in files:
            with open(path, "rb", buffering=0) as fh:
                while fh.readinto(view):
                    pass

    read_all()  # warm the page cache
    page_cache = total / _best(read_all, repeats) / 1e9

    arrays = [np.load(p, mmap_mode="r").reshape(-1, SEQ) for p in files]
    per = max(1, 65536 // len(arrays))
    rng = np.random.default_rng(0)
    picks = [rng.integers(0, a.shape[0], min(per, a.shape[0])) for a in arrays]
    outs = [np.empty((p.size, SEQ), dtype=np.int32) for p in picks]
    for arr in arrays:
        np.take(arr, np.arange(arr.shape[0]), axis=0)  # map every page once

    def gather_all() -> None:
        for arr, pick, out in zip(arrays, picks, outs, strict=True):
            np.take(arr, pick, axis=0, out=out)

    gathered = sum(p.size for p in picks) * SEQ * 4
    gather = gathered / _best(gather_all, repeats) / 1e9
    return {"memcpy_gbs": memcpy, "page_cache_read_gbs": page_cache,
            "random_row_gather_gbs": gather, "page_cache_bytes": float(total)}
