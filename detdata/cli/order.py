"""``detdata order --n N --seed S --at G --count K``: ``GlobalOrder(N, S).ids`` of positions
``G .. G+K-1``, one per line (what the loader reads there, before a mixture or exclusions).
"""

from __future__ import annotations

import argparse
from typing import Any, Final

import numpy as np

from detdata.base.checks import check_count, check_seed
from detdata.order.feistel import GlobalOrder

#: the most positions one call prints
MAX_COUNT: Final = 10_000_000


def register(subparsers: Any) -> None:
    parser = subparsers.add_parser(
        "order",
        help="print the sample ids at global positions AT .. AT+COUNT-1 (one per line)",
        description="Print the sample id at each global position G .. G+K-1 of the order\n"
        "over --n samples with --seed, one per line. The order is a pure function of\n"
        "seed and position: no data is read, and every run with that seed agrees.\n\n"
        "  detdata order --n 1000000 --seed 1 --at 0 --count 8",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--n", type=int, required=True, help="number of samples")
    parser.add_argument("--seed", type=int, required=True, help="the order's seed")
    parser.add_argument("--at", type=int, required=True, metavar="G", help="first global position")
    parser.add_argument("--count", type=int, default=1, metavar="K", help="how many positions")
    parser.set_defaults(func=_cmd_order)


def _cmd_order(args: argparse.Namespace) -> int:
    order = GlobalOrder(check_count(args.n, "--n"), check_seed(args.seed, "--seed"))
    count = check_count(args.count, "--count", maximum=MAX_COUNT)
    start = check_count(args.at, "--at", minimum=0, maximum=(1 << 63) - 1 - count)
    ids = order.ids(np.arange(start, start + count, dtype=np.int64))
    print("\n".join(str(int(i)) for i in ids))
    return 0
