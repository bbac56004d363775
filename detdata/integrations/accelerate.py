"""accelerate (1.15): a resume that would restart the data is refused, with no glue.

The user's one line (README) is ``accelerator.register_for_checkpointing(loader)``: then
``save_state`` / ``load_state`` carry the loader's state. Without it, ``load_state`` resumes
the model, optimizer, RNG and ``accelerator.step`` while the loader starts its run over at
position 0, and nothing of that call reaches the loader. Likewise a torch ``DataLoader`` with a
detdata batch sampler prepared without ``use_stateful_dataloader=True``: accelerate saves and
restores no position for it.

So detdata watches ``load_state`` (`detdata.loading.frameworks`): when accelerate is imported
before detdata, or before a detdata loader or sampler is built (the usual order: a
``load_state`` called before both is not seen), ``Accelerator.load_state`` is wrapped, once per
process, by a function that calls accelerate's own and then looks at what it restored:

- a prepared data loader whose batch sampler is a detdata sampler, while that loader is not a
  stateful one: `StateError` from ``load_state``, naming ``use_stateful_dataloader=True``;
- a `detdata.DataLoader` that starts an iteration at position 0 after an ``Accelerator`` of
  this process loaded a checkpoint with no detdata loader registered for checkpointing:
  `StateError` at its first batch, naming ``register_for_checkpointing``. (With a detdata
  loader registered, another loader at position 0 is taken to be meant, e.g. evaluation.)

Nothing else changes: the wrapper returns what accelerate returns and raises what it raises.
"""

from __future__ import annotations

import functools
import weakref
from collections.abc import Callable, Iterator
from typing import Any, Final

from accelerate import Accelerator

from detdata.base.errors import StateError
from detdata.loading.loader import DataLoader
from detdata.loading.sampler import DeterministicBatchSampler, FrameworkBatchSampler

__all__ = ["LoadStateWatch", "start_watch"]

#: set on the wrapper, so that the class is wrapped once
_MARK: Final = "__detdata_watch__"
_SAMPLERS: Final = (DeterministicBatchSampler, FrameworkBatchSampler)
#: how deep a data loader's batch sampler may be wrapped (accelerate: BatchSamplerShard,
#: SkipBatchSampler)
_DEPTH: Final = 4


class LoadStateWatch:
    """The accelerators of this process whose ``load_state`` returned (weakly held), and the
    check of a loader starting at position 0 against them (a `FrameworkWatcher`)."""

    def __init__(self) -> None:
        self.resumed: weakref.WeakSet[Any] = weakref.WeakSet()

    def built(self) -> None:
        """Nothing: the wrapper is in place (`start_watch`)."""

    def loaded(self, accelerator: Any) -> None:
        """``accelerator.load_state`` returned: refuse a prepared detdata sampler that it did
        not restore, and remember the accelerator for `check_start`."""
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
        self.resumed.add(accelerator)

    def check_start(self, loader: object) -> None:
        """A `DataLoader` at position 0 after a ``load_state`` that restored no detdata loader:
        `StateError` (see the module doc)."""
        if not isinstance(loader, DataLoader):
            return
        for accelerator in tuple(self.resumed):
            registered = getattr(accelerator, "_custom_objects", None)
            if registered is None or any(isinstance(o, DataLoader) for o in registered):
                continue
            raise StateError(
                "accelerator.load_state resumed the model and optimizer, but this "
                "detdata.DataLoader starts at position 0: it is not registered for "
                "checkpointing, so no checkpoint holds its position and it would train the "
                "run's first samples again; hint: accelerator.register_for_checkpointing(loader)"
                " right after building the Accelerator, in the run that saves and the one "
                "that resumes (a checkpoint saved without it has no loader state: resume from "
                "one saved with it, or call loader.load_state_dict(state) with a state you "
                "saved yourself)",
                fields=("samples_consumed",),
            )


_WATCH: Final = LoadStateWatch()


def start_watch() -> LoadStateWatch:
    """Wrap ``Accelerator.load_state`` (once per process) and return the watch."""
    original = Accelerator.load_state
    if not getattr(original, _MARK, False):
        Accelerator.load_state = _watched(original)
    return _WATCH


def _watched(original: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(original)
    def load_state(self: Any, *args: Any, **kwargs: Any) -> Any:
        out = original(self, *args, **kwargs)
        _WATCH.loaded(self)
        return out

    setattr(load_state, _MARK, True)
    return load_state


def _detdata_sampler(prepared: Any) -> Any:
    """The detdata batch sampler a (prepared) data loader draws from, or None."""
    for start in (getattr(prepared, "batch_sampler", None), getattr(prepared, "sampler", None)):
        for obj in _chain(start):
            if isinstance(obj, _SAMPLERS):
                return obj
    return None


def _chain(obj: Any) -> Iterator[Any]:
    """``obj`` and the batch samplers it wraps (``.batch_sampler``), at most `_DEPTH`."""
    for _ in range(_DEPTH):
        if obj is None:
            return
        yield obj
        obj = getattr(obj, "batch_sampler", None)
