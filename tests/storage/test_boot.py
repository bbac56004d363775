"""The per-boot record of copies known whole (`detdata.storage.boot`)."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest

from detdata.storage import boot
from detdata.storage.boot import CheckedThisBoot, boot_id


def test_boot_id_is_the_kernel_s() -> None:
    found = boot_id()
    assert found == Path("/proc/sys/kernel/random/boot_id").read_text().strip()


def test_the_record_is_shared_by_processes_of_a_boot_and_dropped_at_the_next(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    first = CheckedThisBoot(str(tmp_path))
    other = CheckedThisBoot(str(tmp_path))  # another process of the same boot
    assert first.enabled and not first.has("a" * 64)
    first.add("a" * 64)
    assert other.has("a" * 64) and not other.has("b" * 64)
    with open(tmp_path / f"checked-{boot_id()}", "ab") as fh:
        fh.write(b"c" * 30)  # a line cut short by a crash mid-write: not a name
    assert not other.has("c" * 30) and not other.has("c" * 64)
    old = tmp_path / f"checked-{boot_id()}"
    monkeypatch.setattr(boot, "boot_id", lambda: "2" * 8 + "-0000-4000-8000-" + "0" * 12)
    later = CheckedThisBoot(str(tmp_path))
    assert not later.has("a" * 64)
    # another boot's record used lately may be another machine's (a folder shared by
    # machines): kept, so that machine does not hash its copies again; a stale one is deleted
    assert old.exists()
    os.utime(old, (0, time.time() - boot.STALE_RECORD_S - 60))
    CheckedThisBoot(str(tmp_path))
    assert not old.exists()


def test_without_a_boot_id_nothing_is_recorded_and_every_copy_counts(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(boot, "boot_id", lambda: None)
    record = CheckedThisBoot(str(tmp_path))
    assert not record.enabled and record.has("a" * 64)
    record.add("a" * 64)
    assert list(tmp_path.iterdir()) == []
