"""blake3 digests of shard bytes: full content (streamed, bounded memory) and quick digest."""

from __future__ import annotations

import struct
from typing import Final

import blake3
import fsspec

CHUNK: Final = 8 << 20
QUICK_SPAN: Final = 1 << 20
PREFIX: Final = "b3:"


def full_digest_file(fs: fsspec.AbstractFileSystem, path: str) -> str:
    """``b3:<hex>`` blake3 of every byte of ``path``, read in 8 MiB chunks."""
    hasher = blake3.blake3()
    with fs.open(path, "rb", block_size=CHUNK) as fh:
        while chunk := fh.read(CHUNK):
            hasher.update(chunk)
    return PREFIX + hasher.hexdigest()


def digest_bytes(data: bytes) -> str:
    """``b3:<hex>`` of a bytes object."""
    return PREFIX + blake3.blake3(data).hexdigest()


def quick_digest_parts(size: int, head: bytes, tail: bytes) -> str:
    """Quick digest (``quick-v1``): blake3 of a domain tag, ``u64le(size)``, first and last MiB."""
    hasher = blake3.blake3(b"detdata:quick-v1" + struct.pack("<Q", size))
    hasher.update(head)
    hasher.update(tail)
    return PREFIX + hasher.hexdigest()


def quick_digest_file(fs: fsspec.AbstractFileSystem, path: str, size: int) -> str:
    """Quick digest of ``path`` of known ``size`` with two range reads (head, tail)."""
    span = min(size, QUICK_SPAN)
    with fs.open(path, "rb", block_size=QUICK_SPAN) as fh:
        head = fh.read(span)
        fh.seek(size - span)
        tail = fh.read(span)
    return quick_digest_parts(size, head, tail)
