"""A ``torch.distributed.checkpoint`` save inside gradient accumulation (issue 31).

Two ranks under torchrun (gloo, CPU) train with 2 micro steps per optimizer step and save model,
optimizer, step counter and the detdata loader with ``dcp.save`` after the first micro batch of
step 5, then stop. A fresh process at world size 1 loads it with ``dcp.load`` (which calls
``load_state_dict(state)`` itself: the default) and trains to step 8. The partial step's
gradients were in no state dict, so the resumed run must train step 5 whole: every micro batch
the model sees, grouped by the loop's optimizer step, is an uninterrupted plain loader's (run
here, at world size 1), rows and step boundaries alike; samples 40-43 reach an update.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.multiproc, pytest.mark.slow]

SCRIPT = Path(__file__).resolve().parents[1] / "dist" / "dcp_accum_check.py"
REPO = Path(__file__).resolve().parents[2]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _records(out: Path, ranks: int) -> list[dict]:
    return [json.loads(Path(f"{out}.rank{r}").read_text()) for r in range(ranks)]


def _steps(records: list[dict]) -> dict[int, list[int]]:
    """Row ids per optimizer step, over the given micro batches, in delivery order."""
    steps: dict[int, list[int]] = {}
    for r in records:
        steps.setdefault(r["step"], []).extend(r["ids"])
    return steps


def test_dcp_save_mid_accumulation_resumes_with_the_whole_step(tmp_path: Path) -> None:
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    ckpt = tmp_path / "ckpt"
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
                "--master-addr", "127.0.0.1", "--master-port", str(_free_port())]  # fmt: skip
    for cmd in (
        [*torchrun, str(SCRIPT), "train", str(ckpt), str(tmp_path / "train")],
        [sys.executable, str(SCRIPT), "resume", str(ckpt), str(tmp_path / "resume")],
        [sys.executable, str(SCRIPT), "reference", "-", str(tmp_path / "ref")],
    ):
        done = subprocess.run(cmd, env=env, timeout=240, capture_output=True, text=True)
        assert done.returncode == 0, done.stderr[-4000:]
    (reference,) = _records(tmp_path / "ref", 1)
    train = _records(tmp_path / "train", 2)
    (resumed,) = _records(tmp_path / "resume", 1)
    want = _steps(reference["records"])
    assert sorted(want) == list(range(8)) and all(len(v) == 8 for v in want.values())

    # the interrupted run: steps 0-4 whole over both ranks, then the first micro step of 5
    before: dict[int, list[int]] = {}
    for rank in train:
        for s, ids in _steps(rank["records"]).items():
            before.setdefault(s, []).extend(ids)
    assert {s: sorted(v) for s, v in before.items()} == {
        **{s: sorted(want[s]) for s in range(5)},
        5: sorted(want[5][:4]),
    }
    assert train[0]["consumed"] == 44  # samples 40-43 live only in .grad at the save

    # the resumed run trains step 5 whole again, then 6 and 7: micro batch for micro batch,
    # step boundary for step boundary, the uninterrupted loader's
    assert resumed["records"] == [r for r in reference["records"] if r["step"] >= 5]
    assert resumed["consumed"] == 64
