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
from detdata.base.types import MAX_POSITION, IntArray

_MAX_INDEX = (1 << 63) - 1


def reverse_epochs(
    n: int, sample_id: int, start: int, until: int, *, most: int
) -> tuple[int, int, int, range]:
    """A reverse lookup's arguments checked (``sample_id < n``, ``start`` and ``until`` in
    ``[0, 2**62]``), with the epochs of ``n`` samples holding positions ``[start, until)``
    (none when ``until <= start``): ``(sample_id, start, until, epochs)``. More than ``most``
    epochs is a `ConfigError`."""
    x = check_count(sample_id, "sample_id", minimum=0, maximum=n - 1)
    lo = check_count(start, "start", minimum=0, maximum=MAX_POSITION)
    hi = check_count(until, "until", minimum=0, maximum=MAX_POSITION)
    epochs = range(lo // n, (hi - 1) // n + 1) if hi > lo else range(0)
    if len(epochs) > most:
        raise ConfigError(
            f"positions_of over [{lo}, {hi}) spans {len(epochs)} epochs of {n} samples (more "
            f"than {most}); hint: ask for a narrower range of positions"
        )
    return x, lo, hi, epochs


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
