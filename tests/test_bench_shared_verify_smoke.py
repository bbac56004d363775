"""``python -m benchmarks.shared_verify --smoke`` runs end to end (issue 43).

A 1-rank and a 2-rank first start over 2,000 shards, then the model. Checked against the
corpus as written on disk (its files' sizes, not the benchmark's own figure) and against the
model's target worked out here: the lone rank read every shard; the two ranks together read
every shard once (not twice: the verification is shared) and delivered different batches;
the model's bytes per rank are the target's shards x 2 MiB (the ``quick`` check's first and
last MiB) over the ranks, and one verifier's are all of them."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow
@pytest.mark.multiproc
def test_shared_verify_benchmark_smoke_run(tmp_path: Path) -> None:
    out, data = tmp_path / "results", tmp_path / "data"
    cmd = [sys.executable, "-m", "benchmarks.shared_verify", "--smoke", "--out", str(out)]
    proc = subprocess.run(
        [*cmd, "--data-dir", str(data)], cwd=ROOT, capture_output=True, text=True, timeout=900
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    doc = json.loads((out / "shared_verify_smoke.json").read_text())
    corpus = sum(f.stat().st_size for f in (data / "n2000").rglob("*.npy"))
    rows = {r["ranks"]: r for r in doc["rows"]}
    assert set(rows) == {1, 2} and all(r["code"] == "after" for r in rows.values())
    assert rows[1]["rchar"][0] >= corpus  # one rank alone reads every shard
    two = rows[2]
    assert two["distinct_batches"] == 2 and len(two["rchar"]) == len(two["own_cpu_s"]) == 2
    assert corpus <= sum(two["rchar"]) < corpus * 3 // 2  # every shard once, none twice
    assert all(w > 0 for w in (rows[1]["wall_to_first_batch_s"], two["wall_to_first_batch_s"]))

    m = doc["model"]
    ranks, shards = m["target"]["ranks"], m["target"]["shards"]
    assert (ranks, shards, m["target"]["shard_bytes"]) == (10_000, 1_000_000, 64 * 10**6)
    assert m["shared"]["per_rank_bytes"] == pytest.approx(shards / ranks * 2 * 2**20)
    assert m["one_verifier"]["per_rank_bytes"] == pytest.approx(shards * 2 * 2**20)
    assert m["shared"]["slices"] * m["shared"]["slice_shards"] >= shards
    assert m["shared"]["slices"] == math.ceil(shards / m["shared"]["slice_shards"])
    measured = m["measured"]
    assert measured["per_shard_cpu_s"] > 0 and measured["quick_bytes"]["cpu_s"] > 0
    assert measured["store_op_s"] > 0
    assert m["shared"]["wall_s"] < m["one_verifier"]["wall_s"] / 100
    assert "| shared (" in proc.stdout and "| one verifier |" in proc.stdout
