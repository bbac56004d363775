"""A store that goes down before ``detdata verify`` runs (issue 40): one line, exit 3.

A real HTTP server on 127.0.0.1 serves the shards; ``verify`` passes while it runs. The server
is then stopped (by PID): ``verify`` ends in the one-line `StorageError` of the exit-code table
(exit 3) naming the URL, with the credential in it redacted, and a hint; each retry is not a
line of its own (it was: 36 lines at the default deadline), ``--verbose`` shows them, and
``--traceback`` shows the traceback.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from detdata import build_manifest
from tests.cli.test_cli_exit_codes import check_failure
from tests.cli.test_cli_manifest import run
from tests.servers import pid_alive, start_http, stop_pid

pytestmark = pytest.mark.multiproc

SECRET = "sekret-0123456789"


def _served_then_stopped(tmp_path: Path) -> tuple[Path, str, int]:
    """(manifest, root URL with a password in it, port) of shards whose server has stopped;
    ``verify`` passed against it while it ran."""
    server = start_http(tmp_path)
    try:
        docroot, url = server.new_dir()
        np.save(docroot / "shard-000.npy", np.arange(5000, dtype=np.uint16))
        np.save(docroot / "shard-001.npy", np.arange(3000, dtype=np.uint32))
        manifest = tmp_path / "m.json"
        build_manifest(str(docroot), progress=False).save(str(manifest))
        root = url.replace("http://", f"http://reader:{SECRET}@", 1)
        up = run("verify", str(manifest), "--root", root)
        assert up.returncode == 0, up.stderr
        assert up.stdout.startswith("ok ") and SECRET not in up.stdout
    finally:
        stop_pid(server.pid, 5)
    assert not pid_alive(server.pid)
    return manifest, root, server.port


def test_verify_with_the_server_down_is_one_line_exit_3(tmp_path: Path) -> None:
    manifest, root, port = _served_then_stopped(tmp_path)
    down = run("verify", str(manifest), "--root", root, "--deadline", "3")
    check_failure(down, 3, "storage error", f"127.0.0.1:{port}", "shard-00", "hint:", "--deadline")
    assert SECRET not in down.stderr + down.stdout
    assert "http://***@127.0.0.1" in down.stderr  # the URL, its password redacted
    assert "attempt(s)" in down.stderr  # the retries, summed up in the one line


def test_verbose_lists_each_retry_and_traceback_shows_the_traceback(tmp_path: Path) -> None:
    manifest, root, _ = _served_then_stopped(tmp_path)
    verbose = run("-v", "verify", str(manifest), "--root", root, "--deadline", "2")
    assert verbose.returncode == 3, verbose.stderr
    lines = verbose.stderr.splitlines()
    assert len(lines) > 2 and "failed on attempt 1" in lines[0], verbose.stderr
    assert lines[-1].startswith("detdata: storage error: ")
    traced = run("--traceback", "verify", str(manifest), "--root", root, "--deadline", "2")
    assert "Traceback (most recent call last)" in traced.stderr
    assert "RetriesExhausted" in traced.stderr
    assert SECRET not in verbose.stderr + traced.stderr


def test_a_bad_deadline_is_a_one_line_usage_error(tmp_path: Path) -> None:
    manifest = tmp_path / "m.json"
    root = tmp_path / "data"
    root.mkdir()
    np.save(root / "s.npy", np.arange(10, dtype=np.uint16))
    build_manifest(str(root), progress=False).save(str(manifest))
    for value in ("0", "-1", "nan", "inf"):
        done = run("verify", str(manifest), "--deadline", value)
        check_failure(done, 2, "--deadline")
