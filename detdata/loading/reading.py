"""Reading groups of positions: from a group of micro batches to delivered batches.

`GroupSampler` yields this rank's micro-batch positions in groups of ``batches_ahead``;
`GroupReader` reads a group with one batched read (a fetch plus the per-sample
transform) and splits it into a `GroupRead` (or, with `SlotSampler`, a
`SlotGroup` in a shared-memory slot). Delivered batches own their memory (`owned`).
"""

from __future__ import annotations

import dataclasses
import inspect
import itertools
import os
import pickle
import traceback
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any, Final

import numpy as np
import torch
import torch.utils.data as tud

from detdata.base.errors import ConfigError
from detdata.base.redact import get_logger
from detdata.base.types import Batch, IntArray
from detdata.datasets.base import Stream
from detdata.datasets.batch_columns import is_ragged, restack, to_torch
from detdata.datasets.capabilities import hint_read_ahead
from detdata.loading.layout import Layout
from detdata.loading.slots import (
    Receipt,
    SlotGroup,
    SlotTask,
    SlotTransport,
    settle,
    write_slot,
)
from detdata.order.rng import sample_rng

log = get_logger("detdata.loader")

#: ``transform(sample, rng)``, or ``transform(sample)`` for a transform without randomness.
Transform = (
    Callable[[dict[str, np.ndarray], np.random.Generator], Mapping[str, Any]]
    | Callable[[dict[str, np.ndarray]], Mapping[str, Any]]
)
_POSITIONAL: Final = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)


def takes_rng(transform: Callable[..., Any]) -> bool:
    """Does ``transform`` take a generator: a second positional parameter (with or without a
    default) or ``*args``? A transform of one positional parameter, ``transform(sample)``,
    is called without one (building a sample's generator costs ~25 us, more than many
    transforms). A callable whose signature cannot be read gets one."""
    try:
        params = list(inspect.signature(transform).parameters.values())
    except (TypeError, ValueError):
        return True
    if any(p.kind is inspect.Parameter.VAR_POSITIONAL for p in params):
        return True
    return sum(p.kind in _POSITIONAL for p in params) >= 2


def apply_transform(
    batch: Batch, positions: IntArray, transform: Transform, seed: int, *, rng: bool = True
) -> Batch:
    """Apply ``transform(sample, rng)`` (``transform(sample)`` when ``rng`` is False) to each
    sample with its position's generator, and restack; every output must have the first
    one's keys (`ConfigError` naming the position)."""
    outs: list[Mapping[str, Any]] = []
    call: Callable[..., Mapping[str, Any]] = transform  # one of the two `Transform` shapes
    for i in range(len(positions)):
        sample = {k: v[i] for k, v in batch.items()}
        result = call(sample, sample_rng(seed, int(positions[i]))) if rng else call(sample)
        if not isinstance(result, Mapping):
            raise ConfigError(
                f"transform must return a mapping of column -> array, got "
                f"{type(result).__name__} for position {int(positions[i])}"
            )
        if outs and result.keys() != outs[0].keys():
            raise ConfigError(
                f"transform returned keys {sorted(map(str, result))} at position "
                f"{int(positions[i])} but {sorted(map(str, outs[0]))} at position "
                f"{int(positions[0])}; every sample must have the same keys; hint: "
                "return every key for every sample (a placeholder if needed)"
            )
        outs.append(result)
    if not outs:
        return batch
    return {
        k: restack([o[k] for o in outs], k, positions, ragged=is_ragged(batch.get(k)))
        for k in outs[0]
    }


class GroupSampler(tud.Sampler[list[IntArray]]):
    """Groups of up to ``size`` consecutive micro batches (position arrays) from ``start``."""

    def __init__(self, layout: Layout, start: int, stop: int | None, size: int) -> None:
        self.layout = layout
        self.start = start
        self.stop = stop
        self.size = size

    def __iter__(self) -> Iterator[list[IntArray]]:
        per = self.layout.samples_per_micro_step
        steps: Iterator[int] = itertools.count(self.start // per)
        if self.stop is not None:  # the micro steps that begin before ``stop``
            steps = iter(range(self.start // per, -(-self.stop // per)))
        micro = map(self.layout.positions, steps)
        while group := list(itertools.islice(micro, self.size)):
            yield group


class SlotSampler(tud.Sampler[SlotTask]):
    """A `GroupSampler`'s groups as `SlotTask` objects naming a free slot of ``transport``."""

    def __init__(self, groups: GroupSampler, transport: SlotTransport) -> None:
        self.groups = groups
        self.transport = transport

    def __iter__(self) -> Iterator[SlotTask]:
        self.transport.reset()  # torch starts a pass: the tasks of an earlier one are done
        for group in self.groups:
            yield self.transport.task(group)


@dataclass(frozen=True)
class GroupRead:
    """Micro batches of one group read, and the error that stopped the group (if any)."""

    batches: list[Any]
    error: BaseException | None
    views: bool = False  # batches are views of one group tensor (the default collate's transfer)
    receipt: Receipt | None = None  # from a worker given a shared-memory slot (`slots`)

    def deliver(self) -> Iterator[Any]:
        """Each micro batch, owning its memory (views of the group are copied out of it)."""
        if self.receipt is not None:
            settle(self.receipt)  # this group took torch's transfer: its slot is free
        for batch in self.batches:
            yield owned(batch) if self.views else batch
        if self.error is not None:
            raise self.error

    def pin_memory(self) -> GroupRead:
        """Called by torch's pin-memory thread for groups coming from worker processes."""
        if self.receipt is not None:
            settle(self.receipt)
        return GroupRead([pin(b) for b in self.batches], self.error)  # pinning copies: owned


def portable(exc: BaseException) -> BaseException:
    """``exc`` with its traceback as a note (or a RuntimeError with its text if it cannot be
    pickled): a worker returns a failed group's error as a value, which must pickle."""
    text = "".join(traceback.format_exception(exc))
    try:
        pickle.loads(pickle.dumps(exc))
    except Exception:
        clone: BaseException = RuntimeError(f"{type(exc).__name__}: {exc}")
    else:
        clone = exc
    clone.add_note(f"(raised in DataLoader worker process {os.getpid()}):\n{text}")
    return clone


def rows(batch: Any, a: int, b: int) -> Any:
    """Rows ``[a, b)`` of every column (views; see `owned`)."""
    if isinstance(batch, (torch.Tensor, np.ndarray, list)):
        return batch[a:b]
    if isinstance(batch, Mapping):
        return {k: rows(v, a, b) for k, v in batch.items()}
    return batch


def own_copy(tensor: torch.Tensor) -> torch.Tensor:
    """A copy of ``tensor`` in memory of its own: a numpy copy of a contiguous CPU tensor's
    bytes, made by one thread (``clone()``, used otherwise, runs on torch's intra-op threads:
    on a busy machine a 0.5 MB copy then costs milliseconds, not microseconds)."""
    cpu = tensor.device.type == "cpu" and not tensor.requires_grad
    if not cpu or not tensor.is_contiguous() or tensor.numel() == 0:
        return tensor.clone()
    out = torch.empty_like(tensor, memory_format=torch.contiguous_format)
    np.copyto(_bytes(out), _bytes(tensor))
    return out


def _bytes(tensor: torch.Tensor) -> np.ndarray[Any, Any]:
    """The bytes of a contiguous CPU tensor (any dtype) as a uint8 array, not copied."""
    return tensor.reshape(-1).view(torch.uint8).numpy()


def owned(batch: Any) -> Any:
    """``batch`` with every tensor that views a larger buffer (its read-ahead group) copied:
    a delivered batch owns its memory (docs/design.md section 4)."""
    if isinstance(batch, torch.Tensor):
        return own_copy(batch) if batch.untyped_storage().nbytes() > batch.nbytes else batch
    if isinstance(batch, np.ndarray):
        return batch.copy() if batch.base is not None else batch
    if type(batch) is list:
        return [owned(v) for v in batch]
    if type(batch) is tuple:
        return tuple(owned(v) for v in batch)
    if type(batch) is dict:
        return {k: owned(v) for k, v in batch.items()}
    return batch


class GroupReader(tud.Dataset[GroupRead | SlotGroup]):
    """Reads a group of micro batches with one batched read, then splits it (see ``batches_ahead``).

    With the default collate the group is one tensor per column and each micro batch a view
    of it (one allocation, pinning and transfer per group); given a `SlotTask` it is written
    into that shared-memory slot instead (`detdata.loading.slots`). A failed group is read
    again batch by batch: the batches before the failing one are delivered and the error is
    raised exactly at the one that cannot be read.
    """

    def __init__(self, stream: Stream, reads: Reads, pin: bool, in_worker: bool) -> None:
        self.stream, self.reads = stream, reads
        self.pin, self.in_worker = pin, in_worker
        self.rng = reads.transform is not None and takes_rng(reads.transform)

    def _read(self, positions: IntArray) -> Batch:
        """The samples at ``positions`` (one batched fetch), each transformed."""
        batch = self.stream.fetch(positions)
        transform = self.reads.transform
        if transform is not None:
            batch = apply_transform(batch, positions, transform, self.reads.seed, rng=self.rng)
        return batch

    def _finish(self, raw: Any) -> Any:
        collate_fn = self.reads.collate_fn
        batch = to_torch(raw) if collate_fn is None else collate_fn(raw)
        return pin(batch) if self.pin else batch

    def _one_by_one(self, group: list[IntArray]) -> GroupRead:
        done: list[Any] = []
        for positions in group:
            try:
                done.append(self._finish(self._read(positions)))
            except Exception as exc:
                return GroupRead(done, portable(exc) if self.in_worker else exc)
        return GroupRead(done, None)

    def __getitem__(self, group: list[IntArray] | SlotTask) -> GroupRead | SlotGroup:
        if isinstance(group, SlotTask):
            return self._into_slot(group)
        return self(group)

    def _into_slot(self, task: SlotTask) -> GroupRead | SlotGroup:
        """A worker's read of a group into its shared-memory slot; a group that cannot use it
        is sent as on the plain path, with a receipt that frees the slot."""
        task.held()  # take the ring attached to this task, if any
        group = task.group
        bounds = _bounds(group)
        try:
            raw = self._read(group[0] if len(group) == 1 else np.concatenate(group))
            sent = write_slot(task, raw, bounds)
            if isinstance(sent, SlotGroup):
                return sent
            whole = to_torch(raw)
        except Exception as exc:
            if len(group) == 1:
                plain = GroupRead([], portable(exc) if self.in_worker else exc)
            else:
                plain = self._after_failure(group, exc)
            return dataclasses.replace(plain, receipt=task.receipt(0))
        parts = [rows(whole, a, b) for a, b in bounds]
        return GroupRead(parts, None, views=True, receipt=task.receipt(sent))

    def _group(self, group: list[IntArray]) -> GroupRead:
        bounds = _bounds(group)
        try:
            raw = self._read(np.concatenate(group))
            if self.reads.collate_fn is None:
                # one tensor per column for the group: one transfer from a worker process;
                # the micro batches are copied out of it when delivered (or when pinned)
                whole = to_torch(raw)
                parts = [rows(whole, a, b) for a, b in bounds]
                if self.in_worker:
                    return GroupRead(parts, None, views=True)  # owned after the transfer
                return GroupRead([pin(p) if self.pin else owned(p) for p in parts], None)
            return GroupRead([self._finish(owned(rows(raw, a, b))) for a, b in bounds], None)
        except Exception as exc:
            return self._after_failure(group, exc)

    def _after_failure(self, group: list[IntArray], exc: Exception) -> GroupRead:
        """A group read failed: read it again batch by batch (deliver those before the error)."""
        result = self._one_by_one(group)  # locate the failing batch; deliver those before it
        if result.error is None:
            log.warning(
                "detdata: a read-ahead group of %d micro batches failed (%s: %s) but "
                "each of its micro batches read on its own: delivered them; a transient "
                "error, or batches that cannot be concatenated",
                len(group),
                type(exc).__name__,
                exc,
            )
        return result

    def __call__(self, group: list[IntArray]) -> GroupRead:
        return self._one_by_one(group) if len(group) == 1 else self._group(group)

    def read_ahead(self, group: list[IntArray] | None) -> None:
        """A hint that ``group`` is read next (None: drop what is pending) to a `ReadsAhead`
        stream (`hint_read_ahead`); never changes a byte (`OrderedStream.read_ahead`)."""
        hint_read_ahead(self.stream, None if group is None else np.concatenate(group))


@dataclass(frozen=True)
class RunSlice:
    """What one iteration reads: this rank's micro batches of ``stream`` under ``layout``
    from global position ``start``, stopping before ``stop`` (`Cursor.stop`; None: never)."""

    stream: Stream
    layout: Layout
    start: int
    stop: int | None

    def groups(self, size: int) -> GroupSampler:
        """Its micro batches in groups of ``size`` (``batches_ahead``)."""
        return GroupSampler(self.layout, self.start, self.stop, size)


@dataclass(frozen=True)
class Reads:
    """How every batch source reads a group (``pin_memory``: pin batches read in this process
    when CUDA is present; off with a device feed, which pins itself)."""

    transform: Transform | None
    seed: int
    collate_fn: Callable[[Batch], Any] | None
    pin_memory: bool
    batches_ahead: int

    def reader(self, stream: Stream, *, in_worker: bool) -> GroupReader:
        """The `GroupReader` of ``stream`` (never pinning ``in_worker``: torch's pin-memory
        thread does, `GroupRead.pin_memory`)."""
        pin = not in_worker and self.pin_memory and torch.cuda.is_available()
        return GroupReader(stream, self, pin, in_worker)


def _bounds(group: list[IntArray]) -> list[tuple[int, int]]:
    """Rows ``[a, b)`` of each micro batch of ``group`` in the group's concatenated read."""
    return list(itertools.pairwise(np.cumsum([0] + [len(p) for p in group]).tolist()))


def pin(batch: Any) -> Any:
    if isinstance(batch, torch.Tensor):
        return batch.pin_memory()
    if isinstance(batch, Mapping):
        return {k: pin(v) for k, v in batch.items()}
    if isinstance(batch, list):
        return [pin(v) for v in batch]
    return batch
