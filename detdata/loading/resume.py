"""The checks of a resume (`Cursor.load_state_dict`), as pure functions of what they are
given: the stream in force (`stream_in_force`), the resumed history (`resumed_plan`) and the
refusals of an allowed mixture or exclusion change. Nothing here modifies anything.
"""

from __future__ import annotations

from detdata.base.errors import ConfigError, StateError
from detdata.datasets.base import Dataset, Stream
from detdata.datasets.capabilities import ContinuesFrom
from detdata.datasets.exclusions import Excluded
from detdata.loading import reweighting
from detdata.loading.history import Plan
from detdata.loading.layout import Layout
from detdata.loading.state import K_EXCLUSIONS, K_GLOBAL_BATCH, K_MIXTURE, K_SEED, LoaderState
from detdata.loading.steps import MidStep
from detdata.order.batches import BatchSchedule


def resumed_plan(
    saved: LoaderState, schedule: BatchSchedule | None, layout: Layout, total: int | None
) -> Plan:
    """The saved run's history continued by ``schedule`` (None: the saved one continues) and
    by ``layout`` from the saved position; `StateError` when ``layout`` cannot continue there
    or ``total`` (the loader's ``total_samples``) is not a step end of the resumed run."""
    position = saved.samples_consumed
    plan = saved.plan
    if schedule is not None:
        plan = plan.with_schedule(position, schedule, layout)
    try:
        plan.check_continues(layout, position)
    except ConfigError as exc:
        raise StateError(f"cannot resume: {exc}") from None
    if total is not None:
        try:
            plan.check_step_end(total)
        except ConfigError as exc:
            raise StateError(
                f"cannot resume: {exc} (in the resumed run's steps); hint: build the "
                "loader with total_samples=None and call set_total_samples() after "
                "load_state_dict",
                fields=(K_GLOBAL_BATCH,),
            ) from None
    return plan.with_layout(position, layout)


def check_exclusions(stream: Stream, failure: ConfigError | StateError | None) -> None:
    """An allowed ``exclusions`` change may only append lists in force from the saved
    position on (``failure``: `stream_in_force`'s refusal); else a `StateError`."""
    if not isinstance(stream, Excluded):
        raise StateError(
            "the saved state excludes samples but this loader's stream is not an "
            "Excluded stream: the excluded samples would be delivered again; hint: wrap "
            "the data in detdata.Excluded with the saved lists (and append new ones)",
            fields=(K_EXCLUSIONS,),
        )
    if failure is not None:
        raise failure


def stream_in_force(
    data: Dataset | Stream, stream: Stream, saved: LoaderState
) -> tuple[Stream, ConfigError | StateError | None]:
    """The stream a loader over ``data`` (reading ``stream`` now) delivers from the resume
    position on: the one definition of "the mixture in force". ``data`` that continues the
    saved stream (`ContinuesFrom.continue_from`: a `Mixture` with the saved phases before
    the position and its weights after, an `Excluded` appending lists) is that
    continuation; otherwise ``stream``, with the reason when it cannot continue. The saved
    history's weight changes are replayed first, so a resume needs no controller."""
    changes = reweighting.recorded(saved.plan)
    if changes:  # weights changed during the saved run: its trajectory, replayed
        replayed = reweighting.replay(stream, changes)
        data = replayed if data is stream else reweighting.replay(data, changes)
        stream = replayed
    if not isinstance(data, ContinuesFrom):
        return stream, None
    try:
        return data.continue_from(dict(saved.stream), saved.samples_consumed), None
    except (ConfigError, StateError) as exc:
        return stream, exc


def check_mixture_change(
    data: Dataset | Stream,
    saved: LoaderState,
    failure: ConfigError | StateError | None,
    diffs: list[str],
) -> None:
    """An allowed ``mixture`` change continues the saved mixture (`StateError` naming why
    it cannot)."""
    if saved.fields.get(K_MIXTURE) is None:
        return  # a mixture where the saved run had none: other data, refused by name
    if not isinstance(data, ContinuesFrom):
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


def check_at_step(mid_step: MidStep | None) -> None:
    """An explicit ``mid_step="continue"`` contradicts ``at_step`` (`ConfigError`)."""
    if mid_step is MidStep.CONTINUE:
        raise ConfigError(
            "load_state_dict(at_step=..., mid_step='continue') contradicts itself: at_step "
            "resumes at the first position of that optimizer step (the step re-delivered "
            "whole), mid_step='continue' right after the part of the step delivered before the "
            "save; hint: pass at_step alone (a trainer's restored step) or mid_step='continue' "
            "alone (the partial step's gradients were saved too)"
        )
