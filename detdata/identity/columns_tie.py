"""The full tie of a fast-form manifest to its id, checked once per job (docs/design.md
section 8: chunk digests catch damage, not a forger): `verify_columns_id` re-computes the id
from every entry, `check_json` hashes the JSON against the digest the columns recorded.
"""

from __future__ import annotations

import itertools
import json
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any, Final

import blake3

from detdata.base.canonical import canonical_json
from detdata.base.errors import ManifestError
from detdata.base.hashing import PREFIX
from detdata.identity.columns import ShardTable
from detdata.identity.entry import ShardEntry
from detdata.identity.manifest_id import PIECE, body_ends
from detdata.storage.digest import full_digest_path


def check_json(table: ShardTable) -> None:
    """A `ManifestError` naming the JSON file (``table.json_path``, if any) and the first
    field where it differs from the columns, unless it hashes to the header's
    ``json_digest``."""
    c, json_path = table.columns, table.json_path
    if json_path is None:
        return
    found = full_digest_path(json_path)
    if found == c.header["json_digest"]:
        return
    raise ManifestError(
        f"manifest {json_path}: {_first_difference(table, json_path)}; it is not the JSON "
        f"its fast form {c.path} was saved with (edited or torn since: it hashes to {found}, "
        f"the fast form recorded {c.header['json_digest']}); hint: restore the JSON, or "
        "build the manifest again and save it (which rewrites both)"
    )


def _first_difference(table: ShardTable, json_path: str) -> str:
    """The first field (top level, then shard by shard) where the JSON at ``json_path``
    differs from the columns, in words (only on the way to an error)."""
    try:
        with open(json_path, "rb") as fh:
            doc = json.loads(fh.read())
    except (OSError, ValueError) as exc:
        return f"unreadable as JSON ({exc})"
    if not isinstance(doc, dict) or not isinstance(doc.get("shards"), list):
        return "not a manifest document (no 'shards' list)"
    header = table.columns.header
    for name in ("id", "metadata"):
        if doc.get(name) != header[name]:
            return f"field {name!r} is {doc.get(name)!r}, the fast form has {header[name]!r}"
    listed: list[Any] = doc["shards"]
    for lo in range(0, min(len(listed), len(table)), PIECE):
        entries = table.entries_between(lo, min(len(listed), len(table), lo + PIECE))
        for i, entry in enumerate(entries, start=lo):
            want = entry.to_json()
            got = listed[i] if isinstance(listed[i], dict) else {}
            for name in sorted(set(want) | set(got)):
                if got.get(name) != want.get(name):
                    return (
                        f"shard #{i} ({entry.path}) field {name!r} is {got.get(name)!r}, the "
                        f"fast form (and the id) has {want.get(name)!r}"
                    )
    if len(listed) != len(table):
        return f"field 'shards' lists {len(listed)} shards, the fast form {len(table)}"
    return "its bytes differ (no field does: reformatted?)"


def verify_columns_id(
    table: ShardTable, *, each: Callable[[int, list[ShardEntry]], None] | None = None
) -> str:
    """The id re-computed from every entry of the columns, `PIECE` entries at a time (the
    `tie_part` of each, checked by `check_tie_parts`); `ManifestError` unless it is the
    header's, the shards are in canonical order and the header's totals are the entries'
    sums. ``each(lo, entries)`` sees every piece once its order is checked, before the
    verdict."""

    def parts() -> Iterator[bytes]:
        for lo in range(0, len(table), PIECE):
            entries = table.entries_between(lo, min(len(table), lo + PIECE))
            yield tie_part(entries)
            if each is not None:  # the piece's order was checked when it was taken
                each(lo, entries)

    return check_tie_parts(table, parts())


#: a tie part's head fields: first and last path, in canonical order within, sums
FIRST: Final = "first"
LAST: Final = "last"
ORDERED: Final = "ordered"
SAMPLES: Final = "samples"
BYTES: Final = "bytes"


def tie_part(entries: Sequence[ShardEntry]) -> bytes:
    """What the tie needs of a run of consecutive entries (not empty): a line of canonical
    JSON (first and last path, whether in canonical order, their sums), then the entries
    as the id hashes them (joined by ",")."""
    paths = [e.path for e in entries]
    head = {
        FIRST: paths[0],
        LAST: paths[-1],
        ORDERED: all(a < b for a, b in itertools.pairwise(paths)),
        SAMPLES: sum(e.num_samples for e in entries),
        BYTES: sum(e.bytes for e in entries),
    }
    return canonical_json(head) + b"\n" + canonical_json([e.to_json() for e in entries])[1:-1]


def check_tie_parts(table: ShardTable, parts: Iterable[bytes]) -> str:
    """The id hashed from the `tie_part` of every run of ``table``'s entries, in order,
    without decoding them again; `ManifestError` as `verify_columns_id` says."""
    c = table.columns
    head, tail = body_ends(c.header["metadata"])
    hasher = blake3.blake3(head)
    totals = [0, 0]
    last: str | None = None
    for i, raw in enumerate(parts):
        line, _, body = raw.partition(b"\n")
        doc = json.loads(line)
        if not doc[ORDERED] or (last is not None and last >= doc[FIRST]):
            raise c._error("shards are not in canonical order (sorted, unique paths)")
        last = doc[LAST]
        totals[0] += int(doc[SAMPLES])
        totals[1] += int(doc[BYTES])
        if i:
            hasher.update(b",")
        hasher.update(body)
    hasher.update(tail)
    found = PREFIX + hasher.hexdigest()
    if found != c.header["id"]:
        raise c._error(
            f"its entries hash to {found}, the header says {c.header['id']} (edited or "
            "written by another manifest)"
        )
    claimed = [c.header["num_samples"], c.header["total_bytes"]]
    if totals != claimed:
        raise c._error(
            f"the entries hold {totals[0]} samples in {totals[1]} bytes, the header says "
            f"{claimed[0]} in {claimed[1]}"
        )
    return found
