"""``detdata replay-check [--steps N] [--stop-at K] [--out DIR] -- CMD ...``: your own script.

Runs ``CMD`` three times, each in fresh processes (A, B, and C stopped at step K, then
resumed), and compares the final weight digests, the data traces step by step
(`detdata.loading.trace.compare`) and the optional per-step model digests. `CONTRACT` (in
``--help``) is the whole contract: the flags appended, what the script prints, when the
check passes, the exit codes. docs/design.md, "Replay check of a user script".
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import signal
import subprocess
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Final

from detdata.base.errors import ConfigError
from detdata.loading.model_digest import parse_model_steps
from detdata.loading.trace import Record, compare, read_trace

#: The flags ``replay-check -- CMD`` appends to your command (shown by ``--help``).
CONTRACT: Final = """\
your command (after --) must accept the flags replay-check appends to it:
  --steps N       train until global step N (the last step is N - 1)
  --stop-at K     stop after step K - 1 and save a checkpoint in --run-dir: the model,
                  the optimizer (and scheduler, RNG states) and loader.state_dict()
  --resume        load that checkpoint (loader.load_state_dict too) and continue to step N
  --run-dir DIR   build the loader with
                  DataLoader(..., options=LoaderOptions(trace=DIR/"trace.jsonl"))
and print a line "weights <hex digest of the final weights>" on stdout (the last counts).
Optional, to name the first divergent step of a fault outside the data (an optimizer,
scheduler or dropout generator not restored, another reduction order): after each
optimizer step call detdata.report_model_step(step, model), which prints
"detdata-model step=<t> b3:<hex>" (a blake3 of the model's state_dict).
Runs: A and B (CMD --steps N --run-dir DIR/A, DIR/B); C (CMD --steps N --stop-at K
--run-dir DIR/C, then CMD --steps N --resume --run-dir DIR/C in a new process), each
killed past --timeout seconds.
PASS when the three weight digests are equal, B's and C's traces deliver, step by step,
what A delivered, the reported model digests agree step by step, and run C really
stopped at step K and restored its loader state there. FAIL (exit 1) otherwise, and
also when a trace is empty (nothing compared) or run C ran past K / did not restore.
Each difference names its first divergent step ("A vs C: step K ...").
Exit 0 pass, 1 fail, 2 a run that failed, timed out or broke the contract (its stderr
tail is shown).
"""
TRACE: Final = "trace.jsonl"
_WEIGHTS: Final = re.compile(r"^\s*weights[\s:=]+([0-9a-fA-F]{8,})\s*$")
_TAIL: Final = 2000


def run_once(command: Sequence[str], extra: Sequence[str], timeout: float, run: str) -> str:
    """Run ``command + extra`` in its own process group; its stdout, or `ConfigError` naming
    ``run`` with its stderr tail (a failure) or the timeout (the whole group is killed)."""
    argv = [*command, *extra]
    try:
        proc = subprocess.Popen(
            argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True
        )
    except FileNotFoundError:
        raise ConfigError(f"replay-check: cannot run {argv[0]!r}: not found") from None
    try:
        stdout, stderr = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(proc.pid, signal.SIGKILL)
        _, stderr = proc.communicate()
        raise ConfigError(
            f"replay-check: run {run} ran past --timeout {timeout:g} s and was killed: "
            f"{' '.join(argv)}\n{(stderr or '')[-_TAIL:]}\nhint: a hang in the script (a "
            "collective waiting for a rank?), or raise --timeout"
        ) from None
    if proc.returncode != 0:
        raise ConfigError(
            f"replay-check: run {run} failed: {' '.join(argv)} exited {proc.returncode}:\n"
            f"{stderr[-_TAIL:]}"
        )
    return stdout


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
            f"DataLoader(..., options=detdata.LoaderOptions(trace=RUN_DIR / {TRACE!r}))"
        )
    records = read_trace(first)
    for extra in sorted(run_dir.glob(TRACE + ".rank*")):
        records.extend(read_trace(extra))
    return records


def _rank0(run_dir: Path) -> list[Record]:
    path = run_dir / TRACE
    return read_trace(path) if path.exists() else []


def resume_problems(before: Sequence[Record], after: Sequence[Record], stop_at: int) -> list[str]:
    """Why run C is not a run stopped at step ``stop_at`` and resumed from its state (rank 0's
    records of its first process, ``before``, and of its resumed process, ``after``)."""
    if not before:
        return [f"run C's first process (--stop-at {stop_at}) delivered nothing"]
    reached = max(r.next_step for r in before)
    if reached != stop_at:
        return [
            f"run C did not stop at step {stop_at}: its first process delivered through step "
            f"{reached - 1} (does the script honour --stop-at?)"
        ]
    if not after:
        return ["run C's resumed process (--resume) delivered nothing: no mid-run resume happened"]
    first, end = after[0], before[-1].next
    if not first.restored:
        return [
            f"run C's resumed process did not restore the loader state: its first batch (at "
            f"samples_consumed {first.at}) follows no load_state_dict"
        ]
    if first.at != end:
        return [
            f"run C's resumed process restored samples_consumed {first.at}, not the {end} its "
            "first process stopped at (an older checkpoint?)"
        ]
    return []


def model_difference(a: Mapping[int, str], b: Mapping[int, str]) -> dict[str, Any] | None:
    """The first step whose reported model digests differ (or that one run did not report)."""
    for step in sorted(set(a) | set(b)):
        if a.get(step) != b.get(step):
            return {"step": step, "left": a.get(step), "right": b.get(step)}
    return None


def first_divergences(
    a: Sequence[Record], b: Sequence[Record], c: Sequence[Record]
) -> dict[str, Any]:
    """The first divergence (`Finding` JSON, None when none) of trace ``a`` from ``b`` and from
    ``c``, keyed as a replay check reports them."""
    found = {run: compare(a, t, labels=("A", run)).first for run, t in (("B", b), ("C", c))}
    return {
        f"first_divergent_step_A_{run}": None if f is None else f.to_json()
        for run, f in found.items()
    }


def user_replay_check(
    command: Sequence[str], out: Path, *, steps: int, stop_at: int, timeout: float
) -> dict[str, Any]:
    """Runs A, B and stopped-and-resumed C of ``command`` (non-empty) under ``out`` (its
    ``A``, ``B``, ``C`` folders are replaced); returns the comparison as plain JSON."""
    weights, models = {}, {}
    for tag in ("A", "B", "C"):
        run_dir = out / tag
        if run_dir.exists():
            shutil.rmtree(run_dir)
        run_dir.mkdir(parents=True)
    base = ["--steps", str(steps)]
    for tag in ("A", "B"):
        extra = [*base, "--run-dir", os.fspath(out / tag)]
        stdout = run_once(command, extra, timeout, tag)
        weights[tag] = weights_of(stdout, [*command, *extra])
        models[tag] = parse_model_steps(stdout)
    c_dir = ["--run-dir", os.fspath(out / "C")]
    stopped = run_once(command, [*base, "--stop-at", str(stop_at), *c_dir], timeout, "C (stopped)")
    before = _rank0(out / "C")
    extra = [*base, "--resume", *c_dir]
    resumed = run_once(command, extra, timeout, "C (resumed)")
    weights["C"] = weights_of(resumed, [*command, *extra])
    models["C"] = parse_model_steps(stopped) | parse_model_steps(resumed)
    ta, tb, tc = (trace_of(out / t) for t in ("A", "B", "C"))
    problems = [f"the trace of run {t} is empty: nothing was compared" for t, r in
                (("A", ta), ("B", tb), ("C", tc)) if not r]  # fmt: skip
    problems += resume_problems(before, _rank0(out / "C")[len(before) :], stop_at)
    return {
        "command": list(command),
        "steps": steps,
        "stop_at": stop_at,
        "weights": weights,
        "weights_identical": len(set(weights.values())) == 1,
        **first_divergences(ta, tb, tc),
        "model_digests": any(models.values()),
        # None when no run reported: no step then differs
        "first_divergent_model_step_A_B": model_difference(models["A"], models["B"]),
        "first_divergent_model_step_A_C": model_difference(models["A"], models["C"]),
        "problems": problems,
    }


def print_verdict(check: dict[str, Any]) -> int:
    """Print a replay check's first divergent steps (A vs B, A vs C) and its verdict; the exit
    code: 0 when the runs are bitwise identical, else 1. ``check`` is `user_replay_check`'s
    (the demo's has no model digests and no ``problems``)."""
    ok = check["weights_identical"] and not check.get("problems")
    for pair in ("A_B", "A_C"):
        diff = check[f"first_divergent_step_{pair}"]
        ok = ok and diff is None
        print(
            f"first divergent data step {pair.replace('_', ' vs ')}: "
            + ("none" if diff is None else f"step {diff['step']} ({diff['reason']})")
        )
    if check.get("model_digests"):
        for pair in ("A_B", "A_C"):
            diff = check[f"first_divergent_model_step_{pair}"]
            left, right = pair.split("_")
            text = "none"
            if diff is not None:
                ok = False
                text = (
                    f"step {diff['step']} ({left} {diff['left'] or 'not reported'}, "
                    f"{right} {diff['right'] or 'not reported'})"
                )
            print(f"first divergent model step {left} vs {right}: {text}")
    elif "model_digests" in check:
        print(
            "first divergent model step: not reported (optional: call "
            "detdata.report_model_step(step, model) after each optimizer step)"
        )
    for problem in check.get("problems", []):
        print(f"problem: {problem}")
    print("replay check: " + ("PASS (bitwise identical)" if ok else "FAIL"))
    return 0 if ok else 1


def run_user(command: Sequence[str], out: Path, steps: int, stop_at: int, timeout: float) -> int:
    """The ``replay-check -- CMD`` command: run, report, write ``out/report.json``."""
    check = user_replay_check(command, out, steps=steps, stop_at=stop_at, timeout=timeout)
    (out / "report.json").write_text(json.dumps(check, indent=1, default=str))
    w = check["weights"]
    print(
        f"final weights: A {w['A'][:16]}  B {w['B'][:16]}  "
        f"C (stopped at step {stop_at}, resumed) {w['C'][:16]}"
    )
    return print_verdict(check)
