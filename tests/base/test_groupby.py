"""Stable group-by (`detdata.base.groupby`) against a brute-force grouping: each run holds one
key, runs come in key order, and inside a run the positions keep their input order."""

from __future__ import annotations

import numpy as np
from hypothesis import given
from hypothesis import strategies as st

from detdata.base.groupby import runs, stable_groups


def brute_force(keys: list[int]) -> list[tuple[int, list[int]]]:
    """(key, positions of that key in input order) for each distinct key, keys ascending."""
    return [(k, [i for i, x in enumerate(keys) if x == k]) for k in sorted(set(keys))]


@given(st.lists(st.integers(-5, 5), max_size=60))
def test_groups_are_the_brute_force_grouping(keys: list[int]) -> None:
    arr = np.asarray(keys, dtype=np.int64)
    groups = stable_groups(arr)
    assert groups.sorted_keys.tolist() == sorted(keys)
    assert (arr[groups.order] == groups.sorted_keys).all()
    got = [(k, groups.order[a:b].tolist()) for k, a, b in groups.spans]
    assert got == brute_force(keys)
    assert all(type(k) is int and type(a) is int for k, a, _ in groups.spans)


def test_runs_cut_sorted_keys_at_each_change() -> None:
    assert runs(np.zeros(0, dtype=np.int64)) == []
    assert runs(np.array([7])) == [(7, 0, 1)]
    assert runs(np.array([1, 1, 2, 5, 5, 5])) == [(1, 0, 2), (2, 2, 3), (5, 3, 6)]
