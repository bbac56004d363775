"""A manifest's id, computed in pieces: its canonical JSON body streamed through blake3.

The id is ``b3:`` + blake3 of the canonical JSON of the body ``{"format_version", "kind",
"metadata", "shards"}``. Keys are sorted, so its bytes are everything up to
``"shards":[``, the canonical entries joined by ``,``, then ``]}``: `manifest_id` hashes
those a piece of entries at a time (bounded memory). It is the only definition of the id.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, Final

import blake3

from detdata.base.canonical import canonical_json
from detdata.base.hashing import PREFIX
from detdata.identity.entry import FORMAT_VERSION, KIND, ShardEntry

#: entries serialised at once (~1 MB of JSON a piece)
PIECE: Final = 1 << 12


def body_ends(metadata: Mapping[str, Any]) -> tuple[bytes, bytes]:
    """The canonical body's bytes before its first shard entry and after its last."""
    empty = canonical_json(
        {"kind": KIND, "format_version": FORMAT_VERSION, "shards": [], "metadata": dict(metadata)}
    )
    return empty[:-2], b"]}"  # "shards" sorts after the other keys: ``..."shards":[]}``


def manifest_id(metadata: Mapping[str, Any], shards: Sequence[ShardEntry]) -> str:
    """The id of a manifest with ``metadata`` and ``shards`` (in canonical order)."""
    head, tail = body_ends(metadata)
    hasher = blake3.blake3(head)
    for lo in range(0, len(shards), PIECE):
        joined = canonical_json([s.to_json() for s in shards[lo : lo + PIECE]])  # b"[e1,...]"
        if lo:
            hasher.update(b",")
        hasher.update(memoryview(joined)[1:-1])
    hasher.update(tail)
    return PREFIX + hasher.hexdigest()
