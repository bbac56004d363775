"""Progress of long work shows in a log, not only on a terminal (issue 34).

In a child whose stderr is a pipe (as under SLURM or CI), hashing shards (`build_manifest`),
verifying them and hashing a content split's samples print ``detdata: ...: done/total (pct),
rate unit/s, ETA ...`` lines and a closing ``done in`` line (the interval is set to 0 here so
that tiny work shows them); ``DETDATA_PROGRESS=0`` silences every one of them.

Covers: detdata/base/progress.py.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parent.parent
CODE = """
import numpy as np
import detdata
import detdata.base.progress as progress
progress.LOG_EVERY_S = 0.0  # a line at every update: the work here is tiny
for i in range(3):
    np.save(f"s{i}.npy", np.arange(1000, dtype=np.uint16))
m = detdata.build_manifest(".", pattern="*.npy", threads=1)
m.verify("full")
detdata.Split(detdata.TokenWindows(m, seq_len=15), fraction="1/10", salt="v1")
print("ok")
"""
LINE = re.compile(r"^detdata: (.+?): ([\d,]+)/([\d,]+) \(\d+%\), [\d,.]+ (\w+)/s, (ETA|done in) ")


def _run(tmp_path: Path, **env: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", CODE],
        cwd=tmp_path,
        env={**os.environ, "PYTHONPATH": str(ROOT), **env},
        capture_output=True,
        text=True,
        check=False,
    )


def test_long_work_prints_progress_lines_with_rate_and_eta_when_stderr_is_a_log(
    tmp_path: Path,
) -> None:
    done = _run(tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    lines = [m for m in map(LINE.match, done.stderr.splitlines()) if m]
    tasks = {m.group(1) for m in lines}
    assert any(m.group(4) == "shard" for m in lines), done.stderr
    assert "split: hashing samples" in tasks, done.stderr
    split = [m for m in lines if m.group(1) == "split: hashing samples"]
    total = int(split[-1].group(3).replace(",", ""))
    assert total == 3 * (999 // 15)  # every window of the split's dataset is counted
    assert split[-1].group(5) == "done in" and split[-1].group(2) == split[-1].group(3)
    assert any(m.group(5) == "ETA" for m in split)


@pytest.mark.parametrize("value", ["0", "off"])
def test_one_switch_silences_every_progress_line(tmp_path: Path, value: str) -> None:
    done = _run(tmp_path, DETDATA_PROGRESS=value)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.strip() == "ok"
    assert "detdata:" not in done.stderr, done.stderr


LISTING = """
import os
import numpy as np
import detdata
import detdata.base.progress as progress
progress.LOG_EVERY_S = 0.0  # a line at every folder listed: the tree here is tiny
for sub in ("a", "b/c"):
    os.makedirs(sub, exist_ok=True)
    for i in range(2):
        np.save(f"{sub}/s{i}.npy", np.arange(100, dtype=np.uint16))
open("b/notes.txt", "w").write("not a shard")
print(detdata.build_manifest(".", pattern="**/*.npy", threads=1).num_samples)
"""


def test_a_build_shows_progress_while_it_lists_the_files(tmp_path: Path) -> None:
    """Issue 46: listing 120k shards took 17 s of 60 with nothing shown; now the listing
    counts the files it has found (4 shards and a text file written here) as it goes."""
    done = subprocess.run(
        [sys.executable, "-c", LISTING],
        cwd=tmp_path,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        capture_output=True,
        text=True,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.strip() == str(4 * 100)
    lines = done.stderr.splitlines()
    listing = [ln for ln in lines if ln.startswith("detdata: listing files: ")]
    assert any(" files so far, " in ln for ln in listing), done.stderr
    assert listing[-1].startswith("detdata: listing files: 5 files in "), done.stderr
    first_hash = next(i for i, ln in enumerate(lines) if ln.startswith("detdata: hashing"))
    assert lines.index(listing[-1]) < first_hash  # shown while listing, before hashing


def _shards(folder: Path) -> None:
    folder.mkdir()
    for i in range(3):
        np.save(folder / f"s{i}.npy", np.arange(1000, dtype=np.uint16))


def test_a_short_command_line_build_in_a_log_ends_with_its_closing_line(tmp_path: Path) -> None:
    """Issue 46: ``detdata manifest build`` of a few shards, its stderr a log, showed nothing."""
    _shards(tmp_path / "data")
    done = subprocess.run(
        [sys.executable, "-m", "detdata.cli", "manifest", "build", "data", "-o", "m.json"],
        cwd=tmp_path,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        capture_output=True,
        text=True,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    closing = [
        m for m in map(LINE.match, done.stderr.splitlines()) if m and m.group(5) == "done in"
    ]
    assert [(m.group(1), m.group(2), m.group(3)) for m in closing] == [("hashing", "3", "3")]


def test_detdata_progress_1_forces_the_closing_line(tmp_path: Path) -> None:
    """Issue 46: ``DETDATA_PROGRESS=1`` forces progress on, closing line included (as the
    module says), for a build given no ``progress=``; without it a short build stays quiet."""
    _shards(tmp_path / "data")
    code = "import detdata; detdata.build_manifest('data', threads=1)"
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    env.pop("DETDATA_PROGRESS", None)
    for switch, want in (("1", [("hashing", "3", "3")]), ("", [])):
        done = subprocess.run(
            [sys.executable, "-c", code],
            cwd=tmp_path,
            env={**env, "DETDATA_PROGRESS": switch},
            capture_output=True,
            text=True,
            check=False,
        )
        assert done.returncode == 0, done.stderr[-3000:]
        matches = [m for m in map(LINE.match, done.stderr.splitlines()) if m]
        closing = [(m.group(1), m.group(2), m.group(3)) for m in matches if m.group(5) == "done in"]
        assert closing == want, (switch, done.stderr)
