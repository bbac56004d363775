"""Where detdata's per-batch time goes (token windows, batch 64), and what two fixes would save.

``python -m benchmarks.profile_detdata [--data-dir DIR] [--batches N]`` uses the
data of ``python -m benchmarks`` (generated if missing) and prints microseconds
per batch for:

* ``order.ids``: `GlobalOrder.ids` of 64 consecutive positions (feistel-v1,
  ~50 small numpy calls, independent of the batch size);
* ``order.ids, block cache``: the same ids computed 4096 positions at a time
  and sliced (a suggested cache: O(block) memory, still O(1) resume);
* ``TokenWindows.read``: the batched read of 64 random ids;
* ``gather, sorted take``: a suggested local gather for the same ids (one
  ``np.take(..., out=)`` per shard run into a sorted buffer, one scatter);
* ``DataLoader``: a whole ``next()`` of ``detdata.DataLoader`` (num_workers=0);

then a cProfile of the DataLoader loop.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt

from benchmarks.bench_data import SEQ, DataSpec, check_rows, generate

IntArray = npt.NDArray[np.int64]


class BlockOrder:
    """`GlobalOrder.ids` computed ``block`` aligned positions at a time, last block kept."""

    def __init__(self, ids: Callable[[IntArray], IntArray], block: int = 4096) -> None:
        self._ids = ids
        self.block = block
        self._first = -1
        self._cached: IntArray = np.empty(0, dtype=np.int64)

    def ids(self, positions: IntArray) -> IntArray:
        lo, hi = int(positions[0]), int(positions[-1])
        first = lo - lo % self.block
        if hi < first + self.block and hi - lo + 1 == positions.size:  # one block, contiguous
            if first != self._first:
                self._cached = self._ids(np.arange(first, first + self.block, dtype=np.int64))
                self._first = first
            return self._cached[lo - first:hi - first + 1]
        return self._ids(positions)


def sorted_take_gather(views: list[np.ndarray[Any, Any]], starts: IntArray, ids: IntArray,
                       out: np.ndarray[Any, Any]) -> None:
    """Suggested local gather: sort, one ``np.take(out=)`` per shard run, one scatter."""
    order = np.argsort(ids, kind="stable")
    sorted_ids = ids[order]
    shard = np.searchsorted(starts, sorted_ids, side="right") - 1
    local = sorted_ids - starts[shard]
    tmp = np.empty_like(out)
    a = 0
    for b in [*(np.flatnonzero(shard[1:] != shard[:-1]) + 1).tolist(), ids.size]:
        np.take(views[int(shard[a])], local[a:b], axis=0, out=tmp[a:b], mode="clip")
        a = b
    out[order] = tmp


def per_call_us(fn: Callable[[], Any], n: int) -> float:
    fn()
    t0 = time.perf_counter()
    for _ in range(n):
        fn()
    return (time.perf_counter() - t0) / n * 1e6


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--data-dir", default=str(Path(tempfile.gettempdir()) / "detdata-bench" /
                                             "16384x8-rg1024"))
    p.add_argument("--batches", type=int, default=3000)
    args = p.parse_args(argv)
    root = Path(args.data_dir)
    generate(root, DataSpec(16384, 8, 1024))
    import detdata
    from detdata.datasets.base import OrderedStream
    from detdata.datasets.tokens import TokenWindows

    n = args.batches
    ds = TokenWindows(str(root / "tokens" / "manifest.json"), SEQ, labels=False)
    stream = OrderedStream(ds, 1234)
    blocks = BlockOrder(stream.order.ids)
    rng = np.random.default_rng(0)
    batches = [np.arange(k * 64, (k + 1) * 64, dtype=np.int64) for k in range(n)]
    ids = [stream.order.ids(b) for b in batches]
    for b, want in zip(batches, ids, strict=True):
        assert np.array_equal(blocks.ids(b), want)
    ds.read(ids[0])  # opens the file system (views need the root)
    views = [ds._view(s) for s in range(len(ds.windows_per_shard))]
    starts = np.asarray(ds._starts)
    out = np.empty((64, SEQ), dtype=np.int32)
    sorted_take_gather(views, starts, ids[0], out)
    assert np.array_equal(check_rows(out, ds.num_samples), ids[0])

    it = iter(range(10 * n))
    rows = {
        "order.ids (64 positions)": per_call_us(lambda: stream.order.ids(batches[next(it) % n]), n),
    }
    blocks = BlockOrder(stream.order.ids)
    it = iter(range(10 * n))
    rows["order.ids, block cache of 4096"] = per_call_us(lambda: blocks.ids(batches[next(it) % n]), n)
    it = iter(range(10 * n))
    rows["TokenWindows.read (64 ids)"] = per_call_us(lambda: ds.read(ids[next(it) % n]), n)
    it = iter(range(10 * n))
    rows["gather, sorted take (suggested)"] = per_call_us(
        lambda: sorted_take_gather(views, starts, ids[next(it) % n], out), n)
    del rng
    loader = detdata.DataLoader(ds, global_batch_size=64, seed=1234)
    batch_iter = iter(loader)
    rows["detdata.DataLoader next() (num_workers=0)"] = per_call_us(lambda: next(batch_iter), n)
    print("microseconds per batch of 64 x 2 KiB token windows:")
    for name, us in rows.items():
        print(f"  {name:44s} {us:8.1f} us")
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(n):
        next(batch_iter)
    prof.disable()
    text = io.StringIO()
    pstats.Stats(prof, stream=text).sort_stats("tottime").print_stats(14)
    print("\n".join(line for line in text.getvalue().splitlines() if line.strip()))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
