"""A read-only integer array kept in a file and read with ``pread``, never mapped.

Not a memory map: a fault maps the whole page-cache folio around a page (up to 2 MiB), so a
rank looking up a handful of shards of a 1M-shard index held ~20 MB resident. `FileColumn`
reads `BLOCK`-element blocks on demand (a column that has read `PROMOTE_BLOCKS` is read whole)
and keeps every `BLOCK`-th element (``coarse``) so a `searchsorted` reads one block per
distinct answer. The file's bytes must be checked before a column is made over them, and it
is replaced atomically, never rewritten in place.
"""

from __future__ import annotations

import os
import threading
import time
import weakref
from typing import Any, Final, TypeAlias

import numpy as np
import numpy.typing as npt

#: elements per block read (and per coarse step): 4 KiB of int64
BLOCK: Final = 512
#: a per-shard integer array: in memory, or a `FileColumn` read on demand
IntColumn: TypeAlias = "npt.NDArray[np.int64] | FileColumn"
#: a request for at most this many distinct elements (or values to search) reads just those
#: elements (a ``pread`` each; a search ~9): a rank's first batch reads bytes, not pages
SMALL_READS: Final = 16
#: blocks read (or half the column's, if fewer) before a column is read whole and kept
PROMOTE_BLOCKS: Final = 256


class OpenFile:
    """A descriptor held open for columns over one file (closed when the last goes)."""

    __slots__ = ("__weakref__", "_closer", "fd", "identity", "path", "seen_ns")

    def __init__(self, path: str) -> None:
        self.path = path
        self.fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
        self._closer = weakref.finalize(self, os.close, self.fd)
        st = os.fstat(self.fd)
        #: ``[size, mtime_ns, ctime_ns, inode, device]`` at open (before any byte is read),
        #: and the wall time it was taken at
        self.identity = [st.st_size, st.st_mtime_ns, st.st_ctime_ns, st.st_ino, st.st_dev]
        self.seen_ns = time.time_ns()
        # scattered small reads: no read-ahead around each (it would read, and count, more)
        os.posix_fadvise(self.fd, 0, 0, os.POSIX_FADV_RANDOM)

    def pread(self, at: int, count: int) -> bytes:
        """Exactly ``count`` bytes from ``at``; `OSError` naming the file if it is shorter
        (truncated in place after it was checked)."""
        parts = []
        got = 0
        while got < count:
            part = os.pread(self.fd, count - got, at + got)
            if not part:
                raise OSError(f"{self.path}: {count} bytes at {at} are past its end (truncated?)")
            parts.append(part)
            got += len(part)
        return parts[0] if len(parts) == 1 else b"".join(parts)

    def close(self) -> None:
        self._closer()


class FileColumn:
    """``length`` elements of ``dtype`` at byte ``at`` of ``file``, read on demand: what the
    datasets ask of a per-shard array (``len``, indexing, ``take``, slices, ``searchsorted``
    of the ascending column, ``np.asarray``). ``coarse``: every `BLOCK`-th element, or None."""

    __slots__ = (
        "_blocks",
        "_coarse",
        "_lock",
        "_promoting",
        "_whole",
        "at",
        "dtype",
        "file",
        "length",
    )

    def __init__(
        self,
        file: OpenFile,
        at: int,
        length: int,
        dtype: npt.DTypeLike,
        coarse: npt.NDArray[Any] | None = None,
    ) -> None:
        self.file = file
        self.at = at
        self.length = length
        self.dtype = np.dtype(dtype)
        self._blocks: dict[int, npt.NDArray[Any]] = {}
        self._lock = threading.Lock()
        self._coarse = coarse
        self._whole: npt.NDArray[Any] | None = None
        self._promoting = False

    @property
    def coarse(self) -> npt.NDArray[Any]:
        """Every `BLOCK`-th element (read on first use: one small ``pread`` each)."""
        if self._coarse is None:
            picks = [self._element(k) for k in range(0, self.length, BLOCK)]
            self._coarse = np.array(picks, dtype=self.dtype)
        return self._coarse

    # shape ---------------------------------------------------------------------------
    def __len__(self) -> int:
        return self.length

    @property
    def size(self) -> int:
        return self.length

    @property
    def shape(self) -> tuple[int]:
        return (self.length,)

    @property
    def ndim(self) -> int:
        return 1

    # reads ---------------------------------------------------------------------------
    def _block(self, b: int) -> npt.NDArray[Any]:
        found = self._blocks.get(b)
        if found is not None:
            return found
        block = self._range(b * BLOCK, min(self.length, (b + 1) * BLOCK))
        with self._lock:
            self._blocks[b] = block
        return block

    def _promoted(self, wanted: npt.NDArray[np.int64]) -> npt.NDArray[Any] | None:
        """The whole column, read now (by one thread) if reading ``wanted`` blocks would bring
        the blocks read to `PROMOTE_BLOCKS` (or half the column's); else None."""
        if self._whole is not None:
            return self._whole
        missing = sum(1 for b in wanted.tolist() if b not in self._blocks)
        threshold = min(PROMOTE_BLOCKS, max(1, -(-self.length // BLOCK) // 2))
        with self._lock:
            if self._promoting or len(self._blocks) + missing < threshold:
                return None
            self._promoting = True
        self._whole = whole = self.whole()
        self._blocks = {}
        return whole

    def _element(self, i: int) -> Any:
        """Element ``i`` (0 <= i < length): from its block if read, else read alone."""
        block = self._blocks.get(i // BLOCK)
        return block[i % BLOCK] if block is not None else self._range(i, i + 1)[0]

    def _search_one(self, k: int, value: Any, side: str) -> int:
        """`searchsorted` of one ``value`` whose ``coarse`` count is ``k``: a binary search
        of block ``k - 1`` through `_element` (its elements read one at a time)."""
        if k == 0:
            return 0
        lo, hi = (k - 1) * BLOCK + 1, min(k * BLOCK, self.length)  # answer in [lo, hi]
        while lo < hi:  # first position in [lo, hi) whose element fails the search
            mid = (lo + hi) // 2
            x = self._element(mid)
            if x < value or (side == "right" and x == value):
                lo = mid + 1
            else:
                hi = mid
        return lo

    def _range(self, lo: int, hi: int) -> npt.NDArray[Any]:
        """Elements ``[lo, hi)`` in one ``pread`` (not cached)."""
        item = self.dtype.itemsize
        if hi <= lo:
            return np.empty(0, dtype=self.dtype)
        return np.frombuffer(self.file.pread(self.at + lo * item, (hi - lo) * item), self.dtype)

    def _gathered(self, blocks: npt.NDArray[np.int64]) -> npt.NDArray[Any]:
        """The distinct ``blocks`` (ascending) concatenated: every block but the column's
        last is `BLOCK` long, so block ``blocks[j]`` starts at ``j * BLOCK`` here."""
        return np.concatenate([self._block(b) for b in blocks.tolist()])

    def take(self, indices: npt.ArrayLike) -> Any:
        """``column[indices]`` for an integer array (any shape) or one integer."""
        idx = np.asarray(indices)
        if idx.dtype.kind not in "iu":
            raise TypeError(f"column indices must be integers, got {idx.dtype}")
        flat = idx.astype(np.int64, copy=False).reshape(-1)
        if flat.size and (int(flat.min()) < -self.length or int(flat.max()) >= self.length):
            bad = flat[(flat < -self.length) | (flat >= self.length)][0]
            raise IndexError(f"index {int(bad)} is out of range for {self.length} elements")
        flat = np.where(flat < 0, flat + self.length, flat)
        whole = self._whole
        if whole is not None:
            return whole[flat].reshape(idx.shape) if idx.ndim else whole[int(flat[0])]
        if idx.ndim == 0:
            return self._element(int(flat[0]))
        if not flat.size:
            return np.empty(idx.shape, dtype=self.dtype)
        distinct = np.unique(flat)
        if distinct.size <= SMALL_READS:
            got = np.asarray([self._element(i) for i in distinct.tolist()], dtype=self.dtype)
            return got[np.searchsorted(distinct, flat)].reshape(idx.shape)
        blocks = flat // BLOCK
        wanted = np.unique(blocks)
        whole = self._promoted(wanted)
        if whole is not None:
            return whole[flat].reshape(idx.shape)
        at = np.searchsorted(wanted, blocks) * BLOCK + (flat - blocks * BLOCK)
        return self._gathered(wanted)[at].reshape(idx.shape)

    def __getitem__(self, key: Any) -> Any:
        if isinstance(key, slice):
            start, stop, step = key.indices(self.length)
            if step != 1:
                return self.whole()[key]
            stop = max(start, stop)
            coarse = None
            if start % BLOCK == 0 and self._coarse is not None:
                coarse = self._coarse[start // BLOCK : -(-stop // BLOCK)]
            return FileColumn(
                self.file,
                self.at + start * self.dtype.itemsize,
                stop - start,
                self.dtype,
                coarse=coarse,
            )
        return self.take(key)

    def searchsorted(self, values: npt.ArrayLike, side: Any = "left") -> Any:
        """`numpy.searchsorted` of the (ascending) column: ``coarse`` finds each value's
        block, one block read per distinct block."""
        vals = np.asarray(values)
        if side not in ("left", "right"):
            raise ValueError(f"side must be 'left' or 'right', got {side!r}")
        if self._whole is not None:
            return self._whole.searchsorted(vals, side=side)
        c = self.coarse.searchsorted(vals, side=side).astype(np.int64)
        if vals.ndim == 0:
            return np.int64(self._search_one(int(c), vals, side))
        flat_c, flat_v = c.reshape(-1), vals.reshape(-1)
        if flat_v.size <= SMALL_READS:
            answers = [
                self._search_one(k, v, side) for k, v in zip(flat_c.tolist(), flat_v, strict=True)
            ]
            return np.asarray(answers, dtype=np.int64).reshape(vals.shape)
        out = np.zeros(flat_c.size, dtype=np.int64)
        inside = flat_c > 0
        if inside.any():
            # value v's answer lies in block k = c - 1: every element of an earlier block
            # satisfies the search, none of a later one, so one search over the distinct
            # blocks concatenated (ascending) counts exactly block k's share
            ks = flat_c[inside] - 1
            wanted = np.unique(ks)
            whole = self._promoted(wanted)
            if whole is not None:
                return whole.searchsorted(vals, side=side)
            found = self._gathered(wanted).searchsorted(flat_v[inside], side=side)
            out[inside] = ks * BLOCK + (found - np.searchsorted(wanted, ks) * BLOCK)
        return out.reshape(vals.shape)

    def whole(self) -> npt.NDArray[Any]:
        """Every element (read now, unless kept: O(length) memory and time), read-only."""
        if self._whole is not None:
            return self._whole
        arr = self._range(0, self.length)
        arr.flags.writeable = False
        return arr

    def __array__(self, dtype: Any = None, copy: Any = None) -> npt.NDArray[Any]:
        arr = self.whole()
        return arr if dtype is None else arr.astype(dtype)

    def __repr__(self) -> str:
        return f"FileColumn({self.file.path!r}, at={self.at}, length={self.length}, {self.dtype})"
