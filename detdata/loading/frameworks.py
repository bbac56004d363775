"""Framework watchers: how integration code sees the calls a user makes to a training framework
(e.g. accelerate's ``load_state`` resuming everything but an unregistered detdata loader).

A `FrameworkWatcher` is told of two moments: ``built()`` (a detdata loader or batch sampler was
built) and ``check_start(loader)`` (a loader at position 0 starts its first batch: raise a
`DetdataError` if a framework says the run resumes). Watchers are registered by
``detdata/__init__.py``, so this layer imports no integration.
"""

from __future__ import annotations

from typing import Protocol


class FrameworkWatcher(Protocol):
    """What a framework integration watches (see the module doc); ``built`` must be cheap."""

    def built(self) -> None: ...

    def check_start(self, loader: object) -> None: ...


_WATCHERS: list[FrameworkWatcher] = []


def add_watcher(watcher: FrameworkWatcher) -> None:
    """Register ``watcher`` (once: the same object again is ignored)."""
    if not any(w is watcher for w in _WATCHERS):
        _WATCHERS.append(watcher)


def built() -> None:
    """Tell every watcher a detdata loader or sampler was built."""
    for watcher in tuple(_WATCHERS):
        watcher.built()


def check_start(loader: object) -> None:
    """Every watcher checks a loader that starts at position 0 (raises to refuse it)."""
    for watcher in tuple(_WATCHERS):
        watcher.check_start(loader)
