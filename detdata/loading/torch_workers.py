"""Batches read in worker processes (`WorkerSource`: ``worker_mode="process"``): torch's
``DataLoader`` of worker processes, kept with ``persistent_workers`` when safe, started so a
Ctrl-C in an iterator's start surfaces only as ``KeyboardInterrupt`` (`WorkerLoader`; why:
docs/guarantees.md, ``_set_worker_pids should be called only once``, issue 40).
"""

from __future__ import annotations

import contextlib
import functools
import random
import signal
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import numpy as np
import torch
import torch.utils.data as tud
from torch.utils.data.dataloader import _BaseDataLoaderIter, _MultiProcessingDataLoaderIter

from detdata.loading.reading import GroupRead, GroupSampler, Reads, RunSlice, SlotSampler
from detdata.loading.slots import SlotGroup, SlotTransport
from detdata.order.rng import worker_seed
from detdata.storage.fileread import set_read_threads


def _init_worker(
    seed: int, rank: int, user_init: Callable[[int], None] | None, worker_id: int
) -> None:
    # a terminal's Ctrl-C is for the main process, which keeps or replaces the workers
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    # forked with SIGINT blocked (`_WorkerIterator`): one pending since is now discarded
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})
    seed64 = worker_seed(seed, rank, worker_id)  # python, numpy-legacy and torch globals
    random.seed(seed64)
    np.random.seed(seed64 % (1 << 32))
    torch.manual_seed(seed64 % (1 << 63))
    set_read_threads(1)  # the worker processes read side by side (never changes a byte)
    if user_init is not None:
        user_init(worker_id)


def _identity(item: Any) -> Any:
    return item


class WorkerSource:
    """Groups read in worker processes by torch's ``DataLoader``, handed over through
    shared-memory slots with the default collate (`detdata.loading.slots`) or as one tensor
    per column. Kept (``persistent_workers``) only as `_loader_for` says."""

    in_processes = True

    def __init__(
        self,
        reads: Reads,
        torch_kwargs: Mapping[str, Any],
        worker_init_fn: Callable[[int], None] | None,
    ) -> None:
        """``torch_kwargs``: torch's DataLoader keywords as given; ``worker_init_fn`` runs in
        each worker after its globals are seeded from ``reads.seed``, the rank and the worker
        id."""
        self._reads = reads
        self._user_init = worker_init_fn
        self._torch_kwargs = dict(torch_kwargs)
        self._persistent = bool(torch_kwargs.get("persistent_workers"))
        self._depth = torch_kwargs.get("prefetch_factor", 2)  # groups per worker
        self._loader: tud.DataLoader[Any] | None = None
        self._groups: GroupSampler | None = None  # the sampler (or the slots') of `_loader`
        self._transport: SlotTransport | None = None
        self._built_for: RunSlice | None = None
        self._busy = False  # see `_worker_batches`

    @property
    def transport(self) -> SlotTransport | None:
        """The workers' shared-memory slots (None: none started, or a ``collate_fn``)."""
        return self._transport

    def batches(self, at: RunSlice) -> Iterator[Any]:
        loader = self._loader_for(at)
        self._busy = True
        groups = iter(loader)  # forks the workers, or torch's ``_reset`` of persistent ones
        return self._worker_batches(groups)

    def reset(self) -> None:
        """Drop the workers (kept or not) and their slots: the next iteration starts fresh
        ones (torch shuts the old ones down when their loader is collected)."""
        self._loader = self._groups = self._transport = self._built_for = None
        self._busy = False

    def _loader_for(self, at: RunSlice) -> tud.DataLoader[Any]:
        """The persistent loader when its workers were left between two groups of the same
        stream, layout and bound (its sampler moved to ``at.start``), else a new one."""
        kept = self._built_for
        same = (
            kept is not None
            and kept.stream is at.stream
            and (kept.layout, kept.stop) == (at.layout, at.stop)
        )
        if self._loader is None or not self._persistent or self._busy or not same:
            self.reset()  # before building: an interrupted build rebuilds again
            self._loader = self._build(at)
            self._built_for = at
        else:
            assert self._groups is not None  # built together with the loader
            self._groups.start = at.start
        return self._loader

    def _build(self, at: RunSlice) -> tud.DataLoader[Any]:
        self._groups = at.groups(self._reads.batches_ahead)
        sampler: GroupSampler | SlotSampler = self._groups
        if self._reads.collate_fn is None:
            # groups come back through reused shared-memory slots (detdata.loading.slots)
            self._transport = SlotTransport(self._torch_kwargs["num_workers"], self._depth)
            sampler = SlotSampler(self._groups, self._transport)
        return WorkerLoader(  # torch's, safe from a Ctrl-C in an iterator's start
            self._reads.reader(at.stream, in_worker=True),
            batch_size=None,
            sampler=sampler,
            collate_fn=_identity,
            worker_init_fn=functools.partial(
                _init_worker, self._reads.seed, at.layout.rank, self._user_init
            ),
            **self._torch_kwargs,
        )

    def _worker_batches(self, groups: Iterator[GroupRead | SlotGroup]) -> Iterator[Any]:
        """The batches of ``groups``; ``_busy`` is False only while a batch is with the caller,
        so an interrupt or error inside torch leaves it True: the persistent workers' state is
        then unknown (`_loader_for`)."""
        while True:
            self._busy = True
            group = next(groups, None)
            if group is None:
                self._busy = False
                return
            for batch in group.deliver():
                self._busy = False
                yield batch
                self._busy = True


class WorkerLoader(tud.DataLoader[Any]):
    """torch's ``DataLoader`` whose worker-process iterators are `_WorkerIterator`."""

    def _get_iterator(self) -> _BaseDataLoaderIter:
        self.check_worker_number_rationality()
        return _WorkerIterator(self)


class _WorkerIterator(_MultiProcessingDataLoaderIter):
    """torch's worker-process iterator whose start leaves no registration behind: an entry
    under its address can only be a dead iterator's, dropped first; a start that raises drops
    its own and gives torch's finaliser ``_workers_status`` to shut down started workers."""

    def __init__(self, loader: tud.DataLoader[Any]) -> None:
        _drop_worker_pids(id(self))
        # the workers are forked with SIGINT blocked (the mask is inherited): a terminal's
        # Ctrl-C reaching one before its `_init_worker` ignores it would end it
        blocked = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
        try:
            super().__init__(loader)
        except BaseException:
            _drop_worker_pids(id(self))
            self._worker_pids_set = False
            fields = vars(self)
            fields.setdefault("_workers_status", [False] * len(fields.get("_workers", ())))
            raise
        finally:
            signal.pthread_sigmask(signal.SIG_SETMASK, blocked)


def _drop_worker_pids(key: int) -> None:
    """Remove the worker pids registered under ``key`` (none registered: nothing to do)."""
    # torch raises "Cannot find worker information for _BaseDataLoaderIter ..." when none is
    with contextlib.suppress(ValueError):
        torch._C._remove_worker_pids(key)
