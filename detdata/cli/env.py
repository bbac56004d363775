"""``detdata env``: print this process's run record (`detdata.RunRecord`) as JSON.

``--repo DIR`` (default: the current directory), ``--lock FILE`` (repeatable; default the
lock files found at the repository root), ``--manifest M`` (repeatable: their ids join the
record; loaded without reading shards), ``--config FILE.json`` (hashed), ``--out FILE``
(also save it). A dirty tree is reported, not refused. With ``--check SAVED`` the record is
verified against a saved one (``--allow FIELD``, repeatable): exit 1 listing each refused
difference, 0 when none.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from detdata.base.errors import ConfigError, StateError


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
    p.set_defaults(func=run_env)


def _config(path: str | None) -> dict[str, Any] | None:
    if path is None:
        return None
    with open(path, encoding="utf-8") as fh:
        try:
            doc = json.load(fh)
        except ValueError as exc:
            raise ConfigError(f"--config {path}: not valid JSON ({exc})") from None
    if not isinstance(doc, dict):
        raise ConfigError(f"--config {path}: expected a JSON object")
    return doc


def run_env(args: argparse.Namespace) -> int:
    from detdata.identity.manifest import Manifest
    from detdata.loading.record import RunRecord

    manifests = [Manifest.load(m, verify="off") for m in args.manifest]
    record = RunRecord.capture(
        repo=args.repo,
        allow_dirty=True,
        lock_files=args.lock,
        config=_config(args.config),
        manifests=manifests,
    )
    if args.out is not None:
        record.save(args.out)
    print(json.dumps(record.to_json(), sort_keys=True, indent=1))
    if args.check is not None:
        try:
            record.verify(RunRecord.load(args.check), allow=args.allow)
        except StateError as exc:
            if not exc.fields:
                raise
            print(f"detdata: run record check failed: {exc}", file=sys.stderr)
            return 1
    return 0
