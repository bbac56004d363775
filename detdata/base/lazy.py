"""Modules imported at first use, so that ``import detdata`` stays light.

`LazyModule` is a stand-in whose first attribute access imports the real module (pyarrow as
``pa``, ``ipc``, ``pq`` here: ~0.3 s, needed only for tables); `require` imports one now.
A module that cannot be imported is a `DependencyError` naming it and the ``pip install``.
"""

from __future__ import annotations

import importlib
import threading
import types
from typing import TYPE_CHECKING, Any, Final

from detdata.base.errors import DependencyError

#: Held while a lazy module is first imported (see `LazyModule._load`).
_IMPORTING: Final = threading.RLock()


class LazyModule(types.ModuleType):
    """``name``, imported on the first attribute access (then every access is the real one)."""

    def __init__(self, name: str, *, install: str) -> None:
        super().__init__(name)
        self._lazy_install = install
        self._lazy_module: types.ModuleType | None = None

    def _load(self) -> types.ModuleType:
        if self._lazy_module is None:
            # One first import at a time: threads importing pyarrow, pyarrow.ipc and
            # pyarrow.parquet at once (shards inspected in parallel) otherwise see a partially
            # initialised pyarrow.ipc ("cannot import name 'serialize_pandas'").
            with _IMPORTING:
                if self._lazy_module is None:
                    self._lazy_module = require(
                        self.__name__,
                        install=self._lazy_install,
                        purpose="to read Parquet / Arrow tables",
                    )
        return self._lazy_module

    def __getattr__(self, attr: str) -> Any:
        if attr.startswith("_lazy_"):
            raise AttributeError(attr)
        return getattr(self._load(), attr)


def require(name: str, *, install: str, purpose: str) -> types.ModuleType:
    """Module ``name``, imported now, or `DependencyError` naming it, why, what it is needed
    ``purpose`` for, and ``pip install <install>``."""
    try:
        return importlib.import_module(name)
    except ImportError as exc:
        raise DependencyError(
            f"{name} cannot be imported ({exc}); it is needed {purpose}; "
            f"hint: pip install {install!r}"
        ) from exc


__all__ = ["LazyModule", "ipc", "pa", "pq", "require"]

if TYPE_CHECKING:
    import pyarrow as pa
    import pyarrow.ipc as ipc
    import pyarrow.parquet as pq
else:
    pa = LazyModule("pyarrow", install="pyarrow>=15")
    ipc = LazyModule("pyarrow.ipc", install="pyarrow>=15")
    pq = LazyModule("pyarrow.parquet", install="pyarrow>=15")
