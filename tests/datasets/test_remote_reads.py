"""Uncached remote `TokenWindows` reads coalesce each shard's windows into few requests:
bytes against the writer's own arrays on a real nginx, request counts and resets in the
middle of an answer through the fault proxy."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest

import detdata
from detdata import Storage
from detdata.datasets.tokens import TokenWindows
from detdata.storage.retry import RetriesExhausted, RetryPolicy
from tests.faultproxy import FaultProxy, reset_all, schedule
from tests.servers import HttpServer

SEQ = 31
SIZES = (4000, 2500, 3300, 1200)
PATIENT = RetryPolicy(deadline_s=20.0, attempt_timeout_s=2.0, base_delay_s=0.01, max_delay_s=0.1)
FAST = RetryPolicy(deadline_s=1.0, attempt_timeout_s=0.5, base_delay_s=0.05, max_delay_s=0.2)


@pytest.fixture(scope="module")
def written(http_server: HttpServer) -> tuple[list[np.ndarray], detdata.Manifest]:
    directory, _ = http_server.new_dir()
    rng = np.random.default_rng(7)
    arrays = [rng.integers(0, 65_000, n).astype(np.uint16) for n in SIZES]
    for i, a in enumerate(arrays):
        np.save(directory / f"t{i}.npy", a)
    return arrays, detdata.build_manifest(str(directory), pattern="*.npy")


def expected_windows(arrays: list[np.ndarray], ids: np.ndarray) -> np.ndarray:
    """Window ``w`` of shard ``s`` = tokens ``[w*SEQ, w*SEQ + SEQ + 1)``, shards in order."""
    rows = [a[w * SEQ : w * SEQ + SEQ + 1] for a in arrays for w in range((len(a) - 1) // SEQ)]
    return np.stack([rows[i] for i in ids.tolist()]).astype(np.int32)


def remote(
    http_server: HttpServer, proxy: FaultProxy, manifest: detdata.Manifest, root: Path
) -> TokenWindows:
    url = f"http://{proxy.address}/{root.name}"
    # cache_dir=None: these tests are about the coalesced range reads (no shard cache)
    return TokenWindows(
        manifest.with_root(url), SEQ, storage=Storage(verify="off", retry=PATIENT, cache_dir=None)
    )


def test_reads_equal_the_writer_arrays_with_one_request_per_dense_shard(
    http_server: HttpServer,
    written: tuple[list[np.ndarray], detdata.Manifest],
    fault_proxy: Callable[[int], FaultProxy],
) -> None:
    arrays, manifest = written
    proxy = fault_proxy(http_server.port)
    ds = remote(http_server, proxy, manifest, Path(str(manifest.root)))
    n = ds.num_samples
    ids = np.arange(n)[::-1].copy()  # every window of every shard, reversed
    assert np.array_equal(ds.read(ids)["tokens"], expected_windows(arrays, ids))
    assert proxy.stats.requests == len(SIZES)  # dense: one covering request per shard
    rng = np.random.default_rng(1)
    for size in (1, 7, 64, 300):
        ids = rng.integers(0, n, size)
        before = proxy.stats.requests
        assert np.array_equal(ds.read(ids)["tokens"], expected_windows(arrays, ids))
        assert proxy.stats.requests - before <= len(np.unique(ids))


def test_resets_mid_request_still_give_the_writer_bytes(
    http_server: HttpServer,
    written: tuple[list[np.ndarray], detdata.Manifest],
    fault_proxy: Callable[[int], FaultProxy],
) -> None:
    arrays, manifest = written
    proxy = fault_proxy(http_server.port)
    ds = remote(http_server, proxy, manifest, Path(str(manifest.root)))
    proxy.set_plan(schedule(reset_every=2, reset_after=400))  # inside each answer's body
    for ids in (
        np.random.default_rng(2).permutation(ds.num_samples)[:200],  # small requests
        np.arange(ds.num_samples),  # one covering request per shard, 2.4-8 KB each
    ):
        assert np.array_equal(ds.read(ids)["tokens"], expected_windows(arrays, ids))
    assert proxy.stats.resets > 0


def test_a_dead_link_fails_naming_shard_and_url(
    http_server: HttpServer,
    written: tuple[list[np.ndarray], detdata.Manifest],
    fault_proxy: Callable[[int], FaultProxy],
) -> None:
    _, manifest = written
    proxy = fault_proxy(http_server.port)
    url = f"http://{proxy.address}/{Path(str(manifest.root)).name}"
    ds = TokenWindows(manifest.with_root(url), SEQ, storage=Storage(verify="off", retry=FAST))
    proxy.set_plan(reset_all)
    with pytest.raises(RetriesExhausted) as info:
        ds.read(np.asarray([200]))  # a window of t1.npy
    assert "t1.npy" in str(info.value) and f"{url}/t1.npy" in str(info.value)
