"""Scale of the identity layer: registry writes, and opening many shards with quick verification.

Run: ``python benchmarks/scale_identity.py [--smoke] [--json FILE]``.

* `registry_rows`: a registry is filled with distinct manifests by ``register``
  (the public call, one name per entry); the rows give the mean and median time
  of the ``window`` registers just before the registry holds each count (100,
  1k, 10k by default). Flat rows mean O(1) amortised per register (each
  register fsyncs: on a loaded machine the mean is noisy, the median less so).
* `open_rows`: ``local_shards`` small ``.npy`` shards on local disk and
  ``remote_shards`` served by nginx on 127.0.0.1 (through a counting TCP proxy,
  `tests.faultproxy.FaultProxy`): the time to build the manifest, to load it
  with quick verification (and, split, to parse it and to verify the parsed
  object), to open ``TokenWindows(registry.resolve(name))`` (resolve
  verifies; the dataset must not verify the same object again), and for the
  remote store the HTTP requests issued (counted by an aiohttp trace hook in
  the client) and the bytes the server sent (counted by the proxy, headers
  included) per byte of data.

The benchmark uses only public calls that existed before issue 18, so the same
file measures an older checkout (``PYTHONPATH=/path/to/old/checkout``).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

if not __package__:  # run as ``python benchmarks/scale_identity.py``
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    if os.environ.get("PYTHONPATH"):  # an older checkout to measure goes first
        for entry in reversed(os.environ["PYTHONPATH"].split(os.pathsep)):
            sys.path.insert(0, entry)

SMOKE_REGISTRY = (20, 50, 100)
SMOKE_LOCAL, SMOKE_REMOTE = 300, 100


# ------------------------------------------------------------------ registry
def _tiny_manifest(i: int) -> Any:
    from detdata.identity.entry import ShardEntry
    from detdata.identity.formats import Format
    from detdata.identity.manifest import Manifest

    digest = "b3:" + f"{i:064x}"
    entry = ShardEntry(
        path=f"s-{i}.npy",
        bytes=228,
        blake3=digest,
        quick=digest,
        num_samples=50,
        format=Format.NPY,
        dtype="uint16",
        data_offset=128,
    )
    return Manifest(shards=(entry,), metadata={"entry": i})


def registry_rows(
    counts: Sequence[int] = (100, 1_000, 10_000), *, window: int = 100, root: str | None = None
) -> list[dict[str, Any]]:
    """Mean seconds per ``register`` over the ``window`` registers ending at each count."""
    from detdata.identity.registry import Registry

    work = root or tempfile.mkdtemp(prefix="detdata-reg-bench-")
    reg = Registry(os.path.join(work, "registry"))
    rows: list[dict[str, Any]] = []
    done = 0
    try:
        for count in sorted(counts):
            first_timed = max(done, count - window)
            for i in range(done, first_timed):
                reg.register(f"ds-{i}@v1", _tiny_manifest(i))
            times = []
            for i in range(first_timed, count):
                start = time.perf_counter()
                reg.register(f"ds-{i}@v1", _tiny_manifest(i))
                times.append(time.perf_counter() - start)
            done = count
            rows.append(
                {
                    "bench": "registry",
                    "entries": count,
                    "registers_timed": len(times),
                    "ms_per_register": 1e3 * sum(times) / max(1, len(times)),
                    "median_ms_per_register": 1e3 * float(np.median(times)) if times else 0.0,
                }
            )
    finally:
        if root is None:
            shutil.rmtree(work, ignore_errors=True)
    return rows


# ----------------------------------------------------------------------- open
def _write_shards(root: Path, count: int, tokens: int) -> int:
    root.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(7)
    base = rng.integers(0, 65_000, size=tokens, dtype=np.uint16)
    for i in range(count):
        base[0] = i % 65_000
        base[1] = i // 65_000
        np.save(root / f"shard-{i:06d}.npy", base)
    return sum(f.stat().st_size for f in root.iterdir())


def _open_tokens(reg: Any, name: str, storage: Any = None) -> float:
    from detdata.datasets.tokens import TokenWindows

    start = time.perf_counter()
    TokenWindows(reg.resolve(name), 32, storage=storage)
    return time.perf_counter() - start


def _local_row(work: Path, count: int, tokens: int) -> dict[str, Any]:
    from detdata.identity.build import build_manifest
    from detdata.identity.manifest import Manifest
    from detdata.identity.registry import Registry

    data = work / f"local-{count}"
    total = _write_shards(data, count, tokens)
    start = time.perf_counter()
    manifest = build_manifest(str(data), pattern="*.npy")
    build_s = time.perf_counter() - start
    path = str(work / f"local-{count}.json")
    manifest.save(path)
    start = time.perf_counter()
    Manifest.load(path, verify="quick")
    quick_s = time.perf_counter() - start
    start = time.perf_counter()
    parsed = Manifest.load(path, verify="off")
    parse_s = time.perf_counter() - start
    start = time.perf_counter()
    parsed.verify("quick")
    verify_s = time.perf_counter() - start
    reg = Registry(str(work / f"reg-local-{count}"))
    reg.register("local@v1", manifest)
    open_s = _open_tokens(reg, "local@v1")
    return {
        "bench": "open",
        "store": "local",
        "shards": count,
        "dataset_bytes": total,
        "build_s": build_s,
        "quick_verify_s": quick_s,
        "quick_over_build": quick_s / build_s,
        "load_without_verify_s": parse_s,
        "verify_only_s": verify_s,
        "verify_only_over_build": verify_s / build_s,
        "resolve_and_open_s": open_s,
    }


def _remote_row(work: Path, count: int, tokens: int) -> dict[str, Any]:
    import aiohttp

    from detdata import Storage
    from detdata.identity.build import build_manifest
    from detdata.identity.registry import Registry
    from detdata.storage.retry import RetryPolicy
    from tests.faultproxy import FaultProxy
    from tests.servers import start_nginx, stop_pid

    server = start_nginx(work / "nginx")
    requests = [0]

    async def on_request(*_: Any) -> None:
        requests[0] += 1

    trace = aiohttp.TraceConfig()
    trace.on_request_start.append(on_request)
    try:
        directory, url = server.new_dir()
        total = _write_shards(directory, count, tokens)
        manifest = build_manifest(str(directory), pattern="*.npy")
        with FaultProxy(server.port) as proxy:
            remote = url.replace(f"127.0.0.1:{server.port}", proxy.address)
            opts = {"client_kwargs": {"trace_configs": [trace]}, "skip_instance_cache": True}
            policy = RetryPolicy(deadline_s=60.0, attempt_timeout_s=20.0)
            on_http = manifest.with_root(remote)
            proxy.set_plan(proxy.plan)  # zero the counters
            requests[0] = 0
            start = time.perf_counter()
            on_http.verify("quick", retry=policy, **opts)
            quick_s = time.perf_counter() - start
            quick_requests, quick_bytes = requests[0], proxy.stats.bytes_down
            reg = Registry(str(work / f"reg-remote-{count}"))
            reg.register("remote@v1", on_http)
            proxy.set_plan(proxy.plan)
            requests[0] = 0
            open_s = _open_tokens(reg, "remote@v1", Storage(fs_options=opts, retry=policy))
            open_requests, open_bytes = requests[0], proxy.stats.bytes_down
    finally:
        stop_pid(server.pid, 2.0)
    return {
        "bench": "open",
        "store": "http",
        "shards": count,
        "dataset_bytes": total,
        "quick_verify_s": quick_s,
        "quick_requests": quick_requests,
        "quick_bytes_moved": quick_bytes,
        "quick_bytes_per_dataset_byte": quick_bytes / total,
        "resolve_and_open_s": open_s,
        "open_requests": open_requests,
        "open_bytes_per_dataset_byte": open_bytes / total,
    }


def open_rows(
    *,
    local_shards: Sequence[int] = (50_000,),
    remote_shards: Sequence[int] = (10_000,),
    tokens_per_shard: int = 512,
    workdir: str | None = None,
) -> list[dict[str, Any]]:
    """Open-time rows (see the module docstring) for each local and remote shard count."""
    work = Path(workdir or tempfile.mkdtemp(prefix="detdata-open-bench-"))
    rows: list[dict[str, Any]] = []
    try:
        rows += [_local_row(work, n, tokens_per_shard) for n in local_shards]
        rows += [_remote_row(work, n, tokens_per_shard) for n in remote_shards]
    finally:
        if workdir is None:
            shutil.rmtree(work, ignore_errors=True)
    return rows


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--smoke", action="store_true", help="tiny sizes (CI)")
    parser.add_argument("--only", choices=["registry", "open"], help="one part only")
    parser.add_argument("--json", metavar="FILE", help="write the rows as JSON")
    parser.add_argument("--local", type=int, nargs="*", help="local shard counts (open)")
    parser.add_argument("--remote", type=int, nargs="*", help="remote shard counts (open)")
    args = parser.parse_args(argv)
    rows: list[dict[str, Any]] = []
    if args.only in (None, "registry"):
        rows += registry_rows(SMOKE_REGISTRY, window=10) if args.smoke else registry_rows()
    if args.only in (None, "open"):
        local = (SMOKE_LOCAL,) if args.smoke else (50_000,)
        remote = (SMOKE_REMOTE,) if args.smoke else (10_000,)
        rows += open_rows(
            local_shards=local if args.local is None else args.local,
            remote_shards=remote if args.remote is None else args.remote,
        )
    import detdata

    meta = {"detdata": getattr(detdata, "__file__", "?"), "python": platform.python_version()}
    for row in rows:
        print(json.dumps(row, sort_keys=True))
    if args.json:
        Path(args.json).write_text(json.dumps({"meta": meta, "rows": rows}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
