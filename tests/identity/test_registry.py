"""Registry: content-addressed manifests, named versions, history, atomicity, concurrency."""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import time
import uuid
from pathlib import Path
from typing import Any

import pytest

from detdata.base.errors import (
    ConfigError,
    ManifestError,
    RegistryError,
    VerificationError,
)
from detdata.identity.build import build_manifest
from detdata.identity.manifest import Manifest
from detdata.identity.registry import STALE_TEMP_S, Registry, default_root, split_name


@pytest.fixture
def manifest(token_shards: Path) -> Manifest:
    return build_manifest(str(token_shards), metadata={"tokenizer": "t1"})


@pytest.fixture
def other(token_shards: Path) -> Manifest:
    return build_manifest(str(token_shards), metadata={"tokenizer": "t2"})


@pytest.fixture
def registry(tmp_path: Path) -> Registry:
    return Registry(str(tmp_path / "registry"))


def test_register_resolve_get(registry: Registry, manifest: Manifest) -> None:
    assert registry.register("wiki-en@v1", manifest) == manifest.id
    resolved = registry.resolve("wiki-en@v1")
    assert resolved.id == manifest.id and resolved.root == manifest.root
    assert resolved.shards == manifest.shards and resolved.metadata == manifest.metadata
    by_id = registry.get(manifest.id)
    assert by_id.id == manifest.id and by_id.root is None
    assert registry.resolve(manifest.id).id == manifest.id
    assert registry.names() == ["wiki-en@v1"]


def test_objects_are_content_addressed_json(registry: Registry, manifest: Manifest) -> None:
    registry.register("a@v1", manifest)
    obj = Path(registry.root) / "manifests" / f"{manifest.id[3:]}.json"
    doc = json.loads(obj.read_bytes())
    assert doc["id"] == manifest.id and "root" not in doc
    assert Manifest.loads(obj.read_bytes()).id == manifest.id


def test_registration_is_idempotent(registry: Registry, manifest: Manifest) -> None:
    registry.register("ds@v1", manifest)
    ref = Path(registry.root) / "refs" / "ds" / "v1.json"
    before = ref.read_bytes()
    assert registry.register("ds@v1", manifest) == manifest.id
    assert ref.read_bytes() == before
    assert len(registry.history("ds@v1")) == 1


def test_new_root_for_same_id_is_recorded(
    registry: Registry, manifest: Manifest, tmp_path: Path
) -> None:
    registry.register("ds@v1", manifest)
    registry.register("ds@v1", manifest.with_root(str(tmp_path / "moved")))
    events = registry.history("ds@v1")
    assert [e.root for e in events] == [manifest.root, str(tmp_path / "moved")]
    assert not any(e.forced for e in events)
    assert registry.resolve("ds@v1", verify="off").root == str(tmp_path / "moved")


def test_repointing_needs_force(registry: Registry, manifest: Manifest, other: Manifest) -> None:
    registry.register("ds@v1", manifest)
    with pytest.raises(
        RegistryError, match=f"ds@v1 already points at {manifest.id}, not {other.id}.*force=True"
    ):
        registry.register("ds@v1", other)
    assert registry.resolve("ds@v1").id == manifest.id
    assert registry.register("ds@v1", other, force=True) == other.id
    assert registry.resolve("ds@v1").id == other.id
    events = registry.history("ds@v1")
    assert [(e.id, e.forced) for e in events] == [(manifest.id, False), (other.id, True)]
    assert registry.get(manifest.id).id == manifest.id  # the old object is still there


def test_bare_name_is_latest_created_version(
    registry: Registry, manifest: Manifest, other: Manifest
) -> None:
    registry.register("ds@v2", manifest)
    registry.register("ds@v10", other)
    assert registry.resolve("ds").id == other.id
    assert registry.versions("ds") == ["v2", "v10"]
    registry.register("ds@v2", other, force=True)  # re-pointing does not make v2 the latest
    registry.register("ds@v10", manifest, force=True)
    assert registry.resolve("ds").id == manifest.id
    history = registry.history("ds")
    assert [(e.name, e.id) for e in history] == [
        ("ds@v2", manifest.id),
        ("ds@v10", other.id),
        ("ds@v2", other.id),
        ("ds@v10", manifest.id),
    ]
    assert registry.names() == ["ds@v10", "ds@v2"]


def test_register_from_path(registry: Registry, manifest: Manifest, tmp_path: Path) -> None:
    manifest.save(str(tmp_path / "m.json"))
    assert registry.register("ds@v1", str(tmp_path / "m.json")) == manifest.id
    assert registry.resolve("ds@v1").root == manifest.root


def test_resolve_verifies_shards(
    registry: Registry, manifest: Manifest, token_shards: Path
) -> None:
    registry.register("ds@v1", manifest)
    victim = token_shards / "shard-001.npy"
    victim.write_bytes(victim.read_bytes()[:-2])
    with pytest.raises(VerificationError, match=r"shard-001\.npy") as info:
        registry.resolve("ds@v1")
    assert any("ds@v1" in note for note in info.value.__notes__)
    assert registry.resolve("ds@v1", verify="off").id == manifest.id
    with pytest.raises(ManifestError, match=r"manifest file not found: .*nope\.json"):
        registry.register("ds@v2", str(token_shards / "nope.json"))
    assert registry.names() == ["ds@v1"]


@pytest.mark.parametrize(
    "name",
    [
        "",
        "@v1",
        "ds@",
        "ds@v1@v2",
        "-ds@v1",
        "ds@.v1",
        "d s@v1",
        "ds/x@v1",
        "../x@v1",
        "ds@..",
        "x" * 129 + "@v1",
        "ds@v1\n",
    ],
)
def test_invalid_names(registry: Registry, manifest: Manifest, name: str) -> None:
    with pytest.raises(RegistryError, match="invalid registry name"):
        registry.register(name, manifest)


def test_register_needs_a_version(registry: Registry, manifest: Manifest) -> None:
    with pytest.raises(RegistryError, match=r"has no version.*'ds@v1'"):
        registry.register("ds", manifest)
    assert split_name("wiki-en@v3.1_rc-2") == ("wiki-en", "v3.1_rc-2")


def test_unknown_names_and_ids(registry: Registry, manifest: Manifest) -> None:
    with pytest.raises(RegistryError, match="name 'nope' is not in registry"):
        registry.resolve("nope")
    registry.register("ds@v1", manifest)
    with pytest.raises(RegistryError, match=r"ds@v9 is not in registry.*known versions.*'v1'"):
        registry.resolve("ds@v9")
    missing = "b3:" + "0" * 64
    with pytest.raises(RegistryError, match=f"manifest {missing} is not in registry"):
        registry.get(missing)
    with pytest.raises(RegistryError, match="invalid manifest id 'b3:zz'"):
        registry.get("b3:zz")
    assert Registry(registry.root + "-empty").names() == []


def test_corrupted_object_is_refused(
    registry: Registry, manifest: Manifest, other: Manifest
) -> None:
    registry.register("ds@v1", manifest)
    obj = Path(registry.root) / "manifests" / f"{manifest.id[3:]}.json"
    doc = json.loads(obj.read_bytes())
    doc["metadata"]["tokenizer"] = "tampered"
    obj.write_text(json.dumps(doc))
    with pytest.raises(RegistryError, match=f"registry object {manifest.id} .*corrupted"):
        registry.resolve("ds@v1")
    other_doc = dict(other.body(), id=other.id)  # a valid manifest under the wrong name
    obj.write_text(json.dumps(other_doc))
    with pytest.raises(RegistryError, match=f"holds manifest {other.id}"):
        registry.get(manifest.id)


def test_corrupted_ref_is_refused(registry: Registry, manifest: Manifest) -> None:
    registry.register("ds@v1", manifest)
    (Path(registry.root) / "refs" / "ds" / "v1.json").write_text("{not json")
    with pytest.raises(RegistryError, match="reference 'ds@v1' is corrupted"):
        registry.resolve("ds@v1")


def test_default_root_env_and_argument(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, manifest: Manifest
) -> None:
    monkeypatch.setenv("DETDATA_REGISTRY", str(tmp_path / "from-env"))
    assert Registry().root == str(tmp_path / "from-env")
    assert Registry(str(tmp_path / "arg")).root == str(tmp_path / "arg")
    Registry().register("ds@v1", manifest)
    assert (tmp_path / "from-env" / "refs" / "ds" / "v1.json").exists()
    monkeypatch.delenv("DETDATA_REGISTRY")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    assert default_root() == str(tmp_path / "cache" / "detdata" / "registry")


def test_fsspec_url_registry(manifest: Manifest, other: Manifest) -> None:
    reg = Registry(f"memory://detdata-registry-{uuid.uuid4().hex}")
    reg.register("ds@v1", manifest)
    reg.register("ds@v2", other)
    assert reg.names() == ["ds@v1", "ds@v2"]
    assert reg.resolve("ds").id == other.id
    assert reg.resolve("ds@v1").id == manifest.id
    with pytest.raises(RegistryError, match="already points at"):
        reg.register("ds@v1", other)


def test_file_url_registry_is_the_same_directory(tmp_path: Path, manifest: Manifest) -> None:
    Registry("file://" + str(tmp_path / "r")).register("ds@v1", manifest)
    assert Registry(str(tmp_path / "r")).resolve("ds@v1").id == manifest.id


# ---------------------------------------------------------------- concurrency
def _worker(root: str, docs: list[str], index: int, rounds: int, barrier: Any, out: Any) -> None:
    """Spawned worker: race for one name, then force-register a shared name ``rounds`` times."""
    manifest = Manifest.loads(docs[index], root=f"/data/{index}")
    reg = Registry(root)
    barrier.wait()
    reg.register(f"own{index}@v1", manifest)
    try:
        reg.register("contested@v1", manifest)
        out.put((index, "won"))
    except RegistryError:
        out.put((index, "refused"))
    barrier.wait()
    for r in range(rounds):  # each registration has a unique root, so each appends one event
        forced = Manifest.loads(docs[(index + r) % len(docs)], root=f"/data/p{index}/r{r}")
        reg.register("hot@v1", forced, force=True)


def _manifest_docs(token_shards: Path, count: int) -> list[str]:
    return [
        json.dumps(build_manifest(str(token_shards), metadata={"i": i}).to_json())
        for i in range(count)
    ]


@pytest.mark.multiproc
def test_concurrent_processes_leave_registry_consistent(tmp_path: Path, token_shards: Path) -> None:
    ctx = mp.get_context("spawn")
    root = str(tmp_path / "registry")
    procs, rounds = 3, 8
    docs = _manifest_docs(token_shards, procs)
    ids = [Manifest.loads(d).id for d in docs]
    barrier, out = ctx.Barrier(procs), ctx.Queue()
    workers = [
        ctx.Process(target=_worker, args=(root, docs, i, rounds, barrier, out))
        for i in range(procs)
    ]
    for w in workers:
        w.start()
    for w in workers:
        w.join(timeout=120)
    assert [w.exitcode for w in workers] == [0] * procs
    results = dict(out.get(timeout=10) for _ in range(procs))
    reg = Registry(root)
    # exactly one process won the contested name; the others were refused, nothing overwritten
    winners = [i for i, r in results.items() if r == "won"]
    assert len(winners) == 1
    assert reg.resolve("contested@v1", verify="off").id == ids[winners[0]]
    assert len(reg.history("contested@v1")) == 1
    # forced re-pointing: every registration appended exactly one event (no lost update)
    hot = reg.history("hot@v1")
    assert len(hot) == procs * rounds
    assert sorted(e.root or "" for e in hot) == sorted(
        f"/data/p{i}/r{r}" for i in range(procs) for r in range(rounds)
    )
    assert reg.resolve("hot@v1", verify="off").id == hot[-1].id
    assert sorted(reg.names()) == sorted(
        ["contested@v1", "hot@v1", *(f"own{i}@v1" for i in range(procs))]
    )
    for name in reg.names():
        reg.resolve(name, verify="off")  # every ref points at an intact object
    leftovers = [f for _, _, files in os.walk(root) for f in files if f.startswith(".tmp-")]
    assert leftovers == []


def test_register_sweeps_stale_temp_files_but_spares_fresh_ones(
    registry: Registry, manifest: Manifest
) -> None:
    """A writer killed mid-write leaves a ``.tmp-*`` file in ``tmp/``; later registers remove
    the stale ones there, and `Registry.gc` also those older versions left beside the objects."""
    root = Path(registry.root)
    registry.register("ds@v1", manifest)
    old = time.time() - STALE_TEMP_S - 60

    def plant(folder: Path, name: str, stale: bool) -> Path:
        folder.mkdir(parents=True, exist_ok=True)
        path = folder / name
        path.write_bytes(b"{half")
        if stale:
            os.utime(path, (old, old))
        return path

    killed = plant(root / "tmp", ".tmp-killed", True)
    in_flight = plant(root / "tmp", ".tmp-in-flight", False)
    legacy = [plant(root / d, ".tmp-legacy", True) for d in ("manifests", "refs/ds")]
    legacy_fresh = plant(root / "manifests", ".tmp-legacy-in-flight", False)
    unrelated = root / "refs" / "ds" / "notes.txt"  # not ours: never touched
    unrelated.write_text("keep")
    os.utime(unrelated, (old, old))
    registry.register("ds@v2", manifest)
    assert not killed.exists() and in_flight.exists()
    assert all(p.exists() for p in legacy)  # register lists only tmp/, never the objects
    assert registry.resolve("ds@v2").id == manifest.id
    assert registry.gc() == 2
    assert [p.exists() for p in legacy] == [False, False]
    assert in_flight.exists() and legacy_fresh.exists() and unrelated.exists()
    assert registry.resolve("ds@v1").id == registry.resolve("ds@v2").id == manifest.id


def test_register_lists_no_folder_that_grows_with_the_entries(
    registry: Registry, manifest: Manifest, monkeypatch: pytest.MonkeyPatch
) -> None:
    """O(1) amortised: a register lists (scandir) only ``tmp/``, whatever the registry holds."""
    for i in range(30):
        registry.register(f"fill{i}@v1", manifest.with_root(f"/elsewhere/{i}"))
    listed: list[str] = []
    real = os.scandir

    def spy(path: Any = ".") -> Any:
        listed.append(os.fspath(path))
        return real(path)

    monkeypatch.setattr(os, "scandir", spy)
    registry.register("one-more@v1", manifest)
    root = Path(registry.root)
    assert [Path(p) for p in listed] == [root / "tmp"]
    assert not any((root / "tmp").iterdir())  # published writes left nothing behind
    assert len(list((root / "refs").iterdir())) == 31


# ------------------------------------------------------------ bad roots and damaged files
@pytest.mark.parametrize("root", ["", "   ", "\t"])
def test_empty_root_is_refused_not_the_default(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, root: str
) -> None:
    monkeypatch.setenv("DETDATA_REGISTRY", str(tmp_path / "default"))
    with pytest.raises(ConfigError, match=r"Registry\(root=.*empty.*hint: .*root=None"):
        Registry(root)
    assert not (tmp_path / "default").exists()
    assert Registry(None).root == str(tmp_path / "default")  # None still means the default
    assert Registry(tmp_path / "as-path").root == str(tmp_path / "as-path")  # os.PathLike


def test_corrupted_old_object_does_not_block_newer_versions(
    registry: Registry, manifest: Manifest, other: Manifest
) -> None:
    registry.register("ds@v1", manifest)
    registry.register("ds@v2", other)
    (Path(registry.root) / "manifests" / f"{manifest.id[3:]}.json").write_text("garbage")
    assert registry.resolve("ds@v2").id == other.id
    assert registry.resolve("ds").id == other.id  # the latest needs only the references
    assert registry.versions("ds") == ["v1", "v2"]
    with pytest.raises(RegistryError, match=f"registry object {manifest.id} .*corrupted"):
        registry.resolve("ds@v1")


def test_corrupted_old_reference_names_it_and_leaves_explicit_versions_readable(
    registry: Registry, manifest: Manifest, other: Manifest
) -> None:
    """The latest of a name cannot be decided while one of its references is unreadable
    (it might be the latest): refused naming that reference; explicit versions still resolve."""
    registry.register("ds@v1", manifest)
    registry.register("ds@v2", other)
    (Path(registry.root) / "refs" / "ds" / "v1.json").write_text("{not json")
    assert registry.resolve("ds@v2").id == other.id
    with pytest.raises(
        RegistryError,
        match=r"name 'ds'.*ds@v1.*corrupted.*hint: resolve an "
        r"explicit version such as ds@v2",
    ):
        registry.resolve("ds")


def _dir_at_ref(root: Path, manifest: Manifest) -> Path:
    path = root / "refs" / "ds" / "v2.json"
    path.mkdir(parents=True)
    return path


def _dir_at_object(root: Path, manifest: Manifest) -> Path:
    path = root / "manifests" / f"{manifest.id[3:]}.json"
    path.unlink()
    path.mkdir()
    return path


def _file_at_refs_folder(root: Path, manifest: Manifest) -> Path:
    path = root / "refs" / "other"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("not a folder")
    return path


@pytest.mark.parametrize(
    ("damage", "action"),
    [
        (_dir_at_ref, "resolve:ds@v2"),
        (_dir_at_ref, "resolve:ds"),
        (_dir_at_ref, "register:ds@v2"),
        (_dir_at_ref, "history:ds@v2"),
        (_dir_at_object, "resolve:ds@v1"),
        (_dir_at_object, "get"),
        (_file_at_refs_folder, "register:other@v1"),
        (_file_at_refs_folder, "resolve:other@v1"),
    ],
)
def test_damaged_registry_paths_are_registry_errors_naming_the_path(
    registry: Registry, manifest: Manifest, damage: Any, action: str
) -> None:
    registry.register("ds@v1", manifest)
    path = damage(Path(registry.root), manifest)
    verb, _, name = action.partition(":")
    call = {
        "resolve": lambda: registry.resolve(name),
        "get": lambda: registry.get(manifest.id),
        "register": lambda: registry.register(name, manifest),
        "history": lambda: registry.history(name),
    }[verb]
    with pytest.raises(RegistryError) as info:
        call()
    message = str(info.value)
    assert path.name in message and "hint:" in message, message


def test_registry_root_that_is_a_file_is_a_registry_error(
    tmp_path: Path, manifest: Manifest
) -> None:
    root = tmp_path / "registry"
    root.write_text("I am a file")
    with pytest.raises(RegistryError, match=r"registry.*hint:"):
        Registry(str(root)).register("ds@v1", manifest)
    assert root.read_text() == "I am a file"
