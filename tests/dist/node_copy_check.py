"""Child of tests/identity/test_node_copy.py, run under torchrun (gloo), ranks on one node.

Every rank initialises the process group, warms up (imports, one load of the manifest at
WARM), then runs each phase of PHASES (a JSON list of ``{"name", "path", "tamper"}``): it
loads the phase's manifest with ``verify="off"`` and records the bytes it read meanwhile
(``rchar`` of /proc/self/io, counted by the kernel), the opens of the original manifest
files (the JSON and its fast form, seen by CPython's ``open`` audit event, which every
``open`` and ``os.open`` raises), the manifest's id and shard count, the
warnings it got and the error it got (class, message), if any. A ``tamper`` phase: rank 0
loads first, alone (the others wait at a store key), then flips a byte of every node copy
under ``$DETDATA_CACHE_DIR/manifests`` before the others load. A phase with ``wait_s``
sets the store's timeout to that many seconds for its load. Each phase also records its
load's ``wall`` seconds. The results go to
``OUT.rank<r>`` as a JSON object of phase name -> result.
"""

import json
import os
import sys
import time
import warnings
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch.distributed as dist

import detdata


def rchar() -> int:
    with open("/proc/self/io") as fh:
        return next(int(line.split()[1]) for line in fh if line.startswith("rchar:"))


def tamper() -> None:
    for copy in (Path(os.environ["DETDATA_CACHE_DIR"]) / "manifests").glob("*.json*"):
        data = bytearray(copy.read_bytes())
        data[len(data) // 2] ^= 0x01
        copy.write_bytes(bytes(data))


OPENED: list[str] = []


def audit(event: str, args: tuple[Any, ...]) -> None:
    if event == "open" and isinstance(args[0], str):
        OPENED.append(os.path.abspath(args[0]))


def load(path: str) -> dict[str, Any]:
    result: dict[str, Any] = {}
    originals = {os.path.abspath(path), os.path.abspath(path) + ".columns"}
    OPENED.clear()
    before = rchar()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            loaded = detdata.Manifest.load(path, verify="off")
            result["id"], result["shards"] = loaded.id, len(loaded.shards)
        except detdata.DetdataError as exc:
            result["error"] = [type(exc).__name__, str(exc)]
    result["read"] = rchar() - before
    result["opened"] = [p for p in OPENED if p in originals]
    result["warnings"] = [str(w.message) for w in caught]
    return result


phases, warm, out = json.loads(sys.argv[1]), sys.argv[2], sys.argv[3]
sys.addaudithook(audit)
dist.init_process_group("gloo")
rank = dist.get_rank()
store = dist.distributed_c10d._get_default_store()
detdata.Manifest.load(warm, verify="off")  # imports and a first meeting, not counted
results: dict[str, Any] = {}
for phase in phases:
    dist.barrier()  # every rank loads at about the same time
    go = f"test/go/{phase['name']}"
    if phase["tamper"] and rank != 0:
        store.wait([go], timedelta(seconds=120))
    if "wait_s" in phase:  # the store's timeout: how long a rank waits for the node's reader
        kept = store.timeout
        store.set_timeout(timedelta(seconds=phase["wait_s"]))
    start = time.monotonic()
    results[phase["name"]] = {"rank": rank, **load(phase["path"])}
    results[phase["name"]]["wall"] = time.monotonic() - start
    if "wait_s" in phase:
        store.set_timeout(kept)
    if phase["tamper"] and rank == 0:
        tamper()
        store.set(go, b"1")
with open(f"{out}.rank{rank}", "w", encoding="utf-8") as fh:
    json.dump(results, fh)
dist.barrier()
dist.destroy_process_group()
