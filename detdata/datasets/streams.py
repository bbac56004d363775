"""Streams over one dataset: `OrderedStream` (a dataset read in `GlobalOrder`) and `as_stream`.

`detdata.Mixture` (`detdata.datasets.mixture`) is the stream over several datasets.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from detdata.base.checks import check_seed
from detdata.base.errors import ConfigError
from detdata.base.types import Batch, IntArray
from detdata.datasets.base import Dataset, Stream
from detdata.order.feistel import ALGORITHM, GlobalOrder
from detdata.order.memo import ChunkMemo


class OrderedStream:
    """A dataset read in `GlobalOrder`: position ``g`` -> ``dataset.read(order.ids(g))``."""

    def __init__(self, dataset: Dataset, seed: int) -> None:
        self.dataset = dataset
        self.seed = check_seed(seed)
        n = dataset.num_samples
        if isinstance(n, (int, np.integer)) and not isinstance(n, bool) and int(n) <= 0:
            raise ConfigError(
                f"dataset {type(dataset).__name__} is empty (num_samples == {n}); "
                "there is nothing to order or load; hint: check the manifest / "
                "dataset construction"
            )
        self.order = GlobalOrder(n, self.seed)
        self._memo = ChunkMemo(self._ids)

    def _ids(self, positions: IntArray) -> tuple[IntArray]:
        return (self.order.ids(positions),)

    def sample_ids(self, positions: IntArray) -> IntArray:
        """Sample ids at ``positions`` (same shape); chunk-cached, identical to ``order.ids``."""
        pos = np.asarray(positions)
        return self._memo(pos)[0].reshape(pos.shape)

    def fetch(self, positions: IntArray) -> Batch:
        return self.dataset.read(self.sample_ids(positions).reshape(-1))

    def identity(self) -> dict[str, Any]:
        return {
            "type": "ordered",
            "algorithm": ALGORITHM,
            "seed": self.seed,
            "dataset": self.dataset.identity(),
        }


def as_stream(data: Dataset | Stream, seed: int) -> Stream:
    """A `Stream` for ``data``: streams pass through, datasets get `GlobalOrder` under ``seed``."""
    if isinstance(data, Stream) and hasattr(data, "fetch"):
        return data
    if isinstance(data, Dataset):
        return OrderedStream(data, seed)
    raise ConfigError(
        f"expected a detdata Dataset (num_samples, read, identity) or Stream "
        f"(fetch, sample_ids, identity), got {type(data).__name__}"
    )
