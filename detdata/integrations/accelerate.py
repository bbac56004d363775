"""accelerate (1.15): a resume that would restart the data or misalign its steps is refused or
repaired; the one line is ``accelerator.register_for_checkpointing(loader)`` (README,
"accelerate"; docs/design.md section 7).

Wrapped once per process (`detdata.integrations.watch`), each returning and raising what
accelerate does: ``register_for_checkpointing`` notes each loader's accelerators; the first
``accumulate`` per accelerator checks ``gradient_accumulation_steps x num_processes x micro
batch`` = its loaders' global batch (`ConfigError`); after ``load_state`` a prepared detdata
sampler without ``use_stateful_dataloader=True`` is a `StateError` and ``accelerator.step`` is
set to the micro batches the restored loaders delivered (logged). A loader whose accelerator
resumed without it is refused at its first batch (`AcceleratorWatch.check_start`).
"""

from __future__ import annotations

import functools
import weakref
from collections.abc import Callable
from typing import Any, Final

from detdata.base.errors import StateError
from detdata.base.redact import get_logger
from detdata.integrations.watch import wrap_once
from detdata.loading.loader import DataLoader
from detdata.loading.sampler import DeterministicBatchSampler, FrameworkBatchSampler

__all__ = ["AcceleratorWatch", "start_watch"]

log: Final = get_logger("detdata.loader")

_SAMPLERS: Final = (DeterministicBatchSampler, FrameworkBatchSampler)
#: how deep accelerate wraps a batch sampler (BatchSamplerShard, SkipBatchSampler)
_DEPTH: Final = 4
_REGISTER: Final = (
    "hint: accelerator.register_for_checkpointing(loader) right after building the "
    "Accelerator, before load_state, in the run that saves and the one that resumes (a "
    "checkpoint saved without it has no loader state: resume from one saved with it, or call "
    "loader.load_state_dict(state) with a state you saved yourself); a loader that starts over "
    "in every run (evaluation) declares it: "
    "LoaderOptions(resume=ResumePolicy(fresh_each_run=True))"
)


class AcceleratorWatch:
    """What the wrapped ``Accelerator`` methods saw (weakly held), and `check_start`."""

    def __init__(self) -> None:
        #: accelerators whose ``load_state`` returned -> whether it restored a detdata loader
        self.resumed: weakref.WeakKeyDictionary[Any, bool] = weakref.WeakKeyDictionary()
        #: detdata loaders -> the accelerators they are registered with
        self.registered: weakref.WeakKeyDictionary[DataLoader, weakref.WeakSet[Any]] = (
            weakref.WeakKeyDictionary()
        )
        #: detdata loaders a ``load_state`` restored
        self.restored: weakref.WeakSet[DataLoader] = weakref.WeakSet()
        #: accelerators whose batch settings were checked at their first ``accumulate()``
        self.checked: weakref.WeakSet[Any] = weakref.WeakSet()

    # -------------------------------------------------------- the wrapped methods
    def registering(self, accelerator: Any, objects: tuple[Any, ...]) -> None:
        for obj in objects:
            if isinstance(obj, DataLoader):
                self.registered.setdefault(obj, weakref.WeakSet()).add(accelerator)
                if int(accelerator.gradient_accumulation_steps) > 1:
                    _check_batch(accelerator, obj)

    def accumulating(self, accelerator: Any, _models: tuple[Any, ...]) -> None:
        """Before ``accelerator.accumulate(...)``: check its loaders' batch (once)."""
        if accelerator in self.checked:
            return
        for loader in _loaders(accelerator):
            _check_batch(accelerator, loader)
        self.checked.add(accelerator)

    def loaded(self, accelerator: Any, _args: tuple[Any, ...]) -> None:
        for prepared in getattr(accelerator, "_dataloaders", ()):
            sampler = _detdata_sampler(prepared)
            if sampler is not None and not getattr(prepared, "use_stateful_dataloader", False):
                raise StateError(
                    "accelerator.load_state restored the model and optimizer but not the "
                    f"position of the prepared DataLoader over a detdata {type(sampler).__name__}"
                    ": without use_stateful_dataloader=True accelerate saves no position for it,"
                    " and it would start the run over at its first sample; hint: "
                    "Accelerator(dataloader_config=DataLoaderConfiguration(split_batches=True, "
                    "use_stateful_dataloader=True)) for the run that saves and the one that "
                    "resumes"
                )
        loaders = _loaders(accelerator)
        for loader in loaders:
            self.restored.add(loader)
        self.resumed[accelerator] = bool(loaders)
        if loaders:
            _align_step(accelerator, loaders)

    # -------------------------------------------------------- the loader's first batch
    def check_start(self, loader: object) -> None:
        """A `DataLoader` at position 0 starts: `StateError` if an accelerator it is registered
        with resumed without it, or it is registered with none while some ``load_state``
        restored no detdata loader. Never for ``ResumePolicy(fresh_each_run=True)``."""
        if not isinstance(loader, DataLoader) or loader.options.resume.fresh_each_run:
            return
        owners = self.registered.get(loader)
        if owners:
            for accelerator in tuple(owners):
                if accelerator in self.resumed and loader not in self.restored:
                    raise StateError(
                        "this detdata.DataLoader starts at position 0: it was registered for "
                        "checkpointing after accelerator.load_state returned, so its position "
                        "was not restored and it would train the run's first samples again; "
                        + _REGISTER,
                        fields=("samples_consumed",),
                    )
            return
        if any(not covered for covered in tuple(self.resumed.values())):
            raise StateError(
                "accelerator.load_state resumed the model and optimizer, but this "
                "detdata.DataLoader starts at position 0: it is not registered for "
                "checkpointing, so no checkpoint holds its position and it would train the "
                "run's first samples again; " + _REGISTER,
                fields=("samples_consumed",),
            )


_WATCH: Final = AcceleratorWatch()


def start_watch() -> Callable[[object], None]:
    """Wrap the module doc's three methods; returns `AcceleratorWatch.check_start`. accelerate
    is imported here, not with this module: a direct import of this module before accelerate
    would otherwise start the watch while this module is half made."""
    from accelerate import Accelerator

    for name, hook, before in (
        ("load_state", _WATCH.loaded, False),
        ("register_for_checkpointing", _WATCH.registering, False),
        ("accumulate", _WATCH.accumulating, True),
    ):
        wrap_once(Accelerator, name, functools.partial(_watched, hook=hook, before=before))
    return _WATCH.check_start


def _watched(
    original: Callable[..., Any], hook: Callable[[Any, tuple[Any, ...]], None], *, before: bool
) -> Callable[..., Any]:
    """``original`` with ``hook(accelerator, positional arguments)`` run before or after it."""

    @functools.wraps(original)
    def method(self: Any, *args: Any, **kwargs: Any) -> Any:
        if before:
            hook(self, args)
        out = original(self, *args, **kwargs)
        if not before:
            hook(self, args)
        return out

    return method


def _loaders(accelerator: Any) -> list[DataLoader]:
    return [o for o in getattr(accelerator, "_custom_objects", ()) if isinstance(o, DataLoader)]


def _check_batch(accelerator: Any, loader: DataLoader) -> None:
    loader.check_trainer_batch(
        micro_batch_size=loader.batch_size,
        accumulation=int(accelerator.gradient_accumulation_steps),
        world_size=int(accelerator.num_processes),
        trainer="accelerate.Accelerator",
        fix="Accelerator(gradient_accumulation_steps={accumulation}), or a micro_batch_size that "
        "makes micro x processes x gradient_accumulation_steps the global batch",
    )


def _align_step(accelerator: Any, loaders: list[DataLoader]) -> None:
    """Set ``accelerator.step`` (module doc); loaders that disagree are a `StateError`."""
    accumulation = int(accelerator.gradient_accumulation_steps)
    if accumulation > 1:
        for loader in loaders:
            _check_batch(accelerator, loader)
    delivered = {lo.samples_consumed // lo.layout.samples_per_micro_step for lo in loaders}
    if len(delivered) > 1:
        raise StateError(
            "accelerator.load_state restored detdata loaders that stand at different micro "
            f"steps ({sorted(delivered)}); accelerator.step can follow only one; hint: register "
            "one training loader per Accelerator",
            fields=("samples_consumed",),
        )
    (micro_steps,) = delivered
    restored = int(accelerator.step)
    if accumulation == 1 or restored == micro_steps:
        return
    log.warning(
        "detdata: accelerator.load_state restored accelerator.step=%d, but the detdata loader "
        "resumes at optimizer step %d after %d micro batches of this run's layout "
        "(gradient_accumulation_steps=%d); setting accelerator.step=%d so that accumulate() "
        "steps at detdata's step boundaries",
        restored,
        loaders[0].step,
        micro_steps,
        accumulation,
        micro_steps,
    )
    accelerator.step = micro_steps


def _detdata_sampler(prepared: Any) -> Any:
    """The detdata batch sampler ``prepared`` draws from (possibly wrapped), or None."""
    for obj in (getattr(prepared, "batch_sampler", None), getattr(prepared, "sampler", None)):
        for _ in range(_DEPTH):
            if isinstance(obj, _SAMPLERS):
                return obj
            obj = getattr(obj, "batch_sampler", None)
    return None
