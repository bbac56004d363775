"""Verification once per job, shared by its ranks (docs/design.md section 8, issue 43): under
torchrun (3 ranks, gloo) the ranks opening a manifest split its shards (each shard read by one
rank: the ranks' bytes add up to the corpus once) and every rank gets the verdict; a changed
shard is named in every rank, with the rank that found it. Ranks reading one manifest from
different roots (per-rank copies) each get their root verified, at once: one shared
verification per distinct (manifest, root).

Covers: detdata/identity/shared.py.

Bytes read per rank are counted by the kernel (``rchar`` of /proc/self/io), in the child
processes (tests/dist/verify_once_check.py).
"""

from __future__ import annotations

import json
import os
import pickle
import re
import shutil
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


def _run(
    manifest: Path | str, out: Path, receipts: str, who: str = "all"
) -> list[dict[str, object]]:
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    env["DETDATA_RECEIPTS"] = receipts
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
def test_the_ranks_share_the_verification_and_every_rank_gets_the_verdict(
    tmp_path: Path,
) -> None:
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
    read = [int(str(r["read"])) for r in ranks]
    # every shard read once, by one rank or another (disjoint slices), not once per rank
    assert corpus <= sum(read) <= corpus + corpus // 5, ranks
    want = shards[0][:65].astype(np.int32).tobytes().hex()  # the writer's own first window
    assert all(r["first"] == want for r in ranks)

    data = bytearray((root / "s13.npy").read_bytes())
    data[-1] ^= 0xFF
    (root / "s13.npy").write_bytes(bytes(data))
    ranks = _run(path, tmp_path / "bad", "off")
    assert [r.get("error") for r in ranks] == [["s13.npy", "quick"]] * RANKS, ranks
    found_by = {re.search(r"found by rank (\d)", str(r["message"])) for r in ranks}
    assert None not in found_by, ranks
    assert len({m.group(1) for m in found_by if m is not None}) == 1  # the same rank, everywhere

    # a rank opening a manifest the others do not open never waits for them (no
    # collective), nor do they wait for it
    for who in ("0", "2"):
        ranks = _run(path, tmp_path / f"only{who}", "off", who)
        assert [r.get("error") for r in ranks] == [
            ["s13.npy", "quick"] if str(r["rank"]) == who else None for r in ranks
        ], ranks
        assert int(str(ranks[int(who)]["read"])) >= corpus // 2


def _corpus(root: Path) -> tuple[list[np.ndarray], Path, int]:
    root.mkdir()
    rng = np.random.default_rng(9)
    shards = [rng.integers(0, 60_000, 100_000).astype(np.uint16) for _ in range(20)]
    for i, tokens in enumerate(shards):
        np.save(root / f"s{i:02d}.npy", tokens)
    manifest = build_manifest(str(root))
    manifest.save(str(root / "manifest.json"))
    return shards, root / "manifest.json", manifest.total_bytes


@pytest.mark.slow
def test_ranks_reading_one_manifest_from_different_roots_each_verify_their_root_at_once(
    tmp_path: Path,
) -> None:
    """Per-rank copies of one corpus (a common layout on nodes with local disks): ranks 0
    and 1 read copy A, rank 2 copy B. One rank verifies A, rank 2 verifies B, nobody waits
    for a verifier that never comes (the job opens in seconds), every rank reads its own
    copy's bytes; a damaged shard in B is named with B's root in rank 2 only, one in A
    in ranks 0 and 1 only."""
    shards, first, corpus = _corpus(tmp_path / "A")
    shutil.copytree(tmp_path / "A", tmp_path / "B")
    roots = [tmp_path / "A", tmp_path / "A", tmp_path / "B"]
    per_rank = ",".join(str(root / "manifest.json") for root in roots)
    assert first.exists()

    ranks = _run(per_rank, tmp_path / "ok", "off")
    want = shards[0][:65].astype(np.int32).tobytes().hex()  # the writer's own first window
    assert [r.get("first") for r in ranks] == [want] * RANKS, ranks
    # well under the default wait for a verifier (120 s): nobody waited for one
    assert all(float(str(r["open_s"])) < 30 for r in ranks), ranks
    read = [int(str(r["read"])) for r in ranks]
    assert read[2] >= corpus, ranks  # the only rank under B verified B
    assert corpus <= read[0] + read[1] <= corpus + corpus // 5, ranks  # A's two shared A

    for damaged, named in (("B", [2]), ("A", [0, 1])):
        data = bytearray((tmp_path / damaged / "s07.npy").read_bytes())
        data[-1] ^= 0xFF
        (tmp_path / damaged / "s07.npy").write_bytes(bytes(data))
        ranks = _run(per_rank, tmp_path / f"bad{damaged}", "off")
        errors = [r.get("error") for r in ranks]
        assert errors == [["s07.npy", "quick"] if r in named else None for r in range(RANKS)]
        for r in named:
            assert f"(under {tmp_path / damaged})" in str(ranks[r]["message"]), ranks
        data[-1] ^= 0xFF
        (tmp_path / damaged / "s07.npy").write_bytes(bytes(data))


def test_a_verdict_crosses_the_store_as_json_never_pickle(tmp_path: Path) -> None:
    """The job's store takes what any peer on the network sends: a verdict is JSON (the
    detdata error class by name, its message and fields), and bytes that are not such JSON
    (a pickle that would run code) are an error, never run."""
    from detdata.base.errors import VerificationError
    from detdata.identity.shared import dumps_verdict, loads_verdict

    sent = VerificationError("shard a.npy: blake3 differs", shard="a.npy", field="blake3")
    got = loads_verdict(dumps_verdict(sent))
    assert type(got) is VerificationError and str(got) == str(sent)
    assert (got.shard, got.field) == ("a.npy", "blake3")
    assert loads_verdict(dumps_verdict(None)) is None
    odd = loads_verdict(dumps_verdict(KeyError("x")))
    assert type(odd).__name__ == "DetdataError" and "KeyError" in str(odd)
    marker = tmp_path / "ran"

    class Payload:
        def __reduce__(self) -> tuple[object, tuple[str]]:
            return (os.system, (f"touch {marker}",))

    with pytest.raises(ValueError):
        loads_verdict(pickle.dumps(Payload()))
    assert not marker.exists()
