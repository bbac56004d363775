"""Soak sizes: how many rounds a soak or stress test runs.

A soak test (marked ``slow``) proves its property over many rounds: Ctrl-C storms, random
resumes, property tests with many examples. Every run executes every such test; the number
of rounds is the only thing that changes:

* the default: the bounded count, so the suite stays within its time. ``make test`` runs
  every test not marked ``slow``; ``make test-slow`` (``DETDATA_SOAK=0 pytest -m slow``) the
  slow set at these bounded counts; CI (.ci/run) runs both;
* ``DETDATA_SOAK=1``, ``pytest --soak`` (``make test-soak``) or ``pytest -m slow`` without
  ``DETDATA_SOAK=0``: the full count (tests/conftest.py sets ``DETDATA_SOAK`` for the two
  pytest forms, before any test module is imported, and worker processes inherit it).

The bounded count of each test is chosen so that it still exercises every branch the test
names (each interrupt point, each stage, each mode); the full count is the historical one.
"""

from __future__ import annotations

import os
import re

ENV = "DETDATA_SOAK"


def requested(markexpr: str, flag: bool) -> bool:
    """Whether a pytest run asks for the full counts: ``--soak`` (``flag``), or a ``-m``
    expression that selects ``slow`` (``slow``, ``slow and multiproc``; not ``not slow``)."""
    return flag or re.search(r"(?<!not )\bslow\b", markexpr) is not None


def full() -> bool:
    """True when the full soak counts were asked for (``DETDATA_SOAK`` set, not ``0``)."""
    return os.environ.get(ENV, "") not in ("", "0")


def rounds(full_count: int, bounded: int) -> int:
    """``full_count`` under a soak run, else ``bounded`` (never more than ``full_count``)."""
    if bounded > full_count:
        raise ValueError(f"bounded count {bounded} exceeds the full count {full_count}")
    return full_count if full() else bounded
