"""The boot time (`detdata.storage.boot`), against the kernel's own uptime."""

from __future__ import annotations

import time
from pathlib import Path

from detdata.storage.boot import before_boot, boot_ns


def test_boot_time_is_now_minus_the_uptime() -> None:
    uptime_s = float(Path("/proc/uptime").read_text().split()[0])
    found = boot_ns()
    assert found is not None
    booted = time.time_ns() - int(uptime_s * 1e9)
    assert abs(found - booted) <= 3_000_000_000  # whole seconds, plus the margin
    assert before_boot(booted - 5_000_000_000)
    assert not before_boot(time.time_ns())
