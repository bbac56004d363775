"""When this machine booted: what a crash could have lost is older than that.

A file written without ``fsync`` is safe against a process dying (the kernel still holds
and writes its pages) but not against the machine going down before the pages reached the
disk. A file last changed before the current boot may hold such a loss; one changed since
cannot (a crash since would have started another boot). `detdata.storage.cache` writes its
copies without ``fsync`` and checks in full, once, a copy last changed before this boot.
"""

from __future__ import annotations

import functools
from typing import Final

#: ``btime`` is whole seconds (rounded down): a change within this much after it is taken
#: as older than the boot
_MARGIN_NS: Final = 1_000_000_000


@functools.cache
def boot_ns() -> int | None:
    """The wall time (ns since the epoch) from which a file's change is known to be of this
    boot (``btime`` of ``/proc/stat`` plus a second); None where it cannot be read (then
    nothing may rely on it: write with ``fsync``)."""
    try:
        with open("/proc/stat", "rb") as fh:
            for line in fh:
                if line.startswith(b"btime "):
                    return int(line.split()[1]) * 1_000_000_000 + _MARGIN_NS
    except (OSError, ValueError):
        return None
    return None


def before_boot(ctime_ns: int) -> bool:
    """Was a file whose change time is ``ctime_ns`` last changed before this boot (or can
    this not be told: no boot time)? Then unsynced writes to it may have been lost."""
    boot = boot_ns()
    return boot is None or ctime_ns < boot
