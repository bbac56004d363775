"""Manifests: building, identity, save/load, verification and refusals.

Covers: detdata/base/hashing.py.
"""

from __future__ import annotations

import dataclasses
import json
import pickle
import shutil
import struct
import threading
import tracemalloc
import uuid
from pathlib import Path
from typing import Any

import blake3
import fsspec
import numpy as np
import pyarrow as pa
import pyarrow.ipc as ipc
import pyarrow.parquet as pq
import pytest

import detdata.identity.build as manifest_mod
from detdata.base.canonical import canonical_json
from detdata.base.errors import (
    ConfigError,
    FormatError,
    ManifestError,
    StorageError,
    VerificationError,
)
from detdata.identity.build import build_manifest, hash_files
from detdata.identity.formats import Format
from detdata.identity.manifest import Manifest
from tests.conftest import write_token_shards

MiB = 1 << 20


def b3(data: bytes) -> str:
    return "b3:" + blake3.blake3(data).hexdigest()


def quick_spec(data: bytes) -> str:
    """quick-v1 from its spec: blake3(tag, u64le(size), first MiB, last MiB)."""
    span = min(len(data), MiB)
    return b3(
        b"detdata:quick-v1" + struct.pack("<Q", len(data)) + data[:span] + data[len(data) - span :]
    )


def flip_byte(path: Path, offset: int) -> None:
    data = bytearray(path.read_bytes())
    data[offset] ^= 0xFF
    path.write_bytes(bytes(data))


def doc_of(manifest: Manifest) -> dict[str, Any]:
    return json.loads(json.dumps(manifest.to_json()))


# ---------------------------------------------------------------- building
def test_entries_match_independent_computation(token_shards: Path) -> None:
    m = build_manifest(str(token_shards))
    files = sorted(token_shards.glob("*.npy"))
    assert [s.path for s in m.shards] == [f.name for f in files]
    for shard, f in zip(m.shards, files, strict=True):
        data = f.read_bytes()
        arr = np.load(f)
        assert shard.bytes == len(data)
        assert shard.blake3 == b3(data)
        assert shard.quick == quick_spec(data)
        assert shard.num_samples == arr.size
        assert shard.format is Format.NPY and shard.dtype == "uint16"
        assert shard.data_offset is not None
        assert data[shard.data_offset :] == arr.tobytes()
    assert m.num_samples == 1000 + 2500 + 40
    assert m.root == str(token_shards)


def test_id_is_blake3_of_canonical_json(token_shards: Path) -> None:
    m = build_manifest(str(token_shards), metadata={"tokenizer": "b3:abc", "description": "é"})
    body = {
        "kind": "detdata.manifest",
        "format_version": 1,
        "metadata": dict(m.metadata),
        "shards": [s.to_json() for s in m.shards],
    }
    raw = json.dumps(body, sort_keys=True, separators=(",", ":"), ensure_ascii=False).encode()
    assert canonical_json(m.body()) == raw
    assert m.id == b3(raw)


def test_build_is_deterministic_bytes_and_threads(token_shards: Path, tmp_path: Path) -> None:
    a = build_manifest(str(token_shards), threads=1)
    b = build_manifest(str(token_shards), threads=8)
    assert a.id == b.id
    a.save(str(tmp_path / "a.json"))
    b.save(str(tmp_path / "b.json"))
    assert (tmp_path / "a.json").read_bytes() == (tmp_path / "b.json").read_bytes()


def test_metadata_is_part_of_identity(token_shards: Path) -> None:
    plain = build_manifest(str(token_shards))
    tok1 = build_manifest(str(token_shards), metadata={"tokenizer": "t1"})
    tok2 = build_manifest(str(token_shards), metadata={"tokenizer": "t2"})
    assert len({plain.id, tok1.id, tok2.id}) == 3


def test_metadata_is_detached_and_validated(token_shards: Path) -> None:
    meta: dict[str, Any] = {"tokenizer": "t1"}
    m = build_manifest(str(token_shards), metadata=meta)
    before = m.id
    meta["tokenizer"] = "changed"
    assert Manifest(shards=m.shards, metadata=m.metadata).id == before
    with pytest.raises(ManifestError, match="plain JSON"):
        Manifest(shards=m.shards, metadata={"x": {1, 2}})
    with pytest.raises(ManifestError, match="keys must be strings"):
        Manifest(shards=m.shards, metadata={1: "a"})
    with pytest.raises(ManifestError, match="plain JSON"):
        Manifest(shards=m.shards, metadata={"x": float("nan")})


def test_moving_the_shard_directory_keeps_the_id(token_shards: Path, tmp_path: Path) -> None:
    original = build_manifest(str(token_shards), metadata={"d": "x"})
    original.save(str(tmp_path / "m.json"))
    moved = tmp_path / "elsewhere" / "deeper"
    moved.parent.mkdir()
    shutil.move(str(token_shards), moved)
    rebuilt = build_manifest(str(moved), metadata={"d": "x"})
    assert rebuilt.id == original.id and rebuilt.root != original.root
    loaded = Manifest.load(str(tmp_path / "m.json"), root=str(moved), verify="full")
    assert loaded.id == original.id and loaded.root == str(moved)
    with pytest.raises(VerificationError, match="missing"):
        Manifest.load(str(tmp_path / "m.json"))  # the stored root no longer has the shards


def test_fsspec_urls_give_the_same_id(token_shards: Path) -> None:
    local = build_manifest(str(token_shards))
    as_file_url = build_manifest("file://" + str(token_shards))
    mem_root = f"memory://detdata-test-{uuid.uuid4().hex}/data"
    fs = fsspec.filesystem("memory")
    for f in token_shards.iterdir():
        fs.pipe_file(f"{mem_root}/{f.name}", f.read_bytes())
    in_memory = build_manifest(mem_root)
    assert local.id == as_file_url.id == in_memory.id
    assert in_memory.root == mem_root
    in_memory.verify("full")


def test_pattern_nested_and_sorted(tmp_path: Path) -> None:
    root = tmp_path / "data"
    write_token_shards(root / "b", (10,))
    write_token_shards(root / "a" / "z", (20, 30))
    (root / "notes.txt").write_text("not a shard")
    m = build_manifest(str(root), pattern="**/*.npy")
    assert [s.path for s in m.shards] == [
        "a/z/shard-000.npy",
        "a/z/shard-001.npy",
        "b/shard-000.npy",
    ]
    assert build_manifest(str(root)).id == m.id  # default: every known suffix
    assert [s.path for s in build_manifest(str(root), pattern="b/*.npy").shards] == [
        "b/shard-000.npy"
    ]


def test_build_errors(tmp_path: Path, token_shards: Path) -> None:
    with pytest.raises(ConfigError, match="does not exist"):
        build_manifest(str(tmp_path / "nope"))
    with pytest.raises(ConfigError, match="no shards found"):
        build_manifest(str(token_shards), pattern="*.parquet")
    with pytest.raises(StorageError, match=r"shard missing\.npy"):
        build_manifest(str(token_shards), paths=["missing.npy"])
    with pytest.raises(ManifestError, match=r"\.\."):
        build_manifest(str(token_shards), paths=["../x.npy"])
    with pytest.raises(ConfigError, match="unknown shard format"):
        build_manifest(str(token_shards), format="csv")


# ---------------------------------------------------------------- formats
@pytest.mark.parametrize("dtype", ["uint16", "uint32", "int32", "int64"])
def test_npy_token_dtypes(tmp_path: Path, dtype: str) -> None:
    write_token_shards(tmp_path, (123,), dtype=dtype)
    (shard,) = build_manifest(str(tmp_path)).shards
    assert shard.dtype == dtype and shard.num_samples == 123


def test_npy_refusals(tmp_path: Path) -> None:
    np.save(tmp_path / "two_d.npy", np.zeros((3, 4), dtype=np.uint16))
    with pytest.raises(FormatError, match=r"two_d\.npy.*1-D"):
        build_manifest(str(tmp_path), pattern="two_d.npy")
    np.save(tmp_path / "big.npy", np.zeros(4, dtype=">u2"))
    with pytest.raises(FormatError, match=r"big\.npy.*little-endian"):
        build_manifest(str(tmp_path), pattern="big.npy")
    np.save(tmp_path / "f.npy", np.zeros(4, dtype=np.float32))
    with pytest.raises(FormatError, match=r"f\.npy.*float32|f\.npy.*<f4"):
        build_manifest(str(tmp_path), pattern="f.npy")
    np.save(tmp_path / "short.npy", np.zeros(100, dtype=np.uint16))
    data = (tmp_path / "short.npy").read_bytes()
    (tmp_path / "short.npy").write_bytes(data[:-10])
    with pytest.raises(FormatError, match=r"short\.npy.*100"):
        build_manifest(str(tmp_path), pattern="short.npy")
    (tmp_path / "junk.npy").write_bytes(b"not numpy at all")
    with pytest.raises(FormatError, match=r"junk\.npy"):
        build_manifest(str(tmp_path), pattern="junk.npy")


def test_raw_bin_needs_dtype(tmp_path: Path) -> None:
    tokens = np.arange(1000, dtype=np.uint32)
    (tmp_path / "t.bin").write_bytes(tokens.tobytes())
    with pytest.raises(ConfigError, match="declared dtype"):
        build_manifest(str(tmp_path))
    m = build_manifest(str(tmp_path), dtype="uint32")
    (shard,) = m.shards
    assert (shard.format, shard.dtype, shard.num_samples, shard.data_offset) == (
        Format.BIN,
        "uint32",
        1000,
        0,
    )
    assert build_manifest(str(tmp_path), dtype="uint16").shards[0].num_samples == 2000
    (tmp_path / "t.bin").write_bytes(tokens.tobytes() + b"x")
    with pytest.raises(FormatError, match=r"t\.bin.*multiple"):
        build_manifest(str(tmp_path), dtype="uint32")
    with pytest.raises(ConfigError, match="float32"):
        build_manifest(str(tmp_path), dtype="float32")


def _table(rows: int, extra: bool = False) -> pa.Table:
    cols: dict[str, Any] = {"text": [f"doc {i}" for i in range(rows)], "n": list(range(rows))}
    if extra:
        cols["score"] = [0.5] * rows
    return pa.table(cols)


def test_parquet_and_arrow(tmp_path: Path) -> None:
    pq.write_table(_table(250), tmp_path / "a.parquet", row_group_size=100)
    with ipc.new_file(tmp_path / "b.arrow", _table(1).schema) as writer:
        writer.write_table(_table(70), max_chunksize=30)
    m = build_manifest(str(tmp_path))
    a, b = m.shards
    assert (a.format, a.num_samples, a.row_groups) == (Format.PARQUET, 250, (100, 100, 50))
    assert (b.format, b.num_samples, b.row_groups) == (Format.ARROW, 70, (30, 30, 10))
    assert a.schema == b.schema and a.schema is not None  # same fields and types
    pq.write_table(_table(250, extra=True), tmp_path / "a.parquet", row_group_size=100)
    changed = build_manifest(str(tmp_path)).shards[0]
    assert changed.schema != a.schema
    roundtrip = Manifest.loads(json.dumps(m.to_json()))
    assert roundtrip.shards == m.shards


def test_table_refusals(tmp_path: Path) -> None:
    with ipc.new_stream(tmp_path / "s.arrow", _table(1).schema) as writer:
        writer.write_table(_table(5))
    with pytest.raises(FormatError, match=r"s\.arrow.*Arrow IPC file"):
        build_manifest(str(tmp_path), format="arrow")  # undeclared, it is an arrow_stream
    (tmp_path / "s.arrow").unlink()
    (tmp_path / "x.parquet").write_bytes(b"PAR1 garbage")
    with pytest.raises(FormatError, match=r"x\.parquet.*Parquet"):
        build_manifest(str(tmp_path))


# ---------------------------------------------------------------- save / load
def test_save_load_roundtrip(token_shards: Path, tmp_path: Path) -> None:
    m = build_manifest(str(token_shards), metadata={"tokenizer": "t"})
    out = tmp_path / "m.json"
    assert m.save(str(out)) == m.id
    doc = json.loads(out.read_bytes())  # plain JSON, never pickle
    assert doc["id"] == m.id and doc["root"] == str(token_shards)
    loaded = Manifest.load(str(out))
    assert loaded.id == m.id and loaded.shards == m.shards
    assert loaded.metadata == {"tokenizer": "t"} and loaded.root == str(token_shards)


def test_manifest_inside_root_is_relocatable(token_shards: Path, tmp_path: Path) -> None:
    m = build_manifest(str(token_shards))
    m.save(str(token_shards / "manifest.json"))
    assert json.loads((token_shards / "manifest.json").read_text())["root"] == "."
    moved = tmp_path / "moved"
    shutil.move(str(token_shards), moved)
    loaded = Manifest.load(str(moved / "manifest.json"), verify="full")
    assert loaded.id == m.id and loaded.root == str(moved)
    # rebuilding skips the manifest itself (.json is not a shard)
    assert build_manifest(str(moved)).id == m.id


def test_url_manifest_root_defaults_to_its_directory(token_shards: Path) -> None:
    mem = f"memory://detdata-test-{uuid.uuid4().hex}"
    fs = fsspec.filesystem("memory")
    for f in token_shards.iterdir():
        fs.pipe_file(f"{mem}/{f.name}", f.read_bytes())
    m = build_manifest(mem)
    m.save(f"{mem}/manifest.json")
    loaded = Manifest.load(f"{mem}/manifest.json", verify="full")
    assert loaded.id == m.id


# ---------------------------------------------------------------- verification
def test_truncated_shard_fails_default_load(token_shards: Path, tmp_path: Path) -> None:
    build_manifest(str(token_shards)).save(str(tmp_path / "m.json"))
    victim = token_shards / "shard-001.npy"
    size = victim.stat().st_size
    victim.write_bytes(victim.read_bytes()[:-7])
    with pytest.raises(VerificationError, match=r"shard-001\.npy") as info:
        Manifest.load(str(tmp_path / "m.json"))
    err = info.value
    assert (err.shard, err.field, err.expected, err.found) == (
        "shard-001.npy",
        "bytes",
        size,
        size - 7,
    )
    assert f"expected {size} bytes, found {size - 7}" in str(err)


def test_middle_byte_needs_full_verification(tmp_path: Path) -> None:
    root = tmp_path / "data"
    write_token_shards(root, (10, 3 * MiB // 2, 20))  # shard-001: 3 MiB of uint16
    m = build_manifest(str(root))
    m.save(str(tmp_path / "m.json"))
    victim = root / "shard-001.npy"
    expected = m.shards[1].blake3
    flip_byte(victim, victim.stat().st_size // 2)
    quick = Manifest.load(str(tmp_path / "m.json"))  # head and tail unchanged: quick passes
    assert quick.id == m.id
    with pytest.raises(VerificationError, match=r"shard-001\.npy.*blake3 mismatch") as info:
        Manifest.load(str(tmp_path / "m.json"), verify="full")
    assert info.value.field == "blake3" and info.value.expected == expected
    assert info.value.found == b3(victim.read_bytes())


def test_head_byte_is_caught_by_quick(token_shards: Path, tmp_path: Path) -> None:
    build_manifest(str(token_shards)).save(str(tmp_path / "m.json"))
    flip_byte(token_shards / "shard-002.npy", 200)
    with pytest.raises(VerificationError, match=r"shard-002\.npy.*quick digest") as info:
        Manifest.load(str(tmp_path / "m.json"))
    assert info.value.field == "quick"


def test_missing_shard_and_verify_off(token_shards: Path, tmp_path: Path) -> None:
    m = build_manifest(str(token_shards))
    m.save(str(tmp_path / "m.json"))
    (token_shards / "shard-000.npy").unlink()
    with pytest.raises(VerificationError, match=r"shard-000\.npy.*missing") as info:
        Manifest.load(str(tmp_path / "m.json"))
    assert info.value.field == "exists"
    assert Manifest.load(str(tmp_path / "m.json"), verify="off").id == m.id
    with pytest.raises(ConfigError, match="verify must be one of"):
        Manifest.load(str(tmp_path / "m.json"), verify="fast")


def test_error_names_first_bad_shard_in_path_order(token_shards: Path, tmp_path: Path) -> None:
    build_manifest(str(token_shards)).save(str(tmp_path / "m.json"))
    for name in ("shard-002.npy", "shard-001.npy"):
        p = token_shards / name
        p.write_bytes(p.read_bytes() + b"\0\0")
    with pytest.raises(VerificationError) as info:
        Manifest.load(str(tmp_path / "m.json"), threads=4)
    assert info.value.shard == "shard-001.npy"


# ---------------------------------------------------------------- refusals
def _saved_doc(token_shards: Path) -> dict[str, Any]:
    return doc_of(build_manifest(str(token_shards)))


def _load_doc(doc: dict[str, Any]) -> Manifest:
    return Manifest.loads(json.dumps(doc))


@pytest.mark.parametrize(
    ("bad_path", "message"),
    [
        ("../outside.npy", r"\.\."),
        ("a/../../x.npy", r"\.\."),
        ("/etc/passwd", "absolute or a URL"),
        ("s3://bucket/x.npy", "absolute or a URL"),
        ("file:///x.npy", "absolute or a URL"),
        ("C:/x.npy", "absolute or a URL"),
        ("a\\b.npy", "absolute or a URL"),
        ("a//b.npy", "normalised"),
        ("./a.npy", "normalised"),
        ("", "non-empty"),
    ],
)
def test_unsafe_paths_refused(token_shards: Path, bad_path: str, message: str) -> None:
    doc = _saved_doc(token_shards)
    doc["shards"][0]["path"] = bad_path
    del doc["id"]
    with pytest.raises(ManifestError, match=message) as info:
        _load_doc(doc)
    assert "shard #0" in str(info.value)


def test_duplicate_paths_refused(token_shards: Path) -> None:
    doc = _saved_doc(token_shards)
    doc["shards"][1] = dict(doc["shards"][0])
    del doc["id"]
    with pytest.raises(ManifestError, match=r"duplicate shard paths.*shard-000\.npy"):
        _load_doc(doc)


def test_unsorted_shards_refused(token_shards: Path) -> None:
    doc = _saved_doc(token_shards)
    doc["shards"].reverse()
    del doc["id"]
    with pytest.raises(ManifestError, match="not sorted"):
        _load_doc(doc)


@pytest.mark.parametrize("version", [0, 2, "1", None])
def test_unknown_format_version_refused(token_shards: Path, version: Any) -> None:
    doc = _saved_doc(token_shards)
    doc["format_version"] = version
    with pytest.raises(ManifestError, match=f"unknown format_version {version!r}"):
        _load_doc(doc)


@pytest.mark.parametrize(
    "text", ["", "{", "[1, 2]", '{"kind": "detdata.manifest"', '"just a string"', "nul\x00l"]
)
def test_malformed_json_refused(text: str) -> None:
    with pytest.raises(ManifestError):
        Manifest.loads(text)


def test_duplicate_json_keys_refused(token_shards: Path) -> None:
    doc = _saved_doc(token_shards)
    text = json.dumps(doc)
    text = text.replace('"kind":', '"metadata": {}, "kind":', 1)
    with pytest.raises(ManifestError, match="duplicate key 'metadata'"):
        Manifest.loads(text)


def test_pickle_is_never_loaded(token_shards: Path, tmp_path: Path) -> None:
    m = build_manifest(str(token_shards))
    (tmp_path / "m.pkl").write_bytes(pickle.dumps(m.to_json()))
    with pytest.raises(ManifestError, match="malformed JSON"):
        Manifest.load(str(tmp_path / "m.pkl"))


def test_id_mismatch_refused(token_shards: Path) -> None:
    doc = _saved_doc(token_shards)
    real = doc["id"]
    doc["shards"][0]["num_samples"] += 1
    with pytest.raises(ManifestError, match=f"the file says {real} but its content hashes to b3:"):
        _load_doc(doc)
    doc = _saved_doc(token_shards)
    doc["metadata"] = {"sneaky": "edit"}
    with pytest.raises(ManifestError, match="id mismatch"):
        _load_doc(doc)


@pytest.mark.parametrize(
    ("field", "value", "message"),
    [
        ("bytes", -1, "'bytes' must be a non-negative integer"),
        ("bytes", True, "'bytes' must be a non-negative integer"),
        ("num_samples", "7", "'num_samples' must be a non-negative integer"),
        ("blake3", "b3:xyz", "'blake3' must look like"),
        ("quick", "md5:00", "'quick' must look like"),
        ("format", "csv", "unknown format 'csv'"),
        ("dtype", "float32", "'dtype' must be one of"),
        ("data_offset", None, "without field 'data_offset'"),
        ("extra", 1, "unknown fields \\['extra'\\]"),
    ],
)
def test_bad_shard_fields_refused(token_shards: Path, field: str, value: Any, message: str) -> None:
    doc = _saved_doc(token_shards)
    del doc["id"]
    if value is None:
        del doc["shards"][0][field]
    else:
        doc["shards"][0][field] = value
    with pytest.raises(ManifestError, match=message) as info:
        _load_doc(doc)
    assert "shard-000.npy" in str(info.value) or "shard #0" in str(info.value)


def test_bad_top_level_refused(token_shards: Path) -> None:
    doc = _saved_doc(token_shards)
    for key, value, message in [
        ("kind", "other", "'kind' must be"),
        ("shards", {}, "'shards' must be a list"),
        ("metadata", [], "'metadata' must be an object"),
        ("root", 5, "'root' must be a string"),
        ("surprise", 1, "unknown top-level fields"),
    ]:
        bad = dict(doc, **{key: value})
        with pytest.raises(ManifestError, match=message):
            _load_doc(bad)


def test_missing_manifest_file(tmp_path: Path) -> None:
    with pytest.raises(ManifestError, match="not found"):
        Manifest.load(str(tmp_path / "nope.json"))


# ---------------------------------------------------------------- hashing
def test_hash_files(token_shards: Path, tmp_path: Path) -> None:
    files = sorted(str(p) for p in token_shards.iterdir())
    got = hash_files(files)
    assert got == [(f, Path(f).stat().st_size, b3(Path(f).read_bytes())) for f in files]
    with pytest.raises(StorageError, match=r"nope\.bin: file not found"):
        hash_files([str(tmp_path / "nope.bin")])
    with pytest.raises(StorageError, match="is a directory"):
        hash_files([str(token_shards)])


def test_full_hash_streams_in_bounded_memory(tmp_path: Path) -> None:
    big = tmp_path / "big.bin"
    block = np.random.default_rng(1).integers(0, 256, size=MiB, dtype=np.uint8).tobytes()
    with big.open("wb") as fh:
        for _ in range(48):
            fh.write(block)
    tracemalloc.start()
    try:
        ((_, size, digest),) = hash_files([str(big)])
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert size == 48 * MiB and digest == b3(block * 48)
    assert peak < 24 * MiB, f"peak {peak / MiB:.1f} MiB while hashing a 48 MiB file"


def test_shards_are_hashed_in_parallel(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    write_token_shards(tmp_path, (10, 10, 10, 10))
    threads: set[int] = set()
    calls: list[str] = []
    lock = threading.Lock()
    barrier = threading.Barrier(2, timeout=10)
    real = manifest_mod.digests_file

    def spy(fs: Any, path: str, size: int) -> tuple[str, str]:
        with lock:
            threads.add(threading.get_ident())
            calls.append(path)
            first_two = len(calls) <= 2
        if first_two:
            barrier.wait()  # the first two shards must be hashed at the same time
        return real(fs, path, size)

    monkeypatch.setattr(manifest_mod, "digests_file", spy)
    parallel = build_manifest(str(tmp_path), threads=4)
    assert len(threads) >= 2
    monkeypatch.setattr(manifest_mod, "digests_file", real)
    assert parallel.id == build_manifest(str(tmp_path), threads=1).id


def test_progress_bar_only_when_asked_or_tty(
    token_shards: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    build_manifest(str(token_shards))  # stderr is captured: not a terminal
    assert capsys.readouterr().err == ""
    build_manifest(str(token_shards), progress=True)
    err = capsys.readouterr().err
    assert "hashing" in err and "3/3" in err


def test_npy_headers_are_parsed_one_at_a_time(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Hashing threads never parse .npy headers concurrently (CPython 3.11's ast is not
    thread-safe: python/cpython#106905 made a parallel build fail with SystemError here)."""
    import time

    for i in range(16):
        np.save(tmp_path / f"s{i:02d}.npy", np.arange(10 + i, dtype=np.uint16))
    real = np.lib.format.read_array_header_1_0
    active, peak, lock = [0], [0], threading.Lock()

    def watched(fp: Any, *args: Any, **kwargs: Any) -> Any:
        with lock:
            active[0] += 1
            peak[0] = max(peak[0], active[0])
        time.sleep(0.005)  # widen the window a concurrent parse would need
        try:
            return real(fp, *args, **kwargs)
        finally:
            with lock:
                active[0] -= 1

    monkeypatch.setattr(np.lib.format, "read_array_header_1_0", watched)
    built = build_manifest(str(tmp_path), threads=8)
    assert len(built.shards) == 16 and peak[0] == 1


@pytest.mark.parametrize("version", [(1, 0), (2, 0), (3, 0)])
def test_npy_header_versions_and_truncation(tmp_path: Path, version: tuple[int, int]) -> None:
    data = np.arange(1000, dtype=np.uint32)
    with open(tmp_path / "a.npy", "wb") as fh:
        np.lib.format.write_array(fh, data, version=version)
    entry = build_manifest(str(tmp_path)).shards[0]
    assert entry.num_samples == 1000 and entry.dtype == "uint32"
    raw = (tmp_path / "a.npy").read_bytes()
    (tmp_path / "a.npy").write_bytes(raw[:20])  # cut inside the header
    with pytest.raises(
        FormatError, match=r"shard a\.npy: not a valid \.npy file \(the header is truncated"
    ):
        build_manifest(str(tmp_path))


@pytest.mark.parametrize(
    "bad_path", ["bad\udcff.npy", "\ud800.npy"], ids=["non-utf8-file-name", "lone-surrogate"]
)
def test_path_that_is_not_utf8_is_a_manifest_error(token_shards: Path, bad_path: str) -> None:
    """JSON can escape a lone surrogate, but no UTF-8 manifest can hold it: refused by name
    (never a raw UnicodeEncodeError while computing the id)."""
    doc = _saved_doc(token_shards)
    doc["shards"][0]["path"] = bad_path
    del doc["id"]
    text = json.dumps(doc)  # ASCII JSON with \\udcff escapes
    with pytest.raises(ManifestError, match=r"shard #0.*not valid UTF-8"):
        Manifest.loads(text)


@pytest.mark.parametrize("what", ["directory", "file-as-folder"])
def test_loading_a_directory_or_through_a_file_is_a_manifest_error(
    token_shards: Path, what: str
) -> None:
    path = token_shards if what == "directory" else token_shards / "shard-000.npy" / "m.json"
    with pytest.raises(ManifestError, match=r"cannot read manifest .*hint:"):
        Manifest.load(str(path))


def test_http_shard_urls_are_percent_encoded(token_shards: Path) -> None:
    manifest = build_manifest(str(token_shards))
    entry = manifest.shards[0]
    odd = dataclasses.replace(entry, path="sub dir/a#b?c%41.npy")
    http = Manifest(shards=(odd,), root="http://h:1/data")
    assert http.url(odd) == "http://h:1/data/sub%20dir/a%23b%3Fc%2541.npy"
    s3 = Manifest(shards=(odd,), root="s3://bucket/data")  # object keys are not URL-encoded
    assert s3.url(odd) == "s3://bucket/data/sub dir/a#b?c%41.npy"
