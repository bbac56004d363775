"""``benchmarks/scale.py --smoke`` runs end to end: every row checked, resources bounded."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow
@pytest.mark.multiproc
def test_scale_benchmark_smoke_run_reports_bounded_handles(tmp_path: Path) -> None:
    out = tmp_path / "results"
    cmd = [
        sys.executable,
        "benchmarks/scale.py",
        "--smoke",
        "--out",
        str(out),
        "--data-dir",
        str(tmp_path / "data"),
        "--max-open-shards",
        "16",
        "--skip-identity",
    ]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    doc = json.loads((out / "scale.json").read_text())
    measured = [r for r in doc["results"] if r.get("samples_per_s") is not None]
    assert {(r["kind"], r["workers"]) for r in measured} >= {
        ("tokens", 0),
        ("tokens", 2),
        ("parquet", 0),
    }
    for row in measured:  # every delivered row was checked by the benchmark itself
        assert row["samples"] > 0 and row["samples_per_s"] > 0, row
        # more shards than the bound, yet at most 16 mapped per process (+ reads in flight)
        assert row["peak_shard_maps_main"] <= 16 + 2, row
        assert row["peak_shard_maps_worker"] <= 16 + 2, row
        if row["workers"]:
            assert row["workers_seen"] >= 2 and row["peak_rss_worker_mib"] > 0, row
    assert max(r["shards"] for r in measured if r["kind"] == "tokens") > 16
    assert "exponent" in doc["table"] and "# Scale (shards)" in proc.stdout
    assert {m["what"].split(":")[0] for m in doc["miss_costs"]} == {"tokens", "parquet"}
    # alternating slices: every order at the most shards against feistel-v1 at the fewest,
    # for each worker count; each slice's ratio from rows the benchmark checked
    slices = doc["slices"]
    assert {(r["candidate"].split(" at ")[0], r["workers"]) for r in slices} >= {
        ("feistel-v1", 0),
        ("feistel-v1", 2),
    }
    for row in slices:
        assert len(row["pct_each"]) == row["slices"] == 2 and row["samples_per_s"] > 0, row
        assert min(row["pct_each"]) <= row["pct_median"] <= max(row["pct_each"]), row
    assert "alternating slices" in doc["table"]
