"""Who else can write a shard-cache folder, and the fills in progress in it (`storage.cache`).

Trust model (README "Shared cache folders", docs/design.md "Remote reads"): a folder is
**private** when it and its layout (``objects/``, ``tmp/``, ``locks/``) are owned by this user
and writable by nobody else; only then are the per-boot record (`detdata.storage.boot`) and
the quick check of copies this user owns alone trusted. Any other folder is **shared**:
usable, but every copy is hashed in full at its first use in each process (and whenever its
``stat`` changes), and a reader's open is confirmed to be the file hashed. A layout folder
that is a link (or not a folder) is refused, naming it.

Fills in progress are ``tmp/<hex>.<bytes>.<random>.part``, created exclusively and locked
(``flock``) by their filler: judged by the lock, never by a pid (pids repeat and differ
between containers). One nobody holds, unchanged for `LEFTOVER_S`, is a dead fill's leftover.
"""

from __future__ import annotations

import contextlib
import errno
import os
import secrets
import stat
import time
import weakref
from typing import Final

from detdata.base.errors import StorageError
from detdata.base.redact import get_logger
from detdata.storage.locks import hold, is_held, let_go

LAYOUT: Final = ("objects", "tmp", "locks")
#: The default cache folder's variable (`user_cache_dir`).
ENV_CACHE_DIR: Final = "DETDATA_CACHE_DIR"
#: A temp file nobody holds and nobody has written for this long is a dead fill's leftover.
LEFTOVER_S: Final = 30.0
#: A wait for a cache lock longer than this is logged (once per wait).
WARN_S: Final = 10.0
log: Final = get_logger("detdata.cache")
_SHARED_LOGGED: Final[set[str]] = set()  # shared folders this process has logged
_OTHERS_WRITE: Final = stat.S_IWGRP | stat.S_IWOTH
_CREATE: Final = os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC


def user_cache_dir() -> str:
    """The default cache's folder: ``$DETDATA_CACHE_DIR``, else
    ``$XDG_CACHE_HOME/detdata/shards``, else ``~/.cache/detdata/shards``."""
    base = os.environ.get("XDG_CACHE_HOME", "") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.environ.get(ENV_CACHE_DIR, "") or os.path.join(base, "detdata", "shards")


def make_layout(directory: str) -> None:
    """Make the cache folder (mode 0700, whatever the umask) and its layout folders, each
    with the cache folder's own permissions (a team folder's layout is as writable)."""
    if not os.path.isdir(directory):
        parent = os.path.dirname(directory)
        if parent:
            os.makedirs(parent, exist_ok=True)
        with contextlib.suppress(FileExistsError):
            os.mkdir(directory, 0o700)
    mode = stat.S_IMODE(os.stat(directory).st_mode) & 0o1777 | 0o700
    for sub in LAYOUT:
        path = os.path.join(directory, sub)
        try:
            os.mkdir(path, 0o700)
        except FileExistsError:
            continue
        os.chmod(path, mode)  # mkdir's mode is cut by the umask; this one is not


def drop_damaged(copy: str, shard: str) -> None:
    """Delete the damaged copy ``copy`` of ``shard``; one this user may not delete (another
    user's, in a folder with the sticky bit) is a `StorageError` naming it and its owner."""
    try:
        os.unlink(copy)
    except FileNotFoundError:
        pass
    except PermissionError as exc:
        raise StorageError(
            f"shard {shard}: the cached copy {copy} is damaged and belongs to uid "
            f"{os.lstat(copy).st_uid}, so this user cannot replace it ({exc.strerror}); "
            "nothing was read from it; hint: ask its owner to delete it, or use a cache "
            "folder of your own (cache_dir=)"
        ) from exc


def note_shared(directory: str, reason: str | None) -> None:
    """Log once per process that the cache folder ``directory`` is shared, and the cost."""
    if reason is None or directory in _SHARED_LOGGED:
        return
    _SHARED_LOGGED.add(directory)
    log.warning(
        "detdata: shard cache folder %s is shared (%s): its copies are not trusted; each is "
        "hashed in full at its first use in this process (a folder only you can write needs "
        "the quick check alone)",
        directory,
        reason,
    )


def owned_alone(st: os.stat_result) -> bool:
    """Is a copy with this ``stat`` owned by this user and writable by nobody else?"""
    return st.st_uid == os.geteuid() and not st.st_mode & _OTHERS_WRITE


class LayoutDirs:
    """Open descriptors of the cache's layout folders: fills create and rename relative to
    them (``dir_fd``), so a layout folder later replaced by a link never receives a byte."""

    def __init__(self, directory: str) -> None:
        self.directory = directory
        self._fds: dict[str, int] = {}
        weakref.finalize(self, _close_all, self._fds)
        for sub in LAYOUT:
            self._fds[sub] = self._open(sub)

    def _open(self, sub: str) -> int:
        path = os.path.join(self.directory, sub)
        try:
            return os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
        except OSError as exc:
            if exc.errno in (errno.ELOOP, errno.ENOTDIR):
                kind = "a symbolic link" if os.path.islink(path) else "not a folder"
                raise _not_a_layout_folder(self.directory, path, kind) from exc
            raise

    def shared_reason(self) -> str | None:
        """Why the cache folder is shared (see the module docstring), or None when it is
        private: judged on the folder and the layout folders this object holds open."""
        found = [(self.directory, os.stat(self.directory))]
        found += [(os.path.join(self.directory, s), os.fstat(self._fds[s])) for s in LAYOUT]
        me = os.geteuid()
        for path, st in found:
            if st.st_uid != me:
                return f"{path} is owned by uid {st.st_uid}, not by this user (uid {me})"
            if st.st_mode & _OTHERS_WRITE:
                who = "others" if st.st_mode & stat.S_IWOTH else "its group"
                return f"{path} is writable by {who} (mode {stat.filemode(st.st_mode)})"
        return None

    def fd(self, sub: str) -> int:
        """The descriptor of layout folder ``sub``, re-opened if the folder was made again
        (FileNotFoundError when removed; a `StorageError` when now a link or not a folder)."""
        path = os.path.join(self.directory, sub)
        st = os.lstat(path)
        held = os.fstat(self._fds[sub])
        if (st.st_dev, st.st_ino) != (held.st_dev, held.st_ino):
            if not stat.S_ISDIR(st.st_mode):
                raise _not_a_layout_folder(self.directory, path, "no longer a folder")
            os.close(self._fds[sub])
            self._fds[sub] = self._open(sub)
        return self._fds[sub]

    def close(self) -> None:
        _close_all(self._fds)


def _close_all(fds: dict[str, int]) -> None:
    for fd in fds.values():
        with contextlib.suppress(OSError):
            os.close(fd)
    fds.clear()


def _not_a_layout_folder(directory: str, path: str, what: str) -> StorageError:
    return StorageError(
        f"shard cache folder {directory}: {path} is {what}; detdata never fills a copy where "
        "someone else chose; hint: remove it (it is made again), and keep the cache in a "
        "folder only you can write"
    )


class TempFill:
    """A fill's temp file in ``tmp/`` (descriptor ``tmp_fd``), created exclusively under a
    random name and locked until `close`; ``name`` is relative to ``tmp_fd``."""

    def __init__(self, tmp_fd: int, tmp_dir: str, hex_digest: str, size: int) -> None:
        while True:
            name = f"{hex_digest}.{size}.{secrets.token_hex(8)}.part"
            try:
                fd = os.open(name, _CREATE, 0o644, dir_fd=tmp_fd)
            except FileExistsError:  # taken (or planted): another name
                continue
            break
        self.tmp_fd = tmp_fd
        self.name = name
        self.path = os.path.join(tmp_dir, name)
        self.fd = fd
        hold(fd)  # a fresh file nobody else has opened yet: taken at once

    def rewind(self) -> None:
        """Empty the file for another download attempt."""
        os.ftruncate(self.fd, 0)
        os.lseek(self.fd, 0, os.SEEK_SET)

    def close(self) -> None:
        """Release the lock (the fill is over: renamed into ``objects/`` or deleted)."""
        let_go(self.fd)


def copies(directory: str) -> list[tuple[int, int, str]]:
    """``(mtime_ns, size, path)`` of each copy in ``objects/`` (the LRU order's input)."""
    found = []
    with os.scandir(os.path.join(directory, "objects")) as listing:
        for item in listing:
            with contextlib.suppress(FileNotFoundError):  # evicted meanwhile
                st = item.stat()  # through a link, as os.stat
                found.append((st.st_mtime_ns, st.st_size, item.path))
    return found


def reserved_bytes(tmp_dir: str) -> int:
    """Bytes reserved by live fills in ``tmp_dir`` (any process, any pid namespace); deletes
    leftovers of dead fills, and planted links or non-files, on the way."""
    reserved = 0
    now = time.time()
    for name in os.listdir(tmp_dir):
        size = _declared_size(name)
        if size is None:
            continue
        path = os.path.join(tmp_dir, name)
        held = is_held(path)
        if held:
            reserved += size
            continue
        if held is None:  # gone, or a link / non-file someone planted: not a fill
            if os.path.islink(path):
                with contextlib.suppress(OSError):
                    os.unlink(path)
            continue
        with contextlib.suppress(OSError):
            if now - os.lstat(path).st_mtime < LEFTOVER_S:
                reserved += size  # maybe a fill whose lock this machine cannot see
                continue
            os.unlink(path)  # nobody holds it, nobody wrote it lately: a dead fill's
    return reserved


def _declared_size(name: str) -> int | None:
    """The size a temp file's name declares (``<hex>.<bytes>.<...>.part``), or None."""
    parts = name.split(".")
    if len(parts) < 4 or parts[-1] != "part" or not parts[1].isdigit():
        return None
    return int(parts[1])


class LockWait:
    """A bounded wait for a cache lock (`detdata.storage.locks.Stalled`): a wait for a fill of
    ``hex_digest`` goes on while its temp file keeps changing, any other ends ``deadline_s``
    after it began (then a `StorageError` naming the lock). Logged once past `WARN_S`."""

    def __init__(
        self, lock: str, deadline_s: float, *, tmp_dir: str = "", hex_digest: str = ""
    ) -> None:
        self.lock = lock
        self.deadline_s = deadline_s
        self.tmp_dir = tmp_dir
        self.hex_digest = hex_digest
        self._warned = False
        self._last_change = 0.0  # seconds into the wait when the fill last changed
        self._seen: float | None = None  # the fill's temp file's newest mtime, last look
        self._looked = -1.0

    def __call__(self, waited: float) -> None:
        if self.hex_digest and waited - self._looked >= 0.5:
            self._looked = waited
            newest = self._fill_mtime()
            if newest is not None and newest != self._seen:
                self._seen, self._last_change = newest, waited
        if waited > WARN_S and not self._warned:
            self._warned = True
            log.warning(
                "detdata: waiting %.0f s for lock %s, held by another process%s",
                waited,
                self.lock,
                " filling that shard" if self.hex_digest else "",
            )
        if waited - self._last_change > self.deadline_s:
            raise StorageError(
                f"lock {self.lock} stayed held for {waited:.0f} s"
                + (" with no progress of the fill it guards" if self.hex_digest else "")
                + " (its holder is stopped or stuck: a suspended job, a debugger, another "
                "user); hint: resume or end that process, or remove the lock's holder; "
                "RetryPolicy(deadline_s=...) sets this wait"
            )

    def _fill_mtime(self) -> float | None:
        newest = None
        with contextlib.suppress(OSError):
            for name in os.listdir(self.tmp_dir):
                if name.startswith(self.hex_digest + "."):
                    with contextlib.suppress(OSError):
                        mtime = os.lstat(os.path.join(self.tmp_dir, name)).st_mtime
                        newest = mtime if newest is None else max(newest, mtime)
        return newest
