"""A typical pretraining loop with torch's DataLoader replaced by detdata's.

The change from a vanilla script is the block marked "detdata": build the
dataset from a verified manifest, construct `detdata.DataLoader`, and save /
load `loader.state_dict()` with the checkpoint.

    python examples/pretrain_minimal.py --workdir /tmp/pm --steps 20
"""

from __future__ import annotations

import argparse
import itertools
import json
from pathlib import Path

import blake3
import torch
from _corpus import write_token_shards
from torch import nn

import detdata


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--workdir", default="/tmp/detdata-pretrain-minimal")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--seq-len", type=int, default=64)
    ap.add_argument("--record", help="append the rows of every trained step to this JSONL file")
    args = ap.parse_args()
    work = Path(args.workdir)
    if not (work / "manifest.json").exists():
        detdata.build_manifest(str(write_token_shards(work / "shards"))).save(
            str(work / "manifest.json")
        )

    torch.manual_seed(0)
    model = nn.Sequential(nn.Embedding(512, 64), nn.Linear(64, 512))
    optim = torch.optim.AdamW(model.parameters(), lr=1e-3)

    # --- detdata: was `DataLoader(dataset, batch_size=16, shuffle=True, num_workers=2)` ---
    dataset = detdata.TokenWindows(
        str(work / "manifest.json"), seq_len=args.seq_len
    )  # verifies the bytes
    loader = detdata.DataLoader(dataset, global_batch_size=16, seed=1234, num_workers=2)
    ckpt = work / "ckpt.pt"
    if ckpt.exists():
        saved = torch.load(ckpt, weights_only=True)
        model.load_state_dict(saved["model"])
        optim.load_state_dict(saved["optim"])
        loader.load_state_dict(json.loads((work / "loader.json").read_text()))
    # -------------------------------------------------------------------------------------

    # Take exactly the batches of the remaining steps: breaking out of `for batch in loader`
    # after one more batch was delivered would count (and so skip on resume) a batch never trained.
    per_step = loader.global_batch_size // loader.layout.samples_per_micro_step
    remaining = max(0, args.steps - loader.step) * per_step
    for batch in itertools.islice(loader, remaining):
        if args.record:
            delivered_at = loader.samples_consumed - loader.layout.samples_per_micro_step
            record(args.record, delivered_at // loader.global_batch_size, batch)
        tokens = batch["tokens"].long()
        loss = nn.functional.cross_entropy(
            model(tokens[:, :-1]).flatten(0, 1), tokens[:, 1:].flatten()
        )
        optim.zero_grad()
        loss.backward()
        optim.step()
    torch.save({"model": model.state_dict(), "optim": optim.state_dict()}, ckpt)
    (work / "loader.json").write_text(json.dumps(loader.state_dict()))  # detdata: one JSON object
    weights = blake3.blake3(b"".join(p.detach().numpy().tobytes() for p in model.parameters()))
    print(
        f"step {loader.step} samples_consumed {loader.samples_consumed} "
        f"weights {weights.hexdigest()[:16]}"
    )


def record(path: str, step: int, batch: dict[str, torch.Tensor]) -> None:
    """Append the step and a digest of every row this step trained on (for the resume test)."""
    rows = [blake3.blake3(r.numpy().tobytes()).hexdigest()[:16] for r in batch["tokens"]]
    with open(path, "a", encoding="utf-8") as fh:
        fh.write(json.dumps({"step": step, "rows": rows}) + "\n")


if __name__ == "__main__":
    main()
