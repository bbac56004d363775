"""``detdata bench``: run the throughput and resume benchmarks (``python -m benchmarks``).

The harness is the ``benchmarks/`` folder of a source checkout (not in the wheel), found
next to the ``detdata`` package or in ``--repo``; it runs with the same Python, given the
other arguments.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

from detdata.base.errors import ConfigError


def find_checkout(repo: str | None) -> Path:
    """The folder holding ``benchmarks/throughput.py`` (``repo``, else the one above
    ``detdata``)."""
    candidates = [Path(repo)] if repo else [Path(__file__).resolve().parents[1], Path.cwd()]
    for folder in candidates:
        if (folder / "benchmarks" / "throughput.py").is_file():
            return folder
    where = ", ".join(str(c) for c in candidates)
    raise ConfigError(
        f"benchmarks/throughput.py not found in {where}; the benchmarks ship with the "
        "source checkout, not the wheel; hint: run from a git checkout of detdata "
        "(pip install -e .) or pass --repo PATH"
    )


# (flag, type, help): forwarded to ``python -m benchmarks`` when given
_OPTIONS: tuple[tuple[str, type, str], ...] = (
    ("--out", str, "folder for throughput.{md,json,png} (default: benchmarks/results)"),
    ("--data-dir", str, "where to generate the data (default: a temp folder)"),
    ("--samples-per-shard", int, "samples per shard (default 16384; smoke 1024)"),
    ("--shards", int, "shards per format (default 8; smoke 2)"),
    ("--row-group", int, "Parquet rows per row group (default 1024; smoke 256)"),
    ("--repeats", int, "interleaved rounds of every run (default 3; smoke 1)"),
    ("--budget", float, "seconds of steady-state loading per throughput run (default 1.5)"),
    ("--warmup", int, "batches before the throughput window (default 32; smoke 4)"),
    ("--resume-at", int, "resume position (default 40000; smoke 1024)"),
    ("--workers", str, "num_workers values, comma separated (default 0,2)"),
    ("--resume-workers", str, "num_workers values for resume runs (default: --workers)"),
    ("--contenders", str, "comma-separated subset of the contenders"),
    ("--batch", int, "batch size (default 64)"),
    ("--seed", int, "shuffle seed"),
)


def bench_argv(args: argparse.Namespace) -> list[str]:
    """The ``python -m benchmarks`` arguments for parsed ``detdata bench`` arguments."""
    argv = ["--smoke"] if args.smoke else []
    for flag, _, _ in _OPTIONS:
        value = getattr(args, flag[2:].replace("-", "_"))
        if value is not None:
            # paths are resolved here: the benchmark runs with the checkout as working folder
            argv += [
                flag,
                os.path.abspath(value) if flag in ("--out", "--data-dir") else str(value),
            ]
    return argv


def run_bench(args: argparse.Namespace) -> int:
    checkout = find_checkout(args.repo)
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(checkout), env.get("PYTHONPATH", "")) if p)
    cmd = [sys.executable, "-m", "benchmarks", *bench_argv(args)]
    return subprocess.call(cmd, cwd=checkout, env=env)


def register(subparsers: Any) -> None:
    p = subparsers.add_parser(
        "bench",
        help="throughput/resume benchmarks vs the vanilla DataLoader (python -m benchmarks)",
        description=__doc__.splitlines()[0] if __doc__ else None,
    )
    p.add_argument(
        "--smoke", action="store_true", help="tiny data, one round (well under a minute)"
    )
    for flag, kind, text in _OPTIONS:
        p.add_argument(flag, type=kind, help=text)
    p.add_argument("--repo", help="source checkout holding benchmarks/ (default: auto)")
    p.set_defaults(func=run_bench)
