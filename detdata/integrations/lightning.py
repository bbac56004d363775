"""PyTorch Lightning (2.6): no glue, and no line; Lightning's optimizer step N is detdata's step
N, or ``fit`` stops before its first batch naming the setting that fixes it (README, "PyTorch
Lightning"; docs/design.md section 7).

Wrapped once per process and package (``pytorch_lightning`` and ``lightning.pytorch``, each
once imported, `detdata.integrations.watch`):

- ``_CheckpointConnector.restore_loops`` (`align_checkpoint`): a checkpoint written inside an
  optimizer step has its loader state moved to the first position of ``global_step`` and
  Lightning's micro-batch counters (``epoch_loop.batch_progress``) moved back with it, recounted
  in this run's ``accumulate_grad_batches`` if it differs (logged): the step is trained whole;
- ``FitLoop.on_run_start`` (`check_fit`, before the first batch): each `detdata.DataLoader`
  needs ``accumulate_grad_batches x devices x micro batch`` = its global batch (`ConfigError`)
  and must stand at the first position of the restored ``global_step`` (`StateError`).
"""

from __future__ import annotations

import functools
import importlib
import sys
from collections.abc import Callable, MutableMapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Final, cast

from detdata.base.errors import ConfigError, StateError
from detdata.base.redact import get_logger
from detdata.integrations.watch import wrap_once
from detdata.loading.loader import DataLoader
from detdata.loading.state import KIND, LoaderState
from detdata.loading.steps import MidStep

if TYPE_CHECKING:  # lightning.pytorch's copies of these classes are the same code
    import pytorch_lightning as pl
    from pytorch_lightning.loops.fit_loop import _FitLoop
    from pytorch_lightning.trainer.connectors.checkpoint_connector import _CheckpointConnector

__all__ = ["PACKAGES", "DetdataSteps", "align_checkpoint", "start_watch"]

log: Final = get_logger("detdata.loader")

#: the Lightning packages watched -> the top-level package in ``sys.modules`` (`DetdataSteps`)
PACKAGES: Final = {"pytorch_lightning": "pytorch_lightning", "lightning.pytorch": "lightning"}
#: Lightning's batch counters (``_ProcessedTracker``)
_COUNTERS: Final = ("ready", "started", "processed", "completed")


@dataclass(frozen=True)
class _Package:
    """The classes the watch uses, from one Lightning package (a key of `PACKAGES`)."""

    name: str
    connector: type[_CheckpointConnector]
    fit_loop: type[_FitLoop]
    callback: type[pl.Callback]
    scheduler: type[pl.callbacks.GradientAccumulationScheduler]


@functools.cache
def _load(name: str) -> _Package:
    """The classes of Lightning package ``name`` (imported here if it is not yet)."""
    if name not in PACKAGES:
        raise ConfigError(
            f"detdata watches the Lightning packages {sorted(PACKAGES)}, not {name!r}; hint: "
            "import pytorch_lightning or lightning.pytorch"
        )
    package = importlib.import_module(name)
    return _Package(
        name=name,
        connector=importlib.import_module(
            f"{name}.trainer.connectors.checkpoint_connector"
        )._CheckpointConnector,
        fit_loop=importlib.import_module(f"{name}.loops.fit_loop")._FitLoop,
        callback=package.Callback,
        scheduler=package.callbacks.GradientAccumulationScheduler,
    )


def start_watch(package: str = "pytorch_lightning") -> None:
    """Wrap the two methods of the module doc in Lightning package ``package`` (a key of
    `PACKAGES`); returns None: no check is left for a loader's start."""
    classes = _load(package)
    wrap_once(
        classes.connector, "restore_loops", functools.partial(_aligned_restore, classes=classes)
    )
    wrap_once(
        classes.fit_loop, "on_run_start", functools.partial(_checked_run_start, classes=classes)
    )


def _aligned_restore(original: Callable[..., Any], classes: _Package) -> Callable[..., Any]:
    @functools.wraps(original)
    def restore_loops(self: _CheckpointConnector) -> None:
        checkpoint = self._loaded_checkpoint
        trainer = self.trainer
        if checkpoint and trainer.state.fn == "fit":  # TrainerFn.FITTING, a str enum
            epoch = int(checkpoint.get("epoch", 0))
            align_checkpoint(checkpoint, _accumulation(trainer, epoch, classes))
        original(self)

    return restore_loops


def _checked_run_start(original: Callable[..., Any], classes: _Package) -> Callable[..., Any]:
    @functools.wraps(original)
    def on_run_start(self: _FitLoop) -> None:
        check_fit(self.trainer, classes)
        original(self)

    return on_run_start


class DetdataSteps:
    """The optional line of earlier versions, ``Trainer(callbacks=[DetdataSteps()])``: a
    callback that only starts the watch. It is a ``Callback`` of each Lightning package imported
    when it is called (of ``pytorch_lightning`` when none is), so either ``Trainer`` takes it."""

    packages: tuple[str, ...] = ()

    def __new__(cls) -> DetdataSteps:
        imported = tuple(name for name, top in PACKAGES.items() if top in sys.modules)
        return object.__new__(_steps_class(imported or ("pytorch_lightning",)))

    def __init__(self) -> None:
        super().__init__()
        for package in self.packages:
            start_watch(package)

    def __reduce__(self) -> tuple[type[DetdataSteps], tuple[()]]:
        """Pickled (``ddp_spawn``) and copied as a fresh ``DetdataSteps()``: its class is made
        for the packages imported where it is unpickled."""
        return (DetdataSteps, ())


@functools.cache
def _steps_class(packages: tuple[str, ...]) -> type[DetdataSteps]:
    """`DetdataSteps` made a subclass of the ``Callback`` of each of ``packages``."""
    bases: tuple[type, ...] = (DetdataSteps, *(_load(p).callback for p in packages))
    namespace = {"packages": packages, "__module__": __name__}
    return cast("type[DetdataSteps]", type("DetdataSteps", bases, namespace))


# ------------------------------------------------------------------ restore
def align_checkpoint(checkpoint: MutableMapping[str, Any], accumulation: int) -> None:
    """Move a loaded Lightning checkpoint to the start of its optimizer step, counted in
    ``accumulation`` micro batches a step (module doc); one with no detdata state is left as
    it is. `StateError` if its loaders disagree or do not belong to it."""
    fit = checkpoint.get("loops", {}).get("fit_loop", {})
    states = fit.get("state_dict", {}).get("combined_loader", [])
    step = int(checkpoint.get("global_step", 0))
    moves = {_step_start(states, i, step) for i, s in enumerate(states) if _is_detdata(s)}
    if not moves:
        return
    if len(moves) > 1:
        raise StateError(
            f"the Lightning checkpoint's detdata loaders disagree on where optimizer step {step} "
            f"starts ((micro batches fetched, micro batches per step): {sorted(moves)})",
            fields=("layout",),
        )
    ((back, per_step),) = moves
    if back == 0 and per_step == accumulation:
        return  # at a step boundary, counted as this run counts
    progress = fit.get("epoch_loop.batch_progress")
    _recount(progress, step, back=back, saved=per_step, now=accumulation)


def _is_detdata(state: object) -> bool:
    return isinstance(state, MutableMapping) and state.get("kind") == KIND


def _step_start(states: list[Any], i: int, step: int) -> tuple[int, int]:
    """Move ``states[i]`` to the first position of optimizer ``step``; returns (micro batches
    taken back, micro batches per step), both in the saving run's layout."""
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
    batch = saved.plan.batch_of(step)
    taken = saved.samples_consumed - moved.samples_consumed
    if per <= 0 or taken % per or batch % per:
        raise StateError(
            f"the Lightning checkpoint's detdata loader state ({layout}) was saved {taken} "
            f"samples into optimizer step {step} of {batch} samples: not whole micro steps of "
            "its own layout",
            fields=("layout",),
        )
    return taken // per, batch // per


def _recount(progress: object, step: int, *, back: int, saved: int, now: int) -> None:
    """Lightning's batch counters (``saved`` micro batches a step, ``back`` fetched into
    ``step``) as this run counts at the start of ``step``: whole steps x ``now``."""
    if not isinstance(progress, MutableMapping):
        raise StateError(
            "the Lightning checkpoint has no epoch_loop.batch_progress to move to the start of "
            f"optimizer step {step}"
        )
    starts = {part: _whole_steps(progress[part], part, step, back, saved) * now for part in
              ("current", "total")}  # fmt: skip
    if back:
        log.warning(
            "detdata: the Lightning checkpoint was written inside optimizer step %d (%d of its "
            "micro batches fetched, their gradients not saved); training the step again from "
            "its first micro batch",
            step,
            back,
        )
    if saved != now:
        log.warning(
            "detdata: the Lightning checkpoint counted %d micro batches a step, this run "
            "accumulate_grad_batches=%d: Lightning's batch counters recounted at %d a step, so "
            "optimizer step %d starts at its first micro batch",
            saved,
            now,
            now,
            step,
        )
    for part, start in starts.items():
        counters = progress[part]
        if back:  # as at the step's start: every counter there
            shift = {name: start for name in _COUNTERS}
        else:  # a step boundary: the counters' own stage (e.g. saved on_train_batch_end) kept
            moved = start - int(counters["ready"])
            shift = {name: int(counters[name]) + moved for name in _COUNTERS}
        counters.update(shift)
    if back:
        progress["is_last_batch"] = False


def _whole_steps(counters: Any, part: str, step: int, back: int, per_step: int) -> int:
    """The whole steps ``counters`` (``ready`` less ``back``) count, ``per_step`` micro batches
    each; a `StateError` if they are not whole."""
    start = int(counters["ready"]) - back
    if start < 0 or start % per_step:
        raise StateError(
            f"the Lightning checkpoint's batch counters ({part}: {dict(counters)}) are not the "
            f"start of optimizer step {step} ({back} micro batches of it fetched, {per_step} "
            "a step); hint: resume from a checkpoint Lightning wrote over this detdata loader"
        )
    return start // per_step


# ------------------------------------------------------------------ train start
def check_fit(trainer: pl.Trainer, classes: _Package) -> None:
    """The module doc's train-start checks of every `detdata.DataLoader` ``trainer`` fits."""
    combined = trainer.fit_loop._combined_loader
    loaders = [] if combined is None else list(combined.flattened)
    accumulation = _accumulation(trainer, int(trainer.current_epoch), classes)
    for loader in loaders:
        if isinstance(loader, DataLoader):
            loader.check_trainer_batch(
                micro_batch_size=loader.batch_size,
                accumulation=accumulation,
                world_size=int(trainer.world_size),
                trainer=f"{classes.name}.Trainer",
                fix="Trainer(accumulate_grad_batches={accumulation}), or a micro_batch_size "
                "that makes micro x devices x accumulate_grad_batches the global batch",
            )
            _check_restored(loader, int(trainer.global_step))


def _accumulation(trainer: pl.Trainer, epoch: int, classes: _Package) -> int:
    """Micro batches per optimizer step at ``epoch``: ``accumulate_grad_batches``, or a
    ``GradientAccumulationScheduler``'s (which must not change it: `ConfigError`)."""
    callbacks: list[Any] = trainer.callbacks  # type: ignore[attr-defined]  # set by Lightning
    schedulers = [c for c in callbacks if isinstance(c, classes.scheduler)]
    if not schedulers:
        return int(trainer.accumulate_grad_batches)
    scheduling = schedulers[0].scheduling
    if len(set(scheduling.values())) > 1:
        raise ConfigError(
            f"GradientAccumulationScheduler({scheduling}) changes accumulate_grad_batches "
            "during the run, but a detdata.DataLoader's optimizer step is its global batch, "
            "the same all run; hint: one accumulate_grad_batches for the whole run"
        )
    return int(schedulers[0].get_accumulate_grad_batches(epoch))


def _check_restored(loader: DataLoader, step: int) -> None:
    """The loader stands at the first position of Lightning's optimizer step ``step``."""
    if loader.samples_consumed == loader.position_of_step(step):
        return
    if step > 0 and loader.samples_consumed == 0:
        raise StateError(
            f"Lightning resumes at optimizer step {step}, but this detdata.DataLoader starts at "
            "position 0: its state was not restored (Lightning hands a loader its state only "
            "from a checkpoint written inside an epoch) and it would replay the run from its "
            "first sample; hint: resume from a checkpoint written inside an epoch "
            "(ModelCheckpoint(every_n_train_steps=...), or train by max_steps) with the same "
            "loader in train_dataloaders= or train_dataloader(), or call "
            "loader.load_state_dict(saved_state) before fit",
            fields=("samples_consumed",),
        )
    raise StateError(
        f"Lightning resumes at optimizer step {step} (position {loader.position_of_step(step)}), "
        f"but this detdata.DataLoader stands at position {loader.samples_consumed} (global "
        f"step {loader.step}); hint: resume from a checkpoint Lightning wrote with this loader, "
        "or build a new detdata.DataLoader for a new run",
        fields=("samples_consumed",),
    )
