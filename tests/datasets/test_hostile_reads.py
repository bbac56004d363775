"""Hostile review of the many-shard read paths of `TokenWindows`, of `TableRows` with small
caches, and of `owned` / `own_copy`.

Every expected value comes from an independent reference: token windows cut from
``np.load`` / ``np.fromfile`` of each shard file (labels shifted by one, the default
widening), table rows from the writer's input, and the group tensors a delivered batch was
cut from.
"""

from __future__ import annotations

import gc
import os
import pickle
import threading
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
import torch.utils.data as tud

from detdata import LocalityOrder, Order, Storage
from detdata.base.errors import DetdataError, StorageError, VerificationError
from detdata.datasets.batch_columns import to_torch
from detdata.datasets.handles import PROCESS_HANDLES, set_max_open_shards
from detdata.datasets.tables import TableRows
from detdata.datasets.tokens import TokenWindows
from detdata.identity.build import build_manifest
from detdata.loading.reading import owned, rows

SEQ = 6
WIDEN = {"uint16": np.int32, "int32": np.int32, "int64": np.int64, "uint32": np.int64}


# token corpora ----------------------------------------------------------------------------
def npy_with_header(path: Path, tokens: np.ndarray, total_header: int, version: int) -> None:
    """A ``.npy`` whose header (magic + length + dict) is ``total_header`` bytes: any size,
    even one that leaves the data unaligned (np.load reads it; numpy never writes it)."""
    descr = tokens.dtype.str
    body = f"{{'descr': '{descr}', 'fortran_order': False, 'shape': ({tokens.size},), }}"
    prefix = 10 if version == 1 else 12
    pad = total_header - prefix - len(body) - 1
    assert pad >= 0
    header = (body + " " * pad + "\n").encode("latin1")
    length = len(header).to_bytes(2 if version == 1 else 4, "little")
    with open(path, "wb") as fh:
        fh.write(b"\x93NUMPY" + bytes([version, 0]) + length + header + tokens.tobytes())
    np.testing.assert_array_equal(np.load(path), tokens)  # the reference reader accepts it


#: tokens per shard: zero-window shards (shorter than one window) first, in the middle and
#: last; exact fits (T = k * SEQ + 1); tails; one long shard.
LENGTHS = (3, SEQ + 1, 4 * SEQ + 1, 2 * SEQ, 5, 7 * SEQ + 4, SEQ * 90 + 2, 3 * SEQ + 1, 1, 2 * SEQ)


def write_tokens(root: Path, dtype: str, *, bin_files: bool = False) -> None:
    rng = np.random.default_rng(abs(hash(dtype)) % 1000)
    info = np.iinfo(dtype)
    root.mkdir(parents=True, exist_ok=True)
    for s, n in enumerate(LENGTHS):
        hi = min(int(info.max), 2**40)
        lo = max(int(info.min), -(2**40))
        tokens = rng.integers(lo, hi, size=n, endpoint=True).astype(dtype)
        if bin_files:
            tokens.tofile(root / f"s{s:02d}.bin")
        elif s % 3 == 0:
            np.save(root / f"s{s:02d}.npy", tokens)
        elif s % 3 == 1:
            npy_with_header(root / f"s{s:02d}.npy", tokens, 4096 + 64 + 6, version=2)
        else:
            npy_with_header(root / f"s{s:02d}.npy", tokens, 134, version=1)  # unaligned data


def reference(root: Path, dtype: str, labels: bool, *, bin_files: bool = False) -> np.ndarray:
    """Every window in id order: shards in path order, cut from np.load / np.fromfile."""
    width = SEQ + int(labels)
    out = []
    for path in sorted(root.iterdir()):
        tokens = np.fromfile(path, dtype=dtype) if bin_files else np.load(path)
        for w in range((tokens.size - int(labels)) // SEQ):
            out.append(tokens[w * SEQ : w * SEQ + width].astype(WIDEN[dtype]))
    return np.stack(out)


def batches(ds: TokenWindows, rng: np.random.Generator) -> list[np.ndarray]:
    """Hostile id batches: 1 element, first/last window of every shard, duplicates, unsorted,
    a whole shard's run, every window twice shuffled (huge), random."""
    starts = np.asarray(ds._layout.starts)
    counts = np.asarray(ds.windows_per_shard)
    live = counts > 0
    firsts = starts[live]
    lasts = (starts + counts - 1)[live]
    n = ds.num_samples
    long = int(np.argmax(counts))
    run = np.arange(starts[long], starts[long] + counts[long])
    out = [
        np.asarray([n - 1]),
        np.asarray([0]),
        np.concatenate([lasts, firsts])[::-1].copy(),
        rng.permutation(np.concatenate([firsts, lasts, firsts])),
        np.repeat(lasts, 3),
        run[::-1].copy(),
        np.concatenate([run[:5], run[:5], lasts]),
        rng.permutation(np.tile(np.arange(n), 2)),
        rng.integers(0, n, size=300),
        rng.integers(0, n, size=2),
    ]
    for _ in range(20):
        out.append(rng.integers(0, n, size=int(rng.integers(1, 40))))
    return out


@pytest.fixture(scope="module", params=["uint16", "int32", "int64"])
def tokens(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> tuple[Path, str]:
    root = tmp_path_factory.mktemp(f"hostile-{request.param}") / "data"
    write_tokens(root, request.param)
    return root, request.param


@pytest.mark.parametrize("labels", [True, False])
@pytest.mark.parametrize("cap", [1, 2, None])
def test_any_ids_match_np_load_with_any_handle_bound(
    tokens: tuple[Path, str], labels: bool, cap: int | None
) -> None:
    root, dtype = tokens
    ds = TokenWindows(
        build_manifest(str(root)),
        SEQ,
        labels=labels,
        allow_short_shards=True,
        storage=Storage(max_open_shards=cap),
    )
    ref = reference(root, dtype, labels)
    assert ds.num_samples == len(ref)
    for i, ids in enumerate(batches(ds, np.random.default_rng(7))):
        got = ds.read(ids)["tokens"]
        assert got.dtype == WIDEN[dtype], i
        np.testing.assert_array_equal(got, ref[ids], err_msg=f"batch {i}")
        assert len(ds.files.open_shards()) <= (cap or 128)


def test_explicit_out_dtype_matches_np_load(tokens: tuple[Path, str]) -> None:
    """Widening / same / narrowing (range-checked) casts, on every read path."""
    root, dtype = tokens
    ref = reference(root, dtype, True)
    wanted = {"uint16": ["uint16", "uint32", "int64"], "int32": ["int32", "int64"]}
    for out_dtype in wanted.get(dtype, ["int64"]):
        ds = TokenWindows(
            build_manifest(str(root)),
            SEQ,
            out_dtype=out_dtype,
            allow_short_shards=True,
            storage=Storage(max_open_shards=1),
        )
        for ids in batches(ds, np.random.default_rng(3)):
            got = ds.read(ids)["tokens"]
            assert got.dtype == np.dtype(out_dtype)
            np.testing.assert_array_equal(got, ref[ids].astype(out_dtype))


def test_raw_bin_shards_match_np_fromfile(tmp_path: Path) -> None:
    root = tmp_path / "bin"
    write_tokens(root, "int32", bin_files=True)
    ref = reference(root, "int32", True, bin_files=True)
    for cap in (1, 2, None):
        ds = TokenWindows(
            build_manifest(str(root), dtype="int32"),
            SEQ,
            allow_short_shards=True,
            storage=Storage(max_open_shards=cap),
        )
        for ids in batches(ds, np.random.default_rng(11)):
            np.testing.assert_array_equal(ds.read(ids)["tokens"], ref[ids])


def test_datasets_sharing_a_budget_of_one_handle_read_exactly(tmp_path: Path) -> None:
    """Three datasets (two dtypes) in a process budget of 1: every put evicts another
    dataset's handle, every read is still the reference's."""
    rng = np.random.default_rng(5)
    sets: list[tuple[TokenWindows, np.ndarray, list[np.ndarray]]] = []
    for dtype in ("int32", "uint16", "int32"):
        root = tmp_path / f"{dtype}-{len(sets)}"
        write_tokens(root, dtype)
        ds = TokenWindows(
            build_manifest(str(root)),
            SEQ,
            allow_short_shards=True,
            storage=Storage(max_open_shards=1),
        )
        sets.append((ds, reference(root, dtype, True), batches(ds, rng)))
    gc.collect()  # datasets of earlier tests, unreachable but not yet collected, hold handles
    set_max_open_shards(1)
    try:
        assert PROCESS_HANDLES.capacity == 1  # no other live dataset raises the budget
        for step in range(30):
            for ds, ref, bs in sets:
                ids = bs[(step * 7) % len(bs)]
                np.testing.assert_array_equal(ds.read(ids)["tokens"], ref[ids])
                assert len(PROCESS_HANDLES) <= 1
    finally:
        set_max_open_shards(None)


@pytest.mark.parametrize("cap", [1, 2])
def test_threads_reading_one_dataset_get_the_reference(tokens: tuple[Path, str], cap: int) -> None:
    root, dtype = tokens
    ds = TokenWindows(
        build_manifest(str(root)),
        SEQ,
        allow_short_shards=True,
        storage=Storage(max_open_shards=cap),
    )
    ref = reference(root, dtype, True)
    errors: list[str] = []

    def work(seed: int) -> None:
        rng = np.random.default_rng(seed)
        try:
            for _ in range(3):
                for ids in batches(ds, rng):
                    got = ds.read(ids)["tokens"]
                    if not np.array_equal(got, ref[ids]):
                        errors.append(f"thread {seed}: wrong rows for {ids[:8]}")
        except Exception as exc:
            errors.append(f"thread {seed}: {type(exc).__name__}: {exc}")

    threads = [threading.Thread(target=work, args=(seed,)) for seed in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert not errors, errors[:5]
    assert len(ds.files.open_shards()) <= cap


class _Batches(tud.Dataset[Any]):
    def __init__(self, ds: TokenWindows, ids: list[np.ndarray]) -> None:
        self.ds, self.ids = ds, ids

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> tuple[int, np.ndarray]:
        return i, self.ds.read(self.ids[i])["tokens"]


def test_forked_dataloader_workers_read_the_reference(tokens: tuple[Path, str]) -> None:
    root, dtype = tokens
    ds = TokenWindows(
        build_manifest(str(root)), SEQ, allow_short_shards=True, storage=Storage(max_open_shards=1)
    )
    ref = reference(root, dtype, True)
    ids = batches(ds, np.random.default_rng(9))
    ds.read(ids[7])  # the parent holds a handle and has read: children must drop it
    loader = tud.DataLoader(
        _Batches(ds, ids),
        batch_size=None,
        num_workers=2,
        multiprocessing_context="fork",
        collate_fn=lambda x: x,
    )
    seen = 0
    for i, got in loader:
        np.testing.assert_array_equal(got, ref[ids[i]], err_msg=f"batch {i}")
        seen += 1
    assert seen == len(ids)


# shards changed under a run ----------------------------------------------------------------
def _int32_corpus(root: Path, shards: int = 6, windows: int = 4) -> np.ndarray:
    """``shards`` int32 shards of ``windows`` windows each (with labels); every window."""
    root.mkdir(parents=True)
    arrays = []
    for s in range(shards):
        tokens = (np.arange(windows * SEQ + 1, dtype=np.int32) + 1000 * s).astype(np.int32)
        np.save(root / f"s{s}.npy", tokens)
        arrays.append(tokens)
    return np.stack([a[w * SEQ : w * SEQ + SEQ + 1] for a in arrays for w in range(windows)])


def _replace(path: Path, tokens: np.ndarray) -> None:
    """Replace ``path`` atomically (write elsewhere, rename over it), as a re-export does."""
    tmp = path.with_suffix(".tmp")
    with open(tmp, "wb") as fh:
        np.save(fh, tokens)
    os.replace(tmp, path)


@pytest.mark.parametrize("cap", [1, 2, None])
@pytest.mark.parametrize("ids", [[8, 9, 10, 11], [9], [0, 9], [0, 9, 10, 11, 20]])
def test_a_shard_replaced_by_a_longer_file_is_an_error_not_other_bytes(
    tmp_path: Path, cap: int | None, ids: list[int]
) -> None:
    """Shard 2 re-exported (renamed over) with other, more tokens after the dataset was
    opened and before it was first read: the manifest's bytes are gone, so a read must
    be a `DetdataError` naming the shard or the manifest's bytes, never the new bytes."""
    ref = _int32_corpus(tmp_path / "d")
    ds = TokenWindows(
        build_manifest(str(tmp_path / "d")), SEQ, storage=Storage(max_open_shards=cap)
    )
    ds.read(np.asarray([23]))  # shard 5 holds the only handle when cap=1
    victim = tmp_path / "d" / ds.manifest.shards[2].path
    _replace(victim, np.arange(10 * SEQ, dtype=np.int32) - 5)
    arr = np.asarray(ids)
    try:
        got = ds.read(arr)["tokens"]
    except DetdataError as exc:
        assert ds.manifest.shards[2].path in str(exc)
        return
    np.testing.assert_array_equal(got, ref[arr])


@pytest.mark.parametrize("ids", [[40, 41, 42, 43], [41], [0, 41], [40, 59, 41, 0]])
def test_the_handle_bound_never_changes_the_bytes_of_a_replaced_shard(
    tmp_path: Path, ids: list[int]
) -> None:
    """Shard 2 read by a dataset with room for every mapping and by one with a single
    handle, then re-exported at the same size (renamed over): the dataset with one handle
    must not deliver other bytes than the one that kept the mapping ("the bound and the
    read path never change the bytes read"), unless it raises."""
    ref = _int32_corpus(tmp_path / "d", windows=20)
    manifest = build_manifest(str(tmp_path / "d"))
    small = TokenWindows(manifest, SEQ, storage=Storage(max_open_shards=1))
    big = TokenWindows(manifest, SEQ, storage=Storage(max_open_shards=64))
    arr = np.asarray(ids)
    for ds in (small, big):
        np.testing.assert_array_equal(ds.read(arr)["tokens"], ref[arr])
    scattered = 100 + np.asarray([0, 1, 2, 3, 4, 5, 6, 19])  # 8 windows of shard 5, not dense
    np.testing.assert_array_equal(small.read(scattered)["tokens"], ref[scattered])
    assert small.files.open_shards() == [5]  # shard 2 (if it was mapped) is evicted
    victim = tmp_path / "d" / manifest.shards[2].path
    _replace(victim, (np.arange(20 * SEQ + 1, dtype=np.int32) * 7 - 3).astype(np.int32))
    kept = big.read(arr)["tokens"]
    np.testing.assert_array_equal(kept, ref[arr])  # the mapping still reads the old inode
    try:
        again = small.read(arr)["tokens"]
    except DetdataError as exc:
        assert manifest.shards[2].path in str(exc)
        return
    np.testing.assert_array_equal(again, kept)


@pytest.mark.parametrize("cap", [1, None])
@pytest.mark.parametrize(
    "ids",
    [[9], [8, 9, 10, 11], [11, 8], [0, 9], [0, 8, 9, 10, 11], [23, 8, 8, 11]],
)
def test_a_deleted_shard_is_a_named_error_or_its_old_bytes(
    tmp_path: Path, cap: int | None, ids: list[int]
) -> None:
    _int32_corpus(tmp_path / "d")
    ds = TokenWindows(
        build_manifest(str(tmp_path / "d")), SEQ, storage=Storage(max_open_shards=cap)
    )
    ds.read(np.asarray([23]))
    (tmp_path / "d" / ds.manifest.shards[2].path).unlink()
    arr = np.asarray(ids)
    with pytest.raises(VerificationError) as info:
        ds.read(arr)
    assert info.value.shard == ds.manifest.shards[2].path
    assert isinstance(info.value, DetdataError)


@pytest.mark.parametrize("cap", [1, None])
@pytest.mark.parametrize("mixed", [False, True])
@pytest.mark.parametrize("ids", [[9], [8, 9, 10, 11], [11, 8], [0, 9], [0, 8, 11], [23, 8, 8]])
def test_a_truncated_shard_is_a_named_error(
    tmp_path: Path, cap: int | None, mixed: bool, ids: list[int]
) -> None:
    """Truncated to one window less than the ids need (mapped or not, one dtype or two)."""
    root = tmp_path / "d"
    ref = _int32_corpus(root)
    if mixed:  # another dtype: the per-shard loop and `_pread_rows`, never staged
        np.save(root / "s9.npy", np.arange(4 * SEQ + 1, dtype=np.int64))
    ds = TokenWindows(build_manifest(str(root)), SEQ, storage=Storage(max_open_shards=cap))
    ds.read(np.asarray([23]))
    entry = ds.manifest.shards[2]
    os.truncate(root / entry.path, entry.bytes - 2 * SEQ * 4)  # windows 0, 1 (ids 8, 9) left
    arr = np.asarray(ids)
    if any(i in (10, 11) for i in ids):  # bytes gone: must raise
        with pytest.raises(VerificationError, match="truncated") as info:
            ds.read(arr)
        assert info.value.shard == entry.path
        return
    try:  # only bytes still there: the old rows, or the error
        got = ds.read(arr)["tokens"]
    except VerificationError as exc:
        assert exc.shard == entry.path
        return
    np.testing.assert_array_equal(got, ref[arr])


# tables ------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def table(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, list[Any]]]:
    root = tmp_path_factory.mktemp("hostile-tables")
    rng = np.random.default_rng(2)
    cols: dict[str, list[Any]] = {"x": [], "s": [], "r": [], "f": []}
    base = 0
    for s, (n, group) in enumerate([(53, 7), (0, 5), (31, 31), (40, 3), (9, 4)]):
        x = np.arange(n, dtype=np.int64) + base
        base += n
        strs = [None if i % 11 == 5 else f"row-{v}-" + "z" * (v % 5) for i, v in enumerate(x)]
        ragged = [rng.integers(0, 100, size=int(v % 4)).astype(np.int32) for v in x]
        fixed = [np.full(3, v, dtype=np.float32) for v in x]
        t = pa.table(
            {
                "x": pa.array(x),
                "s": pa.array(strs, type=pa.string()),
                "r": pa.array([list(v) for v in ragged], type=pa.list_(pa.int32())),
                "f": pa.array([list(v) for v in fixed], type=pa.list_(pa.float32(), 3)),
            }
        )
        pq.write_table(t, root / f"t{s}.parquet", row_group_size=group)
        cols["x"] += list(x)
        cols["s"] += strs
        cols["r"] += ragged
        cols["f"] += fixed
    return root, cols


def check_rows(got: dict[str, Any], cols: dict[str, list[Any]], ids: np.ndarray) -> None:
    np.testing.assert_array_equal(got["x"], np.asarray(cols["x"])[ids])
    assert list(got["s"]) == [cols["s"][i] for i in ids]
    assert len(got["r"]) == len(ids)
    for row, i in zip(got["r"], ids.tolist(), strict=True):
        np.testing.assert_array_equal(row, cols["r"][i])
    np.testing.assert_array_equal(got["f"], np.stack([cols["f"][i] for i in ids]))


@pytest.mark.parametrize(
    "kwargs",
    [
        {"cache_row_groups": 1},
        {"cache_row_groups": 0},
        {"row_group_cache_bytes": 1},
        {"cache_row_groups": 2, "row_group_cache_bytes": 300},
        {},
    ],
)
def test_table_rows_with_small_caches_equal_the_writer_input(
    table: tuple[Path, dict[str, list[Any]]], kwargs: dict[str, Any]
) -> None:
    root, cols = table
    ds = TableRows(build_manifest(str(root)), ragged=["r"], **kwargs)
    rng = np.random.default_rng(1)
    n = ds.num_samples
    assert n == len(cols["x"])
    cases = [
        np.asarray([n - 1]),
        np.arange(n)[::-1].copy(),
        rng.permutation(np.tile(np.arange(n), 2)),
    ]
    cases += [rng.integers(0, n, size=int(rng.integers(1, 50))) for _ in range(25)]
    for ids in cases:
        got = ds.read(ids)
        check_rows(got, cols, ids)
        got["x"][:] = -1  # editing a batch never changes a later read
        for row in got["r"]:
            row[:] = -1
    for ids in cases[:5]:
        check_rows(ds.read(ids), cols, ids)


@pytest.mark.parametrize("explicit", [1, 3, 0])
def test_an_explicit_cache_row_groups_is_never_overridden(
    table: tuple[Path, dict[str, list[Any]]], explicit: int
) -> None:
    root, cols = table
    ds = TableRows(build_manifest(str(root)), ragged=["r"], cache_row_groups=explicit)
    for choice in (
        LocalityOrder(window_row_groups=4),
        LocalityOrder(window_shards=1),
        Order.FEISTEL_V1,
    ):
        ds.use_order(choice)
        assert ds.cache_groups == explicit and ds.cache.max_groups == explicit
        ids = np.random.default_rng(explicit).integers(0, ds.num_samples, size=40)
        check_rows(ds.read(ids), cols, ids)
        assert len(ds.cache) <= explicit
    clone = pickle.loads(pickle.dumps(ds))
    assert clone.cache_groups == explicit
    clone.read(np.asarray([0]))
    assert clone.cache.max_groups == explicit and len(clone.cache) <= explicit


def test_default_cache_follows_the_announced_window(
    table: tuple[Path, dict[str, list[Any]]],
) -> None:
    root, cols = table
    ds = TableRows(build_manifest(str(root)), ragged=["r"])
    total = len(ds.row_group_sizes)
    assert ds.cache_groups == total
    ds.use_order(LocalityOrder(window_row_groups=2))
    assert ds.cache_groups == 4 and ds.cache.max_groups == 4
    ids = np.random.default_rng(4).integers(0, ds.num_samples, size=64)
    check_rows(ds.read(ids), cols, ids)
    # this small table fits the default 1 GiB bound: the count rises to every row group
    assert ds.cache.max_groups == total and len(ds.cache) <= total
    small = TableRows(build_manifest(str(root)), ragged=["r"], row_group_cache_bytes=4000)
    small.use_order(LocalityOrder(window_row_groups=2))
    check_rows(small.read(ids), cols, ids)
    assert small.cache.max_groups == 4 and len(small.cache) <= 4  # does not fit: 2k


# owned ---------------------------------------------------------------------------------------
def test_delivered_micro_batches_own_their_memory_and_equal_the_group(
    table: tuple[Path, dict[str, list[Any]]],
) -> None:
    """A group read of rows with numbers, fixed lists, strings and ragged lists, collated,
    cut into micro batches and made owned (as `GroupRead.deliver` does)."""
    root, cols = table
    ds = TableRows(build_manifest(str(root)), ragged=["r"])
    ids = np.random.default_rng(6).integers(0, ds.num_samples, size=48)
    whole = to_torch(ds.read(ids))
    for a, b in [(0, 16), (16, 17), (17, 48)]:
        view = rows(whole, a, b)
        mine = owned(view)
        assert torch.equal(mine["x"], view["x"]) and torch.equal(mine["f"], view["f"])
        assert mine["s"] == view["s"]
        for t in (mine["x"], mine["f"], *mine["r"]):
            assert t.untyped_storage().nbytes() == t.nbytes
        for got, ref in zip(mine["r"], view["r"], strict=True):
            assert torch.equal(got, ref)
        np.testing.assert_array_equal(mine["x"].numpy(), np.asarray(cols["x"])[ids[a:b]])
        mine["x"].zero_()
        assert torch.equal(whole["x"][a:b], torch.from_numpy(np.asarray(cols["x"])[ids[a:b]]))


def test_storage_error_is_a_detdata_error() -> None:
    assert issubclass(StorageError, DetdataError) and issubclass(VerificationError, DetdataError)
