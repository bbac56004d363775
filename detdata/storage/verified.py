"""The shard copies this process verified: re-opening one skips its digest while its stamp
holds (`detdata.storage.cache`).

Per path: the ``stat`` stamp ``(device, inode, size, mtime_ns, ctime_ns)`` when checked, the
digest and the level checked; at most `VERIFIED_MAX`, least recently used forgotten first.
Racy-clean rule (as git's index): a file changed less than `RACY_NS` before it was seen could
be written again within the same timestamp tick, so such a verification is not trusted.
"""

from __future__ import annotations

import os
import threading
from collections import OrderedDict
from typing import Final, NamedTuple

#: Verified copies this process remembers (re-opening one skips its digest).
VERIFIED_MAX: Final = 4096
#: A file changed less than this before it was verified is verified again on its next open
#: (it could be rewritten within the same timestamp tick; coarse file systems tick 1-10 ms).
RACY_NS: Final = 100_000_000
_LEVELS: Final = {"quick": 0, "full": 1}


class _Verified(NamedTuple):
    stamp: tuple[int, ...]  # (device, inode, size, mtime_ns, ctime_ns) when verified
    blake3: str
    level: int  # _LEVELS of the check (a fill hashed every byte: "full")
    trusted: bool  # the file had not changed for RACY_NS when it was verified


#: path -> what this process verified, least recently used first (at most VERIFIED_MAX)
_VERIFIED: Final[OrderedDict[str, _Verified]] = OrderedDict()
_VERIFIED_MUTEX = threading.Lock()


def _new_mutex() -> None:
    global _VERIFIED_MUTEX
    _VERIFIED_MUTEX = threading.Lock()  # a parent thread may have held it at the fork


os.register_at_fork(after_in_child=_new_mutex)


def _stamp(st: os.stat_result) -> tuple[int, ...]:
    """What changes when a file is replaced, written or touched."""
    return (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)


def was_verified(path: str, st: os.stat_result, blake3_hex: str, level: str) -> bool:
    """Did this process verify ``path`` (at ``level`` or stronger) as it is now (``st``), when
    it had been unchanged long enough that a later write would show in its stamp?"""
    with _VERIFIED_MUTEX:
        known = _VERIFIED.get(path)
        if known is None or not known.trusted or known.stamp != _stamp(st):
            return False
        if known.blake3 != blake3_hex or known.level < _LEVELS[level]:
            return False
        _VERIFIED.move_to_end(path)
        return True


def verified_identity(path: str) -> tuple[int, int] | None:
    """``(device, inode)`` of the file this process last verified at ``path``, or None."""
    with _VERIFIED_MUTEX:
        known = _VERIFIED.get(path)
    return None if known is None else (known.stamp[0], known.stamp[1])


def remember_verified(
    path: str,
    st: os.stat_result,
    seen_ns: int,
    blake3_hex: str,
    level: str,
    *,
    own_fill: bool = False,
) -> None:
    """Remember that ``path`` as ``st`` (taken at wall time ``seen_ns``) holds ``blake3_hex``
    (untrusted under the racy-clean rule). ``own_fill``: this process just renamed it into
    place after hashing every byte it wrote, ``st`` taken after: trusted at once."""
    trusted = own_fill or seen_ns - st.st_ctime_ns >= RACY_NS
    with _VERIFIED_MUTEX:
        _VERIFIED[path] = _Verified(_stamp(st), blake3_hex, _LEVELS[level], trusted)
        _VERIFIED.move_to_end(path)
        while len(_VERIFIED) > VERIFIED_MAX:
            _VERIFIED.popitem(last=False)


def forget_verified(path: str | None = None) -> None:
    """Forget that this process verified ``path`` (None: every copy), so its next open
    re-checks its digest (benchmarks measure the old cost this way)."""
    with _VERIFIED_MUTEX:
        if path is None:
            _VERIFIED.clear()
        else:
            _VERIFIED.pop(path, None)


def utime_remembered(path: str, ns: tuple[int, int] | None) -> None:
    """``os.utime`` of ``path`` (now, or ``ns``) on one descriptor (never through a link),
    keeping this process's verification only if the ``fstat`` before shows the file it
    verified. FileNotFoundError when gone, PermissionError where times cannot be set."""
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    try:
        before = _stamp(os.fstat(fd))
        if ns is None:
            os.utime(fd)
        else:
            os.utime(fd, ns=ns)
        after = _stamp(os.fstat(fd))
    finally:
        os.close(fd)
    with _VERIFIED_MUTEX:
        known = _VERIFIED.get(path)
        if known is not None and known.stamp == before:
            _VERIFIED[path] = known._replace(stamp=after)
        else:
            _VERIFIED.pop(path, None)
