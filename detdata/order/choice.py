"""Which order a dataset is read in (docs/design.md section 2): `Order.FEISTEL_V1` (the
default, `GlobalOrder`) or a `LocalityOrder` (`WindowedOrder`: shards or row groups permuted
per epoch, then samples inside windows of ``k`` of them). The order, its unit and ``k`` are
part of a stream's identity (`order_name`): a resume with another is refused naming the
``algorithm`` field.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Final

from detdata.base.checks import check_count
from detdata.base.errors import ConfigError
from detdata.order.feistel import GlobalOrder
from detdata.order.locality import WindowedOrder
from detdata.order.positions import PositionOrder


class Order(enum.Enum):
    """An order algorithm (its value is the versioned name)."""

    FEISTEL_V1 = "feistel-v1"
    LOCALITY_V1 = "locality-v1"


DEFAULT_WINDOW_SHARDS: Final = 8


class LocalityUnit(enum.Enum):
    """What a `LocalityOrder` groups into windows (its value names the window parameter)."""

    SHARDS = "window_shards"
    ROW_GROUPS = "window_row_groups"


@dataclass(frozen=True, kw_only=True)
class LocalityOrder:
    """``locality-v1`` with ``window_shards`` shards per window (default 8), or with
    ``window_row_groups`` row groups per window (give one of the two; row groups need a
    dataset with ``row_group_sizes``, `TableRows`). Larger windows shuffle better and touch
    more shards per stretch of positions (docs/benchmarks.md)."""

    window_shards: int | None = None
    window_row_groups: int | None = None

    def __post_init__(self) -> None:
        if self.window_shards is not None and self.window_row_groups is not None:
            raise ConfigError(
                f"LocalityOrder takes window_shards or window_row_groups, not both (got "
                f"window_shards={self.window_shards!r:.40}, window_row_groups="
                f"{self.window_row_groups!r:.40}); hint: window_row_groups for row-group "
                "windows of a TableRows, window_shards otherwise"
            )
        if self.window_row_groups is not None:
            check_count(
                self.window_row_groups, "LocalityOrder window_row_groups", maximum=(1 << 31) - 1
            )
            return
        if self.window_shards is None:
            object.__setattr__(self, "window_shards", DEFAULT_WINDOW_SHARDS)
        check_count(self.window_shards, "LocalityOrder window_shards", maximum=(1 << 31) - 1)

    @property
    def unit(self) -> LocalityUnit:
        """What a window is made of."""
        return LocalityUnit.SHARDS if self.window_row_groups is None else LocalityUnit.ROW_GROUPS

    @property
    def window(self) -> int:
        """Units (shards or row groups) per window."""
        window = self.window_shards if self.window_row_groups is None else self.window_row_groups
        assert window is not None  # __post_init__ fills window_shards
        return window


#: What ``order=`` accepts: an `Order`, its name, or a `LocalityOrder`.
OrderLike = Order | LocalityOrder | str
#: A checked choice.
OrderChoice = Order | LocalityOrder


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
        f"LocalityOrder(window_shards=k) / LocalityOrder(window_row_groups=k), got "
        f"{value!r:.80}"
    )


def order_name(choice: OrderChoice) -> str:
    """The order's name in identities and loader states: ``"feistel-v1"``, or
    ``"locality-v1(window_shards=k)"`` / ``"locality-v1(window_row_groups=k)"`` (the unit
    and its parameter are part of what is checked)."""
    if isinstance(choice, LocalityOrder):
        return f"{Order.LOCALITY_V1.value}({choice.unit.value}={choice.window})"
    return choice.value


#: The dataset attribute holding the samples per unit, for each `LocalityUnit`.
UNIT_SIZES: Final = {LocalityUnit.SHARDS: "shard_sizes", LocalityUnit.ROW_GROUPS: "row_group_sizes"}


def build_order(
    choice: OrderChoice, num_samples: int, seed: int, unit_sizes: Sequence[int] | None
) -> PositionOrder:
    """The order of ``choice`` over ``num_samples`` samples under ``seed``; a `LocalityOrder`
    needs the samples per unit of the dataset (``unit_sizes``: its ``shard_sizes``, or its
    ``row_group_sizes`` for ``window_row_groups``; summing to ``num_samples``)."""
    if not isinstance(choice, LocalityOrder):
        return GlobalOrder(num_samples, seed)
    attr = UNIT_SIZES[choice.unit]
    if unit_sizes is None:
        hint = (
            "use a TableRows dataset (Parquet / Arrow row groups) or window_shards=k"
            if choice.unit is LocalityUnit.ROW_GROUPS
            else "use a sharded dataset (TokenWindows, TableRows)"
        )
        raise ConfigError(
            f"order {order_name(choice)} needs the dataset's samples per "
            f"{'row group' if choice.unit is LocalityUnit.ROW_GROUPS else 'shard'}, and this "
            f"dataset has no {attr}; hint: {hint} or order=Order.FEISTEL_V1"
        )
    order = WindowedOrder(unit_sizes, seed, window_shards=choice.window)
    if order.num_samples != num_samples:
        raise ConfigError(
            f"{attr} sum to {order.num_samples} samples but the dataset has "
            f"num_samples={num_samples}; the dataset's {attr} are inconsistent"
        )
    return order
