"""``detdata replay-check -- CMD`` on a user's own script (tests/cli/replay_user_script.py)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.cli.test_cli_mix import detdata_exe

pytestmark = [pytest.mark.multiproc, pytest.mark.slow]  # fresh processes: the CLI + the script

SCRIPT = Path(__file__).with_name("replay_user_script.py")


def _check(tmp_path: Path, *flags: str) -> tuple[subprocess.CompletedProcess[str], dict]:
    out = tmp_path / "replay"
    cmd = [sys.executable, str(SCRIPT), "--data", str(tmp_path / "data"), *flags]
    done = subprocess.run(
        [detdata_exe(), "replay-check", "--out", str(out), "--steps", "6", "--stop-at", "3",
         "--", *cmd],
        capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    report = json.loads((out / "report.json").read_text()) if done.returncode in (0, 1) else {}
    return done, report


def test_a_correct_script_passes(tmp_path: Path) -> None:
    done, report = _check(tmp_path)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "PASS" in done.stdout
    assert report["weights_identical"] is True
    assert report["first_divergent_step_A_C"] is None


def test_a_sampler_reset_fails_at_the_step_after_the_restart(tmp_path: Path) -> None:
    done, report = _check(tmp_path, "--forget-loader-state")
    assert done.returncode == 1, done.stdout + done.stderr
    assert "FAIL" in done.stdout
    assert report["first_divergent_step_A_B"] is None
    assert report["first_divergent_step_A_C"]["step"] == 3  # the first step after the restart
    assert report["weights_identical"] is False


def test_a_script_breaking_the_contract_is_a_usage_error(tmp_path: Path) -> None:
    done = subprocess.run(
        [detdata_exe(), "replay-check", "--out", str(tmp_path / "r"), "--", sys.executable,
         "-c", "print('hello')"],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert done.returncode == 2
    assert "weights" in done.stderr
