"""Length-prefixed framing of one sample (column name -> value), the bytes its digests hash.

One home for the sample framing shared by ``split-content-v1`` (`detdata.datasets.split`)
and ``sample-v1`` (`detdata.loading.provenance`): a domain tag, then per column in sorted
name order ``framed(name_utf8, value_bytes(value))``, all of it framed once more. Each
field is prefixed by its length (u64le), so no two different samples give the same bytes.

The per-column encoding ``value_bytes`` is the caller's: the two algorithms differ there by
their pinned definitions (``split-content-v1`` keeps a 0-d array's shape ``()`` and keys
Python numbers; ``sample-v1`` frames a scalar as shape ``(1,)`` and refuses numbers).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any


def framed(*fields: bytes) -> bytes:
    """Each field prefixed by its length as u64le, concatenated."""
    return b"".join(len(f).to_bytes(8, "little") + f for f in fields)


def framed_sample(
    tag: bytes, sample: Mapping[str, Any], value_bytes: Callable[[Any], bytes]
) -> bytes:
    """``framed(tag, framed(name, value_bytes(value)) for each column in sorted name order)``."""
    parts = [tag]
    for name in sorted(sample):
        parts.append(framed(name.encode("utf-8"), value_bytes(sample[name])))
    return framed(*parts)
