"""This user's secret key, for what detdata writes now and trusts later: the window index,
its ``.checked`` note and the receipts are tagged under it in blake3's keyed mode. Where it
lives, how it is made and when it is refused (with a warning: nothing is stored or
trusted): docs/design.md ("Keyed, so that only this user makes what this user trusts").
"""

from __future__ import annotations

import contextlib
import os
import stat
import tempfile
import threading
import warnings
from typing import Final

import blake3

KEY_BYTES: Final = 32
_PREFIX: Final = ".key-"
_READ: Final = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
#: mode bits that make a key no secret (others may read it) or not this user's alone
_OTHERS: Final = 0o077
_KEYS: dict[str, bytes | None] = {}  # key file path -> key (None: unusable), this process
_LOCK = threading.Lock()


def key_path(folder: str) -> str:
    """Where this user's key lives in ``folder`` (a receipts folder)."""
    return os.path.join(folder, f"{_PREFIX}{os.geteuid()}")


def local_key(folder: str) -> bytes | None:
    """This user's key in ``folder``, made on first use; None where it cannot be made or
    fails its checks (a `RuntimeWarning` names it once)."""
    path = key_path(folder)
    with _LOCK:
        if path not in _KEYS:
            _KEYS[path] = _load_or_make(path)
        return _KEYS[path]


def key_id(key: bytes) -> str:
    """A public name of ``key`` (16 hex digits of a keyed hash of a constant)."""
    return blake3.blake3(b"detdata.key-id", key=key).hexdigest()[:16]


def keyed(key: bytes, data: bytes) -> bytes:
    """The 32-byte blake3 of ``data`` in keyed mode under ``key``."""
    return blake3.blake3(data, key=key).digest()


def _load_or_make(path: str) -> bytes | None:
    try:
        with contextlib.suppress(FileNotFoundError):
            return _read(path)
        try:
            _make(path)
        except OSError:  # a read-only folder: no key, no stored index (as where not writable)
            return None
        return _read(path)  # refused where a link or FIFO was planted before ours was linked
    except OSError as exc:  # a link (ELOOP), a planted FIFO, unreadable
        _refused(path, f"cannot be opened as a file ({exc.strerror or exc})")
        return None


def _read(path: str) -> bytes | None:
    fd = os.open(path, _READ)
    try:
        st = os.fstat(fd)
        problem = _problem(st)
        if problem is not None:
            _refused(path, problem)
            return None
        data = os.read(fd, KEY_BYTES + 1)
    finally:
        os.close(fd)
    if len(data) != KEY_BYTES:
        _refused(path, f"holds {len(data)} bytes, not {KEY_BYTES}")
        return None
    return data


def _problem(st: os.stat_result) -> str | None:
    if not stat.S_ISREG(st.st_mode):
        return "is not a regular file"
    if st.st_uid != os.geteuid():
        return f"is owned by uid {st.st_uid}, not by this user (uid {os.geteuid()})"
    if st.st_mode & _OTHERS:
        return f"can be read or written by others (mode {stat.filemode(st.st_mode)})"
    return None


def _make(path: str) -> None:
    """Write a new key to ``path`` unless one is there: a private temp file (mode 0600),
    linked into place (``link`` never replaces a file, nor follows a planted link)."""
    folder = os.path.dirname(path)
    os.makedirs(folder, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=".tmp-key-", dir=folder)
    try:
        os.write(fd, os.urandom(KEY_BYTES))
        os.fsync(fd)
        os.close(fd)
        fd = -1
        with contextlib.suppress(FileExistsError):  # another process made it first
            os.link(tmp, path)
    finally:
        if fd >= 0:
            os.close(fd)
        os.unlink(tmp)


def _refused(path: str, why: str) -> None:
    """Report the key file ``path`` as unusable (a `RuntimeWarning` naming it)."""
    warnings.warn(
        f"detdata key file {path} {why}: it is not used, so no stored window index or "
        "verification receipt is trusted (each process builds its index, each start reads "
        "every shard); hint: remove it (this user's key is made again), and keep "
        "DETDATA_RECEIPTS in a folder only you can write",
        RuntimeWarning,
        stacklevel=2,
    )
