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

from tests.loading.ctrl_c_storm import NUM_WORKERS

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
ROUND_HANG_S = 20  # a round takes well under a second, a fresh-worker start included


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
    """The same with 160 rounds: interrupts also land in ``next()``, in a group's hand-over
    and in the start of fresh workers."""
    check(storm(160, seed=7, timeout=540))
