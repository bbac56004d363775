"""The optimizer step as a unit of the loader state (docs/design.md section 5).

A state says where in its step it was saved (`StepPosition`, ``step_position``, derived from
``samples_consumed`` and ``history``); a resume from inside a step: `MidStep`.
"""

from __future__ import annotations

import abc
import dataclasses
import enum
from dataclasses import dataclass
from typing import Final

from detdata.base.checks import check_count
from detdata.base.errors import ConfigError
from detdata.base.redact import get_logger
from detdata.loading.history import Plan

K_STEP_POSITION: Final = "step_position"

log: Final = get_logger("detdata.loader")


class MidStep(str, enum.Enum):
    """What a resume from a state saved inside a global step does: ``REDO`` (default) resumes
    at the step's first position, re-delivering it whole (its partial gradients were not
    saved); ``CONTINUE`` right after the delivered part (the caller restored the partial
    gradients, or accepts a short step knowingly)."""

    REDO = "redo"
    CONTINUE = "continue"


def parse_mid_step(value: object, name: str = "mid_step") -> MidStep:
    """``value`` as a `MidStep` (its value string or the member); `ConfigError` otherwise."""
    try:
        return MidStep(value)
    except ValueError:
        raise ConfigError(
            f"{name} must be 'redo' (re-deliver the whole step, the default) or 'continue' "
            f"(the partial step's gradients were saved too), got {value!r}"
        ) from None


class RunSteps(abc.ABC):
    """The run's global steps as the `DataLoader` and the `DeterministicBatchSampler` answer
    them, from their `Plan` (``_steps_plan``) and ``samples_consumed``."""

    @property
    @abc.abstractmethod
    def samples_consumed(self) -> int:
        """Global samples delivered so far (all ranks), i.e. the next step's first position."""

    @property
    @abc.abstractmethod
    def _steps_plan(self) -> Plan:
        """The run's history of global batches."""

    @property
    def step(self) -> int:
        """The global step the next micro batch belongs to (from the run's history)."""
        return self._steps_plan.step_of(self.samples_consumed)

    @property
    def global_batch_size(self) -> int:
        """Global batch of the current step (`step`; constant unless a schedule)."""
        return self._steps_plan.batch_of(self.step)

    def position_of_step(self, step: int) -> int:
        """First global position of step ``step`` of this run (all ranks)."""
        return self._steps_plan.start_of(check_count(step, "step", minimum=0))

    def step_of_position(self, position: int) -> int:
        """The step global position ``position`` belongs to in this run."""
        return self._steps_plan.step_of(check_count(position, "position", minimum=0))

    @property
    def drop_last(self) -> bool:
        """True (read-only, as torch's): every delivered batch is a full micro batch."""
        return True


@dataclass(frozen=True, kw_only=True)
class StepPosition:
    """Where ``samples_consumed`` lies in the run's global steps."""

    step: int
    first_position: int
    global_batch_size: int
    delivered_in_step: int

    @property
    def inside(self) -> bool:
        """Part of the step was delivered."""
        return self.delivered_in_step > 0

    @classmethod
    def of(cls, plan: Plan, consumed: int) -> StepPosition:
        step = plan.step_of(consumed)
        first = plan.start_of(step)
        return cls(
            step=step,
            first_position=first,
            global_batch_size=plan.batch_of(step),
            delivered_in_step=consumed - first,
        )

    def to_json(self) -> dict[str, int]:
        return dataclasses.asdict(self)

    def describe(self) -> str:
        return (
            f"{self.delivered_in_step} of the {self.global_batch_size} samples of global step "
            f"{self.step} (positions [{self.first_position}, "
            f"{self.first_position + self.delivered_in_step})) were delivered"
        )


def resume_position(position: StepPosition, consumed: int, mid_step: MidStep) -> int:
    """The position a resume from ``consumed`` continues at (logged when it re-delivers)."""
    if not position.inside or mid_step is MidStep.CONTINUE:
        if position.inside:
            log.warning(
                "detdata: resuming inside a global step as asked (mid_step='continue'): %s "
                "before the state was saved; continuing at position %d",
                position.describe(),
                consumed,
            )
        return consumed
    log.warning(
        "detdata: the loader state was saved inside a global step: %s, and their gradients are "
        "not in any state dict; re-delivering step %d whole from position %d (pass "
        "mid_step='continue' to load_state_dict if the partial step's gradients were saved)",
        position.describe(),
        position.step,
        position.first_position,
    )
    return position.first_position
