"""Which boot of this machine a cache copy is known whole in (`detdata.storage.cache`).

The cache writes copies without ``fsync`` and records, per boot (the kernel's random
``boot_id``), the copies known whole in it: filled or hashed in full in it. A copy not on the
record may hold what a crash lost and is hashed in full at its first open (docs/design.md,
"Remote reads"). The record, ``checked-<boot_id>``, is one name a line, appended, never
opened through a link; other boots' records unchanged for `STALE_RECORD_S` are deleted.
"""

from __future__ import annotations

import contextlib
import functools
import os
import re
import threading
import time
from typing import Final

_BOOT_ID: Final = "/proc/sys/kernel/random/boot_id"
_UUID: Final = re.compile(r"[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}")
PREFIX: Final = "checked-"
#: A record of another boot unchanged this long is deleted (its machine is gone or rebooted).
STALE_RECORD_S: Final = 7 * 24 * 3600
_READ: Final = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
_APPEND: Final = os.O_WRONLY | os.O_APPEND | os.O_CREAT | _READ


@functools.cache
def boot_id() -> str | None:
    """This boot's id (the kernel's ``boot_id``), or None where it cannot be read."""
    try:
        with open(_BOOT_ID, encoding="ascii") as fh:
            found = fh.read().strip()
    except (OSError, ValueError):
        return None
    return found if _UUID.fullmatch(found) else None


class CheckedThisBoot:
    """The copies of the cache at ``directory`` known whole in this boot. ``enabled`` False
    (no boot id): every copy counts as whole (fills are synced). ``trusted=False``: the
    record is neither read nor written and no copy counts as known whole."""

    def __init__(self, directory: str, *, trusted: bool = True) -> None:
        found = boot_id()
        self.enabled = found is not None
        self.trusted = trusted
        self._path = os.path.join(directory, PREFIX + (found or "none"))
        self._known: set[str] = set()
        self._offset = 0
        self._lock = threading.Lock()
        if not (self.enabled and trusted):
            return
        cutoff = time.time() - STALE_RECORD_S  # other boots' records: stale ones are deleted
        with contextlib.suppress(OSError):
            for name in os.listdir(directory):
                path = os.path.join(directory, name)
                if name.startswith(PREFIX) and path != self._path:
                    with contextlib.suppress(OSError):
                        if os.lstat(path).st_mtime < cutoff:
                            os.unlink(path)

    def has(self, name: str) -> bool:
        """Is the copy ``name`` known whole in this boot (this or another process)?"""
        if not self.trusted:
            return False
        if not self.enabled:
            return True
        with self._lock:
            if name in self._known:
                return True
            self._read_new()
            return name in self._known

    def _read_new(self) -> None:
        """Fold in the lines appended since the last read (whole lines only)."""
        try:
            fd = os.open(self._path, _READ)
        except OSError:  # missing, or a planted link (never followed): nothing known
            return
        with os.fdopen(fd, "rb") as fh:
            fh.seek(self._offset)
            data = fh.read()
        end = data.rfind(b"\n") + 1
        self._offset += end
        self._known.update(line.decode("ascii", "replace") for line in data[:end].split())

    def add(self, name: str) -> None:
        """Record the copy ``name`` as whole in this boot (a failed write only means it is
        hashed in full again at a later first open)."""
        if not self.enabled or not self.trusted:
            return
        with self._lock:
            if name in self._known:
                return
            self._known.add(name)
        with contextlib.suppress(OSError):  # a planted link is not followed: nothing written
            fd = os.open(self._path, _APPEND, 0o644)
            try:
                os.write(fd, name.encode("ascii") + b"\n")
            finally:
                os.close(fd)
