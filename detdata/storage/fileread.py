"""Batched reads of many small local files: open, ONE ``preadv``, ``fstat``, close each.

With tens of thousands of shards of a few KiB, the interpreter around four system calls per
file costs more than the calls: `read_files` runs the loop in C without the GIL
(``detdata.storage._fileread``, built where a C compiler is present: `NATIVE`). It opens each
file through its prefix's folder (``openat``, the folder opened once per call and thread),
records a shard's first open from the same open (`detdata.storage.first_opens`), and
otherwise only reads: the caller checks the ``fstat`` s and reads the files from the first
failure on with its own Python loop, which raises the errors. Without the extension,
`read_files` reads nothing and the caller's loop reads every file.
"""

from __future__ import annotations

import os
import threading
import weakref
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Final, NamedTuple

import numpy as np
import numpy.typing as npt

try:
    from detdata.storage import _fileread
except ImportError:  # built without a C compiler: the callers' Python loop reads
    _fileread = None  # type: ignore[assignment]

if TYPE_CHECKING:
    from detdata.storage.first_opens import FirstOpens

#: Whether the native loop is built (else `read_files` always returns 0 files read).
NATIVE: Final = _fileread is not None


def _cpus() -> int:
    """CPUs this process may run on (all of them where affinity is not reported)."""
    affinity = getattr(os, "sched_getaffinity", None)
    return len(affinity(0)) if affinity is not None else os.cpu_count() or 1


#: Threads of one `read_files` call (each takes a contiguous share of >= 16 files): the
#: system calls on small files cost more than the copies, and two threads read a batch of
#: many small shards ~1.6x faster on 2 cores (benchmarks/scale.py).
READ_THREADS: Final = max(1, min(2, _cpus()))

_threads = READ_THREADS  # this process's default (`set_read_threads`)


def set_read_threads(threads: int) -> None:
    """This process's default threads per `read_files` call (1 or 2). A DataLoader worker
    process sets 1: there the workers already run side by side."""
    global _threads
    _threads = max(1, min(2, int(threads)))


#: Columns of `read_files`' ``stats``: bytes read, then the ``fstat`` taken after the read.
GOT, SIZE, INODE, DEVICE, MTIME_NS = range(5)

IntArray = npt.NDArray[np.int64]


def read_files(reads: FileReads, *, threads: int | None = None) -> tuple[int, IntArray]:
    """Read file ``prefix + names[shards[i]]`` for i = 0, 1, ... (the fields of ``reads``):
    ``wants[i]`` bytes at ``file_at[i]`` into its ``iov_count[i]`` buffers (the next ones of
    ``out[iov_off[j]: iov_off[j] + iov_len[j]]``). Returns ``(done, stats)``: files
    ``[0, done)`` were read whole, ``stats[i]`` = (bytes read, size, inode, device, mtime_ns)
    of an ``fstat`` after the read (columns 2-4 are ``uint64`` patterns). ``done`` is the
    first file it could not open, read whole or ``fstat`` (0 without the extension).
    ``threads`` (at most 2; None: `set_read_threads`) take contiguous shares. With ``first``,
    an unrecorded shard of ``first.sizes[shard]`` bytes is recorded right after its open
    (another size stops the loop there). Mismatched arguments (a buffer outside ``out``) are
    a `ValueError`."""
    stats = np.zeros((int(reads.shards.size), 5), dtype=np.int64)
    if _fileread is None or not reads.shards.size:
        return 0, stats
    threads = _threads if threads is None else threads
    return _fileread.read_shards(*_native_args(reads, stats, _plain, threads)), stats


def _native_args(
    reads: FileReads, stats: IntArray, array: Callable[[IntArray], IntArray], threads: int
) -> tuple[Any, ...]:
    """The native loop's arguments for ``reads`` (its index arrays passed through ``array``),
    the first-open records' (state, ident, sizes) last (None: no records; the sizes of the
    shards read filled in by `FirstOpens.prepare`)."""
    prefix, names, shards, file_at, wants, out, iov_off, iov_len, iov_count, first = reads
    table: tuple[object, ...] = (None, None, None)
    if first is not None:
        first.prepare(shards)
        table = (first.state, first.ident, first.sizes)
    indexes = [array(a) for a in (shards, file_at, wants)]
    iovs = [array(a) for a in (iov_off, iov_len, iov_count)]
    return (prefix, names, *indexes, out, *iovs, stats, threads, *table)


class FileReads(NamedTuple):
    """The arguments of one `read_files` (or `start_read_files`) call, in order."""

    prefix: bytes
    names: list[bytes]
    shards: IntArray
    file_at: IntArray
    wants: IntArray
    out: npt.NDArray[np.uint8]
    iov_off: IntArray
    iov_len: IntArray
    iov_count: IntArray
    first: FirstOpens | None = None


class PendingRead:
    """Reads started by `start_read_files`; `wait` (from any thread) returns what
    `read_files` would. Until then ``out`` is being written. Dropping one, or a fork of the
    process (`_join_before_fork`), joins its reads first."""

    __slots__ = ("__weakref__", "_done", "_lock", "_native", "_stats")

    def __init__(self, native: object | None, stats: IntArray) -> None:
        self._native = native
        self._stats = stats
        self._done: int | None = None if native is not None else 0
        self._lock = threading.Lock()
        if native is not None:
            _LIVE.add(self)

    def wait(self) -> tuple[int, IntArray]:
        """``(done, stats)`` as `read_files` returns them (joins the reads once)."""
        with self._lock:
            if self._done is None:
                self._done = int(self._native.wait())  # type: ignore[union-attr]
                self._native = None
                _LIVE.discard(self)
        return self._done, self._stats


#: Background reads not waited for yet (weakly: a dropped one joins in its own dealloc).
_LIVE: weakref.WeakSet[PendingRead] = weakref.WeakSet()


def _join_before_fork() -> None:
    """Wait for every background read of this process before it forks: a read's thread
    holds a shard's descriptor between its open and its close, and a child would inherit
    it with no thread there to close it (a torch worker forked mid-read would keep a
    deleted shard's inode alive for its whole life)."""
    for pending in list(_LIVE):
        pending.wait()


os.register_at_fork(before=_join_before_fork)


def start_read_files(reads: FileReads, *, threads: int = 1) -> PendingRead:
    """`read_files` on ``threads`` (1 or 2) native threads of their own: returns at once;
    `PendingRead.wait` joins them and returns what `read_files` would have. The index arrays
    are copied; ``out`` is written until then. Mismatched arguments: `ValueError`, here."""
    stats = np.zeros((int(reads.shards.size), 5), dtype=np.int64)
    if _fileread is None or not reads.shards.size:
        return PendingRead(None, stats)
    threads = max(1, min(2, int(threads)))
    return PendingRead(
        _fileread.start_read_shards(*_native_args(reads, stats, _owned, threads)), stats
    )


def _owned(values: IntArray) -> IntArray:
    """A contiguous native int64 copy of ``values`` (read by threads after the call)."""
    return np.array(values, dtype=np.int64, order="C", copy=True)


def _plain(values: IntArray) -> IntArray:
    """``values`` as a contiguous native int64 array (what the C loop reads)."""
    return np.ascontiguousarray(values, dtype=np.int64)
