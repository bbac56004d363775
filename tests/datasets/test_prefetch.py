"""CacheAhead prefetch into the shard cache (`detdata.datasets.prefetch`) on a real nginx.

References are independent of the code under test: the writer's own arrays (windows cut
by hand), first-use orders and shard sets computed by brute force from the ids, and a
loader over the local files.
"""

from __future__ import annotations

import os
import shutil
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import detdata
from detdata import Storage
from detdata.datasets.prefetch import CacheAhead, cached_readers, shard_uses
from detdata.datasets.tokens import TokenWindows
from detdata.loading.layout import Layout
from detdata.storage.locks import flock as _flock
from detdata.storage.retry import RetryPolicy
from tests.faultproxy import FaultProxy, schedule
from tests.servers import HttpServer

SEQ = 15
SIZES = (1601, 961, 1441, 1281, 801, 1121, 1601, 641)  # uint16: 1.3-3.2 KB per shard
PATIENT = RetryPolicy(deadline_s=20.0, attempt_timeout_s=2.0, base_delay_s=0.01, max_delay_s=0.1)


@pytest.fixture(scope="module")
def written(http_server: HttpServer) -> tuple[list[np.ndarray], detdata.Manifest, Path]:
    directory, _ = http_server.new_dir()
    rng = np.random.default_rng(9)
    arrays = [rng.integers(0, 65_000, n).astype(np.uint16) for n in SIZES]
    for i, a in enumerate(arrays):
        np.save(directory / f"p{i}.npy", a)
    return arrays, detdata.build_manifest(str(directory), pattern="*.npy"), directory


def windows_of(arrays: list[np.ndarray]) -> tuple[np.ndarray, np.ndarray]:
    """(every window as rows, the shard of each window), cut by hand from the arrays."""
    rows, shard = [], []
    for s, a in enumerate(arrays):
        for w in range((len(a) - 1) // SEQ):
            rows.append(a[w * SEQ : w * SEQ + SEQ + 1])
            shard.append(s)
    return np.stack(rows).astype(np.int32), np.asarray(shard)


def remote(url: str, manifest: detdata.Manifest, cache: Path, bound: int) -> TokenWindows:
    return TokenWindows(
        manifest.with_root(url),
        SEQ,
        storage=Storage(verify="off", retry=PATIENT, cache_dir=cache, shard_cache_bytes=bound),
    )


def test_shard_uses_are_in_order_of_first_use(
    written: tuple[list[np.ndarray], detdata.Manifest, Path], http_server: HttpServer
) -> None:
    arrays, manifest, directory = written
    ds = remote(f"{http_server.base}/{directory.name}", manifest, directory.parent / "c0", 1 << 20)
    stream = detdata.OrderedStream(ds, seed=3)
    _, shard_of = windows_of(arrays)
    for start in (0, 17, 400):
        positions = np.arange(start, start + 40)
        ids = stream.sample_ids(positions)
        brute: list[int] = []
        for i in ids.tolist():
            if int(shard_of[i]) not in brute:
                brute.append(int(shard_of[i]))
        assert shard_uses(stream, positions, [ds]) == [(0, s) for s in brute]


def test_an_excluded_stream_prefetches_the_shards_of_what_it_delivers(
    written: tuple[list[np.ndarray], detdata.Manifest, Path], http_server: HttpServer
) -> None:
    """An `Excluded` stream says where its samples come from (`HasOrigins`), replacements
    included: its cached readers are its dataset's and its shard uses are those of the ids
    it delivers (brute force from the hand-cut windows)."""
    arrays, manifest, directory = written
    ds = remote(f"{http_server.base}/{directory.name}", manifest, directory.parent / "c1", 1 << 20)
    inner = detdata.OrderedStream(ds, seed=3)
    positions = np.arange(0, 40)
    bad = detdata.ExclusionList.of(inner.sample_ids(positions)[::3].tolist())
    stream = detdata.Excluded(inner, bad, seed=3)
    assert cached_readers(stream) == [ds]
    ids = stream.sample_ids(positions)
    assert not np.isin(ids, inner.sample_ids(positions)[::3]).any()  # replaced
    _, shard_of = windows_of(arrays)
    brute: list[int] = []
    for i in ids.tolist():
        if int(shard_of[i]) not in brute:
            brute.append(int(shard_of[i]))
    assert shard_uses(stream, positions, [ds]) == [(0, s) for s in brute]


def test_window_stays_under_the_cache_bound_and_covers_the_next_step(
    written: tuple[list[np.ndarray], detdata.Manifest, Path],
    http_server: HttpServer,
    tmp_path: Path,
) -> None:
    arrays, manifest, directory = written
    rows, _ = windows_of(arrays)
    # the data is ~2x the cache; one micro step (4 windows) needs at most 4 shards < 5
    bound = 5 * max(s.bytes for s in manifest.shards)
    ds = remote(f"{http_server.base}/{directory.name}", manifest, tmp_path / "cache", bound)
    stream = detdata.OrderedStream(ds, seed=4)
    layout = Layout.create(8, 4, 1, 0)
    ahead = CacheAhead(stream, layout.positions, steps=12, connections=2)
    assert ahead.active
    cache = ds.files.shard_cache
    assert cache is not None
    try:
        for j in range(60):
            ahead.advance(j)
            assert ahead.window_bytes() <= bound
            assert cache.usage() <= bound
            ids = stream.sample_ids(layout.positions(j))
            assert np.array_equal(stream.fetch(layout.positions(j))["tokens"], rows[ids])
            assert cache.usage() <= bound
    finally:
        ahead.close()
    assert ahead.stats.submitted > 0 and ahead.stats.released > 0
    assert ahead.stats.max_window_bytes <= bound
    assert ahead.stats.failed == 0


@pytest.mark.parametrize(("num_workers", "mode"), [(0, "process"), (2, "thread"), (2, "process")])
def test_loader_with_lookahead_delivers_the_local_bytes(
    written: tuple[list[np.ndarray], detdata.Manifest, Path],
    http_server: HttpServer,
    fault_proxy: Callable[[int], FaultProxy],
    tmp_path: Path,
    num_workers: int,
    mode: str,
) -> None:
    _, manifest, directory = written
    proxy = fault_proxy(http_server.port)
    proxy.set_plan(schedule(reset_every=2, reset_after=500))  # resets inside fills
    bound = 4 * max(s.bytes for s in manifest.shards)
    ds = remote(f"http://{proxy.address}/{directory.name}", manifest, tmp_path / "cache", bound)
    local = TokenWindows(manifest, SEQ)
    kw: dict[str, Any] = {"global_batch_size": 8, "micro_batch_size": 4, "seed": 2}
    got = detdata.DataLoader(
        ds,
        num_workers=num_workers,
        options=detdata.LoaderOptions(
            read=detdata.ReadOptions(worker_mode=mode, batches_ahead=2, steps_ahead=24)
        ),
        **kw,
    )
    want = detdata.DataLoader(local, **kw)
    try:
        for k, (a, b) in enumerate(zip(got, want, strict=False)):
            assert np.array_equal(a["tokens"].numpy(), b["tokens"].numpy())
            cache = ds.files.shard_cache
            assert cache is not None and cache.usage() <= bound
            if k == 80:
                break
    finally:
        got.close()
    assert proxy.stats.resets > 0


def test_a_missing_shard_fails_at_the_first_batch_that_needs_it(
    written: tuple[list[np.ndarray], detdata.Manifest, Path],
    http_server: HttpServer,
    tmp_path: Path,
) -> None:
    arrays, manifest, directory = written
    _, shard_of = windows_of(arrays)
    served = Path(http_server.docroot) / f"gone-{directory.name}"
    shutil.copytree(directory, served)
    os.unlink(served / "p5.npy")  # verified when opened (elsewhere), then deleted
    ds = remote(f"{http_server.base}/{served.name}", manifest, tmp_path / "cache", 1 << 20)
    stream = detdata.OrderedStream(TokenWindows(manifest, SEQ), seed=6)
    layout = Layout.create(8, 4, 1, 0)
    first = next(j for j in range(10_000) if 5 in shard_of[stream.sample_ids(layout.positions(j))])
    loader = detdata.DataLoader(
        ds,
        global_batch_size=8,
        micro_batch_size=4,
        seed=6,
        options=detdata.LoaderOptions(read=detdata.ReadOptions(batches_ahead=4, steps_ahead=64)),
    )
    delivered = 0
    with pytest.raises((FileNotFoundError, detdata.StorageError)) as info:
        for _ in loader:
            delivered += 1
    loader.close()
    assert delivered == first and loader.samples_consumed == first * 4
    assert "p5.npy" in str(info.value)


def test_a_forked_child_does_not_keep_a_parent_threads_flock(tmp_path: Path) -> None:
    """A worker forked while a prefetch thread holds a shard lock must not inherit it."""
    path = str(tmp_path / "x.lock")
    held, release = threading.Event(), threading.Event()

    def hold() -> None:
        with _flock(path):
            held.set()
            release.wait(10)

    thread = threading.Thread(target=hold)
    thread.start()
    held.wait(10)
    read_fd, write_fd = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: wait for the parent's release, then take the lock
        os.close(write_fd)
        os.read(read_fd, 1)
        import fcntl
        import time

        fd = os.open(path, os.O_RDWR)
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                os._exit(0)
            except BlockingIOError:
                time.sleep(0.01)
        os._exit(1)
    os.close(read_fd)
    release.set()
    thread.join(10)
    os.write(write_fd, b"x")
    os.close(write_fd)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
