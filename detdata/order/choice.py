"""Which order a dataset is read in: `Order` (the algorithms) and `LocalityOrder` (parameters).

``Order.FEISTEL_V1`` (the default): `GlobalOrder`, a keyed permutation of all samples
per epoch. ``LocalityOrder(window_shards=k)`` (``Order.LOCALITY_V1`` with the default
``k``): `WindowedOrder`, shards permuted per epoch, then samples inside each window of
``k`` consecutive shards, so a stretch of positions touches at most ``k`` shards (for
large or remote corpora: fewer open files, whole-shard reads, prefetch that knows what
comes next). Both are bijections per epoch with O(1) random access; the choice and its
parameters are part of a stream's identity (`order_name`), so a resume with another
order or another ``k`` is refused naming the ``algorithm`` field.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Final, Protocol

import numpy.typing as npt

from detdata.base.checks import check_count
from detdata.base.errors import ConfigError
from detdata.base.types import IntArray
from detdata.order.feistel import GlobalOrder
from detdata.order.locality import WindowedOrder


class Order(enum.Enum):
    """An order algorithm (its value is the versioned name)."""

    FEISTEL_V1 = "feistel-v1"
    LOCALITY_V1 = "locality-v1"


DEFAULT_WINDOW_SHARDS: Final = 8


@dataclass(frozen=True, kw_only=True)
class LocalityOrder:
    """``locality-v1`` with ``window_shards`` shards per window (default 8).

    Larger windows shuffle better (``window_shards >= shards`` is a full shuffle) and
    touch more shards per stretch of positions; see docs/benchmarks.md for the measured
    trade-off.
    """

    window_shards: int = DEFAULT_WINDOW_SHARDS

    def __post_init__(self) -> None:
        check_count(self.window_shards, "LocalityOrder window_shards", maximum=(1 << 31) - 1)


#: What ``order=`` accepts: an `Order`, its name, or a `LocalityOrder`.
OrderLike = Order | LocalityOrder | str
#: A checked choice.
OrderChoice = Order | LocalityOrder


class PositionOrder(Protocol):
    """Global position -> sample id (`GlobalOrder`, `WindowedOrder`)."""

    @property
    def num_samples(self) -> int: ...

    def ids(self, positions: npt.ArrayLike) -> IntArray: ...


def check_order(value: object) -> OrderChoice:
    """``value`` as `Order.FEISTEL_V1` or a `LocalityOrder`, else `ConfigError` listing the
    choices (``Order.LOCALITY_V1`` and ``"locality-v1"`` mean ``LocalityOrder()``)."""
    if isinstance(value, LocalityOrder):
        return value
    if isinstance(value, str) and value in {o.value for o in Order}:
        value = Order(value)
    if value is Order.FEISTEL_V1:
        return Order.FEISTEL_V1
    if value is Order.LOCALITY_V1:
        return LocalityOrder()
    raise ConfigError(
        f"order must be one of {[o.value for o in Order]} (an Order or its name) or "
        f"LocalityOrder(window_shards=k), got {value!r:.80}"
    )


def order_name(choice: OrderChoice) -> str:
    """The order's name in identities and loader states: ``"feistel-v1"``, or
    ``"locality-v1(window_shards=k)"`` (the parameter is part of what is checked)."""
    if isinstance(choice, LocalityOrder):
        return f"{Order.LOCALITY_V1.value}(window_shards={choice.window_shards})"
    return choice.value


def build_order(
    choice: OrderChoice, num_samples: int, seed: int, shard_sizes: Sequence[int] | None
) -> PositionOrder:
    """The order of ``choice`` over ``num_samples`` samples under ``seed``; a `LocalityOrder`
    needs the samples per shard (``shard_sizes``, summing to ``num_samples``)."""
    if not isinstance(choice, LocalityOrder):
        return GlobalOrder(num_samples, seed)
    if shard_sizes is None:
        raise ConfigError(
            f"order {order_name(choice)} needs the dataset's samples per shard, and this "
            "dataset has no shard_sizes; hint: use a sharded dataset (TokenWindows, "
            "TableRows) or order=Order.FEISTEL_V1"
        )
    order = WindowedOrder(shard_sizes, seed, window_shards=choice.window_shards)
    if order.num_samples != num_samples:
        raise ConfigError(
            f"shard_sizes sum to {order.num_samples} samples but the dataset has "
            f"num_samples={num_samples}; the dataset's shard_sizes are inconsistent"
        )
    return order
