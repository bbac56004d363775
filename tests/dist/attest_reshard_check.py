"""Run under ``torchrun`` (gloo, CPU) by tests/loading/test_attest_reshard.py (issue 43).

Phase "train" (8 ranks): two global steps, then every rank saves the loader with
torch.distributed.checkpoint. Phase "resume" (7 ranks): every rank loads that checkpoint and
asks for its first micro batch; it writes what it got (the ``id`` column) or the error that
refused it to ``out/rank<r>.json``. The transform multiplies ``x`` by the environment's
``ATTEST_SCALE`` (a global read at import: the same function name in every run).
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import numpy as np
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

import detdata

GBS, SEED, STEPS = 56, 7, 2
SCALE = int(os.environ.get("ATTEST_SCALE", "1"))


def scaled(sample: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    return {"id": sample["id"], "x": sample["x"] * SCALE}


def dataset() -> detdata.ArrayDataset:
    ids = np.arange(500, dtype=np.int64)
    return detdata.ArrayDataset({"id": ids, "x": (ids * 3 % 101).astype(np.int32)})


def loader(micro: int) -> detdata.DataLoader:
    return detdata.DataLoader(
        dataset(),
        global_batch_size=GBS,
        micro_batch_size=micro,
        seed=SEED,
        options=detdata.LoaderOptions(transform=scaled, transform_id="scaled"),
    )


def train(ckpt: str) -> None:
    dist.init_process_group("gloo")
    dl = loader(GBS // dist.get_world_size())
    it = iter(dl)
    for _ in range(STEPS):
        next(it)
    dcp.save({"loader": dl}, checkpoint_id=ckpt)
    dist.barrier()
    dist.destroy_process_group()


def resume(ckpt: str, out: str) -> None:
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    dl = loader(GBS // world)
    template = dl.state_dict()
    dcp.load({"loader": template}, checkpoint_id=ckpt)
    dl.load_state_dict(template)
    record: dict[str, object] = {"rank": rank, "world": world, "consumed": dl.samples_consumed}
    try:
        record["ids"] = next(iter(dl))["id"].tolist()
        record["refused"] = None
    except detdata.StateError as exc:
        record["refused"] = str(exc)
    Path(out, f"rank{rank}.json").write_text(json.dumps(record))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    if sys.argv[1] == "train":
        train(sys.argv[2])
    else:
        resume(sys.argv[2], sys.argv[3])
