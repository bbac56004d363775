"""Atomic, durable writes: temp file + fsync + rename locally; single PUT on object stores."""

from __future__ import annotations

import errno
import os
import stat
import tempfile
import threading
from typing import Any, Final

from detdata.base.errors import ConfigError, StorageError
from detdata.storage.fs import filesystem, is_url

TEMP_PREFIX: Final = ".tmp-"
"""Unpublished local writes are named ``TEMP_PREFIX + random`` in the target's directory."""


#: errnos of a write that failed for lack of room or a failing device: a storage error
_FULL: Final = frozenset({errno.ENOSPC, errno.EDQUOT, errno.EFBIG, errno.EIO})
_UMASK_LOCK: Final = threading.Lock()


def atomic_write_bytes(
    path: str, data: bytes, *, temp_dir: str | None = None, **storage_options: Any
) -> None:
    """Write ``data`` so that readers see either the old file or the whole new one.

    Locally: a ``TEMP_PREFIX`` file in ``temp_dir`` (same file system) or the target's
    folder, fsynced and renamed over ``path``. A symlink is written through; a character
    device or FIFO (``/dev/stdout``) is written in place; another non-regular file is a
    `ConfigError` naming it. A new file gets ``0o666`` less the umask, a replaced one keeps
    its mode. A full disk, a quota or an I/O error is a `StorageError` naming ``path``.
    """
    if is_url(path) and not path.startswith("file://"):
        fs, fpath = filesystem(path, **storage_options)
        parent = fpath.rsplit("/", 1)[0]
        if parent:
            fs.makedirs(parent, exist_ok=True)
        fs.pipe_file(fpath, data)  # object stores publish a PUT atomically
        return
    local = path[len("file://") :] if path.startswith("file://") else path
    try:
        st: os.stat_result | None = os.stat(local)  # through symlinks
    except FileNotFoundError:
        st = None
    try:
        if st is not None and not stat.S_ISREG(st.st_mode):
            # opened by its own name: /dev/stdout -> /proc/self/fd/1 -> a pipe has no path
            _write_in_place(path, local, st, data)
            return
        target = os.path.realpath(local)  # a symlink to a regular file is written through
        mode = _new_file_mode() if st is None else stat.S_IMODE(st.st_mode)
        _replace(target, data, mode, temp_dir)
    except OSError as exc:
        if isinstance(exc, StorageError) or exc.errno not in _FULL:
            raise
        raise StorageError(
            f"cannot write {path}: {exc.strerror or exc} (nothing was replaced); hint: free "
            "space on its file system or write elsewhere"
        ) from exc


def _write_in_place(path: str, target: str, st: os.stat_result, data: bytes) -> None:
    """Write a character device or FIFO in place; refuse other non-regular files."""
    if not (stat.S_ISCHR(st.st_mode) or stat.S_ISFIFO(st.st_mode)):
        kind = "a folder" if stat.S_ISDIR(st.st_mode) else "not a regular file"
        real = os.path.realpath(target)
        shown = path if real == os.path.abspath(path) else f"{path} (-> {real})"
        raise ConfigError(f"{shown} is {kind}; refusing to write there; hint: give a file name")
    with open(target, "wb", buffering=0) as fh:
        view = memoryview(data)
        while view:
            view = view[fh.write(view) or 0 :]


def _new_file_mode() -> int:
    """``0o666`` less this process's umask (read without a race between threads)."""
    with _UMASK_LOCK:
        mask = os.umask(0o022)
        os.umask(mask)
    return 0o666 & ~mask


def _replace(local: str, data: bytes, mode: int, temp_dir: str | None) -> None:
    directory = os.path.dirname(os.path.abspath(local))
    os.makedirs(directory, exist_ok=True)
    if temp_dir is not None:
        os.makedirs(temp_dir, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=TEMP_PREFIX, dir=temp_dir or directory)
    try:
        with os.fdopen(fd, "wb") as fh:
            os.fchmod(fh.fileno(), mode)
            fh.write(data)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, local)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
    dir_fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)
