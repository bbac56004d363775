"""Rank and world size are bound when iteration starts; the surface trainers probe.

A loader built before ``torch.distributed.init_process_group`` (as when it is handed
to a trainer that forms the group later) must read its own rank's slice, not the
whole global batch on every rank.
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
import torch

import detdata
from tests.resume_checker import take

SCRIPT = Path(__file__).resolve().parents[1] / "dist" / "bind_check.py"
REPO = Path(__file__).resolve().parents[2]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.mark.multiproc
def test_loader_built_before_the_process_group_reads_its_rank_slice(tmp_path: Path) -> None:
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    out = tmp_path / "ids"
    subprocess.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--nproc-per-node",
            "2",
            "--master-addr",
            "127.0.0.1",
            "--master-port",
            str(_free_port()),
            str(SCRIPT),
            str(out),
        ],
        env=env,
        check=True,
        capture_output=True,
        timeout=120,
    )
    ranks = [json.loads(Path(f"{out}.rank{r}").read_text()) for r in (0, 1)]
    assert [r["before"] for r in ranks] == [[0, 1], [0, 1]]  # built before the group existed
    assert [r["after"] for r in ranks] == [[0, 2], [1, 2]]
    # reference: a plain world-1 run; step s of the 2-rank run is rank 0's + rank 1's micro batch
    ref = detdata.DataLoader(
        detdata.ArrayDataset({"id": np.arange(200, dtype=np.int64)}), global_batch_size=8, seed=3
    )
    steps = [b["id"].tolist() for b in take(ref, 6)]
    assert [ranks[0]["ids"][s] + ranks[1]["ids"][s] for s in range(6)] == steps
    assert ranks[0]["consumed"] == ranks[1]["consumed"] == 6 * 8


def test_len_is_constant_and_the_surface_trainers_probe() -> None:
    data = detdata.ArrayDataset({"id": np.arange(100, dtype=np.int64)})
    dl = detdata.DataLoader(data, global_batch_size=8, micro_batch_size=4, seed=1)
    # the whole global steps of one pass over the dataset (12 steps of 8 of the 100 samples),
    # this rank's micro batches of them
    assert len(dl) == (100 // 8) * (8 // 4)
    list(take(dl, 7))
    assert len(dl) == 24  # unchanged by consumption
    assert dl.dataset is data and dl.batch_size == 4 and dl.drop_last is True
    assert dl.batch_sampler is None and dl.collate_fn is None
    assert not isinstance(dl.sampler, torch.utils.data.Sampler)  # nothing to replace or wrap
    dl.sampler.set_epoch(5)  # never moves the position: the next batch is still the 8th
    nxt = next(iter(dl))["id"].tolist()
    again = detdata.DataLoader(data, global_batch_size=8, micro_batch_size=4, seed=1)
    assert nxt == list(take(again, 8))[-1]["id"].tolist()
    bounded = detdata.DataLoader(
        data,
        global_batch_size=8,
        micro_batch_size=4,
        options=detdata.LoaderOptions(total_samples=40),
    )
    assert len(bounded) == 10
    mixture = detdata.Mixture({"a": data, "b": data}, {"a": 1, "b": 1}, seed=0)
    assert len(detdata.DataLoader(mixture, global_batch_size=8)) == (1 << 62) // 8


def test_state_loads_with_weights_only(tmp_path: Path) -> None:
    data = detdata.ArrayDataset({"id": np.arange(100, dtype=np.int64)})
    dl = detdata.DataLoader(data, global_batch_size=8, seed=1)
    list(take(dl, 3))
    torch.save({"loader": dl.state_dict()}, tmp_path / "c.pt")
    state = torch.load(tmp_path / "c.pt", weights_only=True)["loader"]
    fresh = detdata.DataLoader(data, global_batch_size=8, seed=1)
    fresh.load_state_dict(state)
    assert fresh.samples_consumed == 24


def test_set_epoch_on_a_loader_that_delivered_nothing_is_refused() -> None:
    """A trainer at epoch 1 with a loader at position 0: its state was not restored."""
    data = detdata.ArrayDataset({"id": np.arange(100, dtype=np.int64)})
    dl = detdata.DataLoader(data, global_batch_size=8, seed=1)
    dl.sampler.set_epoch(0)  # the first epoch of a fresh run
    with pytest.raises(detdata.StateError, match="state was not restored"):
        dl.sampler.set_epoch(1)
    list(take(dl, 1))
    dl.set_epoch(3)  # a trainer's own epoch counter, after delivery: accepted, no move
    assert dl.samples_consumed == 8
