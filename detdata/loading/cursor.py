"""Where a `DataLoader` stands in its run: the `Cursor`, the one owner of the loader's
position (iteration advances it, ``state_dict`` saves it, ``load_state_dict`` moves it with
the checks of `detdata.loading.resume`), over the immutable `Definition` of what it reads.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any, Final

from detdata.base.checks import check_count
from detdata.base.errors import ConfigError, StaleIteratorError, StateError
from detdata.base.redact import get_logger
from detdata.base.types import IntArray
from detdata.datasets.base import Dataset, Stream
from detdata.datasets.exclusions import Excluded
from detdata.datasets.streams import as_stream
from detdata.loading import resume, reweighting
from detdata.loading.attest import Attestation, Attestor, Pending
from detdata.loading.history import Plan
from detdata.loading.identity_diff import first_difference
from detdata.loading.layout import Layout, Placement
from detdata.loading.options import ResumePolicy
from detdata.loading.state import (
    CHECKED_FIELDS,
    K_ALGORITHM,
    K_DATA,
    K_EXCLUSIONS,
    K_GLOBAL_BATCH,
    K_MANIFESTS,
    K_MIXTURE,
    K_SEED,
    K_STREAM_SEED,
    K_TRANSFORM,
    LoaderState,
    check_allow,
    environment,
    identity_fields,
    mismatch_message,
)
from detdata.loading.steps import MidStep, StepPosition, parse_mid_step
from detdata.loading.trace import StepSpan
from detdata.order.batches import BatchSchedule
from detdata.order.choice import OrderLike

_LOG: Final = get_logger("detdata")
#: Checked fields whose change at a resume gives earlier positions another stream.
STREAM_FIELDS: Final = (K_SEED, K_STREAM_SEED, K_MANIFESTS, K_DATA, K_ALGORITHM)
#: Allowed changes after which the samples before the saved position cannot be re-derived
#: (another stream or transform): such a resume is not attested (`Cursor._attestation_of`).
_UNATTESTABLE: Final = (*STREAM_FIELDS, K_TRANSFORM)


@dataclass(frozen=True)
class Definition:
    """What a loader reads and how its state names it; never changes after construction.

    ``stream``: ``data`` ordered with ``seed`` and ``order`` (or ``data``, a stream).
    ``wrapped``: the loader ordered a plain dataset with its seed, or an `Excluded` did with
    that same seed (so adding exclusions at a resume keeps ``stream_seed``)."""

    data: Dataset | Stream
    stream: Stream
    order: OrderLike | None
    seed: int
    schedule: BatchSchedule
    transform: str | None
    wrapped: bool

    @classmethod
    def of(
        cls,
        data: Dataset | Stream,
        *,
        seed: int,
        order: OrderLike | None,
        schedule: BatchSchedule,
        transform: str | None,
    ) -> Definition:
        stream = as_stream(data, seed, order=order)
        wrapped = stream is not data or (
            isinstance(stream, Excluded) and stream.orders_dataset is True and stream.seed == seed
        )
        return cls(data, stream, order, seed, schedule, transform, wrapped)

    def fields(self, stream: Stream, seed: int | None = None) -> dict[str, Any]:
        """The checked identity fields of this loader reading ``stream`` with ``seed`` (None:
        the loader's)."""
        identity = stream.identity()
        return identity_fields(
            identity,
            self.seed if seed is None else seed,
            self.schedule.to_json(),
            stream_seed=None if self.wrapped else identity.get("seed"),
            transform=self.transform,
        )


class Cursor:
    """The position of a loader in its run and what moves with it: ``samples_consumed``, the
    run's `Plan`, this rank's `Layout` (re-read at `bind`), the stream in force, the bound
    ``total_samples`` and the generation that makes superseded iterators stale."""

    def __init__(
        self,
        definition: Definition,
        placement: Placement,
        *,
        total_samples: int | None,
        policy: ResumePolicy,
    ) -> None:
        self.definition = definition
        self._placement = placement
        self._policy = policy
        self._layout = placement.layout_at(0)
        self._plan = Plan.fresh(definition.schedule, self._layout)
        self._plan.check_settles(self._layout)
        self._consumed = 0
        self.set_total_samples(total_samples)
        self._saved_plan: Plan | None = None  # the history of the state loaded last, as saved
        self._stream = definition.stream
        self._generation = 0
        self._superseded = ""  # what ended the iterators of earlier generations
        self._pending: Pending | None = None  # the loaded state's attestation, not yet passed
        self._controller: reweighting.MixtureController | None = None
        self._asked = -1  # the position whose step the controller was asked for last

    # ------------------------------------------------------------- read-only
    @property
    def samples_consumed(self) -> int:
        return self._consumed

    @property
    def layout(self) -> Layout:
        return self._layout

    @property
    def plan(self) -> Plan:
        return self._plan

    @property
    def saved_plan(self) -> Plan | None:
        """The history of the state loaded last, with its layouts as saved (None: none)."""
        return self._saved_plan

    @property
    def stream(self) -> Stream:
        return self._stream

    @property
    def total_samples(self) -> int | None:
        return self._total

    @property
    def pending(self) -> Pending | None:
        """The loaded state's attestation until an iteration passed it (None: none)."""
        return self._pending

    def attested(self) -> None:
        self._pending = None

    @property
    def generation(self) -> int:
        """Incremented by `supersede`: iterators of an earlier generation are stale."""
        return self._generation

    # ------------------------------------------------------------ the run's steps
    @property
    def step(self) -> int:
        return self._plan.step_of(self._consumed)

    def step_span(self) -> StepSpan:
        """Where the next micro batch lies in the run's steps (a trace record's step fields)."""
        at = StepPosition.of(self._plan, self._consumed)
        return StepSpan(
            step=at.step,
            start=at.first_position,
            size=at.global_batch_size,
            next=self._consumed + self._layout.samples_per_micro_step,
        )

    def positions_of_next(self) -> IntArray:
        return self._layout.positions(self._consumed // self._layout.samples_per_micro_step)

    def stop(self) -> int | None:
        """``total_samples`` as a `GroupSampler` counts it: less this layout's ``offset``, as
        micro step ``j`` begins at ``j * m * D + offset``."""
        return None if self._total is None else self._total - self._layout.offset

    def whole_steps(self, samples: int) -> int:
        """Samples of the run's steps that end within ``samples`` (at least its first step)."""
        end = self._plan.start_of(self._plan.step_of(samples))
        return end if end > 0 else self._plan.start_of(1)

    # ------------------------------------------------------------ moves
    def layout_now(self) -> Layout:
        """The layout an iteration started now would bind (`bind`), not bound yet."""
        return self._placement.layout_at(self._consumed)

    def bind(self, *, check: bool = True) -> None:
        """Re-read rank and world size (an iteration starts). With ``check``, the layout must
        fit every global batch from ``samples_consumed`` on (`ConfigError` naming the first
        that does not)."""
        layout = self.layout_now()
        if check:
            self._plan.check_continues(layout, self._consumed)
        if layout != self._layout:
            self._layout = layout
            self._plan = self._plan.with_layout(self._consumed, layout)

    def advance(self) -> None:
        self._consumed += self._layout.samples_per_micro_step

    def set_mixture_weights(self, weights: Mapping[str, Any]) -> int:
        """Put ``weights`` in force from the first position of the next global step
        (`reweighting.effect_position`), returned. Checked first (as the `Mixture`
        constructor does; equal on every rank: `reweighting.agree_across_ranks`; before
        ``total_samples``), else a `ConfigError` and nothing changes. The change becomes a
        phase of the mixture in force and joins the history (`Plan.with_weights`); an
        iteration in progress drops what it read ahead."""
        stream = reweighting.reweightable(self._stream)
        position = reweighting.effect_position(self._plan, self._consumed)
        step = self._plan.step_of(position)
        if self._total is not None and position >= self._total:
            raise ConfigError(
                f"mixture weights from step {step} (position {position}) would never take "
                f"effect: this run stops at total_samples {self._total}"
            )
        new = stream.with_mixture_weights(position, weights)
        new_weights = reweighting.weights_json(
            reweighting.reweightable(new).mixture_weights_at(position)
        )
        reweighting.agree_across_ranks(step, position, new_weights)
        old_weights = reweighting.weights_json(stream.mixture_weights_at(position))
        pending = self._plan.weight_changes()
        if new_weights != old_weights or (pending and pending[-1].position == position):
            self._plan = self._plan.with_weights(position, old_weights, new_weights)
            self._stream = new
        return position

    def ask_controller(self) -> None:
        """Before a step's first micro batch: the controller's weights for it, once."""
        if self._controller is None:
            return
        step = self._plan.step_of(self._consumed)
        if self._plan.start_of(step) != self._consumed or self._asked == self._consumed:
            return
        self._asked = self._consumed
        weights = self._controller.mixture_weights(step)
        if weights is not None:
            self.set_mixture_weights(weights)

    def set_controller(self, controller: reweighting.MixtureController | None) -> None:
        if controller is not None and not isinstance(controller, reweighting.MixtureController):
            raise ConfigError(
                f"a mixture controller needs mixture_weights(step) -> weights or None, got "
                f"{type(controller).__name__}"
            )
        if controller is not None:
            reweighting.reweightable(self._stream)
        self._controller, self._asked = controller, -1

    def set_total_samples(self, total_samples: int | None) -> None:
        """`DataLoader.set_total_samples` (`ConfigError` unless a step end at or after
        ``samples_consumed``)."""
        if total_samples is not None:
            total_samples = check_count(total_samples, "total_samples", minimum=0)
            self._plan.check_step_end(total_samples)
            if total_samples < self._consumed:
                raise ConfigError(
                    f"total_samples {total_samples} is before samples_consumed {self._consumed}"
                )
        self._total = total_samples

    def supersede(self, why: str) -> None:
        """Start a new generation: earlier iterators raise `stale` (saying ``why``)."""
        self._generation += 1
        self._superseded = why

    def stale(self) -> StaleIteratorError:
        return StaleIteratorError(
            f"this detdata.DataLoader iterator is stale: {self._superseded} after it was "
            f"created (samples_consumed is now {self._consumed}); a stale iterator would "
            "deliver batches out of order, so it stops with this error rather than ending the "
            "loop quietly; hint: iterate the new iterator (a `for batch in loader:` started "
            "after the change), and call load_state_dict before the loop, not inside it"
        )

    # ------------------------------------------------------------ the state
    def state_dict(
        self, workers: Mapping[str, Any], attestor: Attestor | None = None
    ) -> dict[str, Any]:
        """JSON state: samples delivered, identity, layout (with ``workers``), environment and
        the attestation ``attestor`` derives (None: none); a loaded attestation not yet passed
        is carried instead."""
        attestation: Attestation | None = None
        if self._pending is not None:
            attestation = self._pending.attestation
        elif attestor is not None:
            attestation = attestor.record(self._stream, self._consumed)
        layout = {
            "world_size": self._layout.world_size,
            "micro_batch_size": self._layout.micro_batch_size,
            **workers,
        }
        state = LoaderState(
            samples_consumed=self._consumed,
            fields=self.definition.fields(self._stream),
            stream=self._stream.identity(),
            layout=layout,
            env=environment(),
            history=tuple(self._plan.to_json()),
            attestation=attestation,
        )
        return state.to_json()

    def load_state_dict(
        self,
        state_dict: Mapping[str, Any] | str,
        *,
        allow: Iterable[str] = (),
        mid_step: str | MidStep | None = None,
        at_step: int | None = None,
    ) -> None:
        """`DataLoader.load_state_dict`: nothing changes unless every check passes, except the
        layout re-read from torch.distributed."""
        how = self._policy.mid_step_mode if mid_step is None else parse_mid_step(mid_step)
        if at_step is not None:
            resume.check_at_step(how if mid_step is not None else None)
            at_step = check_count(at_step, "at_step", minimum=0)
        self.bind(check=False)  # `resume.resumed_plan` checks from the saved position
        saved = LoaderState.from_json(state_dict)
        allowed = self._policy.allowed | check_allow(allow)
        saved = saved.resumed(how, at_step)  # a state saved inside a step: by default, its start
        stream, failure = resume.stream_in_force(self.definition.data, self._stream, saved)
        current = self.definition.fields(stream)
        diffs = saved.differences(current)
        refused = [d for d in diffs if d not in allowed]
        if refused:
            where = first_difference(dict(saved.stream), stream.identity())
            detail = f"\nfirst differing identity field: {where}" if where else ""
            raise StateError(
                mismatch_message(refused, saved.fields, current) + detail, fields=tuple(refused)
            )
        if self._total is not None and saved.samples_consumed > self._total:
            raise StateError(
                f"saved samples_consumed {saved.samples_consumed} is beyond this loader's "
                f"total_samples {self._total}"
            )
        layout = self._placement.layout_at(saved.samples_consumed)
        plan = resume.resumed_plan(
            saved,
            self.definition.schedule if K_GLOBAL_BATCH in diffs else None,
            layout,
            self._total,
        )
        for name in diffs:  # each allowed change joins the history, and is logged
            plan = plan.with_change(
                name, saved.samples_consumed, saved.fields.get(name), current.get(name)
            )
            _LOG.warning(
                "detdata: resume at samples_consumed=%d: %s (allowed by name)",
                saved.samples_consumed,
                plan.changes[-1].describe(),
            )
        if K_EXCLUSIONS in diffs:
            resume.check_exclusions(self._stream, failure)
        if K_MIXTURE in diffs:
            resume.check_mixture_change(self.definition.data, saved, failure, diffs)
        self._stream = stream
        self._plan, self._layout = plan, layout
        self._saved_plan = Plan(saved.plan.entries, plan.changes)
        self._consumed = saved.samples_consumed
        self._pending = self._attestation_of(saved, diffs)
        self._asked = -1  # the controller is asked again from the resumed step on
        self.supersede("load_state_dict() moved the loader")

    def _attestation_of(self, saved: LoaderState, diffs: list[str]) -> Pending | None:
        """The attestation the first iteration after this resume must pass (None: off, none
        saved, or an allowed change of what it depends on; logged)."""
        if not self._policy.attest:
            return None
        if saved.attestation is None:
            if saved.upgraded_from is not None:
                _LOG.warning(
                    "detdata: this resume is not attested: the state was saved in format %d, "
                    "before resume attestation (a state saved from now on carries one)",
                    saved.upgraded_from,
                )
            return None  # otherwise nothing was delivered before the save, or attest was off
        changed = [d for d in diffs if d in _UNATTESTABLE]
        span = saved.attestation.first + len(saved.attestation.samples)
        if not changed and span > self._consumed:  # a change takes effect at the position
            changed = [d for d in diffs if d in (K_MIXTURE, K_EXCLUSIONS)]
        if changed:
            _LOG.warning(
                "detdata: this resume is not attested: the allowed change of %s changes the "
                "samples the state attests",
                changed,
            )
            return None
        equal = tuple(f for f in CHECKED_FIELDS if f not in diffs)
        return Pending(saved.attestation, self._consumed, self.step, equal)
