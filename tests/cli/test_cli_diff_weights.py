"""``detdata diff`` over runs whose mixture weights changed during the run (issue 44).

The reference is the caller's side: the ids each run's loader delivered, step by step, and a
`Mixture` built by its constructor with the schedule the changes make. ``diff`` of two traces
must call two runs identical when they delivered the same samples (a run stopped, resumed on
another layout and given the same changes included) and name the first step where the
delivered samples differ when a change came one step later; ``diff --state`` must name the
weights history as what differs between their states.

Covers: detdata/cli/trace.py and detdata/loading/reweighting.py through the CLI.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import detdata
from detdata.loading.loader import DataLoader
from tests.loading.test_reweighting import (
    GBS,
    SEED,
    reference_ids,
    reference_schedule,
    sources,
)

NAMES = ["a", "b", "c"]
W0 = {"a": 1, "b": 1, "c": 1}
STEPS = 12


def _loader(trace: Path, micro: int, workers: int = 0) -> DataLoader:
    return DataLoader(
        detdata.Mixture(sources(NAMES), W0, seed=SEED),
        global_batch_size=GBS,
        micro_batch_size=micro,
        seed=0,
        num_workers=workers,
        options=detdata.LoaderOptions(
            trace=trace, read=detdata.ReadOptions(worker_mode="thread" if workers else "process")
        ),
    )


def _run(
    trace: Path, changes: dict[int, dict[str, int]], *, stop_at: int | None = None
) -> tuple[list[list[int]], dict[str, Any]]:
    """Steps 0..STEPS-1 with ``changes[s]`` asked just before step ``s``; with ``stop_at``,
    the run saves after that step and a loader of another layout (micro 8, 2 threads)
    resumes from the saved state, appending to the same trace. Returns the ids of each
    step as the caller received them, and the last state."""
    steps: list[list[int]] = []
    micro = 4
    loader = _loader(trace, micro=micro)
    it = iter(loader)
    for step in range(STEPS):
        if stop_at is not None and step == stop_at:
            state = loader.state_dict()
            loader.close()
            micro = 8
            loader = _loader(trace, micro=micro, workers=2)
            loader.load_state_dict(json.loads(json.dumps(state)))
            it = iter(loader)
        if step in changes:
            loader.set_mixture_weights(changes[step])
        ids: list[int] = []
        for _ in range(GBS // micro):
            ids += next(it)["id"].tolist()
        steps.append(ids)
    state = loader.state_dict()
    loader.close()
    return steps, state


def _cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "detdata.cli.main", "diff", *args],
        capture_output=True,
        text=True,
        check=False,
        timeout=300,
    )


def _reference(changes: dict[int, dict[str, int]]) -> list[list[int]]:
    """The steps an uninterrupted run applying ``changes`` delivers, from a `Mixture` built
    whole by its constructor (change asked before step s = a phase at position GBS*s)."""
    schedule = reference_schedule(W0, [(GBS * s, w) for s, w in sorted(changes.items())])
    flat = reference_ids(NAMES, schedule, GBS * STEPS)  # type: ignore[arg-type]
    return [flat[GBS * s : GBS * (s + 1)] for s in range(STEPS)]


def test_diff_of_runs_with_weight_changes_names_the_first_step_that_differs(
    tmp_path: Path,
) -> None:
    early = {4: {"a": 5, "b": 1, "c": 1}, 5: {"a": 1, "b": 1, "c": 6}, 9: {"a": 2, "b": 3, "c": 1}}
    late = {5: {"a": 5, "b": 1, "c": 1}, 6: {"a": 1, "b": 1, "c": 6}, 9: {"a": 2, "b": 3, "c": 1}}
    a_steps, a_state = _run(tmp_path / "a.jsonl", early)
    b_steps, b_state = _run(tmp_path / "b.jsonl", early, stop_at=7)
    c_steps, c_state = _run(tmp_path / "c.jsonl", late)
    # The caller's side against the independent reference first.
    assert a_steps == _reference(early) and b_steps == _reference(early)
    assert c_steps == _reference(late)
    # Same changes, one run stopped and resumed on another layout: identical.
    same = _cli(str(tmp_path / "a.jsonl"), str(tmp_path / "b.jsonl"))
    assert same.returncode == 0, same.stdout + same.stderr
    assert f"identical: {STEPS} steps" in same.stdout
    # A change one step later: the first step whose delivered samples differ.
    expected = next(s for s in range(STEPS) if _reference(early)[s] != _reference(late)[s])
    assert expected == 4
    other = _cli(str(tmp_path / "a.jsonl"), str(tmp_path / "c.jsonl"))
    assert other.returncode == 1, other.stdout + other.stderr
    assert f"first difference at step {expected} " in other.stdout
    # States: the same changes give identical states; other changes name the mixture.
    for name, state in (("a", a_state), ("b", b_state), ("c", c_state)):
        (tmp_path / f"{name}.json").write_text(json.dumps(state))
    differs = _cli("--state", str(tmp_path / "a.json"), str(tmp_path / "c.json"))
    assert differs.returncode == 1, differs.stdout + differs.stderr
    # the weights' phases in the stream and the recorded changes' positions are named
    assert "stream.schedule[1][0]: A 64 | B 80" in differs.stdout
    assert any(
        line.startswith("history[") and ".position: A 64 | B 80" in line
        for line in differs.stdout.splitlines()
    ), differs.stdout

    # The resumed run's state holds one more history entry (its layout change); its
    # weights history is a's, entry for entry, and c's is not.
    def weights_history(state: dict[str, Any]) -> list[Any]:
        return [
            (h["step"], h["position"], h["new"])
            for h in state["history"]
            if h.get("field") == "mixture_weights"
        ]

    assert weights_history(a_state) == weights_history(b_state) != weights_history(c_state)
    assert [s for s, _, _ in weights_history(a_state)] == sorted(early)
    assert [p for _, p, _ in weights_history(a_state)] == [GBS * s for s in sorted(early)]


def test_the_reference_itself_sees_the_change_position() -> None:
    """Guard for the test above: the two schedules really deliver different samples from
    step 4 on and the same before (else 'identical' would prove nothing)."""
    early = {4: {"a": 5, "b": 1, "c": 1}}
    late = {5: {"a": 5, "b": 1, "c": 1}}
    r1, r2 = _reference(early), _reference(late)
    assert r1[:4] == r2[:4] and r1[4] != r2[4]
