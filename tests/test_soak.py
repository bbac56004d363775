"""The soak switch (tests/soak.py): bounded counts by default, the full counts under
``DETDATA_SOAK=1``, ``pytest --soak`` or ``pytest -m slow`` (bounded again with an explicit
``DETDATA_SOAK=0``: ``make test-slow``), set before test modules are imported (their counts
are read at import) by tests/conftest.py."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests import soak

ROOT = Path(__file__).resolve().parents[1]


def test_counts_follow_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    for value, full in (("", False), ("0", False), ("1", True), ("yes", True)):
        monkeypatch.setenv(soak.ENV, value)
        assert soak.full() is full
        assert soak.rounds(160, 40) == (160 if full else 40)
    monkeypatch.delenv(soak.ENV)
    assert soak.rounds(25, 10) == 10
    with pytest.raises(ValueError, match="bounded count 50 exceeds the full count 40"):
        soak.rounds(40, 50)


@pytest.mark.parametrize(
    ("markexpr", "flag", "full"),
    [
        ("", False, False),
        ("", True, True),
        ("slow", False, True),
        ("slow and multiproc", False, True),
        ("multiproc or slow", False, True),
        ("not slow", False, False),
        ("multiproc and not slow", False, False),
        ("slowest", False, False),
    ],
)
def test_a_run_asks_for_full_counts_by_flag_or_by_selecting_slow(
    markexpr: str, flag: bool, full: bool
) -> None:
    assert soak.requested(markexpr, flag) is full


@pytest.mark.parametrize(
    ("args", "given", "full"),
    [
        ([], None, "unset"),
        (["-m", "slow"], None, "1"),
        (["--soak"], None, "1"),
        (["-m", "not slow"], None, "unset"),
        (["-m", "slow"], "0", "0"),  # make test-slow (CI): the slow set at bounded counts
        (["--soak"], "0", "1"),
    ],
)
def test_pytest_sets_the_switch_before_collecting(
    args: list[str], given: str | None, full: str
) -> None:
    """A real pytest run (collection only) in a fresh process: what the environment holds
    once pytest configured itself (``given``: DETDATA_SOAK before the run; None: unset)."""
    code = (
        "import os, pytest\n"
        f"pytest.main(['--collect-only', '-q', '-p', 'no:cacheprovider', *{args!r}, "
        "'tests/test_soak.py'])\n"
        f"print('SOAK=' + os.environ.get({soak.ENV!r}, 'unset'))\n"
    )
    env = {k: v for k, v in os.environ.items() if k != soak.ENV}
    if given is not None:
        env[soak.ENV] = given
    done = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120
    )
    assert done.stdout.strip().splitlines()[-1] == f"SOAK={full}", done.stdout + done.stderr
