"""Stable group-by of integer keys: the one way readers group ids by shard or row group."""

from __future__ import annotations

import itertools
from typing import NamedTuple

from detdata.base.types import IntArray


class Groups(NamedTuple):
    """``keys[order] == sorted_keys``; ``spans``: ``(key, a, b)`` per run ``sorted_keys[a:b]``."""

    order: IntArray
    sorted_keys: IntArray
    spans: list[tuple[int, int, int]]


def runs(sorted_keys: IntArray) -> list[tuple[int, int, int]]:
    """``(key, a, b)`` for each run of equal values ``sorted_keys[a:b]``, in order.

    ``sorted_keys`` is 1-D with equal values adjacent (sorted); empty gives ``[]``.
    """
    if not sorted_keys.size:
        return []
    cuts = ((sorted_keys[1:] != sorted_keys[:-1]).nonzero()[0] + 1).tolist()
    return [
        (int(sorted_keys[a]), a, b)
        for a, b in itertools.pairwise([0, *cuts, int(sorted_keys.size)])
    ]


def stable_groups(keys: IntArray) -> Groups:
    """Group positions of ``keys`` by value: stable argsort, then `runs` of the sorted keys."""
    order = keys.argsort(kind="stable")
    sorted_keys = keys[order]
    return Groups(order, sorted_keys, runs(sorted_keys))
