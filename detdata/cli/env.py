"""``detdata env``: print this process's run record (`detdata.RunRecord`) as JSON.

``--repo DIR`` (default: the current directory), ``--lock FILE`` (repeatable; default the
lock files found at the repository root), ``--manifest M`` (repeatable: their ids join the
record; loaded without reading shards), ``--config FILE.json`` (hashed), ``--out FILE``
(also save it). The record has the shape `RunRecord.capture` gives from Python: what the CLI
cannot see by itself is given as options: ``--layout world=8,tp=2`` (the parallel layout),
``--loader-state FILE`` (a saved ``loader.state_dict()``: manifests, seeds, loader fields and the
execution shape), ``--seed NAME=VALUE``, ``--execution KEY=VALUE`` (e.g. ``precision=bf16-mixed``),
``--extra-env NAME`` (recorded by the blake3 of its value unless ``--clear-env NAME``),
``--image`` / ``--image-digest``. A dirty tree is reported, not refused. With ``--check SAVED``
the record is verified against a saved one (``--allow FIELD``, repeatable): exit 1 listing
each refused difference (after the record), 0 with one line ``ok: ...`` when none (the whole
record too with ``-v``); a record saved from Python compares equal when the same inputs are
given here. A saved record that cannot be read, an ``--allow`` name that is
no field (or an ``env.NAME`` neither record holds) and ``--allow`` without ``--check`` are
usage errors (exit 2, one line naming it and the valid names) before anything is printed or
saved.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import TYPE_CHECKING, Any, Final

from detdata.base.errors import ConfigError, StateError
from detdata.cli.where import read_object

if TYPE_CHECKING:
    from detdata.loading.record import RunRecord

#: (flag, metavar, help) of the repeatable options after ``--loader-state``
_REPEATED: Final = (
    ("--seed", "NAME=VALUE", "a seed (repeatable)"),
    ("--execution", "KEY=VALUE", "an execution field: micro_batch, grad_accum, ... (repeatable)"),
    ("--extra-env", "NAME", "also record this environment variable, as its blake3 (repeatable)"),
    ("--clear-env", "NAME", "record this --extra-env variable in clear text (repeatable)"),
)


def register(sub: Any) -> None:
    p = sub.add_parser(
        "env",
        help="print the run record (code, packages, versions, GPUs, env vars) as JSON",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--repo", help="the code's folder (default: the current directory)")
    p.add_argument("--lock", action="append", help="a lock file to hash (repeatable)")
    p.add_argument("--manifest", action="append", default=[], help="a manifest (repeatable)")
    p.add_argument("--config", help="a JSON config file to hash")
    p.add_argument("--out", help="also save the record to this file")
    p.add_argument("--check", metavar="SAVED", help="verify against a saved record")
    p.add_argument("--allow", action="append", default=[], help="allowed field (repeatable)")
    p.add_argument(
        "-v",
        "--verbose",
        dest="show_record",
        action="store_true",
        help="with --check: print the whole record even when the check passes",
    )
    p.add_argument("--layout", type=_pairs, help="the parallel layout: world=N,dp=N,tp=N,pp=N")
    p.add_argument("--loader-state", help="a saved loader state (JSON file)")
    for flag, metavar, text in _REPEATED:
        p.add_argument(flag, action="append", default=[], metavar=metavar, help=text)
    p.add_argument("--image", help="the container image (default: from the environment)")
    p.add_argument("--image-digest", help="its digest (default: from the environment)")
    p.set_defaults(func=run_env)


def _value(text: str) -> Any:
    """An option value: an integer, true/false/null, or the text itself."""
    if text.lstrip("-").isdigit():
        return int(text)
    return {"true": True, "false": False, "null": None}.get(text, text)


def _pairs(text: str) -> dict[str, Any]:
    out = {}
    for part in filter(None, text.split(",")):
        key, sep, value = part.partition("=")
        if not sep or not key:
            raise argparse.ArgumentTypeError(f"expected KEY=VALUE[,KEY=VALUE...], got {text!r}")
        out[key.strip()] = _value(value.strip())
    return out


def _merged(items: list[str], what: str) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for item in items:
        try:
            out.update(_pairs(item))
        except argparse.ArgumentTypeError as exc:
            raise ConfigError(f"{what}: {exc}") from None
    return out


def run_env(args: argparse.Namespace) -> int:
    from detdata.identity.manifest import Manifest
    from detdata.loading.record import RunRecord

    if args.allow and args.check is None:
        raise ConfigError(
            f"--allow {args.allow[0]} applies to --check SAVED (the differences it allows); "
            "hint: add --check with the saved run record, or drop --allow"
        )
    saved = None if args.check is None else RunRecord.load(args.check)
    manifests = [Manifest.load(m, verify="off") for m in args.manifest]
    record = RunRecord.capture(
        repo=args.repo,
        allow_dirty=True,
        lock_files=args.lock,
        config=None if args.config is None else read_object(args.config, "--config"),
        manifests=manifests,
        layout=args.layout,
        loader=None if args.loader_state is None else read_object(args.loader_state, "state"),
        seeds=_merged(args.seed, "--seed") or None,
        execution=_merged(args.execution, "--execution") or None,
        extra_env=args.extra_env,
        clear_env=args.clear_env,
        image=args.image,
        image_digest=args.image_digest,
    )
    if saved is not None:  # a misspelt --allow is a usage error before anything is written
        record.check_allow(args.allow, saved, option="--allow")
    if args.out is not None:
        record.save(args.out)
    text = json.dumps(record.to_json(), sort_keys=True, indent=1)
    if saved is None:
        print(text)
        return 0
    return _check(record, saved, args, text)


def _check(record: RunRecord, saved: RunRecord, args: argparse.Namespace, text: str) -> int:
    """``--check``: one ``ok`` line when ``record`` matches ``saved`` (the record ``text`` too
    with ``-v``); the record, then each refused difference on stderr, and 1 when not."""
    try:
        record.verify(saved, allow=args.allow)
    except StateError as exc:
        if not exc.fields:
            raise
        print(text)
        print(f"detdata: run record check failed: {exc}", file=sys.stderr)
        return 1
    if args.show_record:
        print(text)
    allowed = f" (allowed: {', '.join(args.allow)})" if args.allow else ""
    print(f"ok: this run's record matches {args.check}{allowed}")
    return 0
