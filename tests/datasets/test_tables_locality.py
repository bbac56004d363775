"""`TableRows` read in row-group windows (``LocalityOrder(window_row_groups=k)``) and the
default row-group cache sized from the order (`auto_cache_row_groups`).

References: the row-group sizes come from pyarrow's own file metadata; the expected ids from
the independent locality-v1 reference of ``tests/order/test_locality.py`` (`ref_epoch`); the
expected rows from the writer's input; decodes are counted at pyarrow's
``ParquetFile.read_row_group`` (below the code under test).
"""

from __future__ import annotations

import collections
import pickle
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import detdata
from detdata import LocalityOrder, Order
from detdata.base.errors import ConfigError, StateError
from detdata.datasets.rowgroups import auto_cache_row_groups
from detdata.order.choice import order_name
from detdata.order.locality import WindowedOrder
from tests.order.test_locality import ref_epoch
from tests.resume_checker import take

SEED = 5
ROWS = (95, 40, 0, 61, 7)  # rows per file; row groups of 10 (the last of each shorter)
GROUP = 10


@pytest.fixture(scope="module")
def corpus(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, np.ndarray]:
    root = tmp_path_factory.mktemp("rg-locality")
    parts = []
    for s, rows in enumerate(ROWS):
        x = np.arange(rows, dtype=np.int64) + 1000 * s
        parts.append(x)
        pq.write_table(pa.table({"x": x}), root / f"t{s}.parquet", row_group_size=GROUP)
    return root, np.concatenate(parts)


def pyarrow_group_sizes(root: Path) -> list[int]:
    sizes = []
    for path in sorted(root.glob("*.parquet")):
        meta = pq.ParquetFile(path).metadata
        sizes += [meta.row_group(i).num_rows for i in range(meta.num_row_groups)]
    return sizes


def groups_of(root: Path, rows: np.ndarray) -> set[tuple[str, int]]:
    """The (file, row group) holding each delivered row, from the writer's layout."""
    return {(str(root / f"t{x // 1000}.parquet"), x % 1000 // GROUP) for x in rows.tolist()}


@pytest.fixture
def decodes(monkeypatch: pytest.MonkeyPatch) -> Iterator[collections.Counter[tuple[str, int]]]:
    """(file, row group) -> times pyarrow decoded it in this process."""
    seen: collections.Counter[tuple[str, int]] = collections.Counter()
    original = pq.ParquetFile.read_row_group

    def counted(self: pq.ParquetFile, i: int, *a: Any, **k: Any) -> pa.Table:
        seen[(self._detdata_name, i)] += 1
        return original(self, i, *a, **k)

    original_init = pq.ParquetFile.__init__

    def init(self: pq.ParquetFile, source: Any, *a: Any, **k: Any) -> None:
        original_init(self, source, *a, **k)
        self._detdata_name = str(getattr(source, "path", source))

    monkeypatch.setattr(pq.ParquetFile, "read_row_group", counted)
    monkeypatch.setattr(pq.ParquetFile, "__init__", init)
    yield seen


def test_row_group_sizes_are_the_files_own(corpus: tuple[Path, np.ndarray]) -> None:
    root, _ = corpus
    ds = detdata.TableRows(detdata.build_manifest(str(root)), ["x"])
    assert list(ds.row_group_sizes) == pyarrow_group_sizes(root)
    assert sum(ds.row_group_sizes) == ds.num_samples == sum(ROWS)


@pytest.mark.parametrize("k", [1, 3, 50])
def test_delivers_the_reference_order_over_row_groups(
    corpus: tuple[Path, np.ndarray], k: int
) -> None:
    """Two epochs and a bit through a DataLoader: every row is the reference's id, read from
    the writer's input; each epoch delivers every row exactly once."""
    root, rows = corpus
    ds = detdata.TableRows(detdata.build_manifest(str(root)), ["x"])
    loader = detdata.DataLoader(
        ds, global_batch_size=7, seed=SEED, order=LocalityOrder(window_row_groups=k)
    )
    n = ds.num_samples
    steps = (2 * n + 30) // 7
    got = torch.cat([b["x"] for b in take(loader, steps)]).numpy()
    sizes = pyarrow_group_sizes(root)
    ref = ref_epoch(sizes, k, SEED, 0) + ref_epoch(sizes, k, SEED, 1) + ref_epoch(sizes, k, SEED, 2)
    np.testing.assert_array_equal(got, rows[np.array(ref[: 7 * steps])])
    assert sorted(got[:n].tolist()) == sorted(rows.tolist())


def test_each_row_group_decoded_once_per_epoch_with_the_default_cache(
    corpus: tuple[Path, np.ndarray], decodes: collections.Counter[Any]
) -> None:
    """The default cache sized from the order: with row-group windows each row group is decoded
    once in an epoch, with a byte bound far below the dataset (a global shuffle under that bound
    re-decodes; the counter sees it)."""
    root, rows = corpus
    manifest = detdata.build_manifest(str(root))
    groups = len(pyarrow_group_sizes(root))
    n = sum(ROWS)
    row_bytes = 8
    bound = 8 * GROUP * row_bytes  # 8 groups of the 21 fit
    for order, once in ((LocalityOrder(window_row_groups=3), True), (Order.FEISTEL_V1, False)):
        decodes.clear()
        ds = detdata.TableRows(manifest, ["x"], row_group_cache_bytes=bound)
        loader = detdata.DataLoader(
            ds,
            global_batch_size=4,
            seed=SEED,
            order=order,
            options=detdata.LoaderOptions(total_samples=n // 4 * 4),
        )
        got = torch.cat([b["x"] for b in loader]).numpy()
        assert len(got) == n // 4 * 4 and len(set(got.tolist())) == len(got)
        assert set(got.tolist()) <= set(rows.tolist())
        seen = decodes
        if once:
            assert ds.cache_groups == 6  # 2k
            assert seen == collections.Counter(groups_of(root, got)), seen
        else:
            assert ds.cache_groups == groups  # every row group; the bytes bound bites
            assert sum(seen.values()) > groups


def test_feistel_with_the_default_cache_decodes_each_group_once_when_it_fits(
    corpus: tuple[Path, np.ndarray], decodes: collections.Counter[Any]
) -> None:
    root, _ = corpus
    ds = detdata.TableRows(detdata.build_manifest(str(root)), ["x"])
    n = ds.num_samples
    loader = detdata.DataLoader(
        ds, global_batch_size=4, seed=SEED, options=detdata.LoaderOptions(total_samples=n // 4 * 4)
    )
    got = torch.cat([b["x"] for b in loader]).numpy()
    assert decodes == collections.Counter(groups_of(root, got))


def test_an_explicit_cache_row_groups_is_kept(corpus: tuple[Path, np.ndarray]) -> None:
    root, _ = corpus
    ds = detdata.TableRows(detdata.build_manifest(str(root)), ["x"], cache_row_groups=2)
    detdata.OrderedStream(ds, SEED, order=LocalityOrder(window_row_groups=5))
    assert ds.cache_groups == 2 and ds.cache.max_groups == 2


def test_the_announced_order_travels_with_the_pickle(corpus: tuple[Path, np.ndarray]) -> None:
    root, rows = corpus
    ds = detdata.TableRows(detdata.build_manifest(str(root)), ["x"])
    assert ds.cache_groups == len(pyarrow_group_sizes(root))  # not told: every row group
    detdata.OrderedStream(ds, SEED, order=LocalityOrder(window_row_groups=4))
    copy = pickle.loads(pickle.dumps(ds))
    assert ds.cache_groups == copy.cache_groups == copy.cache.max_groups == 8
    np.testing.assert_array_equal(copy.read([3, 200, 3])["x"], rows[[3, 200, 3]])


def test_worker_processes_deliver_the_same_rows(corpus: tuple[Path, np.ndarray]) -> None:
    root, _ = corpus
    manifest = detdata.build_manifest(str(root))

    def rows_of(workers: int) -> np.ndarray:
        ds = detdata.TableRows(manifest, ["x"], row_group_cache_bytes=6 * GROUP * 8)
        loader = detdata.DataLoader(
            ds,
            global_batch_size=6,
            seed=SEED,
            order=LocalityOrder(window_row_groups=2),
            num_workers=workers,
            options=detdata.LoaderOptions(total_samples=120),
        )
        return torch.cat([b["x"] for b in loader]).numpy()

    np.testing.assert_array_equal(rows_of(2), rows_of(0))


def test_resume_with_the_other_unit_is_refused_naming_algorithm(
    corpus: tuple[Path, np.ndarray],
) -> None:
    root, _ = corpus
    ds = detdata.TableRows(detdata.build_manifest(str(root)), ["x"])
    a = detdata.DataLoader(
        ds, global_batch_size=4, seed=1, order=LocalityOrder(window_row_groups=3)
    )
    take(a, 2)
    state = a.state_dict()
    b = detdata.DataLoader(ds, global_batch_size=4, seed=1, order=LocalityOrder(window_shards=3))
    with pytest.raises(StateError, match="algorithm"):
        b.load_state_dict(state)


def test_bad_choices_are_clear(corpus: tuple[Path, np.ndarray], tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="not both"):
        LocalityOrder(window_shards=2, window_row_groups=2)
    with pytest.raises(ConfigError, match="window_row_groups"):
        LocalityOrder(window_row_groups=0)
    np.save(tmp_path / "a.npy", np.arange(100, dtype=np.int32))
    tokens = detdata.TokenWindows(detdata.build_manifest(str(tmp_path), pattern="*.npy"), 4)
    with pytest.raises(ConfigError, match=r"row_group_sizes.*hint: use a TableRows"):
        detdata.OrderedStream(tokens, 0, order=LocalityOrder(window_row_groups=2))
    assert LocalityOrder() == LocalityOrder(window_shards=8)
    assert order_name(LocalityOrder(window_row_groups=3)) == ("locality-v1(window_row_groups=3)")


@settings(max_examples=60, deadline=None)
@given(
    groups=st.lists(st.integers(0, 6), min_size=1, max_size=12).filter(lambda g: sum(g) > 0),
    k=st.integers(1, 8),
    epoch=st.integers(0, 3),
)
def test_auto_cache_covers_two_consecutive_windows_of_shards(
    groups: list[int], k: int, epoch: int
) -> None:
    """For ``window_shards=k`` the auto count is at least the row groups of any two consecutive
    windows of an epoch (what a read crossing a window boundary needs), and never more than
    all row groups."""
    sizes = [max(1, g) for g in groups]  # samples per shard (any positive count)
    sigma = WindowedOrder(sizes, 3, window_shards=k).shard_order(epoch).tolist()
    per_window = [sum(groups[s] for s in sigma[w : w + k]) for w in range(0, len(sigma), k)]
    need = max(a + b for a, b in zip(per_window, [*per_window[1:], 0], strict=True))
    got = auto_cache_row_groups(LocalityOrder(window_shards=k), groups)
    assert need <= got <= sum(groups)
    assert auto_cache_row_groups(LocalityOrder(window_row_groups=k), groups) == min(
        sum(groups), 2 * k
    )
    assert auto_cache_row_groups(Order.FEISTEL_V1, groups) == sum(groups)
    assert auto_cache_row_groups(None, groups) == sum(groups)


def test_arrow_ipc_record_batches_are_the_row_groups(tmp_path: Path) -> None:
    """Arrow IPC files: each record batch is a row group; the order windows them."""
    import pyarrow.ipc as ipc

    sizes = []
    parts = []
    for s, batches in enumerate(((5, 9, 1), (7,), (3, 3))):
        with ipc.new_file(tmp_path / f"a{s}.arrow", pa.schema([("x", pa.int64())])) as w:
            start = 0
            for rows in batches:
                x = np.arange(start, start + rows, dtype=np.int64) + 1000 * s
                w.write_batch(pa.record_batch([pa.array(x)], names=["x"]))
                parts.append(x)
                sizes.append(rows)
                start += rows
    rows_all = np.concatenate(parts)
    ds = detdata.TableRows(detdata.build_manifest(str(tmp_path), pattern="*.arrow"), ["x"])
    assert list(ds.row_group_sizes) == sizes
    stream = detdata.OrderedStream(ds, SEED, order=LocalityOrder(window_row_groups=2))
    n = ds.num_samples
    got = stream.fetch(np.arange(2 * n, dtype=np.int64))["x"]
    ref = ref_epoch(sizes, 2, SEED, 0) + ref_epoch(sizes, 2, SEED, 1)
    np.testing.assert_array_equal(got, rows_all[np.array(ref)])
    assert ds.cache_groups == 4


def test_a_dataset_that_fits_is_cached_whole_whatever_the_order(
    corpus: tuple[Path, np.ndarray], decodes: collections.Counter[Any]
) -> None:
    """Default cache and a byte bound that holds every row group: after the first epoch no
    row group is decoded again, with row-group windows too (the count rises to all groups);
    an explicit count is kept."""
    root, rows = corpus
    manifest = detdata.build_manifest(str(root))
    n = sum(ROWS)
    for cache in (None, 3):
        decodes.clear()
        ds = detdata.TableRows(manifest, ["x"], cache_row_groups=cache)
        loader = detdata.DataLoader(
            ds,
            global_batch_size=7,
            seed=SEED,
            order=LocalityOrder(window_row_groups=2),
            options=detdata.LoaderOptions(total_samples=2 * n // 7 * 7),
        )
        got = torch.cat([b["x"] for b in loader]).numpy()
        assert sorted(got[:n].tolist()) == sorted(rows.tolist())  # epoch 1: every row once
        touched = collections.Counter(groups_of(root, got))
        if cache is None:
            assert ds.cache.max_groups == len(pyarrow_group_sizes(root))
            assert decodes == collections.Counter(dict.fromkeys(touched, 1))
        else:
            assert ds.cache.max_groups == 3
            assert sum(decodes.values()) > len(touched)  # epoch 2 decodes again
