"""A `DataLoader`'s state and its resume: ``state_dict`` and ``load_state_dict``.

The state is the samples delivered plus identity, layout and environment (`LoaderState`).
A resume checks the saved identity fields against this loader's (over a saved mixture: its
mixture continued from the saved one, the mixture in force; a difference is refused unless
allowed by name), places the saved position on a step of the saved run's history
(`MidStep`), continues that history with this loader's schedule and layout, and applies an
allowed mixture or exclusion change from the saved position on.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any, Final

from detdata.base.checks import check_count
from detdata.base.errors import ConfigError, StateError
from detdata.base.redact import get_logger
from detdata.datasets.base import Stream
from detdata.datasets.capabilities import ChecksContinuation, ContinuesFrom
from detdata.loading.history import Plan
from detdata.loading.layout import Layout
from detdata.loading.loader_base import LoaderBase
from detdata.loading.state import (
    K_EXCLUSIONS,
    K_GLOBAL_BATCH,
    K_MIXTURE,
    K_SEED,
    LoaderState,
    check_allow,
    environment,
    mismatch_message,
)
from detdata.loading.steps import MidStep, parse_mid_step

_LOG: Final = get_logger("detdata")


class Resume(LoaderBase):
    """``state_dict`` / ``load_state_dict`` of a `DataLoader`."""

    def state_dict(self) -> dict[str, Any]:
        """JSON-serialisable state: samples delivered plus identity, layout and environment."""
        layout = {
            "world_size": self.layout.world_size,
            "micro_batch_size": self.layout.micro_batch_size,
            "num_workers": self.num_workers,
            "worker_mode": self.worker_mode.value,
        }
        state = LoaderState(
            samples_consumed=self._consumed,
            fields=self._fields(),
            stream=self._stream.identity(),
            layout=layout,
            env=environment(),
            history=tuple(self._plan.to_json()),
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
        """Resume at the saved position in O(1).

        A state saved inside a global step (its ``step_position`` has ``delivered_in_step``
        > 0: a checkpoint between two micro batches of gradient accumulation) resumes by
        default at that step's first position: the whole step is delivered again, since the
        partial step's gradients are in no state dict (logged as a warning; ``mid_step="redo"``,
        `MidStep.REDO`). ``mid_step="continue"`` resumes right after the delivered part, for a
        caller that saved and restores the partial gradients too
        (``options=LoaderOptions(resume=ResumePolicy(mid_step=...))`` sets the default, for
        callers such as ``torch.distributed.checkpoint`` that call ``load_state_dict(state)``
        themselves). ``at_step`` (an integration's trainer step): resume at the first position
        of that optimizer step, the saved step or, for a state saved at the end of a step the
        trainer had not stepped yet, the one before (`LoaderState.resumed`); with an explicit
        ``mid_step="continue"`` it is a `ConfigError` (the two contradict). Live iterators are
        stale afterwards: the next batch asked of them raises `StaleIteratorError`.

        Differences in checked fields (manifests, data, seed, algorithm,
        mixture, global batch) are refused with a `StateError` listing each,
        unless named in ``allow`` (or the loader's ``ResumePolicy.allow``). Over a saved
        mixture, this loader's `Mixture` continues the saved one from the resume position
        (`Mixture.continue_from`, each source from its consumed count): the ``mixture`` field
        compared, recorded in the history and saved later is that continued mixture's (the
        mixture in force), so a later resume with the same weights changes nothing and one
        with other weights is a change from it, any number of times.
        Layout may differ if the position is a micro-step boundary of this layout within
        its step (counted from the step's first position).

        An allowed ``global_batch_size`` change (another int or `BatchSchedule`) is appended
        to the state's ``history``: the new schedule is in effect from the start of the
        saved step (a step boundary; inside a step, the new batch completes the step being
        accumulated), so every earlier step keeps its positions and ``step`` stays right;
        this loader's micro steps start at the saved position.
        """
        how = self._mid_step if mid_step is None else parse_mid_step(mid_step)
        if at_step is not None:
            _check_at_step(how if mid_step is not None else None)
            at_step = check_count(at_step, "at_step", minimum=0)
        self._bind_layout(check=False)  # `_resumed_plan` checks from the saved position
        saved = LoaderState.from_json(state_dict)
        allowed = self._allow | check_allow(allow)
        # a state saved inside a step: by default, the step's start
        saved = saved.resumed(how, at_step)
        stream, failure = self._stream_in_force(saved)
        current = self._fields(stream)
        diffs = saved.differences(current)
        refused = [d for d in diffs if d not in allowed]
        if refused:
            raise StateError(
                mismatch_message(refused, saved.fields, current), fields=tuple(refused)
            )
        if self.total_samples is not None and saved.samples_consumed > self.total_samples:
            raise StateError(
                f"saved samples_consumed {saved.samples_consumed} is beyond this loader's "
                f"total_samples {self.total_samples}"
            )
        plan, layout = self._resumed_plan(saved, K_GLOBAL_BATCH in diffs)
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
            self._check_exclusions(saved)
        if K_MIXTURE in diffs:
            self._check_mixture_change(saved, failure, diffs)
        self._stream = stream
        self._plan, self.layout = plan, layout
        self._saved_plan = Plan(saved.plan.entries, plan.changes)
        self._consumed = saved.samples_consumed
        if self._trace is not None:
            self._trace.restore(self._consumed)
        self._supersede("load_state_dict() moved the loader")
        self._torch_loader = None

    def _resumed_plan(self, saved: LoaderState, changed: bool) -> tuple[Plan, Layout]:
        """The saved run's history continued by this loader's schedule (when ``changed``) and
        layout (its micro steps from the saved position); nothing is modified."""
        position = saved.samples_consumed
        layout = self._layout_now(position)
        plan = saved.plan
        if changed:
            plan = plan.with_schedule(position, self._schedule, layout)
        try:
            self._check_layout(layout, position, plan)
        except ConfigError as exc:
            raise StateError(f"cannot resume: {exc}") from None
        if self.total_samples is not None:
            try:
                plan.check_step_end(self.total_samples)
            except ConfigError as exc:
                raise StateError(
                    f"cannot resume: {exc} (in the resumed run's steps); hint: build the "
                    "loader with total_samples=None and call set_total_samples() after "
                    "load_state_dict",
                    fields=(K_GLOBAL_BATCH,),
                ) from None
        return plan.with_layout(position, layout), layout

    def _check_exclusions(self, saved: LoaderState) -> None:
        """An allowed ``exclusions`` change may only append lists in force from the saved
        position on (`Excluded.check_continues`); anything else is a `StateError`."""
        stream = self._stream
        if not isinstance(stream, ChecksContinuation):
            raise StateError(
                "the saved state excludes samples but this loader's stream is not an "
                "Excluded stream: the excluded samples would be delivered again; hint: wrap "
                "the data in detdata.Excluded with the saved lists (and append new ones)",
                fields=(K_EXCLUSIONS,),
            )
        stream.check_continues(dict(saved.stream), saved.samples_consumed)

    def _stream_in_force(self, saved: LoaderState) -> tuple[Stream, ConfigError | None]:
        """The stream this loader delivers from the resume position on, the one definition of
        "the mixture in force": over a saved mixture, this loader's `Mixture` (as built, not
        as an earlier resume left it) continued from the saved one (`Mixture.continue_from`:
        the saved phases before the position, this loader's weights from it on; the same
        mixture when the weights in force do not change). Anything else is this loader's
        stream; so is a mixture that cannot continue the saved one (other sources or seed:
        the differences name them), returned with the reason.

        The checked fields are compared, recorded in a change and saved from this one
        stream, so a change's ``new`` value is the field every later state holds, and a
        later resume with the same definition is no change at all."""
        definition = self._data
        if saved.fields.get(K_MIXTURE) is None or not isinstance(definition, ContinuesFrom):
            return self._stream, None
        try:
            return definition.continue_from(dict(saved.stream), saved.samples_consumed), None
        except ConfigError as exc:
            return self._stream, exc

    def _check_mixture_change(
        self, saved: LoaderState, failure: ConfigError | None, diffs: list[str]
    ) -> None:
        """An allowed ``mixture`` change continues the saved mixture (`StateError` naming why
        it cannot)."""
        if saved.fields.get(K_MIXTURE) is None:
            return  # a mixture where the saved run had none: other data, refused by name
        if not isinstance(self._data, ContinuesFrom):
            raise StateError(
                "the saved state has a mixture but this loader's data is not a Mixture",
                fields=(K_MIXTURE,),
            )
        if K_SEED in diffs:
            raise StateError(
                "cannot change the mixture and the seed in the same resume", fields=(K_SEED,)
            )
        if failure is not None:
            raise StateError(
                f"allowed mixture change cannot be applied: {failure}", fields=(K_MIXTURE,)
            )


def _check_at_step(mid_step: MidStep | None) -> None:
    """``at_step`` names the step whose first position the resume starts at; an explicit
    ``mid_step="continue"`` (resume after the delivered part) contradicts it."""
    if mid_step is MidStep.CONTINUE:
        raise ConfigError(
            "load_state_dict(at_step=..., mid_step='continue') contradicts itself: at_step "
            "resumes at the first position of that optimizer step (the step re-delivered "
            "whole), mid_step='continue' right after the part of the step delivered before the "
            "save; hint: pass at_step alone (a trainer's restored step) or mid_step='continue' "
            "alone (the partial step's gradients were saved too)"
        )
