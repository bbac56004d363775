"""The machine's ceilings, measured in the same run as the loaders.

* ``memcpy_gbs``: ``np.copyto`` of a 256 MiB buffer (bytes copied per second).
* ``page_cache_read_gbs``: reading the generated token files with ``readinto``
  (8 MiB chunks) after a warming pass, i.e. from the page cache.
* ``random_row_gather_gbs``: one numpy gather of 65,536 random 2 KiB rows from
  a warm memmap of the same files (the best a gather-based loader can do when
  it has no per-batch overhead at all).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from benchmarks.bench_data import SEQ, data_files
from benchmarks.timing import best_of


def measure(root: Path, repeats: int = 3) -> dict[str, float]:
    """The ceilings above (GB/s, best of ``repeats`` passes) and the bytes read from the cache."""
    files = data_files(root, "tokens")
    memcpy = memcpy_gbs(repeats + 2)
    page_cache = page_cache_read_gbs(files, repeats)
    gather = random_row_gather_gbs(files, repeats)
    total = sum(p.stat().st_size for p in files)
    return {
        "memcpy_gbs": memcpy,
        "page_cache_read_gbs": page_cache,
        "random_row_gather_gbs": gather,
        "page_cache_bytes": float(total),
    }


def memcpy_gbs(repeats: int) -> float:
    size = 256 << 20
    src = np.ones(size, dtype=np.uint8)
    dst = np.empty_like(src)
    return size / best_of(lambda: np.copyto(dst, src), repeats) / 1e9


def page_cache_read_gbs(files: list[Path], repeats: int) -> float:
    total = sum(p.stat().st_size for p in files)
    view = memoryview(bytearray(8 << 20))

    def read_all() -> None:
        for path in files:
            with open(path, "rb", buffering=0) as fh:
                while fh.readinto(view):
                    pass

    read_all()  # warm the page cache
    return total / best_of(read_all, repeats) / 1e9


def random_row_gather_gbs(files: list[Path], repeats: int) -> float:
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

    gathered = int(sum(p.size for p in picks)) * SEQ * 4
    return gathered / best_of(gather_all, repeats) / 1e9
