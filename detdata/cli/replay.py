"""``detdata replay-check [--steps N] [--stop-at K] [--out DIR] -- CMD ...``: your own script.

Runs your training command three times, each in a fresh process, and compares
what the runs trained on and the weights they ended with:

* **A** and **B**: ``CMD --steps N --run-dir DIR/A`` (and ``DIR/B``);
* **C**: ``CMD --steps N --stop-at K --run-dir DIR/C``, then, in a new process,
  ``CMD --steps N --resume --run-dir DIR/C``.

**The contract** your script follows (the flags are appended to ``CMD``):

* ``--steps N``: train until global step N (the run's last step is N - 1);
* ``--stop-at K``: stop after step K - 1 and save a checkpoint in ``--run-dir``:
  the model, the optimizer and ``loader.state_dict()``;
* ``--resume``: load that checkpoint (including ``loader.load_state_dict``) and
  continue to step N;
* ``--run-dir DIR``: build the loader with ``DataLoader(..., trace=DIR/"trace.jsonl")``
  (rank r > 0 writes ``trace.jsonl.rank<r>`` by itself): the per-step data digests;
* print ``weights <hex digest of the final weights>`` on stdout (the last such line counts).

The check passes when the three weight digests are equal and the traces of B and
of C deliver, step by step, what A delivered (`detdata.loading.trace.compare`:
a resume that forgot the loader state shows as a discontinuity at step K, the
step after the restart). Exit 0 pass, 1 a difference, 2 a run that failed or
broke the contract (its stderr tail is shown).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Final

from detdata.base.errors import ConfigError
from detdata.loading.trace import Record, first_difference, read_trace

#: The flags ``replay-check -- CMD`` appends to your command (shown by ``--help``).
CONTRACT: Final = """\
your command (after --) must accept the flags replay-check appends to it:
  --steps N       train until global step N (the last step is N - 1)
  --stop-at K     stop after step K - 1 and save a checkpoint in --run-dir: the model,
                  the optimizer and loader.state_dict()
  --resume        load that checkpoint (loader.load_state_dict too) and continue to step N
  --run-dir DIR   build the loader with DataLoader(..., trace=DIR/"trace.jsonl")
and print a line "weights <hex digest of the final weights>" on stdout (the last counts).
Runs: A and B (CMD --steps N --run-dir DIR/A, DIR/B); C (CMD --steps N --stop-at K
--run-dir DIR/C, then CMD --steps N --resume --run-dir DIR/C in a new process).
Passes when the three weight digests are equal and B's and C's traces deliver, step by
step, what A delivered; exit 0 pass, 1 a difference, 2 a run that failed or broke the
contract (its stderr tail is shown).
"""
TRACE: Final = "trace.jsonl"
_WEIGHTS: Final = re.compile(r"^\s*weights[\s:=]+([0-9a-fA-F]{8,})\s*$")
_TAIL: Final = 2000


def run_once(command: Sequence[str], extra: Sequence[str], timeout: float | None) -> str:
    """Run ``command + extra``; its stdout, or `ConfigError` with its stderr tail."""
    argv = [*command, *extra]
    try:
        done = subprocess.run(argv, capture_output=True, text=True, timeout=timeout, check=False)
    except FileNotFoundError:
        raise ConfigError(f"replay-check: cannot run {argv[0]!r}: not found") from None
    except subprocess.TimeoutExpired:
        raise ConfigError(f"replay-check: {' '.join(argv)} ran past {timeout} s") from None
    if done.returncode != 0:
        raise ConfigError(
            f"replay-check: {' '.join(argv)} exited {done.returncode}:\n{done.stderr[-_TAIL:]}"
        )
    return done.stdout


def weights_of(stdout: str, argv: Sequence[str]) -> str:
    """The digest of the last ``weights <hex>`` line, or `ConfigError` (contract broken)."""
    found = [m.group(1).lower() for m in map(_WEIGHTS.match, stdout.splitlines()) if m]
    if not found:
        raise ConfigError(
            f"replay-check: {' '.join(argv)} printed no 'weights <hex>' line; hint: print a "
            "digest of the final weights (see `detdata replay-check --help`)"
        )
    return found[-1]


def trace_of(run_dir: Path) -> list[Record]:
    """The records of every rank's trace in ``run_dir`` (rank 0 first)."""
    first = run_dir / TRACE
    if not first.exists():
        raise ConfigError(
            f"replay-check: the run wrote no trace {first}; hint: build the loader with "
            f"DataLoader(..., trace=RUN_DIR / {TRACE!r})"
        )
    records = read_trace(first)
    for extra in sorted(run_dir.glob(TRACE + ".rank*")):
        records.extend(read_trace(extra))
    return records


def user_replay_check(
    command: Sequence[str], out: Path, *, steps: int, stop_at: int, timeout: float | None = None
) -> dict[str, Any]:
    """Runs A, B and stopped-and-resumed C of ``command`` under ``out`` (its ``A``, ``B``, ``C``
    folders are replaced); returns the comparison as plain JSON."""
    if not command:
        raise ConfigError("replay-check: no command after '--'; hint: -- python train.py ...")
    weights = {}
    for tag in ("A", "B", "C"):
        run_dir = out / tag
        if run_dir.exists():
            shutil.rmtree(run_dir)
        run_dir.mkdir(parents=True)
    base = ["--steps", str(steps)]
    for tag in ("A", "B"):
        extra = [*base, "--run-dir", os.fspath(out / tag)]
        weights[tag] = weights_of(run_once(command, extra, timeout), [*command, *extra])
    c_dir = ["--run-dir", os.fspath(out / "C")]
    run_once(command, [*base, "--stop-at", str(stop_at), *c_dir], timeout)
    extra = [*base, "--resume", *c_dir]
    weights["C"] = weights_of(run_once(command, extra, timeout), [*command, *extra])
    ta, tb, tc = (trace_of(out / t) for t in ("A", "B", "C"))
    return {
        "command": list(command),
        "steps": steps,
        "stop_at": stop_at,
        "weights": weights,
        "weights_identical": len(set(weights.values())) == 1,
        "first_divergent_step_A_B": first_difference(ta, tb),
        "first_divergent_step_A_C": first_difference(ta, tc),
    }


def print_user_check(check: dict[str, Any]) -> int:
    w = check["weights"]
    print(
        f"final weights: A {w['A'][:16]}  B {w['B'][:16]}  "
        f"C (stopped at step {check['stop_at']}, resumed) {w['C'][:16]}"
    )
    return print_verdict(check)


def print_verdict(check: dict[str, Any]) -> int:
    """Print a replay check's first divergent steps (A vs B, A vs C) and its verdict.

    ``check`` holds ``weights_identical`` and ``first_divergent_step_A_B`` / ``_A_C``
    (``None`` or a difference with ``step`` and ``reason``). Returns the exit code:
    0 when the runs are bitwise identical, else 1.
    """
    for pair in ("A_B", "A_C"):
        diff = check[f"first_divergent_step_{pair}"]
        print(
            f"first divergent data step {pair.replace('_', ' vs ')}: "
            + ("none" if diff is None else f"step {diff['step']} ({diff['reason']})")
        )
    ok = (
        check["weights_identical"]
        and check["first_divergent_step_A_B"] is None
        and check["first_divergent_step_A_C"] is None
    )
    print("replay check: " + ("PASS (bitwise identical)" if ok else "FAIL"))
    return 0 if ok else 1


def run_user(command: Sequence[str], out: Path, steps: int, stop_at: int) -> int:
    """The ``replay-check -- CMD`` command: run, report, write ``out/report.json``."""
    check = user_replay_check(command, out, steps=steps, stop_at=stop_at)
    (out / "report.json").write_text(json.dumps(check, indent=1, default=str))
    return print_user_check(check)
