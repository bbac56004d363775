"""One rank of a real torch.distributed (gloo) run changing mixture weights (issue 44).

``python -m torch.distributed.run --nproc-per-node 3 reweight_check.py OUT_DIR``: every rank
reads two steps, then asks for new weights before step 2 (rank 1 asks for other weights
than ranks 0 and 2 when ``DISAGREE=1``), reads two more steps and writes
``OUT_DIR/rank<r>.json``: the error each rank got (or none), the positions and ids it read,
and its state's history.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import numpy as np
import torch.distributed as dist

import detdata
from detdata.base.errors import ConfigError


def main(out: Path) -> None:
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    sources = {
        n: detdata.ArrayDataset({"id": np.arange(40, dtype=np.int64) + 1000 * (i + 1)})
        for i, n in enumerate(("a", "b", "c"))
    }
    mixture = detdata.Mixture(sources, {"a": 1, "b": 1, "c": 1}, seed=11)
    loader = detdata.DataLoader(mixture, global_batch_size=12, micro_batch_size=2, seed=0)
    got: dict[int, int] = {}
    it = iter(loader)

    def read(micro: int) -> None:
        for _ in range(micro):
            positions = loader.positions_of_next().tolist()
            got.update(zip(positions, next(it)["id"].tolist(), strict=True))

    read(4)  # steps 0 and 1 (2 micro batches of 2 per rank per step of 12 over 3 ranks)
    weights = {"a": 5, "b": 1, "c": 1}
    if os.environ.get("DISAGREE") == "1" and rank == 1:
        weights = {"a": 1, "b": 5, "c": 1}
    error = None
    try:
        loader.set_mixture_weights(weights)
    except ConfigError as exc:
        error = str(exc)
    read(4)  # steps 2 and 3
    record = {
        "rank": rank,
        "error": error,
        "read": sorted(got.items()),
        "history": loader.state_dict()["history"],
    }
    (out / f"rank{rank}.json").write_text(json.dumps(record))
    dist.destroy_process_group()


if __name__ == "__main__":
    main(Path(sys.argv[1]))
