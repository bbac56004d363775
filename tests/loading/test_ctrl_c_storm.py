"""Ctrl-C at any moment into a loader with persistent worker processes: the next iteration
continues exactly or starts fresh workers, never raises one of torch's internals (the
``KeyError: _ResumeIteration`` of a reset cut short), never hangs, never leaks workers.

The storm runs in a child process of its own (tests/loading/ctrl_c_storm.py: real worker
processes, real SIGINT from a timer thread), bounded by a per-round watchdog there and a
timeout here, so a hang fails the test instead of the suite."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from typing import Any

import pytest

from tests import soak
from tests.loading.ctrl_c_storm import NUM_WORKERS

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
ROUND_HANG_S = 20  # a round takes well under a second, a fresh-worker start included
#: the soak forms (tests/soak.py): full counts under a soak run, bounded ones by default
STORM_ROUNDS = soak.rounds(160, 40)
START_ROUNDS = soak.rounds(25, 10)  # at least two presses at each of the five points


def storm(rounds: int, seed: int, timeout: float) -> dict[str, Any]:
    args = [str(rounds), str(seed), str(ROUND_HANG_S)]
    proc = subprocess.run(
        [sys.executable, "-m", "tests.loading.ctrl_c_storm", *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=timeout,
        start_new_session=True,  # its signals reach nothing but the child and its workers
        env={**os.environ, "PYTHONPATH": ROOT},
    )
    lines = proc.stdout.strip().splitlines()
    assert proc.returncode == 0 and lines, (
        f"the storm process ended with {proc.returncode} (a round hung: every thread's stack "
        f"follows the round's number):\n{proc.stderr[-6000:]}"
    )
    summary: dict[str, Any] = json.loads(lines[-1])
    return summary


def check(summary: dict[str, Any]) -> None:
    # the item itself: no torch internal (KeyError: _ResumeIteration, an assertion of its
    # iterator) and no other error from any round, the continuation after the rounds included
    assert summary["errors"] == [], summary
    # every pressed round ended by its Ctrl-C (an iteration that swallowed it would not)
    assert summary["interrupts"] == summary["rounds"] // 2, summary
    # every kept batch is the uninterrupted run's batch at that position, none twice
    assert summary["mismatched"] == [] and summary["repeated"] == [], summary
    # samples_consumed moved by the batches kept (plus at most one an interrupt cut off
    # between counting and the caller's hands, checked per round in the child)
    assert summary["kept"] + summary["skipped"] == summary["batches"], summary
    # the same loader then continues, and a fresh loader from its state_dict(), exactly
    assert summary["tail_exact"], summary
    # replaced workers were shut down, not piled up; none left after close()
    assert summary["max_children"] <= 2 * NUM_WORKERS, summary
    assert summary["children_left"] == 0, summary


@pytest.mark.multiproc
def test_ctrl_c_storm_with_persistent_workers_never_surfaces_torch_internals() -> None:
    """24 rounds: a short clean round (its workers kept, so the next ``iter()`` resets them)
    then a round Ctrl-C ends within 12 ms of its start, mostly inside that reset. Before the
    fix the second round already left ``_ResumeIteration`` replies queued and the third
    raised ``KeyError: _ResumeIteration``."""
    check(storm(24, seed=29, timeout=240))


@pytest.mark.slow
@pytest.mark.multiproc
def test_ctrl_c_storm_with_persistent_workers_many_rounds() -> None:
    """The same with 160 rounds (40 outside a soak run): interrupts also land in ``next()``,
    in a group's hand-over and in the start of fresh workers."""
    check(storm(STORM_ROUNDS, seed=7, timeout=540))


_STEP_SCRIPT = r"""
import faulthandler, os, signal, time
import numpy as np
import detdata
from tests.resume_checker import digest, take

faulthandler.dump_traceback_later(120, exit=True)
signal.signal(signal.SIGINT, signal.default_int_handler)
ids = np.arange(400, dtype=np.int64)
plain = detdata.ArrayDataset({"id": ids, "x": (ids * 5).astype(np.int32)})


def make(**kw):
    return detdata.DataLoader(plain, global_batch_size=8, micro_batch_size=4, seed=2, **kw)


dl = make(num_workers=2, persistent_workers=True,
          options=detdata.LoaderOptions(read=detdata.ReadOptions(batches_ahead=1)))
kept = []
for press_at in (3, 7, 12):
    try:
        for batch in dl:
            kept.append(batch)
            if len(kept) == press_at:  # Ctrl-C in the training step, the loader idle
                os.killpg(0, signal.SIGINT)  # a terminal's: to the workers too
                for _ in range(1000):  # any thread may take the signal: poll for it
                    time.sleep(0.01)
                raise SystemExit("the Ctrl-C never arrived")
    except KeyboardInterrupt:
        pass
    assert dl.samples_consumed == len(kept) * 4, (dl.samples_consumed, len(kept))
kept += list(take(dl, 20 - len(kept)))
reference = [digest(b) for b in take(make(), 20)]
assert [digest(b) for b in kept] == reference, "not the uninterrupted stream"
print("EXACT", len(kept))
"""


@pytest.mark.multiproc
def test_ctrl_c_in_the_training_step_keeps_persistent_workers_alive(tmp_path: Any) -> None:
    """A terminal's Ctrl-C reaches the worker processes too. Pressed while the loop body runs
    (the loader idle, its kept workers between two passes), it used to end them, and the
    next ``for batch in loader`` waited 5 s for them and raised torch's ``RuntimeError:
    DataLoader worker (pid(s) ...) exited unexpectedly``. The workers ignore SIGINT: the main
    process decides (keep them, or replace them after an interrupted call), and the loop
    continues exactly, three times over."""
    script = tmp_path / "step_ctrl_c.py"
    script.write_text(_STEP_SCRIPT)
    proc = subprocess.run(
        [sys.executable, str(script)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=180,
        start_new_session=True,  # the process group the Ctrl-C goes to: the script's own
        env={**os.environ, "PYTHONPATH": ROOT},
    )
    assert proc.returncode == 0 and "EXACT 20" in proc.stdout, proc.stderr[-4000:]


@pytest.mark.slow
@pytest.mark.multiproc
def test_ctrl_c_in_a_worker_iterator_start_surfaces_as_keyboard_interrupt_only() -> None:
    """A real SIGINT at each point of the start of torch's worker-process iterator (five
    points, five rounds each in a soak run, two outside one; tests/loading/ctrl_c_start.py):
    the interrupted iteration raises
    ``KeyboardInterrupt`` and nothing else, the next one delivers the bytes of an uninterrupted
    run from ``samples_consumed``, and torch prints no "Exception ignored" from the half-started
    iterator's finaliser. Before the fix (issue 40) a Ctrl-C right after torch registered the
    worker pids left them registered under the dead iterator's address, and a later
    iterator placed there failed its start with torch's ``ValueError: _set_worker_pids should
    be called only once`` (in 16 of 30 such rounds here), at the press or at the next
    iteration."""
    proc = subprocess.run(
        [sys.executable, "-m", "tests.loading.ctrl_c_start", str(START_ROUNDS)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
        start_new_session=True,
        env={**os.environ, "PYTHONPATH": ROOT},
    )
    lines = proc.stdout.strip().splitlines()
    assert proc.returncode == 0 and lines, proc.stderr[-6000:]
    summary = json.loads(lines[-1])
    results = summary["results"]
    assert summary["pressed"] == len(results) == START_ROUNDS  # every armed point was reached
    wrong = [r for r in results if r["raised"] != "KeyboardInterrupt: " or r["after"] != "nothing"]
    assert wrong == [], wrong
    assert [r for r in results if not r["exact"]] == [], results
    assert "Exception ignored" not in proc.stderr, proc.stderr[-6000:]
    assert summary["children_left"] == 0, summary


_FORK_WINDOW = """
import multiprocessing as mp, os, signal, sys
import numpy as np
import detdata

class Interrupted(mp.context.ForkProcess):
    def start(self):  # a terminal's Ctrl-C reaching a worker right after its fork
        super().start()
        os.kill(self.pid, signal.SIGINT)

class Context(mp.context.ForkContext):
    Process = Interrupted

def make(context):
    data = detdata.ArrayDataset({"x": np.arange(64 * 16, dtype=np.int64).reshape(64, 16)})
    return detdata.DataLoader(data, global_batch_size=8, micro_batch_size=8, seed=5,
                              num_workers=2, multiprocessing_context=context)

want = [b["x"].numpy().tobytes() for _, b in zip(range(6), make(None))]
for _ in range(3):
    got = [b["x"].numpy().tobytes() for _, b in zip(range(6), make(Context()))]
    assert got == want, "other bytes"
print("ok")
"""


def test_a_ctrl_c_reaching_a_worker_right_after_its_fork_does_not_end_it() -> None:
    """A terminal's Ctrl-C goes to the whole process group, workers included; one that
    reaches a worker between its fork and its own ``SIG_IGN`` (here sent by the context's
    ``Process.start`` at once) must not end it: the workers are forked with SIGINT blocked,
    so the iteration delivers the uninterrupted run's bytes instead of torch's "worker
    exited unexpectedly"."""
    proc = subprocess.run(
        [sys.executable, "-c", _FORK_WINDOW],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "PYTHONPATH": ROOT},
    )
    assert proc.returncode == 0 and proc.stdout.strip() == "ok", proc.stderr[-3000:]
