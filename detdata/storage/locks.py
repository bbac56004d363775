"""Exclusive file locks (``fcntl.flock``) that exclude threads and processes, fork-safe.

A lock file is never followed through a symbolic link, opened read-only (a lock file another
user made is usable) and must be a regular file (`open_lock_file`). A lock belongs to the
open file description, which a fork shares: so a forked child closes its copies of the locks
this process holds at once (``os.register_at_fork``), and the parent's release is a release.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import stat
import threading
import time
from collections.abc import Callable, Iterator
from typing import Final

from detdata.base.errors import StorageError

#: How a lock file is opened: read-only (``flock`` needs no more), created if missing, never
#: through a symbolic link, and without blocking on a planted FIFO.
_LOCK_FLAGS: Final = os.O_RDONLY | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC

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


#: What a waiter is told while a lock stays held: called with the seconds waited so far, it
#: returns to keep waiting or raises to give up (the lock is then not taken).
Stalled = Callable[[float], None]


@contextlib.contextmanager
def _holding(fd: int, stalled: Stalled | None = None) -> Iterator[None]:
    """`hold` of the open descriptor ``fd`` for the block; ``fd`` is closed after."""
    hold(fd, stalled)
    try:
        yield
    finally:
        let_go(fd)


def open_lock_file(path: str, *, dir_fd: int | None = None) -> int:
    """A read-only descriptor on the regular file ``path`` (created if missing; relative to
    the folder ``dir_fd`` when given), never through a symbolic link: a `StorageError`
    naming ``path`` where it is a link or not a regular file; other OS errors as they are."""
    try:
        fd = os.open(
            os.path.basename(path) if dir_fd is not None else path,
            _LOCK_FLAGS,
            0o644,
            dir_fd=dir_fd,
        )
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise _not_a_lock_file(path, "a symbolic link") from exc
        raise
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise _not_a_lock_file(path, "not a regular file")
    return fd


def _not_a_lock_file(path: str, what: str) -> StorageError:
    return StorageError(
        f"lock file {path} is {what}; detdata never follows or locks one (another user of "
        "the folder may have planted it); hint: remove it, and keep caches and indexes in "
        "a folder only you can write"
    )


@contextlib.contextmanager
def flock(
    path: str, *, stalled: Stalled | None = None, dir_fd: int | None = None
) -> Iterator[None]:
    """An exclusive ``flock`` on ``path`` (`open_lock_file`) while the block runs. ``stalled``:
    a bounded wait (`Stalled`; without it, as long as the holder holds it). ``dir_fd``: the
    lock file is made in that folder (``path`` names it in errors)."""
    fd = open_lock_file(path, dir_fd=dir_fd)
    with _holding(fd, stalled):
        yield


def hold(fd: int, stalled: Stalled | None = None) -> None:
    """Take an exclusive ``flock`` on the caller's descriptor ``fd`` now, waiting for the
    holder (retrying after signals; with ``stalled``, polling and asking it between tries);
    it lasts until `let_go(fd)` (at once on failure). A forked child closes its copy."""
    with _HELD_MUTEX:
        _HELD.add(fd)
    began = time.monotonic()
    pause = 0.001
    try:
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX if stalled is None else fcntl.LOCK_EX | fcntl.LOCK_NB)
                return
            except OSError as exc:
                if exc.errno not in (errno.EINTR, errno.EWOULDBLOCK, errno.EAGAIN):
                    raise
            if stalled is not None:
                stalled(time.monotonic() - began)
                time.sleep(pause)
                pause = min(0.05, pause * 2)
    except BaseException:
        let_go(fd)
        raise


def let_go(fd: int) -> None:
    """Release a `hold` by closing ``fd``."""
    with _HELD_MUTEX:
        _HELD.discard(fd)
    with contextlib.suppress(OSError):
        os.close(fd)


def is_held(path: str) -> bool | None:
    """Does some process (any pid namespace, this one included) hold a lock on the regular
    file ``path``? None when ``path`` is gone, a symbolic link or not a regular file."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError:
        return None
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            return None
        try:
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except OSError as exc:
            if exc.errno in (errno.EWOULDBLOCK, errno.EAGAIN):
                return True
            raise
        return False
    finally:
        os.close(fd)


@contextlib.contextmanager
def file_lock(path: str) -> Iterator[bool]:
    """`flock`, best effort, for locks that only save work: the local file ``path`` (made if
    missing, its folder too; an existing folder is locked itself). Yields True when held;
    False (the block still runs) where the lock file cannot be made."""
    try:
        if os.path.isdir(path) and not os.path.islink(path):
            fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
        else:
            os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
            fd = open_lock_file(path)
    except OSError:  # StorageError included: a planted link is not followed, not locked
        yield False
        return
    with _holding(fd):
        yield True
