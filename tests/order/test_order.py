"""GlobalOrder / feistel-v1: bijection, golden vectors, an independent reference, statistics.

Covers: detdata/order/positions.py.
"""

from __future__ import annotations

import json
import math
import struct
import tracemalloc
from pathlib import Path
from typing import Any

import blake3
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from detdata.base.errors import ConfigError
from detdata.order.feistel import (
    ALGORITHM,
    MAX_SAMPLES,
    ROUNDS,
    GlobalOrder,
    _key_table,
    permute,
    permute_epochs,
)

GOLDEN = Path(__file__).resolve().parents[1] / "golden" / "order_feistel_v1.json"
M64 = (1 << 64) - 1
MAX_N = MAX_SAMPLES - 1
MAX_POS = (1 << 63) - 1


# --------------------------------------------------------------------------
# Independent pure-Python reference, written from the module docstring spec.
# --------------------------------------------------------------------------
def ref_keys(seed: int, epoch: int) -> list[int]:
    material = blake3.blake3(b"detdata:feistel-v1" + struct.pack("<QQ", seed, epoch)).digest(
        length=8 * 8
    )
    return [int.from_bytes(material[8 * r : 8 * r + 8], "little") for r in range(8)]


def ref_f(key: int, value: int) -> int:
    z = (value ^ key) & M64
    z ^= z >> 30
    z = (z * 0xBF58476D1CE4E5B9) & M64
    z ^= z >> 27
    z = (z * 0x94D049BB133111EB) & M64
    z ^= z >> 31
    return z


def ref_encrypt(x: int, keys: list[int], bits: int) -> int:
    lo_bits = bits // 2
    hi_bits = bits - lo_bits
    lo_mask, hi_mask = (1 << lo_bits) - 1, (1 << hi_bits) - 1
    lo, hi = x & lo_mask, x >> lo_bits
    for r, key in enumerate(keys):
        if r % 2 == 0:
            hi ^= ref_f(key, lo) & hi_mask
        else:
            lo ^= ref_f(key, hi) & lo_mask
    return (hi << lo_bits) | lo


def ref_id(n: int, seed: int, g: int) -> int:
    """Sample id at global position ``g`` (feistel-v1, straight from the spec)."""
    epoch, i = divmod(g, n)
    if n == 1:
        return 0
    keys = ref_keys(seed, epoch)
    bits = max(2, (n - 1).bit_length())
    y = ref_encrypt(i, keys, bits)
    while y >= n:
        y = ref_encrypt(y, keys, bits)
    return y


def golden() -> dict[str, Any]:
    doc: dict[str, Any] = json.loads(GOLDEN.read_text())
    return doc


# --------------------------------------------------------------------------
# Golden vectors
# --------------------------------------------------------------------------
def test_golden_file_header() -> None:
    doc = golden()
    assert doc["algorithm"] == ALGORITHM == "feistel-v1"
    assert doc["rounds"] == ROUNDS == 8
    assert len(doc["cases"]) >= 10


@pytest.mark.parametrize("case", golden()["cases"], ids=lambda c: f"n={c['n']}-seed={c['seed']}")
def test_golden_vectors_numpy(case: dict[str, Any]) -> None:
    order = GlobalOrder(case["n"], case["seed"])
    got = order.ids(np.array(case["positions"], dtype=np.int64))
    np.testing.assert_array_equal(got, np.array(case["ids"], dtype=np.int64))


@pytest.mark.parametrize("case", golden()["cases"], ids=lambda c: f"n={c['n']}-seed={c['seed']}")
def test_golden_vectors_reference(case: dict[str, Any]) -> None:
    assert [ref_id(case["n"], case["seed"], g) for g in case["positions"]] == case["ids"]


def test_golden_scalar_access_matches() -> None:
    for case in golden()["cases"][:6]:
        order = GlobalOrder(case["n"], case["seed"])
        assert [order[g] for g in case["positions"]] == case["ids"]


def round_keys(seed: int, epoch: int) -> list[int]:
    """The round keys the order uses for ``(seed, epoch)``."""
    return _key_table(seed, np.array([epoch], dtype=np.uint64))[:, 0].tolist()


def test_reference_round_keys_match() -> None:
    for seed, epoch in [(0, 0), (1, 0), (0, 1), (M64, 12345)]:
        assert round_keys(seed, epoch) == ref_keys(seed, epoch)


# --------------------------------------------------------------------------
# Bijection
# --------------------------------------------------------------------------
def _sizes() -> list[int]:
    primes = [5, 7, 11, 13, 97, 101, 997, 7919, 65521, 104729]
    powers = [1 << k for k in range(1, 18)]
    near = [p + d for p in powers for d in (-1, 1) if p + d >= 1]
    return sorted({1, 2, 3, *primes, *powers, *near})


@pytest.mark.parametrize("n", _sizes())
def test_each_epoch_is_a_permutation(n: int) -> None:
    for seed in (0, 987654321):
        order = GlobalOrder(n, seed)
        for epoch in (0, 3):
            ids = order.ids(np.arange(epoch * n, (epoch + 1) * n, dtype=np.int64))
            np.testing.assert_array_equal(np.sort(ids), np.arange(n))


@pytest.mark.slow
def test_full_bijection_ten_million() -> None:
    """Every id in [0, 10**7) appears exactly once; checked in 1M chunks (10 MB bitmap).

    n positions map into [0, n) and every slot of the bitmap ends up set, so by
    pigeonhole no id repeats (within or across chunks).
    """
    n = 10**7
    order = GlobalOrder(n, 20240601)
    seen = np.zeros(n, dtype=bool)
    chunk = 1_000_000
    for start in range(0, n, chunk):
        ids = order.ids(np.arange(start, start + chunk, dtype=np.int64))
        assert ids.min() >= 0 and ids.max() < n
        assert not seen[ids].any(), f"id repeated from an earlier chunk (chunk at {start})"
        seen[ids] = True
    assert seen.all()


def test_order_is_not_identity_or_rotation() -> None:
    ids = GlobalOrder(1000, 1).ids(np.arange(1000))
    assert np.count_nonzero(ids == np.arange(1000)) < 20
    assert np.unique(np.diff(ids) % 1000).size > 100


# --------------------------------------------------------------------------
# Keying: seed s / epoch 1 vs seed s+1 / epoch 0
# --------------------------------------------------------------------------
@pytest.mark.parametrize("seed", [0, 1, 41, 2**32, 2**64 - 2])
def test_seed_and_epoch_are_not_interchangeable(seed: int) -> None:
    n = 100_000
    epoch1 = GlobalOrder(n, seed).ids(np.arange(n, 2 * n))
    next_seed = GlobalOrder(n, seed + 1).ids(np.arange(n))
    # Two unrelated permutations agree at ~1 position on average (Poisson(1)).
    assert np.count_nonzero(epoch1 == next_seed) < 12
    assert round_keys(seed, 1) != round_keys(seed + 1, 0)


def test_epochs_and_seeds_differ() -> None:
    n = 50_000
    base = GlobalOrder(n, 7).ids(np.arange(n))
    assert np.count_nonzero(base == GlobalOrder(n, 7).ids(np.arange(n, 2 * n))) < 12
    assert np.count_nonzero(base == GlobalOrder(n, 8).ids(np.arange(n))) < 12
    np.testing.assert_array_equal(base, GlobalOrder(n, 7).ids(np.arange(n)))


# --------------------------------------------------------------------------
# Property tests
# --------------------------------------------------------------------------
ns = st.integers(min_value=1, max_value=MAX_N)
seeds = st.integers(min_value=0, max_value=M64)


@settings(max_examples=150, deadline=None)
@given(n=ns, seed=seeds, positions=st.lists(st.integers(0, MAX_POS), min_size=1, max_size=6))
def test_numpy_matches_reference(n: int, seed: int, positions: list[int]) -> None:
    got = GlobalOrder(n, seed).ids(np.array(positions, dtype=np.int64))
    assert got.tolist() == [ref_id(n, seed, g) for g in positions]


@settings(max_examples=60, deadline=None)
@given(n=st.integers(1, 5000), seed=seeds, a=st.integers(0, 20000), b=st.integers(0, 20000))
def test_chunking_and_shape_do_not_matter(n: int, seed: int, a: int, b: int) -> None:
    order = GlobalOrder(n, seed)
    lo, hi = min(a, b), max(a, b) + 1
    whole = order.ids(np.arange(lo, hi))
    mid = (lo + hi) // 2
    parts = np.concatenate([order.ids(np.arange(lo, mid)), order.ids(np.arange(mid, hi))])
    np.testing.assert_array_equal(whole, parts)
    reversed_ids = order.ids(np.arange(lo, hi)[::-1])
    np.testing.assert_array_equal(reversed_ids, whole[::-1])
    assert whole.min() >= 0 and whole.max() < n
    assert order[lo] == int(whole[0])
    np.testing.assert_array_equal(order[lo:hi], whole)


@settings(max_examples=40, deadline=None)
@given(n=st.integers(1, 3000), seed=seeds, epoch=st.integers(0, 10**6))
def test_any_epoch_is_a_permutation(n: int, seed: int, epoch: int) -> None:
    ids = GlobalOrder(n, seed).ids(np.arange(epoch * n, (epoch + 1) * n, dtype=np.int64))
    np.testing.assert_array_equal(np.sort(ids), np.arange(n))


def test_multidimensional_positions_keep_shape() -> None:
    order = GlobalOrder(12345, 3)
    pos = np.arange(60).reshape(3, 4, 5) * 1000
    got = order.ids(pos)
    assert got.shape == (3, 4, 5) and got.dtype == np.int64
    np.testing.assert_array_equal(got.reshape(-1), order.ids(pos.reshape(-1)))


# --------------------------------------------------------------------------
# Multi-epoch requests (vectorised over epochs) == one epoch at a time
# --------------------------------------------------------------------------
def scalar_ids(order: GlobalOrder, positions: np.ndarray) -> np.ndarray:
    """One `order[g]` per position: each a single-epoch request (the per-epoch path)."""
    flat = [order[int(g)] for g in positions.reshape(-1)]
    return np.array(flat, dtype=np.int64).reshape(positions.shape)


small_or_any_n = st.one_of(st.integers(1, 4), st.integers(1, 200), ns)


def test_key_table_matches_round_keys() -> None:
    epochs = np.array([0, 1, 7, 7, 2**40, 2**64 - 1], dtype=np.uint64)
    for seed in (0, 5, M64):
        table = _key_table(seed, epochs)
        assert table.shape == (ROUNDS, epochs.size) and table.dtype == np.uint64
        for j, epoch in enumerate(epochs.tolist()):
            assert table[:, j].tolist() == ref_keys(seed, epoch)


@settings(max_examples=150, deadline=None)
@given(
    n=small_or_any_n,
    seed=seeds,
    positions=st.lists(st.integers(0, MAX_POS), min_size=2, max_size=40),
)
def test_multi_epoch_matches_scalar_and_reference(n: int, seed: int, positions: list[int]) -> None:
    pos = np.array(positions, dtype=np.int64)
    got = GlobalOrder(n, seed).ids(pos)
    np.testing.assert_array_equal(got, scalar_ids(GlobalOrder(n, seed), pos))
    assert got.tolist() == [ref_id(n, seed, g) for g in positions]


@settings(max_examples=60, deadline=None)
@given(
    n=st.integers(1, 8),
    seed=seeds,
    offsets=st.lists(st.integers(0, 10**6), min_size=2, max_size=30),
)
def test_tiny_n_huge_positions(n: int, seed: int, offsets: list[int]) -> None:
    positions = [MAX_POS - d for d in offsets] + offsets
    got = GlobalOrder(n, seed).ids(np.array(positions, dtype=np.int64))
    assert got.tolist() == [ref_id(n, seed, g) for g in positions]


@settings(max_examples=40, deadline=None)
@given(
    n=st.integers(1, 3000),
    seed=seeds,
    first=st.integers(0, 10**9),
    epochs=st.integers(1, 12),
    perm_seed=st.integers(0, 2**32 - 1),
)
def test_shuffled_full_epochs_are_permutations(
    n: int, seed: int, first: int, epochs: int, perm_seed: int
) -> None:
    """Whole epochs requested in shuffled order (cycle walking on mixed keys): each epoch
    is a permutation and equals its single-epoch request."""
    order = GlobalOrder(n, seed)
    pos = np.arange(first * n, (first + epochs) * n, dtype=np.int64)
    shuffled = np.random.default_rng(perm_seed).permutation(pos)
    got = np.empty_like(pos)
    got[shuffled - pos[0]] = order.ids(shuffled)
    per_epoch = got.reshape(epochs, n)
    for e in range(epochs):
        start = (first + e) * n
        np.testing.assert_array_equal(per_epoch[e], order.ids(np.arange(start, start + n)))
        np.testing.assert_array_equal(np.sort(per_epoch[e]), np.arange(n))


@settings(max_examples=60, deadline=None)
@given(
    n=small_or_any_n,
    seed=seeds,
    pos=hnp.arrays(
        np.int64,
        hnp.array_shapes(min_dims=0, max_dims=4, min_side=0, max_side=4),
        elements=st.integers(0, MAX_POS),
    ),
)
def test_multi_epoch_any_shape(n: int, seed: int, pos: np.ndarray) -> None:
    order = GlobalOrder(n, seed)
    got = order.ids(pos)
    assert got.shape == pos.shape and got.dtype == np.int64
    np.testing.assert_array_equal(got, scalar_ids(order, pos))
    np.testing.assert_array_equal(got.reshape(-1), order.ids(pos.reshape(-1)))


@pytest.mark.parametrize("n", [1, 2, 3, 70, 1000, 10**6])
def test_mixed_single_and_multi_epoch_chunks(n: int) -> None:
    """Arrays longer than one vectorised pass: single-epoch passes (fast path) next to
    multi-epoch passes give the same ids as separate requests."""
    order = GlobalOrder(n, 99)
    rng = np.random.default_rng(n)
    same_epoch = np.full(70_000, 5 * n, dtype=np.int64) + rng.integers(0, n, 70_000)
    spread = rng.integers(0, 10**12, 300)
    pos = np.concatenate([same_epoch, spread, same_epoch[:10], spread[::-1]])
    got = order.ids(pos)
    np.testing.assert_array_equal(got[:70_000], order.ids(same_epoch))
    np.testing.assert_array_equal(got[70_000:70_300], scalar_ids(order, spread))
    np.testing.assert_array_equal(got[70_300:70_310], got[:10])
    np.testing.assert_array_equal(got[70_310:], got[70_000:70_300][::-1])


@settings(max_examples=60, deadline=None)
@given(
    n=st.integers(1, 5000),
    seed=seeds,
    items=st.lists(
        st.tuples(st.integers(0, 4999), st.integers(0, 2**64 - 1)), min_size=1, max_size=50
    ),
)
def test_permute_epochs_matches_permute(n: int, seed: int, items: list[tuple[int, int]]) -> None:
    local = np.array([i % n for i, _ in items], dtype=np.uint64)
    epochs = np.array([e for _, e in items], dtype=np.uint64)
    before = local.copy(), epochs.copy()
    got = permute_epochs(local, epochs, n, seed)
    want = [int(permute(local[j : j + 1], n, seed, int(epochs[j]))[0]) for j in range(local.size)]
    assert got.tolist() == want
    np.testing.assert_array_equal(local, before[0])
    np.testing.assert_array_equal(epochs, before[1])


# --------------------------------------------------------------------------
# Statistics
# --------------------------------------------------------------------------
def chi2_threshold(df: int, z: float = 4.753) -> float:
    """Wilson-Hilferty upper quantile of chi-square(df); z = 4.753 is p = 1e-6 one-sided."""
    c = 2.0 / (9.0 * df)
    return df * (1.0 - c + z * math.sqrt(c)) ** 3


def position_id_chi2(perms: np.ndarray) -> tuple[float, int]:
    """Chi-square of the (position, id) contingency table over many permutations (rows)."""
    num, n = perms.shape
    counts = np.zeros((n, n), dtype=np.int64)
    np.add.at(counts, (np.tile(np.arange(n), num), perms.reshape(-1)), 1)
    expected = num / n
    stat = float(((counts - expected) ** 2).sum() / expected)
    return stat, (n - 1) ** 2


@pytest.mark.parametrize("n", [16, 100])
def test_position_vs_id_uniform_over_seeds(n: int) -> None:
    """Over 2000 seeds, every id is equally likely at every position.

    Threshold: the p = 1e-6 quantile of chi-square with (n-1)^2 degrees of
    freedom (Wilson-Hilferty). The seeds are fixed, so the test is
    deterministic; a uniform shuffle would fail it with probability 1e-6.
    """
    perms = np.stack([GlobalOrder(n, seed).ids(np.arange(n)) for seed in range(2000)])
    stat, df = position_id_chi2(perms)
    assert stat < chi2_threshold(df), (stat, df, chi2_threshold(df))


def test_chi2_statistic_rejects_a_biased_order() -> None:
    """Control: the same statistic flags a shuffle where position 0 keeps id 0 half the time."""
    n, num = 100, 2000
    rng = np.random.default_rng(0)
    perms = np.stack([rng.permutation(n) for _ in range(num)])
    fair, df = position_id_chi2(perms)
    assert fair < chi2_threshold(df)
    for row in perms[::2]:
        j = int(np.flatnonzero(row == 0)[0])
        row[0], row[j] = row[j], row[0]
    biased, _ = position_id_chi2(perms)
    assert biased > chi2_threshold(df)


# --------------------------------------------------------------------------
# Memory and errors
# --------------------------------------------------------------------------
def test_no_per_sample_memory_at_huge_n() -> None:
    order = GlobalOrder(MAX_N, 5)
    positions = np.arange(10_000, dtype=np.int64) + (MAX_N - 5000)
    tracemalloc.start()
    try:
        order.ids(positions)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 2_000_000, f"peak {peak} bytes for 10k positions"


@pytest.mark.parametrize(
    ("n", "seed"),
    [(0, 1), (-1, 1), (MAX_SAMPLES, 1), (10, -1), (10, 1 << 64), (10, 1.5), (True, 1), (10, "1")],
)
def test_bad_arguments_raise_config_error(n: Any, seed: Any) -> None:
    with pytest.raises(ConfigError):
        GlobalOrder(n, seed)


def test_bad_positions_raise_config_error() -> None:
    order = GlobalOrder(10, 1)
    with pytest.raises(ConfigError, match=">= 0"):
        order.ids(np.array([3, -1]))
    with pytest.raises(ConfigError, match="integers"):
        order.ids(np.array([1.0]))
    with pytest.raises(ConfigError, match="stop"):
        order[5:]
    with pytest.raises(ConfigError):
        order[-1]


def test_ids_leave_inputs_alone_and_return_fresh_int64() -> None:
    order = GlobalOrder(1000, 5)  # 1000 < 2**10: cycle walking happens
    for dtype in (np.int64, np.uint64, np.int32):
        pos = np.arange(0, 3000, 7).astype(dtype)
        before = pos.copy()
        a, b = order.ids(pos), order.ids(pos)
        np.testing.assert_array_equal(pos, before)
        assert a.dtype == np.int64 and a.flags.writeable and not np.shares_memory(a, b)
        np.testing.assert_array_equal(a, [order[int(g)] for g in before])
    assert order.ids(np.int64(7)).shape == () and int(order.ids(np.int64(7))) == order[7]
