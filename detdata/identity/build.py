"""Building manifests: list the shard files under a root, hash them in parallel.

`build_manifest` is the only way detdata creates a `Manifest` from data: every name it
records has passed `check_shard_name`, and each shard is streamed once for its digests,
locally or as one `hash_entry` task per shard on any executor, same id (docs/design.md,
"Hashing across machines").
"""

from __future__ import annotations

import functools
import os
import posixpath
import re
from collections.abc import Mapping, Sequence
from concurrent.futures import Executor
from glob import has_magic
from typing import Any

from fsspec.utils import glob_translate

from detdata.base.errors import ConfigError, DetdataError, StorageError
from detdata.base.progress import progress
from detdata.base.redact import redact_url
from detdata.identity.entry import ShardEntry
from detdata.identity.formats import (
    Format,
    detect_format,
    inspect_shard,
    parse_format,
    sniff_format,
    suffix_format,
)
from detdata.identity.manifest import Manifest
from detdata.identity.parallel import map_in_threads
from detdata.storage.digest import digests_file, full_digest_file
from detdata.storage.fs import (
    check_shard_name,
    filesystem,
    is_http,
    is_local_fs,
    is_url,
    join,
    missing_folder_hint,
    unquote_path,
    url_join,
)
from detdata.storage.retry import RetryPolicy, check_policy


def build_manifest(
    root: str | os.PathLike[str],
    *,
    pattern: str | None = None,
    format: str | Format | None = None,
    dtype: str | None = None,
    metadata: Mapping[str, Any] | None = None,
    paths: Sequence[str] | None = None,
    threads: int = 8,
    progress: bool | None = None,
    retry: RetryPolicy | None = None,
    executor: Executor | None = None,
    **storage_options: Any,
) -> Manifest:
    """Hash the shards under ``root`` (path or fsspec URL) into a `Manifest`.

    Shards are ``paths`` (relative) if given, else files matching the glob ``pattern``
    (default: every file with a known suffix, recursively). ``format`` overrides suffix
    detection; ``.bin`` needs ``dtype``. Hashed in ``threads`` threads, or as one
    `hash_entry` task per shard on ``executor`` (whose workers must reach the same
    store). ``metadata`` is part of the id.
    """
    root = os.fspath(root)  # a pathlib.Path as torch users pass one
    fs, rootpath = filesystem(root, **storage_options)
    fmt = parse_format(format) if format is not None else None
    rels = shard_names(fs, root, rootpath, pattern, fmt, paths, progress=progress)
    entries = hash_entries(
        root,
        rels,
        format=fmt,
        dtype=dtype,
        threads=threads,
        progress=progress,
        retry=retry,
        executor=executor,
        **storage_options,
    )
    return Manifest(shards=tuple(entries), metadata=dict(metadata or {}), root=canonical(root))


def canonical(root: str) -> str:
    """The root a built manifest records: URLs as given, local paths made absolute."""
    return root if is_url(root) else os.path.abspath(root)


def hash_entries(
    root: str,
    rels: Sequence[str],
    *,
    format: Format | None = None,
    dtype: str | None = None,
    threads: int = 8,
    progress: bool | None = None,
    retry: RetryPolicy | None = None,
    executor: Executor | None = None,
    **storage_options: Any,
) -> list[ShardEntry]:
    """The entries of the (checked) shard names ``rels`` under ``root``, in input order, in
    ``threads`` local threads or one `hash_entry` task per shard on ``executor``."""
    policy = check_policy(retry)
    options = dict(storage_options)
    if executor is not None:
        if not isinstance(executor, Executor):
            raise ConfigError(
                f"executor must be a concurrent.futures.Executor, got {type(executor).__name__}; "
                "hint: a Dask client gives one with client.get_executor()"
            )
        task = functools.partial(
            hash_entry, root, format=format, dtype=dtype, retry=policy, storage_options=options
        )
        entries = list(executor.map(task, list(rels)))
        _check_returned(entries, rels)
        return entries
    fs, rootpath = filesystem(root, **options)
    return map_in_threads(
        lambda rel: _hash_with(fs, rootpath, root, rel, format, dtype, policy),
        list(rels),
        threads=threads,
        desc="hashing",
        progress=progress,
    )


def hash_entry(
    root: str,
    rel: str,
    format: Format | None,
    dtype: str | None,
    retry: RetryPolicy,
    storage_options: Mapping[str, Any],
) -> ShardEntry:
    """The manifest entry of shard ``rel`` under ``root`` (a self-contained, picklable task)."""
    fs, rootpath = filesystem(root, **dict(storage_options))
    return _hash_with(fs, rootpath, root, rel, format, dtype, retry)


def _check_returned(entries: list[Any], rels: Sequence[str]) -> None:
    """A `StorageError` naming the first shard without its entry unless the executor
    returned one entry per shard, in order."""
    for i, rel in enumerate(rels):
        got = entries[i] if i < len(entries) else None
        if not isinstance(got, ShardEntry) or got.path != rel:
            found = got.path if isinstance(got, ShardEntry) else type(got).__name__
            raise StorageError(
                f"the executor returned {len(entries)} entries for {len(rels)} shards: shard "
                f"{rel} (number {i}) has no entry (found {found!r} in its place); a task was "
                "lost or reordered; hint: check the executor (its map must return one result "
                "per task, in order)"
            )
    if len(entries) != len(rels):
        raise StorageError(
            f"the executor returned {len(entries)} entries for {len(rels)} shards; hint: check "
            "the executor (its map must return one result per task, in order)"
        )


def _hash_with(
    fs: Any,
    rootpath: str,
    root: str,
    rel: str,
    fmt: Format | None,
    dtype: str | None,
    policy: RetryPolicy,
) -> ShardEntry:
    """The entry of ``rel``; an OS error that does not name the shard is a `StorageError`
    that does (the task may run on another machine)."""
    check_shard_name(rel, root=root)
    try:
        if is_local_fs(fs):
            return _build_entry(fs, join(rootpath, rel), rel, fmt, dtype)
        return policy.run(
            lambda _t: _build_entry(fs, join(rootpath, rel), rel, fmt, dtype),
            what="hashing",
            shard=rel,
            url=url_join(root, rel),
        )
    except OSError as exc:
        if isinstance(exc, DetdataError):
            raise
        where = redact_url(url_join(root, rel))
        reason = exc.strerror or exc
        raise StorageError(f"shard {rel}: cannot be hashed: {reason} ({where})") from exc


def hash_files(
    paths: Sequence[str], *, threads: int = 8, **storage_options: Any
) -> list[tuple[str, int, str]]:
    """``(path, bytes, b3:<hex>)`` for each file or URL, hashed in parallel."""

    def one(p: str) -> tuple[str, int, str]:
        fs, fpath = filesystem(p, **storage_options)
        try:
            if fs.isdir(fpath):
                raise StorageError(
                    f"{redact_url(p)}: is a directory; hint: pass files, e.g. {redact_url(p)}/*.npy"
                )
            return p, int(fs.size(fpath)), full_digest_file(fs, fpath)
        except FileNotFoundError:
            raise StorageError(f"{redact_url(p)}: file not found; hint: check the path") from None

    return map_in_threads(one, paths, threads=threads)


def shard_names(
    fs: Any,
    root: str,
    rootpath: str,
    pattern: str | None,
    fmt: Format | None,
    paths: Sequence[str] | None,
    *,
    progress: bool | None = None,
) -> list[str]:
    """The sorted, checked relative names to build: ``paths``, else a listing of ``root``
    (its progress: files found so far)."""
    if paths is not None:
        rels = sorted(check_shard_name(p, root=root) for p in paths)
    else:
        if not fs.exists(rootpath):
            hint = missing_folder_hint(root) if is_local_fs(fs) else "hint: check the URL"
            raise ConfigError(f"root {redact_url(root)!r} does not exist; {hint}")
        rels = _list_shards(fs, rootpath, pattern, fmt, progress)
    if not rels:
        raise ConfigError(
            f"no shards found under {redact_url(root)!r} (pattern={pattern!r}); hint: check the "
            "path and pattern, e.g. pattern='**/*.npy'"
        )
    return rels


def _list_shards(
    fs: Any, root: str, pattern: str | None, fmt: Format | None, progress: bool | None = None
) -> list[str]:
    """Sorted relative paths of the shard files under ``root`` (checked by `check_shard_name`;
    HTTP listings decoded, so a build over HTTP has the same names and id)."""
    full = (
        None
        if pattern is None
        else (posixpath.join(root, pattern) if root not in ("", "/") else root + pattern)
    )
    if is_local_fs(fs):
        found = _walk_local(fs, root, full, progress)
    elif full is None:
        found = list(fs.find(root))
    else:
        found = [p for p in fs.glob(full) if not fs.isdir(p)]
    if pattern is None and fmt is not Format.JSONL:  # format="jsonl": .json names are shards
        found = [p for p in found if not p.endswith(".json")]
    prefix = root.rstrip("/") + "/"
    outside = [p for p in found if not p.startswith(prefix)]
    if outside:
        raise ConfigError(
            f"pattern {pattern!r} matched {redact_url(outside[0])!r}, which is not under the "
            f"root {redact_url(root)!r}; hint: use a pattern relative to the root"
        )
    rels = [p[len(prefix) :] for p in found]
    if is_http(root):
        rels = [unquote_path(r) for r in rels]
    rels.sort()
    if fmt is None and pattern is None:
        rels = [r for r in rels if suffix_format(r) is not None]
    return [check_shard_name(r, root=root) for r in rels]


def _walk_local(fs: Any, root: str, full: str | None, show: bool | None) -> list[str]:
    """The files under local ``root`` (matching the glob ``full`` as ``fs.glob`` would), one
    folder at a time so that a large listing shows its progress."""
    if full is not None and not has_magic(full):
        return [full] if fs.isfile(full) else []
    match = None if full is None else re.compile(glob_translate(full)).match
    found: list[str] = []
    with progress(None, "listing files", unit="files", enabled=show) as update:
        for folder, _, files in fs.walk(root):
            paths = [posixpath.join(folder, name) for name in files]
            found += paths if match is None else [p for p in paths if match(p)]
            update(len(files))
    return found


def _build_entry(fs: Any, path: str, rel: str, fmt: Format | None, dtype: str | None) -> ShardEntry:
    """The entry of one shard: size, layout (header/footer), full and quick digests."""
    shard_format = fmt if fmt is not None else detect_format(rel)
    try:
        size = int(fs.size(path))
    except FileNotFoundError:
        raise StorageError(
            f"shard {rel}: file not found at {redact_url(path)}; hint: check the root and the "
            "relative paths"
        ) from None
    if fmt is None:  # a .arrow file is an Arrow IPC file or stream: its first bytes say
        shard_format = sniff_format(fs, path, shard_format)
    layout = inspect_shard(fs, path, size, shard_format, dtype, rel=rel)
    full, quick = digests_file(fs, path, size)
    return ShardEntry(
        path=rel, bytes=size, blake3=full, quick=quick, format=shard_format, **vars(layout)
    )
