"""Verification once per job (DESIGN.md 8): under torchrun (3 ranks, gloo) one rank reads
the shards and every rank gets its verdict; a changed shard is named in every rank.

Bytes read per rank are counted by the kernel (``rchar`` of /proc/self/io), in the child
processes (tests/dist/verify_once_check.py).
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from detdata import build_manifest

pytestmark = pytest.mark.multiproc

SCRIPT = Path(__file__).resolve().parents[1] / "dist" / "verify_once_check.py"
REPO = Path(__file__).resolve().parents[2]
RANKS = 3


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _run(manifest: Path, out: Path, receipts: str, who: str = "all") -> list[dict[str, object]]:
    env = {
        **os.environ,
        "PYTHONPATH": str(REPO),
        "OMP_NUM_THREADS": "1",
        "DETDATA_RECEIPTS": receipts,
        "DETDATA_VERIFY_WAIT_S": "3",
    }
    subprocess.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--nproc-per-node",
            str(RANKS),
            "--master-addr",
            "127.0.0.1",
            "--master-port",
            str(_free_port()),
            str(SCRIPT),
            str(manifest),
            str(out),
            who,
        ],
        check=True,
        env=env,
        timeout=240,
        capture_output=True,
    )
    return [json.loads(Path(f"{out}.rank{r}").read_text()) for r in range(RANKS)]


@pytest.mark.slow
def test_one_rank_verifies_and_every_rank_gets_the_verdict(tmp_path: Path) -> None:
    root = tmp_path / "data"
    root.mkdir()
    rng = np.random.default_rng(5)
    shards = [rng.integers(0, 60_000, 100_000).astype(np.uint16) for _ in range(30)]
    for i, tokens in enumerate(shards):
        np.save(root / f"s{i:02d}.npy", tokens)
    manifest = build_manifest(str(root))
    path = root / "manifest.json"
    manifest.save(str(path))
    corpus = manifest.total_bytes

    # receipts off: what is measured is the once-per-job verification alone
    ranks = _run(path, tmp_path / "ok", "off")
    readers = [r["rank"] for r in ranks if int(str(r["read"])) >= corpus]
    assert readers == [0], ranks  # the lowest rank of the (only) node read the corpus
    for r in ranks[1:]:
        assert int(str(r["read"])) <= corpus // 100, r
    want = shards[0][:65].astype(np.int32).tobytes().hex()  # the writer's own first window
    assert all(r["first"] == want for r in ranks)

    data = bytearray((root / "s13.npy").read_bytes())
    data[-1] ^= 0xFF
    (root / "s13.npy").write_bytes(bytes(data))
    ranks = _run(path, tmp_path / "bad", "off")
    assert [r.get("error") for r in ranks] == [["s13.npy", "quick"]] * RANKS, ranks

    # a rank opening a manifest the others do not open never waits for them (no
    # collective), and a rank whose verifier never comes verifies itself
    for who in ("0", "2"):
        ranks = _run(path, tmp_path / f"only{who}", "off", who)
        assert [r.get("error") for r in ranks] == [
            ["s13.npy", "quick"] if str(r["rank"]) == who else None for r in ranks
        ], ranks
        assert int(str(ranks[int(who)]["read"])) >= corpus // 2
