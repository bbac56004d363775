"""PyTorch Lightning (2.6): the one optional line, ``callbacks=[DetdataSteps()]``.

Plain use needs no glue (Lightning saves and restores the loader's state; ``len()`` is whole
global steps, so ``accumulate_grad_batches`` steps are detdata's steps). `DetdataSteps` adds,
at the start of ``fit`` (before the first batch), for every `detdata.DataLoader` Lightning
trains on:

- the batch check: ``accumulate_grad_batches x devices x micro batch`` must be the loader's
  global batch (`ConfigError` naming the ``accumulate_grad_batches`` that agrees);
- the resume check: Lightning resumes at optimizer step ``global_step`` and the loader must
  stand at that step. A loader whose state Lightning did not restore (it starts at position
  0 while ``global_step > 0``: built anew outside the checkpoint, or a checkpoint written at an
  epoch's end) is a `StateError`, never a silent replay;
- a checkpoint written inside an optimizer step (``OnExceptionCheckpoint``, a time-based
  ``ModelCheckpoint``, your own ``trainer.save_checkpoint`` between two micro batches of
  accumulation, or after the last micro batch of a step but before its optimizer step): its
  partial gradients were not saved, so the whole step is trained again. When Lightning
  loads the checkpoint (``on_load_checkpoint``, before it restores its loops and the
  loader), the loader state is moved to the first position of the checkpoint's
  ``global_step`` (`LoaderState.resumed` with ``at_step``) and Lightning's batch counters back
  by the micro batches of that step it had fetched, so the step Lightning accumulates is
  detdata's whole step.
"""

from __future__ import annotations

from collections.abc import MutableMapping
from typing import Any, Final

import pytorch_lightning as pl

from detdata.base.errors import StateError
from detdata.base.redact import get_logger
from detdata.loading.loader import DataLoader
from detdata.loading.state import KIND, LoaderState
from detdata.loading.steps import MidStep

__all__ = ["DetdataSteps"]

log: Final = get_logger("detdata.loader")


class DetdataSteps(pl.Callback):
    """``pl.Trainer(callbacks=[DetdataSteps()])``: batch settings and resume position checked,
    a mid-step checkpoint trained from its step's start (see the module doc)."""

    def on_load_checkpoint(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, checkpoint: dict[str, Any]
    ) -> None:
        del trainer, pl_module
        fit = checkpoint.get("loops", {}).get("fit_loop", {})
        states = fit.get("state_dict", {}).get("combined_loader", [])
        step = int(checkpoint.get("global_step", 0))
        back = 0  # micro batches of the step the loaders had delivered at the save
        for i, state in enumerate(states):
            if _is_detdata(state):
                back = max(back, _step_start(states, i, step))
        if back:
            _rewind_progress(fit.get("epoch_loop.batch_progress"), back, step)

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        del pl_module
        loaders = _detdata_loaders(trainer)
        for loader in loaders:
            loader.check_trainer_batch(
                micro_batch_size=loader.batch_size,
                accumulation=int(trainer.accumulate_grad_batches),
                world_size=int(trainer.world_size),
                trainer="pytorch_lightning.Trainer",
                fix="pl.Trainer(accumulate_grad_batches={accumulation})",
            )
            _check_restored(loader, int(trainer.global_step))


def _is_detdata(state: object) -> bool:
    return isinstance(state, MutableMapping) and state.get("kind") == KIND


def _step_start(states: list[Any], i: int, step: int) -> int:
    """Move ``states[i]`` (a detdata state) to the first position of optimizer ``step``; the
    micro batches (of the saving run's layout) that takes back."""
    saved = LoaderState.from_json(states[i])
    try:
        moved = saved.resumed(MidStep.REDO, at_step=step)
    except StateError as exc:
        raise StateError(
            f"the Lightning checkpoint resumes at optimizer step {step}, but its detdata loader "
            f"state does not belong to it: {exc}",
            fields=exc.fields,
        ) from None
    states[i] = moved.to_json()
    layout = saved.layout
    per = int(layout.get("micro_batch_size", 0)) * int(layout.get("world_size", 0))
    taken = saved.samples_consumed - moved.samples_consumed
    if taken and (per <= 0 or taken % per):
        raise StateError(
            f"the Lightning checkpoint's detdata loader state was saved {taken} samples into "
            f"optimizer step {step}, not a whole number of its micro steps ({layout})",
            fields=("layout",),
        )
    return taken // per if taken else 0


def _rewind_progress(progress: Any, back: int, step: int) -> None:
    """Lightning's saved batch counters (``epoch_loop.batch_progress``) as at the start of
    optimizer step ``step``: ``back`` micro batches of it had been fetched (and counted by
    the loader), their gradients not saved."""
    if not isinstance(progress, MutableMapping):
        raise StateError(
            "the Lightning checkpoint has no epoch_loop.batch_progress to move back to the start "
            f"of optimizer step {step}"
        )
    log.warning(
        "detdata: the Lightning checkpoint was written inside optimizer step %d (%d of its "
        "micro batches fetched, their gradients not saved); training the step again from its "
        "first micro batch",
        step,
        back,
    )
    for part in ("current", "total"):
        counters = progress[part]
        start = int(counters["ready"]) - back
        if start < 0:
            raise StateError(
                f"the Lightning checkpoint's batch counters ({part}: {dict(counters)}) hold fewer "
                f"than the {back} micro batches of optimizer step {step} its loader delivered"
            )
        for name in ("ready", "started", "processed", "completed"):
            counters[name] = start
    progress["is_last_batch"] = False


def _detdata_loaders(trainer: pl.Trainer) -> list[DataLoader]:
    combined = trainer.fit_loop._combined_loader
    flattened = [] if combined is None else list(combined.flattened)
    return [d for d in flattened if isinstance(d, DataLoader)]


def _check_restored(loader: DataLoader, step: int) -> None:
    """The loader stands at the first position of Lightning's optimizer step ``step``."""
    if loader.samples_consumed == loader.position_of_step(step):
        return
    if step > 0 and loader.samples_consumed == 0:
        raise StateError(
            f"Lightning resumes at optimizer step {step}, but this detdata.DataLoader starts at "
            "position 0: Lightning did not restore its state and it would replay the run from "
            "its first sample; hint: resume from a checkpoint written inside an epoch "
            "(ModelCheckpoint(every_n_train_steps=...)) with the same loader in "
            "train_dataloaders= or train_dataloader(), or call "
            "loader.load_state_dict(saved_state) before fit",
            fields=("samples_consumed",),
        )
    raise StateError(
        f"Lightning resumes at optimizer step {step} (position {loader.position_of_step(step)}), "
        f"but this detdata.DataLoader stands at position {loader.samples_consumed} (global "
        f"step {loader.step}); hint: resume from a checkpoint Lightning wrote with this loader "
        "and DetdataSteps, and give it the same accumulate_grad_batches",
        fields=("samples_consumed",),
    )
