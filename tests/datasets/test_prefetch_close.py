"""Leaving a lookahead prefetch (`detdata.datasets.prefetch`): a ``break`` does not wait for
shard downloads, abandoned fills leave nothing partial in the cache, and a deferred release
never marks a shard that is back in the window as first to evict.

Real nginx, a real slow link (`tests.faultproxy.Link`), real cache files. References: the
writer's own arrays and files, and a loader over the local files.
"""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest

import detdata
from detdata import Storage
from detdata.datasets.prefetch import CacheAhead, shard_uses
from detdata.datasets.tokens import TokenWindows
from detdata.loading.layout import Layout
from detdata.storage.retry import RetryPolicy
from tests.faultproxy import FaultProxy, Link
from tests.servers import HttpServer

SEQ = 15
SIZES = (1601, 961, 1441, 1281, 801, 1121, 1601, 641)  # uint16: 1.3-3.2 KB per shard
BANDWIDTH = 800.0  # bytes/s over the slow link: one fill takes > 1.7 s
#: The exit test's link: one fill takes > 14 s, so its bound (a third of that) is ~20x the
#: child's exit CPU time (0.15-0.22 s measured), whatever the other xdist worker runs.
EXIT_BANDWIDTH = 100.0
PATIENT = RetryPolicy(deadline_s=30.0, attempt_timeout_s=20.0, base_delay_s=0.01, max_delay_s=0.1)
KW = {"global_batch_size": 8, "micro_batch_size": 4}


@pytest.fixture(scope="module")
def written(http_server: HttpServer) -> tuple[detdata.Manifest, Path]:
    directory, _ = http_server.new_dir()
    rng = np.random.default_rng(19)
    for i, n in enumerate(SIZES):
        np.save(directory / f"q{i}.npy", rng.integers(0, 65_000, n).astype(np.uint16))
    return detdata.build_manifest(str(directory), pattern="*.npy"), directory


def remote(url: str, manifest: detdata.Manifest, cache: Path, retry: RetryPolicy) -> TokenWindows:
    return TokenWindows(
        manifest.with_root(url), SEQ, storage=Storage(verify="off", retry=retry, cache_dir=cache)
    )


def prefetch_threads(before: frozenset[threading.Thread] = frozenset()) -> list[threading.Thread]:
    """Prefetch threads alive now, less ``before`` (an earlier test's, if any)."""
    alive = threading.enumerate()
    return [t for t in alive if t.name.startswith("detdata-prefetch") and t not in before]


def test_break_does_not_wait_for_a_running_fill_and_leaves_nothing_partial(
    written: tuple[detdata.Manifest, Path], http_server: HttpServer, tmp_path: Path
) -> None:
    manifest, directory = written
    cache = tmp_path / "cache"
    seed = 5
    before = frozenset(threading.enumerate())
    # step 0's shards are already cached (filled over the fast path): the first batch is
    # read at once; every later shard crosses the slow link
    fast = remote(f"{http_server.base}/{directory.name}", manifest, cache, PATIENT)
    layout = Layout.create(8, 4, 1, 0)
    first = shard_uses(detdata.OrderedStream(fast, seed=seed), layout.positions(0), [fast])
    for _, shard in first:
        fast.files.prefetch_copy(shard)
    assert len(first) < len(SIZES)
    smallest = min(s.bytes for s in manifest.shards)
    one_fill_s = smallest / BANDWIDTH
    proxy = FaultProxy(http_server.port, link=Link(bandwidth_bps=BANDWIDTH)).start()
    try:
        slow = remote(f"http://{proxy.address}/{directory.name}", manifest, cache, PATIENT)
        loader = detdata.DataLoader(
            slow,
            seed=seed,
            options=detdata.LoaderOptions(
                read=detdata.ReadOptions(batches_ahead=1, steps_ahead=16, steps_ahead_connections=1)
            ),
            **KW,
        )
        want = next(iter(detdata.DataLoader(TokenWindows(manifest, SEQ), seed=seed, **KW)))
        began = 0.0
        for batch in loader:
            assert np.array_equal(batch["tokens"].numpy(), want["tokens"].numpy())
            began = time.monotonic()
            break  # a fill of a later shard is running on the slow link now
        loader.close()
        took = time.monotonic() - began
        assert took < one_fill_s / 3, (took, one_fill_s)
        proxy.link = Link()  # the abandoned fill now finishes quickly, in the background
        for thread in prefetch_threads(before):
            thread.join(30)
        assert prefetch_threads(before) == []
    finally:
        proxy.stop()
    # nothing partial: no temp file is left, and every copy is one of the written files
    assert os.listdir(cache / "tmp") == []
    originals = {p.read_bytes() for p in directory.glob("*.npy")}
    for copy in (cache / "objects").iterdir():
        assert copy.read_bytes() in originals, copy.name


def test_a_deferred_release_skips_a_shard_planned_again(
    written: tuple[detdata.Manifest, Path], http_server: HttpServer, tmp_path: Path
) -> None:
    """A jump while shard K's fill runs defers K's release to that fill's end; K planned
    again at the jump target must not be released (made first to evict) by it."""
    manifest, directory = written
    ds = remote(f"{http_server.base}/{directory.name}", manifest, tmp_path / "cache", PATIENT)
    stream = detdata.OrderedStream(ds, seed=8)
    layout = Layout.create(8, 4, 1, 0)
    key = shard_uses(stream, layout.positions(0), [ds])[0]  # the first fill submitted
    target = next(j for j in range(5, 5000) if key in shard_uses(stream, layout.positions(j), [ds]))
    cache = ds.files.shard_cache
    assert cache is not None
    held, let_go = threading.Event(), threading.Event()

    def hold_shard_lock() -> None:  # K's fill waits on its lock: it stays running
        with cache._shard_lock(manifest.shards[key[1]]):
            held.set()
            let_go.wait(20)

    holder = threading.Thread(target=hold_shard_lock)
    holder.start()
    assert held.wait(10)
    ahead = CacheAhead(stream, layout.positions, steps=1, connections=1)
    try:
        ahead.advance(0)
        deadline = time.monotonic() + 10
        while not ahead._futures[key].running() and time.monotonic() < deadline:
            time.sleep(0.01)
        assert ahead._futures[key].running()
        ahead.advance(target)  # a jump: everything released, K's release deferred
        again = ahead._futures[key]  # K is in the new window: filled (a hit) again
        releases = cache.stats.releases
        let_go.set()
        holder.join(10)
        again.result(timeout=20)  # runs after the first fill and its callbacks (1 thread)
        assert cache.stats.releases == releases  # the deferred release was skipped
    finally:
        let_go.set()
        ahead.close()


EXIT_SCRIPT = """
import sys, time
import detdata
from detdata.datasets.prefetch import CacheAhead
from detdata.datasets.tokens import TokenWindows
from detdata.loading.layout import Layout
from detdata.storage.retry import RetryPolicy

directory, url, cache = sys.argv[1:4]
manifest = detdata.build_manifest(directory, pattern="*.npy").with_root(url)
retry = RetryPolicy(deadline_s=30.0, attempt_timeout_s=20.0, base_delay_s=0.01, max_delay_s=0.1)
ds = TokenWindows(
    manifest, 15, storage=detdata.Storage(verify="off", retry=retry, cache_dir=cache)
)
stream = detdata.OrderedStream(ds, seed=3)
ahead = CacheAhead(stream, Layout.create(8, 4, 1, 0).positions, steps=16, connections=1)
ahead.advance(0)  # queues every shard's fill; never closed
while not any(f.running() for f in ahead._futures.values()):
    time.sleep(0.01)
print("running", flush=True)
"""


def test_exit_does_not_wait_for_queued_fills(
    written: tuple[detdata.Manifest, Path], http_server: HttpServer, tmp_path: Path
) -> None:
    """A process that leaves a lookahead unclosed exits at once, cleanly: its queued fills
    are cancelled and the running one is not waited for."""
    manifest, directory = written
    one_fill_s = min(s.bytes for s in manifest.shards) / EXIT_BANDWIDTH
    assert one_fill_s > 10  # and below the child's 20 s attempt timeout: a wait would show
    proxy = FaultProxy(http_server.port, link=Link(bandwidth_bps=EXIT_BANDWIDTH)).start()
    try:
        url = f"http://{proxy.address}/{directory.name}"
        args = [str(directory), url, str(tmp_path / "cache")]
        child = subprocess.Popen(
            [sys.executable, "-c", EXIT_SCRIPT, *args],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        assert child.stdout is not None
        assert child.stdout.readline().strip() == "running"
        began = time.monotonic()
        _, err = child.communicate(timeout=120)
        took = time.monotonic() - began
    finally:
        proxy.stop()
    assert child.returncode == 0, err
    assert "Fatal Python error" not in err
    assert took < one_fill_s / 3, (took, one_fill_s)
