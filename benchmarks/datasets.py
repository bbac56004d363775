"""Throughput of `TokenWindows.read` and `TableRows.read` against per-sample baselines.

Run: ``python benchmarks/datasets.py [--batches N] [--out DIR]``. Prints samples/s
for batches of 64 random ids:

* tokens: 512-token int32 windows (+1 label) from 8 ``.npy`` shards, detdata
  vs a per-sample Python loop of slices of ``np.load(mmap_mode="r")`` arrays
  (opened once, outside the timing).
* parquet: ``list<int32>`` rows of 512 from 4 shards (row groups of 1024 rows),
  detdata with its default cache (8 row groups: random ids decode most groups)
  and with a cache holding every group (warm), vs a per-sample ``Table.slice``
  loop over tables already decoded in memory (load time excluded); plus the
  same rows as memory-mapped Arrow IPC (no decode) with the default cache.

Files are in the OS page cache (just written), so this measures CPU cost, not disk.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.ipc as ipc
import pyarrow.parquet as pq

if not __package__:  # run as ``python benchmarks/datasets.py``: benchmarks.* from this checkout
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.timing import Stopwatch
from detdata import TableRows, TokenWindows, build_manifest

SEQ = 512
BATCH = 64


def rate(fn: Callable[[np.ndarray], object], batches: list[np.ndarray]) -> float:
    """Samples per second of ``fn`` over ``batches`` (after two warm-up calls)."""
    for ids in batches[:2]:
        fn(ids)
    with Stopwatch() as clock:
        for ids in batches:
            fn(ids)
    return sum(len(b) for b in batches) / clock.seconds


def bench_tokens(root: Path, n_batches: int) -> dict[str, float]:
    rng = np.random.default_rng(0)
    for i in range(8):
        np.save(root / f"tok-{i}.npy", rng.integers(0, 50_000, size=2_000_000, dtype=np.int32))
    ds = TokenWindows(build_manifest(str(root), pattern="*.npy"), SEQ)
    arrays = [np.load(root / f"tok-{i}.npy", mmap_mode="r") for i in range(8)]
    starts = np.concatenate([[0], np.cumsum(ds.windows_per_shard)[:-1]])

    def baseline(ids: np.ndarray) -> np.ndarray:
        rows = []
        for i in ids.tolist():
            shard = int(np.searchsorted(starts, i, side="right")) - 1
            w = i - int(starts[shard])
            rows.append(np.asarray(arrays[shard][w * SEQ : w * SEQ + SEQ + 1], dtype=np.int32))
        return np.stack(rows)

    batches = [rng.integers(0, ds.num_samples, size=BATCH) for _ in range(n_batches)]
    assert np.array_equal(baseline(batches[0]), ds.read(batches[0])["tokens"])
    return {"detdata": rate(ds.read, batches), "baseline": rate(baseline, batches)}


def bench_parquet(root: Path, n_batches: int) -> dict[str, float]:
    rng = np.random.default_rng(1)
    tables = []
    for i in range(4):
        rows = 16_384
        values = pa.array(rng.integers(0, 50_000, size=rows * SEQ, dtype=np.int32))
        offsets = pa.array(np.arange(0, (rows + 1) * SEQ, SEQ, dtype=np.int32))
        table = pa.table({"tokens": pa.ListArray.from_arrays(offsets, values)})
        pq.write_table(table, root / f"rows-{i}.parquet", row_group_size=1024)
        with ipc.new_file(root / f"rows-{i}.arrow", table.schema) as writer:
            for batch in table.to_batches(max_chunksize=1024):
                writer.write_batch(batch)
        tables.append(pq.read_table(root / f"rows-{i}.parquet"))
    manifest = build_manifest(str(root), pattern="*.parquet")
    small = TableRows(manifest, cache_row_groups=8)
    warm = TableRows(manifest, cache_row_groups=64, row_group_cache_bytes=4 << 30)
    warm.read(np.arange(0, manifest.num_samples, 1024))  # decode every row group once
    shard_rows = np.cumsum([0] + [t.num_rows for t in tables])

    def baseline(ids: np.ndarray) -> np.ndarray:
        rows = []
        for i in ids.tolist():
            shard = int(np.searchsorted(shard_rows, i, side="right")) - 1
            cell = tables[shard].column("tokens").slice(i - int(shard_rows[shard]), 1)
            rows.append(cell.combine_chunks().flatten().to_numpy())
        return np.stack(rows)

    arrow = TableRows(build_manifest(str(root), pattern="*.arrow"), cache_row_groups=8)
    batches = [rng.integers(0, manifest.num_samples, size=BATCH) for _ in range(n_batches)]
    assert np.array_equal(baseline(batches[0]), small.read(batches[0])["tokens"])
    assert np.array_equal(baseline(batches[0]), arrow.read(batches[0])["tokens"])
    return {
        "detdata_cache8": rate(small.read, batches),
        "detdata_warm": rate(warm.read, batches),
        "arrow_cache8": rate(arrow.read, batches),
        "baseline_in_memory": rate(baseline, batches),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batches", type=int, default=200)
    parser.add_argument("--out", type=Path, default=None, help="scratch dir (default: a temp dir)")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(dir=args.out) as tmp:
        tok = bench_tokens(Path(tmp), args.batches)
        print(
            f"tokens  int32 seq {SEQ} batch {BATCH}: detdata {tok['detdata']:,.0f} samples/s, "
            f"per-sample mmap loop {tok['baseline']:,.0f} samples/s "
            f"(x{tok['detdata'] / tok['baseline']:.1f})"
        )
        par = bench_parquet(Path(tmp), max(10, args.batches // 4))
        base = par["baseline_in_memory"]
        print(
            f"parquet list<int32>[{SEQ}] batch {BATCH}: detdata cache=8 "
            f"{par['detdata_cache8']:,.0f} samples/s (x{par['detdata_cache8'] / base:.2f}), "
            f"detdata warm cache {par['detdata_warm']:,.0f} samples/s "
            f"(x{par['detdata_warm'] / base:.1f}), per-sample slice of in-memory tables "
            f"{base:,.0f} samples/s"
        )
        print(
            f"arrow ipc (memory-mapped, same rows, batches of 1024) cache=8: "
            f"{par['arrow_cache8']:,.0f} samples/s (x{par['arrow_cache8'] / base:.1f})"
        )


if __name__ == "__main__":
    main()
