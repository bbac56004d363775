"""The full tie of a fast-form manifest to its id, checked once per job (DESIGN.md 8).

`detdata.identity.columns` checks each chunk of the columns against its digest when used;
that catches damage, not a file whose chunks were re-digested after an edit. What proves
the columns are the manifest the id names is re-computing the id from every entry
(`verify_columns_id`) and, where the JSON is at hand, hashing it against the digest the
columns recorded (`check_columns`): O(shards), run by the job's verifier
(`detdata.identity.receipts`), its result recorded in the receipt.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterator
from typing import Any

from detdata.identity.columns import ShardTable
from detdata.identity.entry import ShardEntry
from detdata.identity.manifest_id import PIECE, streamed_id
from detdata.storage.digest import full_digest_path


def check_columns(table: ShardTable, *, with_json: bool = True) -> None:
    """The full tie, O(shards) (the job's verifier runs it once): the JSON file the
    columns were loaded for (``table.json_path``) hashes to the header's ``json_digest``,
    and the id re-computed from every entry of the columns is the header's; else
    `ManifestError`."""
    c, json_path = table.columns, table.json_path
    if json_path is not None and with_json:
        found = full_digest_path(json_path)  # read in pieces: bounded memory
        if found != c.header["json_digest"]:
            raise c._error(
                f"the manifest JSON {json_path} hashes to {found}, the columns were saved "
                f"with {c.header['json_digest']} (the JSON was edited or torn)"
            )
    verify_columns_id(table)


def verify_columns_id(
    table: ShardTable, *, each: Callable[[int, list[ShardEntry]], None] | None = None
) -> str:
    """The id re-computed from every entry of the columns (O(shards) time, one piece of
    `PIECE` entries in memory at a time: `detdata.identity.manifest_id.streamed_id`);
    `ManifestError` unless it is the header's, the shards are in canonical order and the
    header's sample and byte totals are the entries' sums. ``each(lo, entries)`` is called
    with every piece (shards ``lo, lo + 1, ...``) as it is decoded, before the verdict:
    what it derives from them holds only once this returns."""
    c = table.columns
    totals = [0, 0]  # samples, bytes
    last: list[str] = []

    def pieces() -> Iterator[list[dict[str, Any]]]:
        for lo in range(0, len(table), PIECE):
            entries = table.entries_between(lo, min(len(table), lo + PIECE))
            paths = last + [e.path for e in entries]
            if any(a >= b for a, b in itertools.pairwise(paths)):
                raise c._error("shards are not in canonical order (sorted, unique paths)")
            last[:] = paths[-1:]
            if each is not None:
                each(lo, entries)
            totals[0] += sum(e.num_samples for e in entries)
            totals[1] += sum(e.bytes for e in entries)
            yield [e.to_json() for e in entries]

    found = streamed_id(c.header["metadata"], pieces())
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
