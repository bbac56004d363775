"""The `DataLoader`'s options beyond torch's keywords: frozen, keyword-only, self-validating.

`LoaderOptions` and its groups `ReadOptions`, `DeviceFeed`, `ResumePolicy` check their fields
when made and store them normalised; a bad value is a `ConfigError` naming the field
(``ReadOptions.batches_ahead``), expected vs found, with a hint. Only ``transform`` can change
a delivered byte. Former spellings of the ``*_ahead`` fields are refused naming the new one.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Final, cast

from detdata.base.checks import check_count, refuses_renamed
from detdata.base.errors import ConfigError, StateError
from detdata.base.types import MAX_POSITION
from detdata.loading.arguments import WorkerMode, parse_worker_mode
from detdata.loading.state import check_allow
from detdata.loading.steps import MidStep, parse_mid_step

if TYPE_CHECKING:
    import torch

    from detdata.loading.reading import Transform

#: ``ReadOptions.batches_ahead``'s upper bound: micro batches read with one batched read.
MAX_BATCHES_AHEAD: Final = 64
MAX_STEPS_AHEAD_CONNECTIONS: Final = 256
#: ``ReadOptions.steps_ahead``'s default: micro steps whose shards are filled into a shard
#: cache ahead of the consumer (the window is cut where it would not fit the cache's bound).
DEFAULT_STEPS_AHEAD: Final = 1024


def _counts(
    minimum: int, maximum: int = MAX_POSITION - 1, *, or_none: bool = True
) -> Callable[[object, str], object]:
    """A field check: an int in ``[minimum, maximum]`` (`check_count`), or None if ``or_none``."""
    return lambda v, label: (
        None if v is None and or_none else check_count(v, label, minimum=minimum, maximum=maximum)
    )


def _fix(
    obj: object, name: str, check: Callable[[Any, str], object], hint: str, label: str = ""
) -> None:
    """Store ``check(value, label)`` as field ``name`` of the frozen dataclass ``obj`` (inside
    ``__post_init__``); its error is a `ConfigError` naming ``label`` (default
    ``Class.name``, unless the message starts with it) with ``hint`` (unless it has one)."""
    label = label or f"{type(obj).__name__}.{name}"
    try:
        value = check(getattr(obj, name), label)
    except (ConfigError, StateError) as exc:
        text = str(exc) if str(exc).startswith(label) else f"{label}: {exc}"
        if "hint:" not in text:
            text = f"{text}; hint: {hint}"
        raise ConfigError(text) from None
    object.__setattr__(obj, name, value)


@refuses_renamed(
    read_ahead="batches_ahead",
    lookahead="steps_ahead",
    lookahead_connections="steps_ahead_connections",
)
@dataclass(frozen=True, kw_only=True)
class ReadOptions:
    """How a `DataLoader` reads; none of these changes a delivered byte or the order.

    * ``worker_mode`` (`WorkerMode` or its value, default ``"process"``): where the
      ``num_workers`` readers run: worker processes (as torch) or threads of this process.
    * ``batches_ahead`` (1..64, default 16): consecutive micro batches of the rank read with
      one batched read and then split (amortises the per-read and per-transfer cost); lower
      it for large samples (memory in flight: see `DataLoader`).
    * ``steps_ahead`` (None: `DEFAULT_STEPS_AHEAD` where shards are read through a shard
      cache; 0: off): the shards of the next ``steps_ahead`` micro steps are filled into the
      cache in the background (`detdata.datasets.prefetch`); make it larger than
      ``num_workers x prefetch_factor x batches_ahead``.
    * ``steps_ahead_connections`` (1..256, default 4): threads filling the cache ahead.
    """

    worker_mode: WorkerMode | str = WorkerMode.PROCESS
    batches_ahead: int = 16
    steps_ahead: int | None = None
    steps_ahead_connections: int = 4

    def __post_init__(self) -> None:
        _fix(
            self,
            "worker_mode",
            lambda v, _: parse_worker_mode(v),
            "'process' (worker processes, as torch) or 'thread' (threads of this process)",
        )
        _fix(
            self,
            "batches_ahead",
            _counts(1, MAX_BATCHES_AHEAD, or_none=False),
            "16 (the default) amortises the per-read cost; lower it for large samples",
        )
        _fix(
            self,
            "steps_ahead",
            _counts(0),
            "None (the default window), 0 (off) or a number of micro steps",
        )
        _fix(
            self,
            "steps_ahead_connections",
            _counts(1, MAX_STEPS_AHEAD_CONNECTIONS, or_none=False),
            "4 (the default) threads fill the shard cache ahead",
        )

    @property
    def mode(self) -> WorkerMode:
        """``worker_mode`` as a `WorkerMode` (it is stored as one once checked)."""
        return WorkerMode(self.worker_mode)


@refuses_renamed(prefetch="copies_ahead")
@dataclass(frozen=True, kw_only=True)
class DeviceFeed:
    """Batches delivered on an accelerator.

    * ``device`` (None: CPU batches; ``"cuda"``, ``"cuda:N"``, ``"cpu"`` or a `torch.device`):
      batches arrive there through reused pinned buffers and a side stream (torch's
      ``pin_memory`` is then ignored). Stored as the concrete `torch.device`; a device this
      process cannot use is refused here.
    * ``copies_ahead`` (1..64, default 2): batches copied ahead of the one delivered (not
      counted in ``samples_consumed`` until delivered).
    """

    device: str | torch.device | None = None
    copies_ahead: int = 2

    @property
    def target(self) -> torch.device | None:
        """``device`` as the `torch.device` it is stored as once checked (None: CPU batches)."""
        return cast("torch.device | None", self.device)

    def feed(self, batches: Iterator[Any]) -> Iterator[Any]:
        """``batches`` on ``device`` (`device_batches`); as they are without a device."""
        if self.target is None:
            return batches
        from detdata.loading.device import device_batches

        return device_batches(batches, self.target, self.copies_ahead)

    def __post_init__(self) -> None:
        from detdata.loading.device import MAX_DEPTH, check_device

        _fix(
            self,
            "copies_ahead",
            _counts(1, MAX_DEPTH, or_none=False),
            "2 overlaps one batch's copy with the current step",
        )
        _fix(
            self,
            "device",
            lambda v, _: None if v is None else check_device(v),
            "DeviceFeed(device='cuda'), 'cpu', or None for plain CPU batches",
        )


@dataclass(frozen=True, kw_only=True)
class ResumePolicy:
    """What ``load_state_dict`` accepts, and does by default (its own arguments add to it).

    * ``allow`` (names of checked state fields, e.g. ``["global_batch_size"]``): changes
      accepted at every resume of this loader, besides those ``load_state_dict(allow=...)``
      names. Stored as a frozenset.
    * ``mid_step`` (`MidStep` or its value, default ``"redo"``): the default of
      ``load_state_dict(mid_step=None)`` (`MidStep`), for callers such as
      ``torch.distributed.checkpoint`` that call ``load_state_dict(state)`` themselves.
    * ``fresh_each_run`` (default False): this loader starts at position 0 in every run by
      design (evaluation): framework watches that refuse a loader starting over in a resumed
      run leave it alone (`detdata.integrations.accelerate`); nothing else changes.
    * ``attest`` (default True): resume attestation (`detdata.loading.attest`): a state
      carries the digests of the last samples delivered, re-derived before a resume's first
      batch (a `StateError` when they differ). False: states carry none, resumes check none.
    """

    allow: Iterable[str] = ()
    mid_step: MidStep | str = MidStep.REDO
    fresh_each_run: bool = False
    attest: bool = True

    def __post_init__(self) -> None:
        for name, example in (
            ("attest", "ResumePolicy(attest=False) to save and resume without attestation"),
            ("fresh_each_run", "ResumePolicy(fresh_each_run=True) for an evaluation loader"),
        ):
            _of_type(f"ResumePolicy.{name}", getattr(self, name), bool, "True or False", example)
        _fix(
            self,
            "allow",
            lambda v, _: check_allow(v),
            "a list of checked field names, e.g. allow=['global_batch_size']",
        )
        _fix(
            self,
            "mid_step",
            parse_mid_step,
            "'redo' unless the partial step's gradients are restored too",
        )

    @property
    def allowed(self) -> frozenset[str]:
        """``allow`` as the frozenset it is stored as."""
        return frozenset(self.allow)

    @property
    def mid_step_mode(self) -> MidStep:
        """``mid_step`` as a `MidStep` (it is stored as one once checked)."""
        return MidStep(self.mid_step)


def _of_type(
    label: str, value: object, kind: type | tuple[type, ...], expected: str, example: str
) -> None:
    if not isinstance(value, kind):
        raise ConfigError(
            f"{label} must be {expected}, got {type(value).__name__} {value!r:.60}; hint: {example}"
        )


@dataclass(frozen=True, kw_only=True)
class LoaderOptions:
    """Everything a `DataLoader` takes beyond the batch, the seed, the order and torch's
    keywords: ``DataLoader(data, ..., options=LoaderOptions(...))``.

    * ``rank``, ``world_size`` (None: read from the initialised ``torch.distributed`` group
      when iteration starts, else 0 and 1): this process's data-parallel placement.
    * ``total_samples`` (None: infinite, epochs continue): the run's bound, a step end.
    * ``transform``: ``transform(sample, rng)`` (or ``transform(sample)``) applied to every
      sample, with the generator of its position (the same in every worker mode).
    * ``transform_id``: a name for the transform's version (e.g. ``"tokenize-v3"``), recorded
      in the state's checked ``transform`` field instead of the function's name.
    * ``trace`` (a path): one JSON line per delivered micro batch (positions, digests, step).
    * ``read``: `ReadOptions` (worker mode, batches and steps ahead).
    * ``device``: `DeviceFeed` (accelerator delivery, batches copied ahead).
    * ``resume``: `ResumePolicy` (changes allowed at every resume, the mid-step default).
    """

    rank: int | None = None
    world_size: int | None = None
    total_samples: int | None = None
    transform: Transform | None = None
    transform_id: str | None = None
    trace: str | os.PathLike[str] | None = None
    read: ReadOptions = field(default_factory=ReadOptions)
    device: DeviceFeed = field(default_factory=DeviceFeed)
    resume: ResumePolicy = field(default_factory=ResumePolicy)

    def __post_init__(self) -> None:
        where = "reads torch.distributed's (or 0 of 1 without a process group)"
        _fix(self, "rank", _counts(0), f"rank=None {where}", label="rank")
        _fix(self, "world_size", _counts(1), f"world_size=None {where}", label="world_size")
        _fix(
            self,
            "total_samples",
            _counts(0),
            "a step end, or None to run on, epoch after epoch",
            label="total_samples",
        )
        if self.transform is not None and not callable(self.transform):
            raise ConfigError(
                f"transform must be callable or None, got {type(self.transform).__name__} "
                f"{self.transform!r:.60}; hint: transform=fn with fn(sample, rng) -> dict"
            )
        if self.transform_id is not None and (
            not isinstance(self.transform_id, str) or not self.transform_id
        ):
            raise ConfigError(
                f"transform_id must be a non-empty string naming the transform's version, got "
                f"{self.transform_id!r}; hint: transform_id='tokenize-v3'"
            )
        if self.trace is not None:
            _of_type("trace", self.trace, (str, os.PathLike), "a path", "trace='run/trace.jsonl'")
        for name, kind, example in (
            ("read", ReadOptions, "read=ReadOptions(batches_ahead=16)"),
            ("device", DeviceFeed, "device=DeviceFeed(device='cuda')"),
            ("resume", ResumePolicy, "resume=ResumePolicy(allow=['global_batch_size'])"),
        ):
            _of_type(
                f"LoaderOptions.{name}",
                getattr(self, name),
                kind,
                f"a detdata.{kind.__name__}",
                example,
            )
