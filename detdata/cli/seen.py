"""``detdata seen SOURCE:ID --until P --data MODULE:FUNCTION``: where a sample was delivered.

Every global position below ``P`` at which the run's stream delivers sample ``ID``
of ``SOURCE`` (a mixture source name; ``ID`` or ``:ID`` alone for a single-dataset
stream), found by inverting the order per epoch instead of scanning ``P`` positions,
and the global step of each (from the run's batch history:
`DataLoader.step_of_position`). ``--data`` as for
``detdata where``; with ``--state`` the state is loaded first (checked, and an
allowed mixture change continued as on a resume; positions before a change of seed, data or
order allowed at a resume are inverted with the stream of that time, or refused naming the
change). ``P`` past the loader's ``total_samples`` is refused. Prints one JSON object:
``{"source", "sample_id", "until", "count", "positions", "steps"}``. Exit 0, or 2.
For contamination checks, data-removal audits and "how often did the model see it".
"""

from __future__ import annotations

import argparse
import json
from typing import Any

from detdata.base.errors import ConfigError
from detdata.cli.where import loader_for, read_object


def parse_sample(text: str) -> tuple[str | None, int]:
    source, sep, ident = text.rpartition(":")
    if not ident.strip().isdigit():
        raise argparse.ArgumentTypeError(f"expected SOURCE:ID or ID (ID an integer), got {text!r}")
    return (source if sep and source else None), int(ident)


def register(sub: Any) -> None:
    p = sub.add_parser(
        "seen",
        help="the positions and steps at which a sample is delivered before position P",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument(
        "sample",
        type=parse_sample,
        metavar="SOURCE:ID",
        help="the sample: a mixture source and its sample id (ID alone for one dataset)",
    )
    p.add_argument("--until", required=True, type=int, metavar="P", help="positions [0, P)")
    p.add_argument(
        "--data",
        required=True,
        metavar="MODULE:FUNCTION",
        help="a function (file.py:name or module:name) that builds the run's loader/stream",
    )
    p.add_argument("--state", help="a saved loader state (checked against --data)")
    p.set_defaults(func=run_seen)


def run_seen(args: argparse.Namespace) -> int:
    if args.until < 0:
        raise ConfigError(f"--until must be >= 0, got {args.until}")
    state = None if args.state is None else read_object(args.state)
    loader = loader_for(args.data, state)
    source, ident = args.sample
    positions = loader.positions_seen(source, ident, until=args.until)
    found = {
        "source": source,
        "sample_id": ident,
        "until": args.until,
        "count": int(positions.size),
        "positions": positions.tolist(),
        "steps": [loader.step_of_position(p) for p in positions.tolist()],
    }
    print(json.dumps(found))
    return 0
