"""The `detdata.loading.frameworks` watcher the package registers: it starts the watch of each
supported framework (accelerate, PyTorch Lightning as ``pytorch_lightning`` or
``lightning.pytorch``) as soon as both detdata and the framework are imported, in either order.

Importing this module imports no framework. One imported later than detdata is watched right
after its top-level package finishes importing (`_AfterImport` on ``sys.meta_path``).
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import sys
import types
from collections.abc import Callable, Sequence
from typing import Any, Final

from detdata.base.redact import get_logger

__all__ = ["WATCHER", "ImportedFrameworks", "wrap_once"]

log: Final = get_logger("detdata")
#: set on each wrapper (`wrap_once`), so that each method is wrapped once
_MARK: Final = "__detdata_watch__"


#: the framework's top-level package -> (the integration module, its ``start_watch`` arguments);
#: ``lightning`` imports ``lightning.pytorch`` from its ``__init__``.
_FRAMEWORKS: Final[dict[str, tuple[str, tuple[str, ...]]]] = {
    "accelerate": ("detdata.integrations.accelerate", ()),
    "pytorch_lightning": ("detdata.integrations.lightning", ("pytorch_lightning",)),
    "lightning": ("detdata.integrations.lightning", ("lightning.pytorch",)),
}


class ImportedFrameworks:
    """A `FrameworkWatcher` over the frameworks imported so far: each integration's
    ``start_watch`` returns its check of a loader's start, or None."""

    def __init__(self) -> None:
        self._started: dict[str, Callable[[object], None] | None] = {}
        self._finder: _AfterImport | None = None

    def built(self) -> None:
        """Start the watch of every framework imported by now; the first call (at ``import
        detdata``) also adds the finder that starts the others when they are imported."""
        for module in _FRAMEWORKS:
            if module in sys.modules:
                self._start(module)
        if self._finder is None:
            self._finder = _AfterImport(
                [m for m in _FRAMEWORKS if m not in self._started], self._start
            )

    def check_start(self, loader: object) -> None:
        for check in tuple(self._started.values()):
            if check is not None:
                check(loader)

    def _start(self, module: str) -> None:
        if module not in self._started:
            integration, args = _FRAMEWORKS[module]
            self._started[module] = importlib.import_module(integration).start_watch(*args)


def wrap_once(
    owner: type, name: str, wrap: Callable[[Callable[..., Any]], Callable[..., Any]]
) -> None:
    """Replace the method ``name`` of ``owner`` with ``wrap(method)``, once per process (the
    wrapper is marked)."""
    original = getattr(owner, name)
    if not getattr(original, _MARK, False):
        wrapped = wrap(original)
        setattr(wrapped, _MARK, True)
        setattr(owner, name, wrapped)


class _AfterImport(importlib.abc.MetaPathFinder):
    """Calls ``after(name)`` once each top-level package of ``names`` has been imported: the
    other finders find its spec, whose loader's ``exec_module`` is wrapped (the module gets the
    original loader back before its code runs); on ``sys.meta_path`` until every name is seen."""

    def __init__(self, names: Sequence[str], after: Callable[[str], None]) -> None:
        self._pending = set(names)
        self._after = after
        if self._pending:
            sys.meta_path.insert(0, self)

    def find_spec(
        self,
        fullname: str,
        path: Sequence[str] | None,
        target: types.ModuleType | None = None,
    ) -> importlib.machinery.ModuleSpec | None:
        if fullname not in self._pending:
            return None
        self._pending.discard(fullname)  # once; also keeps the search below from recursing
        if not self._pending and self in sys.meta_path:
            sys.meta_path.remove(self)
        spec = importlib.util.find_spec(fullname)  # the other finders: this one now answers None
        if spec is not None and spec.loader is not None and hasattr(spec.loader, "exec_module"):
            spec.loader = _ThenStart(spec.loader, spec, lambda: self._started(fullname))
        return spec

    def _started(self, name: str) -> None:
        try:
            self._after(name)
        except Exception as exc:  # the user's import must not fail for detdata's watch
            log.warning(
                "detdata: could not start the watch of %s after its import (%s: %s): resumes "
                "through it are not checked by detdata; hint: import %s before building a "
                "detdata loader",
                name,
                type(exc).__name__,
                exc,
                name,
            )


class _ThenStart(importlib.abc.Loader):
    """``loader`` with ``then()`` run after its ``exec_module`` (nothing after sees this)."""

    def __init__(
        self,
        loader: importlib.abc.Loader,
        spec: importlib.machinery.ModuleSpec,
        then: Callable[[], None],
    ) -> None:
        self._loader = loader
        self._spec = spec
        self._then = then

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> types.ModuleType | None:
        return self._loader.create_module(spec)

    def exec_module(self, module: types.ModuleType) -> None:
        self._spec.loader = self._loader
        module.__loader__ = self._loader
        self._loader.exec_module(module)
        self._then()


#: the one instance ``detdata/__init__.py`` registers
WATCHER: Final = ImportedFrameworks()
