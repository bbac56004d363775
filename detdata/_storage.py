"""Storage access through fsspec: URL handling, safe relative paths, streamed reads."""

from __future__ import annotations

import posixpath
import re
from typing import Any

import fsspec
from fsspec.core import url_to_fs

from detdata._errors import ManifestError

_SCHEME = re.compile(r"^[A-Za-z][A-Za-z0-9+.-]*://")


def is_url(path: str) -> bool:
    """True for ``scheme://...`` strings."""
    return bool(_SCHEME.match(path))


def filesystem(root: str, **storage_options: Any) -> tuple[fsspec.AbstractFileSystem, str]:
    """The fsspec filesystem for ``root`` and the root path inside it (no trailing slash)."""
    fs, path = url_to_fs(root, **storage_options)
    return fs, path.rstrip("/") if path != "/" else path


def check_relative_path(rel: object, *, where: str) -> str:
    """Validate a shard path stored in a manifest: relative, normalised, inside the root.

    Refuses absolute paths, URLs, backslashes, ``..``/``.`` segments and empty
    segments, so a manifest can never make detdata read outside its root.
    """
    if not isinstance(rel, str) or not rel:
        raise ManifestError(f"{where}: shard path must be a non-empty string, got {rel!r}")
    if is_url(rel) or rel.startswith(("/", "~")) or re.match(r"^[A-Za-z]:", rel) or "\\" in rel:
        raise ManifestError(f"{where}: shard path {rel!r} is absolute or a URL; manifests hold "
                            "only paths relative to their root")
    parts = rel.split("/")
    if any(p in ("", ".", "..") for p in parts) or "\x00" in rel:
        raise ManifestError(f"{where}: shard path {rel!r} is not a normalised relative path "
                            "('..', '.', empty segments are refused so no path escapes the root)")
    return rel


def join(root: str, rel: str) -> str:
    """Join a root path (inside its filesystem) and a checked relative path."""
    return posixpath.join(root, rel) if root not in ("", "/") else f"{root}{rel}" if root else rel
