"""Shard file names: the builder never writes a manifest that loading refuses.

One rule decides which relative paths a manifest may hold (relative POSIX
paths in UTF-8, no backslash, not starting with ``/``, ``~`` or a drive letter,
no ``.``/``..``/empty segments). A file whose name breaks it is refused when the
manifest is built, naming the file with a hint; every other name round-trips:
build, save, load with full verification, registry, reads — locally and over
HTTP, where ``#``, ``?``, ``%`` and spaces must be escaped to reach the right
file. Every read is compared with the array the test wrote under that name.
"""

from __future__ import annotations

import dataclasses
import os
import shutil
import tempfile
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from detdata import Manifest, ManifestError, Storage, TokenWindows, build_manifest
from detdata.cli.main import main
from detdata.datasets.tables import TableRows
from detdata.identity.registry import Registry
from tests.servers import HttpServer

SEQ = 4
# loadable everywhere: spaces, URL metacharacters, percent escapes, non-ASCII, a '~' or a
# drive-like 'd:' that is not at the start, a newline
GOOD = (
    "sp ace.npy",
    "h#ash.npy",
    "q?mark.npy",
    "pc%41.npy",
    "pc%zz.npy",
    "plus+amp&eq=.npy",
    "ünï 日本.npy",
    "sub dir/x y.npy",
    "sub/d:/x.npy",
    "a~b.npy",
    "-lead.npy",
    "semi;colon.npy",
    "it's [1] (2).npy",
    "new\nline.npy",
)
# refused at build (the loader refuses them), naming the file
BAD = (
    "back\\slash.npy",
    "~home.npy",
    "d:/drive.npy",
    "c:rel.npy",
    os.fsdecode(b"bad\xff.npy"),
    os.fsdecode(b"dir\xfe/x.npy"),
)


def _tokens(name: str) -> np.ndarray:
    """Distinct tokens per file name (the reference the reads are compared with)."""
    seed = int.from_bytes(os.fsencode(name)[-8:].ljust(8, b"\0"), "little") % (2**32)
    return np.random.default_rng(seed).integers(0, 60_000, size=41 + len(name)).astype(np.uint16)


def _write(root: Path, name: str) -> np.ndarray:
    path = os.path.join(os.fspath(root), name)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    tokens = _tokens(name)
    with open(path, "wb") as fh:  # np.save(str) would append .npy to odd names
        np.save(fh, tokens)
    return tokens


def _expected(names: list[str]) -> np.ndarray:
    """All windows (labels on) of the files in manifest (path) order."""
    rows = []
    for name in sorted(names):
        t = _tokens(name).astype(np.int32)
        rows += [t[w * SEQ : w * SEQ + SEQ + 1] for w in range((t.size - 1) // SEQ)]
    return np.stack(rows)


def _read_all(ds: TokenWindows) -> np.ndarray:
    return ds.read(np.arange(ds.num_samples))["tokens"]


def _round_trip(root: Path, names: list[str], registry: Path) -> Manifest:
    """Build, save, load (full verify), register, resolve, read: all equal the written data."""
    built = build_manifest(str(root))
    assert sorted(s.path for s in built.shards) == sorted(names)
    assert build_manifest(str(root), paths=names).id == built.id
    built.save(str(root / "manifest.json"))
    loaded = Manifest.load(str(root / "manifest.json"), verify="full")
    assert loaded.id == built.id
    reg = Registry(str(registry))
    reg.register("odd@v1", str(root / "manifest.json"), verify="full")
    resolved = reg.resolve("odd@v1", verify="full")
    assert resolved.id == built.id
    for manifest in (built, loaded, resolved):
        np.testing.assert_array_equal(_read_all(TokenWindows(manifest, SEQ)), _expected(names))
    return loaded


def test_odd_but_valid_names_round_trip_locally(tmp_path: Path) -> None:
    root = tmp_path / "data"
    for name in GOOD:
        _write(root, name)
    _round_trip(root, list(GOOD), tmp_path / "registry")


@pytest.mark.parametrize("name", BAD, ids=ascii)
def test_unloadable_name_is_refused_at_build_naming_the_file(tmp_path: Path, name: str) -> None:
    root = tmp_path / "data"
    _write(root, "fine.npy")
    _write(root, name)
    before = sorted(p for p in tmp_path.rglob("*"))
    with pytest.raises(ManifestError) as info:
        build_manifest(str(root))
    message = str(info.value)
    assert repr(name) in message and "hint: rename the file" in message
    with pytest.raises(ManifestError, match="hint: rename the file"):
        build_manifest(str(root), paths=["fine.npy", name])
    # the CLI refuses too and writes no manifest file
    assert main(["manifest", "build", str(root), "-o", str(tmp_path / "m.json")]) != 0
    assert sorted(p for p in tmp_path.rglob("*")) == before


def test_refused_name_can_be_left_out_with_a_pattern(tmp_path: Path) -> None:
    root = tmp_path / "data"
    _write(root, "fine.npy")
    _write(root, "back\\slash.npy")
    manifest = build_manifest(str(root), pattern="f*.npy")
    np.testing.assert_array_equal(_read_all(TokenWindows(manifest, SEQ)), _expected(["fine.npy"]))


@pytest.mark.parametrize("field", ["path", "dtype"])
def test_save_and_register_refuse_a_hand_made_manifest_that_load_would_refuse(
    tmp_path: Path, field: str
) -> None:
    root = tmp_path / "data"
    _write(root, "fine.npy")
    entry = build_manifest(str(root)).shards[0]
    bad = {"path": "back\\slash.npy", "dtype": ">u2"}[field]
    odd = Manifest(shards=(dataclasses.replace(entry, **{field: bad}),), root=str(root))
    with pytest.raises(ManifestError, match=f"{field}"):
        odd.save(str(tmp_path / "odd.json"))
    assert not (tmp_path / "odd.json").exists()
    with pytest.raises(ManifestError):
        Registry(str(tmp_path / "registry")).register("odd@v1", odd)
    assert not (tmp_path / "registry" / "manifests").exists() or not any(
        (tmp_path / "registry" / "manifests").iterdir()
    )


# --------------------------------------------------------------- property
_CHARS = st.sampled_from([*"ab Z09._-~:\\#?%&+=;'[]ü日\n\t", os.fsdecode(b"\xff")])
_SEGMENT = st.text(_CHARS, min_size=1, max_size=12).filter(lambda s: s not in (".", ".."))


@settings(
    max_examples=150,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(segments=st.lists(_SEGMENT, min_size=1, max_size=3))
def test_build_never_writes_what_load_refuses(tmp_path: Path, segments: list[str]) -> None:
    name = "/".join(segments) + ".npy"
    work = Path(tempfile.mkdtemp(dir=tmp_path))
    try:
        root = work / "data"
        _write(root, name)
        try:
            manifest = build_manifest(str(root))
        except ManifestError as exc:
            assert repr(name) in str(exc) and "hint:" in str(exc)
            return
        assert [s.path for s in manifest.shards] == [name]
        manifest.save(str(root / "manifest.json"))
        loaded = Manifest.load(str(root / "manifest.json"), verify="full")
        assert loaded.id == manifest.id
        got = _read_all(TokenWindows(loaded, SEQ))
        np.testing.assert_array_equal(got, _expected([name]))
    finally:
        shutil.rmtree(work)


# ------------------------------------------------------------------ HTTP
HTTP_NAMES = (
    "sp ace.npy",
    "h#ash.npy",
    "q?mark.npy",
    "pc%41.npy",
    "pcA.npy",
    "pc%zz.npy",
    "plus+amp&eq=.npy",
    "ünï 日本.npy",
    "sub dir/x y.npy",
    "a~b.npy",
    "it's [1].npy",
)


def test_odd_names_over_http_build_verify_and_read_the_right_files(
    http_server: HttpServer, tmp_path: Path
) -> None:
    """nginx serves the files; ``pc%41.npy`` must not fetch its neighbour ``pcA.npy``."""
    local = tmp_path / "data"
    for name in HTTP_NAMES:
        _write(local, name)
    table = pa.table({"row": np.arange(50, dtype=np.int64), "text": [f"r{i}" for i in range(50)]})
    pq.write_table(table, local / "t #1?.parquet", row_group_size=20)
    token_names = list(HTTP_NAMES)
    local_manifest = build_manifest(str(local), pattern="**/*.npy")
    directory, url = http_server.new_dir()
    shutil.copytree(local, directory, dirs_exist_ok=True)

    listed = build_manifest(url)  # nginx autoindex listing (percent-encoded links)
    named = build_manifest(url, paths=token_names)
    assert named.id == local_manifest.id
    assert sorted(s.path for s in listed.shards) == sorted([*token_names, "t #1?.parquet"])
    assert listed.id == build_manifest(str(local)).id
    local_manifest.with_root(url).save(str(directory / "manifest.json"))
    loaded = Manifest.load(f"{url}/manifest.json", verify="full")
    assert loaded.id == local_manifest.id and loaded.root == url

    expected = _expected(token_names)
    ranges = TokenWindows(
        loaded, SEQ, storage=Storage(cache_dir=None)
    )  # range requests, no shard cache
    np.testing.assert_array_equal(_read_all(ranges), expected)
    np.testing.assert_array_equal(_read_all(TokenWindows(loaded, SEQ)), expected)  # default
    cached = TokenWindows(
        loaded, SEQ, storage=Storage(cache_dir=tmp_path / "cache", shard_cache_bytes=1 << 20)
    )
    np.testing.assert_array_equal(_read_all(cached), expected)

    tables = build_manifest(url, paths=["t #1?.parquet"])
    rows = TableRows(tables, storage=Storage(verify="full")).read(np.arange(50))
    np.testing.assert_array_equal(rows["row"], table.column("row").to_numpy())
    assert list(rows["text"]) == table.column("text").to_pylist()
