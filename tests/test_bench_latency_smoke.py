"""The resume-latency benchmark runs end to end at smoke size; every first batch is checked
(each row ``64 w + arange(65)`` at the ids the order assigns to the resumed positions)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_resume_latency_benchmark_smoke_run(tmp_path: Path) -> None:
    cmd = [sys.executable, "-m", "benchmarks.resume_latency", "--shards", "10"]
    cmd += ["--positions", "0,1000000000", "--repeats", "1"]
    cmd += ["--data", str(tmp_path / "data"), "--out", str(tmp_path / "out")]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    doc = json.loads((tmp_path / "out" / "resume_latency.json").read_text())
    assert set(doc["summary"]) == {
        f"{n}|{mode}|{p}"
        for n in (10,)
        for mode, p in [("first", 0), ("restart", 0), ("restart", 10**9)]
    }
    assert all(s["ok"] and s["resume_s"] > 0 for s in doc["summary"].values())
    assert "| 10 |" in proc.stdout and "resume @1,000,000,000" in proc.stdout


@pytest.mark.slow
def test_resume_latency_on_the_startup_corpus_keeps_the_earlier_rows(tmp_path: Path) -> None:
    """A shard count run on `benchmarks.startup`'s 2 KiB-shard corpus (the 1M row reuses
    the shared-verification benchmark's corpus) is checked against that corpus's writer
    formula, and ``--keep`` adds it to the rows already measured, each run's provenance
    naming its shard counts."""
    base = [sys.executable, "-m", "benchmarks.resume_latency", "--repeats", "1"]
    base += ["--data", str(tmp_path / "data"), "--out", str(tmp_path / "out")]
    runs = [
        ["--shards", "10", "--positions", "0,1000000000"],
        ["--shards", "50", "--positions", "0,1000000000", "--keep"],
        ["--startup-shards", "50", "--startup-data", str(tmp_path / "startup")],
    ]
    for extra in (runs[0], runs[1] + runs[2]):
        proc = subprocess.run(base + extra, cwd=ROOT, capture_output=True, text=True, timeout=600)
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    doc = json.loads((tmp_path / "out" / "resume_latency.json").read_text())
    assert set(doc["summary"]) == {
        f"{n}|{mode}|{p}"
        for n in (10, 50)
        for mode, p in [("first", 0), ("restart", 0), ("restart", 10**9)]
    }
    assert all(s["ok"] for s in doc["summary"].values())
    assert doc["corpora"]["50"]["kind"] == "startup" and "kind" not in doc["corpora"]["10"]
    assert [p["shards"] for p in doc["earlier"]] == [[10]] and doc["provenance"]["shards"] == [50]
    assert (tmp_path / "startup" / "n50" / "manifest.json").exists()
    assert "| 50 (2 KiB shards) | written with its entries |" in proc.stdout
    assert "| 10 |" in proc.stdout
