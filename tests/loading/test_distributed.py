"""A real 2-process torchrun (gloo, CPU) run, then a resume at world size 1 (issue 3)."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.multiproc  # runs the real console command / child processes

SCRIPT = Path(__file__).resolve().parents[1] / "dist" / "torchrun_check.py"
REPO = Path(__file__).resolve().parents[2]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.mark.slow
@pytest.mark.multiproc
def test_torchrun_two_ranks_union_equals_global_batch_then_resume_at_one(tmp_path: Path) -> None:
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    ckpt, out1, out2 = tmp_path / "ckpt", tmp_path / "train.json", tmp_path / "resume.json"
    subprocess.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--nproc-per-node",
            "2",
            "--master-addr",
            "127.0.0.1",
            "--master-port",
            str(_free_port()),
            str(SCRIPT),
            "train",
            str(ckpt),
            str(out1),
        ],
        check=True,
        env=env,
        timeout=240,
        capture_output=True,
    )
    train = json.loads(out1.read_text())
    assert train["world"] == 2
    assert train["consumed"] == 24
    assert train["gathered"] == train["single"]
    subprocess.run(
        [sys.executable, str(SCRIPT), "resume", str(ckpt), str(out2)],
        check=True,
        env=env,
        timeout=120,
        capture_output=True,
    )
    resumed = json.loads(out2.read_text())
    assert resumed["consumed"] == 24
    assert resumed["resumed"] == resumed["single"]
