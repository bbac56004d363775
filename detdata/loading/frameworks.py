"""Framework watchers: how integration code sees the calls a user makes to a training framework
without a line of detdata glue (docs: README, per framework).

Some mistakes are only visible from the framework's side: accelerate's
``Accelerator.load_state`` resumes the model and optimizer but not a detdata loader that was
never registered for checkpointing, and nothing of that call reaches the loader. A
`FrameworkWatcher` closes the gap in two declared moments of every loader and sampler:

- ``built()``: a `detdata.DataLoader` or a detdata batch sampler was just built (the watcher
  starts watching the frameworks imported by then, e.g. wraps ``load_state``);
- ``check_start(loader)``: a `detdata.DataLoader` at position 0 starts an iteration (its
  first batch): the watcher raises (a `DetdataError`) if a framework says the run resumes.

Watchers are registered by the package's top level (``detdata/__init__.py``), so this layer
imports no integration; the registry is process-wide and a watcher is added once.
"""

from __future__ import annotations

from typing import Protocol

__all__ = ["FrameworkWatcher", "add_watcher", "built", "check_start"]


class FrameworkWatcher(Protocol):
    """What a framework integration watches (see the module doc)."""

    def built(self) -> None:
        """A detdata loader or sampler was built (cheap: called for every one)."""

    def check_start(self, loader: object) -> None:
        """A `detdata.DataLoader` at position 0 starts an iteration; raise to refuse it."""


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
