"""Derived indexes are built once per job and every rank delivers the same bytes (issue 33).

R rank processes are started at once (each waits on a start file after its imports, so
that none finds an index another already wrote) over one saved manifest of many shards:

* `Documents` + `PackedWindows` with a shared ``index_dir``: the document table is built
  (every shard read) and both indexes are written by one rank (counted by the rank
  processes themselves, one file per call of the build / save function); the others load
  and check them (the packing offsets are recomputed from the document table in every
  rank, as issue 29's check requires: numpy over the table, no shard read); every
  rank's windows equal the brute-force packer over the writer's documents.
* `TableRows` over many Parquet shards: a rank builds no per-shard entry at open (the
  row-group tables come from the manifest's mapped columns) and reads the footer of the
  first shard and of the shards of its batch only; its rows equal the writer's.
* `TokenWindows` (the window index, `detdata.datasets.window_index`): built and written
  once (counted by the rank processes: one file per call of the build / encode function),
  by whichever process takes the lock first, or under a process group by the rank that
  claims it first in the group's store; every rank maps that one file and delivers the
  windows a brute-force cut of the ``.npy`` files gives.
"""

from __future__ import annotations

import hashlib
import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

import detdata
from detdata.datasets import window_index
from tests.datasets.doc_corpora import random_documents, write_eod_shard, write_parquet
from tests.order.packing_reference import brute_windows

RANKS = 4
EOD = 0
OPT: dict[str, Any] = dict(
    seed=3, shuffle=True, seq_len=16, labels=True, bos=None, eos=None, tail="drop", pad_id=None
)

CHILD = r"""
import hashlib, json, os, sys, time
from pathlib import Path
import numpy as np
import pyarrow.parquet as pq
import detdata
from detdata.datasets.documents import Documents
from detdata.datasets.packed import PackedWindows

kind, manifest, index_dir, counts, go, out = sys.argv[1:7]
rank = int(os.environ["RANK"])

def counted(cls, name, tag):
    original = getattr(cls, name)
    def wrapper(self, *args, **kwargs):
        Path(counts, f"{tag}-{os.getpid()}-{time.monotonic_ns()}").touch()
        return original(self, *args, **kwargs)
    setattr(cls, name, wrapper)

import detdata.datasets.index_files as index_files

counted(Documents, "_build", "documents")  # reads every shard: once per job
save = index_files.save_index  # an index written: once per job each
def saving(index_dir, name, *args, _save=save, **kwargs):
    Path(counts, f"save_{name}-{os.getpid()}-{time.monotonic_ns()}").touch()
    return _save(index_dir, name, *args, **kwargs)
index_files.save_index = saving
footers = []
class Counting(pq.ParquetFile):
    def __init__(self, source, *args, **kwargs):
        footers.append(str(source))
        super().__init__(source, *args, **kwargs)
pq.ParquetFile = Counting

if kind == "tokens":
    import detdata.datasets.window_index as window_index
    for name, tag in (("build_window_index", "build_windows"), ("encode_window_index",
                                                                "write_windows")):
        def wrapped(*args, _f=getattr(window_index, name), _tag=tag, **kwargs):
            Path(counts, f"{_tag}-{os.getpid()}-{time.monotonic_ns()}").touch()
            return _f(*args, **kwargs)
        setattr(window_index, name, wrapped)
    if "MASTER_PORT" in os.environ:
        import torch.distributed as dist
        dist.init_process_group("gloo")
while not os.path.exists(go):
    time.sleep(0.005)
if kind == "tokens":
    ds = detdata.TokenWindows(manifest, 16, storage=detdata.Storage(verify="off"))
    got = ds.read(np.arange(ds.num_samples))["tokens"]
    result = {"sha": hashlib.sha256(got.tobytes()).hexdigest(), "shape": list(got.shape),
              "mapped": ds._index.path, "pid": os.getpid(),
              "local_rank": os.environ.get("LOCAL_RANK")}
    if "MASTER_PORT" in os.environ:
        dist.barrier()
        dist.destroy_process_group()
elif kind == "table":
    ds = detdata.TableRows(manifest, ["idx", "value"])
    ids = np.arange(rank, ds.num_samples, 97)[:8]
    batch = ds.read(ids)
    result = {"ids": ids.tolist(), "idx": batch["idx"].tolist(),
              "value": batch["value"].tolist(),
              "entries": len(ds.manifest.shards._cache), "footers": len(footers),
              "shards_read": len(set(ds.locate(ids)[0].tolist()))}
else:
    column = "input_ids" if kind == "parquet" else None
    eod = None if kind == "parquet" else 0
    # verify="off": no turn-taking on the receipt lock, the ranks reach the build together
    docs = Documents(manifest, column=column, eod_token=eod, index_dir=index_dir,
                     storage=detdata.Storage(verify="off"))
    opened = len(footers)
    packed = PackedWindows(docs, seq_len=16, seed=3, shuffle=True, labels=True,
                           tail="drop", index_dir=index_dir)
    got = packed.read(np.arange(packed.num_samples))
    result = {"tokens": got["tokens"].tolist(), "doc_index": got["doc_index"].tolist(),
              "footers": opened, "pid": os.getpid()}
Path(out).write_text(json.dumps(result))
"""


def _corpus(root: Path, kind: str, shards: int) -> tuple[Path, list[list[int]]]:
    """``shards`` files of documents (Parquet or eod-token .npy) and the saved manifest."""
    rng = np.random.default_rng(33)
    docs: list[list[int]] = []
    for i in range(shards):
        part = random_documents(rng, 5, max_len=20, vocab=900, empty=kind == "parquet")
        if kind == "parquet":
            write_parquet(root / f"s{i:04d}.parquet", part, row_group_size=2)
            docs += [d.tolist() for d in part]
        else:
            part = [d + 1 for d in part]  # no eod inside a document
            write_eod_shard(root / f"s{i:04d}.npy", part, EOD)
            docs += [[*d.tolist(), EOD] for d in part]
    path = root / "manifest.json"
    detdata.build_manifest(root, threads=2).save(str(path))
    return path, docs


def _run_ranks(
    tmp: Path, kind: str, manifest: Path, index_dir: Path, *, group: bool = False
) -> list[dict[str, Any]]:
    """RANKS processes started at once (``group``: joined in a gloo process group, as
    torchrun starts them); their results."""
    counts, go = tmp / "counts", tmp / "go"
    counts.mkdir()
    script = tmp / "child.py"
    script.write_text(CHILD)
    env = {**os.environ, "DETDATA_RECEIPTS": str(tmp / "receipts"), "DETDATA_PROGRESS": "0"}
    if group:
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            port = sock.getsockname()[1]
        env.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), WORLD_SIZE=str(RANKS))
    procs = []
    for r in range(RANKS):
        out = tmp / f"rank{r}.json"
        cmd = [sys.executable, str(script), kind, str(manifest), str(index_dir)]
        cmd += [str(counts), str(go), str(out)]
        rank_env = {**env, "RANK": str(r)}
        if group:
            rank_env["LOCAL_RANK"] = str((r + 1) % RANKS)  # the verifier is not rank 0
        procs.append((out, subprocess.Popen(cmd, env=rank_env)))
    time.sleep(1.0)  # let every rank import and reach the start file
    go.touch()
    results = []
    for out, proc in procs:
        assert proc.wait(timeout=600) == 0
        results.append(json.loads(out.read_text()))
    return results


@pytest.mark.parametrize("kind", ["parquet", "eod"])
def test_document_and_packing_indexes_are_built_once_for_ranks_started_at_once(
    tmp_path: Path, kind: str
) -> None:
    root = tmp_path / "data"
    root.mkdir()
    # enough shards that building takes longer than the ranks' start skew (a table shard
    # is decoded, a token shard only scanned)
    manifest, docs = _corpus(root, kind, 60 if kind == "parquet" else 600)
    index_dir = tmp_path / "index"
    results = _run_ranks(tmp_path, kind, manifest, index_dir)
    builds = sorted(p.name.split("-")[0] for p in (tmp_path / "counts").iterdir())
    # the document table is built (every shard read) and each index written once for the
    # whole job; the other ranks load them (and check them in full: the packing offsets
    # are recomputed from the document table, reading no shard)
    assert builds == ["documents", "save_documents", "save_packing"], builds
    builder = int(next((tmp_path / "counts").glob("documents-*")).name.split("-")[1])
    expected = brute_windows(docs, **OPT)
    assert expected
    for result in results:
        assert result["tokens"] == [w["tokens"] for w in expected]
        assert result["doc_index"] == [w["doc_index"] for w in expected]
        if kind == "parquet" and result["pid"] != builder:
            # opening (index loaded): one footer per distinct schema, not one per shard
            assert result["footers"] <= 1, result["footers"]
    assert sorted(p.suffix for p in index_dir.iterdir()) == [".json", ".json", ".npy", ".npy"]


def test_table_rows_open_builds_no_entry_per_shard_and_reads_only_its_footers(
    tmp_path: Path,
) -> None:
    root = tmp_path / "data"
    root.mkdir()
    rows_per_shard, shards = 6, 300
    for i in range(shards):
        idx = np.arange(i * rows_per_shard, (i + 1) * rows_per_shard)
        table = pa.table({"idx": pa.array(idx), "value": pa.array(idx * 7 % 1000, pa.int32())})
        pq.write_table(table, root / f"t{i:04d}.parquet", row_group_size=4)
    manifest = root / "manifest.json"
    detdata.build_manifest(root, threads=2).save(str(manifest))
    results = _run_ranks(tmp_path, "table", manifest, tmp_path / "unused")
    for result in results:
        # the writer's rows: row id i is idx i, value i * 7 % 1000
        assert result["idx"] == result["ids"]
        assert result["value"] == [i * 7 % 1000 for i in result["ids"]]
        # entries built: the first shard's and those of the batch (not one per shard)
        assert result["entries"] <= 1 + result["shards_read"], result
        assert result["footers"] <= 1 + result["shards_read"], result


def _brute_windows(root: Path, seq: int) -> np.ndarray:
    """Every window of ``seq`` + 1 tokens of every ``.npy`` file under ``root``, in path
    order, cut from the files' own tokens (int32, as `TokenWindows` widens uint16)."""
    rows = []
    for file in sorted(root.glob("*.npy")):
        tokens = np.load(file)
        for w in range((tokens.size - 1) // seq):
            rows.append(tokens[w * seq : w * seq + seq + 1].astype(np.int32))
    return np.stack(rows)


@pytest.mark.multiproc
@pytest.mark.parametrize("group", [False, True], ids=["lock", "process-group"])
def test_window_index_is_built_once_and_every_rank_maps_it(tmp_path: Path, group: bool) -> None:
    root = tmp_path / "data"
    root.mkdir()
    rng = np.random.default_rng(8)
    for i in range(window_index.STORE_MIN_SHARDS + 50):  # a corpus whose index is stored
        np.save(root / f"t{i:05d}.npy", rng.integers(0, 60_000, 17 + 23 * (i % 7), np.uint16))
    manifest = root / "manifest.json"
    detdata.build_manifest(root, threads=2).save(str(manifest))
    results = _run_ranks(tmp_path, "tokens", manifest, tmp_path / "unused", group=group)
    built = sorted((tmp_path / "counts").iterdir())
    assert sorted(p.name.split("-")[0] for p in built) == ["build_windows", "write_windows"]
    (stored,) = (tmp_path / "receipts").glob("*.windows")
    assert {r["mapped"] for r in results} == {str(stored)}  # every rank maps the one file
    if group:  # under a process group one rank of the group builds it (the first to claim)
        builder = int(built[0].name.split("-")[1])
        assert len([r for r in results if r["pid"] == builder]) == 1
    want = _brute_windows(root, 16)
    digest = hashlib.sha256(want.tobytes()).hexdigest()
    assert {r["sha"] for r in results} == {digest}
    assert results[0]["shape"] == list(want.shape)
