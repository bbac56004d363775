"""The fast form's path table in compressed blocks (`detdata.identity.path_blocks`), and the
version-1 files (plain paths) that are still read."""

from __future__ import annotations

import json
import random
import shutil
import zlib
from pathlib import Path

import blake3
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from detdata import Manifest, ManifestError, ShardEntry
from detdata.base.canonical import canonical_json
from detdata.identity.columns import ColumnsFile, ShardTable, columns_path
from detdata.identity.columns_tie import check_json, verify_columns_id
from detdata.identity.formats import Format
from detdata.identity.path_blocks import PATH_BLOCK, decode_block, encode_paths
from detdata.storage.fs import MAX_PATH_BYTES, path_problem

DATA = Path(__file__).parent / "data"
DIGEST = "b3:" + "cd" * 32


def _error(what: str) -> ManifestError:
    return ManifestError(what)


def _decoded(paths: list[bytes]) -> list[str]:
    blob, ends, largest = encode_paths(paths)
    out: list[str] = []
    for b in range(len(ends) - 1):
        count = min(PATH_BLOCK, len(paths) - b * PATH_BLOCK)
        out += decode_block(blob[ends[b] : ends[b + 1]], count, largest, _error, b)
    return out


@settings(max_examples=60, deadline=None)
@given(st.lists(st.text(min_size=1, max_size=40), max_size=3 * PATH_BLOCK + 5))
def test_blocks_give_back_the_writer_paths(names: list[str]) -> None:
    raw = [n.encode("utf-8", "surrogatepass") for n in names]
    try:
        want = [r.decode("utf-8") for r in raw]
    except UnicodeDecodeError:  # lone surrogates: not UTF-8, refused by the decoder
        with pytest.raises(ManifestError, match="is not UTF-8"):
            _decoded(raw)
        return
    assert _decoded(raw) == want


def test_a_damaged_block_is_refused_naming_it() -> None:
    paths = [f"d/s{i:05d}.npy".encode() for i in range(300)]
    blob, ends, largest = encode_paths(paths)
    first = blob[ends[0] : ends[1]]
    with pytest.raises(ManifestError, match="path block 0 does not decompress"):
        decode_block(b"\x00" + first[1:], PATH_BLOCK, largest, _error, 0)
    with pytest.raises(ManifestError, match="path block 0 is not one compressed block"):
        decode_block(first[:-3], PATH_BLOCK, largest, _error, 0)  # cut short
    with pytest.raises(ManifestError, match="path block 0 is not one compressed block"):
        decode_block(first + b"x", PATH_BLOCK, largest, _error, 0)  # trailing bytes
    bomb = zlib.compress(b"\0" * (largest + 1))  # decompresses past what the writer wrote
    with pytest.raises(ManifestError, match="at most"):
        decode_block(bomb, PATH_BLOCK, largest, _error, 0)
    lengths = np.full(PATH_BLOCK, 3, dtype="<u4").tobytes()
    short = zlib.compress(lengths + b"abc" * (PATH_BLOCK - 1))
    with pytest.raises(ManifestError, match="lengths add up"):
        decode_block(short, PATH_BLOCK, largest, _error, 7)


def _manifest(root: Path, names: list[str]) -> Manifest:
    entries = tuple(
        ShardEntry(
            path=n,
            bytes=160,
            blake3=DIGEST,
            quick=DIGEST,
            num_samples=16,
            format=Format.NPY,
            dtype="uint16",
            data_offset=128,
        )
        for n in sorted(names)
    )
    return Manifest(shards=entries, root=str(root))


def test_paths_of_any_range_are_the_writer_paths(tmp_path: Path) -> None:
    names = [f"{i // 97:03d}/é-s{i:06d}.npy" for i in range(3 * PATH_BLOCK + 17)]
    names += [f"z/{random.Random(i).getrandbits(64):016x}.npy" for i in range(40)]
    built = _manifest(tmp_path, names)
    want = [s.path for s in built.shards]
    path = str(tmp_path / "manifest.json")
    built.save(path)
    table = Manifest.load(path, verify="off").shards
    assert isinstance(table, ShardTable)
    assert table.columns.header["version"] == 2
    n = len(want)
    assert table.paths_between(0, len(table)) == want
    rng = random.Random(5)
    for _ in range(200):
        lo = rng.randrange(n + 1)
        hi = rng.randrange(lo, n + 1)
        assert table.paths_between(lo, hi) == want[lo:hi], (lo, hi)
    for i in [*range(n), *rng.sample(range(n), 100)]:  # in order (one block decoded), at random
        assert table.path(i) == want[i]
    assert [table[i].path for i in (0, PATH_BLOCK - 1, PATH_BLOCK, n - 1)] == [
        want[0],
        want[PATH_BLOCK - 1],
        want[PATH_BLOCK],
        want[-1],
    ]


def test_sorted_shard_names_take_a_few_bytes_each(tmp_path: Path) -> None:
    """What a restart reads to take every shard's identity: the path table. Names of a
    common pattern take ~2 bytes a shard (was 17 + 8 bytes plain)."""
    names = [f"{i // 1000:04d}/s{i:07d}.npy" for i in range(20_000)]
    blob, ends, _ = encode_paths([n.encode() for n in names])
    per_shard = (len(blob) + ends.nbytes) / len(names)
    assert per_shard < 4, per_shard


def test_a_version_1_fast_form_still_loads_with_its_id(tmp_path: Path) -> None:
    """A fast form saved before path blocks (version 1, plain paths) is read as such: the
    same entries as its JSON, parsed, and the same id."""
    for name in ("v1-columns-manifest.json", "v1-columns-manifest.json.columns"):
        shutil.copy(DATA / name, tmp_path / name)
    path = str(tmp_path / "v1-columns-manifest.json")
    doc = json.loads(Path(path).read_text())
    parsed = Manifest.loads(Path(path).read_text(), root=str(tmp_path))
    loaded = Manifest.load(path, verify="off")
    table = loaded.shards
    assert isinstance(table, ShardTable)  # the fast form, not the JSON
    assert table.columns.header["version"] == 1
    assert loaded.id == doc["id"] == parsed.id
    assert list(table) == list(parsed.shards)
    want = [s["path"] for s in doc["shards"]]
    assert table.paths_between(0, len(table)) == want
    assert [table.path(i) for i in reversed(range(len(want)))] == want[::-1]
    check_json(table)  # the full tie holds
    verify_columns_id(table)
    # saved again, it is written as the current version, with the same id
    loaded.save(str(tmp_path / "again.json"))
    again = Manifest.load(str(tmp_path / "again.json"), verify="off")
    assert isinstance(again.shards, ShardTable)
    assert again.shards.columns.header["version"] == 2
    assert again.id == doc["id"] and list(again.shards) == list(parsed.shards)
    assert Path(columns_path(str(tmp_path / "again.json"))).is_file()


def _with_header(data: bytes, **fields: object) -> bytes:
    """A fast form whose header has ``fields`` changed and its own digest recomputed (what
    anyone can do: the header's digest is in the same file)."""
    hlen = int.from_bytes(data[8:16], "little")
    header = json.loads(data[16 : 16 + hlen])
    header.update(fields)
    raw = canonical_json(header)
    rest = data[16 + hlen + 32 :]
    return data[:8] + len(raw).to_bytes(8, "little") + raw + blake3.blake3(raw).digest() + rest


@pytest.mark.parametrize("raw", [-1, -2, 10**30, 2**40, True, "9"])
def test_a_header_allowing_huge_blocks_is_refused_at_open(tmp_path: Path, raw: object) -> None:
    """The most a path block may decompress to comes from the header, which anyone can
    re-digest: a value outside what any writer writes is refused before a block is read
    (a zip bomb in a block cannot take the reader's memory), and the JSON is read instead."""
    built = _manifest(tmp_path, [f"s{i:04d}.npy" for i in range(300)])
    path = str(tmp_path / "manifest.json")
    built.save(path)
    cpath = columns_path(path)
    Path(cpath).write_bytes(_with_header(Path(cpath).read_bytes(), path_block_raw=raw))
    with pytest.raises(ManifestError, match="path_block_raw"):
        ColumnsFile(cpath)
    with pytest.warns(UserWarning, match="path_block_raw"):
        loaded = Manifest.load(path, verify="off")
    assert not isinstance(loaded.shards, ShardTable) and loaded.id == built.id


def test_a_path_longer_than_any_file_system_takes_is_refused_everywhere(tmp_path: Path) -> None:
    long = "d/" + "x" * MAX_PATH_BYTES
    assert path_problem(long) is not None and "longer than" in str(path_problem(long))
    assert path_problem("d/" + "x" * 4000) is None
    with pytest.raises(ManifestError, match="longer than"):
        _manifest(tmp_path, [long]).save(str(tmp_path / "manifest.json"))
    assert not (tmp_path / "manifest.json").exists()


def test_out_of_range_paths_are_an_index_error(tmp_path: Path) -> None:
    built = _manifest(tmp_path, [f"s{i:04d}.npy" for i in range(300)])
    built.save(str(tmp_path / "manifest.json"))
    table = Manifest.load(str(tmp_path / "manifest.json"), verify="off").shards
    assert isinstance(table, ShardTable)
    for lo, hi in ((0, 301), (-1, 3), (5, 4)):
        with pytest.raises(IndexError):
            table.paths_between(lo, hi)
