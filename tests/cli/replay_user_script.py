"""A user's training script following the ``detdata replay-check -- CMD`` contract.

The model of the examples (embedding + linear over 512 token ids, examples/pretrain_minimal.py)
on token shards under ``--data``, with dropout, a linear learning-rate decay and gradients
reduced over 4 micro batches in a fixed order. ``--forget-loader-state`` reproduces the
classic resume bug: the model and optimizer are restored but the data cursor is not (a
sampler reset). ``--fault`` breaks something outside the data at the resume only:
``optimizer-reset`` (a fresh optimizer), ``dropout-rng`` (the generator state not restored),
``scheduler`` (a fresh LR schedule), ``reduction-order`` (micro-batch gradients summed in
reverse order). ``--report-model`` prints a model digest per step
(`detdata.report_model_step`). Scripts breaking the contract: ``--ignore-stop-at`` (trains
to the end and saves there), ``--empty-trace`` (an empty trace file, no trace written).
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
    ap.add_argument(
        "--fault", choices=("optimizer-reset", "dropout-rng", "scheduler", "reduction-order")
    )
    ap.add_argument("--report-model", action="store_true")
    ap.add_argument("--ignore-stop-at", action="store_true")
    ap.add_argument("--empty-trace", action="store_true")
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
    model = nn.Sequential(nn.Embedding(512, 32), nn.Dropout(0.2), nn.Linear(32, 512))
    optim = torch.optim.AdamW(model.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.LambdaLR(optim, lambda t: 1.0 - t / (2 * args.steps))
    dataset = detdata.TokenWindows(str(data / "manifest.json"), seq_len=32)
    trace = run / "trace.jsonl"
    if args.empty_trace:
        trace.touch()
    loader = detdata.DataLoader(
        dataset,
        global_batch_size=8,
        micro_batch_size=2,
        seed=7,
        options=detdata.LoaderOptions(trace=None if args.empty_trace else trace),
    )
    fault = args.fault if args.resume else None
    if args.resume:
        saved = torch.load(run / "ckpt.pt", weights_only=True)
        model.load_state_dict(saved["model"])
        if fault != "optimizer-reset":
            optim.load_state_dict(saved["optim"])
        if fault != "scheduler":
            sched.load_state_dict(saved["sched"])
        if fault != "dropout-rng":
            torch.set_rng_state(saved["rng"])
        if not args.forget_loader_state:
            loader.load_state_dict(json.loads((run / "loader.json").read_text()))
        start = saved["step"]
    else:
        start = 0
    stop = args.stop_at if args.stop_at is not None and not args.ignore_stop_at else None
    last = stop if stop is not None else args.steps
    it = iter(loader)
    for step in range(start, last):
        grads = []
        for _micro in range(4):  # 8 = 4 micro batches of 2
            optim.zero_grad()
            tokens = next(it)["tokens"].long()
            loss = nn.functional.cross_entropy(
                model(tokens[:, :-1]).flatten(0, 1), tokens[:, 1:].flatten()
            )
            loss.backward()
            grads.append([p.grad.clone() for p in model.parameters()])
        if fault == "reduction-order":
            grads.reverse()
        for k, p in enumerate(model.parameters()):
            total = grads[0][k]
            for g in grads[1:]:
                total = total + g[k]
            p.grad = total
        optim.step()
        sched.step()
        if args.report_model:
            detdata.report_model_step(step, model)
    loader.close()
    if args.stop_at is not None:
        torch.save(
            {
                "model": model.state_dict(),
                "optim": optim.state_dict(),
                "sched": sched.state_dict(),
                "rng": torch.get_rng_state(),
                "step": last,
            },
            run / "ckpt.pt",
        )
        (run / "loader.json").write_text(json.dumps(loader.state_dict()))
    digest = blake3.blake3(b"".join(p.detach().numpy().tobytes() for p in model.parameters()))
    print(f"weights {digest.hexdigest()}")


if __name__ == "__main__":
    main()
