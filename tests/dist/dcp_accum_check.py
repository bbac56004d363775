"""A training loop with gradient accumulation that checkpoints with torch.distributed.checkpoint
in the middle of an optimizer step, run by tests/loading/test_dcp_mid_step.py.

    torchrun --nproc-per-node 2 dcp_accum_check.py train CKPT OUT   # stops mid-step 5
    python dcp_accum_check.py resume CKPT OUT                         # world size 1
    python dcp_accum_check.py reference - OUT                         # uninterrupted, world 1

The loop is what a DCP user writes: ``dcp.save({"model": ..., "optim": ..., "loader": loader,
"step": ...})``; the partial gradients of the step being accumulated are in no state dict.
Each rank records every micro batch its model is handed: the optimizer step it is accumulated
into (the loop's own step counter) and its row ids.
"""

from __future__ import annotations

import json
import sys

import numpy as np
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

import detdata

GBS, SEED, SAVE_STEP, LAST = 8, 7, 5, 8


def dataset() -> detdata.ArrayDataset:
    ids = np.arange(60, dtype=np.int64)  # 7 whole steps an epoch, 4 rows left over
    return detdata.ArrayDataset(
        {"id": ids, "x": (ids[:, None] * 0.5 + np.arange(3)).astype(np.float32)}
    )


def loop(
    loader: detdata.DataLoader,
    model: torch.nn.Module,
    opt: torch.optim.Optimizer,
    step: torch.Tensor,
    stop_mid: bool,
    records: list,
) -> None:
    """Train until step LAST; with ``stop_mid``, checkpoint after the first micro batch of step
    SAVE_STEP and stop (a crash right after an exception-time save)."""
    world = dist.get_world_size() if dist.is_initialized() else 1
    accum = GBS // (loader.batch_size * world)
    it = iter(loader)
    while int(step) < LAST:
        for k in range(accum):
            batch = next(it)
            records.append({"step": int(step), "ids": batch["id"].tolist()})
            model(batch["x"]).pow(2).mean().backward()  # gradients accumulate in .grad
            if stop_mid and int(step) == SAVE_STEP and k == 0:
                state = {
                    "model": model.state_dict(),
                    "optim": opt.state_dict(),
                    "loader": loader,
                    "step": step,
                }
                dcp.save(state, checkpoint_id=CKPT)
                return
        opt.step()
        opt.zero_grad()
        step += 1


def run(phase: str, out: str) -> None:
    torch.manual_seed(0)
    distributed = phase == "train"
    if distributed:
        dist.init_process_group("gloo")
    micro = 2 if distributed else 4  # 2 ranks x 2 x 2 micro steps; 1 rank x 4 x 2
    loader = detdata.DataLoader(dataset(), global_batch_size=GBS, micro_batch_size=micro, seed=SEED)
    model = torch.nn.Linear(3, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    step = torch.zeros((), dtype=torch.int64)
    records: list = []
    if phase == "resume":
        state = {
            "model": model.state_dict(),
            "optim": opt.state_dict(),
            "loader": loader,
            "step": step,
        }
        dcp.load(state, checkpoint_id=CKPT)  # calls loader.load_state_dict(saved) itself
        model.load_state_dict(state["model"])
    loop(loader, model, opt, step, phase == "train", records)
    rank = dist.get_rank() if distributed else 0
    with open(f"{out}.rank{rank}", "w") as fh:
        json.dump({"records": records, "consumed": loader.samples_consumed}, fh)
    if distributed:
        dist.barrier()
        dist.destroy_process_group()


if __name__ == "__main__":
    CKPT = sys.argv[2]
    run(sys.argv[1], sys.argv[3])
