"""Every rank of a resharded job attests its first resumed step (issue 43): 8 torchrun ranks
(gloo) save with torch.distributed.checkpoint, 7 resume from it.

Unchanged, the 7 ranks' first micro batches are together the uninterrupted single-process
run's third step (the reference: a plain loader iterated from position 0). With the global
the transform reads changed between the runs, every one of the 7 ranks is refused at its
first batch, naming the same attested position.

Covers: detdata/loading/attest.py.
"""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import detdata

pytestmark = pytest.mark.multiproc

SCRIPT = Path(__file__).resolve().parents[1] / "dist" / "attest_reshard_check.py"
REPO = Path(__file__).resolve().parents[2]
GBS = 56


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _torchrun(ranks: int, args: list[str], scale: int) -> None:
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    env["ATTEST_SCALE"] = str(scale)
    run = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(ranks)]
    where = ["--master-addr", "127.0.0.1", "--master-port", str(_port())]
    done = subprocess.run(
        [*run, *where, str(SCRIPT), *args],
        env=env,
        timeout=400,
        capture_output=True,
        text=True,
    )
    assert done.returncode == 0, done.stderr[-3000:]


def _records(out: Path) -> list[dict[str, Any]]:
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(7)]


def _third_step() -> list[int]:
    """The uninterrupted single-process run's step 2 (ids), read by a plain loader."""
    ids = np.arange(500, dtype=np.int64)
    data = detdata.ArrayDataset({"id": ids, "x": (ids * 3 % 101).astype(np.int32)})
    loader = detdata.DataLoader(data, global_batch_size=GBS, seed=7)
    it = iter(loader)
    next(it), next(it)
    return sorted(next(it)["id"].tolist())


@pytest.mark.slow
def test_eight_ranks_save_seven_resume_each_attests_its_first_batch(tmp_path: Path) -> None:
    ckpt = tmp_path / "ckpt"
    _torchrun(8, ["train", str(ckpt)], scale=1)
    same, changed = tmp_path / "same", tmp_path / "changed"
    same.mkdir(), changed.mkdir()

    _torchrun(7, ["resume", str(ckpt), str(same)], scale=1)
    got = _records(same)
    assert [r["refused"] for r in got] == [None] * 7
    assert all(r["consumed"] == 2 * GBS and r["world"] == 7 for r in got)
    assert sorted(i for r in got for i in r["ids"]) == _third_step()

    _torchrun(7, ["resume", str(ckpt), str(changed)], scale=2)
    refused = _records(changed)
    positions = set()
    for r in refused:
        text = r["refused"]
        assert text is not None and "resume attestation failed at step 2" in text, r
        found = re.search(r"at global position (\d+)", text)
        assert found, text
        positions.add(int(found.group(1)))
    (position,) = positions
    assert 2 * GBS - 4 <= position < 2 * GBS
