"""The optimizer step as a unit of the loader state (docs/design.md section 5).

A trainer with gradient accumulation takes an optimizer step every ``global_batch /
(micro_batch * world_size)`` micro batches. A state saved between two of those micro batches
(a ``torch.distributed.checkpoint`` save in the middle of accumulation, an
exception-time checkpoint) counts samples whose gradients live only in ``.grad``, which no
state dict carries. The state says where in its step it was saved (`StepPosition`, the state's
``step_position``), and a resume from inside a step re-delivers the whole step by default
(`MidStep.REDO`); continuing after the delivered part (`MidStep.CONTINUE`) is asked for by
name, by a caller that saved the partial gradients too. ``step_position`` is derived from
``samples_consumed`` and ``history`` (for the reader of a state); a resume derives it again.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Final

from detdata.base.errors import ConfigError
from detdata.base.redact import get_logger
from detdata.loading.history import Plan

K_STEP_POSITION: Final = "step_position"

log: Final = get_logger("detdata.loader")


class MidStep(str, enum.Enum):
    """What a resume from a state saved inside a global step does.

    ``REDO`` (default): resume at the step's first position, so the step is delivered whole
    again (its partial gradients were not saved: an optimizer step over part of it would train
    on a short batch and the delivered part would never reach an update). ``CONTINUE``: resume
    at the saved position, right after the delivered part (the caller restored the partial
    gradients, or accepts a short step knowingly).
    """

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


@dataclass(frozen=True, kw_only=True)
class StepPosition:
    """Where ``samples_consumed`` lies in the run's global steps."""

    step: int
    first_position: int
    global_batch_size: int
    delivered_in_step: int

    @property
    def inside(self) -> bool:
        """Part of the step was delivered (the state was saved between two micro batches of it)."""
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
        return {
            "step": self.step,
            "first_position": self.first_position,
            "global_batch_size": self.global_batch_size,
            "delivered_in_step": self.delivered_in_step,
        }

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
