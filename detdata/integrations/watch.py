"""The `detdata.loading.frameworks` watcher the package registers: it starts the watch of each
supported framework that is imported by the time a detdata loader or sampler is built.

Importing this module imports no framework: a framework's integration module is imported (and
its watch started) only once the framework itself is in ``sys.modules``. Today: accelerate
(`detdata.integrations.accelerate`: ``Accelerator.load_state`` resuming a run whose detdata
loader it does not checkpoint). The other integrations check inside the code the user adds
(`DetdataSteps`, `DetdataTrainer`, the torchtitan and OLMo-core loaders).
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Final

from detdata.loading.frameworks import FrameworkWatcher

__all__ = ["WATCHER", "ImportedFrameworks"]


def _accelerate() -> FrameworkWatcher:
    from detdata.integrations.accelerate import start_watch

    return start_watch()


#: (the framework's module, what starts its watch)
_FRAMEWORKS: Final[tuple[tuple[str, Callable[[], FrameworkWatcher]], ...]] = (
    ("accelerate.accelerator", _accelerate),
)


class ImportedFrameworks:
    """A `FrameworkWatcher` over the watches of the frameworks imported so far."""

    def __init__(self) -> None:
        self._started: dict[str, FrameworkWatcher] = {}

    def built(self) -> None:
        for module, start in _FRAMEWORKS:
            if module not in self._started and module in sys.modules:
                self._started[module] = start()
        for watcher in tuple(self._started.values()):
            watcher.built()

    def check_start(self, loader: object) -> None:
        for watcher in tuple(self._started.values()):
            watcher.check_start(loader)


#: the one instance ``detdata/__init__.py`` registers
WATCHER: Final = ImportedFrameworks()
