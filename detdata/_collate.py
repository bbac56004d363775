"""The default collate: a read batch (dict of numpy columns) into torch objects."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np
import torch


def to_torch(batch: Any) -> Any:
    """Numpy arrays become tensors (sharing memory); mappings are converted per value."""
    if isinstance(batch, np.ndarray):
        return torch.from_numpy(batch)
    if isinstance(batch, Mapping):
        return {k: to_torch(v) for k, v in batch.items()}
    return batch
