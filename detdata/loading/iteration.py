"""Iterating a `DataLoader`: reading groups of micro batches, the worker lifecycle, delivery.

A sampler yields the positions of this rank's micro batches (`Layout`) in groups of
``read_ahead``; a map-style dataset turns a whole group into batches with one batched read
(`GroupReader`). With process workers these go to torch's public ``DataLoader``, which
handles workers, prefetching and pinning; with ``num_workers=0`` the same sampler, reader
and collate run inline (torch's per-batch plumbing cost more than the read; the shard files
of the next groups are read in the background there, `Iteration._inline_batches`), and
``worker_mode="thread"`` runs them on reader threads. A batch is counted only once it
reaches the caller (`Iteration._deliver`).
"""

from __future__ import annotations

import collections
import functools
import random
import signal
from collections.abc import Callable, Generator, Iterator, Mapping
from typing import Any, Final

import numpy as np
import torch
import torch.utils.data as tud

from detdata.base.errors import ConfigError
from detdata.base.types import IntArray
from detdata.datasets.prefetch import Lookahead
from detdata.loading.arguments import WorkerMode
from detdata.loading.loader_base import LoaderBase
from detdata.loading.reading import (
    GroupReader,
    GroupSampler,
    PositionDataset,
    ReadAhead,
    SlotSampler,
)
from detdata.loading.slots import SlotGroup, SlotTransport
from detdata.loading.torch_workers import WorkerLoader
from detdata.order.rng import worker_seed
from detdata.storage.fileread import set_read_threads

#: Groups of micro batches the inline loader (``num_workers=0``) hints to the stream ahead
#: of the one it reads (`Iteration._inline_batches`).
PREFETCH_GROUPS: Final = 2


def seed_globals(seed64: int) -> None:
    """Seed python, numpy-legacy and torch global generators from one 64-bit value."""
    random.seed(seed64)
    np.random.seed(seed64 % (1 << 32))
    torch.manual_seed(seed64 % (1 << 63))


def _init_worker(
    seed: int, rank: int, user_init: Callable[[int], None] | None, worker_id: int
) -> None:
    # a terminal's Ctrl-C (SIGINT to the process group) is for the main process, which
    # keeps or replaces the workers (`Iteration._loader_from_here`): a kept worker that died
    # of it would cost the next iteration torch's "worker exited unexpectedly" error
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    seed_globals(worker_seed(seed, rank, worker_id))
    set_read_threads(1)  # the worker processes read side by side (never changes a byte)
    if user_init is not None:
        user_init(worker_id)


def _schema(batch: Any) -> dict[str, str] | str:
    """Keys and element types of a delivered batch (shapes excluded: a collate may pad)."""
    if not isinstance(batch, Mapping):
        return type(batch).__name__
    out = {}
    for key, value in batch.items():
        if isinstance(value, torch.Tensor):
            out[str(key)] = str(value.dtype)
        elif isinstance(value, np.ndarray):
            out[str(key)] = value.dtype.str
        else:
            out[str(key)] = type(value).__name__
    return dict(sorted(out.items()))


def _identity(item: Any) -> Any:
    return item


class LoaderIterator:
    """One iteration of a `DataLoader` (what ``iter(loader)`` returns): its micro batches from
    ``samples_consumed`` on. Once superseded (a second ``iter()``, ``load_state_dict``), every
    further ``next()`` raises `StaleIteratorError` (its readers are released at the first),
    never `StopIteration`: a training loop over a stale iterator fails, it does not end early."""

    def __init__(self, loader: Iteration, generation: int) -> None:
        self._loader = loader
        self._generation = generation
        self._batches = loader._iterate(generation)
        self._closed = False

    def __iter__(self) -> LoaderIterator:
        return self

    def __next__(self) -> Any:
        if self._closed:
            raise StopIteration  # ended on purpose: `close`, `DataLoader.close`
        if self._generation != self._loader._generation:
            self._batches.close()
            raise self._loader._stale()
        return next(self._batches)

    def close(self) -> None:
        """End this iteration now (its readers and worker processes stop); `DataLoader.close`
        calls it for every live iterator. Later ``next()`` calls end the iteration."""
        self._closed = True
        self._batches.close()


class Iteration(LoaderBase):
    """The `DataLoader`'s iteration: groups read inline, on threads or in worker processes
    (kept between iterations with ``persistent_workers`` when that is safe), moved to the
    device, checked, traced and counted as they reach the caller."""

    # ------------------------------------------------------ torch's DataLoader
    def _build(self) -> tud.DataLoader[Any]:
        args = (self.layout, self._consumed, self._stop(), self.read_ahead)
        if self._slot_transfer and self._collate_fn is None:
            # groups come back through reused shared-memory slots (detdata.loading.slots)
            transport = SlotTransport(self.num_workers, self._prefetch_factor)
            self._sampler = SlotSampler(*args, transport)
        else:
            self._sampler = GroupSampler(*args)
        return WorkerLoader(  # torch's, safe from a Ctrl-C in an iterator's start
            self._reader(in_worker=True),
            batch_size=None,
            sampler=self._sampler,
            collate_fn=_identity,
            worker_init_fn=functools.partial(
                _init_worker, self.seed, self.layout.rank, self._user_worker_init
            ),
            **self._torch_kwargs,
        )

    def _loader_from_here(self) -> tud.DataLoader[Any]:
        """torch's DataLoader for an iteration from ``samples_consumed``: the persistent one
        when its workers were left between two groups, else a new one (new workers): a call
        into torch's iterator that was interrupted (`_workers_busy`; Ctrl-C in its ``_reset``
        leaves ``_ResumeIteration`` replies queued, one in ``next`` a half-received group) leaves
        them in a state no later iteration can trust. The old loader's workers are shut down
        by torch when it is collected."""
        persistent = self._torch_kwargs["persistent_workers"]
        if self._torch_loader is None or not persistent or self._workers_busy:
            self._torch_loader = None  # before building: an interrupted build rebuilds again
            self._torch_loader = self._build()
            self._workers_busy = False
        else:
            assert self._sampler is not None  # built together with the loader
            self._sampler.start = self._consumed
        return self._torch_loader

    @property
    def _threaded(self) -> bool:
        return self.worker_mode is WorkerMode.THREAD and self.num_workers > 0

    @property
    def _process_workers(self) -> bool:
        return self.num_workers > 0 and not self._threaded

    def _reader(self, *, in_worker: bool) -> GroupReader:
        # worker processes: torch's pin-memory thread pins in the main process
        # (ReadAhead.pin_memory)
        pin = (
            not in_worker and self._pin_memory and torch.cuda.is_available() and self.device is None
        )
        return GroupReader(
            PositionDataset(self._stream, self._transform, self.seed),
            self._collate_fn,
            pin,
            in_worker,
        )

    def _groups(self) -> Iterator[list[IntArray]]:
        return iter(GroupSampler(self.layout, self._consumed, self._stop(), self.read_ahead))

    # ----------------------------------------------------------- batch sources
    def _inline_batches(self) -> Iterator[Any]:
        """``num_workers=0``: the same reader as the workers', without torch's per-batch
        plumbing. The order is known ahead, so the next `PREFETCH_GROUPS` groups are
        hinted to the stream before a group's batches are delivered
        (`GroupReader.prefetch`): a dataset that takes the hint reads their files in the
        background meanwhile (the same bytes and checks; dropped when the loop ends)."""
        read = self._reader(in_worker=False)
        groups = self._groups()
        ahead: collections.deque[list[IntArray]] = collections.deque()
        try:
            while True:
                while len(ahead) <= PREFETCH_GROUPS and (group := next(groups, None)):
                    read.prefetch(group)
                    ahead.append(group)
                if not ahead:
                    return
                result = read(ahead.popleft())
                yield from result.deliver()
        finally:
            read.prefetch(None)

    def _thread_batches(self) -> Iterator[Any]:
        """Reads on ``num_workers`` threads of this process, in order (see `WorkerMode.THREAD`)."""
        from detdata.loading.threads import threaded_batches

        groups = threaded_batches(
            self._reader(in_worker=False),
            self._groups(),
            self.num_workers,
            self.num_workers * self._prefetch_factor,
        )
        try:
            for result in groups:
                yield from result.deliver()
        finally:
            # an error raised here must not leave the readers to the garbage collector
            groups.close()

    def _batches(self) -> Iterator[Any]:
        if self.num_workers == 0:
            return self._inline_batches()
        if self._threaded:
            return self._thread_batches()
        loader = self._loader_from_here()
        self._workers_busy = True
        groups = iter(loader)  # forks the workers, or torch's ``_reset`` of persistent ones
        return self._worker_batches(groups)

    def _worker_batches(self, groups: Iterator[ReadAhead | SlotGroup]) -> Iterator[Any]:
        """The batches of the groups torch's iterator returns. `_workers_busy` is False only
        while a batch is with the caller (the generator suspended at ``yield``: torch's iterator
        between two calls), so any interrupt or error inside torch or a group's hand-over leaves
        it True and the next iteration starts fresh workers (`_loader_from_here`)."""
        while True:
            self._workers_busy = True
            group = next(groups, None)
            if group is None:
                self._workers_busy = False
                return
            for batch in group.deliver():
                self._workers_busy = False
                yield batch
                self._workers_busy = True

    # ------------------------------------------------------------------ delivery
    def _iterate(self, generation: int) -> Generator[Any, None, None]:
        """This rank's micro batches from ``samples_consumed`` on.

        A batch is counted (and traced) only once it reaches the caller: any
        failure before that (read, transform, collate, device copy, trace, an
        interrupt) leaves ``samples_consumed`` at that batch. Leaving the loop
        early (``break``, an exception) closes the readers at once; after an
        abnormal end, or an interrupt anywhere inside torch's iterator (its
        creation and reset included, `_workers_busy`), persistent worker
        processes are replaced on the next iteration (torch's iterator may be
        mid-transfer).
        """
        if generation != self._generation:
            raise self._stale()
        batches: Iterator[Any] = iter(())
        iterator = batches
        lookahead = None
        clean = False
        try:  # from the start: torch's iter() itself can be interrupted (see `_workers_busy`)
            batches = iterator = self._batches()
            lookahead = self._lookahead()  # after _batches(): worker processes are forked by now
            if self.device is not None:
                from detdata.loading.device import device_batches

                iterator = device_batches(batches, self.device, self.device_prefetch)
            yield from self._deliver(iterator, generation, lookahead)
            clean = True
        except GeneratorExit:
            clean = True  # the caller stopped early (break): nothing is in flight in a broken state
            raise
        finally:
            if lookahead is not None:
                lookahead.close()
            for it in (iterator, batches):
                close = getattr(it, "close", None)
                if close is not None:
                    close()
            if not clean and generation == self._generation:
                self._torch_loader = None  # persistent workers may be mid-transfer: start fresh
                self._sampler = None  # and its shared-memory slots (detdata.loading.slots) go

    def _lookahead(self) -> Lookahead | None:
        """A started `detdata.datasets.prefetch.Lookahead`, or None (off, or nothing cached)."""
        if not self.lookahead:
            return None
        per = self.layout.samples_per_micro_step
        stop = self._stop()  # micro step j begins at j * per + offset: stop before the bound
        plan = Lookahead(
            self._stream,
            self.layout.positions,
            steps=self.lookahead,
            connections=self.lookahead_connections,
            stop=None if stop is None else -(-stop // per),
        )
        return plan if plan.active else None

    def _deliver(
        self, iterator: Iterator[Any], generation: int, lookahead: Lookahead | None = None
    ) -> Iterator[Any]:
        per = self.layout.samples_per_micro_step
        while True:
            if generation != self._generation:
                raise self._stale()
            if lookahead is not None:
                lookahead.advance(self._consumed // per)
            try:
                batch = next(iterator)
            except StopIteration:
                return
            except Exception as exc:
                if generation == self._generation:
                    self._explain_failure(exc)
                raise
            if generation != self._generation:
                raise self._stale()  # the fetch itself loaded a state or started an iterator
            if self._transform is not None:
                self._check_schema(batch)
            if self._trace is not None:  # before counting: a failed trace write delivers nothing
                self._trace.add(
                    self._consumed, self.positions_of_next(), batch, span=self._step_span()
                )
            self._consumed += per
            yield batch

    def _explain_failure(self, exc: Exception) -> None:
        """Add where the failed fetch happened to ``exc`` (a note); a worker that died while
        handing a batch over raises torch's own error, explained, instead."""
        exc.add_note(self._failure_note())
        if self._died_in_hand_over(exc):
            raise RuntimeError(
                "a DataLoader worker process exited unexpectedly while handing over "
                f"a batch (the transfer socket failed: {type(exc).__name__}: {exc}); "
                f"{self._failure_note()}; hint: a worker killed mid hand-over (OOM "
                "killer?); rerun with num_workers=0 to see any error in the main "
                "process"
            ) from exc
        if isinstance(exc, (ConnectionError, EOFError)) and self._process_workers:
            exc.add_note(
                "hint: torch hands batches over from worker processes through "
                "sockets; unless the dataset itself raised this, a worker "
                "process probably died mid hand-over (OOM killer?); rerun "
                "with num_workers=0 to see any error in the main process"
            )

    def _check_schema(self, batch: Any) -> None:
        """Batches of a transformed stream keep the keys and dtypes of the first one delivered.

        A transform whose output keys or dtypes depend on the sample is refused within a
        micro batch by `apply_transform`; across micro batches (and worker processes) it
        is caught here, before the batch is counted.
        """
        found = _schema(batch)
        if self._schema is None:
            self._schema = found
            return
        if found != self._schema:
            positions = self.positions_of_next()
            raise ConfigError(
                f"transform output changed at the micro batch of positions "
                f"[{int(positions[0])}, {int(positions[-1])}]: {found} where earlier "
                f"batches had {self._schema}; hint: return the same keys with the "
                "same dtypes for every sample"
            )

    def _died_in_hand_over(self, exc: BaseException) -> bool:
        """A socket error from torch's transfer, not one a dataset raised in a worker (those
        travel as values and carry the worker's traceback note, see `reading.portable`)."""
        if not self._process_workers or not isinstance(exc, (ConnectionError, EOFError)):
            return False
        notes = getattr(exc, "__notes__", [])
        return not any("raised in DataLoader worker process" in n for n in notes)

    def _failure_note(self) -> str:
        """Where a failed fetch happened: rank, step and positions of the undelivered batch."""
        positions = self.positions_of_next()
        grouped = ""
        if self._process_workers and self.read_ahead > 1:
            grouped = (
                f"; worker processes read groups of {self.read_ahead} micro batches, so a "
                "worker that hung or died did so somewhere in the group starting here"
            )
        return (
            f"(detdata.DataLoader rank {self.layout.rank}/{self.layout.world_size}: failed while "
            f"fetching the micro batch at global positions [{int(positions[0])}, "
            f"{int(positions[-1])}] of step {self.step}; samples_consumed is still "
            f"{self._consumed}, so state_dict() resumes at this batch{grouped})"
        )

    def close(self) -> None:
        """End every live iterator (their reader threads and worker processes stop now),
        drop persistent workers and close the trace file. The loader can be iterated again."""
        self._supersede("close() ended the loader's iterators")
        for iterator in list(self._live):  # ended on purpose: they stop, they do not raise
            iterator.close()
        self._live.clear()
        self._torch_loader = None
        self._sampler = None  # its shared-memory slots are unmapped with it
        self._workers_busy = False
        if self._trace is not None:
            self._trace.close()
