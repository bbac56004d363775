"""Digests of stored bytes: the one home of "blake3 this file / these chunks".

The definitions are `detdata.base.hashing`'s; here they are applied to a local descriptor or
path, a file through fsspec, a remote object through retried range reads, or a stream of chunks.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Iterator

import blake3
import fsspec

from detdata.base.hashing import CHUNK, PREFIX, QUICK_SPAN, quick_digest_parts
from detdata.storage.fs import iter_chunks, range_retrying
from detdata.storage.retry import RetryPolicy


def digest_chunks(chunks: Iterable[bytes]) -> str:
    """``b3:<hex>`` of the concatenation of ``chunks`` (consumed once: bounded memory)."""
    hasher = blake3.blake3()
    for chunk in chunks:
        hasher.update(chunk)
    return PREFIX + hasher.hexdigest()


def _fd_chunks(fd: int) -> Iterator[bytes]:
    offset = 0
    while chunk := os.pread(fd, CHUNK, offset):
        yield chunk
        offset += len(chunk)


def full_digest_fd(fd: int) -> str:
    """``b3:<hex>`` of every byte of an open local file (``pread`` in 8 MiB chunks)."""
    return digest_chunks(_fd_chunks(fd))


def full_digest_path(path: str) -> str:
    """``b3:<hex>`` of every byte of the local file ``path`` (`FileNotFoundError` if gone)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        return full_digest_fd(fd)
    finally:
        os.close(fd)


def quick_digest_fd(fd: int, size: int) -> str:
    """The quick digest of an open local file of ``size`` bytes (first and last MiB)."""
    span = min(size, QUICK_SPAN)
    return quick_digest_parts(size, os.pread(fd, span, 0), os.pread(fd, span, size - span))


def _fs_chunks(fs: fsspec.AbstractFileSystem, path: str) -> Iterator[bytes]:
    with fs.open(path, "rb", block_size=CHUNK) as fh:
        while chunk := fh.read(CHUNK):
            yield chunk


def full_digest_file(fs: fsspec.AbstractFileSystem, path: str) -> str:
    """``b3:<hex>`` of every byte of ``path`` on ``fs``, read in 8 MiB chunks (no retries)."""
    return digest_chunks(_fs_chunks(fs, path))


def digests_file(fs: fsspec.AbstractFileSystem, path: str, size: int) -> tuple[str, str]:
    """``(full blake3, quick digest)`` of ``path`` of known ``size``, from one stream of it."""
    head = b""
    tail = b""
    span = min(size, QUICK_SPAN)

    def kept(chunks: Iterator[bytes]) -> Iterator[bytes]:
        nonlocal head, tail
        for chunk in chunks:
            yield chunk
            if not span:
                continue
            if len(head) < span:
                head += chunk[: span - len(head)]
            tail = chunk[-span:] if len(chunk) >= span else (tail + chunk)[-span:]

    full = digest_chunks(kept(_fs_chunks(fs, path)))
    return full, quick_digest_parts(size, head, tail)


def digest_retrying(
    fs: fsspec.AbstractFileSystem,
    path: str,
    size: int,
    *,
    full: bool,
    policy: RetryPolicy,
    shard: str,
    url: str,
) -> str:
    """A remote file's ``full`` digest (``b3:<hex>`` of every byte, streamed in retried
    chunks) or quick digest (from two retried range reads: head, tail)."""
    if full:
        chunks = iter_chunks(fs, path, size, policy=policy, shard=shard, url=url, chunk=CHUNK)
        return digest_chunks(chunks)
    span = min(size, QUICK_SPAN)
    head = range_retrying(fs, path, 0, span, policy=policy, shard=shard, url=url)
    tail = range_retrying(fs, path, size - span, size, policy=policy, shard=shard, url=url)
    return quick_digest_parts(size, head, tail)
