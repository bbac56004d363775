"""Exclusive file locks (``fcntl.flock``) that exclude threads and processes, fork-safe.

`flock(path)` opens its own descriptor on ``path`` (created if needed) and holds an
exclusive ``flock`` on it for the ``with`` block; `file_lock(path)` is the same, best
effort (no lock where the file cannot be made). A lock belongs to the open file
description, which a fork shares: a child that kept its copy of a descriptor locked by the
parent would keep the lock alive after the parent's ``close`` and every later taker (the
child included) would wait forever. So a forked child closes its copies of the locks this
process holds at once (``os.register_at_fork``), and the parent's release is a release.
Locks are released by the kernel when a process dies.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import threading
from collections.abc import Iterator
from typing import Final

_HELD: Final[set[int]] = set()  # descriptors of flocks this process holds now
_HELD_MUTEX = threading.Lock()


def _close_inherited_locks() -> None:
    """In a forked child: close the copies of the parent's lock descriptors (see the module
    docstring). The mutex is made anew: a parent thread may have held it at the fork."""
    global _HELD_MUTEX
    _HELD_MUTEX = threading.Lock()
    for fd in list(_HELD):
        with contextlib.suppress(OSError):
            os.close(fd)
    _HELD.clear()


os.register_at_fork(after_in_child=_close_inherited_locks)


@contextlib.contextmanager
def _holding(fd: int) -> Iterator[None]:
    """An exclusive ``flock`` on the open descriptor ``fd`` for the block (waits for the
    holder, retrying after signals; a forked child closes its copy); ``fd`` is closed
    after."""
    with _HELD_MUTEX:
        _HELD.add(fd)
    try:
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX)
                break
            except OSError as exc:  # EINTR
                if exc.errno != errno.EINTR:
                    raise
        yield
    finally:
        with _HELD_MUTEX:
            _HELD.discard(fd)
        os.close(fd)


@contextlib.contextmanager
def flock(path: str) -> Iterator[None]:
    """An exclusive ``flock`` on ``path`` (created if missing; its own descriptor, so it
    excludes threads and processes) while the block runs."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
    with _holding(fd):
        yield


@contextlib.contextmanager
def file_lock(path: str) -> Iterator[bool]:
    """`flock`, best effort: hold an exclusive lock on the local file ``path`` (made if
    missing, its folder too; an existing folder is locked itself, leaving nothing in it)
    while the block runs: processes of one machine (and of a file system whose locks span
    machines) take turns. Yields True when held; False (no lock, the block still runs)
    where the lock file cannot be made, e.g. a read-only folder: for locks that only ever
    save work, never guard correctness."""
    try:
        if os.path.isdir(path):
            fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        else:
            os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
    except OSError:
        yield False
        return
    with _holding(fd):
        yield True
