"""How the lookahead plans (`detdata.datasets.prefetch`): shards mapped for many micro steps
at once give exactly the per-step first-use order; fills are submitted in order of first use
and far enough ahead (every shard of the window before the consumer reaches it), also when
the byte bound stops the window short and when a plan chunk ends mid-window.

Real nginx and real cache files. References are brute force from the writer's arrays: the
shard of every window, walked in position order.
"""

from __future__ import annotations

import threading
from pathlib import Path

import numpy as np
import pytest

import detdata
from detdata import Storage
from detdata.datasets import prefetch
from detdata.datasets.prefetch import CacheAhead, Key, shard_uses, shard_uses_of_steps
from detdata.datasets.tokens import TokenWindows
from detdata.loading.layout import Layout
from detdata.storage.retry import RetryPolicy
from tests.servers import HttpServer

SEQ = 15
SIZES = (1601, 961, 1441, 1281, 801, 1121, 1601, 641)  # uint16: 1.3-3.2 KB per shard
PATIENT = RetryPolicy(deadline_s=20.0, attempt_timeout_s=2.0, base_delay_s=0.01, max_delay_s=0.1)


@pytest.fixture(scope="module")
def written(http_server: HttpServer) -> tuple[np.ndarray, detdata.Manifest, Path]:
    """(the shard of each window, cut by hand from the arrays), manifest, directory."""
    directory, _ = http_server.new_dir()
    rng = np.random.default_rng(23)
    shard_of: list[int] = []
    for i, n in enumerate(SIZES):
        np.save(directory / f"r{i}.npy", rng.integers(0, 65_000, n).astype(np.uint16))
        shard_of += [i] * ((n - 1) // SEQ)
    manifest = detdata.build_manifest(str(directory), pattern="*.npy")
    return np.asarray(shard_of), manifest, directory


def remote(url: str, manifest: detdata.Manifest, cache: Path, bound: int) -> TokenWindows:
    return TokenWindows(
        manifest.with_root(url),
        SEQ,
        storage=Storage(verify="off", retry=PATIENT, cache_dir=cache, shard_cache_bytes=bound),
    )


def brute_first_use(ids: np.ndarray, shard_of: np.ndarray) -> list[Key]:
    seen: list[Key] = []
    for i in ids.tolist():
        key = (0, int(shard_of[i]))
        if key not in seen:
            seen.append(key)
    return seen


class Recording(CacheAhead):
    """A CacheAhead that records each submitted fill with the consumer's step at that time."""

    def __init__(self, *args: object, **kwargs: object) -> None:
        super().__init__(*args, **kwargs)  # type: ignore[arg-type]
        self.at = -1
        self.submitted: list[tuple[int, Key]] = []

    def advance(self, step: int) -> None:
        self.at = step
        super().advance(step)

    def _submit(self, key: Key) -> None:
        self.submitted.append((self.at, key))
        super()._submit(key)


def test_shard_uses_of_many_steps_equal_each_steps_first_use(
    written: tuple[np.ndarray, detdata.Manifest, Path], http_server: HttpServer
) -> None:
    shard_of, manifest, directory = written
    ds = remote(f"{http_server.base}/{directory.name}", manifest, directory.parent / "p0", 1 << 20)
    stream = detdata.OrderedStream(ds, seed=5)
    rng = np.random.default_rng(3)
    steps = [np.arange(s, s + n) for s, n in ((0, 7), (7, 0), (7, 40), (300, 1), (12, 33))]
    steps += [rng.integers(0, 5000, int(rng.integers(1, 60))) for _ in range(20)]
    got = shard_uses_of_steps(stream, steps, [ds])
    assert got == [brute_first_use(stream.sample_ids(p), shard_of) for p in steps]
    assert [shard_uses(stream, p, [ds]) for p in steps] == got
    assert shard_uses_of_steps(stream, steps, []) == [[] for _ in steps]  # no cached reader


@pytest.mark.parametrize("chunk", [3, 64])
def test_fills_are_submitted_once_each_in_order_of_first_use(
    written: tuple[np.ndarray, detdata.Manifest, Path],
    http_server: HttpServer,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    chunk: int,
) -> None:
    """With a window over the whole run nothing is released before its last use: every
    shard is submitted exactly once, in the order the run first reads it."""
    monkeypatch.setattr(prefetch, "PLAN_CHUNK", chunk)  # chunks end mid-window (3) or not
    shard_of, manifest, directory = written
    bound = sum(s.bytes for s in manifest.shards)
    ds = remote(f"{http_server.base}/{directory.name}", manifest, tmp_path / "cache", bound)
    stream = detdata.OrderedStream(ds, seed=11)
    layout = Layout.create(8, 4, 1, 0)
    total = 40
    ahead = Recording(stream, layout.positions, steps=total, connections=2, stop=total)
    try:
        for j in range(total):
            ahead.advance(j)
    finally:
        ahead.close()
    ids = np.concatenate([stream.sample_ids(layout.positions(j)) for j in range(total)])
    assert [k for _, k in ahead.submitted] == brute_first_use(ids, shard_of)
    assert {at for at, _ in ahead.submitted} == {0}  # all at the first advance
    assert ahead.stats.shrunk == 0


@pytest.mark.parametrize("chunk", [3, 64])
def test_the_window_reaches_steps_ahead_and_a_released_copy_is_not_fetched_again(
    written: tuple[np.ndarray, detdata.Manifest, Path],
    http_server: HttpServer,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    chunk: int,
) -> None:
    """At each advance to step j, every shard read by steps j .. j+steps-1 is in the window
    (its fill submitted); a shard released after its last use in the window and planned
    again later is found in the cache (a bound over the whole data): one download each."""
    monkeypatch.setattr(prefetch, "PLAN_CHUNK", chunk)
    shard_of, manifest, directory = written
    bound = sum(s.bytes for s in manifest.shards)
    ds = remote(f"{http_server.base}/{directory.name}", manifest, tmp_path / "cache", bound)
    stream = detdata.OrderedStream(ds, seed=13)
    layout = Layout.create(8, 4, 1, 0)
    total, steps = 90, 10
    ahead = Recording(stream, layout.positions, steps=steps, connections=2, stop=total)
    try:
        for j in range(total):
            ahead.advance(j)
            assert ahead._next == min(j + steps, total)
            for k in range(j, min(j + steps, total)):
                for key in brute_first_use(stream.sample_ids(layout.positions(k)), shard_of):
                    assert key in ahead._last_use and ahead._last_use[key] >= k
            for future in list(ahead._futures.values()):
                future.result(timeout=20)  # let the fills finish: the cache has them all
    finally:
        ahead.close()
    cache = ds.files.shard_cache
    assert cache is not None
    submitted = [k for _, k in ahead.submitted]
    assert ahead.stats.released > 0 and len(submitted) > len(set(submitted))  # planned again
    assert cache.stats.fills == len(set(submitted))  # ... but downloaded once each
    assert ahead.stats.failed == 0


def test_a_window_cut_short_by_the_bound_still_covers_every_step_before_it_is_read(
    written: tuple[np.ndarray, detdata.Manifest, Path],
    http_server: HttpServer,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A small bound stops the window short (the step that did not fit is mapped already and
    kept for a later advance): every shard a step reads is in the window by the advance to
    that step, the window stays under the bound, and mapping ahead changes no step's shards."""
    monkeypatch.setattr(prefetch, "PLAN_CHUNK", 7)
    shard_of, manifest, directory = written
    bound = 4 * max(s.bytes for s in manifest.shards)  # one step reads <= 4 shards
    ds = remote(f"{http_server.base}/{directory.name}", manifest, tmp_path / "cache", bound)
    stream = detdata.OrderedStream(ds, seed=12)
    layout = Layout.create(8, 4, 1, 0)
    ahead = Recording(stream, layout.positions, steps=16, connections=2)
    try:
        for j in range(80):
            ahead.advance(j)
            assert ahead.window_bytes() <= bound
            planned = dict(ahead._plan)
            assert j in planned  # the step about to be read is always planned
            want = brute_first_use(stream.sample_ids(layout.positions(j)), shard_of)
            assert planned[j] == want
            assert all(k in ahead._futures or k in ahead._last_use for k in want)
            for k, keys in planned.items():  # every planned step as brute force maps it
                assert keys == brute_first_use(stream.sample_ids(layout.positions(k)), shard_of)
    finally:
        ahead.close()
    assert ahead.stats.shrunk > 0  # the bound did cut the window
    assert ahead.stats.failed == 0


def test_fill_threads_asking_at_once_share_one_cache_and_file_system(
    written: tuple[np.ndarray, detdata.Manifest, Path], http_server: HttpServer, tmp_path: Path
) -> None:
    """The lookahead's fill threads and reader threads may first ask a reader for its shard
    cache at the same moment: they must get one cache (one set of counters), not one each."""
    _, manifest, directory = written
    ds = remote(f"{http_server.base}/{directory.name}", manifest, tmp_path / "cache", 1 << 20)
    start = threading.Barrier(8)
    caches: list[object] = []
    systems: list[object] = []

    def ask() -> None:
        start.wait(10)
        caches.append(ds.files.shard_cache)
        systems.append(ds.files.filesystem()[0])

    threads = [threading.Thread(target=ask) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(20)
    assert len(caches) == 8 and all(c is caches[0] for c in caches)
    assert all(s is systems[0] for s in systems)
