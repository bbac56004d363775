"""A `DataLoader`'s state and its resume: ``state_dict`` and ``load_state_dict``.

The state is the samples delivered plus identity, layout and environment (`LoaderState`).
A resume checks the saved identity fields against this loader's (a difference is refused
unless allowed by name), places the saved position on a step of the saved run's history
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
        trainer had not stepped yet, the one before (`LoaderState.resumed`). Live iterators are
        stale afterwards: the next batch asked of them raises `StaleIteratorError`.

        Differences in checked fields (manifests, data, seed, algorithm,
        mixture, global batch) are refused with a `StateError` listing each,
        unless named in ``allow`` (or the loader's ``ResumePolicy.allow``). An allowed
        mixture change continues each source from its consumed count (`Mixture.continue_from`).
        Layout may differ if the position is a micro-step boundary of this layout within
        its step (counted from the step's first position).

        An allowed ``global_batch_size`` change (another int or `BatchSchedule`) is appended
        to the state's ``history``: the new schedule is in effect from the start of the
        saved step (a step boundary; inside a step, the new batch completes the step being
        accumulated), so every earlier step keeps its positions and ``step`` stays right;
        this loader's micro steps start at the saved position.
        """
        how = self._mid_step if mid_step is None else parse_mid_step(mid_step)
        self._bind_layout(check=False)  # `_resumed_plan` checks from the saved position
        saved = LoaderState.from_json(state_dict)
        allowed = self._allow | check_allow(allow)
        current = self._fields()
        diffs = saved.differences(current)
        refused = [d for d in diffs if d not in allowed]
        if refused:
            raise StateError(
                mismatch_message(refused, saved.fields, current), fields=tuple(refused)
            )
        if at_step is not None:
            at_step = check_count(at_step, "at_step", minimum=0)
        # a state saved inside a step: by default, the step's start
        saved = saved.resumed(how, at_step)
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
        if K_MIXTURE in diffs and saved.fields.get(K_MIXTURE) is not None:
            self._stream = self._continue_mixture(saved, diffs)
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

    def _continue_mixture(self, saved: LoaderState, diffs: list[str]) -> Stream:
        current = self._stream
        if not isinstance(current, ContinuesFrom):
            raise StateError(
                "the saved state has a mixture but this loader's data is not a Mixture",
                fields=(K_MIXTURE,),
            )
        if K_SEED in diffs:
            raise StateError(
                "cannot change the mixture and the seed in the same resume", fields=(K_SEED,)
            )
        try:
            stream = current.continue_from(dict(saved.stream), saved.samples_consumed)
        except ConfigError as exc:
            raise StateError(
                f"allowed mixture change cannot be applied: {exc}", fields=(K_MIXTURE,)
            ) from None
        return stream
