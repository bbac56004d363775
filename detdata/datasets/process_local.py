"""`PerProcess`: a value owned by one process (memory maps, file handles, caches), held as a
part: pickled empty, made at its first `get` in a process and again in a forked child (a
fork bumps this module's generation: no ``getpid`` per use). The maker is given at each
`get`, so the holder keeps no reference to its owner.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable
from typing import Any, Generic, TypeVar

T = TypeVar("T")

_generation = 0  # bumped in a forked child: values of another generation are the parent's
_MAKING = threading.RLock()  # reader threads may ask at once; a maker may `get` another value


def _forked() -> None:
    global _generation, _MAKING
    _generation += 1
    _MAKING = threading.RLock()  # a thread of the parent may have held it at the fork


os.register_at_fork(after_in_child=_forked)


class PerProcess(Generic[T]):
    """A value of this process: ``make()`` at the first `get` in a process, and again after
    a fork, an unpickle or `reset`; never pickled."""

    __slots__ = ("_generation", "_value")

    def __init__(self) -> None:
        self._value: T | None = None
        self._generation = -1

    def get(self, make: Callable[[], T]) -> T:
        """This process's value (``make()`` now if this process has none)."""
        value = self._value
        if value is None or self._generation != _generation:
            with _MAKING:
                if self._value is None or self._generation != _generation:
                    self._value, self._generation = make(), _generation
                value = self._value
        return value

    def reset(self) -> None:
        """Forget this process's value: the next `get` makes a new one."""
        self._value = None

    def __getstate__(self) -> dict[str, Any]:
        return {}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self._value, self._generation = None, -1


def pickled_state(
    owner: object, derived: tuple[str, ...], index: str | None = None
) -> dict[str, Any]:
    """``owner``'s attributes to pickle: less the ``derived`` ones (made again when it is
    unpickled) and, where ``owner.index_dir`` is set, with ``index`` as None (the worker
    re-loads it from the file, `detdata.datasets.index_files.reload_index`)."""
    state = {key: value for key, value in vars(owner).items() if key not in derived}
    if index is not None and state.get("index_dir") is not None:
        state[index] = None
    return state
