"""The exception tree drawn in `detdata.base.errors`' docstring is the module's tree."""

from __future__ import annotations

import inspect
import re

from detdata.base import errors


def _drawn() -> dict[str, str | None]:
    """class name -> parent name, read off the docstring's drawing (indent = depth)."""
    doc = errors.__doc__ or ""
    parents: dict[str, str | None] = {}
    stack: list[tuple[int, str]] = []
    for line in doc.splitlines():
        found = re.match(r"^(\s*(?:[│ ]\s*)*(?:[├└]── )?)([A-Z]\w+)( \(\w+\))?\s", line + " ")
        if not found or ("──" not in line and found.group(2) != "DetdataError"):
            continue
        depth = len(found.group(1))
        while stack and stack[-1][0] >= depth:
            stack.pop()
        parents[found.group(2)] = stack[-1][1] if stack else None
        stack.append((depth, found.group(2)))
    return parents


def test_the_drawn_tree_is_the_module_s() -> None:
    actual: dict[str, str | None] = {}
    for name, cls in inspect.getmembers(errors, inspect.isclass):
        if issubclass(cls, errors.DetdataError):  # (their __module__ reads "detdata")
            own = [b for b in cls.__bases__ if issubclass(b, errors.DetdataError)]
            actual[name] = own[0].__name__ if own else None
    assert _drawn() == actual
