"""A manifest's id, computed in pieces: its canonical JSON body streamed through blake3.

The id of a manifest is ``b3:`` + blake3 of the canonical JSON (`detdata.base.canonical`) of
its body ``{"format_version", "kind", "metadata", "shards"}``. Keys are sorted, so the body's
bytes are: everything up to ``"shards":[``, the canonical entries joined by ``,``, then
``]}``. `streamed_id` hashes exactly those bytes, a piece of entries at a time, so the peak
memory is one piece's, whatever the number of shards (a 1M-shard body is ~300 MB of JSON).
It is the only definition of the id: `Manifest.id` and the fast form's full check
(`detdata.identity.columns_tie.verify_columns_id`) both use it.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any, Final

import blake3

from detdata.base.canonical import canonical_json
from detdata.base.hashing import PREFIX
from detdata.identity.entry import FORMAT_VERSION, KIND, ShardEntry

#: entries serialised at once (bounds the memory of an id: ~1 MB of JSON a piece, a few MB
#: with the entries and their dicts)
PIECE: Final = 1 << 12
_EMPTY_END: Final = b'"shards":[]}'


def body_ends(metadata: Mapping[str, Any]) -> tuple[bytes, bytes]:
    """The canonical body's bytes before its first shard entry and after its last."""
    empty = canonical_json(
        {"kind": KIND, "format_version": FORMAT_VERSION, "shards": [], "metadata": dict(metadata)}
    )
    if not empty.endswith(_EMPTY_END):  # "shards" sorts after the other keys: always true
        raise AssertionError(f"unexpected canonical body layout {empty[-40:]!r}")
    return empty[:-2], b"]}"


def streamed_id(metadata: Mapping[str, Any], pieces: Iterable[Sequence[Mapping[str, Any]]]) -> str:
    """The id of the manifest with ``metadata`` whose entries (as `ShardEntry.to_json` gives
    them, in canonical order) come in ``pieces``: equal to blake3 of the whole canonical
    body, computed with one piece in memory at a time."""
    head, tail = body_ends(metadata)
    hasher = blake3.blake3(head)
    first = True
    for piece in pieces:
        if not piece:
            continue
        joined = canonical_json(list(piece))  # b"[e1,e2,...]": the entries joined by ","
        if not first:
            hasher.update(b",")
        hasher.update(memoryview(joined)[1:-1])
        first = False
    hasher.update(tail)
    return PREFIX + hasher.hexdigest()


def manifest_id(metadata: Mapping[str, Any], shards: Sequence[ShardEntry]) -> str:
    """The id of a manifest with ``metadata`` and ``shards`` (in canonical order)."""
    pieces = ([s.to_json() for s in shards[lo : lo + PIECE]] for lo in range(0, len(shards), PIECE))
    return streamed_id(metadata, pieces)
