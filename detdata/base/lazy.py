"""Modules imported at first use, so that ``import detdata`` stays light.

pyarrow (about 170 MB, ~0.3 s to import) is needed only where Parquet / Arrow tables are read;
a user with ``.npy`` or Megatron tokens never imports it. `lazy_module` returns a stand-in
module whose first attribute access imports the real one; a module that cannot be imported
raises `DependencyError` naming it, why, and the ``pip install`` that fixes it.
"""

from __future__ import annotations

import importlib
import types
from typing import Any

from detdata.base.errors import DependencyError


class LazyModule(types.ModuleType):
    """``name``, imported on the first attribute access (then every access is the real one)."""

    def __init__(self, name: str, *, install: str) -> None:
        super().__init__(name)
        self._lazy_install = install
        self._lazy_module: types.ModuleType | None = None

    def _load(self) -> types.ModuleType:
        if self._lazy_module is None:
            try:
                self._lazy_module = importlib.import_module(self.__name__)
            except ImportError as exc:
                raise DependencyError(
                    f"{self.__name__} cannot be imported ({exc}); it is needed to read Parquet / "
                    f"Arrow tables; hint: pip install {self._lazy_install!r}"
                ) from exc
        return self._lazy_module

    def __getattr__(self, attr: str) -> Any:
        if attr.startswith("_lazy_"):
            raise AttributeError(attr)
        return getattr(self._load(), attr)


def lazy_module(name: str, *, install: str) -> Any:
    """A stand-in for module ``name`` that imports it at first use (see `LazyModule`)."""
    return LazyModule(name, install=install)
