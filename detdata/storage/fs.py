"""Storage access through fsspec: URL handling, safe relative paths, streamed reads.

Digests of what is read are `detdata.storage.digest`'s."""

from __future__ import annotations

import asyncio
import contextlib
import difflib
import os
import posixpath
import re
from collections.abc import Iterator
from typing import Any, Final
from urllib.parse import quote, unquote

import fsspec
from fsspec.core import url_to_fs

from detdata.base.errors import DependencyError, ManifestError, ShortRead, StorageError
from detdata.base.redact import install_log_redaction, redact_text, redact_url, scrub_exception
from detdata.storage.retry import RetryPolicy, is_transient

install_log_redaction()  # fsspec's DEBUG lines quote URLs, credentials included

_SCHEME = re.compile(r"^[A-Za-z][A-Za-z0-9+.-]*://")


def is_url(path: str) -> bool:
    """True for ``scheme://...`` strings."""
    return bool(_SCHEME.match(path))


def missing_folder_hint(path: str) -> str:
    """The next step for a local folder ``path`` that does not exist: the closest names
    beside it (a misspelt root), then what to pass instead."""
    parent, name = os.path.split(os.path.normpath(path))
    try:
        near = sorted(os.listdir(parent or "."))
    except OSError:
        near = []
    close = difflib.get_close_matches(name, near, n=3, cutoff=0.6)
    guess = " or ".join(repr(os.path.join(parent, c)) for c in close)
    found = f"did you mean {guess}? " if close else ""
    return f"hint: {found}pass the folder (or URL) that holds the shards"


#: The ``pip install`` extra of detdata that brings each URL scheme's fsspec backend.
SCHEME_EXTRAS: Final = {"http": "http", "https": "http", "s3": "s3", "gs": "gcs", "gcs": "gcs"}


def filesystem(root: str, **storage_options: Any) -> tuple[fsspec.AbstractFileSystem, str]:
    """The fsspec filesystem for ``root`` and the root path inside it (no trailing slash).

    `DependencyError` when the backend for ``root``'s scheme cannot be imported: it names the
    scheme, the root (redacted) and the ``pip install 'detdata[EXTRA]'`` that brings it."""
    try:
        fs, path = url_to_fs(root, **storage_options)
    except ImportError as exc:
        scheme = root.split("://", 1)[0].lower() if is_url(root) else "file"
        extra = SCHEME_EXTRAS.get(scheme)
        install = f"pip install 'detdata[{extra}]'" if extra else "install the fsspec backend"
        raise DependencyError(
            f"root {redact_url(root)}: reading {scheme}:// URLs needs a package that cannot be "
            f"imported ({redact_text(str(exc))}); hint: {install}"
        ) from exc
    return fs, path.rstrip("/") if path != "/" else path


PATH_RULES: Final = (
    "shard paths are relative POSIX paths in UTF-8: '/'-separated, no '.', "
    "'..' or empty segments, no backslash, not starting with '/', '~' or a "
    "drive letter such as 'd:', no NUL, at most 65,536 bytes"
)
#: the longest shard path a manifest holds (a file system's PATH_MAX is 4,096 bytes)
MAX_PATH_BYTES: Final = 1 << 16


def path_problem(rel: object) -> str | None:
    """Why ``rel`` cannot be a shard path of a manifest (`PATH_RULES`), or None when it can:
    the one rule, used where manifests are built and where they are loaded. Spaces, ``#``,
    ``?``, ``%`` and non-ASCII letters are allowed (URLs escape them: `url_join`)."""
    if not isinstance(rel, str) or not rel:
        return f"shard path must be a non-empty string, got {rel!r}"
    try:
        rel.encode("utf-8")
    except UnicodeEncodeError:
        raw: object = rel
        with contextlib.suppress(UnicodeEncodeError):  # a non-UTF-8 file name: its bytes
            raw = os.fsencode(rel)
        return (
            f"shard path {raw!r} is not valid UTF-8 (manifests are UTF-8 JSON; a file "
            "name in another encoding cannot be stored)"
        )
    why = _absolute_reason(rel)
    if why is not None:
        return (
            f"shard path {rel!r} is absolute or a URL ({why}); manifests hold only paths "
            "relative to their root"
        )
    if len(rel) * 4 > MAX_PATH_BYTES and len(rel.encode("utf-8")) > MAX_PATH_BYTES:
        return f"shard path of {len(rel.encode('utf-8'))} bytes is longer than {MAX_PATH_BYTES}"
    if any(p in ("", ".", "..") for p in rel.split("/")) or "\x00" in rel:
        return (
            f"shard path {rel!r} is not a normalised relative path ('..', '.', empty "
            "segments are refused so no path escapes the root)"
        )
    return None


def _absolute_reason(rel: str) -> str | None:
    if is_url(rel):
        return "a URL"
    if rel.startswith("/"):
        return "it starts with '/'"
    if rel.startswith("~"):
        return "it starts with '~', a home directory"
    if re.match(r"^[A-Za-z]:", rel):
        return f"it starts with the drive {rel[:2]!r}"
    if "\\" in rel:
        return "it contains a backslash, a Windows path separator"
    return None


def check_relative_path(rel: object, *, where: str) -> str:
    """``rel``, a shard path stored in a manifest; `ManifestError` (prefixed with ``where``)
    for anything `path_problem` refuses, so a manifest never reads outside its root."""
    problem = path_problem(rel)
    if problem is not None:
        raise ManifestError(f"{where}: {problem}")
    assert isinstance(rel, str)
    return rel


def check_shard_name(rel: object, *, root: str) -> str:
    """``rel`` (a file found under ``root`` while building) if a manifest can hold it, else
    `ManifestError` naming the file, why, and a hint."""
    problem = path_problem(rel)
    if problem is not None:
        raise ManifestError(
            f"cannot list the file {rel!r} under {redact_url(root)!r} in a manifest: "
            f"{problem}; hint: rename the file ({PATH_RULES}), or pass "
            "pattern= / paths= that leave it out"
        )
    assert isinstance(rel, str)
    return rel


def is_http(path: str) -> bool:
    """True for ``http://`` / ``https://`` URLs (whose paths are percent-encoded)."""
    return path.startswith(("http://", "https://"))


def quote_path(rel: str) -> str:
    """``rel`` percent-encoded segment by segment (``/`` kept) for use in an HTTP URL."""
    return "/".join(quote(part, safe="") for part in rel.split("/"))


def unquote_path(rel: str) -> str:
    """Inverse of `quote_path`; invalid UTF-8 escapes become lone surrogates (then refused)."""
    return "/".join(unquote(part, errors="surrogateescape") for part in rel.split("/"))


def _split_query(root: str) -> tuple[str, str]:
    """``(root without its query, "?query" or "")`` for HTTP(S) roots; other roots keep all."""
    if is_http(root) and "?" in root:
        base, _, query = root.partition("?")
        return base, "?" + query
    return root, ""


def join(root: str, rel: str) -> str:
    """Join a root path (inside its filesystem) and a checked relative shard path.

    For HTTP(S) roots the shard path is percent-encoded (so ``#``, ``?``, ``%`` reach the
    file they name), and a query string on the root (a SAS token) goes on every shard URL:
    ``https://host/container/<shard>?sv=..&sig=..``.
    """
    root, query = _split_query(root)
    if is_http(root):
        rel = quote_path(rel)
    if root in ("", "/"):
        return f"{root}{rel}" if root else rel
    return posixpath.join(root, rel) + query


def url_join(root_url: str, rel: str) -> str:
    """The URL of shard ``rel`` under ``root_url`` (HTTP(S): as in `join`)."""
    base, query = _split_query(root_url)
    return base.rstrip("/") + "/" + (quote_path(rel) if is_http(base) else rel) + query


# Remote reads: attempt timeouts, retries, exact lengths.


def is_local_fs(fs: fsspec.AbstractFileSystem) -> bool:
    """True for the local file system (memmaps and direct opens are possible)."""
    from fsspec.implementations.local import LocalFileSystem

    return isinstance(fs, LocalFileSystem)


def call_fs(
    fs: fsspec.AbstractFileSystem, method: str, *args: Any, timeout: float | None, **kwargs: Any
) -> Any:
    """``fs.<method>(*args, **kwargs)``; on fsspec's asynchronous file systems (s3, gcs,
    http) cancelled after ``timeout`` s (``FSTimeoutError``, a TimeoutError)."""
    from fsspec.asyn import AsyncFileSystem, sync

    if (
        timeout is not None
        and isinstance(fs, AsyncFileSystem)
        and not fs.asynchronous
        and hasattr(fs, "_" + method)
    ):
        return sync(fs.loop, getattr(fs, "_" + method), *args, timeout=timeout, **kwargs)
    return getattr(fs, method)(*args, **kwargs)


def cat_ranges_each(
    fs: fsspec.AbstractFileSystem,
    paths: list[str],
    starts: list[int],
    ends: list[int],
    *,
    timeout: float | None,
) -> list[Any]:
    """``fs.cat_ranges(paths, starts, ends)`` with per-range errors returned in place. On
    asynchronous file systems each range gets its own ``timeout``, at most ``fs.batch_size``
    (default 128) in flight; others get one plain ``cat_ranges`` call."""
    from fsspec.asyn import AsyncFileSystem, sync

    if timeout is None or not isinstance(fs, AsyncFileSystem) or fs.asynchronous:
        return list(fs.cat_ranges(paths, starts, ends))
    limit = max(1, int(getattr(fs, "batch_size", None) or 128))

    async def run_all() -> list[Any]:
        gate = asyncio.Semaphore(limit)

        async def one(path: str, start: int, end: int) -> Any:
            async with gate:
                return await asyncio.wait_for(fs._cat_file(path, start=start, end=end), timeout)

        return list(
            await asyncio.gather(
                *(one(p, a, b) for p, a, b in zip(paths, starts, ends, strict=True)),
                return_exceptions=True,
            )
        )

    # outer bound: every wave of `limit` ranges may take `timeout`, plus slack
    waves = -(-len(paths) // limit)
    return list(sync(fs.loop, run_all, timeout=timeout * waves + 5.0))


def _short(start: int, end: int, url: str, got: int) -> ShortRead:
    return ShortRead(
        f"asked for bytes [{start}, {end}) of {redact_url(url)} ({end - start} bytes), got "
        f"{got} (connection cut short, or a server that ignores Range)"
    )


def size_retrying(
    fs: fsspec.AbstractFileSystem, path: str, *, policy: RetryPolicy, shard: str, url: str
) -> int:
    """``fs.size(path)`` with retries (``FileNotFoundError`` passes through at once)."""
    return int(
        policy.run(
            lambda t: call_fs(fs, "size", path, timeout=t), what="size lookup", shard=shard, url=url
        )
    )


def range_retrying(
    fs: fsspec.AbstractFileSystem,
    path: str,
    start: int,
    end: int,
    *,
    policy: RetryPolicy,
    shard: str,
    url: str,
) -> bytes:
    """Exactly bytes ``[start, end)`` of ``path``, retried under ``policy`` (a short answer
    is a transient `ShortRead`)."""

    def attempt(timeout: float | None) -> bytes:
        data = call_fs(fs, "cat_file", path, start=start, end=end, timeout=timeout)
        if len(data) != end - start:
            raise _short(start, end, path, len(data))
        return bytes(data)

    if end <= start:
        return b""
    return policy.run(attempt, what=f"reading bytes [{start}, {end})", shard=shard, url=url)


def iter_chunks(
    fs: fsspec.AbstractFileSystem,
    path: str,
    size: int,
    *,
    policy: RetryPolicy,
    shard: str,
    url: str,
    chunk: int = 8 << 20,
) -> Iterator[bytes]:
    """The ``size`` bytes of ``path`` in ``chunk``-byte range reads, each retried on its own
    (bounded memory; a failure costs one chunk)."""
    for start in range(0, size, chunk):
        yield range_retrying(
            fs, path, start, min(size, start + chunk), policy=policy, shard=shard, url=url
        )


def read_file_retrying(
    path_or_url: str, *, policy: RetryPolicy, what: str, **storage_options: Any
) -> bytes:
    """Every byte of a small file/URL (manifests, registry objects), retried under ``policy``."""
    fs, fpath = filesystem(path_or_url, **storage_options)
    if is_local_fs(fs):
        return bytes(fs.cat_file(fpath))
    return bytes(
        policy.run(
            lambda t: call_fs(fs, "cat_file", fpath, timeout=t),
            what=what,
            shard="-",
            url=path_or_url,
        )
    )


def read_ranges_upto(
    fs: fsspec.AbstractFileSystem,
    paths: list[str],
    starts: list[int],
    ends: list[int],
    *,
    policy: RetryPolicy,
    shards: list[str],
    urls: list[str],
    what: str = "range read",
    upto: bool = True,
) -> list[bytes | BaseException]:
    """Bytes ``[start, end)`` of each path, one ``cat_ranges`` call per attempt; failed
    ranges are fetched again under ``policy`` (then `RetriesExhausted`). ``upto``: a short
    answer is kept (where the object ends first: for checks that ask one byte past the
    expected end) and a permanent error of one range is returned in its place, redacted;
    else a short range is retried too and a permanent error (missing object, permission
    denied) is a `StorageError` naming it at once."""
    out: list[bytes | BaseException | None] = [None] * len(paths)
    pending = list(range(len(paths)))

    def attempt(timeout: float | None) -> None:
        nonlocal pending
        blobs = cat_ranges_each(
            fs,
            [paths[i] for i in pending],
            [starts[i] for i in pending],
            [ends[i] for i in pending],
            timeout=timeout,
        )
        failed: list[int] = []
        first: BaseException | None = None
        for i, blob in zip(pending, blobs, strict=True):
            if isinstance(blob, BaseException):
                err: BaseException = blob
            elif not upto and len(blob) != ends[i] - starts[i]:
                err = _short(starts[i], ends[i], urls[i], len(blob))
            else:
                out[i] = bytes(blob)
                continue
            scrub_exception(err)
            if not is_transient(err):
                if upto:
                    out[i] = err
                    continue
                raise StorageError(  # its text is redacted when it is made (DetdataError)
                    f"{what} failed for shard {shards[i]} at {urls[i]}: "
                    f"{type(err).__name__}: {err}; hint: the object is missing or "
                    "not readable; check the root URL, credentials and that the "
                    "store still holds the manifest's shards"
                ) from err
            failed.append(i)
            first = first or err
        pending = failed
        if first is not None:
            raise first

    if pending:
        policy.run(
            attempt,
            what=f"{what} of {len(paths)} range(s)",
            shard=lambda: shards[pending[0]],
            url=lambda: urls[pending[0]],
        )
    return [b if b is not None else RuntimeError("range not read") for b in out]
