"""`DeterministicBatchSampler`: detdata's position logic for loaders you keep.

Pass it as ``batch_sampler=`` to ``torch.utils.data.DataLoader`` or torchdata's
``StatefulDataLoader`` over your own map-style dataset. Each item is this
rank's micro batch as a list of sample ids, exactly the ids detdata's own
DataLoader would read at those positions (docs/design.md sections 2 and 4). Given a
`Mixture` instead of a sample count, each item is a list of
``(source_name, sample_id)`` pairs (section 3), for a dataset that dispatches by source.

State is the same one integer: global samples consumed. ``StatefulDataLoader``
snapshots the sampler when it dispatches a batch, so its saved state matches
the batches it delivered. With the vanilla DataLoader (which prefetches and
keeps no state) use `state_after(batches_delivered)`.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any, Final

from detdata.base.checks import check_count, check_seed
from detdata.base.errors import ConfigError, StateError
from detdata.base.types import MAX_POSITION, IntArray
from detdata.datasets.mixture import Mixture
from detdata.loading.layout import Layout, process_group_rank_world
from detdata.order.feistel import ALGORITHM, GlobalOrder

SAMPLER_KIND: Final = "detdata.sampler_state"
SAMPLER_VERSION: Final = 1
_CHECKED: Final = ("seed", "num_samples", "mixture", "algorithm", "global_batch_size")


class DeterministicBatchSampler:
    """Yields lists of sample ids: this rank's micro batches from ``samples_consumed`` on."""

    def __init__(
        self,
        num_samples: int | Mixture,
        *,
        global_batch_size: int,
        micro_batch_size: int | None = None,
        seed: int | None = None,
        rank: int | None = None,
        world_size: int | None = None,
        total_samples: int | None = None,
    ) -> None:
        default_rank, default_world = process_group_rank_world()
        self.mixture: Mixture | None = None
        self.order: GlobalOrder | None = None
        if isinstance(num_samples, Mixture):
            if seed is not None and seed != num_samples.seed:
                raise ConfigError(
                    f"DeterministicBatchSampler: seed={seed!r} would be ignored: a "
                    f"Mixture orders its sources with its own seed ({num_samples.seed}); "
                    "hint: drop seed=, or build the Mixture with seed="
                    f"{seed!r}"
                )
            self.mixture, self.seed = num_samples, num_samples.seed
        else:
            self.seed = check_seed(0 if seed is None else seed)
            self.order = GlobalOrder(num_samples, self.seed)
        self.layout = Layout.create(
            global_batch_size,
            micro_batch_size,
            default_world if world_size is None else world_size,
            default_rank if rank is None else rank,
        )
        self.total_samples = (
            None
            if total_samples is None
            else check_count(total_samples, "total_samples", minimum=0)
        )
        self._start = 0
        self._yielded = 0  # micro batches yielded by the current iterator

    @property
    def samples_consumed(self) -> int:
        """Global position after the micro batches yielded so far."""
        return self._start + self._yielded * self.layout.samples_per_micro_step

    def _items(self, positions: IntArray) -> list[Any]:
        if self.order is not None:
            return list(self.order.ids(positions).tolist())
        if self.mixture is None:
            raise ConfigError("DeterministicBatchSampler has neither an order nor a mixture")
        src, _, ids = self.mixture.locate(positions)
        names = self.mixture.source_names
        return [(names[s], i) for s, i in zip(src.tolist(), ids.tolist(), strict=True)]

    def __iter__(self) -> Iterator[list[Any]]:
        self._start = self.samples_consumed
        self._yielded = 0
        per = self.layout.samples_per_micro_step
        j = self._start // per
        while self.total_samples is None or j * per < self.total_samples:
            items = self._items(self.layout.positions(j))
            self._yielded += 1
            j += 1
            yield items

    def __len__(self) -> int:
        if self.total_samples is None:
            raise TypeError("infinite sampler (total_samples=None) has no length")
        return max(
            0, (self.total_samples - self.samples_consumed) // self.layout.samples_per_micro_step
        )

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
            "global_batch_size": self.layout.global_batch_size,
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
        self.layout.check_resume_position(consumed)
        self._start, self._yielded = consumed, 0
