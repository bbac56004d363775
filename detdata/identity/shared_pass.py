"""A slice's whole pass at a shared first start (docs/design.md, "Verification once per job").

At a first start (every shard is read) each rank taking a slice
(`detdata.identity.shared.take_slices`) does, in one pass over its entries: its part of
the fast form's tie (`columns_tie.tie_part`), the receipt's identities of its files
(taken before their bytes are read) and the check of its shards. The claimant gathers
the parts through the store and settles the verdict (`settle`): the tie first, then the
first shard failure in path order; else the identities for the receipt.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, Final

import numpy as np
import numpy.typing as npt

from detdata.base.errors import VerificationError
from detdata.identity import shared
from detdata.identity.columns import ShardTable
from detdata.identity.columns_tie import check_tie_parts, tie_part
from detdata.identity.entry import ShardEntry, ShardList
from detdata.identity.local_ids import FIELDS, LocalIds, checked_paths, local_identities

#: the extras a taker publishes per slice: its tie part, its files' identities
TIE: Final = "tie"
IDS: Final = "ids"

Check = Callable[[Sequence[ShardEntry]], VerificationError | None]


def entries_at(manifest: ShardList, picked: npt.NDArray[np.int64]) -> tuple[ShardEntry, ...]:
    """The entries of shards ``picked`` (ascending): a fast form's decoded in bulk from the
    range they span when they are dense in it, else one by one (none kept cached)."""
    shards = manifest.shards
    index = picked.tolist()
    if not isinstance(shards, ShardTable):
        return tuple(shards[i] for i in index)
    lo, hi = index[0], index[-1] + 1
    if len(index) * 8 > hi - lo:
        span = shards.entries_between(lo, hi)
        return tuple(span[i - lo] for i in index)
    return tuple(shards.entries_between(i, i + 1)[0] for i in index)


def slice_check(
    manifest: ShardList, plan: shared.SlicePlan, root: str, check: Check
) -> shared.SliceCheck:
    """What a taker does with a slice of ``plan`` (`detdata.identity.shared.SliceCheck`):
    its tie part (even once stopped: the tie's verdict comes first), then, unless stopped,
    the identities of its files under ``root`` and ``check`` of its entries."""

    def one(at: npt.NDArray[np.int64], stopped: bool) -> tuple[Exception | None, shared.Extras]:
        if stopped and not plan.tie:
            return None, {}
        entries = entries_at(manifest, at)
        extras: shared.Extras = {}
        if plan.tie:
            extras[TIE] = tie_part(entries)
        if stopped:
            return None, extras
        if plan.ids:
            # a fast form's paths checked first where its tie is not checked yet
            paths = checked_paths(manifest.shards, int(at[0]), int(at[-1]) + 1, not plan.tie)
            extras[IDS] = local_identities(root, paths).astype("<i8").tobytes()
        try:
            return check(entries), extras
        except Exception as exc:  # an I/O error, say: the slice's verdict, its tie part kept
            return exc, extras

    return one


def settle(store: Any, key: str, plan: shared.SlicePlan, manifest: ShardList) -> LocalIds | None:
    """The claimant's verdict once every slice of ``plan`` is done: the tie's error, then the
    first failure in path order; else the identities gathered (None: not an ``ids`` plan)."""
    found = shared.first_failure(store, key, plan)
    if plan.tie:
        parts = shared.gathered(store, key, plan, TIE)
        if parts is not None:  # else a slice failed before its part: that failure is the verdict
            assert isinstance(manifest.shards, ShardTable)
            check_tie_parts(manifest.shards, parts)
    if found is not None:
        raise found
    if not plan.ids:
        return None
    rows = shared.gathered(store, key, plan, IDS)
    assert rows is not None  # every slice passed, so every taker published its rows
    return np.frombuffer(b"".join(rows), dtype="<i8").astype(np.int64).reshape(-1, FIELDS)
