"""A shared first start's whole pass is the ranks' (docs/design.md section 8, issue 43).

At a first start the claimant publishes only the plan: each rank takes the receipt's
identity (``stat``) of its slices' files and its part of the fast form's tie in the same
pass as their check, and the claimant gathers them. Checked under torchrun (gloo) with the
real functions counted in the children (tests/dist/shared_pass_check.py): every shard file
is stat'ed once in the job and every entry decoded once (the claimant no longer does either
for all); the receipt a 4-rank job writes is byte for byte the one a lone (1-rank) run
writes over the same corpus; a shard changed in one rank's slice is named on every rank,
with that rank (the one whose ``stat`` took the shard's identity). In process: the tie
from parts cut anywhere is the manifest's id, and tampered parts are refused as
`verify_columns_id` refuses tampered columns.

Covers: detdata/identity/shared.py, detdata/identity/columns_tie.py.
"""

from __future__ import annotations

import itertools
import json
import os
import re
import socket
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from detdata import Manifest, build_manifest
from detdata.base.errors import ManifestError
from detdata.identity.columns import ShardTable
from detdata.identity.columns_tie import check_tie_parts, tie_part
from detdata.identity.receipts import RACY_S

pytestmark = pytest.mark.multiproc

SCRIPT = Path(__file__).resolve().parents[1] / "dist" / "shared_pass_check.py"
REPO = Path(__file__).resolve().parents[2]
SHARDS = 48


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _run(
    manifest: Path, out: Path, receipts: Path, ranks: int, *extra: str
) -> list[dict[str, object]]:
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    env["DETDATA_RECEIPTS"] = str(receipts)
    subprocess.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--nproc-per-node",
            str(ranks),
            "--master-addr",
            "127.0.0.1",
            "--master-port",
            str(_free_port()),
            str(SCRIPT),
            str(manifest),
            str(out),
            *extra,
        ],
        check=True,
        env=env,
        timeout=240,
        capture_output=True,
    )
    return [json.loads(Path(f"{out}.rank{r}").read_text()) for r in range(ranks)]


def _corpus(root: Path) -> Path:
    root.mkdir()
    rng = np.random.default_rng(11)
    for i in range(SHARDS):
        np.save(root / f"s{i:02d}.npy", rng.integers(0, 60_000, 2_000).astype(np.uint16))
    path = root / "manifest.json"
    build_manifest(str(root)).save(str(path))
    time.sleep(RACY_S + 0.3)  # settled: the receipt records the files' identities
    return path


def _receipt(folder: Path) -> Path:
    found = sorted(folder.glob("*.receipt"))
    assert len(found) == 1, found
    return found[0]


@pytest.mark.slow
def test_the_ranks_take_the_identities_and_the_tie_and_the_receipt_is_a_lone_runs(
    tmp_path: Path,
) -> None:
    path = _corpus(tmp_path / "data")
    receipts = tmp_path / "receipts"
    alone = _run(path, tmp_path / "alone", receipts, 1)
    assert "error" not in alone[0], alone
    lone = _receipt(receipts).read_bytes()
    _receipt(receipts).unlink()  # the same folder: the same key, so the same tag

    # the ranks read the manifest's own files, as the lone run (no node copy: a receipt
    # records the identity of the fast form's file the check read)
    ranks = _run(path, tmp_path / "four", receipts, 4, "alone")
    assert all("error" not in r for r in ranks), ranks
    assert _receipt(receipts).read_bytes() == lone
    assert b'"columns":[' in lone  # the fast form's identity recorded too
    body = lone.partition(b"\n")[2]
    assert np.all(np.frombuffer(body, dtype="<u8") != 0)  # every identity recorded
    # each shard file stat'ed once in the job, each entry decoded once: nobody took all
    stated = [name for r in ranks for name in r["stated"]]  # type: ignore[attr-defined]
    assert sorted(stated) == [f"s{i:02d}.npy" for i in range(SHARDS)], ranks
    assert max(len(r["stated"]) for r in ranks) < SHARDS, ranks  # type: ignore[arg-type]
    assert sum(int(str(r["decoded"])) for r in ranks) == SHARDS, ranks
    assert alone[0]["decoded"] == SHARDS  # one pass alone too (the tie and the check)


@pytest.mark.slow
def test_a_shard_changed_in_one_ranks_slice_is_named_with_that_rank_on_every_rank(
    tmp_path: Path,
) -> None:
    path = _corpus(tmp_path / "data")
    shard = tmp_path / "data" / "s29.npy"
    data = bytearray(shard.read_bytes())
    data[-1] ^= 0xFF
    shard.write_bytes(bytes(data))
    ranks = _run(path, tmp_path / "bad", tmp_path / "receipts", 4)
    takers = [r["rank"] for r in ranks if "s29.npy" in r["stated"]]  # type: ignore[operator]
    assert len(takers) == 1, ranks
    for r in ranks:
        kind, named, message = r["error"]  # type: ignore[misc]
        assert (kind, named) == ("VerificationError", "s29.npy"), r
        assert re.search(rf"found by rank {takers[0]}\b", message), r
    assert not list((tmp_path / "receipts").glob("*.receipt"))  # a failed check writes none


def _table(tmp_path: Path) -> tuple[ShardTable, str]:
    path = _corpus(tmp_path / "data")
    manifest = Manifest.load(str(path), verify="off")
    assert isinstance(manifest.shards, ShardTable)
    return manifest.shards, manifest.id


def test_the_tie_from_parts_cut_anywhere_is_the_manifests_id_and_tampering_is_refused(
    tmp_path: Path,
) -> None:
    table, _ = _table(tmp_path)
    entries = table.entries_between(0, len(table))
    rng = np.random.default_rng(3)
    for _ in range(5):
        cuts = [0, *sorted(rng.choice(np.arange(1, SHARDS), 4, replace=False)), SHARDS]
        parts = [tie_part(entries[a:b]) for a, b in itertools.pairwise(cuts)]
        check_tie_parts(table, parts)  # the writer's id: passes
    whole = [tie_part(entries[:20]), tie_part(entries[20:])]
    with pytest.raises(ManifestError, match="canonical order"):
        check_tie_parts(table, whole[::-1])
    with pytest.raises(ManifestError, match="canonical order"):
        check_tie_parts(table, [tie_part(entries[:20][::-1]), whole[1]])
    with pytest.raises(ManifestError, match="its entries hash to"):
        check_tie_parts(table, whole[:1])
    edited = whole[1].replace(b'"num_samples":', b'"num_samples": ', 1)
    with pytest.raises(ManifestError, match="its entries hash to"):
        check_tie_parts(table, [whole[0], edited])
