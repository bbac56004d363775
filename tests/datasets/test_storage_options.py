"""`detdata.Storage`: one frozen options object taken by every shard dataset; the old
keywords (``verify=``, ``root=``, ``storage_options=``, ``cache_dir=``, ...) are refused,
naming the `Storage` field to pass instead.

References: the writer's own tokens and rows (what the shards were written from), and the
`Storage` fields as the test lists them. The tests in this file use the old keywords on
purpose.
"""

from __future__ import annotations

import dataclasses
import pickle
import re
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

import detdata
from detdata import (
    ConfigError,
    Documents,
    Manifest,
    RetryPolicy,
    Storage,
    TableRows,
    TokenWindows,
    VerificationError,
    Verify,
)
from detdata.datasets.shard_storage import DefaultCache
from tests.datasets.doc_corpora import random_documents, write_eod_shard

SEQ = 5
EOD = 65_000
RETRY = RetryPolicy(deadline_s=3.0, attempt_timeout_s=1.0)


@pytest.fixture()
def moved(tmp_path: Path) -> dict[str, Any]:
    """Token, table and document shards written under ``made/`` and hashed there, then moved
    to ``moved/``: a dataset finds them only through ``root=``."""
    made = tmp_path / "made"
    rng = np.random.default_rng(11)
    (made / "tok").mkdir(parents=True)
    tokens = [rng.integers(0, 60_000, size=n).astype(np.uint16) for n in (41, 23, 60)]
    for i, a in enumerate(tokens):
        np.save(made / "tok" / f"s{i}.npy", a)
    (made / "tab").mkdir()
    rows = {"x": np.arange(30, dtype=np.int64) * 7, "y": rng.random(30).astype(np.float32)}
    pq.write_table(pa.table(rows), made / "tab" / "t0.parquet", row_group_size=4)
    (made / "doc").mkdir()
    docs = random_documents(rng, 25, max_len=12, vocab=EOD, empty=False)
    write_eod_shard(made / "doc" / "d0.npy", docs, EOD)
    manifests = {k: detdata.build_manifest(str(made / k)) for k in ("tok", "tab", "doc")}
    shutil.move(made, tmp_path / "moved")
    roots = {k: str(tmp_path / "moved" / k) for k in manifests}
    return {"manifests": manifests, "roots": roots, "tokens": tokens, "rows": rows, "docs": docs}


def token_reference(arrays: list[np.ndarray]) -> np.ndarray:
    """Every labelled window of ``SEQ`` tokens, shard after shard (the writer's arrays)."""
    rows = [a[w * SEQ : w * SEQ + SEQ + 1] for a in arrays for w in range((len(a) - 1) // SEQ)]
    return np.stack(rows).astype(np.int32)


#: the keywords before `Storage` -> the field of `Storage` that replaced each (listed here)
OLD_TO_FIELD = {
    "verify": "verify",
    "root": "root",
    "storage_options": "fs_options",
    "retry": "retry",
    "cache_dir": "cache_dir",
    "shard_cache_bytes": "shard_cache_bytes",
    "cache_verify": "cache_verify",
    "max_open_shards": "max_open_shards",
    "cache_bytes": "shard_cache_bytes",
}
NEW = {"verify": "full", "retry": RETRY, "cache_verify": "full", "max_open_shards": 2}


@pytest.mark.parametrize("old", sorted(OLD_TO_FIELD))
@pytest.mark.parametrize("kind", ["tok", "tab", "doc"])
def test_each_old_keyword_is_refused_naming_the_storage_field(
    moved: dict[str, Any], old: str, kind: str
) -> None:
    """An old keyword (with or without ``storage=``) is a `ConfigError` naming the field of
    `Storage` to pass, with a hint; the dataset is not made. (`TableRows` refuses
    ``cache_bytes=`` with its own message: `test_cache_bytes_is_refused_...`.)"""
    if kind == "tab" and old == "cache_bytes":
        return
    manifest = moved["manifests"][kind]
    make = {
        "tok": lambda **kw: TokenWindows(manifest, SEQ, **kw),
        "tab": lambda **kw: TableRows(manifest, **kw),
        "doc": lambda **kw: Documents(manifest, eod_token=EOD, **kw),
    }[kind]
    owner = {"tok": "TokenWindows", "tab": "TableRows", "doc": "Documents"}[kind]
    for extra in ({}, {"storage": Storage(root=moved["roots"][kind])}):
        with pytest.raises(ConfigError) as info:
            make(**{old: "x"}, **extra)
        text = str(info.value)
        assert f"{owner}({old}=...)" in text
        assert f"hint: pass storage=detdata.Storage({OLD_TO_FIELD[old]}=...)" in text


def test_the_storage_fields_give_the_writers_bytes(moved: dict[str, Any]) -> None:
    manifest, root = moved["manifests"]["tok"], moved["roots"]["tok"]
    new = TokenWindows(manifest, SEQ, storage=Storage(root=root, cache_dir=None, **NEW))
    ids = np.arange(new.num_samples)[::-1].copy()
    expected = token_reference(moved["tokens"])[ids]
    assert np.array_equal(new.read(ids)["tokens"], expected)
    assert new.storage.max_open_shards == 2 and new.storage.retry is RETRY

    tab, tab_root = moved["manifests"]["tab"], moved["roots"]["tab"]
    table = TableRows(tab, storage=Storage(root=tab_root, verify="full"))
    ids = np.arange(30)[::-1].copy()
    got = table.read(ids)
    assert np.array_equal(got["x"], moved["rows"]["x"][ids])
    assert np.array_equal(got["y"], moved["rows"]["y"][ids])
    assert table.files.cache_dir is None

    doc, doc_root = moved["manifests"]["doc"], moved["roots"]["doc"]
    docs = Documents(doc, eod_token=EOD, storage=Storage(root=doc_root, max_open_shards=1))
    assert docs.num_documents == len(moved["docs"])
    for d, want in enumerate(moved["docs"]):
        assert np.array_equal(docs.document(d), np.append(want, EOD))


def test_fs_options_reach_the_file_system(moved: dict[str, Any]) -> None:
    manifest, root = moved["manifests"]["tok"], moved["roots"]["tok"]
    ds = TokenWindows(manifest, SEQ, storage=Storage(root=root, fs_options={"auto_mkdir": True}))
    assert ds.storage.fs_options == {"auto_mkdir": True}
    fs, _ = ds.files.filesystem()
    assert fs.storage_options == {"auto_mkdir": True}  # reached the file system
    windows = token_reference(moved["tokens"])
    assert np.array_equal(ds.read([0, 9])["tokens"], windows[[0, 9]])


def test_verify_reaches_the_manifest_check_in_either_spelling(tmp_path: Path) -> None:
    # 3 MiB of tokens with one byte changed in the middle after hashing: the quick digest
    # (size + first/last MiB) cannot see it, a full re-hash must name the shard
    tokens = np.arange(3 << 19, dtype=np.uint16)
    np.save(tmp_path / "big.npy", tokens)
    manifest = detdata.build_manifest(str(tmp_path))
    with open(tmp_path / "big.npy", "r+b") as fh:
        fh.seek(3 << 19)
        byte = fh.read(1)
        fh.seek(3 << 19)
        fh.write(bytes([byte[0] ^ 0xFF]))
    TokenWindows(manifest, SEQ, storage=Storage(verify=Verify.QUICK))  # opens
    with pytest.raises(VerificationError, match=r"big\.npy"):
        TokenWindows(manifest, SEQ, storage=Storage(verify="full"))
    with pytest.raises(ConfigError, match=r"Storage\(verify=\.\.\.\)"):
        TokenWindows(manifest, SEQ, verify="full")  # type: ignore[arg-type]


def test_a_storage_that_is_not_a_storage_is_refused(moved: dict[str, Any]) -> None:
    with pytest.raises(ConfigError, match=r"storage must be a detdata\.Storage, found dict"):
        TableRows(moved["manifests"]["tab"], storage={"root": moved["roots"]["tab"]})  # type: ignore[arg-type]


def test_cache_bytes_is_refused_and_table_rows_names_its_old_meaning(
    moved: dict[str, Any], tmp_path: Path
) -> None:
    tok, tok_root = moved["manifests"]["tok"], moved["roots"]["tok"]
    with pytest.raises(ConfigError, match=r"Storage\(shard_cache_bytes=\.\.\.\)"):
        TokenWindows(tok, SEQ, cache_bytes=1 << 20)  # type: ignore[arg-type]
    ds = TokenWindows(
        tok, SEQ, storage=Storage(root=tok_root, cache_dir=tmp_path, shard_cache_bytes=1 << 20)
    )
    assert ds.storage.shard_cache_bytes == 1 << 20
    tab, tab_root = moved["manifests"]["tab"], moved["roots"]["tab"]
    with pytest.raises(ConfigError) as info:
        TableRows(tab, cache_bytes=1 << 20, storage=Storage(root=tab_root))  # type: ignore[arg-type]
    text = str(info.value)
    assert "TableRows(cache_bytes=...)" in text and "hint:" in text
    assert "row_group_cache_bytes" in text and "shard_cache_bytes" in text


def test_an_unknown_keyword_is_a_type_error(moved: dict[str, Any]) -> None:
    with pytest.raises(TypeError, match="unexpected keyword argument 'verfy'"):
        TokenWindows(moved["manifests"]["tok"], SEQ, verfy="full")  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("root", 3),
        ("root", ""),
        ("verify", "fast"),
        ("fs_options", ["anon"]),
        ("fs_options", {1: True}),
        ("retry", 30.0),
        ("cache_dir", 7),
        ("shard_cache_bytes", 0),
        ("shard_cache_bytes", True),
        ("cache_verify", "off"),
        ("max_open_shards", 0),
        ("max_open_shards", 2.5),
    ],
)
def test_each_bad_field_is_a_config_error_naming_it(field: str, value: object) -> None:
    with pytest.raises(ConfigError) as info:
        Storage(**{field: value, "cache_dir": "/tmp/c"} if field != "cache_dir" else {field: value})
    text = str(info.value)
    assert text.startswith(f"Storage.{field}: expected "), text
    assert ", found " in text and "; hint: " in text


def test_a_cache_bound_without_a_cache_is_refused_where_the_dataset_keeps_none(
    moved: dict[str, Any],
) -> None:
    with pytest.raises(ConfigError, match=r"Storage\.shard_cache_bytes: expected None without"):
        Storage(cache_dir=None, shard_cache_bytes=1 << 20)
    # the default cache_dir (AUTO) is the dataset's: none for TableRows, the user cache for
    # TokenWindows (where a bound is meaningful)
    tab, tab_root = moved["manifests"]["tab"], moved["roots"]["tab"]
    with pytest.raises(ConfigError, match=r"Storage\.shard_cache_bytes"):
        TableRows(tab, storage=Storage(root=tab_root, shard_cache_bytes=1 << 20))
    tok, tok_root = moved["manifests"]["tok"], moved["roots"]["tok"]
    ds = TokenWindows(tok, SEQ, storage=Storage(root=tok_root, shard_cache_bytes=1 << 20))
    assert ds.storage.cache_dir is DefaultCache.USER
    assert ds.files.cache_dir is None  # a local root reads in place whatever the default cache
    with pytest.raises(ConfigError, match="max_open_shards"):
        TokenWindows(tok, SEQ, storage=Storage(root=tok_root, max_open_shards=0))


def test_fields_are_normalised_frozen_and_kept_out_of_the_repr(tmp_path: Path) -> None:
    assert Storage() == Storage(verify="quick", retry=None, fs_options=None, max_open_shards=None)  # type: ignore[arg-type]
    made = Storage(root=tmp_path, cache_dir=tmp_path / "c", verify="full")
    assert made.root == str(tmp_path) and made.cache_dir == str(tmp_path / "c")
    assert made.verify is Verify.FULL and made.max_open_shards == 128
    with pytest.raises(dataclasses.FrozenInstanceError):
        made.verify = Verify.OFF  # type: ignore[misc]
    secret = Storage(root="http://alice:T0KEN@host/data", fs_options={"secret": "S3CR3T"})
    shown = repr(secret)
    assert "T0KEN" not in shown and "S3CR3T" not in shown
    assert "'secret': '***'" in shown and "http://***@host/data" in shown
    assert (
        type(secret).__module__ == "detdata" and repr(type(secret)) == "<class 'detdata.Storage'>"
    )


def test_storage_travels_with_a_pickled_dataset(moved: dict[str, Any]) -> None:
    manifest, root = moved["manifests"]["tok"], moved["roots"]["tok"]
    ds = TokenWindows(manifest, SEQ, storage=Storage(root=root, max_open_shards=1, retry=RETRY))
    back = pickle.loads(pickle.dumps(ds))
    assert back.storage == ds.storage and back.storage.max_open_shards == 1
    ids = np.arange(ds.num_samples)
    assert np.array_equal(back.read(ids)["tokens"], token_reference(moved["tokens"]))
    assert isinstance(back.manifest, Manifest) and back.manifest.id == manifest.id


def test_identity_never_depends_on_storage(moved: dict[str, Any]) -> None:
    manifest, root = moved["manifests"]["tok"], moved["roots"]["tok"]
    plain = TokenWindows(manifest, SEQ, storage=Storage(root=root))
    tuned = TokenWindows(
        manifest,
        SEQ,
        storage=Storage(root=root, verify="full", max_open_shards=1, cache_verify="full"),
    )
    assert plain.identity() == tuned.identity()
    assert re.fullmatch(r"b3:[0-9a-f]{64}", plain.identity()["manifest"])
