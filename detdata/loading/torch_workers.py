"""torch's ``DataLoader`` of worker processes, started so that a Ctrl-C anywhere in an
iterator's start surfaces as ``KeyboardInterrupt`` only (`WorkerLoader`).

torch registers an iterator's worker pids in a process-wide table keyed by ``id(iterator)``
(``torch._C._set_worker_pids``, which refuses a key already there) and removes them at
shutdown only when the iterator's ``_worker_pids_set`` flag was set. A ``KeyboardInterrupt``
between the registration and the flag (or inside the shutdown itself) leaves the entry
behind, and a later iterator that CPython places at the same address then fails its start
with ``ValueError: _set_worker_pids should be called only once for each
_BaseDataLoaderIter`` (issue 40: about one run in four under repeated Ctrl-C).
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch
import torch.utils.data as tud
from torch.utils.data.dataloader import _BaseDataLoaderIter, _MultiProcessingDataLoaderIter


class WorkerLoader(tud.DataLoader[Any]):
    """torch's ``DataLoader``; with worker processes, its iterators are `_WorkerIterator`."""

    def _get_iterator(self) -> _BaseDataLoaderIter:
        if self.num_workers == 0:
            return super()._get_iterator()
        self.check_worker_number_rationality()
        return _WorkerIterator(self)


class _WorkerIterator(_MultiProcessingDataLoaderIter):
    """torch's worker-process iterator whose start leaves no registration behind.

    An entry under a new iterator's address can only be a dead iterator's leftover (two live
    objects never share an address): it is dropped before the start, so no leftover, however
    it came about, fails a later start. A start that raises (a Ctrl-C in it) drops its own
    entry at once, and gives torch's finaliser what it needs to shut down the workers
    already started (``_workers_status``, which only the first ``_reset`` sets), so the
    interrupt is the only thing the caller sees.
    """

    def __init__(self, loader: tud.DataLoader[Any]) -> None:
        _drop_worker_pids(id(self))
        try:
            super().__init__(loader)
        except BaseException:
            _drop_worker_pids(id(self))
            self._worker_pids_set = False
            fields = vars(self)
            fields.setdefault("_workers_status", [False] * len(fields.get("_workers", ())))
            raise


def _drop_worker_pids(key: int) -> None:
    """Remove the worker pids registered under ``key`` (none registered: nothing to do)."""
    # torch raises "Cannot find worker information for _BaseDataLoaderIter ..." when none is
    with contextlib.suppress(ValueError):
        torch._C._remove_worker_pids(key)
