"""``detdata diff A B``: the first step where two loader traces differ."""

from __future__ import annotations

import argparse
import json
from typing import Any

from detdata._errors import ConfigError
from detdata._trace import first_difference, read_trace


def register(sub: Any) -> None:
    p = sub.add_parser("diff", help="compare two loader traces (JSONL); exit 1 at the first difference")
    p.add_argument("a", help="trace A (JSONL written by DataLoader(trace=...))")
    p.add_argument("b", help="trace B")
    p.set_defaults(func=run_diff)


def _load(path: str) -> list[dict[str, Any]]:
    try:
        return read_trace(path)
    except FileNotFoundError:
        raise ConfigError(f"trace file not found: {path}") from None
    except (ValueError, KeyError) as exc:
        raise ConfigError(f"trace file {path} is not a detdata trace ({exc})") from None


def run_diff(args: argparse.Namespace) -> int:
    a, b = _load(args.a), _load(args.b)
    try:
        diff = first_difference(a, b)
    except KeyError as exc:
        raise ConfigError(f"trace record without field {exc}; is this a detdata trace?") from None
    if diff is None:
        print(f"identical: {len(a)} steps")
        return 0
    print(f"first difference at step {diff['step']} (rank {diff['rank']}): {diff['reason']}")
    if "a" in diff:
        print("A: " + json.dumps(diff["a"], sort_keys=True))
        print("B: " + json.dumps(diff["b"], sort_keys=True))
    return 1
