"""Run under ``torchrun --nproc-per-node 2`` (gloo, CPU) by tests/loading/test_distributed.py.

Phase "train": each rank loads its slice; an all-gather rebuilds every global
step, which must equal the single-process global batch; the loader state is
saved with torch.distributed.checkpoint. Phase "resume" (plain python, world
size 1): loads that checkpoint and continues the same global stream.
"""

from __future__ import annotations

import json
import sys

import numpy as np
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

import detdata

GBS, STEPS, SEED = 8, 3, 7


def dataset() -> detdata.ArrayDataset:
    ids = np.arange(500, dtype=np.int64)
    return detdata.ArrayDataset(
        {"id": ids, "x": (ids[:, None] * 3 + np.arange(4)).astype(np.int32)}
    )


def single_process_steps(start_step: int, steps: int) -> list[list[int]]:
    dl = detdata.DataLoader(
        dataset(),
        global_batch_size=GBS,
        seed=SEED,
        options=detdata.LoaderOptions(rank=0, world_size=1),
    )
    state = dl.state_dict()
    state["samples_consumed"] = start_step * GBS
    dl.load_state_dict(state)
    it = iter(dl)
    return [next(it)["x"].reshape(-1).tolist() for _ in range(steps)]


def train(ckpt: str, out: str) -> None:
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    dl = detdata.DataLoader(
        dataset(), global_batch_size=GBS, micro_batch_size=2, seed=SEED, num_workers=1
    )
    assert (
        dl.layout.world_size == world and dl.layout.rank == rank
    )  # defaults come from torch.distributed
    it = iter(dl)
    micro_per_step = GBS // (2 * world)
    gathered_steps = []
    for _ in range(STEPS):
        micro = [next(it)["x"] for _ in range(micro_per_step)]
        parts = [[torch.empty_like(m) for _ in range(world)] for m in micro]
        for k, m in enumerate(micro):
            dist.all_gather(parts[k], m)
        gathered_steps.append(
            torch.cat([p for k in range(micro_per_step) for p in parts[k]]).reshape(-1).tolist()
        )
    dcp.save({"loader": dl}, checkpoint_id=ckpt)
    if rank == 0:
        with open(out, "w") as fh:
            json.dump(
                {
                    "world": world,
                    "gathered": gathered_steps,
                    "single": single_process_steps(0, STEPS),
                    "consumed": dl.samples_consumed,
                },
                fh,
            )
    dist.barrier()
    dist.destroy_process_group()


def resume(ckpt: str, out: str) -> None:
    dl = detdata.DataLoader(
        dataset(),
        global_batch_size=GBS,
        seed=SEED,
        options=detdata.LoaderOptions(rank=0, world_size=1),
    )
    dcp.load({"loader": dl}, checkpoint_id=ckpt)
    it = iter(dl)
    got = [next(it)["x"].reshape(-1).tolist() for _ in range(2)]
    with open(out, "w") as fh:
        json.dump(
            {
                "consumed": dl.samples_consumed - 2 * GBS,
                "resumed": got,
                "single": single_process_steps(STEPS, 2),
            },
            fh,
        )


if __name__ == "__main__":
    {"train": train, "resume": resume}[sys.argv[1]](sys.argv[2], sys.argv[3])
