"""How the position -> sample id orders (`GlobalOrder`, `WindowedOrder`) read positions: an
``int`` (one id), a ``slice`` with a stop, or an array of non-negative integers of any shape.
"""

from __future__ import annotations

import abc
from typing import overload

import numpy as np
import numpy.typing as npt

from detdata.base.checks import check_count
from detdata.base.errors import ConfigError
from detdata.base.types import IntArray

_MAX_INDEX = (1 << 63) - 1


def check_positions_array(positions: npt.ArrayLike) -> npt.NDArray[np.integer]:
    """``positions`` as an integer array (shape kept), every value ``>= 0``, else `ConfigError`."""
    pos = np.asarray(positions)
    if pos.dtype.kind not in "iu":
        raise ConfigError(f"positions must be integers, got dtype {pos.dtype}")
    if pos.size and int(pos.min()) < 0:
        raise ConfigError(f"positions must be >= 0, found {int(pos.min())}")
    return pos


class PositionOrder(abc.ABC):
    """Global position -> sample id over ``num_samples`` samples: `ids` of an array,
    ``order[g]`` (one id) or ``order[start:stop:step]`` (a stop is needed: an order is
    infinite). Orders with equal `_identity` are equal and give equal ids."""

    num_samples: int

    @abc.abstractmethod
    def ids(self, positions: npt.ArrayLike) -> IntArray:
        """Sample ids of the global ``positions`` (any shape of non-negative ints)."""

    @abc.abstractmethod
    def _identity(self) -> tuple[object, ...]:
        """The algorithm and its parameters."""

    def __len__(self) -> int:
        return self.num_samples

    def __eq__(self, other: object) -> bool:
        return type(other) is type(self) and other._identity() == self._identity()

    def __hash__(self) -> int:
        return hash(self._identity())

    @overload
    def __getitem__(self, position: int) -> int: ...
    @overload
    def __getitem__(self, position: slice) -> IntArray: ...

    def __getitem__(self, position: int | slice) -> int | IntArray:
        if isinstance(position, slice):
            if position.stop is None:
                raise ConfigError(
                    f"{type(self).__name__} slices need a stop: the order is infinite"
                )
            start, stop, step = position.start or 0, position.stop, position.step or 1
            return self.ids(np.arange(start, stop, step, dtype=np.int64))
        g = check_count(position, "position", minimum=0, maximum=_MAX_INDEX)
        return int(self.ids(np.array([g], dtype=np.int64))[0])
