"""blake3 digests: the ``b3:<hex>`` format, digests of bytes and the quick digest (pure
functions of bytes; stored files and streams: `detdata.storage.digest`).
"""

from __future__ import annotations

import struct
from typing import Final, TypeGuard

import blake3

CHUNK: Final = 8 << 20
QUICK_SPAN: Final = 1 << 20
PREFIX: Final = "b3:"
_HEX: Final = frozenset("0123456789abcdef")


def digest_bytes(data: bytes | bytearray | memoryview) -> str:
    """``b3:<hex>`` of a bytes object."""
    return PREFIX + blake3.blake3(data).hexdigest()


def is_digest(value: object) -> TypeGuard[str]:
    """Whether ``value`` is a digest string: ``b3:`` then 64 lowercase hex digits."""
    return (
        isinstance(value, str)
        and len(value) == len(PREFIX) + 64
        and value.startswith(PREFIX)
        and _HEX.issuperset(value[len(PREFIX) :])
    )


def quick_digest_parts(size: int, head: bytes, tail: bytes) -> str:
    """Quick digest (``quick-v1``): blake3 of a domain tag, ``u64le(size)``, first and last MiB."""
    hasher = blake3.blake3(b"detdata:quick-v1" + struct.pack("<Q", size))
    hasher.update(head)
    hasher.update(tail)
    return PREFIX + hasher.hexdigest()
