"""The detdata console command: reproducible, resumable data for LLM pretraining.

Each module in `COMMAND_MODULES` registers its sub-commands. Every failure ends in one
``detdata: ...`` line on stderr and an exit code (`EPILOG`), a traceback only with
``--traceback``; storage retries show one line each only with ``--verbose``. Everything
printed passes the redaction boundary (`detdata.base.redact.redacted_output`).
"""

from __future__ import annotations

import argparse
import contextlib
import errno
import importlib
import logging
import os
import re
import sys
import textwrap
from collections.abc import Iterator, Sequence
from typing import Final

from detdata.base.errors import DetdataError, StorageError, VerificationError
from detdata.base.redact import get_logger, redacted_output

EXIT_OK: Final = 0
EXIT_FAIL: Final = 1
EXIT_USAGE: Final = 2
EXIT_STORAGE: Final = 3
EXIT_INTERRUPTED: Final = 130
EXIT_BROKEN_PIPE: Final = 141

EPILOG: Final = """\
exit codes:
  0  success (verify: bytes match; diff: identical)
  1  the answer is "no": a verification failed (verify, register, preflight) or a
     difference was found (diff, replay-check, env --check; bench: a contender's bytes did
     not validate); nothing else exits 1
  2  usage or input error: bad arguments, a missing, unreadable or malformed input file
     (manifest, trace, state, config), an output path that cannot be used, a refused
     configuration; also an internal error (a bug: rerun with --traceback and report it)
  3  storage error: reading or writing storage failed (after retries for remote storage),
     e.g. a network failure, a remote object that cannot be read, a full disk
  130 interrupted (Ctrl-C); 141 output pipe closed (e.g. `detdata order ... | head`)
"""

#: Loggers whose lines only ``--verbose`` shows: each retry of a storage read
#: (`detdata.storage.retry`; the error that ends a read which kept failing sums them up).
VERBOSE_LOGGERS: Final = ("detdata.retry",)

# Modules that define ``register(subparsers)``; each sub-command sets ``func(args) -> int``.
COMMAND_MODULES: Final = (
    "detdata.cli.manifest",
    "detdata.cli.order",
    "detdata.cli.trace",
    "detdata.cli.demo",
    "detdata.cli.mix",
    "detdata.cli.bench",
    "detdata.cli.where",
    "detdata.cli.seen",
    "detdata.cli.env",
    "detdata.cli.preflight",
    "detdata.cli.split",
    "detdata.cli.tokenize",
)

#: The commands by task, as ``detdata --help`` lists them; a command missing here is listed
#: under "other commands".
TASKS: Final = (
    ("try it", ("demo", "replay-check", "bench")),
    ("hash, name and check data", ("manifest", "hash", "verify", "register", "inspect")),
    ("raw text", ("tokenize",)),
    ("order, mixtures and splits", ("order", "mix", "split")),
    ("before, during and after a run", ("env", "preflight", "diff", "where", "seen")),
)
_LITERAL: Final = re.compile(r"``([^`]+)``")
_QUOTED: Final = re.compile(r"(?<![\w`])`([^`\n]+)`(?![\w`])")

#: OSErrors that mean "this path (given by the user) cannot be used": a usage error.
_PATH_ERRNOS: Final = frozenset(
    {
        errno.ENOENT,
        errno.ENOTDIR,
        errno.EISDIR,
        errno.EACCES,
        errno.EPERM,
        errno.EEXIST,
        errno.ENAMETOOLONG,
        errno.ELOOP,
        errno.EROFS,
    }
)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="detdata",
        usage="detdata [-h] [--traceback] [-v] COMMAND ...",
        description=__doc__.splitlines()[0] if __doc__ else None,
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "--traceback",
        action="store_true",
        help="on an error, show the Python traceback too (for bug reports)",
    )
    parser.add_argument(
        "-v",
        "--verbose",
        action="store_true",
        help="show each retry of a storage read as it happens (stderr)",
    )
    sub = parser.add_subparsers(
        dest="command", metavar="COMMAND", help=argparse.SUPPRESS, prog=parser.prog
    )
    sub.required = True
    for name in COMMAND_MODULES:
        importlib.import_module(name).register(sub)
    parser.description = f"{parser.description}\n\n{grouped_commands(sub)}"
    _plain_help(parser)
    return parser


def grouped_commands(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> str:
    """The sub-commands with their one-line help, under the headings of `TASKS`."""
    helps = {a.dest: a.help or "" for a in sub._choices_actions}
    width = max(map(len, helps)) + 2
    placed = {c for _, commands in TASKS for c in commands}
    groups = [*TASKS, ("other commands", tuple(c for c in helps if c not in placed))]
    lines = []
    for title, commands in groups:
        present = [c for c in commands if c in helps]
        if present:
            lines.append(f"{title}:")
            lines += [
                textwrap.fill(
                    f"  {c:<{width}}{helps[c]}", width=96, subsequent_indent=" " * (width + 2)
                )
                for c in present
            ]
    return "\n".join(lines)


def plain(text: str) -> str:
    """Help text without reST markup: ``--data`` and `name` print as --data and name."""
    return _QUOTED.sub(r"\1", _LITERAL.sub(r"\1", text))


def _plain_help(parser: argparse.ArgumentParser) -> None:
    """`plain` over every description, epilog and help of ``parser`` and its sub-commands."""
    parser.description = plain(parser.description) if parser.description else None
    parser.epilog = plain(parser.epilog) if parser.epilog else None
    for action in parser._actions:
        if isinstance(action.help, str):
            action.help = plain(action.help)
        if isinstance(action, argparse._SubParsersAction):
            for choice in action._choices_actions:
                choice.help = plain(choice.help) if choice.help else choice.help
            for child in dict.fromkeys(action.choices.values()):
                _plain_help(child)


def _classify(exc: BaseException) -> tuple[int, str]:
    """The exit code (`EPILOG`) and the kind of error the ``detdata: KIND: ...`` line names."""
    if isinstance(exc, VerificationError):
        return EXIT_FAIL, "verification failed"
    if isinstance(exc, StorageError):
        return EXIT_STORAGE, "storage error"
    if isinstance(exc, DetdataError):
        return EXIT_USAGE, "error"
    if isinstance(exc, OSError):
        return (
            (EXIT_USAGE, "error") if exc.errno in _PATH_ERRNOS else (EXIT_STORAGE, "storage error")
        )
    return EXIT_USAGE, (
        f"internal error ({type(exc).__name__}; a bug in detdata: "
        "rerun with --traceback and report it)"
    )


def _report(exc: BaseException) -> int:
    code, kind = _classify(exc)
    if isinstance(exc, OSError) and not isinstance(exc, DetdataError):
        where = " ".join(repr(f) for f in (exc.filename, exc.filename2) if f is not None)
        message = f"{where + ': ' if where else ''}{exc.strerror or exc}"
    else:
        notes = [n for n in getattr(exc, "__notes__", ()) if isinstance(n, str)]
        message = " ".join([str(exc) or type(exc).__name__, *notes])
    print(f"detdata: {kind}: {message}", file=sys.stderr)
    return code


def _quiet_stdout() -> None:
    """After a closed pipe: point stdout at /dev/null so the exit-time flush cannot fail again."""
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, sys.stdout.fileno())
    os.close(devnull)


@contextlib.contextmanager
def _quiet_retries(verbose: bool) -> Iterator[None]:
    """Without ``verbose``: the `VERBOSE_LOGGERS` pass only errors while the body runs."""
    loggers = [] if verbose else [get_logger(name) for name in VERBOSE_LOGGERS]
    levels = [logger.level for logger in loggers]
    for logger in loggers:
        logger.setLevel(logging.ERROR)
    try:
        yield
    finally:
        for logger, level in zip(loggers, levels, strict=True):
            logger.setLevel(level)


def main(argv: Sequence[str] | None = None) -> int:
    """Run one command; everything it writes to stdout and stderr (results, warnings,
    progress, the final error line) passes the redaction boundary (`redacted_output`)."""
    with redacted_output():
        args = build_parser().parse_args(argv)
        try:
            with _quiet_retries(args.verbose):
                code: int = args.func(args)
            sys.stdout.flush()
        except KeyboardInterrupt:
            print("detdata: interrupted", file=sys.stderr)
            return EXIT_INTERRUPTED
        except BrokenPipeError:
            _quiet_stdout()
            return EXIT_BROKEN_PIPE
        except Exception as exc:
            if args.traceback:
                raise
            return _report(exc)
        return code


if __name__ == "__main__":
    sys.exit(main())
