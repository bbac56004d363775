"""Shard paths stored in compressed blocks: the path table of a fast-form manifest
(docs/design.md section 8, "Start-up at scale").

A block is ``zlib(u32 length of each path, little-endian) + (the UTF-8 paths))``; block
``b`` holds shards ``[b * PATH_BLOCK, (b + 1) * PATH_BLOCK)``, the last one fewer.
"""

from __future__ import annotations

import zlib
from collections.abc import Callable, Sequence
from typing import Final

import numpy as np
import numpy.typing as npt

from detdata.storage.fs import MAX_PATH_BYTES

#: shards per compressed block of paths
PATH_BLOCK: Final = 256
#: the most a block may decompress to: what a reader allows, whatever a header says
MAX_BLOCK_RAW: Final = PATH_BLOCK * (4 + MAX_PATH_BYTES)
_LEVEL: Final = 9


def encode_paths(paths: Sequence[bytes]) -> tuple[bytes, npt.NDArray[np.int64], int]:
    """``(blob, ends, largest)``: the compressed blocks of ``paths`` (UTF-8) back to back,
    the cumulative end of each block in the blob (``blocks + 1`` values, from 0), and the
    most bytes one block decompresses to (what `decode_block` allows)."""
    parts: list[bytes] = []
    ends = [0]
    largest = 0
    for lo in range(0, len(paths), PATH_BLOCK):
        block = paths[lo : lo + PATH_BLOCK]
        lengths = np.fromiter((len(p) for p in block), dtype="<u4", count=len(block))
        raw = lengths.tobytes() + b"".join(block)
        largest = max(largest, len(raw))
        parts.append(zlib.compress(raw, _LEVEL))
        ends.append(ends[-1] + len(parts[-1]))
    return b"".join(parts), np.array(ends, dtype=np.int64), largest


def decode_block(
    raw: bytes, count: int, largest: int, error: Callable[[str], Exception], block: int
) -> list[str]:
    """The ``count`` paths of compressed block number ``block`` (``raw``); ``error(what)``
    raised for a block that does not decompress to at most ``largest`` bytes (at most
    `MAX_BLOCK_RAW`: the header's check, `detdata.identity.columns.parse_header`), whose
    lengths do not add up to its bytes, or with a path that is not UTF-8."""
    where = f"path block {block}"
    inflate = zlib.decompressobj()
    try:
        data = inflate.decompress(raw, largest + 1)
    except (zlib.error, ValueError, OverflowError) as exc:
        raise error(f"{where} does not decompress ({exc})") from None
    if len(data) > largest or inflate.unconsumed_tail or not inflate.eof or inflate.unused_data:
        raise error(f"{where} is not one compressed block of at most {largest} bytes")
    head = 4 * count
    if len(data) < head:
        raise error(f"{where} holds {len(data)} bytes, too few for {count} path lengths")
    lengths = np.frombuffer(data, dtype="<u4", count=count).astype(np.int64)
    ends = np.cumsum(lengths) + head
    if count and int(ends[-1]) != len(data):
        raise error(
            f"{where}: its path lengths add up to {int(ends[-1]) - head} bytes, "
            f"it holds {len(data) - head}"
        )
    out: list[str] = []
    start = head
    for k, end in enumerate(ends.tolist()):
        try:
            out.append(data[start:end].decode("utf-8"))
        except UnicodeDecodeError:
            raise error(
                f"shard #{block * PATH_BLOCK + k}: path {data[start:end]!r} is not UTF-8"
            ) from None
        start = end
    return out
