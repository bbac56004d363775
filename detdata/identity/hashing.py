"""blake3 digests of shard files read through an fsspec filesystem (local reads, no retries).

The digest definitions (``b3:`` prefix, chunk size, ``quick-v1``) live in
`detdata.base.hashing`; remote stores read the same bytes with retries through
`detdata.storage.fs.full_digest_retrying` / `quick_digest_retrying`, so a file
has one full and one quick digest however it is read.
"""

from __future__ import annotations

import os

import blake3
import fsspec

from detdata.base.hashing import CHUNK, PREFIX, QUICK_SPAN, quick_digest_parts


def full_digest_file(fs: fsspec.AbstractFileSystem, path: str) -> str:
    """``b3:<hex>`` blake3 of every byte of ``path``, read in 8 MiB chunks (bounded memory)."""
    hasher = blake3.blake3()
    with fs.open(path, "rb", block_size=CHUNK) as fh:
        while chunk := fh.read(CHUNK):
            hasher.update(chunk)
    return PREFIX + hasher.hexdigest()


def full_digest_fd(fd: int) -> str:
    """``b3:<hex>`` of every byte of an open local file (``pread`` in 8 MiB chunks)."""
    hasher = blake3.blake3()
    offset = 0
    while chunk := os.pread(fd, CHUNK, offset):
        hasher.update(chunk)
        offset += len(chunk)
    return PREFIX + hasher.hexdigest()


def digests_file(fs: fsspec.AbstractFileSystem, path: str, size: int) -> tuple[str, str]:
    """``(full blake3, quick digest)`` of ``path`` of known ``size``, every byte read once.

    The file is streamed once: the full hash takes every chunk, the first and
    last `QUICK_SPAN` bytes are kept from the same stream for the quick digest
    (a small file is one read). Equal to `full_digest_file` and the quick digest of the same bytes.
    """
    hasher = blake3.blake3()
    head = b""
    tail = b""
    span = min(size, QUICK_SPAN)
    with fs.open(path, "rb", block_size=CHUNK) as fh:
        while chunk := fh.read(CHUNK):
            hasher.update(chunk)
            if not span:
                continue
            if len(head) < span:
                head += chunk[: span - len(head)]
            tail = chunk[-span:] if len(chunk) >= span else (tail + chunk)[-span:]
    return PREFIX + hasher.hexdigest(), quick_digest_parts(size, head, tail)
