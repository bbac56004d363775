"""Data-parallel training under torchrun; state saved with torch.distributed.checkpoint.

    torchrun --nproc-per-node 2 examples/torchrun_dp.py --workdir /tmp/dp --steps 6
    # resumes at 1 rank:
    torchrun --nproc-per-node 1 examples/torchrun_dp.py --workdir /tmp/dp --steps 12

Each rank reads its slice of every global step (rank and world size come from
torch.distributed). Resuming at another world size continues the same global
stream as long as the global batch divides by micro batch x world size.
"""

from __future__ import annotations

import argparse
import gc
import itertools
import json
from pathlib import Path

import blake3
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from _corpus import write_token_shards
from torch import nn
from torch.nn.parallel import DistributedDataParallel

import detdata

GLOBAL_BATCH = 16


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--workdir", default="/tmp/detdata-dp")
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--record", help="append each rank's trained rows to RECORD.rank<r> (JSONL)")
    args = ap.parse_args()
    dist.init_process_group("gloo")
    try:
        record_to = None if args.record is None else Path(f"{args.record}.rank{dist.get_rank()}")
        summary = train(Path(args.workdir), args.steps, record_to)
        if dist.get_rank() == 0:
            print(json.dumps(summary), flush=True)
    finally:
        # The model (and its DDP reducer) must be gone before the process group is destroyed:
        # a reducer that drops the last reference to a gloo group does so while holding the GIL
        # and can deadlock with gloo's worker thread (pytorch/pytorch#56297). train() returned,
        # so its locals are unreachable; collect any cycles now.
        gc.collect()
        dist.destroy_process_group()


def record(path: Path, step: int, rank: int, batch: dict[str, torch.Tensor]) -> None:
    """Append this rank's rows of a trained step (digests; for the resume test)."""
    rows = [blake3.blake3(r.numpy().tobytes()).hexdigest()[:16] for r in batch["tokens"]]
    with open(path, "a", encoding="utf-8") as fh:
        fh.write(json.dumps({"step": step, "rank": rank, "rows": rows}) + "\n")


def train(work: Path, steps: int, record_to: Path | None = None) -> dict[str, int]:
    rank, world = dist.get_rank(), dist.get_world_size()
    if rank == 0 and not (work / "manifest.json").exists():
        detdata.build_manifest(str(write_token_shards(work / "shards"))).save(
            str(work / "manifest.json")
        )
    dist.barrier()

    torch.manual_seed(0)
    model = DistributedDataParallel(nn.Sequential(nn.Embedding(512, 32), nn.Linear(32, 512)))
    optim = torch.optim.SGD(model.parameters(), lr=0.1)
    dataset = detdata.TokenWindows(str(work / "manifest.json"), seq_len=32)
    loader = detdata.DataLoader(
        dataset, global_batch_size=GLOBAL_BATCH, seed=5, micro_batch_size=GLOBAL_BATCH // world
    )
    state = {"loader": loader, "model": model.state_dict(), "optim": optim.state_dict()}
    if (work / "ckpt").exists():
        dcp.load(state, checkpoint_id=str(work / "ckpt"))
        model.load_state_dict(state["model"])
        optim.load_state_dict(state["optim"])
    start = loader.step
    # exactly the batches of the remaining steps (see pretrain_minimal.py: never break after
    # a batch was delivered but not trained, or the resume skips it)
    per_step = loader.global_batch_size // loader.layout.samples_per_micro_step
    for batch in itertools.islice(loader, max(0, steps - start) * per_step):
        if record_to is not None:
            delivered_at = loader.samples_consumed - loader.layout.samples_per_micro_step
            record(record_to, delivered_at // loader.global_batch_size, rank, batch)
        tokens = batch["tokens"].long()
        loss = nn.functional.cross_entropy(
            model(tokens[:, :-1]).flatten(0, 1), tokens[:, 1:].flatten()
        )
        optim.zero_grad()
        loss.backward()
        optim.step()
    dcp.save(
        {"loader": loader, "model": model.state_dict(), "optim": optim.state_dict()},
        checkpoint_id=str(work / "ckpt"),
    )
    return {
        "world_size": world,
        "from_step": start,
        "to_step": loader.step,
        "samples_consumed": loader.samples_consumed,
    }


if __name__ == "__main__":
    main()
