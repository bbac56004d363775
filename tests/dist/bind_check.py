"""Child of tests/loading/test_binding.py, run under torchrun (2 ranks, gloo).

Builds a detdata.DataLoader and a DeterministicBatchSampler BEFORE the process group
exists (the way a loader handed to a trainer is often built), then initialises the
group, iterates, and writes each rank's delivered ids to OUT.rank<r>.
"""

import json
import sys

import numpy as np
import torch.distributed as dist

import detdata

out = sys.argv[1]
ids = np.arange(200, dtype=np.int64)
loader = detdata.DataLoader(detdata.ArrayDataset({"id": ids}), global_batch_size=8, seed=3)
before = (loader.layout.rank, loader.layout.world_size)
dist.init_process_group("gloo")
rank = dist.get_rank()
got = [b["id"].tolist() for _, b in zip(range(6), loader, strict=False)]
state = loader.state_dict()
with open(f"{out}.rank{rank}", "w", encoding="utf-8") as fh:
    json.dump(
        {
            "before": before,
            "after": [loader.layout.rank, loader.layout.world_size],
            "ids": got,
            "consumed": state["samples_consumed"],
        },
        fh,
    )
dist.barrier()
dist.destroy_process_group()
