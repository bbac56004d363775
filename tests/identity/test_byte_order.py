"""Byte order and declared formats: token bytes are read as the writer wrote them, or refused.

Every comparison is against the writer's own input array. Token shards are
little-endian on disk (a manifest's ``dtype`` is a plain name such as
``uint16``); a big-endian declaration, a big-endian ``.npy`` header or a
non-native ``out_dtype`` is refused with an error naming it, and a ``.npy`` /
Parquet / Arrow file declared as raw ``bin`` is refused instead of delivering
its header bytes as tokens.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.ipc as ipc
import pyarrow.parquet as pq
import pytest
import torch

from detdata import ConfigError, FormatError, Manifest, ManifestError, TokenWindows, build_manifest

SEQ = 8
TOKENS = np.arange(1, 161, dtype=np.int64) * 7  # 160 tokens; swapped bytes give other values


def _windows(tokens: np.ndarray, seq: int = SEQ) -> np.ndarray:
    """Reference windows (with labels) cut from the writer's array."""
    count = (tokens.size - 1) // seq
    return np.stack([tokens[w * seq : w * seq + seq + 1] for w in range(count)]).astype(np.int64)


@pytest.mark.parametrize("name", ["uint16", "uint32", "int32", "int64"])
def test_big_endian_bin_declaration_is_refused_naming_the_file(tmp_path: Path, name: str) -> None:
    big = np.dtype(name).newbyteorder(">")
    TOKENS.astype(big).tofile(tmp_path / "tokens.bin")
    with pytest.raises(ConfigError) as info:
        build_manifest(str(tmp_path), dtype=big.str)
    message = str(info.value)
    assert "tokens.bin" in message and "big-endian" in message and "hint:" in message
    assert list(tmp_path.iterdir()) == [tmp_path / "tokens.bin"]  # nothing written


@pytest.mark.parametrize("name", ["uint16", "uint32", "int32", "int64"])
@pytest.mark.parametrize("spelling", ["plain", "little", "native"])
def test_little_endian_bin_declarations_read_the_writers_values(
    tmp_path: Path, name: str, spelling: str
) -> None:
    little = np.dtype(name).newbyteorder("<")
    TOKENS.astype(little).tofile(tmp_path / "tokens.bin")
    declared = {"plain": name, "little": little.str, "native": "=" + little.str[1:]}[spelling]
    manifest = build_manifest(str(tmp_path), dtype=declared)
    assert manifest.shards[0].dtype == name
    ds = TokenWindows(manifest, SEQ, out_dtype="int64")
    got = ds.read(np.arange(ds.num_samples))["tokens"]
    np.testing.assert_array_equal(got, _windows(TOKENS))


@pytest.mark.parametrize("name", ["uint16", "uint32", "int32", "int64"])
def test_big_endian_npy_is_refused_with_a_hint(tmp_path: Path, name: str) -> None:
    np.save(tmp_path / "big.npy", TOKENS.astype(np.dtype(name).newbyteorder(">")))
    with pytest.raises(FormatError) as info:
        build_manifest(str(tmp_path))
    message = str(info.value)
    assert "big.npy" in message and "little-endian" in message and "hint:" in message


def test_little_endian_npy_of_every_token_dtype_reads_the_writers_values(tmp_path: Path) -> None:
    names = ("uint16", "uint32", "int32", "int64")
    for i, name in enumerate(names):
        np.save(tmp_path / f"s{i}.npy", (TOKENS + i).astype(np.dtype(name).newbyteorder("<")))
    ds = TokenWindows(build_manifest(str(tmp_path)), SEQ)
    assert ds.out_dtype == np.int64
    got = ds.read(np.arange(ds.num_samples))["tokens"]
    expected = np.concatenate([_windows(TOKENS + i) for i in range(len(names))])
    np.testing.assert_array_equal(got, expected)


@pytest.mark.parametrize("out_dtype", [">i4", ">i8", ">u4", ">i2"])
def test_non_native_out_dtype_is_refused_at_construction(
    token_shards: Path, out_dtype: str
) -> None:
    assert not np.dtype(out_dtype).isnative  # this suite runs on little-endian hosts
    with pytest.raises(ConfigError, match=r"out_dtype '>[iu]\d'.*byte order.*hint"):
        TokenWindows(build_manifest(str(token_shards)), SEQ, out_dtype=out_dtype)


@pytest.mark.parametrize("out_dtype", ["<i4", "=i4", "int32", "<i8", "int64"])
def test_native_out_dtype_spellings_give_torch_ready_batches(
    tmp_path: Path, out_dtype: str
) -> None:
    np.save(tmp_path / "s.npy", TOKENS.astype("<u2"))
    ds = TokenWindows(build_manifest(str(tmp_path)), SEQ, out_dtype=out_dtype)
    batch = ds.read(np.arange(ds.num_samples))["tokens"]
    assert batch.dtype.isnative
    tensor = torch.from_numpy(batch)  # torch refuses non-native arrays
    np.testing.assert_array_equal(tensor.numpy(), _windows(TOKENS))


def _write_npy(path: Path) -> None:
    np.save(path, TOKENS.astype(np.uint16))


def _write_parquet(path: Path) -> None:
    pq.write_table(pa.table({"tokens": TOKENS.astype(np.uint16)}), path)


def _write_arrow(path: Path) -> None:
    table = pa.table({"tokens": TOKENS.astype(np.uint16)})
    with ipc.new_file(str(path), table.schema) as writer:
        writer.write_table(table)


@pytest.mark.parametrize(
    ("writer", "kind", "fmt"),
    [
        (_write_npy, ".npy", "npy"),
        (_write_parquet, "Parquet", "parquet"),
        (_write_arrow, "Arrow IPC", "arrow"),
    ],
    ids=["npy", "parquet", "arrow"],
)
@pytest.mark.parametrize("suffix", ["own", "bin"])
def test_container_file_declared_bin_is_refused_naming_it(
    tmp_path: Path, writer: object, kind: str, fmt: str, suffix: str
) -> None:
    name = f"shard.{fmt if suffix == 'own' else 'bin'}"
    writer(tmp_path / name)  # type: ignore[operator]
    with pytest.raises(FormatError) as info:
        build_manifest(str(tmp_path), pattern="shard.*", format="bin", dtype="uint16")
    message = str(info.value)
    assert name in message and kind in message and f"format='{fmt}'" in message


def test_raw_tokens_that_start_like_a_magic_string_are_still_raw_tokens(tmp_path: Path) -> None:
    """Only a real container is refused: raw tokens whose first bytes spell a magic are read."""
    for i, magic in enumerate((b"\x93NUMPY\x01\x00", b"PAR1\x00\x00", b"ARROW1\x00\x00")):
        head = np.frombuffer(magic, dtype="<u2")
        tokens = np.concatenate([head.astype(np.int64), TOKENS])
        tokens.astype("<u2").tofile(tmp_path / f"raw{i}.bin")
    manifest = build_manifest(str(tmp_path), dtype="uint16")
    ds = TokenWindows(manifest, SEQ)
    got = ds.read(np.arange(ds.num_samples))["tokens"]
    expected = []
    for magic in (b"\x93NUMPY\x01\x00", b"PAR1\x00\x00", b"ARROW1\x00\x00"):
        head = np.frombuffer(magic, dtype="<u2").astype(np.int64)
        expected.append(_windows(np.concatenate([head, TOKENS])))
    np.testing.assert_array_equal(got, np.concatenate(expected))


@pytest.mark.parametrize("dtype", [">u2", "<u2", "=u2", "u2", "big"])
def test_manifest_declaring_a_byte_order_is_refused(tmp_path: Path, dtype: str) -> None:
    """A manifest's dtype is a plain name; an edited one with a byte order is not read."""
    np.save(tmp_path / "s.npy", TOKENS.astype("<u2"))
    doc = build_manifest(str(tmp_path)).to_json()
    doc["shards"][0]["dtype"] = dtype
    del doc["id"]
    with pytest.raises(ManifestError, match=r"shard #0.*field 'dtype'"):
        Manifest.loads(json.dumps(doc))
