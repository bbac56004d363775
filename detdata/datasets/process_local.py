"""Pickling for datasets that hold per-process resources (memmaps, file handles, caches).

A dataset is pickled into torch worker processes: only its parameters and
manifest travel; the derived index and the per-process resources are rebuilt
on the other side (and after a fork, by the dataset's own pid check).
"""

from __future__ import annotations

from typing import Any, ClassVar


class ProcessLocal:
    """Mixin: drop ``_TRANSIENT`` attributes when pickled; rebuild them when unpickled."""

    #: Attributes derived from the parameters or owned by one process; never pickled.
    _TRANSIENT: ClassVar[tuple[str, ...]] = ()

    def _build_index(self) -> None:
        """Recompute attributes derived from the parameters (cheap, deterministic)."""

    def _reset_process_state(self) -> None:
        """Start this process's resources afresh (opened lazily on first use)."""

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        for key in self._TRANSIENT:
            state.pop(key, None)
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._build_index()
        self._reset_process_state()
