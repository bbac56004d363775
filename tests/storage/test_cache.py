"""ShardCache: verified fills, corruption detection + refetch, byte bound + LRU, processes.

Shards are served by a real nginx on 127.0.0.1 (tests/servers.py); the cache
is checked against the manifest's blake3 and against local reads of the same
manifest.
"""

from __future__ import annotations

import logging
import multiprocessing as mp
import os
import shutil
from pathlib import Path
from typing import Any

import blake3
import fsspec
import numpy as np
import pytest

from detdata import Storage
from detdata.base.errors import ConfigError, VerificationError
from detdata.datasets.tables import TableRows
from detdata.datasets.tokens import TokenWindows
from detdata.identity.build import build_manifest
from detdata.identity.manifest import Manifest
from detdata.storage import boot
from detdata.storage.cache import ShardCache
from detdata.storage.retry import RetryPolicy
from detdata.storage.verified import forget_verified
from tests.faultproxy import FaultProxy, schedule
from tests.servers import HttpServer

SEQ = 16
SIZES = (4000, 3500, 4200, 3000, 3900, 4100)  # uint16: ~7-8 KB per shard


@pytest.fixture(scope="module")
def served(
    http_server: HttpServer, tmp_path_factory: pytest.TempPathFactory
) -> tuple[Manifest, Manifest, Path]:
    """(local manifest, the same manifest rooted at nginx, served directory)."""
    local_dir = tmp_path_factory.mktemp("cache-local")
    rng = np.random.default_rng(5)
    for i, n in enumerate(SIZES):
        np.save(local_dir / f"s{i}.npy", rng.integers(0, 60_000, size=n).astype(np.uint16))
    directory, url = http_server.new_dir()
    shutil.copytree(local_dir, directory, dirs_exist_ok=True)
    local = build_manifest(str(local_dir))
    return local, local.with_root(url), directory


def objects(cache_dir: Path) -> list[Path]:
    return sorted((cache_dir / "objects").iterdir())


def flip_byte(path: Path, offset: int) -> None:
    data = bytearray(path.read_bytes())
    data[offset] ^= 0xFF
    path.write_bytes(bytes(data))


def test_fill_is_verified_named_by_blake3_and_reused(
    served: tuple[Manifest, Manifest, Path], tmp_path: Path
) -> None:
    local, remote, directory = served
    ds = TokenWindows(remote, SEQ, storage=Storage(cache_dir=tmp_path, shard_cache_bytes=1 << 20))
    ref = TokenWindows(local, SEQ)
    ids = np.arange(ref.num_samples)[::-1]
    np.testing.assert_array_equal(ds.read(ids)["tokens"], ref.read(ids)["tokens"])
    assert ds.files.shard_cache is not None and ds.files.shard_cache.stats.fills == len(SIZES)
    files = objects(tmp_path)
    assert [f.name for f in files] == sorted(s.blake3[3:] for s in remote.shards)
    for f in files:  # every copy holds exactly the bytes its name promises
        assert "b3:" + blake3.blake3(f.read_bytes()).hexdigest() == "b3:" + f.name
    assert list((tmp_path / "tmp").iterdir()) == []
    # a new reader (another job, same cache) uses the copies: no fills, even with the
    # remote data gone (verify="off": the manifest cannot be checked against the store)
    moved = directory.with_name(directory.name + "-moved")
    directory.rename(moved)
    try:
        again = TokenWindows(
            remote,
            SEQ,
            storage=Storage(cache_dir=tmp_path, shard_cache_bytes=1 << 20, verify="off"),
        )
        np.testing.assert_array_equal(again.read(ids)["tokens"], ref.read(ids)["tokens"])
        assert again.files.shard_cache is not None
        assert (
            again.files.shard_cache.stats.fills == 0
            and again.files.shard_cache.stats.hits == len(SIZES)
        )
    finally:
        moved.rename(directory)


def test_corrupted_cache_file_is_detected_and_refetched(
    served: tuple[Manifest, Manifest, Path], tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    local, remote, _ = served
    ref = TokenWindows(local, SEQ)
    ids = np.arange(ref.num_samples)
    TokenWindows(remote, SEQ, storage=Storage(cache_dir=tmp_path, shard_cache_bytes=1 << 20)).read(
        ids
    )
    victim = tmp_path / "objects" / remote.shards[2].blake3[3:]
    good = victim.read_bytes()
    flip_byte(victim, len(good) // 2)
    caplog.set_level(logging.WARNING, "detdata.cache")
    ds = TokenWindows(remote, SEQ, storage=Storage(cache_dir=tmp_path, shard_cache_bytes=1 << 20))
    np.testing.assert_array_equal(ds.read(ids)["tokens"], ref.read(ids)["tokens"])
    assert ds.files.shard_cache is not None
    assert (ds.files.shard_cache.stats.corrupt, ds.files.shard_cache.stats.fills) == (1, 1)
    assert victim.read_bytes() == good  # the copy was fetched again
    assert any("s2.npy" in r.getMessage() and "corrupted" in r.getMessage() for r in caplog.records)
    # a truncated copy is caught by its size
    victim.write_bytes(good[:-10])
    ds2 = TokenWindows(remote, SEQ, storage=Storage(cache_dir=tmp_path, shard_cache_bytes=1 << 20))
    np.testing.assert_array_equal(ds2.read(ids)["tokens"], ref.read(ids)["tokens"])
    assert ds2.files.shard_cache is not None and ds2.files.shard_cache.stats.corrupt == 1
    assert victim.read_bytes() == good


def test_full_verify_on_open_catches_a_flip_the_quick_check_cannot_see(
    http_server: HttpServer, tmp_path: Path
) -> None:
    directory, url = http_server.new_dir()
    np.save(directory / "big.npy", np.arange(1_600_000, dtype=np.uint16))  # 3.2 MB > 2 x 1 MiB
    entry = build_manifest(url).shards[0]
    fs = fsspec.filesystem("http")
    quick = ShardCache(tmp_path, 1 << 23)
    path = Path(quick.path(entry, fs, f"{url}/big.npy", f"{url}/big.npy"))
    flip_byte(path, 1_600_000)  # in the middle: outside the quick digest's head and tail
    full = ShardCache(tmp_path, 1 << 23, verify_on_open="full")
    assert full.path(entry, fs, f"{url}/big.npy", f"{url}/big.npy") == str(path)
    assert (full.stats.corrupt, full.stats.fills) == (1, 1)
    assert "b3:" + blake3.blake3(path.read_bytes()).hexdigest() == entry.blake3
    # documented limit: the default (quick) open check reads only the first and last MiB
    flip_byte(path, 1_600_000)
    again = ShardCache(tmp_path, 1 << 23)
    again.path(entry, fs, f"{url}/big.npy", f"{url}/big.npy")
    assert again.stats.corrupt == 0


def test_cache_stays_under_its_byte_bound_with_lru_eviction(
    served: tuple[Manifest, Manifest, Path], tmp_path: Path
) -> None:
    local, remote, _ = served
    bound = 20_000  # room for 2 shards of ~8 KB
    ds = TokenWindows(remote, SEQ, storage=Storage(cache_dir=tmp_path, shard_cache_bytes=bound))
    ref = TokenWindows(local, SEQ)
    rng = np.random.default_rng(0)
    for _ in range(12):
        ids = rng.integers(0, ref.num_samples, size=rng.integers(1, 6))
        np.testing.assert_array_equal(ds.read(ids)["tokens"], ref.read(ids)["tokens"])
        on_disk = sum(f.stat().st_size for f in objects(tmp_path))
        assert ds.files.shard_cache is not None and on_disk == ds.files.shard_cache.usage() <= bound
    assert ds.files.shard_cache is not None and ds.files.shard_cache.stats.evictions > 0
    # LRU: with A and B cached, using A then filling C evicts B
    fs = fsspec.filesystem("http")
    cache = ShardCache(tmp_path / "lru", 2 * 8400)
    a, b, c = remote.shards[0], remote.shards[1], remote.shards[3]

    def get(e: Any) -> str:
        return cache.path(e, fs, remote.url(e), remote.url(e))

    get(a)
    get(b)
    os.utime(cache.object_path(a), ns=(0, 0))  # A looks old...
    get(a)  # ...until it is used again
    get(c)
    names = {p.name for p in objects(tmp_path / "lru")}
    assert names == {a.blake3[3:], c.blake3[3:]}


def test_shard_larger_than_the_cache_is_refused(
    served: tuple[Manifest, Manifest, Path], tmp_path: Path
) -> None:
    _, remote, _ = served
    ds = TokenWindows(remote, SEQ, storage=Storage(cache_dir=tmp_path, shard_cache_bytes=5000))
    with pytest.raises(ConfigError, match=r"shard s0\.npy .* more than the whole cache"):
        ds.read(np.array([0]))


def test_changed_remote_object_fails_the_fill_with_expected_and_found(
    http_server: HttpServer, tmp_path: Path
) -> None:
    directory, url = http_server.new_dir()
    np.save(directory / "x.npy", np.arange(5000, dtype=np.uint16))
    entry = build_manifest(url).shards[0]
    data = bytearray((directory / "x.npy").read_bytes())
    data[5000] ^= 1  # same size, other bytes
    (directory / "x.npy").write_bytes(bytes(data))
    cache = ShardCache(tmp_path, 1 << 20)
    with pytest.raises(VerificationError, match=r"shard x\.npy at http://.*/x\.npy") as info:
        cache.path(entry, fsspec.filesystem("http"), f"{url}/x.npy", f"{url}/x.npy")
    err = info.value
    assert err.expected == entry.blake3
    assert err.found == "b3:" + blake3.blake3(bytes(data)).hexdigest()
    assert objects(tmp_path) == [] and list((tmp_path / "tmp").iterdir()) == []


def _fill_all(cache_dir: str, manifest_json: str, url: str, queue: Any) -> None:
    manifest = Manifest.loads(manifest_json, root=url)
    cache = ShardCache(cache_dir, 1 << 20, retry=RetryPolicy(deadline_s=20, attempt_timeout_s=2))
    fs = fsspec.filesystem("http", skip_instance_cache=True)
    for entry in manifest.shards:
        cache.path(entry, fs, manifest.url(entry), manifest.url(entry))
    queue.put(cache.stats.fills)


def test_processes_sharing_a_cache_fill_each_shard_once(
    served: tuple[Manifest, Manifest, Path], http_server: HttpServer, tmp_path: Path
) -> None:
    _, remote, _ = served
    with FaultProxy(http_server.port) as proxy:  # a slow link makes the fills overlap
        proxy.set_plan(schedule(rate_bps=80_000))
        url = (remote.root or "").replace(f"127.0.0.1:{http_server.port}", proxy.address)
        ctx = mp.get_context("spawn")
        queue = ctx.Queue()
        doc = Manifest.to_json(remote)
        import json

        procs = [
            ctx.Process(target=_fill_all, args=(str(tmp_path), json.dumps(doc), url, queue))
            for _ in range(3)
        ]
        for p in procs:
            p.start()
        fills = [queue.get(timeout=60) for _ in procs]
        for p in procs:
            p.join(timeout=30)
    assert sum(fills) == len(SIZES)  # one download per shard in all, whoever did it
    for entry in remote.shards:
        path = tmp_path / "objects" / entry.blake3[3:]
        assert "b3:" + blake3.blake3(path.read_bytes()).hexdigest() == entry.blake3


def test_table_rows_read_through_the_cache(http_server: HttpServer, tmp_path: Path) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    directory, url = http_server.new_dir()
    table = pa.table({"row": np.arange(200, dtype=np.int64), "text": [f"t{i}" for i in range(200)]})
    pq.write_table(table.slice(0, 120), directory / "a.parquet", row_group_size=50)
    pq.write_table(table.slice(120), directory / "b.parquet", row_group_size=50)
    local = TableRows(build_manifest(str(directory)))
    ds = TableRows(
        build_manifest(url), storage=Storage(cache_dir=tmp_path, shard_cache_bytes=1 << 20)
    )
    ids = np.random.default_rng(2).integers(0, 200, size=50)
    got, want = ds.read(ids), local.read(ids)
    for name in want:
        np.testing.assert_array_equal(got[name], want[name])
    assert ds.files.shard_cache is not None and ds.files.shard_cache.stats.fills == 2


def test_bad_cache_arguments(served: tuple[Manifest, Manifest, Path], tmp_path: Path) -> None:
    _, remote, _ = served
    with pytest.raises(ConfigError, match=r"Storage.shard_cache_bytes: expected None without"):
        TokenWindows(
            remote, SEQ, storage=Storage(cache_dir=None, shard_cache_bytes=100)
        )  # no cache: no bound
    with pytest.raises(ConfigError, match=r"Storage\.shard_cache_bytes: expected an integer >= 1"):
        TokenWindows(remote, SEQ, storage=Storage(shard_cache_bytes=0))  # the default cache's
    with pytest.raises(ConfigError, match=r"Storage\.shard_cache_bytes: expected an integer >= 1"):
        TokenWindows(remote, SEQ, storage=Storage(cache_dir=tmp_path, shard_cache_bytes=0))
    with pytest.raises(ConfigError, match="cache_dir must be a local directory"):
        ShardCache("s3://bucket/cache", 100)
    with pytest.raises(ConfigError, match="verify_on_open"):
        ShardCache(tmp_path, 100, verify_on_open="none")


def test_cache_bytes_is_refused_naming_shard_cache_bytes(
    served: tuple[Manifest, Manifest, Path], tmp_path: Path
) -> None:
    _, remote, _ = served
    new = TokenWindows(remote, SEQ, storage=Storage(cache_dir=tmp_path, shard_cache_bytes=1 << 20))
    assert new.files.shard_cache_bytes == 1 << 20
    assert new.files.shard_cache is not None
    assert new.files.shard_cache.max_bytes == 1 << 20
    assert new.identity() == TokenWindows(remote, SEQ).identity()
    with pytest.raises(
        ConfigError, match=r"hint: pass storage=detdata\.Storage\(shard_cache_bytes="
    ):
        TokenWindows(remote, SEQ, cache_bytes=1 << 20)  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="without a cache"):
        TokenWindows(remote, SEQ, storage=Storage(cache_dir=None, shard_cache_bytes=100))


def test_token_windows_cache_verify_full_refetches_a_mid_file_flip(
    http_server: HttpServer, tmp_path: Path
) -> None:
    directory, url = http_server.new_dir()
    np.save(directory / "big.npy", np.arange(1_600_000, dtype=np.uint16))  # 3.2 MB > 2 x 1 MiB
    manifest = build_manifest(url)
    ids = np.arange(0, 6000, 997)
    first = TokenWindows(
        manifest, 256, storage=Storage(cache_dir=tmp_path / "c", cache_verify="full")
    )
    expected = first.read(ids)["tokens"].copy()
    (copy,) = objects(tmp_path / "c")
    flip_byte(copy, 1_600_000)  # middle of the file: invisible to the quick open check
    again = TokenWindows(
        manifest, 256, storage=Storage(cache_dir=tmp_path / "c", cache_verify="full")
    )
    np.testing.assert_array_equal(again.read(ids)["tokens"], expected)
    assert again.files.shard_cache is not None and again.files.shard_cache.stats.corrupt == 1
    with pytest.raises(ConfigError, match="cache_verify"):
        TokenWindows(
            manifest, 256, storage=Storage(cache_dir=tmp_path / "c", cache_verify="sometimes")
        )


def test_a_copy_not_known_whole_in_this_boot_is_checked_in_full_once(
    http_server: HttpServer, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Fills are not fsync-ed: a copy not recorded as whole in the machine's current boot
    (filled, or hashed in full, in it) may have lost writes in a crash, so its first open
    in this boot hashes every byte (a loss in the middle, which the quick check cannot
    see, is caught and fetched again); a copy found whole is recorded, and later opens in
    this boot check it as usual. Touching, chmod-ing or copying a copy changes nothing."""
    directory, url = http_server.new_dir()
    np.save(directory / "big.npy", np.arange(1_600_000, dtype=np.uint16))  # 3.2 MB
    entry = build_manifest(url).shards[0]
    fs = fsspec.filesystem("http")
    shard = f"{url}/big.npy"
    path = Path(ShardCache(tmp_path, 1 << 23).path(entry, fs, shard, shard))
    flip_byte(path, 1_600_000)  # what a crash lost: outside the quick digest's head and tail
    os.chmod(path, 0o644)  # a chmod -R after the boot (moves the ctime): no proof of anything
    monkeypatch.setattr(boot, "boot_id", lambda: "0" * 8 + "-0000-4000-8000-" + "0" * 12)
    after = ShardCache(tmp_path, 1 << 23)  # the machine booted since the fill
    # the old boot's record stays (it may be another machine's, sharing the folder) and is
    # not this boot's: the copy is hashed in full below
    assert len(list(tmp_path.glob("checked-*"))) == 1
    assert after.path(entry, fs, shard, shard) == str(path)
    assert (after.stats.corrupt, after.stats.fills) == (1, 1)
    assert "b3:" + blake3.blake3(path.read_bytes()).hexdigest() == entry.blake3
    # booted again: the whole copy is hashed in full once, recorded, then checked as usual
    monkeypatch.setattr(boot, "boot_id", lambda: "1" * 8 + "-0000-4000-8000-" + "0" * 12)
    forget_verified()
    whole = ShardCache(tmp_path, 1 << 23)
    assert whole.path(entry, fs, shard, shard) == str(path)
    assert (whole.stats.corrupt, whole.stats.fills, whole.stats.digests) == (0, 0, 1)
    flip_byte(path, 1_600_000)  # a change within this boot is no crash: quick, as before
    forget_verified()
    again = ShardCache(tmp_path, 1 << 23)  # another process of this boot
    again.path(entry, fs, shard, shard)
    assert again.stats.corrupt == 0
