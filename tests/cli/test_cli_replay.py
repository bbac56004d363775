"""``detdata replay-check -- CMD`` on a user's own script (tests/cli/replay_user_script.py).

The CLI runs in a fresh process and starts each of its four runs in a fresh process, as a
user's would be. The command it is given starts the script in a process forked from a warm
interpreter that imported torch, numpy, blake3, detdata and what the script's
``torch.use_deterministic_algorithms(True)`` imports (``torch._inductor``) once
(tests/forkserver.py: a new pid, session, environment and working directory, the CLI's
stdout and stderr), not in one that imports them again: about 7 CPU-seconds a run.

Covers: detdata/loading/model_digest.py.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.cli.test_cli_mix import detdata_exe
from tests.forkserver import Forkserver

pytestmark = [pytest.mark.multiproc, pytest.mark.slow]  # fresh processes: the CLI + the script

SCRIPT = Path(__file__).with_name("replay_user_script.py")


@pytest.fixture(scope="module")
def warm() -> Iterator[Forkserver]:
    """The warm interpreter the user script's runs are forked from."""
    preload = ["blake3", "numpy", "torch", "detdata", "torch._inductor"]  # the script's order
    server = Forkserver(preload, dict(os.environ))
    yield server
    server.close()


def _check(
    warm: Forkserver, tmp_path: Path, *flags: str, timeout: str = "600"
) -> tuple[subprocess.CompletedProcess[str], dict]:
    out = tmp_path / "replay"
    cmd = [*warm.client(SCRIPT), "--data", str(tmp_path / "data"), *flags]
    done = subprocess.run(
        [detdata_exe(), "replay-check", "--out", str(out), "--steps", "6", "--stop-at", "3",
         "--timeout", timeout, "--", *cmd],
        capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    report = json.loads((out / "report.json").read_text()) if done.returncode in (0, 1) else {}
    return done, report


def test_a_sampler_reset_fails_at_the_step_after_the_restart(
    warm: Forkserver, tmp_path: Path
) -> None:
    done, report = _check(warm, tmp_path, "--forget-loader-state")
    assert done.returncode == 1, done.stdout + done.stderr
    assert "FAIL" in done.stdout
    assert report["first_divergent_step_A_B"] is None
    assert report["first_divergent_step_A_C"]["step"] == 3  # the first step after the restart
    assert report["weights_identical"] is False
    line = next(
        x for x in done.stdout.splitlines() if x.startswith("first divergent data step A vs C")
    )
    assert "discontinuity in C" in line and "in B" not in line


# The faults act in run C's resumed process only (stop-at 3): the optimizer's moments, the
# dropout masks and the summation order of step 3 already differ there; a fresh scheduler does
# not change step 3's learning rate (the restored optimizer holds it), only its own step at
# the end of step 3, so the models first differ after step 4.
SCENARIOS = [
    (None, None),  # a correct script: PASS (it also covers the run without faults)
    ("optimizer-reset", 3),
    ("dropout-rng", 3),
    ("scheduler", 4),
    ("reduction-order", 3),
]


@pytest.mark.parametrize(("fault", "first"), SCENARIOS, ids=[str(f) for f, _ in SCENARIOS])
def test_model_side_faults_get_their_first_divergent_step(
    warm: Forkserver, tmp_path: Path, fault: str | None, first: int | None
) -> None:
    flags = ["--report-model"] + ([] if fault is None else ["--fault", fault])
    done, report = _check(warm, tmp_path, *flags)
    assert done.returncode == (0 if fault is None else 1), done.stdout + done.stderr
    assert report["first_divergent_step_A_B"] is None  # the data is right in every scenario
    assert report["first_divergent_step_A_C"] is None
    assert report["first_divergent_model_step_A_B"] is None
    found = report["first_divergent_model_step_A_C"]
    assert (None if found is None else found["step"]) == first
    assert report["weights_identical"] is (fault is None)
    expected = "none" if first is None else f"step {first} "
    assert f"first divergent model step A vs C: {expected}" in done.stdout
    assert ("PASS" in done.stdout) is (fault is None)


def test_a_script_ignoring_stop_at_fails(warm: Forkserver, tmp_path: Path) -> None:
    done, report = _check(warm, tmp_path, "--ignore-stop-at")
    assert done.returncode == 1, done.stdout + done.stderr
    assert "run C did not stop at step 3" in done.stdout and "FAIL" in done.stdout
    assert report["weights_identical"] is True  # what the old check passed on


def test_empty_traces_fail(warm: Forkserver, tmp_path: Path) -> None:
    done, _ = _check(warm, tmp_path, "--empty-trace")
    assert done.returncode == 1, done.stdout + done.stderr
    assert "the trace of run A is empty: nothing was compared" in done.stdout


HANGS_ON_RESUME = (
    "import sys, time\n"
    "if '--resume' in sys.argv:\n"
    "    time.sleep(600)\n"
    "print('weights 0123456789abcdef')\n"
)


def test_a_hanging_run_times_out_naming_it(tmp_path: Path) -> None:
    done = subprocess.run(
        [detdata_exe(), "replay-check", "--out", str(tmp_path / "r"), "--timeout", "15", "--",
         sys.executable, "-c", HANGS_ON_RESUME],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert done.returncode == 2, done.stdout + done.stderr
    assert "run C (resumed) ran past --timeout 15 s and was killed" in done.stderr


def test_help_states_the_contract() -> None:
    done = subprocess.run(
        [detdata_exe(), "replay-check", "--help"], capture_output=True, text=True, timeout=120
    )
    for text in ("--stop-at K", "--timeout", "report_model_step", "empty", "did not restore"):
        assert text in done.stdout, text


def test_a_script_breaking_the_contract_is_a_usage_error(tmp_path: Path) -> None:
    done = subprocess.run(
        [detdata_exe(), "replay-check", "--out", str(tmp_path / "r"), "--", sys.executable,
         "-c", "print('hello')"],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert done.returncode == 2
    assert "weights" in done.stderr
