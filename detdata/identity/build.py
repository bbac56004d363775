"""Building manifests: list the shard files under a root, hash them in parallel.

`build_manifest` is the only way detdata creates a `Manifest` from data: every
name it records has passed `check_shard_name` (so the loader accepts it), the
shards are sorted by relative path, and each is streamed once for its blake3
(bounded memory) plus a header/footer read for its layout.
"""

from __future__ import annotations

import os
import posixpath
from collections.abc import Mapping, Sequence
from typing import Any

from detdata.base.errors import ConfigError, StorageError
from detdata.identity.formats import (
    Format,
    ShardLayout,
    detect_format,
    inspect_shard,
    parse_format,
    suffix_format,
)
from detdata.identity.hashing import full_digest_file, quick_digest_file
from detdata.identity.manifest import Manifest, ShardEntry
from detdata.identity.parallel import map_in_threads
from detdata.storage.fs import (
    check_shard_name,
    filesystem,
    is_http,
    is_local_fs,
    is_url,
    join,
    unquote_path,
    url_join,
)
from detdata.storage.retry import RetryPolicy, check_policy


def build_manifest(
    root: str,
    *,
    pattern: str | None = None,
    format: str | Format | None = None,
    dtype: str | None = None,
    metadata: Mapping[str, Any] | None = None,
    paths: Sequence[str] | None = None,
    threads: int = 8,
    progress: bool | None = None,
    retry: RetryPolicy | None = None,
    **storage_options: Any,
) -> Manifest:
    """Hash the shards under ``root`` (path or fsspec URL) into a `Manifest`.

    Shards are ``paths`` (relative) if given, else files matching the glob
    ``pattern`` (default: every file with a known suffix, recursively), sorted
    by relative path. ``format`` overrides suffix detection; ``.bin`` needs
    ``dtype``. Shards are hashed in ``threads`` parallel threads, each streamed in
    bounded memory. ``metadata`` (tokenizer hash, description...) is part of the id.
    """
    fs, rootpath = filesystem(root, **storage_options)
    fmt = parse_format(format) if format is not None else None
    rels = _shard_names(fs, root, rootpath, pattern, fmt, paths)
    policy = check_policy(retry)

    def build(rel: str) -> ShardEntry:
        if is_local_fs(fs):
            return _build_entry(fs, join(rootpath, rel), rel, fmt, dtype)
        return policy.run(
            lambda _t: _build_entry(fs, join(rootpath, rel), rel, fmt, dtype),
            what="hashing",
            shard=rel,
            url=url_join(root, rel),
        )

    entries = map_in_threads(build, rels, threads=threads, desc="hashing", progress=progress)
    canonical_root = root if is_url(root) else os.path.abspath(root)
    return Manifest(shards=tuple(entries), metadata=dict(metadata or {}), root=canonical_root)


def hash_files(
    paths: Sequence[str], *, threads: int = 8, **storage_options: Any
) -> list[tuple[str, int, str]]:
    """``(path, bytes, b3:<hex>)`` for each file or URL, hashed in parallel."""

    def one(p: str) -> tuple[str, int, str]:
        fs, fpath = filesystem(p, **storage_options)
        try:
            if fs.isdir(fpath):
                raise StorageError(f"{p}: is a directory; hint: pass files, e.g. {p}/*.npy")
            return p, int(fs.size(fpath)), full_digest_file(fs, fpath)
        except FileNotFoundError:
            raise StorageError(f"{p}: file not found; hint: check the path") from None

    return map_in_threads(one, paths, threads=threads)


def _shard_names(
    fs: Any,
    root: str,
    rootpath: str,
    pattern: str | None,
    fmt: Format | None,
    paths: Sequence[str] | None,
) -> list[str]:
    """The sorted, checked relative names to build: ``paths``, else a listing of ``root``."""
    if paths is not None:
        rels = sorted(check_shard_name(p, root=root) for p in paths)
    else:
        if not fs.exists(rootpath):
            raise ConfigError(f"root {root!r} does not exist")
        rels = _list_shards(fs, rootpath, pattern, fmt)
    if not rels:
        raise ConfigError(
            f"no shards found under {root!r} (pattern={pattern!r}); hint: check the "
            "path and pattern, e.g. pattern='**/*.npy'"
        )
    return rels


def _list_shards(fs: Any, root: str, pattern: str | None, fmt: Format | None) -> list[str]:
    """Sorted relative paths of the shard files under ``root`` (checked by `check_shard_name`).

    HTTP listings give percent-encoded URLs; their paths are decoded, so a manifest
    built over HTTP holds the same file names (and id) as one built from the files.
    """
    if pattern is None:
        found = [p for p in fs.find(root) if not p.endswith(".json")]
    else:
        found = fs.glob(posixpath.join(root, pattern) if root not in ("", "/") else root + pattern)
        found = [p for p in found if not fs.isdir(p)]
    prefix = root.rstrip("/") + "/"
    outside = [p for p in found if not p.startswith(prefix)]
    if outside:
        raise ConfigError(
            f"pattern {pattern!r} matched {outside[0]!r}, which is not under the "
            f"root {root!r}; hint: use a pattern relative to the root"
        )
    rels = [p[len(prefix) :] for p in found]
    if is_http(root):
        rels = [unquote_path(r) for r in rels]
    rels.sort()
    if fmt is None and pattern is None:
        rels = [r for r in rels if suffix_format(r) is not None]
    return [check_shard_name(r, root=root) for r in rels]


def _build_entry(fs: Any, path: str, rel: str, fmt: Format | None, dtype: str | None) -> ShardEntry:
    """The entry of one shard: size, layout (header/footer), full and quick digests."""
    shard_format = fmt if fmt is not None else detect_format(rel)
    try:
        size = int(fs.size(path))
    except FileNotFoundError:
        raise StorageError(
            f"shard {rel}: file not found at {path}; hint: check the root and the relative paths"
        ) from None
    layout: ShardLayout = inspect_shard(fs, path, size, shard_format, dtype, rel=rel)
    return ShardEntry(
        path=rel,
        bytes=size,
        blake3=full_digest_file(fs, path),
        quick=quick_digest_file(fs, path, size),
        num_samples=layout.num_samples,
        format=shard_format,
        dtype=layout.dtype,
        data_offset=layout.data_offset,
        schema=layout.schema,
        row_groups=layout.row_groups,
    )
