"""Remote reads at link speed: lookahead prefetch and range coalescing over an emulated link.

``python -m benchmarks.remote [--smoke] [--out DIR] [--doc]`` (``--doc``: the table, with the
command, date, commit, machine and load average, into ``docs/benchmarks.md`` between the
markers of `benchmarks.remote_report`; ``--report JSON``: only that, from a saved run)

Starts nginx (HTTP; Twisted's web server where nginx is absent) and SeaweedFS (S3) on
127.0.0.1 (tests/servers.py), writes a token corpus ~10x larger than the shard cache bound
(``shard_cache_bytes``) to both, and puts the fault proxy (tests/faultproxy.py) in front of
each, emulating a link of ``bandwidth_bps`` bytes/s and ``latency_s`` per request, in a
process of its own (`ProxyProcess`: the emulated network must not compete with the loader for
its GIL). For each store and order it runs a `detdata.DataLoader` for ``--seconds`` and reports:

* ``samples_per_s`` after warm-up, and ``link_fraction``: that rate over the link's
  ceiling ``bandwidth / sample_bytes`` (target >= 0.70 with a locality-aware order);
* ``measured_ceiling_samples_per_s`` / ``measured_fraction``: what this machine moves
  through the proxy and server with nothing else running (`probe_ceiling`: whole shards
  on 4 connections of the same fsspec client), and the rate over it: on a small machine
  the proxy, the server and the loader share the cores, so the link is not the only limit;
* ``disk_ceiling_samples_per_s``: what this machine's disk takes in fresh files written
  as a cache fill writes them (`probe_disk`: write, ``fsync``, rename), and
  ``machine_fraction``: the rate over the lowest ceiling that applies to the row (link,
  measured, and the disk where shards are read through cached copies);
* ``loader_cpu_per_s`` / ``proxy_cpu_per_s``: CPU seconds per second of the loader's and
  the proxy's processes after warm-up (``torch_threads`` in the JSON: torch's intra-op
  threads, which the batch copies use; ``--torch-threads`` sets them);
* ``fetched_per_delivered``: answer bytes through the proxy (HTTP headers included) over
  the bytes delivered (target <= 1.2);
* ``stall_s`` / ``stalled_reads``: time readers waited for a shard copy (the cache's
  ``stall_s``) after warm-up, and reads that waited at all (target: none with the paced
  consumer). Warm-up ends when one cache bound of samples has been delivered (the
  lookahead has first reached its depth), and lasts at least ``Size.warmup`` batches.
  The paced consumer asks for `PACE` of the lower of the link's ceiling and the measured
  ceiling below: a consumer as fast as the link waits for the link by definition;
* ``requests`` through the proxy.

Orders: ``locality-v1`` (`detdata.LocalityOrder`: a keyed permutation of shards, then of
samples within each window of ``k`` consecutive shards) and ``feistel-v1`` (the default
global shuffle, for comparison: with a cache 10x smaller than the data it re-fetches
shards). Modes: ``default`` (no setting but the order: `TokenWindows`' default cache of a
remote root, a per-user folder -- here a fresh one per row through ``DETDATA_CACHE_DIR`` --
and `DataLoader`'s default lookahead and read-ahead; measured over the first epoch at most,
after the lookahead's first window), ``default bound/10`` (the same with
``shard_cache_bytes`` a tenth of the corpus: a corpus larger than the default cache, which
only a locality order engages), ``cache+lookahead`` (``cache_dir`` + ``lookahead`` as far
ahead as the cache bound holds; the bound cuts the window) and ``ranges``
(``cache_dir=None``: coalesced range reads, the default before the default cache).
``--modes`` picks some. A summary under the table gives both ceilings and the load average.

`remote_rows(...)` returns the rows (list of dicts) for other reports.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

import detdata
from benchmarks import remote_report
from benchmarks.matrix_report import provenance
from detdata import Storage
from detdata.datasets.tokens import TokenWindows
from tests.faultproxy import FaultProxy, Link, Plan, clean
from tests.servers import start_http, start_seaweedfs, stop_pid


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
    shards=160,
    tokens_per_shard=2 << 20,  # 4 MiB of uint16 per shard, 640 MiB in all (a 16-shard cache)
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


# ---------------------------------------------------------------------------- the link
@dataclass(frozen=True)
class ProxyStats:
    """Counters of a `ProxyProcess` (those of `tests.faultproxy.Stats` the rows use), and
    the CPU seconds the proxy's process has used."""

    connections: int
    requests: int
    bytes_down: int
    bytes_up: int
    cpu_s: float


class ProxyProcess:
    """A `tests.faultproxy.FaultProxy` emulating ``link`` in a process of its own.

    An emulated network must not run on the loader's interpreter: in the loader's process
    the proxy's event loop would compete with the loader's threads for the GIL (a real
    network is the kernel's and the wire's work). Commands go over the child's stdin, one
    line each, answered with one JSON line on its stdout.
    """

    def __init__(self, target_port: int, link: Link) -> None:
        root = Path(__file__).resolve().parent.parent
        args = [str(target_port), repr(link.bandwidth_bps), repr(link.latency_s)]
        code = "import sys; from benchmarks.remote import serve_proxy; serve_proxy(sys.argv[1:])"
        self._proc = subprocess.Popen(
            [sys.executable, "-c", code, *args],
            cwd=root,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        self._mutex = threading.Lock()
        self.port = int(self._ask("port")["port"])

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def _ask(self, command: str) -> dict[str, Any]:
        with self._mutex:
            assert self._proc.stdin is not None and self._proc.stdout is not None
            self._proc.stdin.write(command + "\n")
            self._proc.stdin.flush()
            line = self._proc.stdout.readline()
        if not line:
            raise RuntimeError(f"the proxy process exited (code {self._proc.poll()})")
        answer: dict[str, Any] = json.loads(line)
        return answer

    def set_plan(self, plan: Plan) -> None:
        """Fresh counters; open connections are reset (only the clean plan crosses)."""
        if plan is not clean:
            raise ValueError("a ProxyProcess runs the clean plan only")
        self._ask("reset")

    @property
    def stats(self) -> ProxyStats:
        return ProxyStats(**self._ask("stats"))

    def stop(self) -> None:
        if self._proc.poll() is None:
            with contextlib.suppress(OSError, RuntimeError, ValueError):
                self._ask("stop")
            try:
                self._proc.wait(10)
            except subprocess.TimeoutExpired:
                self._proc.kill()
                self._proc.wait(10)


def serve_proxy(argv: list[str]) -> None:
    """The child of `ProxyProcess`: ``argv`` = target port, bandwidth (or None), latency."""
    bandwidth = None if argv[1] == "None" else float(argv[1])
    proxy = FaultProxy(int(argv[0]), link=Link(bandwidth_bps=bandwidth, latency_s=float(argv[2])))
    proxy.start()

    def answer(obj: dict[str, Any]) -> None:
        sys.stdout.write(json.dumps(obj) + "\n")
        sys.stdout.flush()

    try:
        for line in sys.stdin:
            command = line.strip()
            if command == "port":
                answer({"port": proxy.port})
            elif command == "reset":
                proxy.set_plan(clean)
                answer({})
            elif command == "stats":
                st = proxy.stats
                times = os.times()
                answer(
                    {
                        "connections": st.connections,
                        "requests": st.requests,
                        "bytes_down": st.bytes_down,
                        "bytes_up": st.bytes_up,
                        "cpu_s": times.user + times.system,
                    }
                )
            elif command == "stop":
                answer({})
                break
    finally:
        proxy.stop()


# ---------------------------------------------------------------------------- stores
@dataclass
class Store:
    name: str
    url: str  # the corpus root, through the proxy
    options: dict[str, Any]
    proxy: ProxyProcess
    paths: list[str]  # the corpus's files, relative to url
    server: str  # the server's software: nginx, twisted or seaweedfs
    ceiling_bps: float = 0.0  # measured by `probe_ceiling` (answer bytes/s)
    probe_cpu_per_s: float = 0.0  # the proxy's CPU seconds per second during the probe

    def ceiling_samples_per_s(self, sample_bytes: int) -> float:
        return self.ceiling_bps / sample_bytes


PROBE_CONNECTIONS = 4
PROBE_ROUNDS = 3


def probe_ceiling(store: Store, files: int) -> None:
    """What this machine moves through the emulated link with nothing else running: the
    first ``files`` files of the corpus, whole, on `PROBE_CONNECTIONS` threads of one
    fsspec file system (the loader's client stack), best of `PROBE_ROUNDS` rounds. Sets
    ``store.ceiling_bps`` (answer bytes through the proxy, headers included, per second)."""
    from detdata.storage.fs import filesystem, join

    fs, root = filesystem(store.url, **store.options)
    paths = [join(root, p) for p in store.paths[:files]]
    best = 0.0
    for _ in range(PROBE_ROUNDS):
        store.proxy.set_plan(clean)
        before = store.proxy.stats
        began = time.monotonic()
        todo = iter(paths)
        threads = [
            threading.Thread(target=_pull, args=(fs, todo)) for _ in range(PROBE_CONNECTIONS)
        ]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        took = time.monotonic() - began
        after = store.proxy.stats
        rate = (after.bytes_down - before.bytes_down) / took
        if rate > best:
            best = rate
            store.probe_cpu_per_s = (after.cpu_s - before.cpu_s) / took
    store.ceiling_bps = best


def probe_disk(folder: Path, file_bytes: int, files: int) -> float:
    """Bytes/s this machine's disk takes in fresh files written as a cache fill writes
    them (``file_bytes`` each: write, flush, rename into place, with ``fsync`` only where
    the cache syncs, i.e. where there is no boot id: `detdata.storage.boot`; all
    kept until the last is written, as a cache that holds the corpus keeps them): as many
    bytes as the corpus, so that a disk which slows down once its write cache is full shows
    it (this machine's virtual disk, synced: ~400 MB/s for the first ~100 MB, then ~63
    MB/s). A fill can go no faster. Unsynced, the page cache takes them at the speed the
    machine gives new memory pages: here (a VM whose never-used pages are backed on first
    touch) ~70-90 MB/s, against ~3 GB/s for pages just freed by another file; on a common
    machine, memory speed up to the kernel's dirty-page limits (~10-20% of memory), then
    the disk's."""
    from detdata.storage.boot import boot_id

    sync = boot_id() is None
    data = os.urandom(file_bytes)
    folder.mkdir(parents=True, exist_ok=True)
    began = time.monotonic()
    for i in range(files):
        tmp, final = folder / f"f{i}.part", folder / f"f{i}"
        with open(tmp, "wb") as fh:
            fh.write(data)
            fh.flush()
            if sync:
                os.fsync(fh.fileno())
        os.replace(tmp, final)
    rate = files * file_bytes / (time.monotonic() - began)
    shutil.rmtree(folder)
    return rate


_NEXT = threading.Lock()


def _pull(fs: Any, todo: Iterator[str]) -> None:
    while True:
        with _NEXT:
            path = next(todo, None)
        if path is None:
            return
        fs.cat_file(path)


def torch_threads() -> int:
    import torch

    return int(torch.get_num_threads())


def write_corpus(directory: Path, size: Size) -> None:
    directory.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(2024)
    for i in range(size.shards):
        tokens = rng.integers(0, 50_000, size.tokens_per_shard + 1).astype(np.uint16)
        np.save(directory / f"shard-{i:05d}.npy", tokens)


@contextlib.contextmanager
def stores(work: Path, corpus: Path, size: Size, which: tuple[str, ...]) -> Iterator[list[Store]]:
    """nginx (Twisted where nginx is absent) and/or SeaweedFS serving ``corpus``, each
    behind an emulated link."""
    link = Link(bandwidth_bps=size.bandwidth_bps, latency_s=size.latency_s)
    pids: list[int] = []
    proxies: list[ProxyProcess] = []
    out: list[Store] = []
    names = [f.name for f in sorted(corpus.iterdir())]
    try:
        if "http" in which:
            http = start_http(work / "http")  # nginx where the machine has it, else Twisted
            pids.append(http.pid)
            directory, _ = http.new_dir()
            for f in sorted(corpus.iterdir()):
                shutil.copyfile(f, directory / f.name)
            proxy = ProxyProcess(http.port, link)
            proxies.append(proxy)
            url = f"http://{proxy.address}/{directory.name}"
            out.append(Store("http", url, {}, proxy, names, http.software))
        if "s3" in which:
            import s3fs

            s3 = start_seaweedfs(work / "weed")
            pids.append(s3.pid)
            fs = s3fs.S3FileSystem(**s3.storage_options())
            prefix = f"{s3.bucket}/{uuid.uuid4().hex[:10]}"
            for f in sorted(corpus.iterdir()):
                fs.pipe_file(f"{prefix}/{f.name}", f.read_bytes())
            proxy = ProxyProcess(s3.port, link)
            proxies.append(proxy)
            opts = s3.storage_options(endpoint=f"http://{proxy.address}")
            out.append(Store("s3", f"s3://{prefix}", opts, proxy, names, "seaweedfs"))
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
    default = mode.startswith("default")
    # the default cache's folder: a fresh one per row (the variable chooses the folder only)
    os.environ["DETDATA_CACHE_DIR"] = str(work / f"user-cache-{uuid.uuid4().hex[:8]}")
    options: dict[str, Any] = {}
    if not default:
        options = {"cache_dir": cache, "shard_cache_bytes": bound if cache is not None else None}
    elif mode == "default bound/10":
        options = {"shard_cache_bytes": bound}
    ds = TokenWindows(
        manifest.with_root(store.url),
        size.seq_len,
        storage=Storage(verify="off", fs_options=store.options, **options),
    )
    row: dict[str, Any] = {
        "store": store.name,
        "server": store.server,
        "order": order,
        "mode": mode,
        "bandwidth_MBps": size.bandwidth_bps / 1e6,
        "latency_ms": size.latency_s * 1e3,
        "dataset_bytes": sum(s.bytes for s in manifest.shards),
        "cache_bytes": bound if cache is not None else None,
    }
    stream = make_stream(order, ds, size)  # a locality order may engage the default cache
    if default:
        row["cache_bytes"] = ds.files.shard_cache_bytes if ds.files.cache_dir is not None else None
    sample_bytes = size.seq_len * 2
    ceiling = size.bandwidth_bps / sample_bytes
    probed = store.ceiling_samples_per_s(sample_bytes)
    # the paced consumer asks for PACE of what this machine can move (the link, or less
    # when the proxy, the server and the loader share too few cores)
    paced_rate = None if pace is None else pace * min(ceiling, probed)
    per_shard = size.tokens_per_shard // size.seq_len
    # as far ahead as the cache holds: the byte bound cuts the window shorter where it must
    lookahead = max(1, (bound // shard_bytes) * per_shard // size.batch)
    # warm-up: until the lookahead first reaches its depth (one cache bound of samples
    # delivered), and at least `size.warmup` batches (feistel-v1, which refetches shards
    # at ~30 samples/s, only the latter)
    warmup = size.warmup
    if cache is not None and order != "feistel-v1":
        warmup = max(warmup, -(-bound // (sample_bytes * size.batch)))
    limit = size.seconds if order != "feistel-v1" else size.seconds / 2
    last = None  # default modes: the first epoch only (a cache holding the corpus hits after)
    if default:
        loader = detdata.DataLoader(stream, global_batch_size=size.batch, seed=7)
        if ds.files.cache_dir is not None:  # until the default lookahead first reaches its depth
            from detdata.loading.loader import DEFAULT_STEPS_AHEAD

            warmup = max(warmup, DEFAULT_STEPS_AHEAD)
        last = ds.num_samples // size.batch
        warmup = min(warmup, last // 2)
        limit = size.seconds
    else:
        loader = detdata.DataLoader(
            stream,
            global_batch_size=size.batch,
            seed=7,
            options=detdata.LoaderOptions(
                read=detdata.ReadOptions(
                    batches_ahead=READ_AHEAD, steps_ahead=lookahead if cache is not None else 0
                )
            ),
        )
    store.proxy.set_plan(clean)  # fresh counters; open connections are closed
    began = time.monotonic()
    warm_at = began
    warm_proxy = store.proxy.stats
    warm_cpu = time.process_time()
    warm_stall = 0.0
    warm_stalls = 0
    batches = 0
    it = iter(loader)
    try:
        while True:
            next(it)
            batches += 1
            now = time.monotonic()
            if pace is not None and batches > warmup:  # a consumer slower than the link
                assert paced_rate is not None
                due = warm_at + (batches - warmup) * size.batch / paced_rate
                if due > now:
                    time.sleep(due - now)
                    now = time.monotonic()
            if batches == warmup:
                warm_at = now
                warm_proxy, warm_cpu = store.proxy.stats, time.process_time()
                stats = ds.files.shard_cache.stats if ds.files.shard_cache is not None else None
                warm_stall = stats.stall_s if stats else 0.0
                warm_stalls = stats.stalls if stats else 0
            if batches >= warmup + 2 * READ_AHEAD and now - began >= limit:
                break
            if last is not None and batches >= last:
                break
        end = time.monotonic()
        end_cpu = time.process_time()
        proxy = store.proxy.stats  # before close: fills still running are not counted
    finally:
        loader.close()
    measured = (batches - warmup) * size.batch
    rate = measured / (end - warm_at)
    stats = ds.files.shard_cache.stats if ds.files.shard_cache is not None else None
    delivered = batches * size.batch * sample_bytes
    return {
        **row,
        "samples_per_s": round(rate, 1),
        "link_ceiling_samples_per_s": round(ceiling, 1),
        "link_fraction": round(rate / ceiling, 3),
        "paced_samples_per_s": None if paced_rate is None else round(paced_rate, 1),
        "measured_ceiling_samples_per_s": round(probed, 1),
        "measured_fraction": round(rate / probed, 3),
        "probe_proxy_cpu_per_s": round(store.probe_cpu_per_s, 2),
        "probe_connections": PROBE_CONNECTIONS,
        "loader_cpu_per_s": round((end_cpu - warm_cpu) / (end - warm_at), 2),
        "proxy_cpu_per_s": round((proxy.cpu_s - warm_proxy.cpu_s) / (end - warm_at), 2),
        "torch_threads": torch_threads(),
        "fetched_per_delivered": round(proxy.bytes_down / delivered, 3),
        "fetched_per_delivered_after_warmup": round(
            (proxy.bytes_down - warm_proxy.bytes_down) / (measured * sample_bytes), 3
        ),
        "requests": proxy.requests,
        "requests_after_warmup": proxy.requests - warm_proxy.requests,
        "stall_s": None if stats is None else round(stats.stall_s - warm_stall, 3),
        "stalled_reads": None if stats is None else stats.stalls - warm_stalls,
        "batches": batches,
        "warmup_batches": warmup,
        "seconds": round(end - began, 2),
    }


PACE = 0.8  # the paced consumer asks for 80% of the lower ceiling (stalls should be 0)
READ_AHEAD = 4  # micro batches per read: finer timing than the default 16
ORDERS = ("locality-v1", "feistel-v1")
#: ``default``: no setting but the order (the default cache and lookahead); ``default
#: bound/10``: the same with ``shard_cache_bytes`` a tenth of the corpus (a corpus larger
#: than the default cache's bound); ``ranges``: ``cache_dir=None`` (the default before the
#: default cache: coalesced range reads).
MODES = ("default", "default bound/10", "cache+lookahead", "cache+lookahead paced", "ranges")


def remote_rows(
    *,
    smoke: bool = False,
    which: tuple[str, ...] = ("http", "s3"),
    orders: tuple[str, ...] = ORDERS,
    modes: tuple[str, ...] = MODES,
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
        shard_bytes = max(s.bytes for s in manifest.shards)
        disk_bps = probe_disk(base / "disk-probe", shard_bytes, size.shards)
        with stores(base, corpus, size, which) as served:
            for store in served:
                probe_ceiling(store, min(size.shards, 24))
                for mode in modes:
                    for order in orders:
                        if mode.endswith("paced") and order == "feistel-v1":
                            continue  # far below the link: pacing changes nothing
                        rows.append(run_one(store, manifest, order, mode, size, base))
        for row in rows:
            disk = disk_bps / (size.seq_len * 2)
            ceilings = [row["link_ceiling_samples_per_s"], row["measured_ceiling_samples_per_s"]]
            if row["cache_bytes"] is not None:  # reads go through copies written to disk
                ceilings.append(disk)
            row["disk_ceiling_samples_per_s"] = round(disk, 1)
            row["machine_fraction"] = round(row["samples_per_s"] / min(ceilings), 3)
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
    "measured_ceiling_samples_per_s",
    "measured_fraction",
    "disk_ceiling_samples_per_s",
    "machine_fraction",
    "fetched_per_delivered",
    "stall_s",
    "stalled_reads",
    "requests_after_warmup",
    "loader_cpu_per_s",
    "proxy_cpu_per_s",
    "batches",
)


def table(rows: list[dict[str, Any]]) -> str:
    lines = ["| " + " | ".join(COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
    for r in rows:
        lines.append("| " + " | ".join(str(r.get(c, "")) for c in COLUMNS) + " |")
    return "\n".join(lines)


def summary(rows: list[dict[str, Any]], before: tuple[float, ...], after: tuple[float, ...]) -> str:
    """The ceilings the rows are measured against, and the machine's load."""
    lines = []
    for r in {r["store"]: r for r in rows}.values():
        lines.append(
            f"{r['store']}: link ceiling {r['link_ceiling_samples_per_s']} samples/s "
            f"({r['bandwidth_MBps']:g} MB/s, {r['latency_ms']:g} ms); measured ceiling "
            f"{r['measured_ceiling_samples_per_s']} samples/s ({PROBE_CONNECTIONS} connections "
            f"pulling whole shards, proxy CPU {r['probe_proxy_cpu_per_s']} s/s)"
        )
    if rows:
        lines.append(
            f"disk ceiling {rows[0]['disk_ceiling_samples_per_s']} samples/s (fresh files "
            "written and renamed as a cache fill does; bounds the cached modes)"
        )
    lines.append(
        f"torch threads {rows[0]['torch_threads'] if rows else '?'}; load average "
        f"{before[0]:.2f} before, {after[0]:.2f} after ({os.cpu_count()} CPUs)"
    )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--smoke", action="store_true", help="tiny sizes (CI)")
    parser.add_argument("--out", default=None, help="directory for remote.json / remote.md")
    parser.add_argument("--stores", default="http,s3")
    parser.add_argument("--modes", default=",".join(MODES), help="a subset of " + ",".join(MODES))
    parser.add_argument("--seconds", type=float, default=None)
    parser.add_argument(
        "--shards",
        type=int,
        default=None,
        help=f"shards of 4 MiB (default {FULL.shards}; the cache holds a tenth of them)",
    )
    parser.add_argument(
        "--torch-threads",
        type=int,
        default=None,
        help="torch.set_num_threads(N) first (default: torch's own; see torch_threads)",
    )
    parser.add_argument("--doc", action="store_true", help="the table into docs/benchmarks.md")
    parser.add_argument("--report", default=None, help="only --doc, from this remote.json")
    args = parser.parse_args(argv)
    if args.report:
        saved = json.loads(Path(args.report).read_text())
        remote_report.write_doc(remote_report.markdown(saved))
        remote_report.figure(saved)
        return 0
    # a SIGTERM (``timeout``) unwinds like Ctrl-C, so the servers and proxies are stopped
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    if args.torch_threads is not None:
        import torch

        torch.set_num_threads(args.torch_threads)
    size = SMOKE if args.smoke else FULL
    if args.seconds is not None:
        size = dataclasses.replace(size, seconds=args.seconds)
    if args.shards is not None:
        size = dataclasses.replace(size, shards=args.shards)
    command = "python -m benchmarks.remote " + shlex.join(sys.argv[1:] if argv is None else argv)
    prov = provenance(command.strip())
    load = os.getloadavg()
    rows = remote_rows(
        size=size, which=tuple(args.stores.split(",")), modes=tuple(args.modes.split(","))
    )
    text = table(rows) + "\n\n" + summary(rows, load, os.getloadavg())
    print(text)
    prov["load_after"] = round(os.getloadavg()[0], 1)
    doc = {"size": dataclasses.asdict(size), "rows": rows, remote_report.PROVENANCE: prov}
    if args.doc:
        remote_report.write_doc(remote_report.markdown(doc))
        remote_report.figure(doc)
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "remote.json").write_text(json.dumps(doc, indent=1))
        (out / "remote.md").write_text("# Remote reads over an emulated link\n\n" + text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
