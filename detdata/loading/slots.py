"""Shared-memory slots: how worker processes hand a read-ahead group to the main process.

torch's transfer makes and maps a shared-memory segment per tensor per group (on small
batches, more than the read costs). Here the main process owns a ring of ``num_workers *
prefetch_factor + 2`` slots in one anonymous, pre-reserved file (``memfd_create``: nothing
leaks in ``/dev/shm``; a full filesystem is an ``OSError`` and a fallback, never a SIGBUS):
the sampler hands each group a free slot (`SlotTransport.task`), the worker writes it and
returns a small `SlotGroup`, the main process copies each micro batch out and frees the
slot (`settle`). Until slots are sized, and for groups that do not fit, torch's transfer is
used. Neither path changes a delivered byte.
"""

from __future__ import annotations

import contextlib
import itertools
import mmap
import os
import threading
import weakref
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from multiprocessing import reduction
from typing import Any

import numpy as np

from detdata.base.redact import get_logger
from detdata.datasets.batch_columns import to_torch

log = get_logger("detdata.loader")

ALIGN = 64  # column offsets inside a slot
PAGE = 4096
GROWTH = 1.25  # a new ring's slots hold this much more than the largest group seen
MAX_RING_BYTES = 1 << 30  # groups that would need more use torch's transfer
SLOT_KINDS = "biufcMm"  # numeric, bool and temporal numpy columns fit a slot

_ids = itertools.count()
_TRANSPORTS: weakref.WeakValueDictionary[str, SlotTransport] = weakref.WeakValueDictionary()
_HELD: dict[str, WorkerRing] = {}  # in a worker process: the latest ring of each transport


def _round_up(n: int, to: int) -> int:
    return -(-n // to) * to


def _anonymous_file(nbytes: int) -> int:
    """A descriptor of ``nbytes`` of reserved shared memory that has no name anywhere."""
    if hasattr(os, "memfd_create"):
        fd = os.memfd_create("detdata-slots", os.MFD_CLOEXEC)
    else:  # pragma: no cover - not Linux
        from multiprocessing import shared_memory

        segment = shared_memory.SharedMemory(create=True, size=nbytes)
        fd = os.dup(segment._fd)  # type: ignore[attr-defined]
        segment.close()
        segment.unlink()
    try:
        os.ftruncate(fd, nbytes)
        if hasattr(os, "posix_fallocate"):
            os.posix_fallocate(fd, 0, nbytes)  # ENOSPC now, not SIGBUS at the first write
    except BaseException:
        os.close(fd)
        raise
    return fd


def _map(fd: int, nbytes: int) -> mmap.mmap:
    flags = mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0)
    return mmap.mmap(fd, nbytes, flags=flags)


# ------------------------------------------------------------------ what crosses the boundary
@dataclass(frozen=True)
class Receipt:
    """Which slot a task used and what the worker learned: travels back with every result."""

    transport: str  # `SlotTransport.id`
    generation: int | None  # the ring the slot belongs to; None: the task had no slot
    slot: int | None
    worker: int  # torch's worker id
    holds: int | None  # the ring generation this worker holds now
    needed: int  # bytes the group takes in a slot (0: it cannot use one)


class WorkerRing:
    """A worker process's mapping of a ring."""

    def __init__(self, generation: int, slot_bytes: int, count: int, memory: mmap.mmap) -> None:
        self.generation, self.slot_bytes, self.count = generation, slot_bytes, count
        self.array = np.frombuffer(memory, dtype=np.uint8)


def _attach(transport: str, generation: int, slot_bytes: int, count: int, dup: Any) -> WorkerRing:
    """The worker's mapping of a sent ring: the one it holds if that is this generation (or
    newer), else a new mapping of the descriptor."""
    fd = dup.detach()
    try:
        held = _HELD.get(transport)
        if held is not None and held.generation >= generation:
            return held  # already mapped: no second (populated) mapping of the same ring
        memory = _map(fd, slot_bytes * count)
    finally:
        os.close(fd)
    return WorkerRing(generation, slot_bytes, count, memory)


@dataclass(frozen=True)
class SlotTask:
    """What the sampler sends a worker for one group: positions, a free slot, maybe the ring."""

    group: list[Any]  # the micro batches' position arrays
    transport: str
    generation: int | None
    slot: int | None
    ring: WorkerRing | MainRing | None  # a MainRing here unpickles as a WorkerRing

    def receipt(self, needed: int) -> Receipt:
        """The receipt of this task (called in the worker, after `held`)."""
        from torch.utils.data import get_worker_info

        info = get_worker_info()
        held = _HELD.get(self.transport)
        return Receipt(
            self.transport,
            self.generation,
            self.slot,
            0 if info is None else int(info.id),
            None if held is None else held.generation,
            needed,
        )

    def held(self) -> WorkerRing | None:
        """This worker's mapping of the task's ring (taking the attached one if newer)."""
        if isinstance(self.ring, WorkerRing):
            current = _HELD.get(self.transport)
            if current is None or current.generation < self.ring.generation:
                _HELD[self.transport] = self.ring
        return _HELD.get(self.transport)


def slot_layout(raw: Any, rows: int) -> list[tuple[Any, np.ndarray, int]] | None:
    """(key, column, offset) of each column of ``raw`` in a slot, or None if it cannot use one
    (only a flat mapping of `SLOT_KINDS` numpy columns with ``rows`` rows fits)."""
    if not isinstance(raw, Mapping) or not raw:
        return None
    out, offset = [], 0
    for key, col in raw.items():
        if not isinstance(col, np.ndarray) or col.dtype.kind not in SLOT_KINDS:
            return None
        if col.ndim == 0 or col.shape[0] != rows:
            return None
        out.append((key, col, offset))
        offset = _round_up(offset + col.nbytes, ALIGN)
    return out


@dataclass(frozen=True)
class SlotGroup:
    """A group a worker wrote into a slot: only this small description crosses the boundary."""

    receipt: Receipt
    columns: tuple[tuple[Any, str, tuple[int, ...], int], ...]  # key, dtype, shape, offset
    bounds: tuple[tuple[int, int], ...]  # rows [a, b) of each micro batch

    def deliver(self) -> Iterator[Any]:
        """Each micro batch, copied out of the slot (owned); the slot is free again after."""
        return iter(_transport(self.receipt).copy_out(self, pin=False))

    def pin_memory(self) -> PinnedGroup:
        """Called by torch's pin-memory thread: the micro batches copied into pinned memory."""
        return PinnedGroup(_transport(self.receipt).copy_out(self, pin=True))


@dataclass(frozen=True)
class PinnedGroup:
    """A `SlotGroup` copied out of its slot into pinned memory (its slot is free again)."""

    batches: list[Any]

    def deliver(self) -> Iterator[Any]:
        """Each micro batch (owned: pinning copied it)."""
        return iter(self.batches)


def write_slot(task: SlotTask, raw: Any, bounds: list[tuple[int, int]]) -> SlotGroup | int:
    """Write ``raw`` (a group read in a worker) into the task's slot: the `SlotGroup` to
    send, or the bytes the group would need (0: never fits) for torch's transfer."""
    layout = slot_layout(raw, bounds[-1][1] if bounds else 0)
    if layout is None:
        return 0
    _, last, offset = layout[-1]
    needed = offset + last.nbytes
    ring = task.held()
    if (
        task.slot is None
        or ring is None
        or ring.generation != task.generation
        or needed > ring.slot_bytes
    ):
        return needed
    base = task.slot * ring.slot_bytes
    columns = []
    for key, col, offset in layout:
        start = base + offset
        dst = ring.array[start : start + col.nbytes].view(col.dtype).reshape(col.shape)
        np.copyto(dst, col, casting="no")
        columns.append((key, col.dtype.str, tuple(int(s) for s in col.shape), offset))
    return SlotGroup(task.receipt(needed), tuple(columns), tuple(bounds))


# ------------------------------------------------------------------ the main process's side
class MainRing:
    """One generation of slots in the main process of transport ``transport``. It pickles as
    its file's duplicated descriptor (attached to tasks until every worker has reported
    holding it; a worker that already holds it does not map it again: `_attach`)."""

    def __init__(self, transport: str, generation: int, slot_bytes: int, count: int) -> None:
        self.transport, self.generation = transport, generation
        self.slot_bytes, self.count = slot_bytes, count
        self.fd = _anonymous_file(slot_bytes * count)
        try:
            self.memory = _map(self.fd, slot_bytes * count)
        except BaseException:
            os.close(self.fd)
            raise
        self.array = np.frombuffer(self.memory, dtype=np.uint8)
        self.in_use = 0
        self._closer = weakref.finalize(self, _close_ring, self.fd, self.memory)

    def __reduce__(self) -> tuple[Any, tuple[Any, ...]]:
        dup = reduction.DupFd(self.fd)
        return (_attach, (self.transport, self.generation, self.slot_bytes, self.count, dup))

    def close(self) -> None:
        del self.array
        self._closer()


def _close_ring(fd: int, memory: mmap.mmap) -> None:
    os.close(fd)
    with contextlib.suppress(BufferError):  # a view still exists: unmapped when it goes
        memory.close()


def _transport(receipt: Receipt) -> SlotTransport:
    transport = _TRANSPORTS.get(receipt.transport)
    if transport is None:
        raise RuntimeError(
            f"a worker process handed over a group in shared-memory slot {receipt.slot}, but "
            "the loader that owned the slots was closed; hint: this result belongs to an "
            "iterator that is no longer active"
        )
    return transport


def settle(receipt: Receipt) -> None:
    """Free the slot of a result that took torch's transfer; record what its worker reported."""
    transport = _TRANSPORTS.get(receipt.transport)
    if transport is not None:
        transport.fallbacks += 1
        transport.settle(receipt)


class SlotTransport:
    """The main process's ring of slots for one torch DataLoader and the tasks that use it."""

    def __init__(self, num_workers: int, prefetch_factor: int) -> None:
        self.id = f"{os.getpid()}-{next(_ids)}"
        self.count = num_workers * prefetch_factor + 2  # in flight + the one being copied out
        self.num_workers = num_workers
        self._lock = threading.Lock()
        self._rings: dict[int, MainRing] = {}
        self._current: MainRing | None = None
        self._free: list[int] = []
        self._holds: dict[int, int | None] = {}
        self._generations = itertools.count()
        self._largest = 0
        self._disabled = False
        self.slot_groups = 0  # groups handed over through slots (for tests and benchmarks)
        self.fallbacks = 0  # groups that took torch's transfer
        _TRANSPORTS[self.id] = self

    # -------------------------------------------------------------- sampler side
    def reset(self) -> None:
        """A new pass of the sampler: every earlier task was finished or dropped by torch."""
        with self._lock:
            for generation in [g for g in self._rings if self._rings[g] is not self._current]:
                self._rings.pop(generation).close()
            if self._current is not None:
                self._current.in_use = 0
                self._free = list(range(self._current.count))

    def task(self, group: list[Any]) -> SlotTask:
        with self._lock:
            ring = self._current
            if ring is None or not self._free:
                return SlotTask(group, self.id, None, None, None)
            slot = self._free.pop()
            ring.in_use += 1
            known = [self._holds.get(w) for w in range(self.num_workers)]
            attach = any(h != ring.generation for h in known)
            return SlotTask(group, self.id, ring.generation, slot, ring if attach else None)

    # -------------------------------------------------------------- receiving side
    def settle(self, receipt: Receipt) -> None:
        with self._lock:
            if receipt.generation is not None and receipt.slot is not None:
                ring = self._rings.get(receipt.generation)
                if ring is not None:
                    ring.in_use -= 1
                    if ring is self._current:
                        self._free.append(receipt.slot)
                    elif ring.in_use <= 0:
                        self._rings.pop(receipt.generation).close()
            self._holds[receipt.worker] = receipt.holds
            if receipt.needed > self._largest:
                self._largest = receipt.needed
                self._grow()

    def _grow(self) -> None:
        """A ring whose slots hold the largest group seen (with room to spare), if allowed."""
        if self._disabled or (
            self._current is not None and self._largest <= self._current.slot_bytes
        ):
            return
        slot_bytes = _round_up(int(self._largest * GROWTH) + ALIGN, PAGE)
        if slot_bytes * self.count > MAX_RING_BYTES:
            self._disabled = True
            log.info(
                "detdata: a read-ahead group needs %d bytes; %d shared-memory slots of that "
                "size exceed %d bytes, so groups use torch's transfer (lower batches_ahead to "
                "use slots)",
                self._largest,
                self.count,
                MAX_RING_BYTES,
            )
            return
        try:
            ring = MainRing(self.id, next(self._generations), slot_bytes, self.count)
        except OSError as exc:
            self._disabled = True
            log.warning(
                "detdata: could not reserve %d bytes of shared memory for worker slots (%s); "
                "groups use torch's transfer",
                slot_bytes * self.count,
                exc,
            )
            return
        old = self._current
        if old is not None and old.in_use <= 0:
            self._rings.pop(old.generation).close()
        self._rings[ring.generation] = ring
        self._current = ring
        self._free = list(range(ring.count))

    def copy_out(self, group: SlotGroup, pin: bool) -> list[Any]:
        """The micro batches of ``group`` as owned (or pinned) tensors; then frees its slot."""
        receipt = group.receipt
        assert receipt.generation is not None and receipt.slot is not None
        ring = self._rings.get(receipt.generation)
        if ring is None:
            raise RuntimeError(
                f"shared-memory slot {receipt.slot} of ring {receipt.generation} was freed "
                "before its group was copied out; hint: a result of an earlier iteration"
            )
        try:
            base = receipt.slot * ring.slot_bytes
            views = {}
            for key, dtype, shape, offset in group.columns:
                dt = np.dtype(dtype)
                nbytes = int(np.prod(shape, dtype=np.int64)) * dt.itemsize
                start = base + offset
                views[key] = ring.array[start : start + nbytes].view(dt).reshape(shape)
            out = [_one_batch(views, a, b, pin) for a, b in group.bounds]
        finally:
            self.slot_groups += 1
            self.settle(receipt)
        return out

    def close(self) -> None:
        """Free every ring now (workers' mappings go when they exit)."""
        with self._lock:
            self._drop_rings()
        _TRANSPORTS.pop(self.id, None)

    def _drop_rings(self) -> None:
        """Unmap and close every ring; no slot is handed out after."""
        for ring in self._rings.values():
            ring.close()
        self._rings.clear()
        self._current = None
        self._free = []
        self._disabled = True


def _drop_inherited_rings() -> None:
    """After a fork, in the child: drop every inherited ring (workers get theirs through
    their tasks, and an unrelated child must not keep one alive)."""
    for transport in list(_TRANSPORTS.values()):
        # a new lock: another thread of the parent may have held the old one at the fork
        transport._lock = threading.Lock()
        transport._drop_rings()
    _TRANSPORTS.clear()
    _HELD.clear()


os.register_at_fork(after_in_child=_drop_inherited_rings)


def _one_batch(views: dict[Any, np.ndarray], a: int, b: int, pin: bool) -> Any:
    if pin:  # pinning copies: the pinned tensors own their memory
        batch = to_torch({k: v[a:b] for k, v in views.items()})
        return {k: v.pin_memory() for k, v in batch.items()}
    return to_torch({k: np.array(v[a:b]) for k, v in views.items()})
