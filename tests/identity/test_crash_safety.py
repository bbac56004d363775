"""Crash safety: SIGKILL during registry writes and manifest builds/saves leaves nothing
half-written.

A real child process loops: hash a shard directory into a manifest and save it
over a fixed target, save a big (1200-shard, ~370 kB) manifest over another
target, register the big one under a new name and force-re-point a hot name at
the small one. The parent SIGKILLs it at seeded random moments, then checks
what a later run would read:

* each save target is absent, or a complete manifest whose id matches its
  content and is one of the manifests the child writes (old or new, never a mix);
* every object in the registry parses and re-hashes to its file name, every
  reference parses and resolves to an intact object, and any other file left
  behind is an unpublished ``.tmp-*`` file that nothing reads (later registers
  sweep stale ones: tests/identity/test_registry.py);
* a later register / resolve works (the kernel released the killed writer's lock).

`test_checks_detect_half_written_files` shows the checks are not vacuous: the
same checks refuse a torn (truncated) object, reference and save target.

Covers: detdata/storage/atomic.py.
"""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import random
import struct
import time
from pathlib import Path

import blake3
import numpy as np
import pytest

from detdata import Manifest, ManifestError, Registry, RegistryError, ShardEntry, build_manifest
from detdata.identity.columns import ShardTable
from detdata.identity.columns_tie import check_json, verify_columns_id
from detdata.identity.formats import Format

BIG_SHARDS = 1200
KILLS = 6
SEED = 20240611


# ------------------------------------------------------------------ what the child writes
def big_manifest(index: int) -> Manifest:
    """A deterministic ~370 kB manifest (synthetic entries; never verified against bytes)."""
    entries = []
    for j in range(BIG_SHARDS):
        digest = blake3.blake3(struct.pack("<QQ", index, j)).digest(length=64)
        entries.append(
            ShardEntry(
                path=f"part/{j:05d}.npy",
                bytes=128 + 2 * (1000 + j),
                blake3="b3:" + digest[:32].hex(),
                quick="b3:" + digest[32:].hex(),
                num_samples=1000 + j,
                format=Format.NPY,
                dtype="uint16",
                data_offset=128,
            )
        )
    return Manifest(shards=tuple(entries), metadata={"index": index, "kind": "crash-test"})


def write_shards(root: Path) -> None:
    root.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(5)
    for i, size in enumerate((40_000, 25_000, 9_000)):
        np.save(root / f"shard-{i:03d}.npy", rng.integers(0, 60_000, size=size).astype(np.uint16))


def small_manifest(data: Path, index: int) -> Manifest:
    return build_manifest(str(data), metadata={"generation": index % 3}, threads=2)


def child(work: str, run: int) -> None:
    """The writer that gets killed: loops until SIGKILL."""
    base = Path(work)
    registry = Registry(str(base / "registry"))
    progress = base / f"progress-{run}"
    i = 0
    while True:
        small = small_manifest(base / "data", i)  # hashes every shard byte
        small.save(str(base / "small.json"))
        big = big_manifest(run * 1000 + i)
        big.save(str(base / "big.json"))
        registry.register(f"big-{run}-{i}@v1", big)
        registry.register("hot@v1", small, force=True)
        with progress.open("a") as fh:
            fh.write(f"{i}\n")
        i += 1


# ------------------------------------------------------------------ checks
def check_save_target(
    path: Path, allowed_ids: set[str] | None, *, verify: str = "off"
) -> str | None:
    """Absent (None) or a complete manifest whose id is allowed; raises otherwise."""
    if not path.exists():
        return None
    manifest = Manifest.load(str(path), verify=verify)  # refuses torn JSON and id mismatches
    if isinstance(manifest.shards, ShardTable):  # the fast form: its full tie to the JSON
        check_json(manifest.shards)
        verify_columns_id(manifest.shards)
    if allowed_ids is not None:
        assert manifest.id in allowed_ids, f"{path} holds an unexpected manifest {manifest.id}"
    else:
        index = manifest.metadata["index"]
        assert manifest.id == big_manifest(index).id, f"{path} is not big manifest #{index}"
    return manifest.id


def check_registry(root: Path) -> list[str]:
    """Every published object and reference is intact; returns the reference names."""
    registry = Registry(str(root))
    for path in (root / "manifests").glob("*"):  # anything else is an unpublished temp file
        assert path.name.endswith((".json", ".json.columns")) or path.name.startswith(".tmp-"), (
            f"unexpected file {path}"
        )
    for path in (root / "refs").rglob("*"):
        assert path.is_dir() or path.suffix == ".json" or path.name.startswith(".tmp-"), path
    intact = set()
    for path in (root / "manifests").glob("*.json"):
        stored = registry.get("b3:" + path.stem)  # parses and re-hashes to its name, or maps
        if isinstance(stored.shards, ShardTable):  # the fast form, re-hashed in full here
            check_json(stored.shards)
            verify_columns_id(stored.shards)
        intact.add(stored.id)
    names = registry.names()
    for name in names:
        history = registry.history(name)  # parses the reference and its whole history
        assert history[-1].id in intact, f"{name} points at a missing object {history[-1].id}"
    return names


# ------------------------------------------------------------------ the test
def _wait_for(path: Path, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while not (path.exists() and path.read_text().strip()):
        if time.monotonic() > deadline:
            raise AssertionError(f"the writer made no progress within {timeout}s")
        time.sleep(0.01)


@pytest.mark.slow  # a stress loop: 6 writers SIGKILLed mid-write
@pytest.mark.multiproc
def test_sigkill_during_writes_leaves_nothing_half_written(tmp_path: Path) -> None:
    write_shards(tmp_path / "data")
    small_ids = {small_manifest(tmp_path / "data", g).id for g in range(3)}
    registry = Registry(str(tmp_path / "registry"))
    rng = random.Random(SEED)
    ctx = mp.get_context("forkserver")  # children fork from a server with detdata imported once
    ctx.set_forkserver_preload(["tests.identity.test_crash_safety"])
    iterations = []
    for run in range(KILLS):
        proc = ctx.Process(target=child, args=(str(tmp_path), run), daemon=True)
        proc.start()
        try:
            _wait_for(tmp_path / f"progress-{run}", timeout=60)  # the loop is running
            time.sleep(rng.uniform(0.0, 0.4))  # a seeded moment somewhere in the next writes
        finally:
            proc.kill()  # SIGKILL: no cleanup handlers, no flush
            proc.join(timeout=30)
        assert proc.exitcode == -9
        iterations.append(len((tmp_path / f"progress-{run}").read_text().split()))

        assert check_save_target(tmp_path / "small.json", small_ids, verify="full") is not None
        check_save_target(tmp_path / "big.json", None)
        names = check_registry(tmp_path / "registry")
        assert "hot@v1" in names
        assert registry.resolve("hot@v1", verify="full").id in small_ids  # verified against bytes
        # a later run can write and read (the killed writer's lock died with it)
        later = big_manifest(10**6 + run)
        assert registry.register(f"later-{run}@v1", later) == later.id
        assert registry.resolve(f"later-{run}@v1", verify="off").id == later.id
    print("completed iterations per run before the kill:", iterations)
    assert sum(iterations) >= KILLS  # every kill interrupted a running loop


def test_checks_detect_half_written_files(tmp_path: Path) -> None:
    """The crash checks refuse torn files: a non-atomic writer would fail the test above."""
    write_shards(tmp_path / "data")
    small = small_manifest(tmp_path / "data", 0)
    big = big_manifest(7)
    registry = Registry(str(tmp_path / "registry"))
    registry.register("big@v1", big)
    registry.register("hot@v1", small)
    check_registry(tmp_path / "registry")

    target = tmp_path / "small.json"
    small.save(str(target))
    assert check_save_target(target, {small.id}, verify="full") == small.id
    target.write_bytes(target.read_bytes()[: target.stat().st_size // 2])
    with pytest.raises(ManifestError, match="malformed JSON"):
        check_save_target(target, {small.id})

    obj = tmp_path / "registry" / "manifests" / f"{big.id[3:]}.json"
    whole = obj.read_bytes()
    obj.write_bytes(whole[: len(whole) // 2])
    with pytest.raises(RegistryError, match="corrupted"):
        check_registry(tmp_path / "registry")
    obj.write_bytes(whole)

    ref = tmp_path / "registry" / "refs" / "hot" / "v1.json"
    ref.write_bytes(ref.read_bytes()[:-30])
    with pytest.raises(RegistryError, match="reference 'hot@v1' is corrupted"):
        check_registry(tmp_path / "registry")


def test_interrupted_save_keeps_the_old_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Deterministic companion: a save that dies before the rename leaves the old file intact."""
    write_shards(tmp_path / "data")
    old, new = small_manifest(tmp_path / "data", 0), small_manifest(tmp_path / "data", 1)
    target = tmp_path / "m.json"
    old.save(str(target))

    def die(src: str, dst: str) -> None:
        raise KeyboardInterrupt  # as if the process stopped between write and rename

    monkeypatch.setattr(os, "replace", die)
    with pytest.raises(KeyboardInterrupt):
        new.save(str(target))
    monkeypatch.undo()
    assert Manifest.load(str(target), verify="full").id == old.id
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".tmp-")] == []
    assert json.loads(target.read_text())["id"] == old.id
