"""Every example runs in a small configuration and checks its own claim (issue 8)."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.multiproc  # runs the real console command / child processes

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"


def _run(args: list[str], tmp_path: Path, timeout: int = 600) -> str:
    env = {**os.environ, "DETDATA_REGISTRY": str(tmp_path / "registry"), "OMP_NUM_THREADS": "1"}
    done = subprocess.run(
        args, cwd=EXAMPLES, env=env, capture_output=True, text=True, timeout=timeout, check=False
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.mark.slow
def test_pretrain_minimal_runs_and_resumes(tmp_path: Path) -> None:
    first = _run(
        [sys.executable, "pretrain_minimal.py", "--workdir", str(tmp_path), "--steps", "4"],
        tmp_path,
    )
    assert "samples_consumed 80" in first  # 5 steps x 16 delivered when step 4 finished
    second = _run(
        [sys.executable, "pretrain_minimal.py", "--workdir", str(tmp_path), "--steps", "8"],
        tmp_path,
    )
    assert "samples_consumed 144" in second  # continued from 80 instead of restarting


def test_register_shards(tmp_path: Path) -> None:
    out = json.loads(
        _run([sys.executable, "register_shards.py"], tmp_path).strip().splitlines()[-1]
    )
    assert out["id"].startswith("b3:") and out["shards"] == 4 and out["tokens"] == 200_000
    assert (tmp_path / "registry").exists()


@pytest.mark.parametrize("at", ["4096", "1000000000000"])
def test_resume_at_index(tmp_path: Path, at: str) -> None:
    assert "-> True" in _run([sys.executable, "resume_at_index.py", "--at", at], tmp_path)


def test_keep_your_loader(tmp_path: Path) -> None:
    assert "identical to the straight run: True" in _run(
        [sys.executable, "keep_your_loader.py"], tmp_path
    )


@pytest.mark.slow
@pytest.mark.multiproc
def test_torchrun_dp_then_resume_at_other_world_size(tmp_path: Path) -> None:
    base = [sys.executable, "-m", "torch.distributed.run", "--master-addr", "127.0.0.1"]
    # Each launch takes ~5 s; a short timeout turns a distributed hang into a quick failure.
    two = _run(
        [
            *base,
            "--nproc-per-node",
            "2",
            "--master-port",
            str(_port()),
            "torchrun_dp.py",
            "--workdir",
            str(tmp_path),
            "--steps",
            "3",
        ],
        tmp_path,
        timeout=180,
    )
    one = _run(
        [
            *base,
            "--nproc-per-node",
            "1",
            "--master-port",
            str(_port()),
            "torchrun_dp.py",
            "--workdir",
            str(tmp_path),
            "--steps",
            "6",
        ],
        tmp_path,
        timeout=180,
    )
    a, b = (json.loads(x.strip().splitlines()[-1]) for x in (two, one))
    assert (a["world_size"], b["world_size"]) == (2, 1)
    assert b["from_step"] == a["to_step"] and b["samples_consumed"] > a["samples_consumed"]


@pytest.mark.slow
@pytest.mark.multiproc
def test_replay_check_command(tmp_path: Path) -> None:
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "detdata.cli.main",
            "replay-check",
            "--out",
            str(tmp_path / "d"),
            "--steps",
            "6",
            "--stop-at",
            "3",
        ],
        capture_output=True,
        text=True,
        timeout=400,
        check=False,
    )
    assert done.returncode == 0, done.stdout + done.stderr[-2000:]
    assert "first divergent data step A vs C: none" in done.stdout
    assert "PASS (bitwise identical)" in done.stdout
