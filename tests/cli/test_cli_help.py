"""``detdata --help`` and every command's help read as plain text (issue 34).

* every argument of every command and sub-command has a help string;
* no help shows reST markup (````--data````, ```name```);
* the top-level help lists the commands grouped by task (`TASKS`), each exactly once.

Covers: detdata/cli/__main__.py.
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

from detdata.cli.main import TASKS, build_parser

ROOT = Path(__file__).resolve().parents[2]


def _parsers(
    name: str, parser: argparse.ArgumentParser
) -> Iterator[tuple[str, argparse.ArgumentParser]]:
    yield name, parser
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for child, sub in action.choices.items():
                yield from _parsers(f"{name} {child}", sub)


def test_every_argument_of_every_command_has_a_help_string() -> None:
    missing = [
        f"{name} {action.option_strings or action.dest}"
        for name, parser in _parsers("detdata", build_parser())
        for action in parser._actions
        if not isinstance(action, (argparse._HelpAction, argparse._SubParsersAction))
        and not action.help
    ]
    assert missing == [], f"arguments without help: {missing}"


def test_no_help_text_shows_rest_markup() -> None:
    marked = [
        name
        for name, parser in _parsers("detdata", build_parser())
        if "``" in parser.format_help() or "`" in parser.format_help()
    ]
    assert marked == [], f"help with reST markup: {marked}"


def test_top_level_help_groups_the_commands_by_task() -> None:
    done = subprocess.run(
        [sys.executable, "-m", "detdata.cli", "--help"],
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        capture_output=True,
        text=True,
        check=True,
    )
    lines = done.stdout.splitlines()
    registered = sorted(
        next(
            a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction)
        ).choices
    )
    listed: dict[str, str] = {}  # command -> the heading it is listed under
    heading = ""
    for line in lines:
        if line.endswith(":") and not line.startswith(" "):
            heading = line[:-1]
        elif line.startswith("  ") and not line.startswith("   ") and heading:
            word = line.split()[0]
            if word in registered:
                assert word not in listed, f"{word} listed twice"
                listed[word] = heading
    assert sorted(listed) == registered, done.stdout
    for title, commands in TASKS:
        for command in commands:
            if command in registered:
                assert listed[command] == title, (command, listed[command])
    assert "usage: detdata [-h] [--traceback] [-v] COMMAND ..." in done.stdout


def test_every_usage_line_starts_with_the_command_a_user_types() -> None:
    """Issue 46: ``detdata manifest build --help`` showed ``usage: detdata [-h] [--traceback]
    COMMAND ... manifest build``; each usage line now starts with the command itself."""
    garbled = []
    for name, parser in _parsers("detdata", build_parser()):
        usage = parser.format_usage()
        if not usage.startswith(f"usage: {name} ") or (name != "detdata" and "COMMAND" in usage):
            garbled.append(usage.splitlines()[0])
    assert garbled == [], f"usage lines that do not start with their command: {garbled}"


def test_every_command_has_a_description_and_no_help_names_an_internal_module() -> None:
    """Issue 46: ``manifest``, ``hash``, ``verify``, ``order``, ``demo`` had no description;
    ``diff``, ``preflight``, ``split`` named ``detdata.loading.trace``,
    ``detdata.base.redact.redact_text``, ``detdata.datasets.split.Split``; no help spells the
    deprecated ``DataLoader(trace=...)`` (the option is ``LoaderOptions(trace=...)``)."""
    internal = re.compile(r"\bdetdata\.(base|storage|identity|order|datasets|loading|cli)\.")
    undescribed, naming, deprecated = [], [], []
    for name, parser in _parsers("detdata", build_parser()):
        text = parser.format_help()
        if not (parser.description or "").strip():
            undescribed.append(name)
        naming += [f"{name}: {m.group(0)}" for m in internal.finditer(text)]
        if "DataLoader(trace=" in text.replace(" ", ""):
            deprecated.append(name)
    assert undescribed == [], f"commands without a description: {undescribed}"
    assert naming == [], f"help naming internal modules: {naming}"
    assert deprecated == [], f"help spelling DataLoader(trace=...): {deprecated}"
