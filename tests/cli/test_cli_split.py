"""``detdata split`` through the real console entry point: the id lists equal `Split`'s."""

from __future__ import annotations

import json
from pathlib import Path

import blake3
import numpy as np
import pytest

from detdata import Split, TableRows, build_manifest
from tests.cli.test_cli_env import _run
from tests.datasets.test_split import SALT, _rows, _write_parquet

pytestmark = pytest.mark.multiproc  # runs the real console command


def test_split_writes_the_id_lists_and_the_assignment(tmp_path: Path) -> None:
    ds = _write_parquet(tmp_path / "data", _rows(), [600], ["p0.parquet", "p1.parquet"])
    manifest = tmp_path / "manifest.json"
    build_manifest(str(tmp_path / "data")).save(str(manifest))
    out = tmp_path / "split"
    done = _run(
        "split",
        "--manifest",
        str(manifest),
        "--fraction",
        "0.05",
        "--salt",
        SALT,
        "--out",
        str(out),
    )
    assert done.returncode == 0, done.stderr
    doc = json.loads((out / "split.json").read_text())
    assert json.loads(done.stdout) == doc
    api = Split(TableRows(ds.manifest), fraction="1/20", salt=SALT)
    assert doc["rule"] == {
        "algorithm": "split-v1",
        "key": "content",
        "fraction": "1/20",
        "salt": SALT,
    }
    assert doc["assignment"] == api.assignment
    assert doc["validation_keys"] == api.validation_keys
    for part in (api.train, api.validation):
        path = out / doc[part.part]["file"]
        assert np.load(path).tolist() == part.ids.tolist()
        assert doc[part.part]["count"] == part.num_samples
        assert doc[part.part]["blake3"] == "b3:" + blake3.blake3(path.read_bytes()).hexdigest()
    ids = np.load(out / "train_ids.npy").tolist() + np.load(out / "validation_ids.npy").tolist()
    assert sorted(ids) == list(range(ds.num_samples))


def test_split_of_token_shards_needs_seq_len(tmp_path: Path) -> None:
    from tests.conftest import write_token_shards

    write_token_shards(tmp_path / "data")
    manifest = tmp_path / "manifest.json"
    build_manifest(str(tmp_path / "data")).save(str(manifest))
    done = _run(
        "split",
        "--manifest",
        str(manifest),
        "--fraction",
        "1/10",
        "--salt",
        "s",
        "--out",
        str(tmp_path / "out"),
    )
    assert done.returncode == 2 and "--seq-len" in done.stderr
    done = _run(
        "split",
        "--manifest",
        str(manifest),
        "--fraction",
        "1/10",
        "--salt",
        "s",
        "--seq-len",
        "16",
        "--out",
        str(tmp_path / "out"),
    )
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["dataset"]["type"] == "token_windows"
