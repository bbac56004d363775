"""Verifying shard bytes against a manifest's entries (docs/design.md section 1).

``quick`` compares each shard's size and quick digest, ``full`` also re-hashes every
byte against its blake3. Every shard is checked; the `VerificationError` raised names the
first bad one in path order, with its ``shard``, ``field`` (``exists``, ``bytes``,
``quick`` or ``blake3``), ``expected`` and ``found``. Each checked byte is read once
(docs/design.md, "Verification reads each checked byte once").
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from typing import Any, Final

from detdata.base.errors import ConfigError, VerificationError
from detdata.base.hashing import QUICK_SPAN, digest_bytes, quick_digest_parts
from detdata.base.redact import redact_url
from detdata.identity.entry import ShardEntry, ShardList, Verify
from detdata.identity.parallel import map_in_threads
from detdata.storage.digest import digest_retrying, full_digest_fd
from detdata.storage.fs import (
    filesystem,
    is_local_fs,
    join,
    missing_folder_hint,
    read_ranges_upto,
    size_retrying,
)
from detdata.storage.retry import RetryPolicy, check_policy

#: what each checked entry field is called in messages
_LABELS: Final = {"bytes": "size", "quick": "quick digest", "blake3": "blake3"}
#: a shard this small is read and hashed whole (its quick window is all of it)
SMALL_SHARD: Final = 2 * QUICK_SPAN
#: bytes asked for per batch of concurrent remote range requests (bounded memory)
BATCH_BYTES: Final = 64 << 20


def verify_manifest(
    manifest: ShardList,
    mode: Verify,
    shards: Sequence[ShardEntry],
    *,
    threads: int,
    progress: bool | None,
    retry: RetryPolicy | None,
    **storage_options: Any,
) -> VerificationError | None:
    """The first failure in path order (None: none) of the bytes under ``manifest.root`` of
    ``shards`` (some of its entries, in path order) at ``mode`` (quick or full)."""
    if manifest.root is None:
        raise ConfigError("cannot verify a manifest without a root")
    fs, root = filesystem(manifest.root, **storage_options)
    policy = check_policy(retry)
    shown = redact_url(manifest.root)
    if is_local_fs(fs):
        if shards and not os.path.isdir(root):  # every shard missing: said once, of the root
            first = shards[0]
            return VerificationError(
                f"root {shown!r} does not exist, so all {len(shards)} shards of the "
                f"manifest are missing (first: {first.path}); {missing_folder_hint(root)} (root=, "
                "Storage(root=...) or detdata verify --root)",
                shard=first.path,
                field="exists",
                expected=True,
                found=False,
            )
        results = map_in_threads(
            lambda s: check_local(join(root, s.path), s, mode, f"shard {s.path} (under {shown})"),
            shards,
            threads=threads,
            desc="verifying",
            progress=progress,
        )
    else:
        results = _verify_remote(fs, root, manifest, shards, mode, policy, threads, progress)
    return next((err for err in results if err is not None), None)


def check_local(path: str, shard: ShardEntry, mode: Verify, where: str) -> VerificationError | None:
    """Check one local shard file: one open, ``fstat``, ``pread`` of the checked bytes."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except FileNotFoundError:
        return missing(shard, where)
    try:
        size = os.fstat(fd).st_size
        if size == shard.bytes <= SMALL_SHARD:
            return check_whole(shard, pread_all(fd, size), where)
        return check_bytes(
            shard,
            mode,
            where,
            size=lambda: size,
            quick=lambda n: quick_digest_parts(
                n, pread_all(fd, QUICK_SPAN, 0), pread_all(fd, QUICK_SPAN, n - QUICK_SPAN)
            ),
            full=lambda _n: full_digest_fd(fd),
        )
    finally:
        os.close(fd)


def pread_all(fd: int, count: int, offset: int = 0) -> bytes:
    """Exactly ``count`` bytes at ``offset`` (fewer only at the end of the file)."""
    parts: list[bytes] = []
    done = 0
    while done < count:
        chunk = os.pread(fd, count - done, offset + done)
        if not chunk:
            break
        parts.append(chunk)
        done += len(chunk)
    return parts[0] if len(parts) == 1 else b"".join(parts)


def check_whole(shard: ShardEntry, data: bytes, where: str) -> VerificationError | None:
    """Check a small shard (at most `SMALL_SHARD` bytes) from all of its bytes, hashed once
    (equal blake3 implies equal quick digest; a difference reports ``quick`` first)."""
    if len(data) != shard.bytes:
        return mismatch(shard, "bytes", len(data), where)
    found_full = digest_bytes(data)
    if found_full == shard.blake3:
        return None
    span = min(len(data), QUICK_SPAN)
    found_quick = quick_digest_parts(len(data), data[:span], data[len(data) - span :])
    if found_quick != shard.quick:
        return mismatch(shard, "quick", found_quick, where)
    return mismatch(shard, "blake3", found_full, where)


def _verify_remote(
    fs: Any,
    root: str,
    manifest: ShardList,
    shards: Sequence[ShardEntry],
    mode: Verify,
    policy: RetryPolicy,
    threads: int,
    progress: bool | None,
) -> list[VerificationError | None]:
    """Batched, concurrent range reads of the checked bytes; odd cases per shard, retried."""
    results: list[VerificationError | None] = [None] * len(shards)
    again: list[int] = []  # shards to look into with the per-shard path
    full_after: list[int] = []  # large shards whose quick check passed, in FULL mode
    for batch in _batches(shards):
        asks = [(shards[i], span) for i in batch for span in _ranges(shards[i])]
        blobs = read_ranges_upto(
            fs,
            [join(root, s.path) for s, _ in asks],
            [span[0] for _, span in asks],
            [span[1] for _, span in asks],
            policy=policy,
            shards=[s.path for s, _ in asks],
            urls=[manifest.url(s) for s, _ in asks],
            what="verifying",
        )
        at = 0
        for i in batch:
            s = shards[i]
            count = len(_ranges(s))
            got, at = blobs[at : at + count], at + count
            verdict = _judge(s, got, _where(manifest, s))
            if verdict == "again":
                again.append(i)
            elif verdict == "full":
                if mode is Verify.FULL:
                    full_after.append(i)
            elif isinstance(verdict, VerificationError):
                results[i] = verdict

    def retried(s: ShardEntry) -> dict[str, Any]:
        return {"policy": policy, "shard": s.path, "url": manifest.url(s)}

    def again_one(i: int) -> VerificationError | None:
        """One shard with timed-out, retried reads: size, quick digest, (full) blake3."""
        s = shards[i]
        path, kw = join(root, s.path), retried(s)
        return check_bytes(
            s,
            mode,
            _where(manifest, s),
            size=lambda: size_retrying(fs, path, **kw),
            quick=lambda n: digest_retrying(fs, path, n, full=False, **kw),
            full=lambda n: digest_retrying(fs, path, n, full=True, **kw),
        )

    def full_one(i: int) -> VerificationError | None:
        """The blake3 check of a large shard whose size and quick digest matched."""
        s = shards[i]
        found = digest_retrying(fs, join(root, s.path), s.bytes, full=True, **retried(s))
        return mismatch(s, "blake3", found, _where(manifest, s)) if found != s.blake3 else None

    for indices, check, desc in (
        (again, again_one, "verifying"),
        (full_after, full_one, "hashing"),
    ):
        if indices:
            found = map_in_threads(check, indices, threads=threads, desc=desc, progress=progress)
            for i, err in zip(indices, found, strict=True):
                results[i] = err
    return results


def _batches(shards: Sequence[ShardEntry]) -> list[list[int]]:
    """Shard indices in consecutive groups asking for at most ~`BATCH_BYTES` each."""
    out: list[list[int]] = [[]]
    size = 0
    for i, s in enumerate(shards):
        need = min(s.bytes, SMALL_SHARD) + 1
        if out[-1] and size + need > BATCH_BYTES:
            out.append([])
            size = 0
        out[-1].append(i)
        size += need
    return [b for b in out if b]


def _ranges(shard: ShardEntry) -> list[tuple[int, int]]:
    """The ranges a quick check reads: all bytes (+1) of a small shard, else head and tail (+1)."""
    if shard.bytes == 0:
        return []
    if shard.bytes <= SMALL_SHARD:
        return [(0, shard.bytes + 1)]
    return [(0, QUICK_SPAN), (shard.bytes - QUICK_SPAN, shard.bytes + 1)]


def _judge(
    shard: ShardEntry, got: list[bytes | BaseException], where: str
) -> VerificationError | str | None:
    """A verdict from the bytes read: None (good), an error, ``"again"`` (an error or a size
    change: look into it per shard) or ``"full"`` (a large shard whose quick check passed)."""
    if not got or any(isinstance(g, BaseException) for g in got):
        return "again"
    blobs = [g for g in got if isinstance(g, bytes)]
    if shard.bytes <= SMALL_SHARD:
        if len(blobs[0]) != shard.bytes:
            return "again"
        return check_whole(shard, blobs[0], where)
    head, tail = blobs
    if len(head) != QUICK_SPAN or len(tail) != QUICK_SPAN:
        return "again"
    found_quick = quick_digest_parts(shard.bytes, head, tail)
    if found_quick != shard.quick:
        return mismatch(shard, "quick", found_quick, where)
    return "full"


def _where(manifest: ShardList, shard: ShardEntry) -> str:
    return f"shard {shard.path} ({redact_url(manifest.url(shard))})"


def check_bytes(
    shard: ShardEntry,
    mode: Verify,
    where: str,
    *,
    size: Callable[[], int],
    quick: Callable[[int], str],
    full: Callable[[int], str],
) -> VerificationError | None:
    """Compare size, quick digest and (``FULL``) blake3 with the entry; the first mismatch, or
    None. ``size()`` raising `FileNotFoundError` means the shard is missing."""
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
