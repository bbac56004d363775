"""``detdata replay-check`` on a script whose mixture weights a loss-driven controller changes
during the run (issue 44): a correct resume passes (same samples every step, same weights
and final model), and a resume that forgets the controller's state fails at the first step
after the restart. The runs are forked from a warm interpreter (tests/forkserver.py), as in
tests/cli/test_cli_replay.py.

Covers: detdata/loading/reweighting.py through detdata/cli/replay.py.
"""

from __future__ import annotations

import json
import os
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.cli.test_cli_mix import detdata_exe
from tests.forkserver import Forkserver

pytestmark = [pytest.mark.multiproc]

SCRIPT = Path(__file__).with_name("replay_adaptive_script.py")
STOP = 3


@pytest.fixture(scope="module")
def warm() -> Iterator[Forkserver]:
    server = Forkserver(["blake3", "torch", "numpy", "detdata"], dict(os.environ))
    yield server
    server.close()


def _check(
    warm: Forkserver, out: Path, *flags: str
) -> tuple[subprocess.CompletedProcess[str], dict]:
    done = subprocess.run(
        [detdata_exe(), "replay-check", "--out", str(out), "--steps", "7", "--stop-at",
         str(STOP), "--timeout", "600", "--", *warm.client(SCRIPT), *flags],
        capture_output=True, text=True, timeout=900,
    )  # fmt: skip
    report = json.loads((out / "report.json").read_text()) if done.returncode in (0, 1) else {}
    return done, report


def test_a_controller_driven_run_resumed_whole_passes_and_one_forgetting_it_fails(
    warm: Forkserver, tmp_path: Path
) -> None:
    done, report = _check(warm, tmp_path / "whole")
    assert done.returncode == 0, done.stdout + done.stderr
    assert report["weights_identical"] is True
    assert report["first_divergent_step_A_C"] is None
    forgot, report = _check(warm, tmp_path / "forgot", "--forget-controller")
    assert forgot.returncode == 1, forgot.stdout + forgot.stderr
    assert report["first_divergent_step_A_B"] is None
    # the fresh controller chooses other weights for the first step after the restart
    assert report["first_divergent_step_A_C"]["step"] == STOP
