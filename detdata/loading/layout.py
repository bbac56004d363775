"""Which global positions each rank reads at each micro step (docs/design.md section 4).

With ``D`` ranks and micro batch ``m``, every global batch is a multiple of ``m*D``, so a
layout's micro steps form one grid: the ``j``-th is ``j*m*D + offset + r*m + arange(m)`` on
rank ``r``, where ``offset`` (in ``[0, m*D)``) is where the layout's first step began
modulo ``m*D`` (0 for a fresh run; a resume position's for a layout bound there).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from detdata.base.checks import check_count
from detdata.base.errors import ConfigError, StateError


@dataclass(frozen=True, kw_only=True)
class Layout:
    """Micro batch and data-parallel placement of one rank, on a grid of micro steps."""

    micro_batch_size: int
    world_size: int
    rank: int
    offset: int = 0

    def __post_init__(self) -> None:
        check_count(self.micro_batch_size, "micro_batch_size")
        check_count(self.world_size, "world_size")
        check_count(self.rank, "rank", minimum=0, maximum=self.world_size - 1)
        check_count(self.offset, "offset", minimum=0, maximum=self.samples_per_micro_step - 1)

    @classmethod
    def create(
        cls,
        global_batch_size: int | None,
        micro_batch_size: int | None,
        world_size: int,
        rank: int,
        *,
        anchor: int = 0,
    ) -> Layout:
        """Layout whose micro steps include position ``anchor``; ``micro_batch_size`` defaults
        to one micro step per step of the constant ``global_batch_size`` (None, a schedule,
        needs it), which must be a multiple of ``micro_batch_size x world_size``."""
        ws = check_count(world_size, "world_size")
        gbs = (
            None
            if global_batch_size is None
            else check_count(global_batch_size, "global_batch_size")
        )
        if micro_batch_size is None:
            if gbs is None:
                raise ConfigError(
                    "a global batch schedule needs micro_batch_size= (the micro batch stays "
                    "fixed and the number of micro steps per step follows the schedule)"
                )
            if gbs % ws:
                raise ConfigError(
                    f"global_batch_size {gbs} is not divisible by world_size {ws}; "
                    "hint: pick a global batch that is a multiple of the number of ranks"
                )
            micro_batch_size = gbs // ws
        micro = check_count(micro_batch_size, "micro_batch_size")
        per = micro * ws
        if gbs is not None and gbs % per:
            raise ConfigError(
                f"global_batch_size {gbs} is not divisible by micro_batch_size "
                f"{micro} x world_size {ws} = {per}; hint: "
                "choose a micro batch (and world size) whose product divides the global batch"
            )
        anchor = check_count(anchor, "anchor", minimum=0)
        return cls(micro_batch_size=micro, world_size=ws, rank=rank, offset=anchor % per)

    @property
    def samples_per_micro_step(self) -> int:
        """Global samples consumed by one iteration on every rank (``m * D``)."""
        return self.micro_batch_size * self.world_size

    def positions(self, micro_step: int) -> npt.NDArray[np.int64]:
        """Positions of micro step ``micro_step`` of the grid on this rank."""
        start = (
            micro_step * self.samples_per_micro_step
            + self.offset
            + self.rank * self.micro_batch_size
        )
        return np.arange(start, start + self.micro_batch_size, dtype=np.int64)

    def check_resume_position(self, consumed: int, step_start: int) -> None:
        """A resume position must fall on a micro-step boundary of this layout, counted from the
        first position ``step_start`` of the step it falls in."""
        into = consumed - step_start
        if into % self.samples_per_micro_step:
            raise StateError(
                f"cannot resume at samples_consumed={consumed} with micro_batch_size "
                f"{self.micro_batch_size} x world_size {self.world_size}: not a micro-step "
                f"boundary ({into} samples into the step that starts at {step_start}, and "
                f"{into} % {self.samples_per_micro_step} != 0); hint: resume with "
                "the layout it was saved with, or save at a global step boundary (position "
                f"{step_start} or the end of that step)",
                fields=("samples_consumed",),
            )


@dataclass(frozen=True)
class Placement:
    """What a rank's `Layout` is made from: the constant global batch (None: a schedule), the
    micro batch, and rank / world size (None: read from ``torch.distributed`` each time)."""

    global_batch_size: int | None
    micro_batch_size: int | None
    rank: int | None
    world_size: int | None

    def layout_at(self, anchor: int) -> Layout:
        """The layout now (rank / world size not given read from torch.distributed), its
        micro-step grid through position ``anchor``."""
        group_rank, group_world = process_group_rank_world()
        world = group_world if self.world_size is None else self.world_size
        rank = group_rank if self.rank is None else self.rank
        return Layout.create(
            self.global_batch_size, self.micro_batch_size, world, rank, anchor=anchor
        )


def process_group_rank_world() -> tuple[int, int]:
    """``(rank, world_size)`` of the initialised default ``torch.distributed`` group, else
    ``(0, 1)``."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1
