"""Streams over one dataset: `OrderedStream` and `as_stream` (`detdata.Mixture` is the
stream over several)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from detdata.base.checks import check_seed
from detdata.base.errors import ConfigError
from detdata.base.types import Batch, IntArray
from detdata.datasets.base import Dataset, Stream
from detdata.datasets.capabilities import DatasetInfo, Origins, ReadsAhead, info, missing
from detdata.order.choice import (
    LocalityOrder,
    LocalityUnit,
    Order,
    OrderChoice,
    OrderLike,
    build_order,
    check_order,
    order_name,
)
from detdata.order.memo import ChunkMemo


def unit_sizes_of(dataset: Dataset, choice: OrderChoice) -> Sequence[int] | None:
    """What a `LocalityOrder` ``choice`` windows: the dataset's ``shard_sizes`` or its
    ``row_group_sizes`` (`DatasetInfo`); None for a global order. A dataset without the
    member the order needs is a `CapabilityError` naming it."""
    if not isinstance(choice, LocalityOrder):
        return None
    if choice.unit is LocalityUnit.ROW_GROUPS:
        sizes, member = info(dataset).row_group_sizes, ".row_group_sizes"
        hint = "use a TableRows dataset (Parquet / Arrow row groups) or window_shards=k"
    else:
        sizes, member = info(dataset).shard_sizes, ".shard_sizes"
        hint = "use a sharded dataset (TokenWindows, TableRows)"
    if sizes is not None:
        return tuple(int(c) for c in sizes)
    raise missing(
        DatasetInfo,
        dataset,
        member=member,
        needed_by=f"order {order_name(choice)}",
        hint=f"{hint}; subclass DatasetInfo and give your dataset {member}; or "
        "order=Order.FEISTEL_V1",
    )


class OrderedStream:
    """A dataset read in an order: position ``g`` -> ``dataset.read(order.ids(g))``.

    ``order``: `Order.FEISTEL_V1` (default) or a `LocalityOrder` over the dataset's
    ``shard_sizes`` / ``row_group_sizes`` (`unit_sizes_of`); its name is the identity's
    ``algorithm``. The dataset is told the order (`DatasetInfo.use_order`).
    """

    def __init__(self, dataset: Dataset, seed: int, *, order: OrderLike = Order.FEISTEL_V1) -> None:
        self.dataset = dataset
        self.seed = check_seed(seed)
        self.order_choice = check_order(order)
        n = dataset.num_samples
        if isinstance(n, (int, np.integer)) and not isinstance(n, bool) and int(n) <= 0:
            raise ConfigError(
                f"dataset {type(dataset).__name__} is empty (num_samples == {n}); "
                "there is nothing to order or load; hint: check the manifest / "
                "dataset construction"
            )
        sizes = unit_sizes_of(dataset, self.order_choice)
        self.order = build_order(self.order_choice, n, self.seed, sizes)
        info(dataset).use_order(self.order_choice)
        self._memo = ChunkMemo(self._ids)

    def _ids(self, positions: IntArray) -> tuple[IntArray]:
        return (self.order.ids(positions),)

    def sample_ids(self, positions: IntArray) -> IntArray:
        """Sample ids at ``positions`` (same shape); chunk-cached, identical to ``order.ids``."""
        pos = np.asarray(positions)
        return self._memo(pos)[0].reshape(pos.shape)

    def fetch(self, positions: IntArray) -> Batch:
        return self.dataset.read(self.sample_ids(positions).reshape(-1))

    def origins(self, positions: IntArray) -> Origins:
        """One unnamed source: the dataset, and the sample id of each of the 1-D
        ``positions`` (`HasOrigins`)."""
        pos = np.asarray(positions, dtype=np.int64).reshape(-1)
        return Origins(
            names=(None,),
            datasets=(self.dataset,),
            source=np.zeros(pos.size, dtype=np.int64),
            ids=np.asarray(self.sample_ids(pos), dtype=np.int64).reshape(-1),
            notes=(None,) * pos.size,
        )

    def read_ahead(self, positions: IntArray | None) -> None:
        """A hint: the next `fetch` is of ``positions`` (None: drop what is pending), passed
        on as sample ids to a `ReadsAhead` dataset."""
        if isinstance(self.dataset, ReadsAhead):
            ids = None if positions is None else self.sample_ids(positions).reshape(-1)
            self.dataset.read_ahead(ids)

    def identity(self) -> dict[str, Any]:
        return {
            "type": "ordered",
            "algorithm": order_name(self.order_choice),
            "seed": self.seed,
            "dataset": self.dataset.identity(),
        }


def as_stream(data: Dataset | Stream, seed: int, *, order: OrderLike | None = None) -> Stream:
    """A `Stream` for ``data``: streams pass through, datasets get an `OrderedStream` under
    ``seed`` in ``order`` (default `Order.FEISTEL_V1`). A stream has its own order, so
    ``order`` with a stream is a `ConfigError`."""
    if isinstance(data, Stream) and hasattr(data, "fetch"):
        if order is not None:
            raise ConfigError(
                f"order={order!r:.60} applies to a dataset the loader orders, but "
                f"{type(data).__name__} is a stream with its own order; hint: build it with "
                "the order (OrderedStream(dataset, seed, order=...)) or pass the dataset"
            )
        return data
    if isinstance(data, Dataset):
        return OrderedStream(data, seed, order=Order.FEISTEL_V1 if order is None else order)
    raise ConfigError(
        f"expected a detdata Dataset (num_samples, read, identity) or Stream "
        f"(fetch, sample_ids, identity), got {type(data).__name__}; hint: {_next_step(data)}"
    )


def _next_step(data: object) -> str:
    """What to do with ``data`` that is neither a detdata dataset nor a stream."""
    if hasattr(data, "__getitem__") and hasattr(data, "__len__"):  # torch's map-style Dataset
        return (
            f"{type(data).__name__} looks like a torch map-style Dataset: keep it and torch's "
            "DataLoader with batch_sampler=detdata.DeterministicBatchSampler(len(dataset), "
            "global_batch_size=..., micro_batch_size=..., seed=...) for detdata's order and "
            "resume, or build the data as a detdata dataset (TokenWindows / TableRows / "
            "Documents over a manifest, ArrayDataset for arrays in memory)"
        )
    return (
        "build a detdata dataset (TokenWindows / TableRows / Documents over a manifest, "
        "ArrayDataset for arrays in memory)"
    )
