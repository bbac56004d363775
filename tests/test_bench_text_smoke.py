"""The raw-text benchmark (issue 45) runs end to end at smoke size, all three pipelines."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_text_benchmark_smoke_run(tmp_path: Path) -> None:
    out = tmp_path / "results"
    cmd = [sys.executable, "-m", "benchmarks.text", "--smoke", "--out", str(out)]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    doc = json.loads((out / "text.json").read_text())
    names = [r["pipeline"] for r in doc["rows"]]
    assert names == [
        "text at read",
        "text at read, batches_ahead=1",
        "pre-tokenised",
        "HF datasets + torch",
    ]
    for row in doc["rows"]:
        assert row["tokens_per_s"] > 0 and row["first_batch_s"] > 0, row
    assert doc["index_build_s_per_gb"] > 0 and doc["tokenizer_alone_tokens_per_s"] > 0
