"""Verifying shard bytes against a manifest's entries (DESIGN.md section 1).

``quick`` compares each shard's size and quick digest (two range reads),
``full`` also re-hashes every byte against its blake3, ``off`` reads nothing.
Local files are read directly; remote ones with timed-out, retried range reads
(never a hang). Every shard is checked; the `VerificationError` raised names the
first bad one in path order, with its ``shard``, ``field`` (``exists``,
``bytes``, ``quick`` or ``blake3``), ``expected`` and ``found`` values.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Final

from detdata.base.errors import ConfigError, VerificationError
from detdata.identity.hashing import full_digest_file, quick_digest_file
from detdata.identity.manifest import Manifest, ShardEntry, Verify, parse_verify
from detdata.identity.parallel import map_in_threads
from detdata.storage.fs import (
    filesystem,
    full_digest_retrying,
    is_local_fs,
    join,
    quick_digest_retrying,
    size_retrying,
)
from detdata.storage.retry import RetryPolicy, check_policy

#: what each checked entry field is called in messages
_LABELS: Final = {"bytes": "size", "quick": "quick digest", "blake3": "blake3"}


def verify_manifest(
    manifest: Manifest,
    mode: str | Verify = Verify.QUICK,
    *,
    threads: int = 8,
    progress: bool | None = None,
    retry: RetryPolicy | None = None,
    **storage_options: Any,
) -> None:
    """Check the bytes under ``manifest.root`` in ``threads`` threads (`Manifest.verify`)."""
    mode = parse_verify(mode)
    if mode is Verify.OFF:
        return
    if manifest.root is None:
        raise ConfigError("cannot verify a manifest without a root")
    fs, root = filesystem(manifest.root, **storage_options)
    policy = check_policy(retry)

    def check(shard: ShardEntry) -> VerificationError | None:
        if is_local_fs(fs):
            return _check_local(fs, join(root, shard.path), shard, mode, manifest.root or "")
        return _check_remote(fs, join(root, shard.path), shard, mode, manifest.url(shard), policy)

    results = map_in_threads(
        check, manifest.shards, threads=threads, desc="verifying", progress=progress
    )
    for err in results:
        if err is not None:
            raise err


def _check_local(
    fs: Any, path: str, shard: ShardEntry, mode: Verify, root: str
) -> VerificationError | None:
    return check_bytes(
        shard,
        mode,
        f"shard {shard.path} (under {root})",
        size=lambda: int(fs.size(path)),
        quick=lambda size: quick_digest_file(fs, path, size),
        full=lambda size: full_digest_file(fs, path),
    )


def _check_remote(
    fs: Any, path: str, shard: ShardEntry, mode: Verify, url: str, policy: RetryPolicy
) -> VerificationError | None:
    """`_check_local` for remote stores: timed-out, retried range reads (never a hang)."""
    name = shard.path
    return check_bytes(
        shard,
        mode,
        f"shard {name} ({url})",
        size=lambda: size_retrying(fs, path, policy=policy, shard=name, url=url),
        quick=lambda n: quick_digest_retrying(fs, path, n, policy=policy, shard=name, url=url),
        full=lambda n: full_digest_retrying(fs, path, n, policy=policy, shard=name, url=url),
    )


def check_bytes(
    shard: ShardEntry,
    mode: Verify,
    where: str,
    *,
    size: Callable[[], int],
    quick: Callable[[int], str],
    full: Callable[[int], str],
) -> VerificationError | None:
    """Compare size, quick digest and (``FULL``) blake3 with the entry; the first mismatch, or None.

    ``size()`` raising `FileNotFoundError` means the shard is missing; ``quick`` and
    ``full`` are called with the size found, only when every earlier field matched.
    """
    try:
        found_size = size()
    except FileNotFoundError:
        return missing(shard, where)
    if found_size != shard.bytes:
        return mismatch(shard, "bytes", found_size, where)
    found_quick = quick(found_size)
    if found_quick != shard.quick:
        return mismatch(shard, "quick", found_quick, where)
    if mode is Verify.FULL:
        found_full = full(found_size)
        if found_full != shard.blake3:
            return mismatch(shard, "blake3", found_full, where)
    return None


def missing(shard: ShardEntry, where: str) -> VerificationError:
    """The error for a shard file that is not there (field ``exists``)."""
    return VerificationError(
        f"{where}: missing; expected {shard.bytes} bytes; hint: the file "
        "was deleted or renamed, or the root is wrong (pass root=)",
        shard=shard.path,
        field="exists",
        expected=True,
        found=False,
    )


def mismatch(shard: ShardEntry, field: str, found: object, where: str) -> VerificationError:
    """The error for entry ``field`` (``bytes``, ``quick``, ``blake3``) differing from ``found``."""
    expected = getattr(shard, field)
    if field == "bytes":
        detail = f"expected {expected} bytes, found {found} (truncated or rewritten?)"
    else:
        detail = f"expected {expected}, found {found}"
    return VerificationError(
        f"{where}: {_LABELS[field]} mismatch: {detail}",
        shard=shard.path,
        field=field,
        expected=expected,
        found=found,
    )
