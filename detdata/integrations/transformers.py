"""Hugging Face transformers (5.x) ``Trainer`` over a `detdata.DataLoader` (README, "Hugging
Face transformers"): `DetdataTrainer`, or `DetdataTrainerMixin` in your own ``Trainer``
subclass, with the loader as ``train_dataloader``.

- ``get_train_dataloader()`` returns the loader itself once the Trainer's batch
  (``check_trainer_batch``) and worker settings (`check_worker_args`) are checked
  (`ConfigError` naming the fix);
- each ``checkpoint-N`` folder gets `STATE_FILE`: the loader's state at the first position of
  the Trainer's ``global_step`` (a checkpoint inside gradient accumulation retrains that step);
- a resume loads it, checks it stands at the restored ``global_step`` (`StateError`), and
  the Trainer's ``skip_first_batches`` is not applied to the loader.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Final

import transformers.trainer as hf_trainer
from transformers import Trainer
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR

from detdata.base.errors import ConfigError, StateError
from detdata.loading.loader import DataLoader
from detdata.loading.state import LoaderState
from detdata.loading.steps import MidStep
from detdata.storage.atomic import atomic_write_bytes

__all__ = ["STATE_FILE", "DetdataTrainer", "DetdataTrainerMixin"]

#: The loader's state in each checkpoint folder.
STATE_FILE: Final = "detdata_loader.json"
#: The name ``transformers.trainer`` calls to skip the trained batches of a resumed epoch.
_SKIP: Final = "skip_first_batches"


class DetdataTrainerMixin:
    """``class MyTrainer(DetdataTrainerMixin, Trainer)``: the module doc's behaviour."""

    detdata_loader: DataLoader

    def __init__(self, *args: Any, train_dataloader: DataLoader, **kwargs: Any) -> None:
        if not isinstance(train_dataloader, DataLoader):
            raise ConfigError(
                f"train_dataloader must be a detdata.DataLoader, got "
                f"{type(train_dataloader).__name__}"
            )
        self.detdata_loader = train_dataloader
        super().__init__(*args, **kwargs)

    # ------------------------------------------------------------------ the loader
    def get_train_dataloader(self) -> Any:
        args = self.args  # type: ignore[attr-defined]
        check_worker_args(args, self.detdata_loader)
        self.detdata_loader.check_trainer_batch(
            micro_batch_size=args.per_device_train_batch_size,
            accumulation=args.gradient_accumulation_steps,
            world_size=args.world_size,
            trainer="transformers.Trainer",
            fix=(
                "TrainingArguments(per_device_train_batch_size={micro}, "
                "gradient_accumulation_steps={accumulation})"
            ),
        )
        return self.detdata_loader

    # ------------------------------------------------------------------ checkpoints
    def _save_checkpoint(self, model: Any, trial: Any) -> None:
        state = self.state  # type: ignore[attr-defined]
        # the state at the first position of the Trainer's step (module doc)
        try:
            saved = LoaderState.from_json(self.detdata_loader.state_dict()).resumed(
                MidStep.REDO, at_step=int(state.global_step)
            )
        except StateError as exc:  # checked before anything is written
            raise StateError(
                f"transformers.Trainer saves optimizer step {state.global_step} but the detdata "
                f"loader has delivered {self.detdata_loader.samples_consumed} samples (global "
                f"step {self.detdata_loader.step}): {exc}; hint: build the Trainer as "
                "DetdataTrainer with this loader as train_dataloader and nothing else iterating it"
            ) from None
        super()._save_checkpoint(model, trial)  # type: ignore[misc]
        if not self.args.should_save:  # type: ignore[attr-defined]
            return
        folder = Path(self._get_output_dir(trial=trial))  # type: ignore[attr-defined]
        target = folder / f"{PREFIX_CHECKPOINT_DIR}-{state.global_step}" / STATE_FILE
        atomic_write_bytes(str(target), json.dumps(saved.to_json()).encode())

    def _init_training_state(
        self,
        max_steps: int,
        num_update_steps_per_epoch: int,
        num_train_epochs: int,
        resume_from_checkpoint: str | None,
        trial: Any,
    ) -> tuple[int, int]:
        out: tuple[int, int] = super()._init_training_state(  # type: ignore[misc]
            max_steps, num_update_steps_per_epoch, num_train_epochs, resume_from_checkpoint, trial
        )
        step = int(self.state.global_step)  # type: ignore[attr-defined]
        if resume_from_checkpoint is not None:
            self._load_loader_state(Path(resume_from_checkpoint), step)
        elif self.detdata_loader.samples_consumed:
            raise StateError(
                f"transformers.Trainer starts a fresh run at optimizer step 0, but the detdata "
                f"loader has delivered {self.detdata_loader.samples_consumed} samples already "
                f"(global step {self.detdata_loader.step}); hint: train(resume_from_checkpoint="
                "...) to continue a run, or build a new detdata.DataLoader for a new one"
            )
        return out

    def _load_loader_state(self, checkpoint: Path, step: int) -> None:
        path = checkpoint / STATE_FILE
        if not path.is_file():
            raise StateError(
                f"checkpoint {str(checkpoint)!r} has no detdata loader state ({STATE_FILE}): "
                f"the Trainer would resume at optimizer step {step} with the data at position "
                f"{self.detdata_loader.samples_consumed}; hint: write checkpoints with "
                "detdata.integrations.transformers.DetdataTrainer"
            )
        self.detdata_loader.load_state_dict(json.loads(path.read_text()))
        if self.detdata_loader.step != step or self.detdata_loader.samples_consumed != (
            self.detdata_loader.position_of_step(step)
        ):
            raise StateError(
                f"checkpoint {str(checkpoint)!r}: the Trainer resumes at optimizer step {step} "
                f"but {STATE_FILE} resumes the data at position "
                f"{self.detdata_loader.samples_consumed} (global step "
                f"{self.detdata_loader.step}); the checkpoint's files do not belong together"
            )

    # ------------------------------------------------------------------ the epoch loop
    def _run_epoch(self, **kwargs: Any) -> Any:
        """The Trainer's epoch without ``skip_first_batches`` on the detdata loader (already at
        the position; the Trainer still counts the skipped micro batches)."""
        with _no_skip(self.detdata_loader, int(self.state.global_step)):  # type: ignore[attr-defined]
            return super()._run_epoch(**kwargs)  # type: ignore[misc]


def check_worker_args(args: Any, loader: DataLoader) -> None:
    """`ConfigError` for a ``TrainingArguments`` worker setting the Trainer would not apply (the
    loader's own keywords decide); ``dataloader_pin_memory`` / ``_drop_last`` change no sample."""
    workers = int(args.dataloader_num_workers)
    if workers not in (0, loader.num_workers):
        raise ConfigError(
            f"TrainingArguments(dataloader_num_workers={workers}) is not applied: "
            "DetdataTrainer trains on the detdata.DataLoader as it was built, with "
            f"num_workers={loader.num_workers}; hint: detdata.DataLoader(..., "
            f"num_workers={workers}) and leave dataloader_num_workers at its default"
        )
    unapplied = (  # (argument, its value, the DataLoader keyword, the argument's default)
        ("dataloader_persistent_workers", args.dataloader_persistent_workers,
         "persistent_workers", False),
        ("dataloader_prefetch_factor", args.dataloader_prefetch_factor, "prefetch_factor", None),
        ("dataloader_multiprocessing_context", args.dataloader_multiprocessing_context,
         "multiprocessing_context", None),
    )  # fmt: skip
    for name, value, keyword, default in unapplied:
        if value != default:
            raise ConfigError(
                f"TrainingArguments({name}={value!r}) is not applied: DetdataTrainer trains on "
                "the detdata.DataLoader as it was built; hint: detdata.DataLoader(..., "
                f"{keyword}={value!r}) and leave {name} at its default ({default!r})"
            )


@contextlib.contextmanager
def _no_skip(loader: DataLoader, step: int) -> Iterator[None]:
    """transformers' ``skip_first_batches`` returns ``loader`` as it is (`StateError` unless it
    stands at the start of optimizer ``step``); other data loaders are skipped as before."""
    original = getattr(hf_trainer, _SKIP)

    def skip(dataloader: Any, num_batches: int = 0) -> Any:
        if dataloader is not loader:
            return original(dataloader, num_batches)
        if loader.samples_consumed != loader.position_of_step(step):
            raise StateError(
                f"transformers.Trainer resumes {num_batches} micro batches into its epoch at "
                f"optimizer step {step}, but the detdata loader stands at position "
                f"{loader.samples_consumed}, not at that step's first position "
                f"{loader.position_of_step(step)}"
            )
        return loader

    setattr(hf_trainer, _SKIP, skip)
    try:
        yield
    finally:
        setattr(hf_trainer, _SKIP, original)


class DetdataTrainer(DetdataTrainerMixin, Trainer):  # type: ignore[misc]
    """``transformers.Trainer`` over a `detdata.DataLoader` (``train_dataloader=``; module doc)."""
