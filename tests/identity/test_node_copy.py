"""One manifest read per node (docs/design.md section 8, issue 43): under torchrun (4 ranks,
gloo, one node) the node's first rank to load a manifest reads (local root) or fetches
(HTTP root) it once, and the 3 others map its node copy. A node copy changed under them is
refused, named, and the manifest read again; a reader's error (a missing manifest) is named
on every rank.

Covers: detdata/identity/node_copy.py.

What is counted, by the kernel or the server, never by detdata: the bytes each rank read
(``rchar`` of /proc/self/io) and the opens of the original manifest files (CPython's
``open`` audit events), in the children (tests/dist/node_copy_check.py), and
the HTTP requests that reached the server (a real nginx/Twisted behind the counting proxy,
tests/faultproxy.py). The references are the writer's own manifest (its id and shard
count) and one load of the same URL in this process through the same proxy.
"""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from detdata import Manifest, build_manifest
from detdata.identity.columns import columns_path
from tests.faultproxy import FaultProxy, schedule
from tests.servers import HttpServer

pytestmark = [pytest.mark.multiproc, pytest.mark.slow]

SCRIPT = Path(__file__).resolve().parents[1] / "dist" / "node_copy_check.py"
REPO = Path(__file__).resolve().parents[2]
RANKS = 4
#: seconds the node's reader is stalled by the server, and the store's timeout meanwhile
STALL, WAIT = 10.0, 2.0
Phases = dict[str, list[dict[str, Any]]]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _manifest(folder: Path, shards: int) -> tuple[Manifest, Path]:
    """A corpus of ``shards`` small token files and its manifest (JSON and fast form)."""
    folder.mkdir()
    rng = np.random.default_rng(7)
    for i in range(shards):
        np.save(folder / f"part-{i:05d}.npy", rng.integers(0, 60_000, 8).astype(np.uint16))
    manifest = build_manifest(str(folder))
    manifest.save(str(folder / "manifest.json"))
    return manifest, folder / "manifest.json"


def _run(phases: list[dict[str, Any]], warm: Path, out: Path, cache: Path) -> Phases:
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    env["DETDATA_CACHE_DIR"] = str(cache)
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(RANKS)]
    command += ["--master-addr", "127.0.0.1", "--master-port", str(_free_port())]
    command += [str(SCRIPT), json.dumps(phases), str(warm), str(out)]
    subprocess.run(command, check=True, env=env, timeout=400, capture_output=True)
    ranks = [json.loads(Path(f"{out}.rank{r}").read_text()) for r in range(RANKS)]
    return {p["name"]: [r[p["name"]] for r in ranks] for p in phases}


@pytest.fixture(scope="module")
def job(
    tmp_path_factory: pytest.TempPathFactory,
    http_server: HttpServer,
) -> Iterator[dict[str, Any]]:
    """One torchrun job of 4 ranks through every phase; what the kernel and the server saw."""
    tmp = tmp_path_factory.mktemp("node-copy")
    plain, plain_path = _manifest(tmp / "plain", 1500)
    os.unlink(columns_path(str(plain_path)))  # the JSON alone
    fast, fast_path = _manifest(tmp / "fast", 1200)
    warm = _manifest(tmp / "warm", 3)[1]
    served, url = http_server.new_dir()
    (served / "manifest.json").write_bytes(plain_path.read_bytes())
    tampered = tmp / "tampered.json"
    tampered.write_bytes(plain_path.read_bytes())
    proxy = FaultProxy(http_server.port).start()
    url = url.replace(f"127.0.0.1:{http_server.port}", proxy.address) + "/manifest.json"
    stalling = FaultProxy(http_server.port, schedule(stall_at=(0,), stall_s=STALL)).start()
    stalled = url.replace(proxy.address, stalling.address)  # its first answer held STALL s
    Manifest.load(url, verify="off")  # the reference: one load of this URL, in one process
    one_load = proxy.stats.requests
    phases = [
        {"name": "plain", "path": str(plain_path), "tamper": False},
        {"name": "fast", "path": str(fast_path), "tamper": False},
        {"name": "missing", "path": str(tmp / "absent" / "manifest.json"), "tamper": False},
        {"name": "http", "path": url, "tamper": False},
        {"name": "tampered", "path": str(tampered), "tamper": True},
        {"name": "stalled", "path": stalled, "tamper": False, "wait_s": WAIT},
    ]
    try:
        ranks = _run(phases, warm, tmp / "out", tmp / "cache")
        yield {
            "ranks": ranks,
            "requests": proxy.stats.requests - one_load,
            "one_load": one_load,
            "plain": (plain, plain_path),
            "fast": (fast, fast_path),
        }
    finally:
        proxy.stop()
        stalling.stop()


def _readers(ranks: list[dict[str, Any]], size: int) -> list[int]:
    return [r["rank"] for r in ranks if r["read"] >= size]


def test_a_local_manifest_is_read_by_one_rank_of_the_node_the_others_map_its_copy(
    job: dict[str, Any],
) -> None:
    manifest, path = job["plain"]
    ranks = job["ranks"]["plain"]
    size = path.stat().st_size
    assert [(r["id"], r["shards"]) for r in ranks] == [(manifest.id, 1500)] * RANKS, ranks
    assert len(_readers(ranks, size)) == 1, ranks  # one rank read the JSON ...
    assert sorted(r["read"] for r in ranks)[:3] < [size // 50] * 3, ranks  # ... the rest ~0
    assert [len(r["opened"]) for r in ranks].count(0) == RANKS - 1, ranks  # nor opened it


def test_a_fast_form_manifest_and_its_columns_are_opened_once_on_the_node(
    job: dict[str, Any],
) -> None:
    manifest, path = job["fast"]
    ranks = job["ranks"]["fast"]
    assert [(r["id"], r["shards"]) for r in ranks] == [(manifest.id, 1200)] * RANKS, ranks
    # one rank opened the JSON and its columns, once each; nobody else opened them ...
    assert [r["opened"] for r in ranks].count([]) == RANKS - 1, ranks
    (reader,) = _readers(ranks, Path(columns_path(str(path))).stat().st_size)
    # ... and read the columns in full, and of the JSON only its head (the fields before
    # the shards, as every rank read it before: the JSON's entries are the columns')
    assert ranks[reader]["read"] < Path(columns_path(str(path))).stat().st_size + 40_000, ranks
    assert sorted(ranks[reader]["opened"]) == [str(path), columns_path(str(path))], ranks


def test_an_http_manifest_is_fetched_once_for_the_node(job: dict[str, Any]) -> None:
    manifest, _ = job["plain"]
    ranks = job["ranks"]["http"]
    assert [(r["id"], r["shards"]) for r in ranks] == [(manifest.id, 1500)] * RANKS, ranks
    assert job["one_load"] >= 1
    # the 4 ranks together sent the server what one load sends (not 4 times that)
    assert job["requests"] == job["one_load"], job["requests"]


def test_a_changed_node_copy_is_refused_named_and_the_manifest_read_again(
    job: dict[str, Any],
) -> None:
    manifest, path = job["plain"]
    ranks = job["ranks"]["tampered"]
    size = path.stat().st_size
    assert [(r["id"], r["shards"]) for r in ranks] == [(manifest.id, 1500)] * RANKS, ranks
    assert ranks[0]["warnings"] == [] and ranks[0]["read"] >= size, ranks
    for r in ranks[1:]:
        (said,) = [w for w in r["warnings"] if "node copy" in w]
        assert "refused" in said and "tampered.json" in said, said
        digests = re.findall(r"\b[0-9a-f]{64}\b", said)
        assert len(digests) == 2 and digests[0] != digests[1], said  # found vs published
        assert r["read"] >= size, r  # read again from the manifest, not the copy


def test_the_readers_error_is_named_on_every_rank_of_the_node(job: dict[str, Any]) -> None:
    ranks = job["ranks"]["missing"]
    assert all(r["error"][0] == "ManifestError" for r in ranks), ranks
    assert all("manifest file not found" in r["error"][1] for r in ranks), ranks
    named = [re.search(r"found by rank (\d), the rank that read", r["error"][1]) for r in ranks]
    reader = [r["rank"] for r, m in zip(ranks, named, strict=True) if m is None]
    assert len(reader) == 1, ranks  # one rank tried; the others were told, naming it
    assert {m.group(1) for m in named if m is not None} == {str(reader[0])}, ranks


def test_without_a_process_group_the_manifest_is_read_as_before(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    manifest, path = _manifest(tmp_path / "one", 5)
    monkeypatch.setenv("DETDATA_CACHE_DIR", str(tmp_path / "cache"))
    assert Manifest.load(str(path), verify="off").id == manifest.id
    assert not (tmp_path / "cache" / "manifests").exists()


def test_a_rank_waits_for_the_nodes_reader_at_most_the_stores_timeout(
    job: dict[str, Any],
) -> None:
    """The node's reader hangs (the server holds its first answer STALL s): the node's other
    ranks stop waiting after the store's timeout (WAIT s), say so, and fetch the manifest
    themselves; nobody gets other bytes."""
    manifest, _ = job["plain"]
    ranks = job["ranks"]["stalled"]
    assert [(r["id"], r["shards"]) for r in ranks] == [(manifest.id, 1500)] * RANKS, ranks
    held = [r for r in ranks if r["wall"] >= STALL]
    assert len(held) == 1, ranks  # the reader, whom the server held; nobody waited for it
    reader = held[0]
    assert not [w for w in reader["warnings"] if "published nothing" in w], reader
    for r in ranks:
        if r is not reader:
            assert r["wall"] < STALL - 3, ranks  # about WAIT s and a fetch, not STALL s
            (said,) = [w for w in r["warnings"] if "published nothing" in w]
            assert f"within {WAIT:g} s" in said and "reading the manifest itself" in said, said
