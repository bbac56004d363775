"""``detdata diff A B``: the first global step where two loader traces differ; \
``--state``: two states.

Traces are compared per global step from what each run delivered (the JSONL
trace a loader writes with ``LoaderOptions(trace=PATH)``): resumed runs appending to
one file, replays after a restore, other micro batch sizes or worker counts compare
equal when the same samples were delivered; conflicting replays, restarted cursors and
missing steps are differences. Exit 0 identical, 1 different, 2 unreadable or malformed
input.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Iterator
from typing import Any, Final

from detdata.base.errors import ConfigError
from detdata.cli.where import read_object
from detdata.loading.state import CHECKED_FIELDS, K_CONSUMED, K_ENV, K_KIND, K_LAYOUT, KIND
from detdata.loading.steps import K_STEP_POSITION
from detdata.loading.trace import Comparison, compare, read_trace

_SHOWN_VALUE: Final = 160
_STATE_HINT: Final = "; hint: write it with json.dump(loader.state_dict(), f)"


def steps_window(text: str) -> tuple[int, int | None]:
    """``A:B`` (steps A..B-1, like a Python slice), ``A:``, ``:B`` or ``S`` (one step)."""
    lo, sep, hi = text.partition(":")
    try:
        start = int(lo) if lo.strip() else 0
        stop = (int(hi) if hi.strip() else None) if sep else start + 1
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected A:B (integers, steps A..B-1), got {text!r}"
        ) from None
    if start < 0 or (stop is not None and stop <= start):
        raise argparse.ArgumentTypeError(f"expected 0 <= A < B in A:B, got {text!r}")
    return start, stop


def register(sub: Any) -> None:
    p = sub.add_parser(
        "diff",
        help="compare two loader traces (JSONL) or, with --state, two loader "
        "states; exit 1 at the first difference",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument(
        "a",
        help="trace A (JSONL written by LoaderOptions(trace=...)); with --state, a "
        "loader state JSON file (json.dump(loader.state_dict()))",
    )
    p.add_argument("b", help="trace B (or state B)")
    p.add_argument(
        "--steps",
        type=steps_window,
        metavar="A:B",
        help="compare only global steps A..B-1 (A: and :B open-ended; S alone: one step)",
    )
    p.add_argument(
        "--state",
        action="store_true",
        help="A and B are loader states: report each differing field",
    )
    p.add_argument(
        "--plot",
        metavar="OUT.png",
        help="also draw which steps match and where the traces part, as a PNG "
        "(needs matplotlib: pip install 'detdata[plots]')",
    )
    p.set_defaults(func=run_diff)


def run_diff(args: argparse.Namespace) -> int:
    if args.state:
        for flag, value in (("--steps", args.steps), ("--plot", args.plot)):
            if value is not None:
                raise ConfigError(f"{flag} applies to traces; it does not apply with --state")
        return diff_states(args.a, args.b)
    start, stop = args.steps if args.steps is not None else (0, None)
    result = compare(read_trace(args.a), read_trace(args.b), start=start, stop=stop)
    window = "" if args.steps is None else f" in steps {start}:{'' if stop is None else stop}"
    if result.steps_compared == 0 and result.first is None:
        raise ConfigError(
            f"nothing to compare: neither {args.a} nor {args.b} holds a record{window}; "
            "hint: check the paths (rank r > 0 writes PATH.rank<r>) and --steps"
        )
    if result.first is None:
        print(f"identical: {result.steps_compared} steps{window}")
    else:
        _print_difference(result, window)
    if args.plot is not None:
        from detdata.cli.plots import plot_diff

        sys.stdout.flush()
        plot_diff(result, args.plot, title=f"{args.a} vs {args.b}")
        print(f"plot: {args.plot}")
    return 0 if result.first is None else 1


def _print_difference(result: Comparison, window: str) -> None:
    first = result.first
    assert first is not None
    print(f"first difference at step {first.step} (rank {first.rank}): {first.reason}")
    for label, record in first.records:
        print(f"{label}: {record.describe()}")
    for other in result.findings[1:]:
        if other.step == first.step:
            print(f"also at step {other.step} (rank {other.rank}): {other.reason}")
    print(
        f"steps compared{window}: {result.steps_compared}; steps with a difference: "
        f"{result.steps_differing}"
    )


# ------------------------------------------------------------------ states


def _load_state(path: str) -> dict[str, Any]:
    doc = read_object(path, "state file", _STATE_HINT)
    if doc.get(K_KIND) != KIND:
        raise ConfigError(
            f"state file {path} is not a detdata loader state (field {K_KIND!r} is "
            f"{doc.get(K_KIND)!r}, expected {KIND!r}){_STATE_HINT}"
        )
    return doc


def _flat(value: Any, prefix: str = "") -> Iterator[tuple[str, Any]]:
    if isinstance(value, dict) and value:
        for key in sorted(value, key=str):
            yield from _flat(value[key], f"{prefix}.{key}" if prefix else str(key))
    elif isinstance(value, list) and value:
        for i, item in enumerate(value):
            yield from _flat(item, f"{prefix}[{i}]")
    else:
        yield prefix, value


_ABSENT: Final = object()


def _shown(value: Any) -> str:
    if value is _ABSENT:
        return "(absent)"
    text = json.dumps(value, sort_keys=True)
    return text if len(text) <= _SHOWN_VALUE else text[:_SHOWN_VALUE] + "..."


def _role(field_path: str) -> str:
    top = field_path.split(".", 1)[0].split("[", 1)[0]
    if top in CHECKED_FIELDS:
        return "  [checked on resume]"
    if top in (K_CONSUMED, K_STEP_POSITION):
        return "  [position]"
    if top in (K_LAYOUT, K_ENV):
        return "  [informational]"
    return ""


def diff_states(path_a: str, path_b: str) -> int:
    """Print each field that differs between two saved loader states; 1 if any, else 0."""
    a, b = dict(_flat(_load_state(path_a))), dict(_flat(_load_state(path_b)))
    keys = sorted(set(a) | set(b))
    differing = [
        k
        for k in keys
        if a.get(k, _ABSENT) != b.get(k, _ABSENT) or type(a.get(k)) is not type(b.get(k))
    ]
    if not differing:
        print(f"identical: {len(keys)} state fields")
        return 0
    print(f"state fields differ: {len(differing)} of {len(keys)} (A {path_a}, B {path_b})")
    for key in differing:
        print(
            f"{key}: A {_shown(a.get(key, _ABSENT))} | B {_shown(b.get(key, _ABSENT))}{_role(key)}"
        )
    return 1
