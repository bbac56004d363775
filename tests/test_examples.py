"""Every example runs in a small configuration and checks its own claim (issue 8).

Covers: detdata/cli/demo_run.py.
"""

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
def _trained(path: Path) -> list[tuple[int, list[str]]]:
    return [(r["step"], r["rows"]) for r in map(json.loads, path.read_text().splitlines())]


def test_pretrain_minimal_stopped_and_resumed_trains_what_an_uninterrupted_run_trains(
    tmp_path: Path,
) -> None:
    """The example's loop takes exactly the batches of its steps: stopped at step 4 and resumed
    in a fresh process, it trains the rows an uninterrupted 8-step run trains, step by step
    (no batch skipped at the stop), and ends with the same weights."""
    straight, split = tmp_path / "straight", tmp_path / "split"
    cmd = [sys.executable, "pretrain_minimal.py"]
    whole = _run(
        [
            *cmd,
            "--workdir",
            str(straight),
            "--steps",
            "8",
            "--record",
            str(straight / "rows.jsonl"),
        ],
        tmp_path,
    )
    _run(
        [*cmd, "--workdir", str(split), "--steps", "4", "--record", str(split / "rows.jsonl")],
        tmp_path,
    )
    resumed = _run(
        [*cmd, "--workdir", str(split), "--steps", "8", "--record", str(split / "rows.jsonl")],
        tmp_path,
    )
    reference = _trained(straight / "rows.jsonl")
    assert [step for step, _ in reference] == list(range(8))
    assert _trained(split / "rows.jsonl") == reference
    assert "samples_consumed 128" in resumed  # 8 steps x 16, nothing delivered beyond them
    weights = [line.split("weights ")[1] for line in (whole, resumed)]
    assert weights[0] == weights[1]


def test_pretrain_megatron_packed_resumes_to_the_uninterrupted_rows_and_weights(
    tmp_path: Path,
) -> None:
    """Megatron .bin/.idx corpus, packed windows with intra-document masks: stopped at step 3
    and resumed in a fresh process, it trains the rows of an uninterrupted 6-step run."""
    straight, split = tmp_path / "straight", tmp_path / "split"
    cmd = [sys.executable, "pretrain_megatron_packed.py"]

    def run(work: Path, steps: int) -> str:
        args = ["--workdir", str(work), "--steps", str(steps), "--record", str(work / "r.jsonl")]
        return _run([*cmd, *args], tmp_path)

    whole = run(straight, 6)
    run(split, 3)
    resumed = run(split, 6)
    assert _trained(split / "r.jsonl") == _trained(straight / "r.jsonl")
    steps = [s for s, _ in _trained(straight / "r.jsonl")]
    assert steps == [s for s in range(6) for _ in range(2)]  # two micro batches a step
    assert "documents 600" in whole and "samples_consumed 48" in resumed
    assert whole.split("weights ")[1] == resumed.split("weights ")[1]


def test_register_shards(tmp_path: Path) -> None:
    out = json.loads(
        _run([sys.executable, "register_shards.py"], tmp_path).strip().splitlines()[-1]
    )
    assert out["id"].startswith("b3:") and out["shards"] == 4 and out["tokens"] == 200_000
    assert (tmp_path / "registry").exists()


@pytest.mark.parametrize("at", ["4096", "1000000000000"])
def test_resume_at_index(tmp_path: Path, at: str) -> None:
    assert "-> True" in _run([sys.executable, "resume_at_index.py", "--at", at], tmp_path)


def test_loss_spike(tmp_path: Path) -> None:
    out = _run([sys.executable, "loss_spike.py", "--workdir", str(tmp_path / "w")], tmp_path)
    assert "provenance of step 6 matches the shard files: True" in out
    assert "replayed steps 4..8 identical: True" in out
    assert "only they changed: True; never delivered: True" in out
    assert "earlier steps replayed through the exclusions unchanged: True" in out


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
            "--record",
            str(tmp_path / "rows"),
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
            "--record",
            str(tmp_path / "resumed"),
        ],
        tmp_path,
        timeout=180,
    )
    a, b = (json.loads(x.strip().splitlines()[-1]) for x in (two, one))
    assert (a["world_size"], b["world_size"]) == (2, 1)
    assert (a["from_step"], a["to_step"], b["from_step"], b["to_step"]) == (0, 3, 3, 6)
    # the rows trained per global step (ranks 0, 1 of the 2-rank run in rank order, then the
    # 1-rank run) equal a single uninterrupted 6-step run at world size 1
    straight = tmp_path / "straight"
    _run(
        [
            *base,
            "--nproc-per-node",
            "1",
            "--master-port",
            str(_port()),
            "torchrun_dp.py",
            "--workdir",
            str(straight),
            "--steps",
            "6",
            "--record",
            str(straight / "rows"),
        ],
        tmp_path,
        timeout=180,
    )
    reference = {s: rows for s, rows in _trained(straight / "rows.rank0")}
    got: dict[int, list[str]] = {}
    for rank_file in ("rows.rank0", "rows.rank1"):
        for step, rows in _trained(tmp_path / rank_file):
            got.setdefault(step, []).extend(rows)
    for step, rows in _trained(tmp_path / "resumed.rank0"):
        got.setdefault(step, []).extend(rows)
    assert sorted(reference) == list(range(6))
    assert got == reference


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


def test_adaptive_mixture_resumes_and_replays_the_weight_trajectory(tmp_path: Path) -> None:
    """examples/adaptive_mixture.py (issue 44): a DoReMi-style controller changes the
    weights during the run; the stopped-and-resumed run trains the uninterrupted run's
    samples with its weight trajectory, and the trajectory recorded in the state replays
    the samples without the controller (the example asserts each; here its report)."""
    out = _run([sys.executable, "adaptive_mixture.py", "--steps", "16", "--stop", "7"], tmp_path)
    lines = out.splitlines()
    assert lines[0] == "1. stopped at step 7, resumed: same samples and weights at every step"
    assert lines[1].startswith("2. ") and lines[1].endswith("without the controller: same samples")
    assert int(lines[1].split()[1]) >= 10  # the controller changed the weights at most steps
