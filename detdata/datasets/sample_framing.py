"""Length-prefixed framing of one sample (column name -> value), the bytes its digests hash:
shared by ``split-content-v1`` (`detdata.datasets.split`) and ``sample-v1``
(`detdata.loading.provenance`), each with its own pinned per-column ``value_bytes``. Each
field is prefixed by its length (u64le), so no two different samples give the same bytes.
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
    parts = (framed(name.encode("utf-8"), value_bytes(sample[name])) for name in sorted(sample))
    return framed(tag, *parts)
