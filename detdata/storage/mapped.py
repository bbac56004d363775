"""Read-only memory maps of checked local shard files (`map_checked`: the reader's ``stat``
check first, so a short file is an error naming the shard, not a SIGBUS later) and strided
record views over them without copying (records may overlap).
"""

from __future__ import annotations

import mmap
import os
from typing import Any, NamedTuple

import numpy as np

from detdata.storage.reads import OpenChecks


class Mapped(NamedTuple):
    """An open shard: its strided record view, the mapping under it, and the mapped file."""

    view: np.ndarray[Any, Any]
    mapping: mmap.mmap
    path: str


def map_checked(fd: int, shard: int, path: str, checks: OpenChecks) -> mmap.mmap:
    """A read-only mapping of the whole open file ``fd`` (shard ``shard``'s ``path``),
    after ``checks.stat`` of it (size and identity)."""
    checks.stat(shard, os.fstat(fd), path)
    return mmap.mmap(fd, 0, access=mmap.ACCESS_READ)


def record_view(
    mapping: mmap.mmap,
    dtype: np.dtype[Any],
    *,
    offset: int,
    count: int,
    rows: int,
    step: int,
    width: int,
) -> np.ndarray[Any, Any]:
    """Read-only view of ``count`` items of ``dtype`` at byte ``offset`` of ``mapping`` as
    ``rows`` records of ``width`` items, record ``r`` starting at item ``r * step``."""
    items = np.frombuffer(mapping, dtype=dtype, count=count, offset=offset)
    return np.lib.stride_tricks.as_strided(
        items,
        shape=(rows, width),
        strides=(step * dtype.itemsize, dtype.itemsize),
        writeable=False,
    )
