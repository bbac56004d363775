"""The framework hooks of README "Mixtures that change during a run" (issue 44), with the
real frameworks: a PyTorch Lightning ``Callback`` and a transformers ``TrainerCallback`` that
feed a loss-driven controller with each step's per-source losses and call
``loader.set_mixture_weights`` at the step boundary.

Each run is compared with an independent reference: the `Mixture` built by its constructor
with the phases the callback chose (each from the first position of the step after the one
that chose it), row for row over every step the framework trained. The Lightning run is
also stopped at a checkpoint and resumed by Lightning (``ckpt_path``) in fresh objects: the
loader state carries the weights already chosen, the callback's own state its averages, and
the resumed run trains the uninterrupted run's rows.

Covers: detdata/loading/reweighting.py, detdata/integrations/lightning.py.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

import detdata

NAMES = ("a", "b", "c")
GBS, MICRO, STEPS = 8, 4, 6


def sources() -> dict[str, detdata.ArrayDataset]:
    rng = np.random.default_rng(3)
    out = {}
    for k, name in enumerate(NAMES):
        n = 40 + 7 * k
        out[name] = detdata.ArrayDataset(
            {
                "row": np.arange(n, dtype=np.int64) + 1000 * (k + 1),
                "src": np.full(n, k, dtype=np.int64),  # the source, as a column
                "x": rng.normal(size=(n, 4)).astype(np.float32) * (1 + k),
            }
        )
    return out


def make_loader() -> detdata.DataLoader:
    mixture = detdata.Mixture(sources(), dict.fromkeys(NAMES, 1), seed=5)
    return detdata.DataLoader(mixture, global_batch_size=GBS, micro_batch_size=MICRO, seed=0)


class Controller:
    """softmax of each source's mean loss of the last step, as integers out of 100."""

    def __init__(self) -> None:
        self.sums = [0.0] * len(NAMES)
        self.counts = [0] * len(NAMES)
        self.chosen: dict[int, dict[str, int]] = {}  # step whose end chose -> weights

    def add(self, losses: torch.Tensor, src: torch.Tensor) -> None:
        for loss, s in zip(losses.tolist(), src.tolist(), strict=True):
            self.sums[s] += loss
            self.counts[s] += 1

    def weights(self, step: int) -> dict[str, int]:
        means = [s / c if c else 0.0 for s, c in zip(self.sums, self.counts, strict=True)]
        z = [math.exp(min(m, 20.0) / 4) for m in means]
        self.sums, self.counts = [0.0] * len(NAMES), [0] * len(NAMES)
        self.chosen[step] = {
            n: max(1, round(100 * v / sum(z))) for n, v in zip(NAMES, z, strict=True)
        }
        return self.chosen[step]


def reference_rows(chosen: dict[int, dict[str, int]], steps: int) -> list[int]:
    phases: list[tuple[int, dict[str, Any]]] = [(0, dict.fromkeys(NAMES, 1))]
    for step in sorted(chosen):
        if step + 1 < steps:
            phases.append((GBS * (step + 1), chosen[step]))
    mixture = detdata.Mixture(sources(), seed=5, schedule=phases)
    return mixture.fetch(np.arange(GBS * steps, dtype=np.int64))["row"].tolist()


def _lightning_run(ckpt: Path, stop: int | None, resume: Path | None) -> tuple[list[int], Any]:
    import pytorch_lightning as pl
    from pytorch_lightning.callbacks import ModelCheckpoint

    torch.manual_seed(0)
    loader = make_loader()
    rows: list[int] = []

    class Model(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.lin = torch.nn.Linear(4, 1)

        def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> Any:
            losses = self.lin(batch["x"]).squeeze(-1) ** 2
            rows.extend(batch["row"].tolist())
            return {"loss": losses.mean(), "losses": losses.detach(), "src": batch["src"]}

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.SGD(self.parameters(), lr=0.01)

    class MixtureWeights(pl.Callback):
        """The README's Lightning hook: per-source losses of each micro batch; at the end
        of an optimizer step, the controller's weights for the next step."""

        def __init__(self) -> None:
            self.controller = Controller()

        def on_train_batch_end(
            self, trainer: Any, module: Any, outputs: Any, batch: Any, batch_idx: int
        ) -> None:
            self.controller.add(outputs["losses"], outputs["src"])
            if (batch_idx + 1) % trainer.accumulate_grad_batches == 0:  # a step ended
                step = trainer.global_step - 1
                loader.set_mixture_weights(self.controller.weights(step))

        def state_dict(self) -> dict[str, Any]:
            return {"chosen": self.controller.chosen}

        def load_state_dict(self, state: dict[str, Any]) -> None:
            self.controller.chosen = {int(k): v for k, v in state["chosen"].items()}

    hook = MixtureWeights()
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=1,
        max_steps=stop or STEPS,
        accumulate_grad_batches=GBS // MICRO,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[hook, ModelCheckpoint(dirpath=ckpt, every_n_train_steps=1, save_top_k=-1)],
    )
    trainer.fit(Model(), train_dataloaders=loader, ckpt_path=None if resume is None else resume)
    return rows, hook.controller


@pytest.mark.slow
def test_lightning_callback_changes_weights_at_step_boundaries_and_resumes(
    tmp_path: Path,
) -> None:
    straight, controller = _lightning_run(tmp_path / "a", None, None)
    assert straight == reference_rows(controller.chosen, STEPS)
    assert len({tuple(w.values()) for w in controller.chosen.values()}) > 1  # they changed
    first, _ = _lightning_run(tmp_path / "b", 3, None)
    ckpt = sorted((tmp_path / "b").glob("*step=3*.ckpt"))
    assert ckpt, list((tmp_path / "b").iterdir())
    rest, resumed = _lightning_run(tmp_path / "c", None, ckpt[0])
    assert first + rest == straight
    assert resumed.chosen == controller.chosen


@pytest.mark.slow
def test_transformers_callback_changes_weights_at_step_boundaries(tmp_path: Path) -> None:
    from transformers import TrainerCallback, TrainingArguments

    from detdata.integrations.transformers import DetdataTrainer

    torch.manual_seed(0)
    loader = make_loader()
    controller = Controller()
    rows: list[int] = []

    class Model(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = torch.nn.Linear(4, 1)

        def forward(self, x: torch.Tensor, row: torch.Tensor, src: torch.Tensor) -> Any:
            losses = self.lin(x).squeeze(-1) ** 2
            rows.extend(row.tolist())
            controller.add(losses.detach(), src)
            return {"loss": losses.mean()}

    class MixtureWeights(TrainerCallback):  # type: ignore[misc]
        """The README's HF hook: at each optimizer step's end, the next step's weights."""

        def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            loader.set_mixture_weights(controller.weights(state.global_step - 1))

    args = TrainingArguments(
        output_dir=str(tmp_path / "hf"),
        per_device_train_batch_size=MICRO,
        gradient_accumulation_steps=GBS // MICRO,
        max_steps=STEPS,
        learning_rate=0.01,
        report_to=[],
        save_strategy="no",
        logging_strategy="no",
        use_cpu=True,
        dataloader_num_workers=0,
    )
    trainer = DetdataTrainer(
        model=Model(), args=args, train_dataloader=loader, callbacks=[MixtureWeights()]
    )
    trainer.train()
    assert rows == reference_rows(controller.chosen, STEPS)
    assert len({tuple(w.values()) for w in controller.chosen.values()}) > 1
