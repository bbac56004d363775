"""Remote shards read through the default per-user cache (``TokenWindows`` without
``cache_dir``) and the default lookahead of ``DataLoader``: same bytes as local reads.

Real servers (nginx and SeaweedFS, tests/servers.py). The conftest points
``DETDATA_CACHE_DIR`` at a fresh folder per test (never the user's cache). Checked here:
a default-configured dataset and loader over HTTP and S3 deliver the writer's bytes (and
the local dataset's batches), through whole verified copies in that folder; the folder
never holds more than its bound while a loader with its default lookahead runs; the folder
removed mid-run is recreated; a local root, a folder that cannot be written and a bound
too small for the shards fall back to range reads (logged), with the same bytes.
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
import shutil
import uuid
from pathlib import Path
from typing import Any

import fsspec
import numpy as np
import pytest

import detdata
from detdata import Storage
from detdata.datasets.shard_storage import USER_CACHE_MIN_SHARDS, user_cache_dir
from detdata.datasets.tokens import TokenWindows
from tests.servers import HttpServer, S3Server

pytestmark = pytest.mark.multiproc

SEQ = 31
SHARDS = 10
TOKENS = 4_000  # 8 KB of uint16 per shard (+ the .npy header)


@pytest.fixture(scope="module")
def corpus(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[np.ndarray]]:
    root = tmp_path_factory.mktemp("default-cache-corpus")
    rng = np.random.default_rng(33)
    arrays = [rng.integers(0, 60_000, TOKENS + 7 * i).astype(np.uint16) for i in range(SHARDS)]
    for i, a in enumerate(arrays):
        np.save(root / f"s{i:02d}.npy", a)
    return root, arrays


@pytest.fixture(scope="module")
def http_site(http_server: HttpServer, corpus: tuple[Path, list[np.ndarray]]) -> str:
    directory, url = http_server.new_dir()
    shutil.copytree(corpus[0], directory, dirs_exist_ok=True)
    return url


@pytest.fixture(scope="module")
def s3_site(s3_server: S3Server, corpus: tuple[Path, list[np.ndarray]]) -> str:
    fs = fsspec.filesystem("s3", **s3_server.storage_options())
    prefix = f"{s3_server.bucket}/{uuid.uuid4().hex[:12]}"
    for path in sorted(corpus[0].iterdir()):
        fs.pipe_file(f"{prefix}/{path.name}", path.read_bytes())
    return f"s3://{prefix}"


def _expected(arrays: list[np.ndarray], ids: np.ndarray) -> np.ndarray:
    """The windows at ``ids``, cut from the writer's arrays (brute force)."""
    rows = [a[w * SEQ : w * SEQ + SEQ + 1] for a in arrays for w in range((len(a) - 1) // SEQ)]
    return np.stack([rows[i] for i in ids.tolist()]).astype(np.int32)


def _remote(
    request: pytest.FixtureRequest, store: str, corpus: tuple[Path, list[np.ndarray]]
) -> tuple[detdata.Manifest, dict[str, Any]]:
    local = detdata.build_manifest(str(corpus[0]))
    if store == "s3":
        server: S3Server = request.getfixturevalue("s3_server")
        return local.with_root(request.getfixturevalue("s3_site")), server.storage_options()
    return local.with_root(request.getfixturevalue("http_site")), {}


def _batches(data: TokenWindows, count: int, micro: int = 4, seed: int = 9) -> list[np.ndarray]:
    loader = detdata.DataLoader(data, global_batch_size=8, micro_batch_size=micro, seed=seed)
    return [np.asarray(b["tokens"]).copy() for _, b in zip(range(count), loader, strict=False)]


def _objects(folder: Path) -> list[Path]:
    objects = folder / "objects"
    return sorted(objects.iterdir()) if objects.is_dir() else []


def _usage(folder: Path) -> int:
    """Bytes of copies and fills in the cache folder, from the disk, scanned while holding the
    folder's ``.lock`` (the cache evicts and reserves space only under it, so no copy is
    deleted and no fill started mid-scan). Copies first, then fills: a fill renamed into
    objects/ between the two scans is missed, never counted twice."""
    fd = os.open(folder / ".lock", os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        return _bytes_in(folder / "objects") + _bytes_in(folder / "tmp")
    finally:
        os.close(fd)


def _bytes_in(folder: Path) -> int:
    """Bytes of the files in ``folder``, from the disk (a file evicted meanwhile counts 0)."""
    total = 0
    with contextlib.suppress(FileNotFoundError), os.scandir(folder) as entries:
        for entry in entries:
            with contextlib.suppress(FileNotFoundError):
                total += entry.stat().st_size
    return total


@pytest.mark.parametrize("store", ["http", "s3"])
def test_default_remote_reads_equal_local_through_the_user_cache(
    store: str, request: pytest.FixtureRequest, corpus: tuple[Path, list[np.ndarray]]
) -> None:
    manifest, opts = _remote(request, store, corpus)
    arrays = corpus[1]
    folder = Path(os.environ["DETDATA_CACHE_DIR"])
    assert user_cache_dir() == str(folder)
    remote = TokenWindows(
        manifest, SEQ, storage=Storage(fs_options=opts)
    )  # no cache_dir: the default
    local = TokenWindows(detdata.build_manifest(str(corpus[0])), SEQ)
    assert remote.files.cache_dir == str(folder) and local.files.cache_dir is None
    ids = np.random.default_rng(4).permutation(remote.num_samples)[:100]
    np.testing.assert_array_equal(remote.read(ids)["tokens"], _expected(arrays, ids))
    copies = _objects(folder)
    assert copies and all(p.stat().st_size in {s.bytes for s in manifest.shards} for p in copies)
    # a default loader (default lookahead) over a fresh remote dataset: the local batches
    fresh = TokenWindows(manifest, SEQ, storage=Storage(fs_options=opts))
    got, want = _batches(fresh, 30), _batches(local, 30)
    assert len(got) == len(want) == 30
    for a, b in zip(got, want, strict=True):
        np.testing.assert_array_equal(a, b)
    assert len(_objects(folder)) == SHARDS  # every shard read was a whole verified copy


def test_the_default_cache_stays_within_its_bound(
    request: pytest.FixtureRequest, corpus: tuple[Path, list[np.ndarray]]
) -> None:
    manifest, _ = _remote(request, "http", corpus)
    largest = max(s.bytes for s in manifest.shards)
    bound = largest * USER_CACHE_MIN_SHARDS  # the least the default cache accepts
    folder = Path(os.environ["DETDATA_CACHE_DIR"])
    ds = TokenWindows(manifest, SEQ, storage=Storage(shard_cache_bytes=bound))
    # the corpus is larger than the bound: under the default global shuffle, range reads
    assert ds.files.cache_dir is None
    order = detdata.LocalityOrder(window_shards=2)  # 2 windows of 2 shards fit: engaged
    loader = detdata.DataLoader(ds, global_batch_size=8, micro_batch_size=8, seed=1, order=order)
    assert ds.files.cache_dir == str(folder) and ds.files.shard_cache_bytes == bound
    local = TokenWindows(detdata.build_manifest(str(corpus[0])), SEQ)
    want = [
        np.asarray(b["tokens"]).copy()
        for _, b in zip(
            range(local.num_samples // 8),
            detdata.DataLoader(local, global_batch_size=8, micro_batch_size=8, seed=1, order=order),
            strict=False,
        )
    ]
    got = []
    most = 0
    for i, batch in zip(range(len(want)), loader, strict=False):
        got.append(np.asarray(batch["tokens"]).copy())
        used = _usage(folder)
        most = max(most, used)
        assert used <= bound, (i, used, bound)
    assert most > largest  # the cache was used (more than one copy at a time)
    for a, b in zip(got, want, strict=True):
        np.testing.assert_array_equal(a, b)
    assert len(got) == len(want)
    assert ds.files.shard_cache is not None and ds.files.shard_cache.stats.fills >= SHARDS


def test_a_corpus_larger_than_the_default_bound_is_cached_for_a_locality_order_only(
    request: pytest.FixtureRequest,
    corpus: tuple[Path, list[np.ndarray]],
    caplog: pytest.LogCaptureFixture,
) -> None:
    manifest, _ = _remote(request, "http", corpus)
    largest = max(s.bytes for s in manifest.shards)
    local = TokenWindows(detdata.build_manifest(str(corpus[0])), SEQ)
    # global shuffle: range reads (a whole shard per sample would be fetched otherwise)
    shuffled = TokenWindows(manifest, SEQ, storage=Storage(shard_cache_bytes=5 * largest))
    got = _batches(shuffled, 12)
    assert shuffled.files.cache_dir is None and not _objects(Path(os.environ["DETDATA_CACHE_DIR"]))
    for a, b in zip(got, _batches(local, 12), strict=True):
        np.testing.assert_array_equal(a, b)
    # a locality window too large for two windows in the bound: range reads, logged
    caplog.set_level(logging.WARNING, "detdata.cache")
    wide = TokenWindows(manifest, SEQ, storage=Storage(shard_cache_bytes=5 * largest))
    detdata.OrderedStream(wide, 3, order=detdata.LocalityOrder(window_shards=3))
    assert wide.files.cache_dir is None
    assert any("too small for two windows" in r.getMessage() for r in caplog.records)


def test_the_default_cache_folder_removed_mid_run_is_recreated(
    request: pytest.FixtureRequest,
    corpus: tuple[Path, list[np.ndarray]],
    caplog: pytest.LogCaptureFixture,
) -> None:
    manifest, opts = _remote(request, "s3", corpus)
    folder = Path(os.environ["DETDATA_CACHE_DIR"])
    local = TokenWindows(detdata.build_manifest(str(corpus[0])), SEQ)
    want = _batches(local, 24)
    ds = TokenWindows(manifest, SEQ, storage=Storage(fs_options=opts))
    loader = detdata.DataLoader(ds, global_batch_size=8, micro_batch_size=4, seed=9)
    caplog.set_level(logging.WARNING, "detdata.cache")
    got = []
    for i, batch in zip(range(24), loader, strict=False):
        got.append(np.asarray(batch["tokens"]).copy())
        if i in (0, 2):
            shutil.rmtree(folder, ignore_errors=True)  # a tmp cleaner, while shards are filled
    for a, b in zip(got, want, strict=True):
        np.testing.assert_array_equal(a, b)
    assert any("was removed while in use" in r.getMessage() for r in caplog.records)
    assert _objects(folder)  # recreated and filled again


def test_fallbacks_to_range_reads_are_logged_and_read_the_same_bytes(
    request: pytest.FixtureRequest,
    corpus: tuple[Path, list[np.ndarray]],
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    manifest, _ = _remote(request, "http", corpus)
    arrays = corpus[1]
    ids = np.arange(0, 1200, 7)
    # a local root: no cache at all (the files are read in place)
    assert TokenWindows(detdata.build_manifest(str(corpus[0])), SEQ).files.cache_dir is None
    # a bound under USER_CACHE_MIN_SHARDS of the largest shard
    caplog.set_level(logging.WARNING, "detdata.cache")
    small = TokenWindows(
        manifest, SEQ, storage=Storage(shard_cache_bytes=max(s.bytes for s in manifest.shards))
    )
    assert small.files.cache_dir is None
    assert any("range requests" in r.getMessage() for r in caplog.records)
    np.testing.assert_array_equal(small.read(ids)["tokens"], _expected(arrays, ids))
    # a folder that cannot be made (a file is in the way)
    caplog.clear()
    blocker = tmp_path / "a-file"
    blocker.write_text("not a folder")
    monkeypatch.setenv("DETDATA_CACHE_DIR", str(blocker / "shards"))
    blocked = TokenWindows(manifest, SEQ)
    assert blocked.files.cache_dir is None
    assert any(str(blocker) in r.getMessage() for r in caplog.records)
    np.testing.assert_array_equal(blocked.read(ids)["tokens"], _expected(arrays, ids))
    # cache_dir=None: the coalesced range reads, as asked
    assert TokenWindows(manifest, SEQ, storage=Storage(cache_dir=None)).files.cache_dir is None
