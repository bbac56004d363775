"""A local shard file's identity, as a receipt records it (`detdata.identity.receipts`):
``(size, mtime_ns, ctime_ns, inode, device)`` from a ``stat`` taken before its bytes are
read, and its 8-byte digest."""

from __future__ import annotations

import os
import time
from collections.abc import Sequence
from typing import Final

import numpy as np
import numpy.typing as npt

from detdata.identity.columns import ShardTable
from detdata.identity.entry import ShardEntry
from detdata.storage.fs import check_relative_path, join

#: an identity taken this soon after the file's last change is not recorded
RACY_S: Final = 2.0
#: columns of a local identity: size, mtime_ns, ctime_ns, inode, device (-1: not recorded)
FIELDS: Final = 5
NOT_RECORDED: Final = -1
MISSING: Final = -2

LocalIds = npt.NDArray[np.int64]


def local_identities(root: str, paths: Sequence[str]) -> LocalIds:
    """``(size, mtime_ns, ctime_ns, inode, device)`` per shard file under ``root``, from
    ``stat`` (a row of -2: missing; -1: changed within `RACY_S`, not to be recorded)."""
    out = np.full((len(paths), FIELDS), MISSING, dtype=np.int64)
    racy = time.time_ns() - int(RACY_S * 1e9)
    stat = os.stat
    prefix = join(root, "")
    for i, rel in enumerate(paths):
        try:
            st = stat(prefix + rel)
        except OSError:
            continue
        if max(st.st_mtime_ns, st.st_ctime_ns) >= racy:
            out[i] = NOT_RECORDED
            continue
        out[i] = (st.st_size, st.st_mtime_ns, st.st_ctime_ns, st.st_ino, st.st_dev)
    return out


def identity_digests(ids: LocalIds) -> npt.NDArray[np.uint64]:
    """A 64-bit digest of each local identity row (splitmix64 rounds over its fields; 0:
    not recorded), what a receipt stores."""
    h = np.full(ids.shape[0], 0x9E3779B97F4A7C15, dtype=np.uint64)
    for col in range(ids.shape[1]):
        h ^= ids[:, col].view(np.uint64)
        h ^= h >> np.uint64(30)
        h *= np.uint64(0xBF58476D1CE4E5B9)
        h ^= h >> np.uint64(27)
        h *= np.uint64(0x94D049BB133111EB)
        h ^= h >> np.uint64(31)
    h[ids[:, 0] < 0] = 0
    return h


def checked_paths(shards: Sequence[ShardEntry], lo: int, hi: int, checked: bool) -> list[str]:
    """Paths of shards ``[lo, hi)``; a fast form's each checked as a path under the root
    unless ``checked`` (`check_relative_path`, as `ShardTable.path` does)."""
    if not isinstance(shards, ShardTable):  # entries: checked where parsed
        return [s.path for s in shards[lo:hi]]
    paths = shards.paths_between(lo, hi)
    if not checked:
        where = f"manifest columns {shards.columns.path}"
        for i, rel in enumerate(paths, start=lo):
            check_relative_path(rel, where=f"{where} shard #{i}")
    return paths
