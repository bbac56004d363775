"""The cheaper decode paths of `TableRows` (`detdata.datasets.tables`) against independent
references: the writer's input and pyarrow's own ``read_table(...).to_pylist()``.

* fixed-size list columns skip the length comparison of variable lists (`to_numpy`); lists
  of varying type widths, sliced arrays and nulls are compared / rejected as before;
* with slot storage and only fixed-width columns, a read decodes the missing row groups
  into their slots and gathers the batch once (`GroupSlots.missing`); with an object
  column, or a cache too small for slots, that path is not taken and reads visit groups;
* small local Parquet shards are read without a memory map (`PARQUET_MAP_MIN_BYTES`),
  larger ones mapped: both deliver the same bytes and keep the file checks (replaced,
  truncated, missing shard: a `VerificationError` naming it).
"""

from __future__ import annotations

import collections
import os
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

import detdata
from detdata.base.errors import FormatError, VerificationError
from detdata.datasets import tables
from detdata.datasets.arrow_numpy import to_numpy
from detdata.datasets.rowgroups import Group
from tests.datasets.lru_model import RowGroupCache

WIDTH = 5
DTYPES = ["int8", "int32", "int64", "uint16", "float32", "float64", "bool"]


def _values(rng: np.random.Generator, dtype: str, n: int) -> np.ndarray[Any, Any]:
    if dtype == "bool":
        return rng.integers(0, 2, size=n).astype(bool)
    if dtype.startswith("float"):
        return rng.standard_normal(n).astype(dtype)
    info = np.iinfo(dtype)
    return rng.integers(info.min, info.max, size=n, endpoint=True, dtype=dtype)


def _write_corpus(
    root: Path, shards: int, groups: int, rows: int, seed: int = 0
) -> dict[str, np.ndarray[Any, Any]]:
    """``shards`` Parquet files of ``groups`` row groups of ``rows`` rows; returns the
    writer's input (all rows in id order), one array per column."""
    rng = np.random.default_rng(seed)
    n = shards * groups * rows
    data: dict[str, np.ndarray[Any, Any]] = {
        f"fsl_{d}": _values(rng, d, n * WIDTH).reshape(n, WIDTH) for d in DTYPES
    }
    data["scalar_i64"] = np.arange(n, dtype=np.int64) * 7 - 3
    data["scalar_f32"] = _values(rng, "float32", n)
    data["list_i16"] = _values(rng, "int16", n * 3).reshape(n, 3)  # variable list type
    data["text"] = np.asarray([f"row-{i}-{'x' * (i % 5)}" for i in range(n)], dtype=object)
    root.mkdir(parents=True, exist_ok=True)
    per = groups * rows
    for s in range(shards):
        part = slice(s * per, (s + 1) * per)
        cols: dict[str, pa.Array] = {}
        for d in DTYPES:
            flat = pa.array(data[f"fsl_{d}"][part].reshape(-1))
            cols[f"fsl_{d}"] = pa.FixedSizeListArray.from_arrays(flat, WIDTH)
        cols["scalar_i64"] = pa.array(data["scalar_i64"][part])
        cols["scalar_f32"] = pa.array(data["scalar_f32"][part])
        cols["list_i16"] = pa.array([list(r) for r in data["list_i16"][part]], pa.list_(pa.int16()))
        cols["text"] = pa.array(list(data["text"][part]), pa.string())
        pq.write_table(pa.table(cols), root / f"s{s:03d}.parquet", row_group_size=rows)
    return data


def _pyarrow_rows(root: Path, column: str) -> list[Any]:
    """Every row of ``column`` over the shards in path order, as pyarrow reads them."""
    out: list[Any] = []
    for path in sorted(root.glob("*.parquet")):
        out.extend(pq.read_table(path, columns=[column]).column(column).to_pylist())
    return out


@pytest.fixture(scope="module")
def corpus(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, Any]]:
    root = tmp_path_factory.mktemp("fast") / "data"
    return root, _write_corpus(root, shards=6, groups=4, rows=9)


FIXED = [f"fsl_{d}" for d in DTYPES] + ["scalar_i64", "scalar_f32", "list_i16"]


def _batches(n: int, size: int, seed: int) -> list[np.ndarray[Any, Any]]:
    perm = np.random.default_rng(seed).permutation(n)
    return [perm[i : i + size] for i in range(0, n, size)]


# --- to_numpy: fixed-size lists -------------------------------------------------------
@pytest.mark.parametrize("dtype", DTYPES)
def test_fixed_size_list_to_numpy_matches_the_writers_input(dtype: str) -> None:
    """Whole and sliced (non-zero offset) fixed-size list arrays become the writer's rows."""
    rng = np.random.default_rng(1)
    rows = _values(rng, dtype, 13 * 4).reshape(13, 4)
    array = pa.FixedSizeListArray.from_arrays(pa.array(rows.reshape(-1)), 4)
    got = to_numpy(array, "here")
    assert got.shape == (13, 4) and got.dtype == rows.dtype
    np.testing.assert_array_equal(got, rows)
    sliced = to_numpy(array.slice(3, 6), "here")
    np.testing.assert_array_equal(sliced, rows[3:9])
    assert sliced.tolist() == array.slice(3, 6).to_pylist()
    empty = to_numpy(array.slice(5, 0), "here")
    assert empty.shape == (0, 4)


def test_fixed_size_list_nulls_are_named_errors() -> None:
    inner = pa.FixedSizeListArray.from_arrays(pa.array([1, None, 3, 4], pa.int32()), 2)
    with pytest.raises(FormatError, match=r"col x: 1 null value\(s\) inside lists"):
        to_numpy(inner, "col x")
    outer = pa.array([[1, 2], None], pa.list_(pa.int32(), 2))
    with pytest.raises(FormatError, match=r"col y: 1 null list\(s\)"):
        to_numpy(outer, "col y")
    # a null only outside the slice read is no error, and the slice is the writer's rows
    np.testing.assert_array_equal(to_numpy(inner.slice(1, 1), "col x"), [[3, 4]])


def test_variable_lists_still_compare_lengths() -> None:
    """The path not taken for fixed-size lists: variable lists of one length are 2-D, of
    varying lengths a `FormatError` (or object rows with ragged)."""
    same = pa.array([[1, 2, 3], [4, 5, 6]], pa.list_(pa.int64()))
    np.testing.assert_array_equal(to_numpy(same, "w"), [[1, 2, 3], [4, 5, 6]])
    np.testing.assert_array_equal(to_numpy(same.slice(1, 1), "w"), [[4, 5, 6]])
    varying = pa.array([[1, 2], [3]], pa.list_(pa.int64()))
    with pytest.raises(FormatError, match="list lengths vary from 1 to 2"):
        to_numpy(varying, "w")
    rows = to_numpy(varying, "w", ragged=True)
    assert [r.tolist() for r in rows] == [[1, 2], [3]]


# --- reads through TableRows ----------------------------------------------------------
@pytest.mark.parametrize("column", [*FIXED, "text"])
def test_shuffled_reads_match_pyarrow_and_the_writer(
    corpus: tuple[Path, dict[str, Any]], column: str
) -> None:
    """Every column type, read in shuffled batches through the default cache (two epochs:
    decodes, then slot gathers): rows equal pyarrow's ``to_pylist`` and the writer's input."""
    root, data = corpus
    other = "scalar_f32" if column == "scalar_i64" else "scalar_i64"
    ds = detdata.TableRows(detdata.build_manifest(str(root)), [column, other])
    reference = _pyarrow_rows(root, column)
    for epoch in range(2):
        for ids in _batches(ds.num_samples, 11, seed=epoch):
            got = ds.read(ids)
            assert got[column].tolist() == [reference[i] for i in ids.tolist()]
            if data[column].dtype == object:
                assert got[column].tolist() == data[column][ids].tolist()
            else:
                np.testing.assert_array_equal(got[column], data[column][ids])
                assert got[column].dtype == data[column].dtype
            np.testing.assert_array_equal(got[other], data[other][ids])


def _count_decodes(monkeypatch: pytest.MonkeyPatch) -> collections.Counter[tuple[str, int]]:
    """(file, row group) -> times pyarrow decoded it (counted below the code under test)."""
    seen: collections.Counter[tuple[str, int]] = collections.Counter()
    original = pq.ParquetFile.read_row_group
    original_init = pq.ParquetFile.__init__

    def counted(self: pq.ParquetFile, i: int, *a: Any, **k: Any) -> pa.Table:
        seen[(self._test_name, i)] += 1
        return original(self, i, *a, **k)

    def init(self: pq.ParquetFile, source: Any, *a: Any, **k: Any) -> None:
        original_init(self, source, *a, **k)
        self._test_name = str(getattr(source, "path", source))

    monkeypatch.setattr(pq.ParquetFile, "read_row_group", counted)
    monkeypatch.setattr(pq.ParquetFile, "__init__", init)
    return seen


def test_slot_fill_path_decodes_each_group_once_and_keeps_lru_order(
    corpus: tuple[Path, dict[str, Any]], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Fixed-width columns with slots: the fill-then-gather path is taken (`missing` answers);
    an epoch decodes each row group exactly once, rows are the writer's, and the cache's
    LRU order is that of a plain LRU visiting each read's groups in order of first use."""
    root, data = corpus
    seen = _count_decodes(monkeypatch)
    ds = detdata.TableRows(detdata.build_manifest(str(root)), FIXED)
    model = RowGroupCache(10**6, 10**12)
    starts = np.asarray(ds._index.starts)
    for ids in _batches(ds.num_samples, 13, seed=5):
        got = ds.read(ids)
        for name in FIXED:
            np.testing.assert_array_equal(got[name], data[name][ids])
        groups = np.searchsorted(starts, ids, side="right") - 1
        for g in dict.fromkeys(groups.tolist()):  # first use order
            shard = int(ds._index.shard[g])
            key = (shard, g - int(ds._index.shard_first[shard]))
            if model.get(key) is None:
                model.put(key, Group({}, 0))
        assert ds.cache.keys() == model.keys()
    assert ds.cache.missing(np.arange(len(starts), dtype=np.int64)) is not None  # slots used
    groups_total = len(ds.row_group_sizes)
    assert len(seen) == groups_total and set(seen.values()) == {1}, seen
    assert ds.cache.pool_bytes > 0


def test_object_column_does_not_take_the_slot_fill_path(
    corpus: tuple[Path, dict[str, Any]],
) -> None:
    """A string column (charged its own Arrow bytes, so a fill could evict): `missing`
    declines and reads visit groups one by one; rows are still pyarrow's."""
    root, data = corpus
    ds = detdata.TableRows(detdata.build_manifest(str(root)), ["text", "fsl_int32"])
    reference = _pyarrow_rows(root, "text")
    ids = _batches(ds.num_samples, 17, seed=2)
    ds.read(ids[0])
    assert ds.cache.pool_bytes > 0  # slots, but with an object column
    assert ds.cache.missing(np.arange(3, dtype=np.int64)) is None
    for batch in ids[1:]:
        got = ds.read(batch)
        assert got["text"].tolist() == [reference[i] for i in batch.tolist()]
        np.testing.assert_array_equal(got["fsl_int32"], data["fsl_int32"][batch])


def test_small_cache_without_slots_does_not_take_the_slot_fill_path(
    corpus: tuple[Path, dict[str, Any]],
) -> None:
    """A cache of 3 groups (no slots): `missing` declines; reads (with evictions) still
    deliver the writer's rows."""
    root, data = corpus
    ds = detdata.TableRows(detdata.build_manifest(str(root)), FIXED, cache_row_groups=3)
    for ids in _batches(ds.num_samples, 7, seed=3):
        got = ds.read(ids)
        for name in FIXED:
            np.testing.assert_array_equal(got[name], data[name][ids])
        assert ds.cache.pool_bytes == 0
        assert ds.cache.missing(np.arange(2, dtype=np.int64)) is None
        assert len(ds.cache) <= 3


# --- mapped and unmapped local shards ---------------------------------------------------
def _spy_maps(monkeypatch: pytest.MonkeyPatch) -> list[bool]:
    maps: list[bool] = []
    original_init = pq.ParquetFile.__init__

    def init(self: pq.ParquetFile, source: Any, *a: Any, **k: Any) -> None:
        maps.append(bool(k.get("memory_map", False)))
        original_init(self, source, *a, **k)

    monkeypatch.setattr(pq.ParquetFile, "__init__", init)
    return maps


@pytest.mark.parametrize("threshold", [0, 1 << 40])
def test_mapped_and_unmapped_shards_deliver_the_same_rows(
    corpus: tuple[Path, dict[str, Any]], monkeypatch: pytest.MonkeyPatch, threshold: int
) -> None:
    """Every shard mapped (threshold 0) or none (huge): the writer's rows either way."""
    root, data = corpus
    monkeypatch.setattr(tables, "PARQUET_MAP_MIN_BYTES", threshold)
    maps = _spy_maps(monkeypatch)
    ds = detdata.TableRows(detdata.build_manifest(str(root)), FIXED, cache_row_groups=0)
    for ids in _batches(ds.num_samples, 19, seed=4):
        got = ds.read(ids)
        for name in FIXED:
            np.testing.assert_array_equal(got[name], data[name][ids])
    opened = maps[-6:]
    assert opened and set(opened) == {threshold == 0}


@pytest.mark.parametrize("threshold", [0, 1 << 40])
def test_replaced_truncated_and_missing_shards_are_named_errors(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, threshold: int
) -> None:
    """Mapped or not, a shard replaced by a same-size copy, truncated, or removed after the
    first read is a `VerificationError` naming it, never other bytes."""
    monkeypatch.setattr(tables, "PARQUET_MAP_MIN_BYTES", threshold)
    root = tmp_path / "d"
    data = _write_corpus(root, shards=2, groups=2, rows=4, seed=9)
    ds = detdata.TableRows(detdata.build_manifest(str(root)), ["fsl_int32"], cache_row_groups=0)
    first = np.arange(4, dtype=np.int64)
    np.testing.assert_array_equal(ds.read(first)["fsl_int32"], data["fsl_int32"][first])
    target = root / "s000.parquet"
    copy = tmp_path / "copy.parquet"
    shutil.copyfile(target, copy)
    os.replace(copy, target)  # same bytes and size, another inode
    with pytest.raises(VerificationError, match=r"shard s000\.parquet .*replaced or rewritten"):
        ds.read(first)
    with pytest.raises(VerificationError, match=r"shard s000\.parquet .*replaced or rewritten"):
        ds.read(first + 4)  # the other row group of that shard (a kept handle)
    other = np.arange(8, 12, dtype=np.int64)
    np.testing.assert_array_equal(ds.read(other)["fsl_int32"], data["fsl_int32"][other])

    fresh = detdata.TableRows(detdata.build_manifest(str(root)), ["fsl_int32"], cache_row_groups=0)
    np.testing.assert_array_equal(fresh.read(other)["fsl_int32"], data["fsl_int32"][other])
    victim = root / "s001.parquet"
    size = victim.stat().st_size
    with open(victim, "r+b") as fh:
        fh.truncate(size - 10)
    with pytest.raises(VerificationError, match=r"shard s001\.parquet .*truncated"):
        fresh.read(other)
    victim.unlink()
    with pytest.raises(VerificationError, match=r"shard s001\.parquet .*now has 0"):
        fresh.read(other)
    unopened = detdata.TableRows(
        fresh.manifest, ["fsl_int32"], cache_row_groups=0, storage=detdata.Storage(verify="off")
    )
    with pytest.raises(VerificationError, match=r"shard s001\.parquet .*now has 0"):
        unopened.read(other)  # never opened in this dataset: the size check still names it
