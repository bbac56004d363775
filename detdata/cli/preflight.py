"""``detdata preflight [--manifest M ...] [--root R]``: check a machine before a long job.

Cheap checks, in order, each printed as ``preflight[rank R]: ok ...`` on stdout:

1. devices: every visible CUDA device (else the CPU) runs a tiny op whose result is checked;
2. process group: formed from the torchrun variables when ``RANK`` and ``WORLD_SIZE`` are
   set (``env://``: ``MASTER_ADDR``, ``MASTER_PORT``), else alone (world 1); backend
   ``--backend`` (default: nccl with CUDA, gloo without); a tiny all_reduce of ``rank + 1``
   must give ``world * (world + 1) / 2``;
3. data: each ``--manifest`` is loaded and quick-verified under ``--root`` (sizes and quick
   digests: at most 2 MiB read per shard, no large download).

``--timeout`` (the process group's, seconds) must be a positive number: anything else is a
usage error (exit 2) before any check runs.

Every rank runs every check; the ranks then agree through one more all_reduce, so all exit
alike. Exit 0 when every check passed; 1 when one failed (``detdata: preflight failed:
CHECK: why`` on stderr for each: the device, the collective, or the manifest and shard).

``--out FILE`` also saves the result with the run (atomically; rank r > 0 writes
``FILE.rank<r>``): ``{"kind": "detdata.preflight", "format_version": 1, "rank", "time",
"passed", "checks": [{"check", "ok", "detail"}]}``, every text passed through the URL
redaction every detdata output passes (no credential of a URL is written).
"""

from __future__ import annotations

import argparse
import datetime
import functools
import json
import math
import os
import shutil
import sys
import tempfile
from collections.abc import Callable
from typing import Any, Final

from detdata.base.errors import ConfigError
from detdata.base.redact import redact_text
from detdata.cli.main import EXIT_FAIL, EXIT_OK

#: The longest ``--timeout`` (seconds, about 31 years): ``datetime.timedelta`` and torch's
#: millisecond count both hold it.
MAX_TIMEOUT_S: Final = 1e9


def register(sub: Any) -> None:
    p = sub.add_parser(
        "preflight",
        help="run a tiny op on every device, a tiny collective, and quick-verify manifests",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--manifest", action="append", default=[], help="a manifest (repeatable)")
    p.add_argument("--root", help="where the shards are (default: each manifest's root)")
    p.add_argument("--backend", choices=("gloo", "nccl"), help="default: nccl with CUDA, else gloo")
    p.add_argument("--timeout", default="120", help="process group timeout, seconds (> 0)")
    p.add_argument("--out", help="also save the result as JSON (rank r > 0: OUT.rank<r>)")
    p.set_defaults(func=run_preflight)


def check_devices() -> str:
    """A tiny op on every visible device; the result is compared with its known value."""
    import torch

    expected = float(sum(i * i for i in range(16)))
    names = []
    devices = (
        [torch.device("cuda", i) for i in range(torch.cuda.device_count())]
        if torch.cuda.is_available()
        else [torch.device("cpu")]
    )
    for device in devices:
        x = torch.arange(16, dtype=torch.float32, device=device)
        found = float((x * x).sum().item())
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        if found != expected:
            raise RuntimeError(f"device {device}: tiny op gave {found}, expected {expected}")
        label = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
        names.append(f"{device} ({label})")
    return "devices " + ", ".join(names)


def form_group(backend: str | None, timeout: float, folder: str) -> tuple[int, int, str]:
    """Initialise the default process group (alone: a file store in ``folder``); returns
    (rank, world, backend)."""
    import torch
    import torch.distributed as dist

    chosen = backend or ("nccl" if torch.cuda.is_available() else "gloo")
    wait = datetime.timedelta(seconds=timeout)
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        if chosen == "nccl":
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        dist.init_process_group(chosen, init_method="env://", timeout=wait)
    else:
        init = "file://" + os.path.join(folder, "store")
        dist.init_process_group(chosen, init_method=init, rank=0, world_size=1, timeout=wait)
    return dist.get_rank(), dist.get_world_size(), chosen


def _all_reduce(value: float, backend: str, *, largest: bool = False) -> float:
    """``value`` summed (or the largest) over the ranks of the default process group."""
    import torch
    import torch.distributed as dist

    device = torch.device("cuda", torch.cuda.current_device()) if backend == "nccl" else None
    t = torch.tensor([value], dtype=torch.float64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX if largest else dist.ReduceOp.SUM)
    return float(t.item())


def check_collective(rank: int, world: int, backend: str) -> str:
    found, expected = _all_reduce(float(rank + 1), backend), world * (world + 1) / 2
    if found != expected:
        raise RuntimeError(f"all_reduce gave {found}, expected {expected}")
    return f"all_reduce world {world} ({backend})"


def check_manifest(path: str, root: str | None) -> str:
    from detdata.identity.manifest import Manifest

    manifest = Manifest.load(path, root=root, verify="quick")
    done = f"manifest {path}: {len(manifest.shards)} shard(s) quick-verified ({manifest.id})"
    return redact_text(done)  # a record of its own: through the redaction boundary


def _run(label: str, rank: int, results: list[dict[str, Any]], fn: Callable[[], str]) -> None:
    """Run one check: print its ``ok`` line, add ``{"check", "ok", "detail"}`` to ``results``."""
    try:
        detail = fn()
        print(f"preflight[rank {rank}]: ok {detail}", flush=True)
        results.append({"check": label, "ok": True, "detail": detail})
    except Exception as exc:  # every failure is reported, named, and ends in exit 1
        results.append({"check": label, "ok": False, "detail": f"{type(exc).__name__}: {exc}"})


def save_result(path: str, rank: int, results: list[dict[str, Any]], failures: list[str]) -> None:
    """Write the checks run in this process (`_run`'s ``results``) as JSON, atomically."""
    from detdata.storage.atomic import atomic_write_bytes

    checks = [{**r, "detail": redact_text(str(r["detail"]))} for r in results]
    doc = {
        "kind": "detdata.preflight",
        "format_version": 1,
        "rank": rank,
        "time": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "passed": not failures,
        "checks": checks,
        "failures": [redact_text(f) for f in failures],
    }
    target = path if rank == 0 else f"{path}.rank{rank}"
    atomic_write_bytes(target, (json.dumps(doc, indent=1, sort_keys=True) + "\n").encode())


def check_timeout(text: str) -> float:
    """``--timeout`` as given: a positive, finite number of seconds, at most `MAX_TIMEOUT_S`
    (`ConfigError` naming it as typed otherwise: a usage error before any check runs)."""
    try:
        seconds = float(text)
    except ValueError:
        seconds = math.nan
    if not (0 < seconds <= MAX_TIMEOUT_S):  # NaN fails this too
        raise ConfigError(
            f"--timeout {text}: the process group timeout must be a positive number of "
            f"seconds, at most {MAX_TIMEOUT_S:,.0f}; hint: e.g. --timeout 120 (the default)"
        )
    return seconds


def run_preflight(args: argparse.Namespace) -> int:
    import torch.distributed as dist

    timeout = check_timeout(args.timeout)
    rank = int(os.environ.get("RANK", "0"))
    results: list[dict[str, Any]] = []
    _run("devices", rank, results, check_devices)
    group: list[tuple[int, int, str]] = []
    store = tempfile.mkdtemp(prefix="detdata-preflight-")  # of a group formed alone

    def formed() -> str:
        group.append(form_group(args.backend, timeout, store))
        return check_collective(*group[0])

    _run("process group", rank, results, formed)
    for path in args.manifest:
        _run(f"manifest {path}", rank, results, functools.partial(check_manifest, path, args.root))
    failures = [f"{r['check']}: {r['detail']}" for r in results if not r["ok"]]
    if group and dist.is_initialized():
        # all ranks learn whether any rank failed (so they exit alike)
        if _all_reduce(float(len(failures)), group[0][2], largest=True) > 0 and not failures:
            failures.append("another rank: a check failed there (see its messages)")
        dist.destroy_process_group()
    shutil.rmtree(store, ignore_errors=True)  # once the group is gone
    for failure in failures:
        print(f"detdata: preflight failed: {failure}", file=sys.stderr)
    if args.out is not None:
        save_result(args.out, rank, results, failures)
    return EXIT_FAIL if failures else EXIT_OK
