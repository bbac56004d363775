"""How the position -> sample id orders (`GlobalOrder`, `WindowedOrder`) read positions: an
``int`` (one id), a ``slice`` with a stop, or an array of non-negative integers of any shape.
"""

from __future__ import annotations

from collections.abc import Callable

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


def index_positions(
    ids: Callable[[npt.ArrayLike], IntArray], position: int | slice, kind: str
) -> int | IntArray:
    """``order[position]`` through the order's vector lookup ``ids``.

    An ``int`` gives one id; a ``slice`` (which needs a stop: an order is infinite, ``kind``
    names the order class in the error) gives the ids of ``range(start, stop, step)``.
    """
    if isinstance(position, slice):
        if position.stop is None:
            raise ConfigError(f"{kind} slices need a stop: the order is infinite")
        start, stop, step = position.start or 0, position.stop, position.step or 1
        return ids(np.arange(start, stop, step, dtype=np.int64))
    g = check_count(position, "position", minimum=0, maximum=_MAX_INDEX)
    return int(ids(np.array([g], dtype=np.int64))[0])
