"""The diff's model of a run: restores, restarts and discontinuities told apart, so the first
divergent step is the true one whatever the lengths of the parts.

Reference: the test records what each run trained on, training step by training step (the
``id`` column is the sample id), and finds the first training step where two runs got
different samples by brute force. `compare` must name that step; a ``--steps`` window in
which both runs delivered the same samples must compare identical.

Covers: detdata/loading/trace/diff.py.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

import detdata
from detdata.cli.main import main
from detdata.loading.loader import DataLoader
from detdata.loading.trace import compare, read_trace

GBS = 4
DATA = detdata.ArrayDataset({"id": np.arange(1000, dtype=np.int64)})


def _loader(trace: Path) -> DataLoader:
    return DataLoader(
        DATA,
        global_batch_size=GBS,
        micro_batch_size=2,
        seed=7,
        options=detdata.LoaderOptions(trace=trace),
    )


def _train(dl: DataLoader, steps: int, log: list[list[int]]) -> None:
    """``steps`` training steps (2 micro batches each), appending each step's ids to ``log``."""
    it = iter(dl)
    for _ in range(steps):
        log.append([i for _ in range(2) for i in next(it)["id"].tolist()])


def _clean(path: Path, steps: int) -> list[list[int]]:
    log: list[list[int]] = []
    _train(_loader(path), steps, log)
    return log


def _reset(path: Path, before: int, after: int) -> list[list[int]]:
    """``before`` steps, then a fresh loader whose state was not loaded, ``after`` steps."""
    log: list[list[int]] = []
    _train(_loader(path), before, log)
    _train(_loader(path), after, log)  # the data cursor is forgotten: it starts over
    return log


def _first_divergent(a: list[list[int]], b: list[list[int]]) -> int | None:
    """Brute force: the first training step where the runs trained on other samples."""
    for t in range(max(len(a), len(b))):
        if t >= len(a) or t >= len(b) or a[t] != b[t]:
            return t
    return None


@pytest.mark.parametrize(
    ("before", "after", "total"),
    [(37, 23, 60), (40, 20, 60), (11, 5, 16), (5, 30, 35), (20, 20, 40)],
)
def test_a_forgotten_cursor_is_reported_at_the_true_step(
    tmp_path: Path, before: int, after: int, total: int
) -> None:
    ref = _clean(tmp_path / "a.jsonl", total)
    bad = _reset(tmp_path / "b.jsonl", before, after)
    truth = _first_divergent(ref, bad)
    assert truth == before
    found = compare(read_trace(tmp_path / "a.jsonl"), read_trace(tmp_path / "b.jsonl")).first
    assert found is not None and found.step == truth and found.kind == "discontinuity"
    assert "restart" in found.reason and "in B" in found.reason
    # a window before the reset: both runs delivered the same bytes there
    window = compare(
        read_trace(tmp_path / "a.jsonl"), read_trace(tmp_path / "b.jsonl"), stop=before
    )
    assert window.first is None and window.steps_compared == before


def test_diff_steps_window_before_the_reset_is_identical(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    _clean(tmp_path / "a.jsonl", 60)
    _reset(tmp_path / "b.jsonl", 37, 23)
    a, b = str(tmp_path / "a.jsonl"), str(tmp_path / "b.jsonl")
    assert main(["diff", a, b, "--steps", "0:37"]) == 0
    assert "identical: 37 steps in steps 0:37" in capsys.readouterr().out
    assert main(["diff", a, b]) == 1
    assert capsys.readouterr().out.startswith("first difference at step 37 (rank 0)")
    assert main(["diff", a, b, "--steps", "30:40"]) == 1
    assert "first difference at step 37" in capsys.readouterr().out


def test_a_restore_after_a_restart_rolls_it_back(tmp_path: Path) -> None:
    """A restart noticed and undone: the state saved at step 30 is loaded after 6 steps of
    restarted data; what stands is steps 0..29 and the resumed 30.. = a clean run."""
    ref = _clean(tmp_path / "a.jsonl", 40)
    path = tmp_path / "b.jsonl"
    first = _loader(path)
    log: list[list[int]] = []
    _train(first, 30, log)
    saved = json.loads(json.dumps(first.state_dict()))
    _train(_loader(path), 6, log)  # forgot the cursor
    resumed = _loader(path)
    resumed.load_state_dict(saved)
    del log[30:]  # the model is restored with the loader: those 6 steps are rolled back
    _train(resumed, 10, log)
    assert _first_divergent(ref, log) is None
    assert compare(read_trace(tmp_path / "a.jsonl"), read_trace(path)).first is None


def test_a_resume_from_an_earlier_checkpoint_replays_and_compares_equal(tmp_path: Path) -> None:
    ref = _clean(tmp_path / "a.jsonl", 30)
    path = tmp_path / "b.jsonl"
    first = _loader(path)
    log: list[list[int]] = []
    _train(first, 10, log)
    saved = json.loads(json.dumps(first.state_dict()))
    _train(first, 8, log)  # steps 10..17, then a crash: resumed from the checkpoint at 10
    resumed = _loader(path)
    resumed.load_state_dict(saved)
    del log[10:]
    _train(resumed, 20, log)
    assert _first_divergent(ref, log) is None
    assert compare(read_trace(tmp_path / "a.jsonl"), read_trace(path)).first is None


def test_labels_name_the_runs(tmp_path: Path) -> None:
    _clean(tmp_path / "a.jsonl", 16)
    _reset(tmp_path / "c.jsonl", 11, 5)
    found = compare(
        read_trace(tmp_path / "a.jsonl"), read_trace(tmp_path / "c.jsonl"), labels=("A", "C")
    ).first
    assert found is not None and found.step == 11
    assert "discontinuity in C" in found.reason and " B" not in found.reason
