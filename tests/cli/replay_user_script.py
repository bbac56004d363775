"""A user's training script following the ``detdata replay-check -- CMD`` contract.

The model of the examples (embedding + linear over 512 token ids, examples/pretrain_minimal.py)
on token shards under ``--data``. ``--forget-loader-state`` reproduces the classic resume bug:
the model and optimizer are restored but the data cursor is not (a sampler reset).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import blake3
import numpy as np
import torch
from torch import nn

import detdata


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--data", required=True)
    ap.add_argument("--steps", type=int, required=True)
    ap.add_argument("--stop-at", type=int)
    ap.add_argument("--resume", action="store_true")
    ap.add_argument("--run-dir", required=True)
    ap.add_argument("--forget-loader-state", action="store_true")
    args = ap.parse_args()
    run = Path(args.run_dir)
    data = Path(args.data)
    if not (data / "manifest.json").exists():
        data.mkdir(parents=True, exist_ok=True)
        rng = np.random.default_rng(0)
        for i in range(3):
            np.save(data / f"shard-{i}.npy", rng.integers(0, 512, 3000).astype(np.uint16))
        detdata.build_manifest(str(data), pattern="*.npy").save(str(data / "manifest.json"))
    torch.manual_seed(0)
    torch.use_deterministic_algorithms(True)
    torch.set_num_threads(1)
    model = nn.Sequential(nn.Embedding(512, 32), nn.Linear(32, 512))
    optim = torch.optim.AdamW(model.parameters(), lr=1e-2)
    dataset = detdata.TokenWindows(str(data / "manifest.json"), seq_len=32)
    loader = detdata.DataLoader(
        dataset, global_batch_size=8, micro_batch_size=4, seed=7, trace=run / "trace.jsonl"
    )
    if args.resume:
        saved = torch.load(run / "ckpt.pt", weights_only=True)
        model.load_state_dict(saved["model"])
        optim.load_state_dict(saved["optim"])
        if not args.forget_loader_state:
            loader.load_state_dict(json.loads((run / "loader.json").read_text()))
        start = saved["step"]
    else:
        start = 0
    last = args.stop_at if args.stop_at is not None else args.steps
    it = iter(loader)
    for _ in range(start, last):
        optim.zero_grad()
        for _micro in range(2):  # 8 = 2 micro batches of 4
            tokens = next(it)["tokens"].long()
            loss = nn.functional.cross_entropy(
                model(tokens[:, :-1]).flatten(0, 1), tokens[:, 1:].flatten()
            )
            loss.backward()
        optim.step()
    loader.close()
    if args.stop_at is not None:
        torch.save(
            {"model": model.state_dict(), "optim": optim.state_dict(), "step": last},
            run / "ckpt.pt",
        )
        (run / "loader.json").write_text(json.dumps(loader.state_dict()))
    digest = blake3.blake3(b"".join(p.detach().numpy().tobytes() for p in model.parameters()))
    print(f"weights {digest.hexdigest()}")


if __name__ == "__main__":
    main()
