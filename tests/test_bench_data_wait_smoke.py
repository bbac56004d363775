"""The data-wait benchmark at smoke size: every contender feeds the trainer the data's own bytes.

The reference is a direct ``np.load`` of the shard files (not the contenders' readers): one
epoch of steps must deliver exactly the rows of the files, each once, whatever the order.
litData and Grain run where they can be imported (``benchmarks/peers/.venv``); elsewhere (the
project's ``.venv``) each must be reported as not run, with the reason, not silently dropped.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from benchmarks import data_wait
from benchmarks.bench_data import SEQ

TINY = [
    "--steps",
    "8",
    "--warmup",
    "2",
    "--rounds",
    "1",
    "--batch",
    "8",
    "--seq",
    "16",
    "--d-model",
    "16",
    "--layers",
    "1",
    "--vocab",
    "64",
    "--shards",
    "2",
    "--samples-per-shard",
    "32",
]


def direct_rows(root: Path) -> np.ndarray:
    """Every sample row of the ``.npy`` shards, read straight from the files."""
    files = sorted((root / "tokens").glob("shard-*.npy"))
    assert len(files) == 2
    return np.concatenate([np.load(f).reshape(-1, SEQ) for f in files])


def by_first_token(rows: np.ndarray) -> np.ndarray:
    return rows[np.argsort(rows[:, 0], kind="stable")]


@pytest.mark.multiproc
def test_every_contender_feeds_the_files_bytes_and_shares_are_fractions(tmp_path: Path) -> None:
    data = tmp_path / "data"
    out = tmp_path / "data_wait.json"
    args = data_wait.parse([*TINY, "--data", str(data), "--out", str(out), "--no-doc"])
    threads = torch.get_num_threads()
    try:
        assert data_wait.main([*TINY, "--data", str(data), "--out", str(out), "--no-doc"]) == 0
    finally:
        torch.set_num_threads(threads)
    reference = direct_rows(data)
    assert reference.shape == (64, SEQ)  # 8 steps x batch 8 = one epoch
    names, skipped = data_wait.contenders()
    assert set(data_wait.CONTENDERS) <= set(names)
    assert set(names) | set(skipped) == set(data_wait.CONTENDERS) | set(data_wait.PEERS)
    assert not set(names) & set(skipped)
    for workers in data_wait.WORKERS:
        for contender in names:
            spec = data_wait.spec_for(contender, workers, data, args)
            result = data_wait.train(spec, args, keep_rows=True)
            rows = result["rows"]
            assert rows.shape == reference.shape, (contender, workers)
            assert by_first_token(rows).astype(np.int32).tobytes() == reference.tobytes(), (
                contender,
                workers,
            )
            assert 0.0 <= result["share_waited"] <= 1.0
    doc = json.loads(out.read_text())
    summary = doc["summary"]
    assert {(r["contender"], r["workers"]) for r in summary} == {
        (c, w) for c in names for w in data_wait.WORKERS
    }
    for row in summary:
        assert 0.0 <= row["share_waited"] <= 1.0, row
        assert row["steps_per_s"] > 0 and row["validated"] is True, row
    assert doc["not_run"] == skipped
    section = data_wait.markdown(doc)
    for peer, why in skipped.items():
        assert why.startswith("not installed") and f"{data_wait.LABELS[peer]}: {why}" in section
    assert section.startswith(data_wait.BEGIN) and section.endswith(data_wait.END)
    assert out.with_suffix(".png").stat().st_size > 1000
