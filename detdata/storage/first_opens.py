"""Per process, the file first opened for each shard: the reference every later open is
checked against (a shard replaced or rewritten while a run reads it is named, not delivered).

The record is made before any of the first file's bytes are read, and of several threads
that first open a shard at once exactly one records. The native loop
(`detdata.storage.fileread`) writes the records without the GIL through a compare-and-swap
of a per-shard state byte (`NONE`, `BUSY`, `RECORDED`); Python records through the same one.
"""

from __future__ import annotations

import mmap
import os
import threading
from typing import TYPE_CHECKING, Final

import numpy as np
import numpy.typing as npt

try:
    from detdata.storage import _fileread
except ImportError:  # built without a C compiler: no native thread records
    _fileread = None  # type: ignore[assignment]

NONE: Final = 0
RECORDED: Final = 1
BUSY: Final = 2

U64Array = npt.NDArray[np.uint64]
IntArray = npt.NDArray[np.int64]

if TYPE_CHECKING:
    from detdata.storage.file_column import FileColumn

_U64: Final = (1 << 64) - 1


def file_identity(st: os.stat_result) -> tuple[int, int, int]:
    """``(inode, device, mtime_ns)`` of a stat, each as an unsigned 64-bit pattern (an
    overlayfs inode may use the top bit; an mtime before 1970 is negative): what a record
    holds."""
    return (st.st_ino & _U64, st.st_dev & _U64, st.st_mtime_ns & _U64)


class FirstOpens:
    """The first-open records of ``len(sizes)`` shards (``sizes``: the manifest's bytes per
    shard; the native loop records only a file of that size). Per process, never pickled.
    The ``sizes`` attribute is the native loop's table: zero pages until `prepare`."""

    __slots__ = ("_column", "_filled", "_lock", "ident", "sizes", "state", "states")

    def __init__(self, sizes: IntArray | FileColumn) -> None:
        count = len(sizes)
        self._column = sizes
        #: one byte per shard (`NONE`, `BUSY`, `RECORDED`); a bytearray for cheap tests in
        #: per-shard Python loops, `states` is a numpy view of it
        self.state = bytearray(count)
        self.states = np.frombuffer(self.state, dtype=np.uint8)
        # anonymous mappings (zero pages until written): numpy would ask huge pages for an
        # array this large, and a record would then make 2 MiB resident, not 4 KiB
        #: (inode, device, mtime_ns) per shard, meaningful where the state is `RECORDED`
        self.ident: U64Array = np.frombuffer(
            mmap.mmap(-1, max(1, 24 * count)), dtype=np.uint64, count=3 * count
        ).reshape(count, 3)
        self.sizes: IntArray = np.frombuffer(
            mmap.mmap(-1, max(1, 8 * count)), dtype=np.int64, count=count
        )
        self._filled = np.frombuffer(mmap.mmap(-1, max(1, count)), dtype=np.bool_, count=count)
        self._lock = threading.Lock()

    def prepare(self, ids: IntArray) -> None:
        """Copy the sizes of shards ``ids`` into `sizes` (before the native loop reads them)."""
        ids = np.asarray(ids, dtype=np.int64).reshape(-1)
        ids = ids[(ids >= 0) & (ids < self._filled.size)]  # others: the native loop names them
        missing = ids[~self._filled[ids]]
        if missing.size:
            self.sizes[missing] = self._column[missing]
            self._filled[missing] = True  # after the sizes: another thread tests it first

    def __getstate__(self) -> None:
        raise TypeError("FirstOpens is per process and is not pickled")

    def recorded(self, ids: IntArray) -> npt.NDArray[np.bool_]:
        """Whether each of ``ids`` has a record (a record being written counts as none)."""
        got: npt.NDArray[np.bool_] = self.states.take(ids) == RECORDED
        return got

    def record(self, shard: int, now: tuple[int, int, int]) -> tuple[int, int, int]:
        """Record ``now`` as ``shard``'s first file unless one is recorded; returns the
        identity recorded (``now`` when this call recorded it)."""
        if self.state[shard] == RECORDED:
            got = self.ident[shard].tolist()
        else:
            ids = np.asarray([shard], dtype=np.int64)
            got = self.record_many(ids, np.asarray([now], np.uint64))[0].tolist()
        return (got[0], got[1], got[2])

    def record_many(self, ids: IntArray, now: U64Array) -> U64Array:
        """`record` of shards ``ids`` (distinct) with identities ``now`` (rows of 3): the
        identity recorded for each."""
        ids = np.ascontiguousarray(ids, dtype=np.int64)
        now = np.ascontiguousarray(now, dtype=np.uint64).reshape(ids.size, 3)
        seen = np.empty_like(now)
        if _fileread is not None:
            _fileread.record_firsts(self.state, self.ident, ids, now, seen)
            return seen
        with self._lock:  # no native thread can record: the lock serialises Python's
            new = self.states[ids] != RECORDED
            self.ident[ids[new]] = now[new]
            self.states[ids[new]] = RECORDED
            seen[:] = self.ident[ids]
        return seen
