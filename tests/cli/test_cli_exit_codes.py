"""Exit codes of the real ``detdata`` console command, and the demo never deleting user files.

0 ok; 1 only for "the answer is no" (verification failed, difference found);
2 usage or input error; 3 storage error; each failure is one ``detdata: ...``
line on stderr naming the culprit, never a traceback. (Table: ``detdata --help``.)
"""

from __future__ import annotations

import errno
import re
import subprocess
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from detdata import StorageError, build_manifest, cli
from tests.cli.test_cli_manifest import console, run

pytestmark = pytest.mark.multiproc  # runs the real console command / child processes


def write_dataset(tmp_path: Path) -> tuple[Path, Path]:
    """A shard folder and its manifest file."""
    root = tmp_path / "data"
    root.mkdir()
    np.save(root / "shard-000.npy", np.arange(500, dtype=np.uint16))
    manifest = tmp_path / "m.json"
    build_manifest(str(root), progress=False).save(str(manifest))
    return root, manifest


def check_failure(
    result: subprocess.CompletedProcess[str], code: int, *culprits: str, one_line: bool = True
) -> None:
    context = f"exit {result.returncode}\nstdout: {result.stdout}\nstderr: {result.stderr}"
    assert result.returncode == code, context
    assert "Traceback" not in result.stderr, context
    for culprit in culprits:
        assert culprit in result.stderr, f"{culprit!r} not named\n{context}"
    if one_line:  # after the progress lines of work done before it (a build's closing line)
        lines = [ln for ln in result.stderr.splitlines() if not PROGRESS.match(ln)]
        assert len(lines) == 1 and lines[0].startswith("detdata: "), context
        assert result.stderr.endswith(lines[0] + "\n"), context


#: a progress line (`detdata.base.progress`): ``detdata: hashing: 3/3 (100%), ...`` or a
#: listing's ``detdata: listing files: 12 files in 0m00s``
PROGRESS = re.compile(r"^detdata: [\w :]+: [\d,]+(/[\d,]+ \(\d+%\), | files (in|so far) )")


@pytest.mark.slow
def test_usage_and_input_errors_exit_2_naming_the_culprit(tmp_path: Path) -> None:
    root, manifest = write_dataset(tmp_path)
    folder = tmp_path / "folder"
    folder.mkdir()
    a_file = tmp_path / "a-file"
    a_file.write_text("not a folder")
    binary = tmp_path / "binary.json"
    binary.write_bytes(b"\xff\xfe{\x00")
    cases: list[tuple[list[str], list[str]]] = [
        (["manifest", "build", str(root), "-o", str(folder)], ["-o", str(folder), "directory"]),
        (
            ["manifest", "build", str(root), "-o", str(a_file / "m.json")],
            [str(a_file), "not a folder"],
        ),
        (["manifest", "build", str(a_file), "-o", str(tmp_path / "x.json")], ["ROOT", str(a_file)]),
        (["verify", str(folder)], [str(folder), "directory"]),
        (["verify", str(binary)], [str(binary)]),
        (["verify", str(manifest), "--root", str(tmp_path / "nowhere")], ["--root", "nowhere"]),
        (
            ["register", "--registry", str(a_file), str(manifest), "x@v1"],
            ["--registry", str(a_file)],
        ),
        (
            ["register", "--registry", str(tmp_path / "reg"), str(tmp_path / "nope.json"), "x@v1"],
            ["nope.json"],
        ),
        (["hash", str(tmp_path / "nope.bin")], ["nope.bin"]),
        (["hash", str(folder)], [str(folder)]),
        (["order", "--n", "0", "--seed", "1", "--at", "0"], ["--n"]),
        (["order", "--n", "9", "--seed", "-1", "--at", "0"], ["--seed"]),
        (["mix", "--config", str(folder)], [str(folder)]),
        (["mix", "--config", str(binary)], [str(binary)]),
        (["diff", str(folder), str(manifest)], [str(folder)]),
        (["diff", str(manifest), str(manifest)], [f"{manifest}:1"]),
        (["replay-check", "--steps", "-3", "--out", str(tmp_path / "rc")], ["--steps", "-3"]),
        (
            ["replay-check", "--timeout", "0", "--out", str(tmp_path / "rt"), "--", "true"],
            ["--timeout", "got 0.0"],
        ),
        (["demo", "--steps", "40", "--stop-at", "40", "--out", str(tmp_path / "d")], ["--stop-at"]),
        (["demo", "--out", str(a_file)], ["--out", str(a_file)]),
        (["bench", "--repo", str(tmp_path / "no-checkout")], ["no-checkout"]),
    ]
    for args, culprits in cases:
        check_failure(run(*args), 2, *culprits)
    assert sorted(p.name for p in folder.iterdir()) == []  # the refused build wrote nothing there
    for untouched in ("rc", "rt", "d"):  # every argument is checked before the disk is touched
        assert not (tmp_path / untouched).exists(), untouched
    check_failure(run("no-such-command"), 2, "no-such-command", one_line=False)  # argparse usage
    shard = root / "shard-000.npy"  # while a real verification failure stays 1
    shard.write_bytes(shard.read_bytes()[:-2])
    check_failure(run("verify", str(manifest)), 1, "shard-000.npy")


def _raise(exc: BaseException) -> Callable[..., Any]:
    def fail(*_args: Any, **_kwargs: Any) -> Any:
        raise exc

    return fail


@pytest.mark.parametrize(
    ("exc", "code", "words"),
    [
        (StorageError("range read failed for shard s.npy at s3://b/s.npy"), 3, "s3://b/s.npy"),
        (OSError(errno.EIO, "Input/output error", "/mnt/d/s.npy"), 3, "/mnt/d/s.npy"),
        (OSError(errno.ENOSPC, "No space left on device"), 3, "No space left"),
        (PermissionError(errno.EACCES, "Permission denied", "/root/x"), 2, "/root/x"),
        (KeyError("oops"), 2, "internal error"),
    ],
    ids=["storage-error", "eio", "disk-full", "permission", "bug"],
)
def test_storage_and_unexpected_errors_are_mapped(
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    tmp_path: Path,
    exc: BaseException,
    code: int,
    words: str,
) -> None:
    """In-process (``cli.main``, the console's entry point): errors a subprocess cannot provoke."""
    target = tmp_path / "f.bin"
    target.write_bytes(b"x")
    monkeypatch.setattr("detdata.cli.manifest.hash_files", _raise(exc))
    assert cli.main(["hash", str(target)]) == code
    err = capsys.readouterr().err
    assert words in err and err.count("\n") == 1 and "Traceback" not in err
    with pytest.raises(type(exc)):
        cli.main(["--traceback", "hash", str(target)])


@pytest.mark.multiproc
def test_closed_output_pipe_is_not_a_traceback() -> None:
    proc = subprocess.Popen(
        [*console(), "order", "--n", "5000000", "--seed", "1", "--at", "0", "--count", "5000000"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    assert proc.stdout is not None and proc.stderr is not None
    assert proc.stdout.readline().strip().isdigit()
    proc.stdout.close()
    err = proc.stderr.read()
    assert proc.wait(timeout=120) == 141, err
    assert "Traceback" not in err


# ------------------------------------------------------------------ demo output folder


def _user_folder(path: Path) -> dict[str, str]:
    (path / "runs").mkdir(parents=True)
    files = {"notes.txt": "my notes", "runs/keep.log": "my log", "report.json": "{}"}
    for name, text in files.items():
        (path / name).write_text(text)
    return files


def test_demo_never_deletes_a_folder_it_did_not_create(tmp_path: Path) -> None:
    precious = tmp_path / "precious"
    files = _user_folder(precious)
    attempts = [
        (["demo", "--steps", "0", "--out", str(precious)], ["--steps"]),
        (["demo", "--stop-at", "0", "--out", str(precious)], ["--stop-at"]),
        (["demo", "--out", str(precious)], [str(precious), ".detdata-demo"]),
        (["replay-check", "--steps", "1", "--out", str(precious)], ["--steps"]),
        (["replay-check", "--out", str(precious)], [str(precious), ".detdata-demo"]),
    ]
    for args, culprits in attempts:
        check_failure(run(*args), 2, *culprits)
        assert {str(p.relative_to(precious)) for p in precious.rglob("*")} == {*files, "runs"}, args
        assert all((precious / name).read_text() == text for name, text in files.items())


def test_demo_folder_marker_lets_it_clear_only_its_own_output(tmp_path: Path) -> None:
    from detdata.cli.demo import MARKER, prepare_out

    out = tmp_path / "new" / "demo_out"
    prepare_out(out, clear=True)  # created, marked
    assert [p.name for p in out.iterdir()] == [MARKER]
    outside = tmp_path / "outside.txt"
    outside.write_text("not the demo's")
    (out / "runs").mkdir()
    (out / "runs" / "A.trace.jsonl").write_text("{}\n")
    (out / "link").symlink_to(outside)
    prepare_out(out, clear=False)  # reuse keeps everything
    assert (out / "runs" / "A.trace.jsonl").exists()
    prepare_out(out, clear=True)
    assert [p.name for p in out.iterdir()] == [MARKER] and outside.read_text() == "not the demo's"
    empty = tmp_path / "empty"
    empty.mkdir()
    prepare_out(empty, clear=True)  # an empty folder is adopted
    assert (empty / MARKER).exists()
