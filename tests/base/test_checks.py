"""Argument validators (`detdata.base.checks`): the documented ranges, bools refused, numpy
integers accepted, and a `ConfigError` that names the argument and what was found."""

from __future__ import annotations

import numpy as np
import pytest

from detdata.base.checks import check_count, check_positive_int, check_seed
from detdata.base.errors import ConfigError


@pytest.mark.parametrize("seed", [0, 1, 1234, (1 << 64) - 1, np.uint64((1 << 64) - 1), np.int8(7)])
def test_a_seed_in_range_comes_back_as_a_plain_int(seed: object) -> None:
    got = check_seed(seed)
    assert type(got) is int and got == int(seed)  # type: ignore[call-overload]


@pytest.mark.parametrize(
    ("seed", "found"),
    [(True, "True (bool)"), (1.0, "1.0 (float)"), ("3", "'3' (str)"), (None, "None (NoneType)")],
)
def test_a_seed_that_is_not_an_integer_is_refused_naming_its_type(seed: object, found: str) -> None:
    with pytest.raises(ConfigError, match="must be an integer in") as caught:
        check_seed(seed, "mixture seed")
    assert str(caught.value).startswith("mixture seed ")
    assert found in str(caught.value) and "hint:" in str(caught.value)


@pytest.mark.parametrize("seed", [-1, 1 << 64, -(1 << 70)])
def test_a_seed_out_of_range_is_refused_naming_the_value(seed: int) -> None:
    with pytest.raises(ConfigError, match=rf"seed must be in \[0, 2\*\*64\), got {seed}$"):
        check_seed(seed)


def test_a_count_is_checked_against_its_bounds_inclusive() -> None:
    assert check_count(np.int64(3), "n", minimum=3, maximum=3) == 3
    assert type(check_count(np.int32(5), "n")) is int
    assert check_count(0, "num_workers", minimum=0) == 0
    for bad in (2, 4):
        with pytest.raises(ConfigError, match=rf"^steps must be in \[3, 3\], got {bad}"):
            check_count(bad, "steps", minimum=3, maximum=3)
    with pytest.raises(ConfigError, match=r"^epoch must be in \[1, "):
        check_count(0, "epoch")  # minimum 1 by default
    for bad in (False, 2.0, "2"):
        with pytest.raises(ConfigError, match=rf"^n must be an integer, got {bad!r}"):
            check_count(bad, "n")


def test_a_positive_int_has_a_floor_and_refuses_bools() -> None:
    assert check_positive_int(np.uint8(1), "micro") == 1
    assert check_positive_int(0, "micro", minimum=0) == 0
    for bad in (0, -3, True, 1.5, None):
        with pytest.raises(ConfigError, match=rf"^micro must be an integer >= 1, got {bad!r}$"):
            check_positive_int(bad, "micro")
