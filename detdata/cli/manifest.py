"""Sub-commands for bytes identity: ``manifest build`` (``--part I/N``), ``manifest merge``,
``verify``, ``hash``, ``register`` and ``inspect``. Each prints its result on stdout; errors
are `DetdataError`s (exit codes: `detdata.cli.main.EPILOG`), paths checked before any work.
"""

from __future__ import annotations

import argparse
import json
import os
from dataclasses import replace
from typing import Any

from detdata.base.checks import check_count
from detdata.base.errors import ConfigError, RetriesExhausted
from detdata.base.redact import redact_url
from detdata.identity.build import build_manifest, hash_files
from detdata.identity.entry import Verify
from detdata.identity.manifest import Manifest
from detdata.identity.parts import ManifestPart, build_part, merge_manifests
from detdata.identity.registry import Registry
from detdata.storage.fs import is_url, missing_folder_hint
from detdata.storage.retry import DEFAULT_RETRY


def register(subparsers: Any) -> None:
    _add_manifest(subparsers)
    _add_verify(subparsers)
    _add_hash(subparsers)
    _add_register(subparsers)
    _add_inspect(subparsers)


def _meta_item(text: str) -> tuple[str, str]:
    key, sep, value = text.partition("=")
    if not sep or not key:
        raise argparse.ArgumentTypeError(f"expected KEY=VALUE, got {text!r}")
    return key, value


def _add_manifest(subparsers: Any) -> None:
    parser = subparsers.add_parser(
        "manifest",
        help="build manifests",
        description="Build a manifest: the content-addressed list of a dataset's shards\n"
        "(path, size, blake3); its id names exactly these bytes.\n\n"
        "  detdata manifest build data/wiki-en --pattern '**/*.npy' -o data/manifest.json",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    sub = parser.add_subparsers(dest="manifest_command", metavar="ACTION")
    sub.required = True
    build = sub.add_parser(
        "build",
        help="hash the shards under ROOT into a manifest file",
        description="Hash the shards under ROOT (a folder or fsspec URL) into a manifest file "
        "and print its id. Large roots: split the work with --part I/N and join the parts with "
        "detdata manifest merge.",
    )
    build.add_argument("root", metavar="ROOT", help="directory or fsspec URL holding the shards")
    build.add_argument(
        "--pattern",
        help="glob relative to ROOT, e.g. '**/*.npy' (default: every file with a known suffix)",
    )
    build.add_argument(
        "--format",
        choices=["npy", "bin", "parquet", "arrow", "jsonl"],
        help="shard format (default: from the suffix)",
    )
    build.add_argument(
        "--dtype", help="token dtype of raw .bin shards (uint16, uint32, int32, int64)"
    )
    build.add_argument(
        "--meta",
        action="append",
        type=_meta_item,
        default=[],
        metavar="KEY=VALUE",
        help="user metadata, part of the id (repeatable)",
    )
    build.add_argument(
        "-o", "--output", required=True, metavar="FILE", help="manifest file to write"
    )
    build.add_argument("--threads", type=int, default=8, help="parallel hashing threads")
    build.add_argument(
        "--part",
        type=_part_arg,
        metavar="I/N",
        help="hash only part I (0-based) of N of the sorted listing and write a part file "
        "(merge the N parts with `detdata manifest merge`)",
    )
    build.set_defaults(func=_cmd_build)
    merge = sub.add_parser(
        "merge",
        help="merge part files (from `manifest build --part I/N`) into one manifest",
        description="Merge the N part files written by detdata manifest build --part I/N into "
        "one manifest (the same id as one build over the whole root) and print its id.",
    )
    merge.add_argument("parts", nargs="+", metavar="PART", help="part files or URLs")
    merge.add_argument("--root", help="root of the merged manifest (default: the parts' root)")
    merge.add_argument(
        "-o", "--output", required=True, metavar="FILE", help="manifest file to write"
    )
    merge.set_defaults(func=_cmd_merge)


def _part_arg(text: str) -> tuple[int, int]:
    index, sep, count = text.partition("/")
    try:
        i, n = int(index), int(count)
    except ValueError:
        i = n = -1
    if not sep or n < 1 or not 0 <= i < n:
        raise argparse.ArgumentTypeError(
            f"expected I/N with 0 <= I < N (e.g. 0/4 for the first of 4 parts), got {text!r}"
        )
    return i, n


def check_output_file(path: str, flag: str) -> None:
    """A local output path must be writable as a file: not a folder, not under a file (before any
    work)."""
    if is_url(path):
        return
    if os.path.isdir(path):
        raise ConfigError(
            f"{flag} {path} is a directory; hint: give a file name, e.g. "
            f"{os.path.join(path, 'manifest.json')}"
        )
    parent = os.path.dirname(os.path.abspath(path))
    while not os.path.exists(parent):
        parent = os.path.dirname(parent)
    if not os.path.isdir(parent):
        raise ConfigError(
            f"{flag} {path}: {parent} is a file, not a folder; hint: choose another path"
        )


def _check_local(path: str, what: str, *, folder: bool) -> None:
    """A local path named on the command line exists and is a folder (or a file)."""
    if is_url(path):
        return
    if not os.path.exists(path):
        hint = missing_folder_hint(path) if folder else "hint: check the path"
        raise ConfigError(f"{what} {path}: not found; {hint}")
    if folder and not os.path.isdir(path):
        raise ConfigError(
            f"{what} {path} is a file, not a folder; hint: pass the folder holding the shards"
        )
    if not folder and os.path.isdir(path):
        raise ConfigError(
            f"{what} {path} is a directory, not a file; hint: pass files, e.g. {path}/*.npy"
        )


def _cmd_build(args: argparse.Namespace) -> int:
    metadata: dict[str, str] = {}
    for key, value in args.meta:
        if key in metadata:
            raise ConfigError(f"--meta {key}= given twice; hint: each key once")
        metadata[key] = value
    check_output_file(args.output, "-o")  # before hours of hashing
    if not is_url(args.root) and os.path.isfile(args.root):
        raise ConfigError(
            f"ROOT {args.root} is a file, not a folder; hint: pass the folder holding the "
            "shards (and --pattern to pick files)"
        )
    options: dict[str, Any] = {
        "pattern": args.pattern,
        "format": args.format,
        "dtype": args.dtype,
        "metadata": metadata,
        "threads": check_count(args.threads, "--threads"),
        "progress": True,  # asked for: a bar on a terminal; in a log, lines and a closing line
    }
    if args.part is not None:
        part = build_part(args.root, part=args.part, **options)
        part.save(args.output)
        print(f"part {part.index}/{part.count}: {len(part.shards)} shards -> {args.output}")
        return 0
    manifest = build_manifest(args.root, **options)
    manifest.save(args.output)
    print(manifest.id)
    return 0


def _cmd_merge(args: argparse.Namespace) -> int:
    check_output_file(args.output, "-o")
    for path in args.parts:
        _check_local(path, "PART", folder=False)
    manifest = merge_manifests([ManifestPart.load(p) for p in args.parts], root=args.root)
    manifest.save(args.output)
    print(manifest.id)
    return 0


def _add_verify(subparsers: Any) -> None:
    parser = subparsers.add_parser(
        "verify",
        help="check shard bytes against a manifest (exit 1 on mismatch)",
        description="Check the shards a manifest names against the sizes and digests it "
        "recorded: quick digests by default, every byte with --full. Prints 'ok ID' and exits 0, "
        "or names the first shard that differs and exits 1.",
    )
    parser.add_argument("manifest", metavar="MANIFEST", help="manifest file or URL")
    parser.add_argument(
        "--full", action="store_true", help="re-hash every byte (default: sizes and quick digests)"
    )
    parser.add_argument("--root", help="where the shards are now (default: the manifest's root)")
    parser.add_argument(
        "--deadline",
        type=float,
        default=DEFAULT_RETRY.deadline_s,
        metavar="SECONDS",
        help="how long one remote read may keep retrying before it fails, exit 3 "
        f"(default {DEFAULT_RETRY.deadline_s:g})",
    )
    parser.set_defaults(func=_cmd_verify)


def _cmd_verify(args: argparse.Namespace) -> int:
    mode = Verify.FULL if args.full else Verify.QUICK
    if not 0 < args.deadline < float("inf"):  # NaN fails this too
        raise ConfigError(
            f"--deadline {args.deadline:g}: must be a positive number of seconds; hint: e.g. "
            f"--deadline {DEFAULT_RETRY.deadline_s:g} (the default)"
        )
    _check_local(args.manifest, "MANIFEST", folder=False)
    if args.root is not None:
        _check_local(args.root, "--root", folder=True)
    retry = replace(DEFAULT_RETRY, deadline_s=args.deadline)
    try:
        manifest = Manifest.load(args.manifest, root=args.root, verify=mode, retry=retry)
    except RetriesExhausted as exc:
        exc.add_note("(detdata verify --deadline SECONDS sets that deadline)")
        raise
    print(
        f"ok {manifest.id} ({len(manifest.shards)} shards, {manifest.total_bytes} bytes, "
        f"verify={mode.value}, root={redact_url(manifest.root or '')})"
    )
    return 0


def _add_hash(subparsers: Any) -> None:
    parser = subparsers.add_parser(
        "hash",
        help="print the blake3 of files: 'b3:<hex>  BYTES  PATH'",
        description="Print the blake3 digest, size and path of each file (local or URL), one "
        "line each: the digest a manifest records for a shard.",
    )
    parser.add_argument("files", nargs="+", metavar="FILE", help="files or URLs")
    parser.set_defaults(func=_cmd_hash)


def _cmd_hash(args: argparse.Namespace) -> int:
    for path in args.files:
        _check_local(path, "FILE", folder=False)
    for path, size, digest in hash_files(args.files):
        print(f"{digest}  {size}  {path}")
    return 0


def _registry_arg(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--registry",
        metavar="DIR",
        help="registry directory or URL (default: $DETDATA_REGISTRY or the user cache dir)",
    )


def _add_register(subparsers: Any) -> None:
    parser = subparsers.add_parser(
        "register",
        help="store a manifest and name it NAME@VERSION",
        description="Check a manifest's shards, store the manifest in the registry and name it "
        "NAME@VERSION; a loader can then be built from the name.",
    )
    parser.add_argument("manifest", metavar="MANIFEST", help="manifest file or URL")
    parser.add_argument("name", metavar="NAME", help="name@version, e.g. wiki-en@v3")
    _registry_arg(parser)
    parser.add_argument("--force", action="store_true", help="re-point an existing name")
    parser.add_argument(
        "--verify",
        choices=[v.value for v in Verify],
        default="quick",
        help="check the shards before registering (default: quick)",
    )
    parser.set_defaults(func=_cmd_register)


def _check_registry(path: str | None) -> None:
    if path is not None and not is_url(path) and os.path.exists(path) and not os.path.isdir(path):
        raise ConfigError(
            f"--registry {path} is a file, not a folder; hint: a registry is a folder "
            "(created if missing): pass a new or existing registry folder"
        )


def _cmd_register(args: argparse.Namespace) -> int:
    _check_registry(args.registry)
    _check_local(args.manifest, "MANIFEST", folder=False)
    print(
        Registry(args.registry).register(
            args.name, args.manifest, force=args.force, verify=args.verify
        )
    )
    return 0


def _add_inspect(subparsers: Any) -> None:
    parser = subparsers.add_parser(
        "inspect",
        help="print a JSON summary of a manifest (NAME, ID or FILE; no verification)",
        description="Print a JSON summary of a manifest "
        "named by a registry name, a manifest id or a file; the shards are not read.",
    )
    parser.add_argument(
        "target", metavar="NAME|ID|FILE", help="a registry name, a manifest id or a manifest file"
    )
    _registry_arg(parser)
    parser.set_defaults(func=_cmd_inspect)


def _cmd_inspect(args: argparse.Namespace) -> int:
    target: str = args.target
    _check_registry(args.registry)
    extra: dict[str, Any] = {}
    if target.startswith("b3:"):
        manifest = Registry(args.registry).get(target)
        source = "registry"
    elif is_url(target) or os.path.exists(target) or target.endswith(".json"):
        manifest = Manifest.load(target, verify=Verify.OFF)
        source = "file"
    else:
        registry = Registry(args.registry)
        manifest = registry.resolve(target, verify=Verify.OFF, latest=True)
        source = "registry"
        extra["history"] = [dict(e.to_json(), name=e.name) for e in registry.history(target)]
    print(json.dumps(_summary(manifest, target, source) | extra, indent=1, sort_keys=True))
    return 0


def _summary(manifest: Manifest, target: str, source: str) -> dict[str, Any]:
    formats = sorted({s.format.value for s in manifest.shards})
    return {
        "target": target,
        "source": source,
        "id": manifest.id,
        "root": None if manifest.root is None else redact_url(manifest.root),
        "num_shards": len(manifest.shards),
        "num_samples": manifest.num_samples,
        "total_bytes": manifest.total_bytes,
        "formats": formats,
        "metadata": dict(manifest.metadata),
        "shards": [s.path for s in manifest.shards[:5]]
        + (["..."] if len(manifest.shards) > 5 else []),
    }
