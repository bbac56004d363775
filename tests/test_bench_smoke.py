"""The benchmark runs end to end at smoke size and every contender's output is validated."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
EXPECTED = {"vanilla", "vanilla-batched", "stateful", "detdata", "detdata-threads"}


@pytest.mark.slow
@pytest.mark.multiproc
def test_benchmark_smoke_run_validates_every_contender(tmp_path: Path) -> None:
    out = tmp_path / "results"
    cmd = [
        sys.executable,
        "-m",
        "benchmarks",
        "--smoke",
        "--out",
        str(out),
        "--data-dir",
        str(tmp_path / "data"),
        "--budget",
        "0.1",
    ]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    doc = json.loads((out / "throughput.json").read_text())
    rows = doc["summary"]
    assert {r["contender"] for r in rows} == EXPECTED
    assert {r["data"] for r in rows} == {"tokens", "parquet"}
    for row in rows:
        assert row["validated"] is True, row
        assert row["samples_per_s"] and row["samples_per_s"] > 0, row
        assert abs(row["spearman"]) < 0.2, row  # shuffled
        if row["contender"].startswith("detdata"):
            assert row["exact_order"] is True, row
    far = [r for r in rows if r["contender"] == "detdata" and r["workers"] == 0]
    assert all(r["ttfb_far_s"] is not None for r in far)
    assert set(doc["skipped"]) == {"mosaicml-streaming", "grain", "litdata"}
    assert (out / "throughput.md").read_text().startswith("# Throughput")
    assert (out / "throughput.png").stat().st_size > 1000


def test_detdata_bench_forwards_its_options_with_absolute_paths(tmp_path: Path) -> None:
    from detdata.cli.bench import bench_argv, find_checkout
    from detdata.cli.main import build_parser

    args = build_parser().parse_args(["bench", "--smoke", "--out", "res", "--repeats", "2"])
    argv = bench_argv(args)
    assert argv[0] == "--smoke"
    assert argv[argv.index("--out") + 1] == str(Path("res").resolve())
    assert argv[argv.index("--repeats") + 1] == "2"
    assert find_checkout(None) == ROOT
