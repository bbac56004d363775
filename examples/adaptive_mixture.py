"""A loss-driven mixture (DoReMi-style) whose weights change during the run, replayed exactly.

Three sources of different difficulty train a tiny model. Before every global step the
loader asks a controller for the weights of that step; the controller keeps a moving
average of each source's *excess loss* (its loss minus a reference loss) and answers
``softmax(eta * excess)`` mixed with a little of the uniform mixture, rounded to integers
(exact weights, identical on every rank). Each source's loss comes from the micro batch's
own rows: the positions the loader delivers (`DataLoader.positions_of_next`) and the
mixture's pure position -> source map (`Mixture.assign`), summed per source and, under
torch.distributed, all-reduced across ranks before the controller reads them.

The example checks its three claims:

1. the run stopped at step ``--stop`` and resumed in fresh objects (model, optimizer,
   controller and loader restored from the checkpoint) trains exactly the samples of the
   uninterrupted run and reproduces its weight trajectory;
2. the trajectory is in the loader state: a fresh loader over the same mixture, fed the
   recorded changes (no controller, no model), delivers the same samples;
3. the weights in force at every step (`DataLoader.mixture_weights_at_step`) are the ones
   the controller chose.

    python examples/adaptive_mixture.py [--steps 24] [--stop 10]
"""

from __future__ import annotations

import argparse
import copy
import math
from fractions import Fraction
from typing import Any

import numpy as np
import torch

import detdata
from detdata.loading.reweighting import recorded
from detdata.loading.state import LoaderState

NAMES = ("easy", "medium", "hard")
GBS, MICRO, DIM = 32, 8, 8


def make_sources() -> dict[str, detdata.ArrayDataset]:
    """Linear targets with more noise the harder the source (so their losses differ)."""
    rng = np.random.default_rng(0)
    true_w = rng.normal(size=DIM).astype(np.float32)
    out = {}
    for k, name in enumerate(NAMES):
        x = rng.normal(size=(512, DIM)).astype(np.float32)
        y = x @ true_w + (0.1 + k) * rng.normal(size=512).astype(np.float32)
        out[name] = detdata.ArrayDataset({"x": x, "y": y.astype(np.float32)})
    return out


def make_loader() -> tuple[detdata.DataLoader, detdata.Mixture]:
    mixture = detdata.Mixture(make_sources(), dict.fromkeys(NAMES, 1), seed=1234)
    loader = detdata.DataLoader(mixture, global_batch_size=GBS, micro_batch_size=MICRO, seed=0)
    return loader, mixture


class ExcessLossController:
    """DoReMi-style weights: ``softmax(eta * EMA(loss_s - reference_s))`` mixed with
    ``smoothing`` of the uniform mixture, as integers out of 1000 (exact and the same on
    every rank, since the losses it reads were all-reduced). A `detdata.MixtureController`."""

    def __init__(self, reference: dict[str, float], eta: float = 2.0, smoothing: float = 0.1):
        self.reference, self.eta, self.smoothing = reference, eta, smoothing
        self.excess = dict.fromkeys(NAMES, 0.0)
        self.chosen: dict[int, dict[str, int]] = {}  # step -> the weights answered

    def observe(self, loss_sum: dict[str, float], count: dict[str, int]) -> None:
        """One step's per-source losses (summed over rows and ranks) and row counts."""
        for name in NAMES:
            if count[name]:
                excess = loss_sum[name] / count[name] - self.reference[name]
                self.excess[name] = 0.7 * self.excess[name] + 0.3 * max(excess, 0.0)

    def mixture_weights(self, step: int) -> dict[str, int] | None:
        if step == 0:
            return None  # the initial weights
        z = [math.exp(self.eta * self.excess[n]) for n in NAMES]
        p = [(1 - self.smoothing) * v / sum(z) + self.smoothing / len(NAMES) for v in z]
        self.chosen[step] = {n: max(1, round(1000 * q)) for n, q in zip(NAMES, p, strict=True)}
        return self.chosen[step]

    def state_dict(self) -> dict[str, Any]:
        return {"excess": dict(self.excess)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.excess = dict(state["excess"])


def per_source(
    mixture: detdata.Mixture, positions: np.ndarray, losses: torch.Tensor
) -> tuple[dict[str, float], dict[str, int]]:
    """Loss sum and row count per source of one micro batch (its rows' positions)."""
    source, _ = mixture.assign(positions)
    sums = torch.zeros(len(NAMES), dtype=torch.float64)
    counts = torch.zeros(len(NAMES), dtype=torch.float64)
    sums.index_add_(0, torch.from_numpy(source), losses.detach().double())
    counts.index_add_(0, torch.from_numpy(source), torch.ones_like(losses, dtype=torch.float64))
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        torch.distributed.all_reduce(sums)  # every rank then holds the same totals
        torch.distributed.all_reduce(counts)
    names = mixture.source_names
    return (
        {n: float(sums[i]) for i, n in enumerate(names)},
        {n: int(counts[i]) for i, n in enumerate(names)},
    )


def train(
    steps: int, start: dict[str, Any] | None = None, stop: int | None = None
) -> dict[str, Any]:
    """Train to ``steps`` (or ``stop``) from a checkpoint ``start`` (None: fresh); returns the
    checkpoint at the end with the samples of each step and the weights chosen."""
    torch.manual_seed(0)
    model = torch.nn.Linear(DIM, 1)
    optim = torch.optim.SGD(model.parameters(), lr=0.05)
    controller = ExcessLossController(reference={"easy": 0.01, "medium": 1.0, "hard": 4.0})
    loader, mixture = make_loader()
    seen: dict[int, list[float]] = {}
    if start is not None:
        model.load_state_dict(start["model"])
        optim.load_state_dict(start["optim"])
        controller.load_state_dict(start["controller"])
        loader.load_state_dict(start["loader"])
        seen = copy.deepcopy(start["seen"])
    loader.set_mixture_controller(controller)
    per_step = GBS // MICRO
    it = iter(loader)
    end = steps if stop is None else stop
    while loader.step < end:
        step = loader.step
        sums, counts = dict.fromkeys(NAMES, 0.0), dict.fromkeys(NAMES, 0)
        rows: list[float] = []
        for _ in range(per_step):  # gradient accumulation over the step's micro batches
            positions = loader.positions_of_next()
            batch = next(it)
            losses = (model(batch["x"]).squeeze(-1) - batch["y"]) ** 2
            (losses.mean() / per_step).backward()
            s, c = per_source(mixture, positions, losses)
            sums = {n: sums[n] + s[n] for n in NAMES}
            counts = {n: counts[n] + c[n] for n in NAMES}
            rows += batch["y"].tolist()
        optim.step()
        optim.zero_grad()
        controller.observe(sums, counts)  # before the next step's weights are asked for
        seen[step] = rows
    return {
        "model": model.state_dict(),
        "optim": optim.state_dict(),
        "controller": controller.state_dict(),
        "loader": loader.state_dict(),
        "seen": seen,
        "weights": {s: loader.mixture_weights_at_step(s) for s in range(end)},
        "chosen": {**(start or {}).get("chosen", {}), **controller.chosen},
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=24)
    parser.add_argument("--stop", type=int, default=10)
    args = parser.parse_args()
    straight = train(args.steps)
    stopped = train(args.steps, stop=args.stop)
    resumed = train(args.steps, start=stopped)
    assert resumed["seen"] == straight["seen"], "the resumed run trained other samples"
    assert resumed["weights"] == straight["weights"], "the weight trajectory differs"
    changes = recorded(LoaderState.from_json(straight["loader"]).plan)
    print(f"1. stopped at step {args.stop}, resumed: same samples and weights at every step")

    _, mixture = make_loader()  # claim 2: the recorded trajectory, no controller, no model
    replay = detdata.DataLoader(
        mixture.with_weight_changes(changes),
        global_batch_size=GBS,
        micro_batch_size=MICRO,
        seed=0,
    )
    it = iter(replay)
    for step in range(args.steps):
        rows = [y for _ in range(GBS // MICRO) for y in next(it)["y"].tolist()]
        assert rows == straight["seen"][step], step
    print(
        f"2. {len(changes)} recorded weight changes replayed without the controller: same samples"
    )
    for step, chosen in straight["chosen"].items():
        total = sum(chosen.values())
        exact = {n: Fraction(w, total) for n, w in chosen.items()}
        assert straight["weights"][step] == exact, step
    for step in (0, args.stop, args.steps - 1):
        shown = {n: str(f) for n, f in straight["weights"][step].items()}
        print(f"3. step {step}: weights in force {shown}")


if __name__ == "__main__":
    main()
