"""The shard cache survives its folder being removed mid-run and names it when unusable.

Real remote reads (nginx, tests/servers.py) through ``cache_dir``: a tmp cleaner removes
the whole cache folder between reads; the next reads recreate it (with a warning), fetch
the copies again and deliver the writer's bytes. A cache folder replaced by a file (what
no process can write into, root included) or made read-only is a `StorageError` naming the
folder, in the reader and in a DataLoader with worker processes.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import numpy as np
import pytest

import detdata
from detdata import Storage
from detdata.base.errors import StorageError
from detdata.datasets.tokens import TokenWindows
from tests.servers import HttpServer

pytestmark = pytest.mark.multiproc

SEQ = 15
SIZES = (900, 700, 1100)


@pytest.fixture(scope="module")
def site(http_server: HttpServer) -> tuple[list[np.ndarray], detdata.Manifest]:
    directory, url = http_server.new_dir()
    rng = np.random.default_rng(11)
    arrays = [rng.integers(0, 60_000, n).astype(np.uint16) for n in SIZES]
    for i, a in enumerate(arrays):
        np.save(directory / f"s{i}.npy", a)
    return arrays, detdata.build_manifest(str(directory)).with_root(url)


def _expected(arrays: list[np.ndarray], ids: np.ndarray) -> np.ndarray:
    rows = [a[w * SEQ : w * SEQ + SEQ + 1] for a in arrays for w in range((len(a) - 1) // SEQ)]
    return np.stack([rows[i] for i in ids.tolist()])


def test_a_removed_cache_folder_is_recreated_and_refilled(
    site: tuple[list[np.ndarray], detdata.Manifest], tmp_path: Path
) -> None:
    arrays, manifest = site
    cache = tmp_path / "cache"
    windows = TokenWindows(manifest, SEQ, storage=Storage(cache_dir=cache))
    every = np.arange(windows.num_samples)
    first = every[::7]
    assert np.array_equal(windows.read(first)["tokens"], _expected(arrays, first))
    shutil.rmtree(cache)  # a tmp cleaner
    with _warns_removed():
        got = windows.read(every)["tokens"]
    assert np.array_equal(got, _expected(arrays, every))
    assert (cache / "objects").is_dir() and len(list((cache / "objects").iterdir())) == 3
    # removed again mid-run of a loader: batches equal an uninterrupted run
    straight = [b["tokens"].copy() for b in _run(TokenWindows(manifest, SEQ), 12, None)]
    got_batches = [b["tokens"].copy() for b in _run(windows, 12, cache)]
    assert all(np.array_equal(a, b) for a, b in zip(straight, got_batches, strict=True))


def _run(windows: TokenWindows, count: int, remove: Path | None) -> list[dict[str, np.ndarray]]:
    loader = detdata.DataLoader(windows, global_batch_size=8, micro_batch_size=8, seed=2)
    out = []
    for i, batch in zip(range(count), loader, strict=False):
        out.append({k: np.asarray(v) for k, v in batch.items()})
        if remove is not None and i % 4 == 1:
            shutil.rmtree(remove, ignore_errors=True)
    return out


class _warns_removed:
    """The recreation is logged as a warning on the ``detdata.cache`` logger."""

    def __enter__(self) -> None:
        import logging

        self.records: list[logging.LogRecord] = []
        self.handler = logging.Handler()
        self.handler.emit = self.records.append  # type: ignore[method-assign]
        logging.getLogger("detdata.cache").addHandler(self.handler)

    def __exit__(self, *exc: object) -> None:
        import logging

        logging.getLogger("detdata.cache").removeHandler(self.handler)
        if exc[0] is None:
            assert any("was removed" in r.getMessage() for r in self.records)


def _make_unusable(cache: Path, how: str) -> None:
    shutil.rmtree(cache)
    if how == "a-file":
        cache.write_bytes(b"not a folder")
    else:
        cache.mkdir()
        cache.chmod(0o555)


@pytest.mark.parametrize("how", ["a-file", "read-only"])
def test_an_unusable_cache_folder_is_a_storage_error_naming_it(
    site: tuple[list[np.ndarray], detdata.Manifest], tmp_path: Path, how: str
) -> None:
    if how == "read-only" and os.geteuid() == 0:
        how = "a-file"  # permission bits do not bind root: the file variant is tested twice
    manifest = site[1]
    cache = tmp_path / "cache"
    windows = TokenWindows(manifest, SEQ, storage=Storage(cache_dir=cache))
    windows.read(np.arange(3))
    _make_unusable(cache, how)
    try:
        with pytest.raises(StorageError, match=f"shard cache folder {cache}"):
            TokenWindows(manifest, SEQ, storage=Storage(cache_dir=cache)).read(
                np.arange(windows.num_samples)
            )
        with pytest.raises(StorageError, match=f"shard cache folder {cache}"):
            windows.read(np.arange(windows.num_samples))
        loader = detdata.DataLoader(
            windows, global_batch_size=8, micro_batch_size=8, seed=2, num_workers=1
        )
        with pytest.raises(StorageError, match="shard cache folder"):
            for _ in loader:
                pass
    finally:
        if cache.is_dir():
            cache.chmod(0o755)
