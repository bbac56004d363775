"""``-o`` / ``--out`` of the real console command: what the path names is respected.

A symlink is written through (the link stays, its target gets the bytes), a FIFO's
reader gets the bytes, ``/dev/full`` (a real full device) is a storage error (exit 3)
and stays a device, a folder is refused (exit 2), and new files honour the umask. The
reference for the written bytes is the same command writing a plain new file.
"""

from __future__ import annotations

import os
import stat
import subprocess
import threading
from pathlib import Path

import numpy as np
import pytest

from tests.cli.test_cli_exit_codes import check_failure
from tests.cli.test_cli_manifest import console, run

pytestmark = pytest.mark.multiproc


@pytest.fixture
def root(tmp_path: Path) -> Path:
    data = tmp_path / "data"
    data.mkdir()
    np.save(data / "s0.npy", np.arange(300, dtype=np.uint16))
    return data


def _command(kind: str, root: Path, out: Path) -> list[str]:
    if kind == "manifest":
        return ["manifest", "build", str(root), "-o", str(out)]
    return ["env", "--repo", str(root), "--out", str(out)]


def _reference(kind: str, root: Path, tmp_path: Path) -> bytes:
    plain = tmp_path / f"plain-{kind}.json"
    result = run(*_command(kind, root, plain))
    assert result.returncode == 0, result.stderr
    return plain.read_bytes()


def _same(kind: str, got: bytes, want: bytes) -> None:
    if kind == "manifest":
        assert got == want
    else:  # a run record holds its capture time: compare without it
        import json

        a, b = json.loads(got), json.loads(want)
        for doc in (a, b):
            doc.pop("captured_at", None)
            doc.pop("time", None)
        assert a.keys() == b.keys()


KINDS = ["manifest", "env"]


@pytest.mark.parametrize("kind", KINDS)
def test_a_symlink_is_written_through(kind: str, root: Path, tmp_path: Path) -> None:
    want = _reference(kind, root, tmp_path)
    target = tmp_path / "real.json"
    target.write_text("old")
    link = tmp_path / "link.json"
    link.symlink_to(target)
    result = run(*_command(kind, root, link))
    assert result.returncode == 0, result.stderr
    assert link.is_symlink() and os.readlink(link) == str(target)
    _same(kind, target.read_bytes(), want)


@pytest.mark.parametrize("kind", KINDS)
def test_a_fifo_reader_gets_the_bytes(kind: str, root: Path, tmp_path: Path) -> None:
    want = _reference(kind, root, tmp_path)
    fifo = tmp_path / "pipe"
    os.mkfifo(fifo)
    got: list[bytes] = []
    reader = threading.Thread(target=lambda: got.append(fifo.read_bytes()))
    reader.start()
    result = run(*_command(kind, root, fifo))
    reader.join(timeout=30)
    if reader.is_alive():  # nothing opened the FIFO for writing: release the reader
        os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))
        reader.join()
    assert result.returncode == 0, result.stderr
    assert stat.S_ISFIFO(fifo.stat().st_mode)  # still a FIFO, not replaced by a file
    assert got[0], "the FIFO's reader got nothing"
    _same(kind, got[0], want)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("via_link", [False, True])
def test_a_full_device_is_a_storage_error_exit_3(
    kind: str, via_link: bool, root: Path, tmp_path: Path
) -> None:
    out = Path("/dev/full")
    if via_link:
        out = tmp_path / "to-full"
        out.symlink_to("/dev/full")
    result = run(*_command(kind, root, out))
    check_failure(result, 3, str(out), "No space left", one_line=kind == "manifest")
    assert "storage error" in result.stderr
    assert stat.S_ISCHR(os.stat("/dev/full").st_mode)  # still the device


@pytest.mark.parametrize("kind", KINDS)
def test_a_folder_or_a_link_to_one_is_refused_exit_2(kind: str, root: Path, tmp_path: Path) -> None:
    folder = tmp_path / "folder"
    folder.mkdir()
    link = tmp_path / "to-folder"
    link.symlink_to(folder)
    for out in (folder, link):
        result = run(*_command(kind, root, out))
        check_failure(result, 2, str(out), one_line=kind == "manifest")
        assert list(folder.iterdir()) == []


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("umask", [0o022, 0o027, 0o002])
def test_new_files_honour_the_umask_and_replaced_files_keep_their_mode(
    kind: str, umask: int, root: Path, tmp_path: Path
) -> None:
    out = tmp_path / "new.json"
    result = subprocess.run(
        [
            "sh",
            "-c",
            f'umask {umask:03o} && exec "$@"',
            "sh",
            *console(),
            *_command(kind, root, out),
        ],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert result.returncode == 0, result.stderr
    assert stat.S_IMODE(out.stat().st_mode) == 0o666 & ~umask
    out.chmod(0o640)
    assert run(*_command(kind, root, out)).returncode == 0
    assert stat.S_IMODE(out.stat().st_mode) == 0o640


def test_dev_stdout_as_a_pipe_is_written_in_place(root: Path, tmp_path: Path) -> None:
    """``-o /dev/stdout`` into a pipe: /dev/stdout -> /proc/self/fd/1 -> a pipe with no path;
    opened by its own name, never resolved and replaced."""
    want = _reference("manifest", root, tmp_path)
    result = run(*_command("manifest", root, Path("/dev/stdout")))
    assert result.returncode == 0, result.stderr
    assert result.stdout.encode().startswith(want)
