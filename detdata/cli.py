"""The ``detdata`` console command.

Each area registers its sub-commands from its own module (``detdata._cli_*``)
listed in `COMMAND_MODULES`. Exit codes: 0 ok, 1 verification failure or a
difference found, 2 usage error (bad arguments, bad input files).
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Sequence
from typing import Final

from detdata._errors import DetdataError, VerificationError

EXIT_OK: Final = 0
EXIT_FAIL: Final = 1
EXIT_USAGE: Final = 2

# Modules that define ``register(subparsers)``; each sub-command sets ``func(args) -> int``.
COMMAND_MODULES: Final = (
    "detdata._cli_manifest",
    "detdata._cli_trace",
    "detdata._cli_demo",
    "detdata._cli_mix",
    "detdata._cli_bench",
)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="detdata", description=__doc__.splitlines()[0] if __doc__ else None)
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True
    for name in COMMAND_MODULES:
        importlib.import_module(name).register(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        code: int = args.func(args)
    except VerificationError as exc:
        print(f"detdata: verification failed: {exc}", file=sys.stderr)
        return EXIT_FAIL
    except DetdataError as exc:
        print(f"detdata: error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    return code


if __name__ == "__main__":
    sys.exit(main())
