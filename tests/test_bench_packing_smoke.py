"""The packing benchmark runs end to end at smoke size; its packed windows are validated."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_packing_benchmark_smoke_run(tmp_path: Path) -> None:
    out = tmp_path / "results"
    cmd = [
        sys.executable,
        "-m",
        "benchmarks.packing",
        "--smoke",
        "--out",
        str(out),
        "--work",
        str(tmp_path / "work"),
    ]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    doc = json.loads((out / "packing.json").read_text())
    assert {r["dataset"] for r in doc["read"]} == {"TokenWindows", "PackedWindows"}
    for row in doc["read"]:
        assert row["validated"] is True and row["read_windows_per_s"] > 0, row
        assert row["loader_windows_per_s"] > 0, row
    (build,) = doc["build"]
    assert build["documents"] == 20_000 and build["build_s_per_1e6_docs"] > 0
    assert build["index_bytes_per_doc"] == pytest.approx(24, abs=0.01)  # 8 + 16 bytes
    resume = doc["resume"]
    assert resume["position"] == 10**9 and resume["resume_first_batch_s"] > 0
    assert "resume at position 1,000,000,000" in proc.stdout
