"""Keep torchdata's StatefulDataLoader; take detdata's order with DeterministicBatchSampler.

Your own map-style dataset keeps its __getitem__; the batch sampler decides which
sample ids each rank reads per micro batch (seed + global position), and its
state is the same one integer.

    python examples/keep_your_loader.py
"""

from __future__ import annotations

import torch
import torch.utils.data as tud
from torchdata.stateful_dataloader import StatefulDataLoader

import detdata


class MyDataset(tud.Dataset[torch.Tensor]):
    def __len__(self) -> int:
        return 1000

    def __getitem__(self, i: int) -> torch.Tensor:
        return torch.full((8,), i)


def make() -> StatefulDataLoader:
    sampler = detdata.DeterministicBatchSampler(
        len(MyDataset()), global_batch_size=32, micro_batch_size=16, seed=3
    )
    return StatefulDataLoader(MyDataset(), batch_sampler=sampler, num_workers=2)


def main() -> None:
    straight = [b[:, 0].tolist() for _, b in zip(range(10), make(), strict=False)]
    loader = make()
    it = iter(loader)
    for _ in range(4):
        next(it)
    state = loader.state_dict()  # includes the sampler's samples_consumed
    resumed = make()
    resumed.load_state_dict(state)
    rest = [b[:, 0].tolist() for _, b in zip(range(6), resumed, strict=False)]
    print(
        "resumed after 4 micro batches; next 6 identical to the straight run: "
        f"{rest == straight[4:]}"
    )
    if rest != straight[4:]:
        raise SystemExit(1)


if __name__ == "__main__":
    main()
