"""``detdata demo`` and ``detdata replay-check``.

Both check every argument before touching the disk. Their ``--out`` folder is
marked with a `MARKER` file when they create (or adopt an empty) folder; they
clear or reuse only folders that carry it, and refuse any other non-empty folder
without deleting anything.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import time
from pathlib import Path
from typing import Any, Final

from detdata.base.errors import ConfigError
from detdata.cli.replay import CONTRACT, print_verdict

MARKER: Final = ".detdata-demo"
_MARKER_TEXT: Final = (
    "This folder was created by `detdata demo` / `detdata replay-check`; they clear or "
    "reuse only folders holding this file.\n"
)


def _add_run_args(parser: argparse.ArgumentParser, out_help: str) -> None:
    parser.add_argument("--out", default="demo_out", help=out_help)
    parser.add_argument("--steps", type=int, default=40, help="training steps (>= 2)")
    parser.add_argument(
        "--stop-at", type=int, default=17, help="step where run C is interrupted (1 .. steps-1)"
    )


def register(sub: Any) -> None:
    p = sub.add_parser(
        "demo",
        help="build a small corpus, train a tiny GPT with interrupt/resume/reshard proof",
        description="Build a small byte-level corpus, register its manifests and train a tiny "
        "GPT on CPU: an uninterrupted run, a run stopped at --stop-at and resumed, and a "
        "resharded resume, then compare their data and weights.",
    )
    _add_run_args(
        p,
        f"working folder: created, or cleared if an earlier demo made it (it holds {MARKER}); "
        "any other non-empty folder is refused",
    )
    p.set_defaults(func=run_demo)
    r = sub.add_parser(
        "replay-check",
        help="three fresh-process runs (A, B, interrupted+resumed C); "
        "exit 1 if weights or data traces differ",
        description="Run the demo's training (or your own command after --) three times in "
        "fresh processes and compare the data traces and the final weights.",
        epilog=CONTRACT,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    _add_run_args(
        r,
        "folder holding a demo corpus (built if the folder is new or empty; else it must "
        f"hold {MARKER})",
    )
    r.add_argument(
        "--timeout",
        type=float,
        default=3600.0,
        help="seconds each run of your command may take (default 3600); past it the run's "
        "process group is killed and replay-check exits 2 naming the run",
    )
    r.add_argument(
        "command",
        nargs=argparse.REMAINDER,
        help="-- CMD ...: check your own training command instead of the demo (the flags it "
        "must accept: below)",
    )
    r.set_defaults(func=run_replay_check)


def check_run_args(steps: int, stop_at: int) -> None:
    """``--steps`` and ``--stop-at`` before anything is written."""
    if steps < 2:
        raise ConfigError(f"--steps must be at least 2 (run C stops in the middle), got {steps}")
    if not 0 < stop_at < steps:
        raise ConfigError(
            f"--stop-at must be between 1 and --steps - 1 = {steps - 1}, got {stop_at}"
        )


def _refuse(out: Path, what: str) -> ConfigError:
    return ConfigError(
        f"--out {out}: {what}; refusing to write there; hint: pass a new or empty folder "
        f"(e.g. --out demo_out2), or delete {out} yourself if it is an old demo output"
    )


def prepare_out(out: Path, *, clear: bool) -> None:
    """Make ``out`` ours: create it (or adopt it if empty) with `MARKER`; clear it if asked.

    A non-empty folder without the marker, or a path that is not a folder, is
    refused with a `ConfigError` naming it; nothing is deleted then.
    """
    if out.exists() and not out.is_dir():
        raise _refuse(out, "is not a folder")
    if out.is_dir():
        entries = os.listdir(out)
        if entries and MARKER not in entries:
            raise _refuse(
                out, f"is a non-empty folder that detdata did not create (no {MARKER} file in it)"
            )
        for path in (out / name for name in entries if clear and name != MARKER):
            if path.is_dir() and not path.is_symlink():
                shutil.rmtree(path)
            else:
                path.unlink()
    try:
        out.mkdir(parents=True, exist_ok=True)
        (out / MARKER).write_text(_MARKER_TEXT, encoding="utf-8")
    except OSError as exc:
        raise _refuse(out, f"cannot create it ({exc.strerror or exc})") from None


def _print_check(check: dict[str, Any]) -> int:
    print(
        f"final weights blake3: A {check['weights']['A'][:16]}  B {check['weights']['B'][:16]}  "
        f"C (stopped at {check['stop_at']} on 2 ranks, resumed on 1) {check['weights']['C'][:16]}"
    )
    return print_verdict(check)


def run_demo(args: argparse.Namespace) -> int:
    check_run_args(args.steps, args.stop_at)
    from detdata.cli.demo_run import WEIGHTS, build_corpus, loader_throughput, replay_check

    t0 = time.perf_counter()
    out = Path(args.out)
    prepare_out(out, clear=True)
    ids = build_corpus(out)
    print("== detdata demo ==")
    for name, mid in ids.items():
        print(f"registered demo-{name}@v1 -> {mid}")
    check = replay_check(out, steps=args.steps, stop_at=args.stop_at)
    print(
        f"trained {check['steps']} steps on the mixture {json.dumps(WEIGHTS)}: "
        f"loss {check['first_loss']:.3f} -> {check['final_loss']:.3f}"
    )
    code = _print_check(check)
    print(
        f"loader throughput (mixture of 3 sources, global batch 64, seq 64): "
        f"{loader_throughput(out):,.0f} samples/s"
    )
    (out / "report.json").write_text(json.dumps({"manifests": ids, **check}, indent=1, default=str))
    print(f"report: {out / 'report.json'}  ({time.perf_counter() - t0:.0f} s)")
    return code


def run_replay_check(args: argparse.Namespace) -> int:
    check_run_args(args.steps, args.stop_at)
    command = list(args.command or [])
    if command[:1] == ["--"]:
        command = command[1:]
    if command and not args.timeout > 0:
        raise ConfigError(f"--timeout must be a positive number of seconds, got {args.timeout}")
    out = Path(args.out)
    prepare_out(out, clear=False)
    if command:
        from detdata.cli.replay import run_user

        return run_user(command, out, args.steps, args.stop_at, args.timeout)
    from detdata.cli.demo_run import build_corpus, replay_check

    if not (out / "registry").exists():
        build_corpus(out)
    return _print_check(replay_check(out, steps=args.steps, stop_at=args.stop_at))
