"""TableRows over real Parquet (several row groups) and Arrow IPC shards."""

from __future__ import annotations

import datetime as dt
import multiprocessing as mp
import pickle
import threading
import uuid
from pathlib import Path
from typing import Any

import fsspec
import numpy as np
import pyarrow as pa
import pyarrow.ipc as ipc
import pyarrow.parquet as pq
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from detdata import Storage
from detdata.base.errors import ConfigError, FormatError
from detdata.datasets.arrow_numpy import to_numpy
from detdata.datasets.base import Dataset
from detdata.datasets.rowgroups import Group
from detdata.datasets.tables import TableRows
from detdata.identity.build import build_manifest
from detdata.loading.loader import DataLoader
from detdata.loading.options import LoaderOptions, ReadOptions
from tests.datasets.lru_model import RowGroupCache
from tests.datasets.test_aliasing import (
    RAGGED,
    ROWS,
    check_rows,
    plain_numpy,
    plain_torch,
    snapshot,
    write_kinds,
)

WIDTH = 12
SHARD_ROWS = (130, 47, 211)
GROUP_ROWS = 32  # several row groups per shard, the last one shorter

Reference = dict[str, np.ndarray]


def make_columns(rng: np.random.Generator, start: int, rows: int) -> dict[str, np.ndarray]:
    return {
        "row": np.arange(start, start + rows, dtype=np.int64),
        "tokens": rng.integers(-(2**31), 2**31 - 1, size=(rows, WIDTH), dtype=np.int32),
        "fixed": rng.integers(0, 1000, size=(rows, 3), dtype=np.int32),
        "score": rng.random(rows).astype(np.float32),
        "text": np.asarray([f"doc-{start + i}" for i in range(rows)], dtype=object),
    }


def to_table(cols: dict[str, np.ndarray]) -> pa.Table:
    rows = len(cols["row"])
    return pa.table(
        {
            "row": cols["row"],
            "tokens": pa.ListArray.from_arrays(
                np.arange(0, (rows + 1) * WIDTH, WIDTH, dtype=np.int32),
                pa.array(cols["tokens"].reshape(-1)),
            ),
            "fixed": pa.FixedSizeListArray.from_arrays(pa.array(cols["fixed"].reshape(-1)), 3),
            "score": cols["score"],
            "text": pa.array(cols["text"].tolist(), pa.string()),
        }
    )


def write_shards(root: Path, fmt: str, seed: int = 0) -> Reference:
    """Write the shards; return the concatenated original columns (the reference)."""
    rng = np.random.default_rng(seed)
    root.mkdir(parents=True, exist_ok=True)
    parts, start = [], 0
    for i, rows in enumerate(SHARD_ROWS):
        cols = make_columns(rng, start, rows)
        table = to_table(cols)
        if fmt == "parquet":
            pq.write_table(table, root / f"part-{i}.parquet", row_group_size=GROUP_ROWS)
        else:
            with ipc.new_file(root / f"part-{i}.arrow", table.schema) as writer:
                for batch in table.to_batches(max_chunksize=GROUP_ROWS):
                    writer.write_batch(batch)
        parts.append(cols)
        start += rows
    return {k: np.concatenate([p[k] for p in parts]) for k in parts[0]}


@pytest.fixture(scope="module", params=["parquet", "arrow"])
def tables(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> tuple[TableRows, Reference]:
    root = tmp_path_factory.mktemp(request.param)
    ref = write_shards(root, request.param)
    return TableRows(build_manifest(str(root)), cache_row_groups=4), ref


def per_sample(ref: Reference, name: str, ids: np.ndarray) -> list[Any]:
    """The straightforward reference: one slice of the original array per id."""
    return [ref[name][i] for i in ids]


@settings(max_examples=40, deadline=None)
@given(raw=st.lists(st.integers(0, 10**6), min_size=1, max_size=70))
def test_read_matches_per_sample_reference(
    tables: tuple[TableRows, Reference], raw: list[int]
) -> None:
    ds, ref = tables
    ids = np.asarray(raw, dtype=np.int64) % ds.num_samples
    batch = ds.read(ids)
    assert list(batch) == ["row", "tokens", "fixed", "score", "text"]
    assert batch["tokens"].shape == (len(ids), WIDTH) and batch["tokens"].dtype == np.int32
    assert batch["fixed"].shape == (len(ids), 3)
    for name in batch:
        np.testing.assert_array_equal(batch[name], np.stack(per_sample(ref, name, ids)))
    assert len(ds.cache) <= 4


def test_counts_identity_and_locate(tables: tuple[TableRows, Reference]) -> None:
    ds, _ = tables
    assert ds.num_samples == sum(SHARD_ROWS)
    assert isinstance(ds, Dataset)
    assert ds.identity() == {
        "type": "table_rows",
        "manifest": ds.manifest.id,
        "columns": ["row", "tokens", "fixed", "score", "text"],
        "num_samples": sum(SHARD_ROWS),
    }
    shard, group, row = ds.locate(np.array([0, 31, 32, 129, 130, 176, 177, 387]))
    assert shard.tolist() == [0, 0, 0, 0, 1, 1, 2, 2]
    assert group.tolist() == [0, 0, 1, 4, 0, 1, 0, 6]
    assert row.tolist() == [0, 31, 0, 1, 0, 14, 0, 18]


def test_every_row_in_reverse_with_duplicates(tables: tuple[TableRows, Reference]) -> None:
    ds, ref = tables
    ids = np.concatenate([np.arange(ds.num_samples)[::-1], [5, 5, 0, 5]])
    batch = ds.read(ids)
    np.testing.assert_array_equal(batch["row"], ids)
    np.testing.assert_array_equal(batch["tokens"], ref["tokens"][ids])


def test_selected_columns_only(tmp_path: Path) -> None:
    ref = write_shards(tmp_path, "parquet", seed=3)
    ds = TableRows(build_manifest(str(tmp_path)), ["tokens", "row"])
    batch = ds.read(np.array([200, 7]))
    assert list(batch) == ["tokens", "row"]
    np.testing.assert_array_equal(batch["tokens"], ref["tokens"][[200, 7]])
    assert ds.identity()["columns"] == ["tokens", "row"]
    group = ds.cache.get(ds.cache.keys()[0])
    assert group is not None and sorted(group.columns) == ["row", "tokens"]
    with pytest.raises(ConfigError, match=r"nope.*part-0\.parquet"):
        TableRows(ds.manifest, ["tokens", "nope"])
    with pytest.raises(ConfigError, match="sequence"):
        TableRows(ds.manifest, "tokens")


def test_empty_ids_keep_column_shapes(tables: tuple[TableRows, Reference]) -> None:
    ds, _ = tables
    batch = ds.read(np.array([], dtype=np.int64))
    assert batch["tokens"].shape == (0, WIDTH) and batch["tokens"].dtype == np.int32
    assert batch["score"].shape == (0,)


def test_cache_is_bounded_and_reused(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    write_shards(tmp_path, "parquet", seed=1)
    ds = TableRows(build_manifest(str(tmp_path)), cache_row_groups=3)
    decodes: list[tuple[int, int]] = []
    original = ds._decode

    def counting(shard: int, group: int) -> Group:
        decodes.append((shard, group))
        return original(shard, group)

    monkeypatch.setattr(ds, "_decode", counting)
    rng = np.random.default_rng(0)
    for _ in range(30):
        ids = rng.integers(0, ds.num_samples, size=int(rng.integers(1, 40)))
        ds.read(ids)
        assert len(ds.cache) <= 3
    # within a call each needed row group is decoded at most once, even with no cache hits
    decodes.clear()
    ids = np.arange(0, ds.num_samples, 5)
    ds.read(ids)
    shard, group, _ = ds.locate(ids)
    assert (
        len(decodes)
        == len(set(decodes))
        == len(set(zip(shard.tolist(), group.tolist(), strict=True)))
    )
    # a repeated small read hits the cache
    ds.read(np.array([1, 2]))
    decodes.clear()
    ds.read(np.array([2, 1, 3]))
    assert decodes == []


def test_cache_byte_bound(tmp_path: Path) -> None:
    write_shards(tmp_path, "arrow", seed=2)
    manifest = build_manifest(str(tmp_path))
    probe = TableRows(manifest, ["tokens"], cache_row_groups=100)
    probe.read(np.array([0]))
    one = probe.cache.nbytes
    assert one > 0
    bound = int(2.5 * one)  # the first group is a full one: at most 2 full groups fit
    ds = TableRows(manifest, ["tokens"], cache_row_groups=100, row_group_cache_bytes=bound)
    starts = range(0, ds.num_samples, 16)
    for start in starts:
        ds.read(np.array([start]))
        assert 0 < ds.cache.nbytes <= bound
    assert 2 <= len(ds.cache) < len(starts) // 2
    too_small = TableRows(manifest, ["tokens"], row_group_cache_bytes=one - 1)
    np.testing.assert_array_equal(
        too_small.read(np.array([0]))["tokens"], probe.read(np.array([0]))["tokens"]
    )
    assert len(too_small.cache) == 0  # a group larger than the byte bound is not kept
    off = TableRows(manifest, ["tokens"], cache_row_groups=0)
    off.read(np.arange(100))
    assert len(off.cache) == 0


def test_cache_bytes_is_refused_where_it_named_the_row_group_cache(tmp_path: Path) -> None:
    # cache_bytes= once named row_group_cache_bytes here and shard_cache_bytes in TokenWindows;
    # it now means the latter everywhere, so TableRows refuses it rather than change meaning
    write_shards(tmp_path, "arrow", seed=2)
    manifest = build_manifest(str(tmp_path))
    new = TableRows(manifest, ["tokens"], row_group_cache_bytes=5000)
    assert new.row_group_cache_bytes == new.cache.max_bytes == 5000
    assert new.identity() == TableRows(manifest, ["tokens"]).identity()
    assert TableRows(manifest, ["tokens"]).row_group_cache_bytes == 1 << 30
    with pytest.raises(ConfigError, match=r"TableRows\(cache_bytes=\.\.\.\) is no longer"):
        TableRows(manifest, ["tokens"], cache_bytes=5000)


def test_lru_evicts_least_recently_used() -> None:
    cache = RowGroupCache(max_groups=2, max_bytes=10**9)
    item = Group({}, 10)
    cache.put((0, 0), item)
    cache.put((0, 1), item)
    assert cache.get((0, 0)) is item  # (0, 1) is now the least recently used
    cache.put((1, 0), item)
    assert cache.keys() == [(0, 0), (1, 0)]
    assert cache.nbytes == 20


def test_mismatched_schemas_name_both_shards_and_field(tmp_path: Path) -> None:
    pq.write_table(
        pa.table({"a": pa.array([1, 2], pa.int64()), "b": [1.0, 2.0]}), tmp_path / "x.parquet"
    )
    pq.write_table(
        pa.table({"a": pa.array([1, 2], pa.int32()), "b": [1.0, 2.0]}), tmp_path / "y.parquet"
    )
    with pytest.raises(FormatError, match=r"x\.parquet and y\.parquet.*'a': int64 vs int32"):
        TableRows(build_manifest(str(tmp_path)))


def test_missing_field_is_named(tmp_path: Path) -> None:
    pq.write_table(pa.table({"a": [1, 2], "b": [1.0, 2.0]}), tmp_path / "x.parquet")
    pq.write_table(pa.table({"a": [1, 2]}), tmp_path / "y.parquet")
    with pytest.raises(FormatError, match=r"x\.parquet and y\.parquet.*'b' only in the first"):
        TableRows(build_manifest(str(tmp_path)))


def ragged_table(lengths: list[int], start: int = 0) -> tuple[pa.Table, list[np.ndarray]]:
    rows = [
        np.arange(start + 100 * i, start + 100 * i + n, dtype=np.int32)
        for i, n in enumerate(lengths)
    ]
    return pa.table({"ids": pa.array([r.tolist() for r in rows], pa.list_(pa.int32()))}), rows


def test_variable_length_lists_are_refused_or_object(tmp_path: Path) -> None:
    table, rows = ragged_table([3, 5, 0, 2, 7])
    pq.write_table(table, tmp_path / "r.parquet", row_group_size=2)
    manifest = build_manifest(str(tmp_path))
    strict = TableRows(manifest)
    with pytest.raises(FormatError, match=r"r\.parquet.*'ids'.*vary from 3 to 5.*ragged="):
        strict.read(np.array([0, 1]))
    loose = TableRows(manifest, ragged=["ids"])
    ids = np.array([4, 0, 2, 4, 1])
    out = loose.read(ids)["ids"]
    assert out.dtype == object and out.shape == (5,)
    for got, i in zip(out, ids, strict=True):
        np.testing.assert_array_equal(got, rows[i])
    assert loose.identity()["ragged"] == ["ids"]
    with pytest.raises(ConfigError, match="ragged"):
        TableRows(manifest, ragged=["nope"])


def test_equal_lengths_per_group_but_different_across_groups(tmp_path: Path) -> None:
    table, _ = ragged_table([4, 4, 6, 6])
    pq.write_table(table, tmp_path / "w.parquet", row_group_size=2)
    ds = TableRows(build_manifest(str(tmp_path)))
    assert ds.read(np.array([1, 0]))["ids"].shape == (2, 4)
    assert ds.read(np.array([3]))["ids"].shape == (1, 6)
    with pytest.raises(FormatError, match=r"'ids'.*\[4, 6\]"):
        ds.read(np.array([0, 3]))


def test_nulls_in_numeric_column_are_refused(tmp_path: Path) -> None:
    pq.write_table(pa.table({"x": pa.array([1, None, 3], pa.int64())}), tmp_path / "n.parquet")
    ds = TableRows(build_manifest(str(tmp_path)))
    with pytest.raises(FormatError, match=r"n\.parquet.*'x'.*1 null"):
        ds.read(np.array([0]))


def test_unsupported_column_type_is_refused(tmp_path: Path) -> None:
    struct = pa.array([{"a": 1}, {"a": 2}])
    pq.write_table(pa.table({"s": struct, "x": [1, 2]}), tmp_path / "s.parquet")
    manifest = build_manifest(str(tmp_path))
    with pytest.raises(FormatError, match=r"s\.parquet.*'s'.*not supported"):
        TableRows(manifest)
    np.testing.assert_array_equal(TableRows(manifest, ["x"]).read(np.array([1, 0]))["x"], [2, 1])


def test_errors_for_ids_empty_and_token_shards(
    tables: tuple[TableRows, Reference], tmp_path: Path
) -> None:
    ds, _ = tables
    for bad in ([-1], [sum(SHARD_ROWS)], [[1]], [1.5]):
        with pytest.raises(ConfigError):
            ds.read(np.asarray(bad))
    pq.write_table(pa.table({"x": pa.array([], pa.int64())}), tmp_path / "e.parquet")
    with pytest.raises(ConfigError, match="empty"):
        TableRows(build_manifest(str(tmp_path)))
    np.save(tmp_path / "t.npy", np.arange(10, dtype=np.int32))
    with pytest.raises(FormatError, match=r"t\.npy.*TokenWindows"):
        TableRows(build_manifest(str(tmp_path), pattern="*.npy"))


def test_pickle_after_use_is_small_and_reads(tmp_path: Path) -> None:
    ref = write_shards(tmp_path, "parquet", seed=4)
    ds = TableRows(build_manifest(str(tmp_path)))
    ids = np.array([300, 3, 150, 3])
    before = ds.read(ids)
    assert len(ds.cache) > 0
    blob = pickle.dumps(ds)
    assert len(blob) < 4096 < ref["tokens"].nbytes
    clone = pickle.loads(blob)
    assert len(clone.cache) == 0
    after = clone.read(ids)
    for name in before:
        np.testing.assert_array_equal(after[name], before[name])


def test_to_numpy_respects_slices_of_list_arrays() -> None:
    rows = [[1, 2], [3, 4], [5, 6], [7, 8], [9, 10]]
    lists = pa.array(rows, pa.list_(pa.int32()))
    fixed = pa.array(rows, pa.list_(pa.int32(), 2))
    for array in (lists, fixed):
        np.testing.assert_array_equal(to_numpy(array.slice(2, 3), "t"), rows[2:5])
    assert to_numpy(fixed.slice(1, 0), "t").shape == (0, 2)
    assert to_numpy(lists.slice(1, 0), "t").shape == (0, 0)  # no row to tell the length
    ragged = pa.array([[1], [2, 3], [4, 5, 6]], pa.list_(pa.int64())).slice(1, 2)
    parts = to_numpy(ragged, "t", ragged=True)
    assert [p.tolist() for p in parts] == [[2, 3], [4, 5, 6]]
    np.testing.assert_array_equal(to_numpy(pa.array([1.5, 2.5]).slice(1), "t"), [2.5])


@pytest.mark.parametrize("fmt", ["parquet", "arrow"])
def test_remote_root_matches_reference(tmp_path: Path, fmt: str) -> None:
    ref = write_shards(tmp_path, fmt, seed=6)
    fs = fsspec.filesystem("memory")
    mem = f"/detdata-tables-{uuid.uuid4().hex}"
    try:
        for path in sorted(tmp_path.iterdir()):
            fs.pipe(f"{mem}/{path.name}", path.read_bytes())
        manifest = build_manifest(f"memory://{mem}")
        assert manifest.id == build_manifest(str(tmp_path)).id
        ds = pickle.loads(pickle.dumps(TableRows(manifest, ["tokens", "text"], cache_row_groups=2)))
        ids = np.random.default_rng(0).integers(0, ds.num_samples, size=50)
        batch = ds.read(ids)
        np.testing.assert_array_equal(batch["tokens"], np.stack(per_sample(ref, "tokens", ids)))
        np.testing.assert_array_equal(batch["text"], np.stack(per_sample(ref, "text", ids)))
    finally:
        fs.rm(mem, recursive=True)


def _child(ds: TableRows, ids: np.ndarray, queue: Any) -> None:
    queue.put((ds.read(ids)["tokens"], len(ds.cache)))


def test_forked_worker_gets_its_own_readers_and_cache(tmp_path: Path) -> None:
    ref = write_shards(tmp_path, "parquet", seed=7)
    ds = TableRows(build_manifest(str(tmp_path)), ["tokens"])
    first = np.arange(0, ds.num_samples, 40)
    ds.read(first)  # readers and a cache of every group read in the parent
    shard, group, _ = ds.locate(first)
    assert len(ds.cache) == len(set(zip(shard.tolist(), group.tolist(), strict=True))) > 3
    ids = np.array([387, 0, 200, 0])
    ctx = mp.get_context("fork")
    queue = ctx.Queue()
    proc = ctx.Process(target=_child, args=(ds, ids, queue))  # inherited, not pickled
    proc.start()
    got, child_cache = queue.get(timeout=30)
    proc.join(timeout=30)
    np.testing.assert_array_equal(got, ref["tokens"][ids])
    shard, group, _ = ds.locate(ids)
    assert child_cache == len(set(zip(shard.tolist(), group.tolist(), strict=True))) == 3


# GroupSlots: the TableRows cache (slots of shared column arrays) ---------------------------


def _model_step(model: RowGroupCache, ds: TableRows, ids: np.ndarray, charge: int) -> None:
    """What a RowGroupCache would do for ``ds.read(ids)``: each needed group, in order of
    first use in ``ids``."""
    shard, group, _ = ds.locate(ids)
    for key in dict.fromkeys(zip(shard.tolist(), group.tolist(), strict=True)):
        if model.get(key) is None:
            model.put(key, Group({}, charge))


@pytest.mark.parametrize("fmt", ["parquet", "arrow"])
def test_whole_dataset_cache_reads_by_slots(
    tmp_path: Path, fmt: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    ref = write_shards(tmp_path, fmt, seed=8)
    manifest = build_manifest(str(tmp_path))
    groups = sum(len(s.row_groups or ()) for s in manifest.shards)
    ds = TableRows(manifest, ["row", "tokens", "fixed", "score"], cache_row_groups=groups)
    decodes: list[tuple[int, int]] = []
    original = ds._decode

    def counting(shard: int, group: int) -> Group:
        decodes.append((shard, group))
        return original(shard, group)

    monkeypatch.setattr(ds, "_decode", counting)
    slot = GROUP_ROWS * (8 + 4 * WIDTH + 4 * 3 + 4)  # rows_per_slot x row bytes
    model = RowGroupCache(max_groups=groups, max_bytes=10**12)
    rng = np.random.default_rng(1)
    for step in range(60):
        ids = rng.integers(0, ds.num_samples, size=int(rng.integers(1, 50)))
        batch = ds.read(ids)
        _model_step(model, ds, ids, slot)
        for name in batch:
            np.testing.assert_array_equal(batch[name], ref[name][ids])
            assert batch[name].dtype == ref[name].dtype and batch[name].flags.c_contiguous
        assert ds.cache.keys() == model.keys()  # LRU order, slot gathers included
        assert (
            ds.cache.nbytes
            == len(ds.cache) * slot
            <= ds.cache.pool_bytes
            <= ds.row_group_cache_bytes
        )
        if step == 30:
            ds.read(np.arange(ds.num_samples))
            _model_step(model, ds, np.arange(ds.num_samples), slot)
            decodes.clear()
    assert decodes == []  # the whole dataset is cached: every later batch is one gather per column
    assert ds.cache.pool_bytes == groups * slot
    group = ds.cache.get(ds.cache.keys()[0])
    assert group is not None and sorted(group.columns) == ["fixed", "row", "score", "tokens"]


def test_smaller_cache_keeps_groups_as_arrays_lru(tmp_path: Path) -> None:
    ref = write_shards(tmp_path, "parquet", seed=9)
    manifest = build_manifest(str(tmp_path))
    groups = sum(len(s.row_groups or ()) for s in manifest.shards)
    for kwargs in (
        {"cache_row_groups": groups - 1},
        {"cache_row_groups": 3},
        {"row_group_cache_bytes": (groups - 1) * GROUP_ROWS * 8 * (1 + WIDTH // 2)},
    ):
        ds = TableRows(manifest, ["row", "tokens"], **kwargs)
        full = ds.row_group_cache_bytes >= groups * GROUP_ROWS * 8 * (1 + WIDTH // 2)
        # the default count with no order announced: every row group of the manifest
        assert ds.cache_groups == kwargs.get("cache_row_groups", groups)
        model = RowGroupCache(max_groups=ds.cache_groups, max_bytes=ds.row_group_cache_bytes)
        rng = np.random.default_rng(2)
        for _ in range(40):
            ids = rng.integers(0, ds.num_samples, size=int(rng.integers(1, 30)))
            batch = ds.read(ids)
            np.testing.assert_array_equal(batch["row"], ids)
            np.testing.assert_array_equal(batch["tokens"], ref["tokens"][ids])
            if full:  # only the count bound evicts: same order as the reference LRU
                shard, group, _ = ds.locate(ids)
                for key in dict.fromkeys(zip(shard.tolist(), group.tolist(), strict=True)):
                    if model.get(key) is None:
                        model.put(key, Group({}, 1))
                assert ds.cache.keys() == model.keys()
            assert len(ds.cache) <= ds.cache_groups and ds.cache.nbytes <= ds.row_group_cache_bytes
        assert ds.cache.pool_bytes == 0  # no slots unless the whole manifest fits


def test_slots_with_strings_evict_honestly_and_reuse_slots(tmp_path: Path) -> None:
    """Slots are used (every group fits at the slot charge) but the strings' bytes do not all fit:
    groups are evicted, their slots reused; data stays right and both bounds hold."""
    ref = write_shards(tmp_path, "arrow", seed=10)
    manifest = build_manifest(str(tmp_path))
    groups = sum(len(s.row_groups or ()) for s in manifest.shards)
    slot = GROUP_ROWS * (8 + 8)  # int64 row + an object pointer
    ds = TableRows(
        manifest,
        ["row", "text"],
        cache_row_groups=groups,
        row_group_cache_bytes=groups * slot + 2000,
    )
    rng = np.random.default_rng(3)
    evicted = False
    for step in range(200):
        ids = rng.integers(0, ds.num_samples, size=int(rng.integers(1, 40)))
        batch = ds.read(ids)
        np.testing.assert_array_equal(batch["row"], ids)
        assert batch["text"].tolist() == ref["text"][ids].tolist()
        assert (
            ds.cache.nbytes <= ds.row_group_cache_bytes
            and ds.cache.pool_bytes <= ds.row_group_cache_bytes
        )
        evicted |= len(ds.cache) < groups
        if step % 4:
            continue  # let slot gathers and evicting decodes follow each other unobserved
        cached = ds.cache.keys()
        assert len(cached) == len(ds.cache) == int((ds.cache._slot_of >= 0).sum())
        charges = 0
        for key in cached:
            got = ds.cache.get(key)
            assert got is not None and got.nbytes >= slot
            charges += got.nbytes
            first = int(ds._index.starts[ds._index.shard_first[key[0]] + key[1]])
            np.testing.assert_array_equal(
                got.columns["row"], np.arange(first, first + len(got.columns["row"]))
            )
        assert charges == ds.cache.nbytes
    assert evicted and ds.cache.pool_bytes > 0
    pool_text = ds.cache._pool["text"]
    cached = ds.cache.keys()
    live = {int(ds.cache._slot_of[ds._index.shard_first[k[0]] + k[1]]) for k in cached}
    for free in set(range(ds.cache._slots)) - live:  # evicted slots hold no references
        assert all(v is None for v in pool_text[free * GROUP_ROWS : (free + 1) * GROUP_ROWS])


def test_other_width_group_gives_up_slots(tmp_path: Path) -> None:
    table, rows = ragged_table([4, 4, 6, 6, 4, 4])
    pq.write_table(table, tmp_path / "w.parquet", row_group_size=2)
    ds = TableRows(build_manifest(str(tmp_path)))
    np.testing.assert_array_equal(ds.read(np.array([1, 0, 5]))["ids"], [rows[1], rows[0], rows[5]])
    assert ds.cache.pool_bytes > 0 and len(ds.cache) == 2
    before = ds.cache.nbytes
    np.testing.assert_array_equal(ds.read(np.array([3, 2]))["ids"], [rows[3], rows[2]])
    assert ds.cache.pool_bytes == 0 and len(ds.cache) == 3
    assert ds.cache.nbytes == before + 2 * 6 * 4  # the copied groups are charged their own bytes
    np.testing.assert_array_equal(ds.read(np.array([5, 1, 4]))["ids"], [rows[5], rows[1], rows[4]])
    with pytest.raises(FormatError, match=r"'ids'.*\[4, 6\]"):
        ds.read(np.array([0, 3]))


def test_slots_under_reader_threads(tmp_path: Path) -> None:
    ref = write_shards(tmp_path, "arrow", seed=12)
    manifest = build_manifest(str(tmp_path))
    groups = sum(len(s.row_groups or ()) for s in manifest.shards)
    ds = TableRows(
        manifest,
        ["row", "tokens", "text"],
        cache_row_groups=groups,
        row_group_cache_bytes=groups * GROUP_ROWS * (8 + 4 * WIDTH + 8) + 3000,
    )  # strings force evictions
    errors: list[BaseException] = []

    def work(seed: int) -> None:
        rng = np.random.default_rng(seed)
        try:
            for _ in range(150):
                ids = rng.integers(0, ds.num_samples, size=int(rng.integers(1, 40)))
                batch = ds.read(ids)
                np.testing.assert_array_equal(batch["row"], ids)
                np.testing.assert_array_equal(batch["tokens"], ref["tokens"][ids])
                assert batch["text"].tolist() == ref["text"][ids].tolist()
        except BaseException as exc:  # reported below
            errors.append(exc)

    threads = [threading.Thread(target=work, args=(seed,)) for seed in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=120)
    assert not errors, errors[0]
    assert (
        ds.cache.nbytes <= ds.row_group_cache_bytes
        and ds.cache.pool_bytes <= ds.row_group_cache_bytes
    )


# ------------------------------------------------------------------ column kinds in the loader
KIND_SCHEMA = {  # what each Arrow type of tests.datasets.test_aliasing.write_kinds reads as
    "id": "int64",
    "source": "int8",
    "f32": "float32",
    "flag": "bool",
    "u16": "uint16",
    "fixed": "int32 (3,)",
    "equal": "int16 (4,)",
    "ragged": "list<int64>",
    "ragged_bool": "list<bool>",
    "ragged_f": "list<float32>",
    "text": "str",
    "blob": "bytes",
    "ts": "datetime64[ms]",
    "ts_tz": "datetime64[us]",
    "day": "datetime64[D]",
    "dur": "timedelta64[s]",
}
KIND_TORCH = {  # default collate: column -> tensor dtype and trailing shape, or list item type
    "id": (torch.int64, ()),
    "source": (torch.int8, ()),
    "f32": (torch.float32, ()),
    "flag": (torch.bool, ()),
    "u16": (torch.uint16, ()),
    "fixed": (torch.int32, (3,)),
    "equal": (torch.int16, (4,)),
    "ragged": torch.int64,
    "ragged_bool": torch.bool,
    "ragged_f": torch.float32,
    "text": str,
    "blob": bytes,
    "ts": (torch.int64, ()),
    "ts_tz": (torch.int64, ()),
    "day": (torch.int64, ()),
    "dur": (torch.int64, ()),
}


def test_schema_says_what_read_delivers(tmp_path: Path) -> None:
    ref = write_kinds(tmp_path / "t")
    ds = TableRows(build_manifest(str(tmp_path / "t")), ragged=list(RAGGED))
    assert ds.schema() == KIND_SCHEMA
    batch = ds.read(np.arange(ROWS))
    for name, kind in KIND_SCHEMA.items():
        if kind == "str":
            assert all(v is None or isinstance(v, str) for v in batch[name]), name
        elif kind == "bytes":
            assert all(isinstance(v, bytes) for v in batch[name]), name
        elif kind.startswith("list<"):
            assert all(v.dtype == np.dtype(kind[5:-1]) and v.ndim == 1 for v in batch[name]), name
        else:
            dtype, _, shape = kind.partition(" ")
            assert batch[name].dtype == np.dtype(dtype), name
            assert str(batch[name].shape[1:]) == (shape or "()"), name
    assert check_rows(snapshot(batch, plain_numpy), {0: ref}) == ROWS
    narrow = TableRows(build_manifest(str(tmp_path / "t")), columns=["equal", "ts"])
    assert narrow.schema() == {"equal": "int16 (4,)", "ts": "datetime64[ms]"}


@pytest.mark.parametrize("read_ahead", [1, 16])
@pytest.mark.parametrize("mode", ["inline", "thread"])
def test_every_column_kind_through_the_default_collate(
    tmp_path: Path, mode: str, read_ahead: int
) -> None:
    """Numbers -> tensors, lists -> 2-D tensors, ragged -> lists of 1-D tensors, strings and
    binary -> lists, timestamps -> int64 raw counts: each row equals the writer's."""
    ref = write_kinds(tmp_path / "t")
    ds = TableRows(build_manifest(str(tmp_path / "t")), ragged=list(RAGGED))
    loader = DataLoader(
        ds,
        global_batch_size=6,
        seed=8,
        options=LoaderOptions(
            total_samples=2 * ROWS,
            read=ReadOptions(worker_mode="thread", batches_ahead=read_ahead),
        ),
        num_workers=2 if mode == "thread" else 0,
    )
    delivered = 0
    for batch in loader:
        assert list(batch) == list(KIND_TORCH)
        for name, kind in KIND_TORCH.items():
            value = batch[name]
            if isinstance(kind, tuple):
                assert isinstance(value, torch.Tensor) and value.dtype == kind[0], name
                assert tuple(value.shape) == (6, *kind[1]), name
            elif kind in (str, bytes):
                assert isinstance(value, list) and len(value) == 6, name
                assert all(v is None or isinstance(v, kind) for v in value), name
            else:
                assert isinstance(value, list) and len(value) == 6, name
                assert all(
                    isinstance(v, torch.Tensor) and v.dtype == kind and v.ndim == 1 for v in value
                ), name
        delivered += check_rows(snapshot(batch, plain_torch), {0: ref})
    assert delivered == 2 * ROWS


def test_timestamp_counts_are_in_the_column_unit(tmp_path: Path) -> None:
    """Raw counts since 1970-01-01 UTC, checked against the calendar, not against the reader."""
    root = tmp_path / "t"
    root.mkdir()
    when = [
        dt.datetime(2024, 2, 29, 12, 30, 1, 500_000, tzinfo=dt.UTC),
        dt.datetime(1969, 12, 31, 23, 59, 59, tzinfo=dt.UTC),
    ]
    pq.write_table(
        pa.table(
            {
                "ms": pa.array(when, pa.timestamp("ms")),
                "us_tz": pa.array(when, pa.timestamp("us", tz="Europe/Paris")),
                "day": pa.array([w.date() for w in when], pa.date32()),
            }
        ),
        root / "t.parquet",
    )
    ds = TableRows(build_manifest(str(root)))
    assert ds.schema() == {
        "ms": "datetime64[ms]",
        "us_tz": "datetime64[us]",
        "day": "datetime64[D]",
    }
    seen = {}
    for batch in DataLoader(
        ds, global_batch_size=2, seed=0, options=LoaderOptions(total_samples=2)
    ):
        order = np.argsort(batch["ms"].numpy())
        seen = {k: [v.tolist()[i] for i in order] for k, v in batch.items()}
    epoch = dt.datetime(1970, 1, 1, tzinfo=dt.UTC)
    assert seen["ms"] == [-1000, int((when[0] - epoch).total_seconds() * 1000)]
    assert seen["us_tz"] == [-1_000_000, int((when[0] - epoch).total_seconds() * 10**6)]
    assert seen["day"] == [-1, (when[0].date() - epoch.date()).days]


def test_time_of_day_column_is_refused_by_the_default_collate_naming_it(tmp_path: Path) -> None:
    root = tmp_path / "t"
    root.mkdir()
    pq.write_table(
        pa.table({"n": np.arange(4), "clock": pa.array([1, 2, 3, 4], pa.time64("us"))}),
        root / "t.parquet",
    )
    ds = TableRows(build_manifest(str(root)))
    assert ds.schema() == {"n": "int64", "clock": "time"}
    with pytest.raises(ConfigError, match=r"column 'clock'.*hint: pass collate_fn="):
        next(iter(DataLoader(ds, global_batch_size=2, seed=0)))
    rows = [
        r
        for b in DataLoader(
            ds,
            global_batch_size=2,
            seed=0,
            options=LoaderOptions(total_samples=4),
            collate_fn=lambda b: list(zip(b["n"].tolist(), b["clock"].tolist(), strict=True)),
        )
        for r in b
    ]
    assert sorted(rows) == [(i, dt.time(0, 0, 0, i + 1)) for i in range(4)]


def test_interval_column_is_refused_naming_it(tmp_path: Path) -> None:
    """pyarrow crashes the process converting intervals to numpy: refuse when opening."""
    root = tmp_path / "t"
    root.mkdir()
    table = pa.table(
        {"n": np.arange(3), "span": pa.array([(1, 2, 3)] * 3, pa.month_day_nano_interval())}
    )
    with ipc.new_file(root / "t.arrow", table.schema) as writer:
        writer.write_table(table)
    manifest = build_manifest(str(root))
    with pytest.raises(FormatError, match=r"column 'span'.*interval.*hint"):
        TableRows(manifest)
    assert TableRows(manifest, columns=["n"]).read(np.arange(3))["n"].tolist() == [0, 1, 2]


def test_transform_over_ragged_string_and_binary_columns(tmp_path: Path) -> None:
    """Per-sample outputs are restacked by kind: a ragged column stays ragged even in batches
    whose rows happen to have one length; strings of any length and bytes with trailing
    NULs come through unchanged; each row equals the writer's row, transformed."""
    ref = write_kinds(tmp_path / "t")
    ds = TableRows(
        build_manifest(str(tmp_path / "t")),
        columns=["id", "ragged", "text", "blob"],
        ragged=["ragged"],
    )

    def transform(sample: dict[str, Any], rng: np.random.Generator) -> dict[str, Any]:
        return {
            "id": sample["id"],
            "ragged": sample["ragged"][::-1] * 2,
            "text": sample["text"],
            "blob": sample["blob"] + b"\x00",
        }

    rows, equal_length_batches = [], 0
    for batch in DataLoader(
        ds,
        global_batch_size=2,
        seed=4,
        options=LoaderOptions(total_samples=4 * ROWS, transform=transform),
    ):
        assert isinstance(batch["ragged"], list)
        equal_length_batches += len({len(r) for r in batch["ragged"]}) == 1
        rows += snapshot(batch, plain_torch)
    assert equal_length_batches > 0  # the case where np.stack would have made a 2-D tensor
    for row in rows:
        want = ref[row["id"]]
        assert row == {
            "id": want["id"],
            "ragged": [2 * v for v in want["ragged"][::-1]],
            "text": want["text"],
            "blob": want["blob"] + b"\x00",
        }


_TRUNCATE_TABLE_CHILD = r"""
import json, os, sys
import numpy as np
import detdata
root, fmt = sys.argv[1], sys.argv[2]
ds = detdata.TableRows(detdata.build_manifest(root, pattern="*." + fmt), cache_row_groups=1)
first = ds.read(np.array([0]))["x"].tolist()
path = os.path.join(root, "t." + fmt)
with open(path, "r+b") as fh:
    fh.truncate(os.path.getsize(path) // 2)
try:
    ds.read(np.array([ds.num_samples - 1]))
    out = {"outcome": "read"}
except detdata.VerificationError as exc:
    out = {"outcome": "VerificationError", "shard": exc.shard, "message": str(exc)}
print(json.dumps({"first": first, **out}))
"""


@pytest.mark.multiproc
@pytest.mark.parametrize("fmt", ["parquet", "arrow"])
def test_table_shard_truncated_during_a_run_is_a_named_error_not_sigbus(
    tmp_path: Path, fmt: str
) -> None:
    """Parquet and Arrow shards are memory-mapped: a truncation between two reads is named at
    the next row-group decode (a child process, so a SIGBUS fails the test, not pytest)."""
    import json
    import os
    import subprocess
    import sys

    import pyarrow as pa
    import pyarrow.ipc as ipc
    import pyarrow.parquet as pq

    import detdata

    root = tmp_path / "data"
    root.mkdir()
    table = pa.table(
        {"x": np.arange(40_000, dtype=np.int64), "y": np.arange(40_000, dtype=np.float64)}
    )
    if fmt == "parquet":
        pq.write_table(table, root / "t.parquet", row_group_size=10_000)
    else:
        with ipc.new_file(str(root / "t.arrow"), table.schema) as writer:
            for batch in table.to_batches(max_chunksize=10_000):
                writer.write_batch(batch)
    repo = Path(detdata.__file__).resolve().parent.parent
    proc = subprocess.run(
        [sys.executable, "-c", _TRUNCATE_TABLE_CHILD, str(root), fmt],
        env={**os.environ, "PYTHONPATH": str(repo)},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, (f"child died with {proc.returncode} (-7 is SIGBUS)", proc.stderr)
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["first"] == [0]  # the writer's first row, read before the truncation
    assert out["outcome"] == "VerificationError", out
    assert (
        out["shard"] == f"t.{fmt}" and "truncated" in out["message"] and "hint:" in out["message"]
    )


@settings(max_examples=30, deadline=None)
@given(raw=st.lists(st.integers(0, 10**6), min_size=1, max_size=70))
def test_one_open_reader_reopens_evicted_shards_and_matches_reference(
    tables: tuple[TableRows, Reference], raw: list[int]
) -> None:
    """``max_open_shards=1``: every read of another shard evicts and re-opens a reader
    (Parquet and memory-mapped Arrow IPC); rows are still the written ones."""
    ds, ref = tables
    bounded = TableRows(ds.manifest, cache_row_groups=2, storage=Storage(max_open_shards=1))
    ids = np.asarray(raw, dtype=np.int64) % ds.num_samples
    for order in (ids, ids[::-1], ids):
        batch = bounded.read(order)
        for name in batch:
            np.testing.assert_array_equal(batch[name], np.stack(per_sample(ref, name, order)))
        assert len(bounded.files.open_shards()) <= 1
    assert bounded.identity() == ds.identity()
