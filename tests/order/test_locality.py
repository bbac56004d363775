"""locality-v1 (`WindowedOrder`): golden vectors, an independent reference, bijection,
random access, locality, keys, and the loader (identity, resume at every step, elastic).

The reference below is written from the module docstring of ``detdata.order.locality``
in plain Python ints: `ref_epoch` materialises one epoch by listing each window's
members (the samples of its shards, slot by slot) and permuting that list; `ref_id`
follows the steps for one position (for large ``n``). Neither shares code with the
implementation. Regenerate the golden file only for a NEW algorithm version:
``python tests/order/test_locality.py --write-golden`` (refuses to overwrite).
"""

from __future__ import annotations

import json
import pickle
import struct
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import blake3
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from detdata.base.errors import ConfigError
from detdata.order.choice import LocalityOrder, Order, check_order, order_name
from detdata.order.feistel import GlobalOrder, permute_many
from detdata.order.locality import (
    ALGORITHM,
    WindowedOrder,
    _shard_keys,
    _walk_tables,
)

GOLDEN = Path(__file__).resolve().parents[1] / "golden" / "order_locality_v1.json"
M64 = (1 << 64) - 1
HYP = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])


# --------------------------------------------------------------------- reference (docstring)
def ref_keys(tag: bytes, *words: int) -> list[int]:
    material = blake3.blake3(tag + struct.pack(f"<{len(words)}Q", *words)).digest(length=64)
    return [int.from_bytes(material[8 * r : 8 * r + 8], "little") for r in range(8)]


def ref_f(key: int, value: int) -> int:
    z = (value ^ key) & M64
    z ^= z >> 30
    z = (z * 0xBF58476D1CE4E5B9) & M64
    z ^= z >> 27
    z = (z * 0x94D049BB133111EB) & M64
    return z ^ (z >> 31)


def ref_perm(m: int, keys: list[int], x: int) -> int:
    """``P(m, K)(x)``: feistel-v1's network with cycle walking on [0, m)."""
    if m == 1:
        return 0
    bits = max(2, (m - 1).bit_length())
    lo_bits = bits // 2
    lo_mask, hi_mask = (1 << lo_bits) - 1, (1 << (bits - lo_bits)) - 1

    def encrypt(v: int) -> int:
        lo, hi = v & lo_mask, v >> lo_bits
        for r, key in enumerate(keys):
            if r % 2 == 0:
                hi ^= ref_f(key, lo) & hi_mask
            else:
                lo ^= ref_f(key, hi) & lo_mask
        return (hi << lo_bits) | lo

    y = encrypt(x)
    while y >= m:
        y = encrypt(y)
    return y


def ref_sigma(num_shards: int, seed: int, epoch: int) -> list[int]:
    keys = ref_keys(b"detdata:locality-v1:shards", seed, epoch)
    return [ref_perm(num_shards, keys, j) for j in range(num_shards)]


def ref_epoch(sizes: Sequence[int], k: int, seed: int, epoch: int) -> list[int]:
    """Sample id at each position of one epoch: windows listed member by member."""
    starts = [sum(sizes[:s]) for s in range(len(sizes))]
    sigma = ref_sigma(len(sizes), seed, epoch)
    out: list[int] = []
    for w in range(-(-len(sizes) // k)):
        members = [
            starts[s] + r for s in sigma[w * k : w * k + k] for r in range(sizes[s])
        ]  # the window's samples, slot by slot, in sample order inside a shard
        if not members:
            continue
        keys = ref_keys(b"detdata:locality-v1:window", seed, epoch, w)
        out += [members[ref_perm(len(members), keys, t)] for t in range(len(members))]
    return out


def ref_id(sizes: Sequence[int], k: int, seed: int, g: int) -> int:
    """Sample id at global position ``g``, step by step (any ``n``)."""
    n = sum(sizes)
    epoch, i = divmod(g, n)
    sigma = ref_sigma(len(sizes), seed, epoch)
    slot_start = [0]
    for s in sigma:
        slot_start.append(slot_start[-1] + sizes[s])
    w = max(v for v in range(-(-len(sizes) // k)) if slot_start[v * k] <= i)
    lo, hi = slot_start[w * k], slot_start[min(w * k + k, len(sizes))]
    q = lo + ref_perm(hi - lo, ref_keys(b"detdata:locality-v1:window", seed, epoch, w), i - lo)
    j = max(v for v in range(len(sizes)) if slot_start[v] <= q)
    return sum(sizes[: sigma[j]]) + q - slot_start[j]


# --------------------------------------------------------------------- golden vectors
GOLDEN_CASES: list[tuple[list[int], int, int]] = [
    ([5], 1, 0),
    ([1], 3, 7),
    ([3, 0, 4, 1, 0, 6], 2, 1),
    ([10] * 8, 1, 12345),
    ([10] * 8, 3, 12345),
    ([10] * 8, 8, 12345),
    ([7, 1, 1, 2, 40, 0, 3, 9, 11], 4, M64),
    ([0, 0, 2], 1, 99),
    ([1000 + 37 * s for s in range(64)], 8, 20240601),
    ([10**9 + s for s in range(200)], 16, 42),
    ([(1 << 40) + 3, 5, (1 << 41) - 1], 2, 3),
]


def golden_positions(n: int) -> list[int]:
    small = list(range(min(n, 40)))
    spread = [n - 1, n, n + 1, 2 * n + n // 3, 7 * n + 5, 10**6 * n + 17]
    far = [((1 << 62) - 1) // n * n - 1, (1 << 62) - 1]
    return sorted(set(small + spread + far))


def golden_payload() -> dict[str, Any]:
    cases = []
    for sizes, k, seed in GOLDEN_CASES:
        positions = golden_positions(sum(sizes))
        ids = WindowedOrder(sizes, seed, window_shards=k).ids(np.array(positions, dtype=np.int64))
        cases.append(
            {
                "shard_sizes": sizes,
                "window_shards": k,
                "seed": seed,
                "positions": positions,
                "ids": ids.tolist(),
            }
        )
    return {"algorithm": ALGORITHM, "rounds": 8, "cases": cases}


def golden() -> dict[str, Any]:
    if not GOLDEN.exists():  # only while writing it: test_golden_header then fails
        return {"algorithm": None, "cases": []}
    doc: dict[str, Any] = json.loads(GOLDEN.read_text(encoding="utf-8"))
    return doc


def _case_id(case: dict[str, Any]) -> str:
    return f"S={len(case['shard_sizes'])}-k={case['window_shards']}-seed={case['seed']}"


def test_golden_header() -> None:
    doc = golden()
    assert doc["algorithm"] == ALGORITHM == "locality-v1"
    assert len(doc["cases"]) == len(GOLDEN_CASES)


@pytest.mark.parametrize("case", golden()["cases"], ids=_case_id)
def test_golden_vectors(case: dict[str, Any]) -> None:
    order = WindowedOrder(case["shard_sizes"], case["seed"], window_shards=case["window_shards"])
    got = order.ids(np.array(case["positions"], dtype=np.int64))
    assert got.tolist() == case["ids"]


@pytest.mark.parametrize("case", golden()["cases"], ids=_case_id)
def test_golden_agrees_with_reference(case: dict[str, Any]) -> None:
    sizes, k, seed = case["shard_sizes"], case["window_shards"], case["seed"]
    n = sum(sizes)
    expected = []
    for g in case["positions"]:
        if n <= 5000:
            expected.append(ref_epoch(sizes, k, seed, g // n)[g % n])
        else:
            expected.append(ref_id(sizes, k, seed, g))
    assert expected == case["ids"]


def test_two_references_agree() -> None:
    sizes, k, seed = [3, 0, 5, 2, 7, 1], 2, 77
    for epoch in (0, 4):
        epoch_ids = ref_epoch(sizes, k, seed, epoch)
        assert [ref_id(sizes, k, seed, epoch * 18 + i) for i in range(18)] == epoch_ids


# --------------------------------------------------------------------- properties
shard_lists = st.lists(st.integers(0, 40), min_size=1, max_size=24).filter(lambda s: sum(s) > 0)


@HYP
@given(sizes=shard_lists, k=st.integers(1, 30), seed=st.integers(0, M64), epoch=st.integers(0, 5))
def test_each_epoch_is_the_reference_bijection(
    sizes: list[int], k: int, seed: int, epoch: int
) -> None:
    """Shards of 0 samples included: every epoch is a permutation of [0, n), equal to the
    materialised reference."""
    n = sum(sizes)
    ids = WindowedOrder(sizes, seed, window_shards=k).ids(
        np.arange(epoch * n, (epoch + 1) * n, dtype=np.int64)
    )
    assert sorted(ids.tolist()) == list(range(n))
    assert ids.tolist() == ref_epoch(sizes, k, seed, epoch)


@HYP
@given(
    sizes=st.lists(st.integers(1, 300), min_size=1, max_size=6),
    seed=st.integers(0, M64),
    data=st.data(),
)
def test_both_evaluations_of_the_window_permutation_are_the_reference(
    sizes: list[int], seed: int, data: st.DataObject
) -> None:
    """`_walk_tables` (each window's whole domain encrypted once, cycles walked by lookup)
    and `permute_many` (positions encrypted pass after pass) are two evaluations of step 5;
    `_tables_pay` only picks between them: both equal ``P(m, K)`` of the reference."""
    windows = len(sizes)
    keys = [ref_keys(b"detdata:locality-v1:window", seed, 0, w) for w in range(windows)]
    rng = np.random.default_rng(data.draw(st.integers(0, M64)))
    owner = rng.integers(0, windows, size=data.draw(st.integers(1, 200)))
    offsets = np.array([rng.integers(0, sizes[w]) for w in owner.tolist()], dtype=np.int64)
    size = np.array(sizes, dtype=np.int64)
    bits = np.array([max(2, (m - 1).bit_length()) for m in sizes], dtype=np.uint64)
    table = np.array(keys, dtype=np.uint64).T.copy()  # (ROUNDS, windows)
    want = [
        ref_perm(sizes[w], keys[w], int(x)) for w, x in zip(owner.tolist(), offsets, strict=True)
    ]
    by_tables = _walk_tables(offsets, size, table, bits, owner)
    by_passes = permute_many(
        offsets.astype(np.uint64), size[owner].astype(np.uint64), table[:, owner], bits[owner]
    )
    assert by_tables.tolist() == want
    assert by_passes.astype(np.int64).tolist() == want


@pytest.mark.parametrize(
    ("sizes", "count", "tables"), [([80] * 60, 4096, True), ([8000], 16, False)]
)
def test_requests_use_either_evaluation(
    sizes: list[int], count: int, tables: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Many small windows take `_walk_tables`, a few positions of one large window take
    `permute_many`: both deliver the reference ids."""
    import detdata.order.locality as locality

    calls: list[int] = []

    def spy(*args: Any) -> Any:
        calls.append(1)
        return _walk_tables(*args)

    monkeypatch.setattr(locality, "_walk_tables", spy)
    order = WindowedOrder(sizes, 11, window_shards=1)
    pos = np.random.default_rng(count).integers(0, order.num_samples, size=count)
    want = np.array(ref_epoch(sizes, 1, 11, 0))[pos]
    np.testing.assert_array_equal(order.ids(pos), want)
    assert bool(calls) is tables


@pytest.mark.parametrize("k", [1, 7, 64, 10**6])
def test_bijection_large(k: int) -> None:
    sizes = [(s * 7919) % 3001 for s in range(400)]  # 0..3000 samples, some shards empty
    order = WindowedOrder(sizes, 5, window_shards=k)
    n = order.num_samples
    for epoch in (0, 9):
        ids = order.ids(np.arange(epoch * n, (epoch + 1) * n, dtype=np.int64))
        np.testing.assert_array_equal(np.sort(ids), np.arange(n))


@HYP
@given(sizes=shard_lists, k=st.integers(1, 30), seed=st.integers(0, M64), data=st.data())
def test_random_access_equals_sequential(
    sizes: list[int], k: int, seed: int, data: st.DataObject
) -> None:
    """Any request order, shape, repeats and epochs mixed in one request: the same ids as
    a sequential pass, and as one position at a time."""
    order = WindowedOrder(sizes, seed, window_shards=k)
    n = order.num_samples
    sequential = order.ids(np.arange(4 * n, dtype=np.int64))
    rng = np.random.default_rng(data.draw(st.integers(0, M64)))
    pos = rng.integers(0, 4 * n, size=data.draw(st.integers(0, 60)))
    np.testing.assert_array_equal(order.ids(pos), sequential[pos])
    if pos.size >= 4:
        np.testing.assert_array_equal(
            order.ids(pos[:4].reshape(2, 2)), sequential[pos[:4]].reshape(2, 2)
        )
    fresh = WindowedOrder(sizes, seed, window_shards=k)  # no cached epochs
    assert [fresh[int(g)] for g in pos[:5]] == sequential[pos[:5]].tolist()


@HYP
@given(sizes=shard_lists, k=st.integers(1, 8), seed=st.integers(0, M64))
def test_a_window_reads_only_its_shards(sizes: list[int], k: int, seed: int) -> None:
    """The positions of each window (consecutive) read exactly the samples of <= k shards,
    all of each: the locality the order is for."""
    order = WindowedOrder(sizes, seed, window_shards=k)
    n = order.num_samples
    starts = np.concatenate([[0], np.cumsum(sizes)[:-1]])
    shard_of = np.searchsorted(starts, order.ids(np.arange(n, dtype=np.int64)), side="right") - 1
    sigma = order.shard_order(0)
    at = 0
    for w in range(-(-len(sizes) // k)):
        shards = sigma[w * k : w * k + k]
        m = int(np.asarray(sizes)[shards].sum())
        assert set(shard_of[at : at + m].tolist()) == {int(s) for s in shards if sizes[s]}
        at += m


@HYP
@given(sizes=shard_lists, k=st.integers(1, 30), seed=st.integers(0, M64), data=st.data())
def test_positions_of_inverts_the_order(
    sizes: list[int], k: int, seed: int, data: st.DataObject
) -> None:
    """Brute force over 3.5 epochs: every position where a sample is delivered."""
    order = WindowedOrder(sizes, seed, window_shards=k)
    n = order.num_samples
    until = 3 * n + n // 2
    ids = np.asarray(ref_epoch(sizes, k, seed, 0) + ref_epoch(sizes, k, seed, 1))
    ids = np.concatenate([ids, ref_epoch(sizes, k, seed, 2), ref_epoch(sizes, k, seed, 3)])
    x = data.draw(st.integers(0, n - 1))
    start = data.draw(st.integers(0, until))
    found = order.positions_of(x, until=until, start=start)
    expected = np.flatnonzero(ids[:until] == x)
    np.testing.assert_array_equal(found, expected[expected >= start])


def test_positions_of_refuses_too_many_epochs() -> None:
    with pytest.raises(ConfigError, match="narrower"):
        WindowedOrder([2, 3], 1, window_shards=1).positions_of(0, until=1 << 40)


def test_epochs_and_seeds_reshuffle() -> None:
    sizes = [50] * 20
    a = WindowedOrder(sizes, 1, window_shards=4)
    n = a.num_samples
    e0, e1 = a.ids(np.arange(n)), a.ids(np.arange(n, 2 * n))
    assert not np.array_equal(e0, e1)
    assert not np.array_equal(a.shard_order(0), a.shard_order(1))
    b = WindowedOrder(sizes, 2, window_shards=4)
    assert not np.array_equal(b.ids(np.arange(n)), e1)  # seed 2 epoch 0 != seed 1 epoch 1
    assert not np.array_equal(WindowedOrder(sizes, 1, window_shards=5).ids(np.arange(n)), e0)


def test_keys_are_hashed_with_the_algorithm_name() -> None:
    for seed, epoch in [(0, 0), (1, 0), (0, 1), (M64, 77)]:
        assert _shard_keys(seed, epoch).tolist() == ref_keys(
            b"detdata:locality-v1:shards", seed, epoch
        )
        assert _shard_keys(seed, epoch).tolist() != ref_keys(b"detdata:feistel-v1", seed, epoch)
    assert _shard_keys(5, 1).tolist() != _shard_keys(6, 0).tolist()


def test_differs_from_feistel_even_as_one_window() -> None:
    sizes = [100] * 10
    full = WindowedOrder(sizes, 3, window_shards=10).ids(np.arange(1000))
    assert sorted(full.tolist()) == list(range(1000))
    assert not np.array_equal(full, GlobalOrder(1000, 3).ids(np.arange(1000)))


def test_pickle_and_equality() -> None:
    order = WindowedOrder([4, 0, 9], 8, window_shards=2)
    order.ids(np.arange(30))  # fill the epoch cache
    back = pickle.loads(pickle.dumps(order))
    assert back == order and hash(back) == hash(order)
    np.testing.assert_array_equal(back.ids(np.arange(60)), order.ids(np.arange(60)))
    assert "locality-v1" in repr(order)
    assert order[3:9].tolist() == order.ids(np.arange(3, 9)).tolist()


@pytest.mark.parametrize(
    ("sizes", "k", "needle"),
    [
        ([], 1, "no samples"),
        ([0, 0], 1, "no samples"),
        ([3, -1], 1, "shard_sizes\\[1\\]"),
        ([3, 1.5], 1, "shard_sizes\\[1\\]"),
        ("abc", 1, "sequence"),
        ([3], 0, "window_shards"),
        ([1 << 61, 1 << 61], 1, "2\\*\\*62"),
    ],
)
def test_bad_inputs(sizes: Any, k: int, needle: str) -> None:
    with pytest.raises(ConfigError, match=needle):
        WindowedOrder(sizes, 0, window_shards=k)


def test_bad_positions() -> None:
    order = WindowedOrder([3, 4], 0, window_shards=1)
    with pytest.raises(ConfigError, match=">= 0"):
        order.ids(np.array([1, -2]))
    with pytest.raises(ConfigError, match="integers"):
        order.ids(np.array([1.0]))
    with pytest.raises(ConfigError, match="stop"):
        order[3:]


# --------------------------------------------------------------------- the choice
def test_order_choices() -> None:
    assert check_order(Order.FEISTEL_V1) is Order.FEISTEL_V1
    assert check_order("feistel-v1") is Order.FEISTEL_V1
    assert check_order(Order.LOCALITY_V1) == LocalityOrder()
    assert check_order("locality-v1") == LocalityOrder()
    assert check_order(LocalityOrder(window_shards=3)) == LocalityOrder(window_shards=3)
    assert order_name(LocalityOrder(window_shards=3)) == "locality-v1(window_shards=3)"
    assert order_name(Order.FEISTEL_V1) == "feistel-v1"
    with pytest.raises(ConfigError, match="feistel-v1"):
        check_order("shuffle")
    with pytest.raises(ConfigError, match="window_shards"):
        LocalityOrder(window_shards=0)
    with pytest.raises(TypeError):
        LocalityOrder(3)  # type: ignore[call-arg]


# --------------------------------------------------------------------- golden writer
def _write_golden() -> None:
    if GOLDEN.exists():
        raise SystemExit(
            f"{GOLDEN} exists: golden vectors are generated once; a new algorithm gets a new file"
        )
    GOLDEN.write_text(json.dumps(golden_payload(), indent=1) + "\n", encoding="utf-8")
    print(f"wrote {GOLDEN}")


if __name__ == "__main__" and "--write-golden" in sys.argv:
    _write_golden()
