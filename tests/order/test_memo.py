"""ChunkMemo is a cache, never a different algorithm: memoised == direct, for any request."""

from __future__ import annotations

import pickle

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

import detdata
from detdata.order.memo import ChunkMemo


def _mixture() -> detdata.Mixture:
    return detdata.Mixture(
        {
            "a": detdata.ArrayDataset({"x": np.arange(5000)}),
            "b": detdata.ArrayDataset({"x": np.arange(70) + 10**6}),
        },
        {"a": "0.7", "b": "0.3"},
        seed=9,
    )


@pytest.mark.slow
@given(start=st.integers(0, 2**50), width=st.integers(0, 20_000), stride=st.integers(1, 64))
def test_ordered_stream_memo_equals_direct(start: int, width: int, stride: int) -> None:
    stream = detdata.OrderedStream(detdata.ArrayDataset({"x": np.arange(1234)}), 5)
    positions = np.arange(start, start + width, stride, dtype=np.int64)
    for _ in range(2):  # second pass answers from the cache
        assert np.array_equal(stream.sample_ids(positions), stream.order.ids(positions))


@given(start=st.integers(0, 2**40), width=st.integers(1, 10_000), seed=st.integers(0, 3))
def test_mixture_fetch_equals_locate(start: int, width: int, seed: int) -> None:
    mix = _mixture()
    positions = np.random.default_rng(seed).permutation(np.arange(start, start + width))[
        : min(width, 97)
    ]
    src, _, ids = mix.locate(positions)
    expected = np.where(src == 0, ids, ids + 10**6)
    assert np.array_equal(mix.fetch(positions)["x"], expected)


calls: list[int] = []


def _double(p: np.ndarray) -> tuple[np.ndarray]:
    calls.append(len(p))
    return (p * 2,)


def test_cache_is_bounded_and_not_pickled() -> None:
    calls.clear()
    memo = ChunkMemo(_double, chunk=100, slots=2)
    for start in range(0, 1000, 10):
        assert np.array_equal(
            memo(np.arange(start, start + 10))[0], np.arange(start, start + 10) * 2
        )
    assert calls == [100] * 10  # each chunk computed once
    assert len(memo._cache) == 2
    assert np.array_equal(
        memo(np.array([5, 950]))[0], np.array([10, 1900])
    )  # spans > slots: direct
    assert calls[-1] == 2
    clone = pickle.loads(pickle.dumps(memo))
    assert len(clone._cache) == 0
