"""``--plot`` writes its PNG as ``-o`` writes its file: atomically (issue 40).

A failure while the picture is being written (a real one: the process's file-size limit,
``RLIMIT_FSIZE``, makes the write fail with ``EFBIG`` part-way) leaves the previous picture
whole, byte for byte, and no temp file; a symlink at the output path keeps pointing at its
target, which is replaced by the new picture rather than overwritten in place (a hard link
to the old target still holds the old bytes). The reference for the new bytes is the same
command writing a plain new file.
"""

from __future__ import annotations

import json
import os
import resource
import signal
import subprocess
from pathlib import Path

import pytest

from tests.cli.test_cli_exit_codes import check_failure
from tests.cli.test_cli_manifest import console
from tests.cli.test_plots import check_png

pytestmark = pytest.mark.multiproc

pytest.importorskip("matplotlib", reason="matplotlib is in the dev lock: the plots extra")

#: a file-size limit well under any picture (the PNGs here are > 10 KiB: `check_png`)
SIZE_LIMIT = 4096


def _config(tmp_path: Path) -> Path:
    path = tmp_path / "mix.json"
    doc = {
        "seed": 7,
        "sources": {"code": {"num_samples": 700}, "web": {"num_samples": 5000}},
        "schedule": [[0, {"code": 3, "web": 6}], [1000, {"code": 1, "web": 2}]],
    }
    path.write_text(json.dumps(doc), encoding="utf-8")
    return path


def _limit_file_size() -> None:
    """In the child: writes past `SIZE_LIMIT` fail with EFBIG (SIGXFSZ ignored, not fatal)."""
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    resource.setrlimit(resource.RLIMIT_FSIZE, (SIZE_LIMIT, SIZE_LIMIT))


def _plot(
    tmp_path: Path, count: int, out: Path, *, limited: bool = False
) -> subprocess.CompletedProcess[str]:
    args = ["mix", "--config", str(_config(tmp_path)), "--count", str(count), "--plot", str(out)]
    return subprocess.run(
        [*console(), *args],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
        preexec_fn=_limit_file_size if limited else None,
    )


def test_a_failure_while_writing_the_plot_leaves_the_previous_file_whole(tmp_path: Path) -> None:
    folder = tmp_path / "plots"
    folder.mkdir()
    out = folder / "shares.png"
    first = _plot(tmp_path, 1000, out)  # the previous picture (and matplotlib's caches warm)
    assert first.returncode == 0, first.stderr
    check_png(out)
    before = out.read_bytes()
    assert len(before) > SIZE_LIMIT

    failed = _plot(tmp_path, 2560, out, limited=True)
    assert out.read_bytes() == before, failed.stderr  # not truncated, not torn
    check_failure(failed, 3, str(out), "File too large")
    assert sorted(p.name for p in folder.iterdir()) == ["shares.png"]  # no temp file left


def test_a_symlink_at_the_plot_path_is_written_through_not_overwritten(tmp_path: Path) -> None:
    reference = tmp_path / "plain.png"
    done = _plot(tmp_path, 2560, reference)
    assert done.returncode == 0, done.stderr
    check_png(reference)

    target = tmp_path / "target.png"
    target.write_bytes(b"the target's own bytes")
    keep = tmp_path / "hard-link-to-target"
    os.link(target, keep)  # the target's inode, seen from elsewhere
    link = tmp_path / "link.png"
    link.symlink_to(target)

    done = _plot(tmp_path, 2560, link)
    assert done.returncode == 0, done.stderr
    assert link.is_symlink() and os.readlink(link) == str(target)
    assert target.read_bytes() == reference.read_bytes()  # the whole new picture
    assert keep.read_bytes() == b"the target's own bytes"  # replaced, not written in place


def test_a_plot_path_that_is_a_folder_is_refused_exit_2(tmp_path: Path) -> None:
    folder = tmp_path / "folder"
    folder.mkdir()
    link = tmp_path / "to-folder"
    link.symlink_to(folder)
    for out in (folder, link):
        done = _plot(tmp_path, 100, out)
        check_failure(done, 2, str(out))
        assert list(folder.iterdir()) == []
