"""Batch samplers with detdata's positions for loaders you keep (docs/design.md sections 2-4, 7).

`DeterministicBatchSampler`: ``batch_sampler=`` of ``torch.utils.data.DataLoader`` or
torchdata's ``StatefulDataLoader`` over your own map-style dataset; each item is this rank's
micro batch as the sample ids (or, over a `Mixture`, ``(source_name, sample_id)`` pairs)
detdata's own DataLoader would read. Its state is one integer, global samples consumed
(``StatefulDataLoader`` snapshots it per dispatched batch; with torch's DataLoader use
`state_after`). `FrameworkBatchSampler`: for a framework that shards the batches itself.
"""

from __future__ import annotations

import sys
from collections.abc import Iterator, Mapping
from types import FrameType
from typing import Any, Final

import numpy as np

from detdata.base.checks import check_count, check_seed
from detdata.base.errors import ConfigError, StateError
from detdata.base.types import MAX_POSITION, IntArray
from detdata.datasets.mixture import Mixture
from detdata.loading import frameworks
from detdata.loading.history import Plan, as_schedule
from detdata.loading.layout import Layout, Placement, process_group_rank_world
from detdata.loading.steps import RunSteps
from detdata.order.batches import BatchSchedule
from detdata.order.feistel import ALGORITHM, GlobalOrder

SAMPLER_KIND: Final = "detdata.sampler_state"
SAMPLER_VERSION: Final = 1
_CHECKED: Final = ("seed", "num_samples", "mixture", "algorithm", "global_batch_size")
_CHUNK_POSITIONS: Final = 1 << 14  # FrameworkBatchSampler: positions whose ids one call computes

_FRAMEWORK_HINT: Final = (
    "with accelerate: sampler = detdata.DeterministicBatchSampler.sharded_by_framework(...) "
    "and Accelerator(dataloader_config=DataLoaderConfiguration(split_batches=True, "
    "use_stateful_dataloader=True))"
)


class _Ids:
    """Sample ids (or ``(source, id)`` pairs of a `Mixture`) at global positions."""

    def __init__(self, num_samples: int | Mixture, seed: int | None, who: str) -> None:
        self.mixture: Mixture | None = None
        self.order: GlobalOrder | None = None
        if isinstance(num_samples, Mixture):
            if seed is not None and seed != num_samples.seed:
                raise ConfigError(
                    f"{who}: seed={seed!r} would be ignored: a "
                    f"Mixture orders its sources with its own seed ({num_samples.seed}); "
                    "hint: drop seed=, or build the Mixture with seed="
                    f"{seed!r}"
                )
            self.mixture, self.seed = num_samples, num_samples.seed
        else:
            self.seed = check_seed(0 if seed is None else seed)
            self.order = GlobalOrder(num_samples, self.seed)

    def items(self, positions: IntArray) -> list[Any]:
        if self.order is not None:
            return list(self.order.ids(positions).tolist())
        assert self.mixture is not None  # one of the two, by construction
        src, _, ids = self.mixture.locate(positions)
        names = self.mixture.source_names
        return [(names[s], i) for s, i in zip(src.tolist(), ids.tolist(), strict=True)]


def _dealer(sampler: object) -> Any:
    """The object that called ``iter(sampler)`` (the ``self`` of the frame that called the
    ``__iter__`` calling this) if it deals the items to several processes (holds it as
    ``.batch_sampler``, has ``num_processes > 1``: accelerate's ``BatchSamplerShard``), else
    None."""
    try:
        frame: FrameType | None = sys._getframe(2)
    except ValueError:  # called from C with no Python frame below
        frame = None
    owner = None if frame is None else frame.f_locals.get("self")
    processes = getattr(owner, "num_processes", None)
    if (
        owner is not None
        and owner is not sampler
        and getattr(owner, "batch_sampler", None) is sampler
        and isinstance(processes, int)
        and processes > 1
    ):
        return owner
    return None


def _check_total(total_samples: int | None) -> int | None:
    if total_samples is None:
        return None
    return check_count(total_samples, "total_samples", minimum=0)


class FrameworkBatchSampler:
    """The run's global micro steps, whole, for a framework that shards them itself.

    Item ``j`` is the ids at global positions ``[j * batch_size, (j + 1) * batch_size)`` at
    every world size; split into consecutive slices in rank order (accelerate's
    ``split_batches=True``), process ``r`` gets exactly what detdata's DataLoader gives rank
    ``r`` with micro batch ``batch_size // world_size``. The framework keeps the position:
    every ``iter()`` starts at the run's beginning and a resumed ``StatefulDataLoader``
    skips the items delivered (the same samples at any world size; skipping reads no data).
    No ``state_dict`` on purpose: torchdata would ask it for a state a world size > 1 never
    saved instead of skipping. One pass covers the run (``total_samples``, else unbounded).
    Iterated at world size > 1 unsplit, or dealt whole to processes
    (``split_batches=False``), it is a `ConfigError`.
    """

    def __init__(
        self,
        num_samples: int | Mixture,
        *,
        global_batch_size: int,
        batch_size: int,
        seed: int | None = None,
        total_samples: int | None = None,
    ) -> None:
        if isinstance(global_batch_size, BatchSchedule):
            raise ConfigError(
                "FrameworkBatchSampler takes one global batch, not a BatchSchedule: the "
                "framework that shards its items counts a fixed number of items per step "
                "(accelerate's gradient_accumulation_steps); hint: use "
                "DeterministicBatchSampler (this rank's slice) or detdata.DataLoader with "
                "the schedule"
            )
        self._ids = _Ids(num_samples, seed, "FrameworkBatchSampler")
        self.seed = self._ids.seed
        #: ids per item, one micro step of all processes together (a divisor of the global batch)
        self.batch_size = Layout.create(global_batch_size, batch_size, 1, 0).micro_batch_size
        self.global_batch_size = check_count(global_batch_size, "global_batch_size")
        self.total_samples = _check_total(total_samples)
        frameworks.built()  # e.g. accelerate's load_state without use_stateful_dataloader

    @property
    def drop_last(self) -> bool:
        """Always True (read-only): every item is a full micro step."""
        return True

    @property
    def sampler(self) -> None:
        """None: positions come from detdata's layout, not from a torch sampler."""
        return None

    def set_epoch(self, epoch: int) -> None:
        """No-op: one pass covers the whole run."""
        del epoch

    def __len__(self) -> int:
        """Items in the run: ``total_samples // batch_size``, or ``2**62 // batch_size``."""
        total = MAX_POSITION if self.total_samples is None else self.total_samples
        return total // self.batch_size

    def __iter__(self) -> Iterator[list[Any]]:
        """The run's items from its first (`ConfigError`: see the class)."""
        dealer = _dealer(self)
        _, world = process_group_rank_world()
        if world > 1 and dealer is None:
            raise ConfigError(
                f"FrameworkBatchSampler yields whole micro steps for a framework to split, "
                f"but it is iterated in a process group of {world} with nobody splitting "
                "them: every process would train on the same rows; hint: prepare the "
                f"DataLoader with the framework ({_FRAMEWORK_HINT}), or use "
                "DeterministicBatchSampler(...), which yields this rank's slice"
            )
        if dealer is not None and getattr(dealer, "split_batches", None) is not True:
            raise ConfigError(
                f"{type(dealer).__name__} deals whole FrameworkBatchSampler items to "
                f"{dealer.num_processes} processes (split_batches=False): the batch count "
                "the framework saves would then stand for other samples when the world size "
                "changes; hint: split each item among the processes: "
                f"{_FRAMEWORK_HINT}"
            )
        return self._generate()

    def _generate(self) -> Iterator[list[Any]]:
        """Items in order, ids computed for `_CHUNK_POSITIONS` positions at once (a framework
        skipping delivered items on resume skips ~100x faster)."""
        per, items = self.batch_size, len(self)
        chunk = max(1, _CHUNK_POSITIONS // per)
        for first in range(0, items, chunk):
            count = min(chunk, items - first)
            ids = self._ids.items(np.arange(first * per, (first + count) * per, dtype=np.int64))
            for i in range(count):
                yield ids[i * per : (i + 1) * per]


class DeterministicBatchSampler(RunSteps):
    """Yields lists of sample ids: this rank's micro batches from ``samples_consumed`` on.

    A ``BatchSampler``'s surface (``batch_size``, ``drop_last``, ``sampler``, a constant
    ``len()``, a no-op ``set_epoch``); infinite unless ``total_samples`` is given, and a new
    ``iter()`` continues at ``samples_consumed``.
    """

    def __init__(
        self,
        num_samples: int | Mixture,
        *,
        global_batch_size: int | BatchSchedule,
        micro_batch_size: int | None = None,
        seed: int | None = None,
        rank: int | None = None,
        world_size: int | None = None,
        total_samples: int | None = None,
    ) -> None:
        self._ids = _Ids(num_samples, seed, "DeterministicBatchSampler")
        self.mixture, self.order, self.seed = self._ids.mixture, self._ids.order, self._ids.seed
        self._schedule = as_schedule(global_batch_size)
        constant = self._schedule.changes[0][1] if self._schedule.is_constant else None
        self._placement = Placement(constant, micro_batch_size, rank, world_size)
        self.layout = self._placement.layout_at(0)
        self._plan = Plan.fresh(self._schedule, self.layout)
        self._plan.check_settles(self.layout)
        self.total_samples = _check_total(total_samples)
        self._start = 0
        self._yielded = 0  # micro batches yielded by the current iterator
        frameworks.built()  # a framework integration watches the calls the user makes

    #: the run's whole micro steps, for a framework that splits each among its processes
    sharded_by_framework = FrameworkBatchSampler

    def _bind(self, consumed: int) -> None:
        """Continue at ``consumed`` with rank and world size re-read from torch.distributed: a
        micro-step boundary of its step whose every later global batch divides into micro
        steps (`StateError` / `ConfigError` otherwise)."""
        layout = self._placement.layout_at(consumed)
        self._plan.check_continues(layout, consumed)
        self.layout, self._start, self._yielded = layout, consumed, 0

    @property
    def _steps_plan(self) -> Plan:
        return self._plan

    # ------------------------------------------------------ BatchSampler surface
    @property
    def batch_size(self) -> int:
        """Ids per item: this rank's micro batch."""
        return self.layout.micro_batch_size

    @property
    def sampler(self) -> None:
        """None: positions come from detdata's layout, not from a torch sampler."""
        return None

    def set_epoch(self, epoch: int) -> None:
        """No-op: the order is a function of the global position, not of an epoch counter."""
        del epoch

    def __len__(self) -> int:
        """Micro batches of this rank per epoch: a constant, all of ``total_samples``, one
        pass over ``num_samples`` (at least 1), or ``2**62`` samples' worth for a `Mixture`."""
        per = self.layout.samples_per_micro_step
        if self.total_samples is not None:
            return self.total_samples // per
        if self.order is not None:  # one pass over the dataset (a `Mixture` has no epoch)
            return max(1, int(self.order.num_samples) // per)
        return MAX_POSITION // per

    # ------------------------------------------------------------- iteration
    @property
    def samples_consumed(self) -> int:
        """Global position after the micro batches yielded so far."""
        return self._start + self._yielded * self.layout.samples_per_micro_step

    def __iter__(self) -> Iterator[list[Any]]:
        """This rank's micro batches from ``samples_consumed`` on (rank and world size re-read
        here); `ConfigError` when the caller deals them to several processes again."""
        dealer = _dealer(self)
        self._bind(self.samples_consumed)  # counted with the layout they were yielded with
        if dealer is not None:
            raise ConfigError(
                f"DeterministicBatchSampler yields rank {self.layout.rank}'s micro batches "
                f"of a world of {self.layout.world_size} already; {type(dealer).__name__} "
                f"deals them to {dealer.num_processes} processes again, so each process "
                "would train on a fraction of its slice and whole micro batches would "
                f"never be used; hint: let the framework shard: {_FRAMEWORK_HINT}"
            )
        return self._generate(self._start // self.layout.samples_per_micro_step)

    def _generate(self, j: int) -> Iterator[list[Any]]:
        per, offset = self.layout.samples_per_micro_step, self.layout.offset
        while self.total_samples is None or (j + 1) * per + offset <= self.total_samples:
            items = self._ids.items(self.layout.positions(j))
            self._yielded += 1
            j += 1
            yield items

    # ----------------------------------------------------------------- state
    def _state(self, consumed: int) -> dict[str, Any]:
        return {
            "kind": SAMPLER_KIND,
            "format_version": SAMPLER_VERSION,
            "samples_consumed": consumed,
            "seed": self.seed,
            "num_samples": None if self.order is None else self.order.num_samples,
            "mixture": None if self.mixture is None else self.mixture.fingerprint(),
            "algorithm": ALGORITHM
            if self.mixture is None
            else f"{ALGORITHM}+{self.mixture.algorithm}",
            "global_batch_size": self._schedule.to_json(),
            "layout": {
                "world_size": self.layout.world_size,
                "micro_batch_size": self.layout.micro_batch_size,
            },
        }

    def state_dict(self) -> dict[str, Any]:
        """State after the micro batches this sampler has yielded (use with StatefulDataLoader)."""
        return self._state(self.samples_consumed)

    def state_after(self, batches_delivered: int) -> dict[str, Any]:
        """State after ``batches_delivered`` micro batches of the current iterator reached the
        caller."""
        n = check_count(batches_delivered, "batches_delivered", minimum=0)
        return self._state(self._start + n * self.layout.samples_per_micro_step)

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Resume at the saved position; checked fields must match (listed when they don't)."""
        if not isinstance(state, Mapping) or state.get("kind") != SAMPLER_KIND:
            raise StateError(f"not a detdata sampler state (kind must be {SAMPLER_KIND!r})")
        if state.get("format_version") != SAMPLER_VERSION:
            raise StateError(
                f"unknown sampler state format_version {state.get('format_version')!r}"
            )
        current = self._state(0)
        diffs = [k for k in _CHECKED if state.get(k) != current[k]]
        if diffs:
            detail = "; ".join(
                f"{k}: saved {state.get(k)!r}, current {current[k]!r}" for k in diffs
            )
            raise StateError(f"sampler state does not match: {detail}", fields=tuple(diffs))
        consumed = state.get("samples_consumed")
        if (
            isinstance(consumed, bool)
            or not isinstance(consumed, int)
            or not 0 <= consumed < MAX_POSITION
        ):
            raise StateError(
                f"sampler state field 'samples_consumed' must be an integer in "
                f"[0, 2**62), found {consumed!r}",
                fields=("samples_consumed",),
            )
        if self.total_samples is not None and consumed > self.total_samples:
            raise StateError(
                f"sampler state samples_consumed {consumed} is beyond this sampler's "
                f"total_samples {self.total_samples}; hint: resume with the "
                "total_samples the state was saved with",
                fields=("samples_consumed",),
            )
        self._bind(consumed)  # rank and world size bound now, as at iteration
