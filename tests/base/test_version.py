"""The package version has one home (`detdata.base.version`): the installed distribution's
metadata (what pip and the run record report) and ``detdata.__version__`` both read it."""

from __future__ import annotations

import importlib.metadata
import re

import detdata
from detdata.base.version import VERSION


def test_the_build_and_the_package_report_the_one_version() -> None:
    assert re.fullmatch(r"\d+\.\d+\.\d+", VERSION)  # PEP 440 normal form, no local part
    assert detdata.__version__ == VERSION
    assert importlib.metadata.version("detdata") == VERSION
