"""`permute_sources` (many `GlobalOrder`s in one pass, as `Mixture.locate` uses it) gives the
same ids as each element's own `GlobalOrder`, and as the spec reference of test_order.py."""

from __future__ import annotations

import numpy as np
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from detdata.order.feistel import GlobalOrder, permute_sources
from tests.order.test_order import ref_id

M64 = (1 << 64) - 1
sizes = st.one_of(
    st.integers(1, 40),
    st.sampled_from([1, 2, 3, 4, 5, 1023, 1024, 1025, 65537]),
    st.integers(1, (1 << 62) - 1),
)


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    orders=st.lists(st.tuples(sizes, st.integers(0, M64)), min_size=1, max_size=12),
    data=st.data(),
)
def test_equals_each_global_order(orders: list[tuple[int, int]], data: st.DataObject) -> None:
    rng = np.random.default_rng(data.draw(st.integers(0, M64)))
    count = data.draw(st.integers(0, 300))
    which = rng.integers(0, len(orders), size=count)
    far = data.draw(st.booleans())
    index = rng.integers(0, (1 << 62) if far else 200, size=count, dtype=np.int64)
    n = np.array([orders[w][0] for w in which], dtype=np.uint64)
    seeds = np.array([orders[w][1] for w in which], dtype=np.uint64)
    got = permute_sources(index.astype(np.uint64), n, seeds).view(np.int64)
    expected = [
        GlobalOrder(*orders[w]).ids(np.array([i]))[0] for w, i in zip(which, index, strict=True)
    ]
    assert got.tolist() == [int(e) for e in expected]
    for w, i, g in list(zip(which, index, got, strict=True))[:5]:
        assert int(g) == ref_id(orders[w][0], orders[w][1], int(i))


def test_long_request_is_chunked_the_same() -> None:
    count = 70_000  # more than one vectorised pass
    rng = np.random.default_rng(3)
    n = rng.choice(np.array([7, 1000, 1 << 40], dtype=np.uint64), size=count)
    seeds = rng.choice(np.array([1, 2, M64], dtype=np.uint64), size=count)
    index = rng.integers(0, 10**6, size=count).astype(np.uint64)
    got = permute_sources(index, n, seeds).view(np.int64)
    for size in (7, 1000, 1 << 40):
        for seed in (1, 2, M64):
            sel = (n == size) & (seeds == seed)
            own = GlobalOrder(size, seed).ids(index[sel].astype(np.int64))
            np.testing.assert_array_equal(got[sel], own)


def test_mixture_locate_with_many_sources_uses_each_sources_order() -> None:
    """Above a few sources per request `Mixture.locate` computes all sample ids in one pass:
    each equals that source's own `GlobalOrder` at its index in source."""
    from detdata import Mixture
    from detdata.cli.mix import CountDataset

    names = [f"s{i:02d}" for i in range(30)]
    m = Mixture(
        {n: CountDataset(1 + 37 * i, name=n) for i, n in enumerate(names)},
        {n: (i % 4) + 1 for i, n in enumerate(names)},
        seed=9,
    )
    rng = np.random.default_rng(0)
    for pos in (np.arange(10**9, 10**9 + 5000), rng.integers(0, 1 << 62, 3000), np.arange(5)):
        src, index, ids = m.locate(pos)
        for s, name in enumerate(names):
            sel = src == s
            np.testing.assert_array_equal(ids[sel], m.orders[name].ids(index[sel]))


@given(st.lists(st.one_of(st.integers(1, 5000), st.integers(1, (1 << 62) - 1)), max_size=50))
def test_domain_bits_many_is_domain_bits_of_each(values: list[int]) -> None:
    """The vectorised form (a float64 exponent below 2**52) against ``bit_length``."""
    from detdata.order.feistel import domain_bits_many

    powers = [1 << p for p in range(53)] + [(1 << p) + 1 for p in range(53)]
    powers += [(1 << p) - 1 for p in range(1, 62)]
    for sample in (values, powers, [(1 << 52) - 1, 1 << 52, (1 << 62) - 1]):
        got = domain_bits_many(np.asarray(sample, dtype=np.int64)).tolist()
        assert got == [max(2, (m - 1).bit_length()) for m in sample]
