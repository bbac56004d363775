"""Shared, generic fixtures."""

from __future__ import annotations

import os
import sys

# gcsfs >= 2026 first asks the bucket's type over gRPC (experimental zonal/HNS support); a
# local GCS emulator speaks only the JSON API, so every call would wait 60 s for that probe.
# Set before anything imports gcsfs. It changes transport only, never bytes.
os.environ.setdefault("GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT", "false")
# Compiled bytecode is cached (``__pycache__``, ignored by git) even where the environment
# says not to (PYTHONDONTWRITEBYTECODE=1, as this project's CI image sets): the suite starts
# hundreds of Python processes (the CLI, scripts, worker processes, ranks), and each would
# compile detdata and the test helpers from source again, about a third of a CLI call's CPU.
# It changes which files Python reads at import, never a result. (Empty is unset.)
os.environ["PYTHONDONTWRITEBYTECODE"] = ""

from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np
import pytest

from tests import servers, soak
from tests.faultproxy import FaultProxy

sys.dont_write_bytecode = False  # this process too (see PYTHONDONTWRITEBYTECODE above)


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


# --- soak counts and the order tests start in ---------------------------------------------
def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--soak",
        action="store_true",
        default=False,
        help="run soak and stress tests at their full counts (tests/soak.py); "
        "the same as DETDATA_SOAK=1 or -m slow",
    )


def pytest_configure(config: pytest.Config) -> None:
    """``--soak`` or a ``-m`` expression selecting ``slow`` asks for the full soak counts: set
    before any test module is imported (their counts are read at import), inherited by the
    xdist workers and every subprocess. An explicit ``DETDATA_SOAK=0`` keeps the bounded
    counts for ``-m slow`` (``make test-slow``, CI); ``--soak`` overrides it."""
    markexpr = config.getoption("markexpr", "") or ""
    if config.getoption("--soak") or (
        soak.requested(markexpr, False) and os.environ.get(soak.ENV) != "0"
    ):
        os.environ[soak.ENV] = "1"


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """The test files that take longest start first (`LONGEST_FIRST`), so that with ``-n 2``
    the short ones fill in at the end and both workers finish together. A file's tests stay
    together and in their order (module fixtures are built once per worker)."""
    rank = {path: i for i, path in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.nodeid.split("::", 1)[0], len(rank)))


#: The test files that take longest, longest first (summed test times of a ``-n 2`` run:
#: ``pytest --durations=0``); the order matters, not the exact times. A file missing here
#: only starts later; one that became long belongs near the top.
LONGEST_FIRST: tuple[str, ...] = (
    "tests/integrations/test_lightning.py",
    "tests/cli/test_cli_replay.py",
    "tests/integrations/test_accelerate.py",
    "tests/loading/test_error_classes.py",
    "tests/cli/test_cli_env.py",
    "tests/cli/test_cli_output_files.py",
    "tests/datasets/test_bounded_handles.py",
    "tests/cli/test_cli_exit_codes.py",
    "tests/identity/test_receipts.py",
    "tests/test_examples.py",
    "tests/identity/test_verify_once.py",
    "tests/test_bench_startup_smoke.py",
    "tests/integrations/test_torchtitan.py",
    "tests/loading/test_evidence.py",
    "tests/integrations/test_transformers.py",
    "tests/cli/test_plots.py",
    "tests/cli/test_cli_where.py",
    "tests/identity/test_manifest_id.py",
    "tests/loading/test_workers_slots.py",
    "tests/cli/test_plot_output.py",
    "tests/test_no_secret_in_output.py",
    "tests/cli/test_cli_server_down.py",
    "tests/identity/test_columns.py",
    "tests/loading/test_counting.py",
    "tests/loading/test_ctrl_c_storm.py",
    "tests/test_bench_smoke.py",
    "tests/test_readme.py",
    "tests/storage/test_remote.py",
    "tests/loading/test_record.py",
    "tests/datasets/test_built_once.py",
    "tests/integrations/test_olmo_core.py",
    "tests/loading/test_options.py",
    "tests/loading/test_dcp_mid_step.py",
    "tests/test_bad_inputs.py",
    "tests/cli/test_cli_mix.py",
    "tests/test_bench_scale_smoke.py",
    "tests/datasets/test_derived_files.py",
    "tests/datasets/test_window_index.py",
    "tests/loading/test_inline_prefetch.py",
    "tests/loading/test_loader.py",
    "tests/identity/test_crash_safety.py",
    "tests/identity/test_path_blocks.py",
    "tests/cli/test_cli_split.py",
    "tests/cli/test_cli_manifest.py",
    "tests/datasets/test_tokens.py",
    "tests/identity/test_registry.py",
    "tests/identity/test_parts.py",
    "tests/datasets/test_documents_packed.py",
    "tests/storage/test_cache_shared.py",
    "tests/loading/test_identity.py",
    "tests/loading/test_distributed.py",
    "tests/identity/test_names.py",
    "tests/test_lean_install.py",
    "tests/datasets/test_tables.py",
    "tests/storage/test_http_status.py",
)
