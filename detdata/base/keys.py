"""Key derivation: the one primitive every seed, round key and sample key comes from.

``derive`` is blake3's XOF over a domain tag, the words as u64le, then ``tail``: seeds are
derived by hashing, never by arithmetic, so ``(seed s, epoch 1)`` is unrelated to ``(seed
s + 1, epoch 0)``. The byte layouts are pinned by the golden vectors.
"""

from __future__ import annotations

import struct
from collections.abc import Sequence

import blake3


def derive(tag: bytes, *words: int, tail: bytes = b"", length: int = 8) -> bytes:
    """``length`` bytes of blake3(tag || u64le(words...) || tail)."""
    return blake3.blake3(tag + struct.pack(f"<{len(words)}Q", *words) + tail).digest(length=length)


def derive_many(tag: bytes, *words: int, last: Sequence[int], length: int = 8) -> bytes:
    """``derive(tag, *words, x, length=length)`` for each ``x`` of ``last``, concatenated:
    the same bytes, without re-packing the common prefix for each (one hash per ``x``)."""
    head = blake3.blake3(tag + struct.pack(f"<{len(words)}Q", *words))
    return b"".join(
        [head.copy().update(x.to_bytes(8, "little")).digest(length=length) for x in last]
    )


def derive_u64(tag: bytes, *words: int, tail: bytes = b"") -> int:
    """The first 8 derived bytes as a little-endian unsigned integer."""
    return int.from_bytes(derive(tag, *words, tail=tail), "little")
