"""Traces and `detdata diff` (issue 3): digests, layout invariance, first differing step.

More (resumes, replays, restarts, malformed traces, states): tests/loading/test_evidence.py.

Covers: detdata/loading/trace/write.py, detdata/loading/trace/digests.py,
  detdata/loading/trace/read.py.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import detdata
from detdata.loading.trace import read_trace, step_digests
from tests.resume_checker import take

pytestmark = pytest.mark.multiproc  # runs the real console command / child processes


def _ds(offset: int = 0) -> detdata.ArrayDataset:
    x = np.arange(400 * 5, dtype=np.int32).reshape(400, 5)
    x[123, 2] += offset
    return detdata.ArrayDataset({"x": x})


def _trace(
    path: Path,
    micro: int,
    workers: int = 0,
    resume_at: int | None = None,
    offset: int = 0,
    steps: int = 20,
) -> list[dict[str, object]]:
    dl = detdata.DataLoader(
        _ds(offset),
        global_batch_size=8,
        micro_batch_size=micro,
        seed=4,
        options=detdata.LoaderOptions(trace=path),
        num_workers=workers,
    )
    if resume_at is not None:
        first = detdata.DataLoader(_ds(offset), global_batch_size=8, micro_batch_size=micro, seed=4)
        list(take(first, resume_at * 8 // micro))
        dl.load_state_dict(first.state_dict())
        steps -= resume_at
    list(take(dl, steps * 8 // micro))
    dl.close()
    return read_trace(path)


def _diff(a: Path, b: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "detdata.cli.main", "diff", str(a), str(b)],
        capture_output=True,
        text=True,
        check=False,
    )


def test_trace_records_are_micro_batch_and_worker_invariant(tmp_path: Path) -> None:
    a = step_digests(_trace(tmp_path / "a.jsonl", micro=8))
    b = step_digests(_trace(tmp_path / "b.jsonl", micro=2, workers=2))
    assert len(a) == 20 and a == b
    assert [d["positions"] for d in a.values()] == [[[8 * s, 8 * s + 8]] for s in range(20)]
    assert _diff(tmp_path / "a.jsonl", tmp_path / "b.jsonl").returncode == 0


def test_resumed_trace_equals_straight_suffix(tmp_path: Path) -> None:
    straight = step_digests(_trace(tmp_path / "s.jsonl", micro=4))
    resumed = step_digests(_trace(tmp_path / "r.jsonl", micro=4, resume_at=7))
    assert resumed == {step: d for step, d in straight.items() if step >= 7}


def test_diff_names_first_differing_step(tmp_path: Path) -> None:
    clean = _trace(tmp_path / "clean.jsonl", micro=4)
    _trace(tmp_path / "bad.jsonl", micro=4, offset=1)  # sample 123 changed
    order = detdata.GlobalOrder(400, 4)
    step_of_123 = int(np.flatnonzero(order.ids(np.arange(160)) == 123)[0]) // 8
    result = _diff(tmp_path / "clean.jsonl", tmp_path / "bad.jsonl")
    assert result.returncode == 1
    assert f"first difference at step {step_of_123} " in result.stdout
    assert "batch_b3" in result.stdout and "positions_b3" not in result.stdout.split("\n")[0]
    assert len(step_digests(clean)) == 20


def test_diff_reports_missing_steps_and_bad_files(tmp_path: Path) -> None:
    _trace(tmp_path / "long.jsonl", micro=8, steps=6)
    _trace(tmp_path / "short.jsonl", micro=8, steps=4)
    result = _diff(tmp_path / "long.jsonl", tmp_path / "short.jsonl")
    assert result.returncode == 1 and "step 4" in result.stdout and "missing in B" in result.stdout
    missing = _diff(tmp_path / "long.jsonl", tmp_path / "nope.jsonl")
    assert missing.returncode == 2 and "nope.jsonl" in missing.stderr


def test_the_writer_refuses_a_batch_outside_its_step_or_without_positions(tmp_path: Path) -> None:
    """The trace never misstates the run: a micro batch that does not lie in the step its span
    names, or that has no positions, is refused before anything is written."""
    from detdata.loading.trace.write import StepSpan, TraceWriter

    writer = TraceWriter(tmp_path / "t.jsonl", rank=0)
    batch = {"x": np.zeros((2, 3), dtype=np.int64)}
    with pytest.raises(detdata.ConfigError, match=r"micro batch \[8, 10\) is not inside its step"):
        writer.add(8, np.array([8, 9]), batch, span=StepSpan(step=1, start=4, size=4, next=10))
    with pytest.raises(detdata.ConfigError, match="without positions"):
        writer.add(
            4, np.array([], dtype=np.int64), {}, span=StepSpan(step=1, start=4, size=4, next=5)
        )
    writer.add(4, np.array([4, 5]), batch, span=StepSpan(step=1, start=4, size=4, next=6))
    writer.close()
    assert len((tmp_path / "t.jsonl").read_text().splitlines()) == 1  # only the good batch
