"""Iterating a `DataLoader`: one `LoaderIterator` per ``iter()`` over the parts it is given
(`Delivery`). A `BatchSource` reads from the `Cursor`'s position, the `DeviceFeed` moves
batches to the device, and each is checked (`SchemaCheck`), traced and counted
(`Cursor.advance`) only once it reaches the caller (`_deliver`).
"""

from __future__ import annotations

from collections.abc import Callable, Generator, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from detdata.base.errors import ConfigError
from detdata.base.types import IntArray
from detdata.datasets.base import Stream
from detdata.datasets.prefetch import CacheAhead
from detdata.loading.attest import Attestor
from detdata.loading.cursor import Cursor
from detdata.loading.options import DEFAULT_STEPS_AHEAD, DeviceFeed, ReadOptions
from detdata.loading.reading import RunSlice
from detdata.loading.sources import BatchSource
from detdata.loading.trace import RankTrace


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


class SchemaCheck:
    """Batches of a transformed stream keep the keys and dtypes of the first one delivered
    (for the loader's life), checked before a batch is counted."""

    def __init__(self) -> None:
        self._first: dict[str, str] | str | None = None

    def check(self, batch: Any, positions: Callable[[], IntArray]) -> None:
        """`ConfigError` naming ``positions()`` (the batch's) when ``batch`` differs."""
        found = _schema(batch)
        if self._first is None:
            self._first = found
            return
        if found != self._first:
            where = positions()
            raise ConfigError(
                f"transform output changed at the micro batch of positions "
                f"[{int(where[0])}, {int(where[-1])}]: {found} where earlier "
                f"batches had {self._first}; hint: return the same keys with the "
                "same dtypes for every sample"
            )


@dataclass(frozen=True)
class Delivery:
    """The parts an iteration uses, wired by the `DataLoader` (each owns its state)."""

    cursor: Cursor
    source: BatchSource
    device: DeviceFeed
    trace: RankTrace
    schema: SchemaCheck | None
    attestor: Attestor | None  # None: ResumePolicy(attest=False)
    read: ReadOptions


class LoaderIterator:
    """``iter(loader)``: its micro batches from ``samples_consumed`` on. Once superseded (a
    second ``iter()``, ``load_state_dict``), ``next()`` raises `StaleIteratorError`, never
    `StopIteration`: a training loop over a stale iterator fails, it does not end early."""

    def __init__(self, delivery: Delivery) -> None:
        self._cursor = delivery.cursor
        self._generation = delivery.cursor.generation
        self._batches = _iterate(delivery, self._generation)
        self._closed = False

    def __iter__(self) -> LoaderIterator:
        return self

    def __next__(self) -> Any:
        if self._closed:
            raise StopIteration  # ended on purpose: `close`, `DataLoader.close`
        if self._generation != self._cursor.generation:
            self._batches.close()
            raise self._cursor.stale()
        return next(self._batches)

    def close(self) -> None:
        """End this iteration now (its readers stop); later ``next()`` calls end it."""
        self._closed = True
        self._batches.close()


def _close(iterator: Iterator[Any], _generator: type[Generator[Any, Any, Any]] = Generator) -> None:
    # ``_generator`` keeps the type reachable when an unfinished iterator is finalized at
    # interpreter exit, after the module's globals are gone (the stdlib's ``__del__`` idiom)
    if isinstance(iterator, _generator):
        iterator.close()


def _iterate(d: Delivery, generation: int) -> Generator[Any, None, None]:
    """This rank's micro batches from ``samples_consumed`` on; a failure before a batch
    reaches the caller leaves ``samples_consumed`` at it. Leaving the loop closes the readers."""
    cursor = d.cursor
    close = _close  # reachable in ``finally`` at interpreter exit (see `_close`)
    batches: Iterator[Any] = iter(())
    iterator = batches
    cache_ahead = None
    clean = False
    try:  # from the start: torch's iter() itself can be interrupted
        pending = cursor.pending
        if pending is not None and d.attestor is not None:  # before the first batch is read
            d.attestor.verify(cursor.stream, pending)
            cursor.attested()
        while True:
            cursor.ask_controller()  # before the readers start: they read the stream in force
            stream = cursor.stream
            at = RunSlice(stream, cursor.layout, cursor.samples_consumed, cursor.stop())
            batches = iterator = d.source.batches(at)
            # after batches(): worker processes are forked by now
            cache_ahead = open_cache_ahead(cursor, d.read)
            iterator = d.device.feed(batches)
            if not (yield from _deliver(d, iterator, generation, cache_ahead, stream)):
                break
            # the mixture weights changed: drop what was read ahead, restart the readers
            if cache_ahead is not None:
                cache_ahead.close()
                cache_ahead = None
            _close(iterator)
            _close(batches)
            d.source.reset()
        clean = True
    except GeneratorExit:
        clean = True  # the caller stopped early (break): nothing is in flight in a broken state
        raise
    finally:
        if cache_ahead is not None:
            cache_ahead.close()
        close(iterator)
        close(batches)
        if not clean and generation == cursor.generation:
            d.source.reset()  # persistent workers may be mid-transfer: start fresh


def open_cache_ahead(cursor: Cursor, read: ReadOptions) -> CacheAhead | None:
    """A started `CacheAhead` of the next ``read.steps_ahead`` micro steps from the cursor's
    position, or None (off, or nothing cached)."""
    steps = DEFAULT_STEPS_AHEAD if read.steps_ahead is None else read.steps_ahead
    if not steps:
        return None
    per = cursor.layout.samples_per_micro_step
    stop = cursor.stop()
    plan = CacheAhead(
        cursor.stream,
        cursor.layout.positions,
        steps=steps,
        connections=read.steps_ahead_connections,
        stop=None if stop is None else -(-stop // per),
    )
    return plan if plan.active else None


def _deliver(
    d: Delivery,
    iterator: Iterator[Any],
    generation: int,
    cache_ahead: CacheAhead | None,
    stream: Stream,
) -> Generator[Any, None, bool]:
    """Yield ``iterator``'s batches (read from ``stream``), counting each; True when the
    stream in force changed (mixture weights: the caller restarts the readers), False at
    the end."""
    cursor = d.cursor
    per = cursor.layout.samples_per_micro_step
    while True:
        if generation != cursor.generation:
            raise cursor.stale()
        cursor.ask_controller()
        if cursor.stream is not stream:
            return True
        if cache_ahead is not None:
            cache_ahead.advance(cursor.samples_consumed // per)
        try:
            batch = next(iterator)
        except StopIteration:
            return False
        except Exception as exc:
            if generation == cursor.generation:
                _explain_failure(exc, d)
            raise
        if generation != cursor.generation:
            raise cursor.stale()  # the fetch itself loaded a state or started an iterator
        if d.schema is not None:
            d.schema.check(batch, cursor.positions_of_next)
        writer = d.trace.writer
        if writer is not None:  # before counting: a failed trace write delivers nothing
            writer.add(
                cursor.samples_consumed, cursor.positions_of_next(), batch, span=cursor.step_span()
            )
        cursor.advance()
        yield batch


def _explain_failure(exc: Exception, d: Delivery) -> None:
    """Add where the failed fetch happened to ``exc`` (a note); a worker that died while
    handing a batch over raises torch's own error, explained, instead."""
    note = _failure_note(d)
    exc.add_note(note)
    processes = d.source.in_processes
    if processes and _died_in_hand_over(exc):
        raise RuntimeError(
            "a DataLoader worker process exited unexpectedly while handing over "
            f"a batch (the transfer socket failed: {type(exc).__name__}: {exc}); "
            f"{note}; hint: a worker killed mid hand-over (OOM "
            "killer?); rerun with num_workers=0 to see any error in the main "
            "process"
        ) from exc
    if isinstance(exc, (ConnectionError, EOFError)) and processes:
        exc.add_note(
            "hint: torch hands batches over from worker processes through "
            "sockets; unless the dataset itself raised this, a worker "
            "process probably died mid hand-over (OOM killer?); rerun "
            "with num_workers=0 to see any error in the main process"
        )


def _died_in_hand_over(exc: BaseException) -> bool:
    """A socket error from torch's transfer, not one a dataset raised in a worker (those
    travel as values and carry the worker's traceback note, see `reading.portable`)."""
    if not isinstance(exc, (ConnectionError, EOFError)):
        return False
    notes = getattr(exc, "__notes__", [])
    return not any("raised in DataLoader worker process" in n for n in notes)


def _failure_note(d: Delivery) -> str:
    """Where a failed fetch happened: rank, step and positions of the undelivered batch."""
    cursor = d.cursor
    positions = cursor.positions_of_next()
    grouped = ""
    if d.source.in_processes and d.read.batches_ahead > 1:
        grouped = (
            f"; worker processes read groups of {d.read.batches_ahead} micro batches, so a "
            "worker that hung or died did so somewhere in the group starting here"
        )
    layout = cursor.layout
    return (
        f"(detdata.DataLoader rank {layout.rank}/{layout.world_size}: failed while "
        f"fetching the micro batch at global positions [{int(positions[0])}, "
        f"{int(positions[-1])}] of step {cursor.step}; samples_consumed is still "
        f"{cursor.samples_consumed}, so state_dict() resumes at this batch{grouped})"
    )
