"""Cost of re-opening a shard on a handle miss, with the shard cache: before and after.

Run: ``python -m benchmarks.scale_reopen [--smoke]`` (or through `benchmarks.scale`,
which calls `rows`).

With ``cache_dir`` and more shards in use than the handle budget, every read of a shard
whose handle was evicted re-opens its cached copy. Before, each re-open re-checked the
copy's quick digest (size + first and last MiB: a small shard is read whole, twice);
now a copy this process verified is trusted while one ``stat`` shows it unchanged
(`detdata.storage.cache`). Both are measured side by side in one run: "before" is the
same reader with the memo forgotten before every read (`forget_verified`), which is
exactly the old path. A ``memory://`` root stands in for the remote store (fills are
out of the measurement: every copy is filled and verified first). For each shard size:
microseconds per re-open (one window read, best of 3 sweeps, ``max_open_shards=1``
over ``shards`` shards read round robin) and bytes read by ``read``/``pread`` system
calls per re-open (``rchar``; mapped reads do not count).

Also a row per local (no cache) miss for reference: one window from a shard whose
handle is not open (``preadv``, no map kept) with a process budget of 1.
"""

from __future__ import annotations

import argparse
import json
import shutil
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

import fsspec
import numpy as np

from benchmarks.timing import Stopwatch

SEQ = 64


def _rchar() -> int:
    with open("/proc/self/io") as fh:
        for line in fh:
            if line.startswith("rchar:"):
                return int(line.split()[1])
    return 0


def _corpus(work: Path, shards: int, shard_bytes: int) -> tuple[str, str]:
    """(local root, memory:// root) of ``shards`` int32 token shards of ~``shard_bytes``."""
    rng = np.random.default_rng(0)
    local = work / f"local-{shard_bytes}"
    local.mkdir()
    name = f"scale-reopen-{uuid.uuid4().hex}"
    fs = fsspec.filesystem("memory")
    tokens = max(shard_bytes // 4, 2 * SEQ + 1)
    for s in range(shards):
        np.save(local / f"s{s:04d}.npy", rng.integers(0, 2**31 - 1, tokens, dtype=np.int32))
        fs.pipe_file(f"/{name}/s{s:04d}.npy", (local / f"s{s:04d}.npy").read_bytes())
    return str(local), f"memory://{name}"


def _sweep(ds: Any, shards: int, forget: bool) -> tuple[float, float]:
    """(seconds, rchar bytes) per re-open: one window of each shard, round robin."""
    from detdata.storage.verified import forget_verified

    starts = np.asarray(ds._layout.starts)
    best = float("inf")
    read = 0
    for _ in range(3):
        r0 = _rchar()
        with Stopwatch() as clock:
            for s in range(shards):
                if forget:
                    forget_verified()
                ds.read(starts[s : s + 1])
        best = min(best, clock.seconds / shards)
        read = (_rchar() - r0) // shards
    return best, float(read)


def reopen_rows(sizes: tuple[int, ...], shards: int) -> list[dict[str, Any]]:
    """Rows of the module docstring, one per shard size."""
    import detdata
    from detdata.datasets import handles as shard_mod

    rows: list[dict[str, Any]] = []
    work = Path(tempfile.mkdtemp(prefix="scale-reopen-"))
    try:
        for size in sizes:
            local, remote = _corpus(work, shards, size)
            cache = work / f"cache-{size}"
            ds = detdata.TokenWindows(
                detdata.build_manifest(remote),
                SEQ,
                storage=detdata.Storage(
                    cache_dir=cache,
                    shard_cache_bytes=4 * shards * size + (1 << 20),
                    max_open_shards=1,
                    verify="off",
                ),
            )
            _sweep(ds, shards, forget=False)  # fills every copy
            time.sleep(0.15)  # past the racy-clean window: verifications are now trusted
            _sweep(ds, shards, forget=False)
            after, read_after = _sweep(ds, shards, forget=False)
            before, read_before = _sweep(ds, shards, forget=True)
            rows.append(
                {
                    "what": "cached copy re-opened after a handle eviction",
                    "shard_bytes": size,
                    "shards": shards,
                    "us_before": round(1e6 * before, 1),
                    "us_after": round(1e6 * after, 1),
                    "speedup": round(before / after, 1) if after else None,
                    "read_bytes_before": read_before,
                    "read_bytes_after": read_after,
                }
            )
            plain = detdata.TokenWindows(
                detdata.build_manifest(local),
                SEQ,
                storage=detdata.Storage(max_open_shards=1, verify="off"),
            )
            shard_mod.set_max_open_shards(1)
            try:
                miss, _ = _sweep(plain, shards, forget=False)
            finally:
                shard_mod.set_max_open_shards(None)
            rows.append(
                {
                    "what": "local shard not open (preadv), process budget 1",
                    "shard_bytes": size,
                    "shards": shards,
                    "us_after": round(1e6 * miss, 1),
                }
            )
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return rows


def rows(smoke: bool) -> list[dict[str, Any]]:
    """The rows `benchmarks.scale` reports (``smoke``: small and quick)."""
    if smoke:
        return reopen_rows((64 << 10,), 20)
    return reopen_rows((64 << 10, 1 << 20, 4 << 20), 100)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--smoke", action="store_true")
    args = parser.parse_args()
    for row in rows(args.smoke):
        print(json.dumps(row))


if __name__ == "__main__":
    main()
