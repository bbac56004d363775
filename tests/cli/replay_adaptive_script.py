"""A user's script with a loss-driven mixture, following the ``detdata replay-check -- CMD``
contract (issue 44): the controller of examples/adaptive_mixture.py chooses each step's
weights from the per-source losses of the step before. ``--forget-controller`` reproduces
the mistake a resume can make: the model, optimizer and loader are restored but the
controller starts afresh, so the weights it chooses after the restart (and the samples they
select) are not the uninterrupted run's.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import blake3
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples"))
from adaptive_mixture import (
    DIM,
    GBS,
    MICRO,
    NAMES,
    ExcessLossController,
    make_loader,
    per_source,
)

import detdata


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, required=True)
    ap.add_argument("--stop-at", type=int)
    ap.add_argument("--resume", action="store_true")
    ap.add_argument("--run-dir", required=True)
    ap.add_argument("--forget-controller", action="store_true")
    args = ap.parse_args()
    run = Path(args.run_dir)
    torch.manual_seed(0)
    torch.set_num_threads(1)
    model = torch.nn.Linear(DIM, 1)
    optim = torch.optim.SGD(model.parameters(), lr=0.05)
    controller = ExcessLossController(reference={"easy": 0.01, "medium": 1.0, "hard": 4.0})
    plain, mixture = make_loader()
    loader = detdata.DataLoader(
        mixture,
        global_batch_size=GBS,
        micro_batch_size=MICRO,
        seed=0,
        options=detdata.LoaderOptions(trace=run / "trace.jsonl"),
    )
    plain.close()
    if args.resume:
        saved = torch.load(run / "ckpt.pt", weights_only=True)
        model.load_state_dict(saved["model"])
        optim.load_state_dict(saved["optim"])
        if not args.forget_controller:
            controller.load_state_dict(json.loads((run / "controller.json").read_text()))
        loader.load_state_dict(json.loads((run / "loader.json").read_text()))
    loader.set_mixture_controller(controller)
    end = args.stop_at if args.stop_at is not None else args.steps
    it = iter(loader)
    while loader.step < end:
        sums, counts = dict.fromkeys(NAMES, 0.0), dict.fromkeys(NAMES, 0)
        for _ in range(GBS // MICRO):
            positions = loader.positions_of_next()
            batch = next(it)
            losses = (model(batch["x"]).squeeze(-1) - batch["y"]) ** 2
            (losses.mean() / (GBS // MICRO)).backward()
            s, c = per_source(mixture, positions, losses)
            sums = {n: sums[n] + s[n] for n in NAMES}
            counts = {n: counts[n] + c[n] for n in NAMES}
        optim.step()
        optim.zero_grad()
        controller.observe(sums, counts)
    if args.stop_at is not None:
        torch.save({"model": model.state_dict(), "optim": optim.state_dict()}, run / "ckpt.pt")
        (run / "controller.json").write_text(json.dumps(controller.state_dict()))
        (run / "loader.json").write_text(json.dumps(loader.state_dict()))
    loader.close()
    digest = blake3.blake3(b"".join(p.detach().numpy().tobytes() for p in model.parameters()))
    print(f"weights {digest.hexdigest()}")


if __name__ == "__main__":
    main()
