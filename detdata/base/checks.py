"""Argument validators: the one home for the checks every constructor makes. Each returns the
value as a plain ``int`` or raises `ConfigError` naming the argument, expected and found
(bools are never integers here).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, Final, TypeVar

import numpy as np

from detdata.base.errors import ConfigError
from detdata.base.types import MAX_POSITION

_MAX_SEED: Final = 1 << 64

C = TypeVar("C", bound=type)


def check_seed(seed: object, what: str = "seed") -> int:
    """Return ``seed`` as an int in ``[0, 2**64)`` or raise `ConfigError`."""
    if isinstance(seed, bool) or not isinstance(seed, (int, np.integer)):
        raise ConfigError(
            f"{what} must be an integer in [0, 2**64), got {seed!r} "
            f"({type(seed).__name__}); hint: pass a plain int such as 1234"
        )
    value = int(seed)
    if not 0 <= value < _MAX_SEED:
        raise ConfigError(f"{what} must be in [0, 2**64), got {value}")
    return value


def check_count(n: object, what: str, *, minimum: int = 1, maximum: int = MAX_POSITION - 1) -> int:
    """Return ``n`` as an int in ``[minimum, maximum]`` or raise `ConfigError`."""
    if isinstance(n, bool) or not isinstance(n, (int, np.integer)):
        raise ConfigError(f"{what} must be an integer, got {n!r} ({type(n).__name__})")
    value = int(n)
    if not minimum <= value <= maximum:
        raise ConfigError(f"{what} must be in [{minimum}, {maximum}], got {value}")
    return value


def check_positive_int(value: object, name: str, *, minimum: int = 1) -> int:
    """``value`` as an int ``>= minimum`` (bools refused), else `ConfigError`."""
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or int(value) < minimum:
        raise ConfigError(f"{name} must be an integer >= {minimum}, got {value!r}")
    return int(value)


def refuses_renamed(**renamed: str) -> Callable[[C], C]:
    """Class decorator: ``Cls(old=...)`` for a keyword renamed ``renamed[old]`` raises
    `ConfigError` naming the new spelling (no alias: one spelling per option); every other
    call goes to the class's own ``__init__`` unchanged (the one type checkers see)."""

    def wrap(cls: C) -> C:
        init = cls.__init__  # type: ignore[misc]  # the class's own, wrapped once

        @functools.wraps(init)
        def __init__(self: object, *args: Any, **kwargs: Any) -> None:
            for old in sorted(kwargs.keys() & renamed.keys()):
                new = renamed[old]
                raise ConfigError(
                    f"{cls.__name__}({old}=...) is now {cls.__name__}({new}=...); hint: "
                    f"write {new}=... (the old spelling has no alias)"
                )
            init(self, *args, **kwargs)

        cls.__init__ = __init__  # type: ignore[misc]
        return cls

    return wrap
