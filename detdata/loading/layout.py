"""Which global positions each rank reads at each micro step (docs/design.md section 4).

Step ``t`` with global batch ``B`` covers positions ``[c, c + B)`` where ``c``
is the number of samples consumed before it. With ``D`` ranks and micro batch
``m``, micro step ``k`` covers ``[c + k*m*D, c + (k+1)*m*D)`` and rank ``r``
takes ``[.. + r*m, .. + (r+1)*m)``. Equivalently, the ``j``-th global micro
step (counting from position 0) of rank ``r`` is ``j*m*D + r*m + arange(m)``.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from detdata.base.checks import check_count
from detdata.base.errors import ConfigError, StateError


@dataclass(frozen=True, kw_only=True)
class Layout:
    """Global batch, micro batch and data-parallel placement of one rank."""

    global_batch_size: int
    micro_batch_size: int
    world_size: int
    rank: int

    def __post_init__(self) -> None:
        check_count(self.global_batch_size, "global_batch_size")
        check_count(self.micro_batch_size, "micro_batch_size")
        check_count(self.world_size, "world_size")
        check_count(self.rank, "rank", minimum=0, maximum=self.world_size - 1)
        per_micro_step = self.micro_batch_size * self.world_size
        if self.global_batch_size % per_micro_step:
            raise ConfigError(
                f"global_batch_size {self.global_batch_size} is not divisible by micro_batch_size "
                f"{self.micro_batch_size} x world_size {self.world_size} = {per_micro_step}; hint: "
                "choose a micro batch (and world size) whose product divides the global batch"
            )

    @classmethod
    def create(
        cls, global_batch_size: int, micro_batch_size: int | None, world_size: int, rank: int
    ) -> Layout:
        """Layout with ``micro_batch_size`` defaulting to one micro step per step."""
        gbs = check_count(global_batch_size, "global_batch_size")
        ws = check_count(world_size, "world_size")
        if micro_batch_size is None:
            if gbs % ws:
                raise ConfigError(
                    f"global_batch_size {gbs} is not divisible by world_size {ws}; "
                    "hint: pick a global batch that is a multiple of the number of ranks"
                )
            micro_batch_size = gbs // ws
        return cls(
            global_batch_size=gbs, micro_batch_size=micro_batch_size, world_size=ws, rank=rank
        )

    @property
    def samples_per_micro_step(self) -> int:
        """Global samples consumed by one iteration on every rank (``m * D``)."""
        return self.micro_batch_size * self.world_size

    @property
    def micro_steps_per_step(self) -> int:
        return self.global_batch_size // self.samples_per_micro_step

    def positions(self, micro_step: int) -> npt.NDArray[np.int64]:
        """Positions of global micro step ``micro_step`` (counted from position 0) on this rank."""
        start = micro_step * self.samples_per_micro_step + self.rank * self.micro_batch_size
        return np.arange(start, start + self.micro_batch_size, dtype=np.int64)

    def check_resume_position(self, consumed: int) -> None:
        """A resume position must fall on a micro-step boundary of this layout."""
        if consumed % self.samples_per_micro_step:
            raise StateError(
                f"cannot resume at samples_consumed={consumed} with micro_batch_size "
                f"{self.micro_batch_size} x world_size {self.world_size}: not a micro-step "
                f"boundary ({consumed} % {self.samples_per_micro_step} != 0); hint: resume with "
                "the layout it was saved with, or save at a global step boundary (a multiple of "
                f"{self.global_batch_size})",
                fields=("samples_consumed",),
            )


def process_group_rank_world() -> tuple[int, int]:
    """``(rank, world_size)`` of the initialised default ``torch.distributed`` group, else
    ``(0, 1)``."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1
