"""Shared, generic fixtures."""

from __future__ import annotations

import os

# gcsfs >= 2026 first asks the bucket's type over gRPC (experimental zonal/HNS support); a
# local GCS emulator speaks only the JSON API, so every call would wait 60 s for that probe.
# Set before anything imports gcsfs. It changes transport only, never bytes.
os.environ.setdefault("GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT", "false")

from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np
import pytest

from tests import servers
from tests.faultproxy import FaultProxy


def write_token_shards(
    root: Path, sizes: tuple[int, ...] = (1000, 2500, 40), dtype: str = "uint16", seed: int = 0
) -> list[Path]:
    """Write ``shard-XXX.npy`` 1-D token files of the given sizes under ``root``; return their
    paths."""
    root.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    paths = []
    for i, size in enumerate(sizes):
        path = root / f"shard-{i:03d}.npy"
        np.save(path, rng.integers(0, 50_000, size=size).astype(dtype))
        paths.append(path)
    return paths


@pytest.fixture
def token_shards(tmp_path: Path) -> Path:
    """A directory ``tmp_path/data`` holding three small uint16 ``.npy`` token shards."""
    root = tmp_path / "data"
    write_token_shards(root)
    return root


# --- real storage servers for the remote tests (tests/servers.py) -----------------------
@pytest.fixture(scope="session")
def s3_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[servers.S3Server]:
    """One SeaweedFS (S3) on 127.0.0.1 for the whole run (shared by xdist workers)."""
    yield from servers.shared_server(
        "seaweedfs", tmp_path_factory, servers.start_seaweedfs, servers.S3Server, grace_s=3.0
    )


@pytest.fixture(scope="session")
def http_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[servers.HttpServer]:
    """One HTTP server with Range support (nginx, or Twisted's) on 127.0.0.1 for the run."""
    yield from servers.shared_server(
        "http", tmp_path_factory, servers.start_http, servers.HttpServer, grace_s=5.0
    )


@pytest.fixture(scope="session")
def gcs_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[servers.GcsServer]:
    """One gcp-storage-emulator (GCS JSON API) on 127.0.0.1 for the whole run."""
    yield from servers.shared_server(
        "gcs-emulator", tmp_path_factory, servers.start_gcs_emulator, servers.GcsServer, grace_s=3.0
    )


@pytest.fixture
def fault_proxy() -> Iterator[Callable[[int], FaultProxy]]:
    """Factory: ``fault_proxy(target_port)`` starts a `FaultProxy`; all are stopped afterwards."""
    started: list[FaultProxy] = []

    def make(port: int) -> FaultProxy:
        proxy = FaultProxy(port).start()
        started.append(proxy)
        return proxy

    yield make
    for proxy in started:
        proxy.stop()


@pytest.fixture(autouse=True)
def _receipts_per_test(
    tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Verification receipts (detdata.identity.receipts) of each test in a folder of its own
    (subprocesses inherit it), never in the user's cache."""
    monkeypatch.setenv("DETDATA_RECEIPTS", str(tmp_path_factory.mktemp("receipts")))
    # the default shard cache of remote roots (detdata.datasets.shard_storage.user_cache) likewise
    monkeypatch.setenv("DETDATA_CACHE_DIR", str(tmp_path_factory.mktemp("shard-cache")))
