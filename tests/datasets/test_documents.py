"""Documents read in place from each format, compared token by token with the writer's input.

Covers: detdata/datasets/doc_table.py.
"""

from __future__ import annotations

import pickle
import struct
import warnings
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

import detdata
from detdata.base.errors import ConfigError, FormatError, VerificationError
from detdata.datasets.documents import Documents
from detdata.identity.formats import Format
from tests.datasets.doc_corpora import (
    random_documents,
    write_arrow_stream,
    write_eod_shard,
    write_hf_arrow,
    write_megatron,
    write_parquet,
)


def _same(documents: Documents, expected: list[np.ndarray]) -> None:
    """Every document, and every token of the corpus, equals the writer's input."""
    assert documents.num_documents == len(expected)
    assert documents.lengths().tolist() == [len(d) for d in expected]
    for i, doc in enumerate(expected):
        assert documents.document(i).tolist() == doc.tolist(), i
    flat = np.concatenate(expected) if expected else np.empty(0, dtype=np.int64)
    everything = documents.gather(np.arange(documents.num_tokens, dtype=np.int64))
    assert everything.tolist() == flat.tolist()
    rng = np.random.default_rng(1)
    picks = rng.integers(0, documents.num_tokens, size=500)
    assert documents.gather(picks).tolist() == flat[picks].tolist()


# ------------------------------------------------------------------ Megatron .bin/.idx
@pytest.mark.parametrize(("dtype", "sentences"), [("uint16", 1), ("int32", 4), ("int64", 2)])
def test_megatron_pairs_read_every_token_of_the_writers_input(
    tmp_path: Path, dtype: str, sentences: int
) -> None:
    rng = np.random.default_rng(3)
    docs = random_documents(rng, 120, vocab=30000)
    write_megatron(tmp_path / "part-a", docs[:70], dtype=dtype, sentences=sentences, rng=rng)
    write_megatron(tmp_path / "part-b", docs[70:], dtype=dtype, sentences=sentences, rng=rng)
    manifest = detdata.build_manifest(str(tmp_path))
    kinds = {s.path: (s.format, s.dtype, s.num_samples) for s in manifest.shards}
    assert kinds["part-a.bin"] == (Format.BIN, dtype, sum(len(d) for d in docs[:70]))
    assert kinds["part-a.idx"] == (Format.MEGATRON_IDX, dtype, 70)
    assert kinds["part-b.idx"] == (Format.MEGATRON_IDX, dtype, 50)
    documents = Documents(manifest)
    _same(documents, docs)
    assert documents.stored_dtype == np.dtype(dtype)
    # delivered in a dtype a model embeds (issue 34): values unchanged (_same above)
    assert documents.out_dtype == np.result_type(np.dtype(dtype), np.int32)


def test_a_changed_idx_is_a_verification_error_naming_the_idx(tmp_path: Path) -> None:
    docs = random_documents(np.random.default_rng(0), 20, empty=False)
    write_megatron(tmp_path / "c", docs)
    manifest = detdata.build_manifest(str(tmp_path))
    path = manifest.save(str(tmp_path / "manifest.json"))
    del path
    idx = tmp_path / "c.idx"
    raw = bytearray(idx.read_bytes())
    # move one document boundary: the same size, another document index
    at = len(raw) - 8 * 3
    value = struct.unpack("<q", raw[at : at + 8])[0]
    raw[at : at + 8] = struct.pack("<q", value - 1)
    idx.write_bytes(bytes(raw))
    with pytest.raises(VerificationError) as err:
        detdata.Manifest.load(str(tmp_path / "manifest.json"))
    assert err.value.shard == "c.idx" and "c.idx" in str(err.value)
    with pytest.raises(VerificationError, match=r"c\.idx"):
        Documents(manifest)


def test_idx_without_bin_and_bin_without_idx_are_refused(tmp_path: Path) -> None:
    docs = random_documents(np.random.default_rng(0), 10, empty=False)
    write_megatron(tmp_path / "p", docs)
    only_idx = detdata.build_manifest(str(tmp_path), paths=["p.idx"])
    with pytest.raises(FormatError, match=r"p\.idx.*without its data file p\.bin"):
        Documents(only_idx)
    only_bin = detdata.build_manifest(str(tmp_path), paths=["p.bin"])  # dtype from the .idx
    with pytest.raises(ConfigError, match=r"p\.bin.*eod_token"):
        Documents(only_bin)


def test_a_declared_dtype_contradicting_the_idx_is_refused(tmp_path: Path) -> None:
    write_megatron(tmp_path / "p", random_documents(np.random.default_rng(0), 5), dtype="int32")
    with pytest.raises(FormatError, match=r"p\.bin.*'uint16'.*p\.idx says 'int32'"):
        detdata.build_manifest(str(tmp_path), dtype="uint16")


def test_an_idx_declared_as_raw_tokens_is_refused(tmp_path: Path) -> None:
    write_megatron(tmp_path / "p", random_documents(np.random.default_rng(0), 5))
    with pytest.raises(FormatError, match=r"p\.idx.*Megatron index"):
        detdata.build_manifest(str(tmp_path), format="bin", dtype="uint16")


def _rewrite_idx(path: Path, edit: str) -> None:
    raw = bytearray(path.read_bytes())
    s = struct.unpack("<Q", raw[18:26])[0]
    if edit == "pointer":  # the second sequence no longer follows the first
        at = 34 + 4 * s + 8
        raw[at : at + 8] = struct.pack("<q", struct.unpack("<q", raw[at : at + 8])[0] + 2)
    elif edit == "multimodal":
        raw += bytes(s)
    elif edit == "version":
        raw[9:17] = struct.pack("<Q", 2)
    elif edit == "float":
        raw[17] = 7
    path.write_bytes(bytes(raw))


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        ("pointer", r"p\.idx.*sequence 1 starts at byte"),
        ("multimodal", r"p\.idx.*multimodal"),
        ("version", r"p\.idx.*version 2"),
        ("float", r"p\.idx.*code 7 \(float32\)"),
    ],
)
def test_malformed_indexes_are_format_errors_naming_the_idx(
    tmp_path: Path, edit: str, message: str
) -> None:
    write_megatron(tmp_path / "p", random_documents(np.random.default_rng(0), 6, empty=False))
    _rewrite_idx(tmp_path / "p.idx", edit)
    with pytest.raises(FormatError, match=message):
        Documents(detdata.build_manifest(str(tmp_path)))


# ------------------------------------------------------------------ token shards + EOD
def test_eod_token_shards_cut_documents_after_each_eod(tmp_path: Path) -> None:
    rng = np.random.default_rng(5)
    eod = 0
    docs = [d + 1 for d in random_documents(rng, 80, vocab=1000)]  # no document holds eod
    write_eod_shard(tmp_path / "s0.npy", docs[:50], eod)
    write_eod_shard(tmp_path / "s1.npy", docs[50:], eod)
    np.save(tmp_path / "s2.npy", np.array([5, 6, 7], dtype=np.uint16))  # no eod at its end
    documents = Documents(detdata.build_manifest(str(tmp_path)), eod_token=eod)
    expected = [np.append(d, eod) for d in docs] + [np.array([5, 6, 7])]
    _same(documents, expected)


def test_eod_token_is_needed_for_plain_token_shards_and_refused_elsewhere(tmp_path: Path) -> None:
    np.save(tmp_path / "s.npy", np.arange(10, dtype=np.uint16))
    with pytest.raises(ConfigError, match=r"s\.npy.*eod_token"):
        Documents(detdata.build_manifest(str(tmp_path)))
    meg = tmp_path / "meg"
    meg.mkdir()
    write_megatron(meg / "p", random_documents(np.random.default_rng(0), 4))
    with pytest.raises(ConfigError, match="eod_token=3 was given"):
        Documents(detdata.build_manifest(str(meg)), eod_token=3)


# ------------------------------------------------------------------ tables
def test_parquet_token_list_column_one_row_one_document(tmp_path: Path) -> None:
    rng = np.random.default_rng(7)
    docs = random_documents(rng, 90)
    write_parquet(tmp_path / "a.parquet", docs[:40], row_group_size=7)
    write_parquet(tmp_path / "b.parquet", docs[40:], row_group_size=13, value=pa.int64())
    manifest = detdata.build_manifest(str(tmp_path))
    documents = Documents(manifest, column="input_ids")
    _same(documents, docs)
    assert documents.out_dtype == np.dtype(np.int64)  # int32 and int64 shards: the common type


def test_parquet_nulls_and_non_list_columns_are_refused(tmp_path: Path) -> None:
    table = pa.table({"input_ids": pa.array([[1, 2], None, [3]], type=pa.list_(pa.int32()))})
    pq.write_table(table, tmp_path / "n.parquet")
    manifest = detdata.build_manifest(str(tmp_path))
    with pytest.raises(FormatError, match=r"n\.parquet column 'input_ids': null"):
        Documents(manifest, column="input_ids")
    with pytest.raises(ConfigError, match="no column 'ids'"):
        Documents(manifest, column="ids")
    with pytest.raises(ConfigError, match="pass column="):
        Documents(manifest)


def test_hugging_face_datasets_arrow_stream_cache_files(tmp_path: Path) -> None:
    rng = np.random.default_rng(11)
    docs = random_documents(rng, 64, vocab=30000)
    write_hf_arrow(tmp_path / "hf", docs, shards=3)
    with pytest.raises(FormatError, match=r"Arrow IPC \*stream\*.*format='arrow_stream'"):
        detdata.build_manifest(str(tmp_path / "hf"), format="arrow")  # declared wrong
    manifest = detdata.build_manifest(str(tmp_path / "hf"), format="arrow_stream")
    assert {s.format for s in manifest.shards} == {Format.ARROW_STREAM}
    detected = detdata.build_manifest(str(tmp_path / "hf"))  # no format=: the bytes say
    assert [s.format for s in detected.shards] == [Format.ARROW_STREAM] * 3
    assert detected.id == manifest.id
    assert sum(s.num_samples for s in manifest.shards) == 64
    documents = Documents(manifest, column="input_ids")
    _same(documents, docs)
    assert documents.out_dtype == np.dtype(np.int32)


def test_pyarrow_stream_writer_and_arrow_files(tmp_path: Path) -> None:
    rng = np.random.default_rng(12)
    docs = random_documents(rng, 33)
    write_arrow_stream(tmp_path / "s.arrow", docs, batch=4)
    documents = Documents(
        detdata.build_manifest(str(tmp_path), format="arrow_stream"), column="input_ids"
    )
    _same(documents, docs)
    files = tmp_path / "files"
    files.mkdir()
    table = pa.table({"input_ids": pa.array([d.tolist() for d in docs], pa.list_(pa.uint16()))})
    with pa.OSFile(str(files / "f.arrow"), "wb") as sink, pa.ipc.new_file(sink, table.schema) as w:
        for batch in table.to_batches(max_chunksize=6):
            w.write_batch(batch)
    _same(Documents(detdata.build_manifest(str(files)), column="input_ids"), docs)


def test_mixed_formats_in_one_manifest_in_path_order(tmp_path: Path) -> None:
    rng = np.random.default_rng(13)
    docs = random_documents(rng, 30, vocab=1000, empty=False)
    write_megatron(tmp_path / "a", docs[:10])
    write_parquet(tmp_path / "b.parquet", docs[10:20])
    write_eod_shard(tmp_path / "c.npy", [d + 1 for d in docs[20:]], 0)
    documents = Documents(detdata.build_manifest(str(tmp_path)), column="input_ids", eod_token=0)
    _same(documents, docs[:20] + [np.append(d + 1, 0) for d in docs[20:]])


# ------------------------------------------------------------------ index files, pickling
def test_document_table_is_stored_content_addressed_and_rebuilt_when_tampered(
    tmp_path: Path,
) -> None:
    data, index = tmp_path / "data", tmp_path / "index"
    data.mkdir()
    docs = [d + 1 for d in random_documents(np.random.default_rng(2), 40, vocab=100)]
    write_eod_shard(data / "s.npy", docs, 0)
    manifest = detdata.build_manifest(str(data))
    first = Documents(manifest, eod_token=0, index_dir=index)
    stored = sorted(p.name for p in index.iterdir())
    assert len(stored) == 2 and stored[0].startswith("documents-")
    again = Documents(manifest, eod_token=0, index_dir=index)
    assert again.starts.tolist() == first.starts.tolist()
    other = Documents(manifest, eod_token=7, index_dir=index)  # other inputs: another file
    assert len(list(index.iterdir())) == 4 and other.num_documents != first.num_documents
    npy = next(p for p in index.iterdir() if p.suffix == ".npy" and p.name in stored)
    raw = bytearray(npy.read_bytes())
    raw[-8] ^= 1
    npy.write_bytes(bytes(raw))
    with pytest.warns(RuntimeWarning, match="rebuilding"):
        rebuilt = Documents(manifest, eod_token=0, index_dir=index)
    assert rebuilt.starts.tolist() == first.starts.tolist()


def test_pickle_round_trip_reads_the_same_tokens(tmp_path: Path) -> None:
    docs = random_documents(np.random.default_rng(4), 30)
    write_megatron(tmp_path / "p", docs)
    documents = Documents(detdata.build_manifest(str(tmp_path)))
    documents.gather(np.arange(5))  # opens a memory map, which must not travel
    for index_dir in (None, str(tmp_path / "ix")):
        source = Documents(detdata.build_manifest(str(tmp_path)), index_dir=index_dir)
        copy = pickle.loads(pickle.dumps(source))
        _same(copy, docs)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert len(pickle.dumps(documents)) < 20_000


@pytest.mark.parametrize("dtype", ["uint16", "int32"])
def test_an_eod_token_outside_the_shards_dtype_is_refused_naming_the_shard(
    tmp_path: Path, dtype: str
) -> None:
    """Such a token can never occur: every shard would silently be one document."""
    np.save(tmp_path / "s.npy", np.array([5, 6, 0, 7], dtype=dtype))
    manifest = detdata.build_manifest(str(tmp_path))
    too_big = int(np.iinfo(np.dtype(dtype)).max) + 1
    with pytest.raises(ConfigError, match=rf"eod_token={too_big} .*s\.npy.*{dtype}"):
        Documents(manifest, eod_token=too_big)
    assert Documents(manifest, eod_token=0).num_documents == 2  # in range: two documents
