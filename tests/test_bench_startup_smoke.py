"""``benchmarks/startup.py --smoke`` runs end to end: 2 ranks at once, first start and restart.

The figures are measured by each rank process itself (/proc/self, getrusage); the checks
here are the ones a smoke run can make on a shared machine: every rank delivered a batch,
the ranks' batches differ, the ranks together read the corpus once at the first start (the
job's verification is shared) and the restart read under 1% of it (receipts)."""

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
    reads = [r["rchar"] for r in first["per_rank"]]
    # the job's verification is shared by its ranks (issue 43): together they read every
    # checked byte, and no shard twice (each rank's own first batch is a small extra)
    assert corpus <= sum(reads) < corpus * 3 // 2
    assert restart["job_rchar"] < first["job_rchar"] - corpus // 2


@pytest.mark.slow
def test_small_start_benchmark_smoke_run(tmp_path: Path) -> None:
    """``benchmarks/small_start.py --smoke``: every mode ran in fresh processes, every detdata
    mode (first start, restart, verify off) delivered the same first batch, and that batch
    is the windows the order names, cut from the shard's own bytes (brute force)."""
    import hashlib

    import numpy as np

    from detdata import GlobalOrder

    out = tmp_path / "results"
    data = tmp_path / "data"
    cmd = [sys.executable, "benchmarks/small_start.py", "--smoke", "--out", str(out)]
    cmd += ["--data-dir", str(data)]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    doc = json.loads((out / "small_start_smoke.json").read_text())
    modes = doc["modes"]
    assert set(modes) == {"floor", "reference", "detdata-restart", "detdata-first", "detdata-off"}
    for row in modes.values():
        assert row["runs"] == doc["repeats"] == 2 and row["cpu_s"] > 0
    assert modes["detdata-first"]["rchar"] > modes["detdata-restart"]["rchar"]  # it verified
    assert doc["detdata_distinct_batches"] == 1
    (shard,) = data.rglob("shard-00000.npy")
    tokens = np.load(shard)
    seq, batch = doc["seq_len"], doc["batch"]
    ids = GlobalOrder((len(tokens) - 1) // seq, 0).ids(np.arange(batch))
    want = np.stack([tokens[i * seq : i * seq + seq + 1] for i in ids.tolist()]).astype(np.int32)
    digest = hashlib.sha256(want.tobytes()).hexdigest()
    assert {r["batch_sha256"] for r in doc["runs"]["detdata-off"]} == {digest}
