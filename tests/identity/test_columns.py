"""The manifest's fast form (detdata.identity.columns, DESIGN.md 8): written by save and
register, mapped by load / resolve / the datasets, entries built when used; the id and the
JSON keep their meaning; a damaged or untied fast form is refused or ignored, never trusted.

References are independent of the code under test: the builder's own entries and the
writer's own arrays.
"""

from __future__ import annotations

import json
import os
import pickle
import shutil
import time
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from detdata import (
    Manifest,
    ManifestError,
    Registry,
    ShardEntry,
    Storage,
    TableRows,
    TokenWindows,
    build_manifest,
)
from detdata.identity import receipts
from detdata.identity.columns import CHUNK, ColumnsFile, ShardTable, columns_path, encode_columns
from detdata.identity.formats import Format

DATA = Path(__file__).parent / "data"


def _tokens(root: Path) -> dict[str, np.ndarray]:
    root.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(3)
    arrays = {}
    for i in range(30):
        dtype = np.uint16 if i % 3 else np.int32
        arr = rng.integers(0, 30_000, 200 + 37 * i).astype(dtype)
        np.save(root / f"part-{i:02d}.npy", arr)
        arrays[f"part-{i:02d}.npy"] = arr
    return arrays


def test_save_writes_the_fast_form_and_load_maps_it(tmp_path: Path) -> None:
    arrays = _tokens(tmp_path / "d")
    built = build_manifest(str(tmp_path / "d"), metadata={"tokenizer": "t1"})
    path = str(tmp_path / "d" / "manifest.json")
    built.save(path)
    assert Path(columns_path(path)).is_file()
    loaded = Manifest.load(path)
    assert isinstance(loaded.shards, ShardTable)
    assert loaded.id == built.id
    assert json.loads(Path(path).read_text())["id"] == built.id  # the JSON says the same
    assert loaded.metadata == {"tokenizer": "t1"}
    assert list(loaded.shards) == list(built.shards)  # every entry, field by field
    assert loaded.shards[7] == built.shards[7] and loaded.shards[-1] == built.shards[-1]
    assert loaded.shards[2:5] == built.shards[2:5]
    assert loaded.num_samples == sum(a.size for a in arrays.values())
    assert loaded.total_bytes == sum((tmp_path / "d" / p).stat().st_size for p in arrays)
    assert loaded.body() == built.body()
    # the datasets read the writer's bytes through the mapped form
    ds = TokenWindows(path, 16)
    first = sorted(arrays)[0]
    want = arrays[first][:17].astype(np.int32)
    assert np.array_equal(ds.read([0])["tokens"][0], want)
    n = ds.num_samples
    every = ds.read(np.arange(n))["tokens"]
    expected = np.concatenate(
        [
            arrays[p][: (arrays[p].size - 1) // 16 * 16 + 1][: ((arrays[p].size - 1) // 16) * 16]
            .reshape(-1, 16)
            .astype(np.int32)
            for p in sorted(arrays)
        ]
    )
    assert np.array_equal(every[:, :16], expected)


def test_entries_are_built_lazily(tmp_path: Path) -> None:
    _tokens(tmp_path / "d")
    path = str(tmp_path / "d" / "manifest.json")
    build_manifest(str(tmp_path / "d")).save(path)
    loaded = Manifest.load(path, verify="off")
    table = loaded.shards
    assert isinstance(table, ShardTable)
    TokenWindows(loaded, 16, storage=Storage(verify="off"))
    assert table._cache == {}  # opening the dataset built no entry
    table[4]
    assert set(table._cache) == {4}


def test_every_existing_manifest_loads_and_keeps_its_id(tmp_path: Path) -> None:
    for source in sorted(DATA.glob("*.json")):
        doc = json.loads(source.read_text())
        if doc.get("kind") != "detdata.manifest":
            continue
        old = Manifest.load(str(source), verify="off")
        # parsed, unless a fast form was saved next to it (v1-columns-manifest.json)
        assert isinstance(old.shards, ShardTable) == Path(columns_path(str(source))).exists()
        assert old.id == doc["id"]
        copy = tmp_path / source.name
        old.save(str(copy))
        again = Manifest.load(str(copy), verify="off")
        assert isinstance(again.shards, ShardTable)
        assert again.id == doc["id"] and list(again.shards) == list(old.shards)


def test_tables_round_trip_schema_and_row_groups(tmp_path: Path) -> None:
    root = tmp_path / "t"
    root.mkdir()
    rows = {}
    for i in range(4):
        table = pa.table({"x": np.arange(10 * i, 10 * i + 7 + i, dtype=np.int64)})
        pq.write_table(table, root / f"t{i}.parquet", row_group_size=3)
        rows[i] = table["x"].to_pylist()
    built = build_manifest(str(root))
    path = str(root / "manifest.json")
    built.save(path)
    loaded = Manifest.load(path)
    assert isinstance(loaded.shards, ShardTable)
    assert list(loaded.shards) == list(built.shards)
    assert all(s.row_groups for s in loaded.shards) and all(s.schema for s in loaded.shards)
    ds = TableRows(path)
    got = ds.read(np.arange(ds.num_samples))["x"].tolist()
    assert got == [x for i in range(4) for x in rows[i]]


def test_a_damaged_chunk_is_refused_naming_the_file(tmp_path: Path) -> None:
    _tokens(tmp_path / "d")
    path = str(tmp_path / "d" / "manifest.json")
    build_manifest(str(tmp_path / "d")).save(path)
    raw = bytearray(Path(columns_path(path)).read_bytes())
    raw[-10] ^= 0x01  # the last data chunk (the row group / digest columns)
    Path(columns_path(path)).write_bytes(bytes(raw))
    with pytest.raises(ManifestError, match=r"manifest columns .*data chunk \d+ does not match"):
        Manifest.load(path)  # the verifier checks every chunk
    raw[20] ^= 0x01  # the header: refused at open, the JSON is read instead (with a warning)
    Path(columns_path(path)).write_bytes(bytes(raw))
    with pytest.warns(UserWarning, match="header does not match its digest"):
        parsed = Manifest.load(path, verify="off")
    assert not isinstance(parsed.shards, ShardTable)


def test_a_self_consistent_but_wrong_fast_form_is_caught_by_the_verifier(tmp_path: Path) -> None:
    """Columns rewritten with valid digests but another entry, under the JSON's id: opening
    without verification cannot see it (documented), the job's verification does."""
    _tokens(tmp_path / "d")
    path = str(tmp_path / "d" / "manifest.json")
    built = build_manifest(str(tmp_path / "d"))
    built.save(path)
    other = build_manifest(str(tmp_path / "d"), metadata={})  # same shards
    entries = list(other.shards)
    entries[3] = type(entries[3])(**{**entries[3].__dict__, "num_samples": 5})
    forged = encode_columns(entries, {}, built.id, Path(path).read_bytes())
    Path(columns_path(path)).write_bytes(forged)
    with pytest.raises(ManifestError, match="entries hash to"):
        Manifest.load(path)


@pytest.mark.parametrize("receipts_on", [True, False], ids=["after-a-receipt", "no-receipts"])
def test_a_json_edited_in_place_is_refused_naming_the_file_and_the_field(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, receipts_on: bool
) -> None:
    """The JSON next to its fast form, edited in place after a verified start: same size,
    same claimed id, one shard's digest changed, its modification time set back. The
    fast form is still what a load maps (the size and head tie at open hold), and the
    job's verification refuses it, naming the JSON file, the shard and the field."""
    monkeypatch.setenv(receipts.ENV_DIR, str(tmp_path / "r") if receipts_on else "off")
    _tokens(tmp_path / "d")
    path = tmp_path / "d" / "manifest.json"
    built = build_manifest(str(tmp_path / "d"))
    built.save(str(path))
    time.sleep(receipts.RACY_S + 0.1)  # settled: the receipt records the files' identities
    Manifest.load(str(path))  # verified; with receipts on, a receipt is written
    victim = built.shards[7]
    raw = path.read_bytes()
    old = victim.blake3.encode()
    assert raw.count(old) == 1
    new = old[:-1] + (b"0" if old[-1:] != b"0" else b"1")  # another digest, same length
    st = path.stat()
    with open(path, "r+b") as fh:  # in place: same file, same size
        fh.seek(raw.index(old))
        fh.write(new)
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert path.stat().st_size == st.st_size and path.stat().st_ino == st.st_ino
    assert isinstance(Manifest.load(str(path), verify="off").shards, ShardTable)  # still mapped
    with pytest.raises(ManifestError) as info:
        Manifest.load(str(path))
    text = str(info.value)
    assert f"manifest {path}:" in text, text
    assert f"shard #7 ({victim.path}) field 'blake3' is {new.decode()!r}" in text, text
    assert old.decode() in text, text


def test_a_json_saved_without_its_fast_form_is_parsed(tmp_path: Path) -> None:
    _tokens(tmp_path / "d")
    path = tmp_path / "d" / "manifest.json"
    first = build_manifest(str(tmp_path / "d"), metadata={"v": 1})
    first.save(str(path))
    second = build_manifest(str(tmp_path / "d"), metadata={"v": 2})
    doc = second.to_json()  # written by another tool: the JSON only
    path.write_text(json.dumps(doc, sort_keys=True, indent=1))
    loaded = Manifest.load(str(path), verify="off")
    assert loaded.id == second.id and loaded.metadata == {"v": 2}
    assert not isinstance(loaded.shards, ShardTable)
    path.write_bytes(path.read_bytes()[:-40])  # and a torn one is refused, not mapped
    with pytest.raises(ManifestError, match="malformed JSON"):
        Manifest.load(str(path), verify="off")


def test_registry_stores_and_maps_the_fast_form(tmp_path: Path) -> None:
    _tokens(tmp_path / "d")
    built = build_manifest(str(tmp_path / "d"))
    reg = Registry(str(tmp_path / "reg"))
    reg.register("c@v1", built)
    resolved = reg.resolve("c@v1")
    assert isinstance(resolved.shards, ShardTable)
    assert resolved.id == built.id and list(resolved.shards) == list(built.shards)
    stored = reg.get(built.id)
    assert isinstance(stored.shards, ShardTable)


def test_pickled_manifest_maps_the_same_file_and_refuses_another(tmp_path: Path) -> None:
    _tokens(tmp_path / "d")
    path = str(tmp_path / "d" / "manifest.json")
    built = build_manifest(str(tmp_path / "d"))
    built.save(path)
    loaded = Manifest.load(path, verify="off")
    blob = pickle.dumps(loaded)
    assert len(blob) < 4096  # the path and the header digest, not the columns
    assert list(pickle.loads(blob).shards) == list(built.shards)
    shutil.copy(columns_path(path), str(tmp_path / "keep"))
    build_manifest(str(tmp_path / "d"), metadata={"x": 1}).save(path)  # another manifest
    with pytest.raises(ManifestError, match="changed since this manifest was opened"):
        pickle.loads(blob)


def test_chunks_are_what_a_rank_touches(tmp_path: Path) -> None:
    """A large manifest: opening it and building one entry checks a few chunks, not all."""
    digest = "b3:" + "ab" * 32
    entries = tuple(
        ShardEntry(
            path=f"s{i:06d}.npy",
            bytes=128 + 40,
            blake3=digest,
            quick=digest,
            num_samples=20,
            format=Format.NPY,
            dtype="uint16",
            data_offset=128,
        )
        for i in range(50_000)
    )
    path = str(tmp_path / "manifest.json")
    Manifest(shards=entries, root=str(tmp_path)).save(path)
    loaded = Manifest.load(path, verify="off")
    table = loaded.shards
    assert isinstance(table, ShardTable)
    assert sum(table.columns._checked) == 0
    assert table[31_234] == entries[31_234]
    checked = sum(table.columns._checked)
    total = -(-table.columns.header["data_bytes"] // CHUNK)
    assert 0 < checked <= 13 < total  # one chunk per column at most


def _rchar() -> int:
    for line in Path("/proc/thread-self/io").read_text().splitlines():
        if line.startswith("rchar:"):
            return int(line.split()[1])
    raise AssertionError("no rchar")


def test_a_verified_fast_form_is_read_without_its_chunks_and_a_replaced_one_is_not_trusted(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """After this job's verification checked the columns (or found them unchanged since a
    receipt's check), a lookup reads the bytes it needs, not the 64 KiB chunks around them.
    Without verification, or on another file than the one checked (a copy renamed over it:
    another inode), every chunk is still hashed on use."""
    monkeypatch.setenv("DETDATA_RECEIPTS", str(tmp_path / "receipts"))
    root = tmp_path / "d"
    root.mkdir()
    for i in range(2000):
        np.save(root / f"s{i:05d}.npy", np.full(8 + i % 5, i, dtype=np.uint16))
    built = build_manifest(str(root))
    path = str(root / "manifest.json")
    built.save(path)
    time.sleep(2.1)  # identities taken within RACY_S of a change are not trusted
    want = [s.path for s in built.shards]

    def lookups(manifest: Manifest) -> int:
        table = manifest.shards
        assert isinstance(table, ShardTable)
        before = _rchar()
        for i in (7, 1999, 1000, 333):
            assert table.path(i) == want[i]
        return _rchar() - before

    verified = Manifest.load(path)  # default verification: this process is the verifier
    assert lookups(verified) < 4096
    unverified = Manifest.load(path, verify="off")
    assert lookups(unverified) >= CHUNK  # chunks hashed on use
    # the file replaced by a copy: what was vouched for is the other inode
    checked = receipts._columns_identity(verified)
    data = Path(columns_path(path)).read_bytes()
    Path(columns_path(path) + ".new").write_bytes(data)
    os.replace(columns_path(path) + ".new", columns_path(path))
    time.sleep(2.1)
    copy = Manifest.load(path, verify="off")
    assert isinstance(copy.shards, ShardTable)
    assert not copy.shards.columns.vouch(checked)
    assert lookups(copy) >= CHUNK


def test_a_columns_file_replaced_under_the_verifier_is_neither_vouched_for_nor_recorded(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The verification reads the columns file its manifest has open; what it vouches for
    and records in the receipt is that file's identity, not a `stat` of the path, which may
    name a newer file by then. A damaged file renamed over the path after the verifier
    opened its own is not trusted by a rank that opens it, nor by the next job's load: its
    damage is named there."""
    monkeypatch.setenv("DETDATA_RECEIPTS", str(tmp_path / "receipts"))
    root = tmp_path / "d"
    root.mkdir()
    for i in range(3000):
        np.save(root / f"s{i:05d}.npy", np.full(8, i, dtype=np.uint16))
    built = build_manifest(str(root))
    path = str(root / "manifest.json")
    built.save(path)
    time.sleep(2.1)  # old enough to be recorded
    first = Manifest.load(path, verify="off")  # the verifier's manifest: file A open
    table = first.shards
    assert isinstance(table, ShardTable)
    c = table.columns
    off, _, dt = c.header["sections"]["num_samples"]
    raw = bytearray(Path(columns_path(path)).read_bytes())
    raw[c._data_at + off + 5 * np.dtype(dt).itemsize] ^= 0x40  # shard 5's sample count
    Path(columns_path(path) + ".new").write_bytes(bytes(raw))
    os.replace(columns_path(path) + ".new", columns_path(path))  # B, same header
    time.sleep(2.1)
    first.verify()  # reads A (its open file): passes, and vouches for A only
    assert table.columns.vouch(None)  # A is the file it checked
    rank = Manifest.load(path, verify="off")  # a rank that opens B
    assert isinstance(rank.shards, ShardTable)
    assert not rank.shards.columns.vouch(receipts._columns_identity(first))
    with pytest.raises(ManifestError, match=r"data chunk \d+ does not match its digest"):
        rank.shards[5]
    with pytest.raises(ManifestError, match=r"does not match its digest"):
        Manifest.load(path)  # the next job: B's identity is not the receipt's, so checked


def test_reads_in_any_order_give_the_writer_entries_and_check_each_chunk(tmp_path: Path) -> None:
    """Ranges read in any order (forward pieces, backward, overlapping, scattered) mix
    chunks not yet checked, checked, and kept from a previous read: every entry equals the
    writer's, and a chunk damaged on disk is refused whichever way it is first reached."""
    entries = tuple(
        ShardEntry(
            path=f"{i // 700:02d}/s{i:06d}.npy",
            bytes=128 + 2 * (i % 977 + 1),
            blake3="b3:" + f"{i:064x}",
            quick="b3:" + f"{i * 7:064x}",
            num_samples=i % 977 + 1,
            format=Format.NPY,
            dtype="uint16",
            data_offset=128,
        )
        for i in range(12_000)
    )
    path = str(tmp_path / "manifest.json")
    Manifest(shards=entries, root=str(tmp_path)).save(path)
    rng = np.random.default_rng(11)
    plans = {
        "forward": [(lo, lo + 1000) for lo in range(0, 12_000, 1000)],
        "backward": [(lo, lo + 1000) for lo in range(11_000, -1, -1000)],
        "scattered": [tuple(sorted(rng.integers(0, 12_001, 2))) for _ in range(60)],
    }
    for name, plan in plans.items():
        table = Manifest.load(path, verify="off").shards
        assert isinstance(table, ShardTable)
        for lo, hi in plan:
            hi = min(hi, len(entries))
            assert table.entries_between(lo, hi) == list(entries[lo:hi]), (name, lo, hi)
        assert len(table.columns._kept) <= 16
    data = bytearray(Path(columns_path(path)).read_bytes())
    data[-100] ^= 0xFF  # in the last chunk (the row groups' ends, then padding)
    Path(columns_path(path)).write_bytes(bytes(data))
    table = Manifest.load(path, verify="off").shards
    assert isinstance(table, ShardTable)
    with pytest.raises(ManifestError, match="does not match its digest"):
        for lo in range(0, 12_000, 1000):
            table.entries_between(lo, min(12_000, lo + 1000))


@pytest.mark.parametrize(
    ("bad", "error"),
    [("part-00.npy/x", "entries hash to"), ("../../outside.npy", "not a normalised")],
)
def test_a_forged_path_is_the_tie_s_error_and_nothing_outside_is_read(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, bad: str, error: str
) -> None:
    """Columns re-digested with one path changed, under the JSON's id: the verification
    (whose shard checks run inside the tie's single pass, a piece at a time) raises the
    tie's `ManifestError`, not an I/O error of the forged path; a path leaving the root is
    refused before anything is asked of it."""
    monkeypatch.setattr(receipts, "VERIFY_PIECE", 2)  # shard checks start before the verdict
    _tokens(tmp_path / "d")
    path = str(tmp_path / "d" / "manifest.json")
    built = build_manifest(str(tmp_path / "d"))
    built.save(path)
    (tmp_path / "outside.npy").write_bytes(b"not a shard")
    entries = sorted(
        [
            *list(built.shards)[:1],
            *list(built.shards)[2:],
            type(built.shards[1])(**{**built.shards[1].__dict__, "path": bad}),
        ],
        key=lambda e: e.path,
    )
    forged = encode_columns(entries, {}, built.id, Path(path).read_bytes())
    Path(columns_path(path)).write_bytes(forged)
    with pytest.raises(ManifestError, match=error):
        Manifest.load(path)


def _version_1(data: bytes, paths: list[bytes]) -> bytes:
    """``data`` (a version-2 file) laid out as version 1 wrote it: the paths as one UTF-8
    blob (``paths``) and each path's end, every other section as written."""
    import blake3

    from detdata.base.canonical import canonical_json
    from detdata.identity.columns import ALIGN, MAGIC

    hlen = int.from_bytes(data[8:16], "little")
    header = json.loads(data[16 : 16 + hlen])
    body = data[16 + hlen + 32 + 32 * -(-header["data_bytes"] // CHUNK) :]
    raw = {name: body[at : at + size] for name, (at, size, _) in header["sections"].items()}
    types = {name: spec[2] for name, spec in header["sections"].items()}
    del raw["path_block_ends"], raw["path_blocks"], header["path_block"], header["path_block_raw"]
    raw["path_ends"] = np.cumsum([0] + [len(p) for p in paths], dtype="<i8").tobytes()
    raw["paths"] = b"".join(paths)
    types.update(path_ends="<i8", paths="|u1")
    layout, out = {}, b""
    for name, section in raw.items():
        layout[name] = [len(out), len(section), types[name]]
        out += section + b"\0" * (-len(section) % ALIGN)
    table = b"".join(blake3.blake3(out[i : i + CHUNK]).digest() for i in range(0, len(out), CHUNK))
    header.update(version=1, data_bytes=len(out), sections=layout)
    header["table_digest"] = blake3.blake3(table).hexdigest()
    head = canonical_json(header)
    return (
        MAGIC + len(head).to_bytes(8, "little") + head + blake3.blake3(head).digest() + table + out
    )


def test_a_version_1_file_is_read_and_its_bad_paths_named(tmp_path: Path) -> None:
    _tokens(tmp_path / "d")
    built = build_manifest(str(tmp_path / "d"))
    written = encode_columns(built.shards, {}, built.id, b"{}")
    paths = [s.path.encode() for s in built.shards]
    old = tmp_path / "v1.columns"
    old.write_bytes(_version_1(written, paths))
    assert list(ShardTable(ColumnsFile(str(old)))) == list(built.shards)
    old.write_bytes(_version_1(written, [paths[0], b"\xff" + paths[1][1:], *paths[2:]]))
    with pytest.raises(ManifestError, match=r"shard #1: path b'\\xff.*' is not UTF-8"):
        list(ShardTable(ColumnsFile(str(old))))
