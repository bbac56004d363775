"""`origins(stream, positions)`: source, dataset and sample id of each position, asked of a
stream that declares `HasOrigins` (`detdata.datasets.capabilities`), else `CapabilityError`.
"""

from __future__ import annotations

import numpy as np
import numpy.typing as npt

from detdata.base.errors import ConfigError
from detdata.datasets.base import Stream
from detdata.datasets.capabilities import HasOrigins, Origins, missing

__all__ = ["Origins", "origins"]


def origins(stream: Stream, positions: npt.ArrayLike) -> Origins:
    """`Origins` of the 1-D ``positions`` of ``stream`` (`HasOrigins`: `CapabilityError`
    naming the stream's type without it)."""
    pos = np.asarray(positions, dtype=np.int64).reshape(-1)
    if not isinstance(stream, HasOrigins):
        raise missing(
            HasOrigins,
            stream,
            needed_by="telling where a stream's samples come from",
            hint="use an OrderedStream or a Mixture, or give the stream an "
            "origins(positions) -> detdata.datasets.capabilities.Origins method",
        )
    result = stream.origins(pos)
    if not isinstance(result, Origins):
        raise ConfigError(
            f"{type(stream).__name__}.origins returned {type(result).__name__}, "
            "expected detdata.datasets.capabilities.Origins"
        )
    return result
