"""Derived files in ``index_dir`` are never trusted: every field of every kind is edited here.

Two kinds of derived file live in ``index_dir``: the document table (``documents-<key>``)
and the packing index (``packing-<key>``), each a ``.npy`` plus a ``.json`` record
(``layout``, ``inputs``, ``digest``, ``meta``). Each test edits one field (a count
lowered or raised, a key added or removed, the array forged *with its digest
re-stamped*, so that only a recomputation can notice) and checks that the load warns
naming the file and the field, and that what is delivered equals the independent
reference: the brute-force packer over the writer's own documents.

Covers: detdata/datasets/index_files.py.
"""

from __future__ import annotations

import json
import pickle
import re
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import blake3
import numpy as np
import pytest

import detdata
from detdata.base.errors import StorageError
from detdata.datasets.documents import Documents
from detdata.datasets.packed import PackedWindows
from tests.datasets.doc_corpora import (
    random_documents,
    write_eod_shard,
    write_megatron,
    write_parquet,
)
from tests.order.packing_reference import brute_windows
from tests.resume_checker import run_digests

EOD = 0
OPT: dict[str, Any] = dict(
    seed=5, shuffle=True, seq_len=16, labels=True, bos=None, eos=None, tail="drop", pad_id=None
)


@pytest.fixture(scope="module")
def corpus(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[list[int]]]:
    """A Megatron pair (ending with empty documents), a Parquet file of 3 row groups and an
    eod-token shard: every unit kind, so every ``meta`` field is non-trivial."""
    root = tmp_path_factory.mktemp("derived")
    rng = np.random.default_rng(29)
    mega = random_documents(rng, 12, max_len=30, vocab=900, empty=False)
    mega += [np.zeros(0, dtype=np.int64), np.zeros(0, dtype=np.int64)]
    table = random_documents(rng, 17, max_len=30, vocab=900)
    eod = [d + 1 for d in random_documents(rng, 9, max_len=30, vocab=900, empty=False)]
    write_megatron(root / "a", mega)
    write_parquet(root / "b.parquet", table, row_group_size=7)
    write_eod_shard(root / "c.npy", eod, EOD)
    docs = [d.tolist() for d in mega + table] + [[*d.tolist(), EOD] for d in eod]
    return root, docs


def _documents(root: Path, index: Path | None) -> Documents:
    return Documents(
        detdata.build_manifest(str(root)), column="input_ids", eod_token=EOD, index_dir=index
    )


def _check_against_reference(packed: PackedWindows, docs: list[list[int]]) -> None:
    expected = brute_windows(docs, **OPT)
    assert packed.num_samples == len(expected)
    got = packed.read(np.arange(packed.num_samples))
    for w, ref in enumerate(expected):
        assert got["tokens"][w].tolist() == ref["tokens"], w
        assert got["doc_index"][w].tolist() == ref["doc_index"], w
    n = max(int(x) for x in got["num_segments"])
    assert packed.max_segments >= n


def _files(index: Path, kind: str) -> tuple[Path, Path]:
    record = next(index.glob(f"{kind}-*.json"))
    return record.with_suffix(".npy"), record


def _restamp(npy: Path, record: Path) -> None:
    """Re-write the record's digest for the (forged) ``.npy``: only a recomputation notices."""
    doc = json.loads(record.read_text())
    doc["digest"] = "b3:" + blake3.blake3(npy.read_bytes()).hexdigest()
    record.write_text(json.dumps(doc))


def _edit_json(change: Callable[[dict[str, Any]], None]) -> Callable[[Path, Path], None]:
    def edit(npy: Path, record: Path) -> None:
        doc = json.loads(record.read_text())
        change(doc)
        record.write_text(json.dumps(doc))

    return edit


def _forge_array(change: Callable[[np.ndarray], np.ndarray]) -> Callable[[Path, Path], None]:
    def edit(npy: Path, record: Path) -> None:
        array = change(np.load(npy).copy())
        with open(npy, "wb") as fh:
            np.save(fh, array)
        _restamp(npy, record)

    return edit


def _set(path: tuple[Any, ...], value: Any) -> Callable[[dict[str, Any]], None]:
    def change(doc: dict[str, Any]) -> None:
        node = doc
        for key in path[:-1]:
            node = node[key]
        node[path[-1]] = value(node[path[-1]]) if callable(value) else value

    return change


def _drop(path: tuple[str, ...]) -> Callable[[dict[str, Any]], None]:
    def change(doc: dict[str, Any]) -> None:
        node = doc
        for key in path[:-1]:
            node = node[key]
        del node[path[-1]]

    return change


def _truncate(npy: Path, record: Path) -> None:
    npy.write_bytes(npy.read_bytes()[:-8])


def _garbage(npy: Path, record: Path) -> None:
    record.write_text('{"layout": ')


def _not_an_npy(npy: Path, record: Path) -> None:
    npy.write_bytes(b"not an npy file at all")
    _restamp(npy, record)


# (id, edit, what the warning names)
COMMON = [
    ("layout", _edit_json(_set(("layout",), "detdata.index-v0")), "layout"),
    ("digest", _edit_json(_set(("digest",), "b3:" + "0" * 64)), "hashes to"),
    ("extra-key", _edit_json(_set(("note",), "hi")), "record keys"),
    ("missing-meta", _edit_json(_drop(("meta",))), "record keys"),
    ("meta-not-object", _edit_json(_set(("meta",), [1, 2])), "meta is a list"),
    ("truncated-npy", _truncate, "hashes to"),
    ("garbage-json", _garbage, "unreadable"),
    ("not-an-npy", _not_an_npy, "not a valid .npy"),
]

PACKING = [
    *COMMON,
    ("inputs-seed", _edit_json(_set(("inputs", "seed"), 6)), "inputs"),
    ("windows-3", _edit_json(_set(("meta", "windows"), lambda v: v - 3)), "meta.windows"),
    ("windows+2", _edit_json(_set(("meta", "windows"), lambda v: v + 2)), "meta.windows"),
    ("bound-1", _edit_json(_set(("meta", "segments_bound"), lambda v: v - 1)), "segments_bound"),
    ("bound+1", _edit_json(_set(("meta", "segments_bound"), lambda v: v + 1)), "segments_bound"),
    ("meta-extra", _edit_json(_set(("meta", "tokens"), 1)), "meta.tokens"),
    ("meta-missing", _edit_json(_drop(("meta", "windows"))), "meta.windows"),
    ("offsets-forged", _forge_array(lambda a: _bump(a, 0, 7)), r"offsets\[0, 7\]"),
    ("first-forged", _forge_array(lambda a: _bump(a, 1, 3)), r"offsets\[1, 3\]"),
    ("offsets-shape", _forge_array(lambda a: a[:, :-1].copy()), "shape"),
    ("offsets-dtype", _forge_array(lambda a: a.astype(np.int32)), "int32"),
]


def _bump(array: np.ndarray, row: int, col: int) -> np.ndarray:
    array[row, col] += 1
    return array


@pytest.mark.parametrize("edit", [p[1] for p in PACKING], ids=[p[0] for p in PACKING])
def test_every_field_of_the_packing_index_is_checked(
    corpus: tuple[Path, list[list[int]]], tmp_path: Path, edit: Callable[[Path, Path], None]
) -> None:
    root, docs = corpus
    name = next(p for p in PACKING if p[1] is edit)[2]
    index = tmp_path / "ix"
    documents = _documents(root, index)
    PackedWindows(documents, **OPT)
    npy, record = _files(index, "packing")
    edit(npy, record)
    with pytest.warns(RuntimeWarning, match=re.escape(record.name) + ".*" + name):
        packed = PackedWindows(documents, **OPT)
    _check_against_reference(packed, docs)
    with np.testing.assert_no_warnings():  # rebuilt in place: the next load is clean
        _check_against_reference(PackedWindows(documents, **OPT), docs)


DOCUMENTS = [
    *COMMON,
    ("inputs-eod", _edit_json(_set(("inputs", "eod_token"), 3)), "inputs"),
    ("tokens-0", _edit_json(_set(("meta", "tokens", 0), lambda v: v - 1)), "meta.tokens"),
    ("tokens-1", _edit_json(_set(("meta", "tokens", 1), lambda v: v + 5)), "meta.tokens"),
    ("tokens-2", _edit_json(_set(("meta", "tokens", 2), lambda v: v + 1)), "meta.tokens"),
    ("groups", _edit_json(_set(("meta", "groups", 1, 0), lambda v: v + 1)), "meta.groups"),
    ("groups-gone", _edit_json(_drop(("meta", "groups"))), "meta.groups"),
    ("meta-extra", _edit_json(_set(("meta", "windows"), 3)), "meta.windows"),
    # the array forged with its digest re-stamped
    ("starts-dtype", _forge_array(lambda a: a.astype(np.int32)), "int32"),
    ("starts-2d", _forge_array(lambda a: a.reshape(1, -1)), "1-D"),
    ("starts-origin", _forge_array(lambda a: a + 1), "from 0"),
    ("starts-decrease", _forge_array(lambda a: _swap(a, 3)), "non-decreasing"),
    ("megatron-end", _forge_array(lambda a: _shift(a, 14, 1)), "a.bin"),
    ("table-rows", _forge_array(lambda a: np.delete(a, 20)), "do not end"),
    ("extra-document", _forge_array(lambda a: np.append(a, a[-1])), "past the manifest"),
    ("missing-document", _forge_array(lambda a: a[:-1].copy()), "c.npy"),
]


def _swap(array: np.ndarray, i: int) -> np.ndarray:
    array[i], array[i + 1] = array[i + 1] + 1, array[i]
    return array


def _shift(array: np.ndarray, i: int, by: int) -> np.ndarray:
    array[i:] += by  # still non-decreasing: only the unit boundary is wrong
    return array


@pytest.mark.parametrize("edit", [p[1] for p in DOCUMENTS], ids=[p[0] for p in DOCUMENTS])
def test_every_field_of_the_document_table_is_checked(
    corpus: tuple[Path, list[list[int]]], tmp_path: Path, edit: Callable[[Path, Path], None]
) -> None:
    root, docs = corpus
    name = next(p for p in DOCUMENTS if p[1] is edit)[2]
    index = tmp_path / "ix"
    _documents(root, index)
    npy, record = _files(index, "documents")
    edit(npy, record)
    with pytest.warns(RuntimeWarning, match=re.escape(record.name) + ".*" + name):
        documents = _documents(root, index)
    assert documents.num_documents == len(docs)
    assert [documents.document(d).tolist() for d in range(len(docs))] == docs
    _check_against_reference(PackedWindows(documents, **OPT), docs)


def test_a_worker_reloading_a_removed_or_edited_index_rebuilds_the_same_one(
    corpus: tuple[Path, list[list[int]]], tmp_path: Path
) -> None:
    """What a worker process does when unpickling: the index its parent checked, by digest."""
    root, docs = corpus
    index = tmp_path / "ix"
    packed = PackedWindows(_documents(root, index), **OPT)
    blob = pickle.dumps(packed)
    shutil.rmtree(index)
    with pytest.warns(RuntimeWarning, match="rebuilding it in process"):
        _check_against_reference(pickle.loads(blob), docs)
    packed = PackedWindows(_documents(root, index), **OPT)
    blob = pickle.dumps(packed)
    npy, record = _files(index, "packing")
    _forge_array(lambda a: _bump(a, 0, 4))(npy, record)  # digest re-stamped: not the parent's
    with pytest.warns(RuntimeWarning, match="rebuilding it in process"):
        _check_against_reference(pickle.loads(blob), docs)


def _unwritable_folder(tmp_path: Path) -> Path:
    """A folder this process cannot create files in: 0555 for a user; as root (to whom
    permission bits do not apply) a folder in sysfs, which refuses new entries."""
    folder = tmp_path / "ro"
    folder.mkdir()
    folder.chmod(0o555)
    try:
        (folder / "probe").write_bytes(b"")
    except PermissionError:
        return folder
    (folder / "probe").unlink()
    return Path("/sys/detdata-index")


@pytest.mark.parametrize("where", ["read-only", "under-a-file"])
def test_an_unwritable_index_dir_is_a_storage_error_naming_it(
    corpus: tuple[Path, list[list[int]]], tmp_path: Path, where: str
) -> None:
    root = corpus[0]
    if where == "read-only":
        index = _unwritable_folder(tmp_path)
    else:
        (tmp_path / "file").write_bytes(b"")
        index = tmp_path / "file" / "ix"
    before = sorted(index.parent.iterdir()) if index.parent.is_dir() else None
    with pytest.raises(StorageError, match=re.escape(str(index)) + ".*index_dir=None"):
        _documents(root, index)
    if before is not None:
        assert sorted(index.parent.iterdir()) == before  # nothing half-written
    if index.is_dir():
        assert list(index.iterdir()) == []


def test_a_read_only_index_dir_holding_valid_indexes_is_only_read(
    corpus: tuple[Path, list[list[int]]], tmp_path: Path
) -> None:
    root, docs = corpus
    index = tmp_path / "ix"
    packed = PackedWindows(_documents(root, index), **OPT)
    stamps = {p.name: (p.stat().st_mtime_ns, p.read_bytes()) for p in index.iterdir()}
    index.chmod(0o555)
    try:
        again = PackedWindows(_documents(root, index), **OPT)
    finally:
        index.chmod(0o755)
    assert {p.name: (p.stat().st_mtime_ns, p.read_bytes()) for p in index.iterdir()} == stamps
    assert again.num_samples == packed.num_samples
    _check_against_reference(again, docs)


@pytest.mark.parametrize("damage", ["removed", "forged"])
def test_spawn_workers_over_a_damaged_index_dir_deliver_the_same_bytes(
    corpus: tuple[Path, list[list[int]]], tmp_path: Path, damage: str
) -> None:
    """The index_dir is damaged after construction, before spawn workers unpickle the
    dataset: each worker rebuilds the index the parent checked (never "worker exited
    unexpectedly") and the batches equal a run without workers."""
    root, _ = corpus
    index = tmp_path / "ix"
    packed = PackedWindows(_documents(root, index), **OPT)

    def make(**kw: Any) -> detdata.DataLoader:
        return detdata.DataLoader(packed, global_batch_size=4, micro_batch_size=2, seed=3, **kw)

    straight = run_digests(make(), 8)
    if damage == "removed":
        shutil.rmtree(index)
    else:
        for kind in ("packing", "documents"):
            npy, record = _files(index, kind)
            _forge_array(lambda a: a + 1)(npy, record)
    spawned = make(num_workers=2, multiprocessing_context="spawn")
    assert run_digests(spawned, 8) == straight
