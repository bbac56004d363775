"""Shared types and bounds."""

from __future__ import annotations

from typing import Final

import numpy as np
import numpy.typing as npt

#: An array of sample ids or global positions.
IntArray = npt.NDArray[np.int64]
#: One batch: column name -> array whose first axis is the batch.
Batch = dict[str, np.ndarray]
#: Exclusive bound of global positions and sample counts: orders and mixtures address [0, 2**62).
MAX_POSITION: Final = 1 << 62
