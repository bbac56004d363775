"""Where detdata's per-batch time goes (token windows, batch 64).

``python -m benchmarks.profile_detdata [--data-dir DIR] [--batches N]`` uses the
data of ``python -m benchmarks`` (generated if missing) and prints microseconds
per batch for:

* ``order.ids``: `GlobalOrder.ids` of 64 consecutive positions (feistel-v1,
  ~50 small numpy calls, independent of the batch size);
* ``TokenWindows.read``: the batched read of 64 random ids;
* ``DataLoader``: a whole ``next()`` of ``detdata.DataLoader`` (num_workers=0);

then a cProfile of the DataLoader loop.
"""

from __future__ import annotations

import argparse
import itertools
import tempfile
from pathlib import Path

import numpy as np

import detdata
from benchmarks.bench_data import SEQ, DataSpec, check_rows, generate
from benchmarks.timing import mean_of, profile

BATCH = 64


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument(
        "--data-dir", default=str(Path(tempfile.gettempdir()) / "detdata-bench" / "16384x8-rg1024")
    )
    p.add_argument("--batches", type=int, default=3000)
    args = p.parse_args(argv)
    root = Path(args.data_dir)
    generate(root, DataSpec(16384, 8, 1024))
    n = args.batches
    ds = detdata.TokenWindows(str(root / "tokens" / "manifest.json"), SEQ, labels=False)
    stream = detdata.OrderedStream(ds, 1234)
    batches = [np.arange(k * BATCH, (k + 1) * BATCH, dtype=np.int64) for k in range(n)]
    ids = [stream.order.ids(b) for b in batches]
    assert np.array_equal(check_rows(ds.read(ids[0])["tokens"], ds.num_samples), ids[0])

    k = itertools.count()
    rows = {"order.ids (64 positions)": mean_of(lambda: stream.order.ids(batches[next(k) % n]), n)}
    k = itertools.count()
    rows["TokenWindows.read (64 ids)"] = mean_of(lambda: ds.read(ids[next(k) % n]), n)
    loader = detdata.DataLoader(ds, global_batch_size=BATCH, seed=1234)
    batch_iter = iter(loader)
    rows["detdata.DataLoader next() (num_workers=0)"] = mean_of(lambda: next(batch_iter), n)
    print(f"microseconds per batch of {BATCH} x 2 KiB token windows:")
    for name, seconds in rows.items():
        print(f"  {name:44s} {seconds * 1e6:8.1f} us")
    print(profile(lambda: next(batch_iter), n, top=14))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
