"""Inverting feistel-v1 and mixture-v1, checked against brute-force forward scans."""

from __future__ import annotations

import numpy as np
import pytest

from detdata.base.errors import ConfigError
from detdata.order.feistel import GlobalOrder, permute, permute_epochs
from detdata.order.inverse import (
    mixture_positions_of,
    position_of_index,
    positions_of,
    unpermute_epochs,
)
from detdata.order.mixing import MixtureSchedule, source_seed


@pytest.mark.parametrize("n", [1, 2, 3, 4, 5, 17, 64, 65, 1000, 4097])
def test_unpermute_inverts_every_index(n: int) -> None:
    local = np.arange(n, dtype=np.uint64)
    for epoch in (0, 1, 99):
        forward = permute(local, n, seed=12, epoch=epoch)
        epochs = np.full(n, epoch, dtype=np.uint64)
        np.testing.assert_array_equal(unpermute_epochs(forward, epochs, n, seed=12), local)


def test_unpermute_epochs_inverts_each_element_under_its_own_epoch() -> None:
    n = 300
    ids = np.array([0, 7, 299, 7, 150], dtype=np.uint64)
    epochs = np.array([0, 3, 3, 8, 1], dtype=np.uint64)
    got = unpermute_epochs(ids, epochs, n, seed=5)
    for j in range(ids.size):
        assert permute(got[j : j + 1], n, 5, int(epochs[j]))[0] == ids[j]
    np.testing.assert_array_equal(permute_epochs(got, epochs, n, 5), ids)


@pytest.mark.parametrize("n", [1, 29, 1000, 65537])
def test_positions_of_equals_a_brute_force_scan_over_1e6_positions(n: int) -> None:
    order = GlobalOrder(n, seed=2**64 - 3)
    ids = order.ids(np.arange(1_000_000))
    for x in sorted({0, n // 2, n - 1}):
        np.testing.assert_array_equal(
            positions_of(order, x, until=1_000_000), np.flatnonzero(ids == x)
        )
        expected = np.flatnonzero(ids[123_457:900_001] == x) + 123_457
        np.testing.assert_array_equal(
            positions_of(order, x, start=123_457, until=900_001), expected
        )


def test_positions_of_refuses_bad_ids_and_huge_ranges() -> None:
    order = GlobalOrder(10, seed=0)
    with pytest.raises(ConfigError, match="sample_id"):
        positions_of(order, 10, until=100)
    with pytest.raises(ConfigError, match="epochs"):
        positions_of(order, 1, until=10 * (1 << 25))
    assert positions_of(order, 1, until=0).size == 0


def test_mixture_inverse_equals_a_brute_force_scan_over_1e6_positions() -> None:
    seed, names, sizes = 77, ("a", "b", "c", "d"), (50, 400, 31, 3000)
    schedule = MixtureSchedule.build(
        seed, [0, 250_000, 600_000], [(1, 2, 3, 4), (5, 0, 1, 1), (1, 1, 1, 100)]
    )
    until = 1_000_000
    src, index = schedule.assign(np.arange(until))
    for s, (name, n) in enumerate(zip(names, sizes, strict=True)):
        order = GlobalOrder(n, source_seed(seed, name))
        ids = np.full(until, -1, dtype=np.int64)
        ids[src == s] = order.ids(index[src == s])
        for x in sorted({0, n - 1}):
            np.testing.assert_array_equal(
                mixture_positions_of(schedule, s, order, x, until=until),
                np.flatnonzero(ids == x),
                err_msg=f"source {name} sample {x}",
            )


def test_position_of_index_is_the_binary_search_reference() -> None:
    schedule = MixtureSchedule.build(3, [0], [(1, 3)])
    src, index = schedule.assign(np.arange(5000))
    for s in (0, 1):
        mine = np.flatnonzero(src == s)
        for i in (0, 1, 100, len(mine) - 1):
            got = position_of_index(lambda p, s=s: schedule.consumed(p)[s], i, until=5000)
            assert got == mine[i] and index[got] == i
        assert (
            position_of_index(lambda p, s=s: schedule.consumed(p)[s], len(mine), until=5000) is None
        )
