"""Remote reads at link speed: lookahead prefetch and range coalescing over an emulated link.

``python -m benchmarks.remote [--smoke] [--out DIR]``

Starts nginx (HTTP) and SeaweedFS (S3) on 127.0.0.1 (tests/servers.py), writes a token
corpus ~10x larger than the shard cache bound (``shard_cache_bytes``) to both, and puts
the fault proxy (tests/faultproxy.py) in front of each, emulating a link of
``--bandwidth`` bytes/s and ``--latency`` s per request. For each store and order it runs
a `detdata.DataLoader` for ``--seconds`` and reports:

* ``samples_per_s`` after warm-up, and ``link_fraction``: that rate over the link's
  ceiling ``bandwidth / sample_bytes`` (target >= 0.70 with a locality-aware order);
* ``fetched_per_delivered``: answer bytes through the proxy (HTTP headers included) over
  the bytes delivered (target <= 1.2);
* ``stall_s`` / ``stalled_batches``: time readers waited for a shard copy (the cache's
  ``stall_s``) after the first ``--warmup`` batches, and batches that waited at all
  (target: none);
* ``requests`` through the proxy.

Orders: ``locality-v1`` (`detdata.LocalityOrder`: a keyed permutation of shards, then of
samples within each window of ``k`` consecutive shards) and ``feistel-v1`` (the default
global shuffle, for comparison: with a cache 10x smaller than the data it re-fetches
shards). Modes: ``cache+lookahead`` (``cache_dir`` + ``lookahead``) and ``ranges`` (no
cache: coalesced range reads).

`remote_rows(...)` returns the rows (list of dicts) for other reports.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import shutil
import sys
import tempfile
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

import detdata
from detdata.datasets.tokens import TokenWindows
from tests.faultproxy import FaultProxy, Link, clean
from tests.servers import start_nginx, start_seaweedfs, stop_pid


@dataclass(frozen=True, kw_only=True)
class Size:
    shards: int
    tokens_per_shard: int
    seq_len: int
    batch: int
    bandwidth_bps: float
    latency_s: float
    seconds: float
    warmup: int
    window_shards: int


FULL = Size(
    shards=64,
    tokens_per_shard=2 << 20,  # 4 MiB of uint16 per shard, 256 MiB in all
    seq_len=2048,
    batch=32,
    bandwidth_bps=200e6,
    latency_s=0.02,
    seconds=10.0,
    warmup=32,
    window_shards=2,
)
SMOKE = Size(
    shards=30,
    tokens_per_shard=64 << 10,  # 128 KiB per shard
    seq_len=256,
    batch=16,
    bandwidth_bps=20e6,
    latency_s=0.005,
    seconds=0.5,
    warmup=8,
    window_shards=2,
)


# ---------------------------------------------------------------------------- orders
# ---------------------------------------------------------------------------- stores
@dataclass
class Store:
    name: str
    url: str  # the corpus root, through the proxy
    options: dict[str, Any]
    proxy: FaultProxy


def write_corpus(directory: Path, size: Size) -> None:
    directory.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(2024)
    for i in range(size.shards):
        tokens = rng.integers(0, 50_000, size.tokens_per_shard + 1).astype(np.uint16)
        np.save(directory / f"shard-{i:05d}.npy", tokens)


@contextlib.contextmanager
def stores(work: Path, corpus: Path, size: Size, which: tuple[str, ...]) -> Iterator[list[Store]]:
    """nginx and/or SeaweedFS serving ``corpus``, each behind an emulated link."""
    link = Link(bandwidth_bps=size.bandwidth_bps, latency_s=size.latency_s)
    pids: list[int] = []
    proxies: list[FaultProxy] = []
    out: list[Store] = []
    try:
        if "http" in which:
            http = start_nginx(work / "nginx")
            pids.append(http.pid)
            directory, _ = http.new_dir()
            for f in sorted(corpus.iterdir()):
                shutil.copyfile(f, directory / f.name)
            proxy = FaultProxy(http.port, link=link).start()
            proxies.append(proxy)
            out.append(Store("http", f"http://{proxy.address}/{directory.name}", {}, proxy))
        if "s3" in which:
            import s3fs

            s3 = start_seaweedfs(work / "weed")
            pids.append(s3.pid)
            fs = s3fs.S3FileSystem(**s3.storage_options())
            prefix = f"{s3.bucket}/{uuid.uuid4().hex[:10]}"
            for f in sorted(corpus.iterdir()):
                fs.pipe_file(f"{prefix}/{f.name}", f.read_bytes())
            proxy = FaultProxy(s3.port, link=link).start()
            proxies.append(proxy)
            opts = s3.storage_options(endpoint=f"http://{proxy.address}")
            out.append(Store("s3", f"s3://{prefix}", opts, proxy))
        yield out
    finally:
        for proxy in proxies:
            proxy.stop()
        for pid in pids:
            stop_pid(pid, 5.0)


# ---------------------------------------------------------------------------- runs
def make_stream(order: str, ds: TokenWindows, size: Size) -> Any:
    if order == "feistel-v1":
        return ds  # the loader orders a plain dataset with GlobalOrder (feistel-v1)
    return detdata.OrderedStream(
        ds, 7, order=detdata.LocalityOrder(window_shards=size.window_shards)
    )


def run_one(
    store: Store, manifest: detdata.Manifest, order: str, mode: str, size: Size, work: Path
) -> dict[str, Any]:
    """One loader over ``store`` for ``size.seconds``; the row of measurements."""
    shard_bytes = max(s.bytes for s in manifest.shards)
    bound = max(shard_bytes, sum(s.bytes for s in manifest.shards) // 10)
    cache = work / f"cache-{uuid.uuid4().hex[:8]}" if mode.startswith("cache") else None
    pace = PACE if mode.endswith("paced") else None
    ds = TokenWindows(
        manifest.with_root(store.url),
        size.seq_len,
        verify="off",
        storage_options=store.options,
        cache_dir=cache,
        shard_cache_bytes=bound if cache is not None else None,
    )
    row: dict[str, Any] = {
        "store": store.name,
        "order": order,
        "mode": mode,
        "bandwidth_MBps": size.bandwidth_bps / 1e6,
        "latency_ms": size.latency_s * 1e3,
        "dataset_bytes": sum(s.bytes for s in manifest.shards),
        "cache_bytes": bound if cache is not None else None,
    }
    stream = make_stream(order, ds, size)
    sample_bytes = size.seq_len * 2
    ceiling = size.bandwidth_bps / sample_bytes
    per_shard = size.tokens_per_shard // size.seq_len
    lookahead = max(1, 2 * size.window_shards * per_shard // size.batch)
    loader = detdata.DataLoader(
        stream,
        global_batch_size=size.batch,
        seed=7,
        lookahead=lookahead if cache is not None else 0,
        read_ahead=READ_AHEAD,
    )
    store.proxy.set_plan(clean)  # fresh counters; open connections are closed
    began = time.monotonic()
    warm_at = began
    warm_bytes = warm_requests = 0
    warm_stall = 0.0
    warm_stalls = 0
    batches = 0
    limit = size.seconds if order != "feistel-v1" else size.seconds / 2
    it = iter(loader)
    try:
        while True:
            next(it)
            batches += 1
            now = time.monotonic()
            if pace is not None and batches > size.warmup:  # a consumer slower than the link
                due = warm_at + (batches - size.warmup) * size.batch / (pace * ceiling)
                if due > now:
                    time.sleep(due - now)
                    now = time.monotonic()
            if batches == size.warmup:
                warm_at = now
                warm_bytes, warm_requests = store.proxy.stats.bytes_down, store.proxy.stats.requests
                stats = ds.shard_cache.stats if ds.shard_cache is not None else None
                warm_stall = stats.stall_s if stats else 0.0
                warm_stalls = stats.stalls if stats else 0
            if batches >= size.warmup + 2 * READ_AHEAD and now - began >= limit:
                break
    finally:
        loader.close()
    end = time.monotonic()
    measured = (batches - size.warmup) * size.batch
    rate = measured / (end - warm_at)
    stats = ds.shard_cache.stats if ds.shard_cache is not None else None
    delivered = batches * size.batch * sample_bytes
    return {
        **row,
        "samples_per_s": round(rate, 1),
        "link_ceiling_samples_per_s": round(ceiling, 1),
        "link_fraction": round(rate / ceiling, 3),
        "fetched_per_delivered": round(store.proxy.stats.bytes_down / delivered, 3),
        "fetched_per_delivered_after_warmup": round(
            (store.proxy.stats.bytes_down - warm_bytes) / (measured * sample_bytes), 3
        ),
        "requests": store.proxy.stats.requests,
        "requests_after_warmup": store.proxy.stats.requests - warm_requests,
        "stall_s": None if stats is None else round(stats.stall_s - warm_stall, 3),
        "stalled_reads": None if stats is None else stats.stalls - warm_stalls,
        "batches": batches,
        "warmup_batches": size.warmup,
        "seconds": round(end - began, 2),
    }


PACE = 0.8  # the paced consumer asks for 80% of the link's ceiling (stalls should be 0)
READ_AHEAD = 4  # micro batches per read: finer timing than the default 16
ORDERS = ("locality-v1", "feistel-v1")


def remote_rows(
    *,
    smoke: bool = False,
    which: tuple[str, ...] = ("http", "s3"),
    orders: tuple[str, ...] = ORDERS,
    modes: tuple[str, ...] = ("cache+lookahead", "cache+lookahead paced", "ranges"),
    workdir: str | Path | None = None,
    size: Size | None = None,
) -> list[dict[str, Any]]:
    """The benchmark's rows (one per store x order x mode), as plain dicts."""
    size = size or (SMOKE if smoke else FULL)
    base = (
        Path(workdir) if workdir is not None else Path(tempfile.mkdtemp(prefix="detdata-remote-"))
    )
    try:
        corpus = base / "corpus"
        write_corpus(corpus, size)
        manifest = detdata.build_manifest(str(corpus), pattern="*.npy")
        rows = []
        with stores(base, corpus, size, which) as served:
            for store in served:
                for mode in modes:
                    for order in orders:
                        if mode.endswith("paced") and order == "feistel-v1":
                            continue  # far below the link: pacing changes nothing
                        rows.append(run_one(store, manifest, order, mode, size, base))
        return rows
    finally:
        if workdir is None:
            shutil.rmtree(base, ignore_errors=True)


COLUMNS = (
    "store",
    "order",
    "mode",
    "samples_per_s",
    "link_fraction",
    "fetched_per_delivered",
    "stall_s",
    "stalled_reads",
    "requests_after_warmup",
    "batches",
)


def table(rows: list[dict[str, Any]]) -> str:
    lines = ["| " + " | ".join(COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
    for r in rows:
        lines.append("| " + " | ".join(str(r.get(c, "")) for c in COLUMNS) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--smoke", action="store_true", help="tiny sizes (CI)")
    parser.add_argument("--out", default=None, help="directory for remote.json / remote.md")
    parser.add_argument("--stores", default="http,s3")
    parser.add_argument("--seconds", type=float, default=None)
    args = parser.parse_args(argv)
    size = SMOKE if args.smoke else FULL
    if args.seconds is not None:
        size = dataclasses.replace(size, seconds=args.seconds)
    rows = remote_rows(size=size, which=tuple(args.stores.split(",")))
    text = table(rows)
    print(text)
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "remote.json").write_text(
            json.dumps({"size": dataclasses.asdict(size), "rows": rows}, indent=1)
        )
        (out / "remote.md").write_text("# Remote reads over an emulated link\n\n" + text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
