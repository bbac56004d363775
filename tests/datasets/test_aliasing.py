"""Nothing delivered aliases a cache (DESIGN.md section 4).

Every column kind is written with pyarrow (or numpy for token shards); the rows
the writer was given are the reference. A consumer then edits everything it is
handed in place: the arrays ``TableRows.read`` / ``Mixture.fetch`` return, the
numpy batch a ``collate_fn`` receives, and the tensors the default collate
delivers, over several epochs (so later epochs read from the warm row-group
cache). Every snapshot taken *before* editing, and every read afterwards, must
still equal the writer's input.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from detdata import (
    ArrayDataset,
    DataLoader,
    GlobalOrder,
    LoaderOptions,
    Mixture,
    ReadOptions,
    TableRows,
    TokenWindows,
)
from detdata.identity.build import build_manifest

ROWS = 96
GROUP = 16  # 6 row groups per table, over 2 shards
RAGGED = ("ragged", "ragged_bool", "ragged_f")
Rows = dict[int, dict[str, Any]]  # id -> column -> the writer's value (plain Python)


# ------------------------------------------------------------------ the writer
def kind_columns(rng: np.random.Generator, rows: int, source: int) -> dict[str, Any]:
    """Per-column Python values (the reference) for every column kind TableRows supports."""
    lengths = rng.integers(0, 6, size=rows)
    stamp = rng.integers(-(10**12), 10**12, size=rows)
    return {
        "id": list(range(rows)),
        "source": [source] * rows,
        "f32": rng.standard_normal(rows).astype(np.float32).tolist(),
        "flag": (rng.random(rows) < 0.5).tolist(),
        "u16": rng.integers(0, 2**16, size=rows).astype(np.uint16).tolist(),
        "fixed": rng.integers(-999, 999, size=(rows, 3)).astype(np.int32).tolist(),
        "equal": rng.integers(-99, 99, size=(rows, 4)).astype(np.int16).tolist(),
        "ragged": [rng.integers(-(2**40), 2**40, size=n).tolist() for n in lengths],
        "ragged_bool": [(rng.random(n) < 0.5).tolist() for n in lengths[::-1]],
        "ragged_f": [rng.standard_normal(n).astype(np.float32).tolist() for n in lengths],
        "text": [None if i % 7 == 3 else f"doc-{source}-{i}-é-日本" for i in range(rows)],
        "blob": [
            bytes(rng.integers(0, 256, size=i % 5).tolist()) + b"\x00" * (i % 3)
            for i in range(rows)
        ],
        "ts": stamp.tolist(),
        "ts_tz": (stamp * 1000 + 7).tolist(),
        "day": rng.integers(-30000, 30000, size=rows).tolist(),
        "dur": rng.integers(-(10**9), 10**9, size=rows).tolist(),
    }


ARROW_TYPES: dict[str, pa.DataType] = {
    "id": pa.int64(),
    "source": pa.int8(),
    "f32": pa.float32(),
    "flag": pa.bool_(),
    "u16": pa.uint16(),
    "fixed": pa.list_(pa.int32(), 3),
    "equal": pa.list_(pa.int16()),
    "ragged": pa.list_(pa.int64()),
    "ragged_bool": pa.list_(pa.bool_()),
    "ragged_f": pa.large_list(pa.float32()),
    "text": pa.string(),
    "blob": pa.binary(),
    "ts": pa.timestamp("ms"),
    "ts_tz": pa.timestamp("us", tz="UTC"),
    "day": pa.date32(),
    "dur": pa.duration("s"),
}


def write_kinds(root: Path, *, source: int = 0, seed: int = 0) -> Rows:
    """Two Parquet shards holding every column kind; returns the writer's rows by id."""
    cols = kind_columns(np.random.default_rng(seed), ROWS, source)
    table = pa.table({name: pa.array(values, ARROW_TYPES[name]) for name, values in cols.items()})
    root.mkdir(parents=True, exist_ok=True)
    half = (
        ROWS // 2 + GROUP // 2
    )  # shards of 56 and 40 rows: row groups of 16, 16, 16, 8 / 16, 16, 8
    pq.write_table(table.slice(0, half), root / "part-0.parquet", row_group_size=GROUP)
    pq.write_table(table.slice(half), root / "part-1.parquet", row_group_size=GROUP)
    return {i: {name: values[i] for name, values in cols.items()} for i in range(ROWS)}


def open_kinds(root: Path, cache: str) -> TableRows:
    """``slots``: the whole dataset fits the cache (slot arrays); ``lru``: 2 groups kept as
    arrays."""
    groups = 64 if cache == "slots" else 2
    return TableRows(build_manifest(str(root)), ragged=list(RAGGED), cache_row_groups=groups)


# ------------------------------------------------------------------ plain values
def plain_numpy(column: np.ndarray) -> list[Any]:
    """A numpy batch column as per-row plain Python values (timestamps as raw counts)."""
    if column.dtype.kind in "Mm":
        return column.view(np.int64).tolist()
    if column.dtype == object:
        return [v.tolist() if isinstance(v, np.ndarray) else v for v in column.tolist()]
    return column.tolist()


def plain_torch(column: Any) -> list[Any]:
    """A default-collated column as per-row plain Python values."""
    if isinstance(column, torch.Tensor):
        return column.tolist()
    assert isinstance(column, list), type(column)
    return [v.tolist() if isinstance(v, torch.Tensor) else v for v in column]


def snapshot(batch: dict[str, Any], plain: Callable[[Any], list[Any]]) -> list[dict[str, Any]]:
    """Rows of a batch, as plain values, taken before anyone edits it."""
    columns = {name: plain(value) for name, value in batch.items()}
    sizes = {len(v) for v in columns.values()}
    assert len(sizes) == 1, {k: len(v) for k, v in columns.items()}
    return [{k: v[i] for k, v in columns.items()} for i in range(sizes.pop())]


# ------------------------------------------------------------------ vandals
def vandalize_numpy(batch: dict[str, np.ndarray]) -> None:
    """Edit every array (and every ragged row) of a numpy batch in place, then its elements."""
    for column in batch.values():
        if column.dtype == object:
            for i, value in enumerate(column.tolist()):
                if isinstance(value, np.ndarray):
                    _overwrite(value)
                column[i] = "vandalized"
        else:
            _overwrite(column)


def _overwrite(arr: np.ndarray) -> None:
    """Scribble over ``arr``'s bytes; a read-only array must refuse (that is allowed)."""
    if arr.flags.writeable:
        arr.view(np.uint8)[...] = 0xA5
    else:
        with pytest.raises(ValueError, match="read-only"):
            arr.view(np.uint8)[...] = 0xA5


def vandalize_torch(batch: dict[str, Any]) -> None:
    """Edit every delivered tensor (and every list item) in place."""
    for column in batch.values():
        if isinstance(column, torch.Tensor):
            _scribble(column)
        else:
            for i, value in enumerate(column):
                if isinstance(value, torch.Tensor):
                    _scribble(value)
                column[i] = "vandalized"


def _scribble(t: torch.Tensor) -> None:
    if t.dtype == torch.bool:
        t.logical_not_()
    else:
        t.fill_(99)


# ------------------------------------------------------------------ checks
def check_rows(rows: Iterable[dict[str, Any]], refs: dict[int, Rows]) -> int:
    """Every row equals the writer's row of its (source, id); returns how many were checked."""
    count = 0
    for row in rows:
        ref = refs[row["source"]][row["id"]]
        assert row == ref, {k: (row[k], ref[k]) for k in ref if row[k] != ref[k]}
        count += 1
    return count


def check_every_read(data: TableRows | Mixture, refs: dict[int, Rows], n: int) -> None:
    if isinstance(data, Mixture):
        batch = data.fetch(np.arange(n, dtype=np.int64))
    else:
        batch = data.read(np.arange(n, dtype=np.int64)[::-1].copy())
    assert check_rows(snapshot(batch, plain_numpy), refs) == n


def run_loader(
    data: TableRows | Mixture, mode: str, collate: str, read_ahead: int, epochs: int
) -> list[dict[str, Any]]:
    """Rows delivered over ``epochs`` passes, snapshotted before every edit."""
    seen: list[dict[str, Any]] = []

    def edit_in_collate(batch: dict[str, np.ndarray]) -> list[dict[str, Any]]:
        rows = snapshot(batch, plain_numpy)  # reader threads run this concurrently: return it
        vandalize_numpy(batch)
        return rows

    total = epochs * ROWS
    loader = DataLoader(
        data,
        global_batch_size=8,
        seed=5,
        options=LoaderOptions(
            total_samples=total, read=ReadOptions(worker_mode="thread", batches_ahead=read_ahead)
        ),
        num_workers=2 if mode == "thread" else 0,
        collate_fn=edit_in_collate if collate == "custom" else None,
    )
    for batch in loader:
        if collate == "default":
            seen.extend(snapshot(batch, plain_torch))
            vandalize_torch(batch)
        else:
            seen.extend(batch)
    assert len(seen) == total
    return seen


# ------------------------------------------------------------------ TableRows
@pytest.mark.parametrize("cache", ["slots", "lru"])
def test_read_then_edit_never_changes_a_later_read(tmp_path: Path, cache: str) -> None:
    ref = write_kinds(tmp_path / "t")
    ds = open_kinds(tmp_path / "t", cache)
    rng = np.random.default_rng(1)
    for _ in range(12):
        ids = rng.integers(0, ROWS, size=20)
        batch = ds.read(ids)
        assert check_rows(snapshot(batch, plain_numpy), {0: ref}) == 20
        vandalize_numpy(batch)
    check_every_read(ds, {0: ref}, ROWS)


@pytest.mark.parametrize("read_ahead", [1, 4])
@pytest.mark.parametrize("collate", ["custom", "default"])
@pytest.mark.parametrize("mode", ["inline", "thread"])
@pytest.mark.parametrize("cache", ["slots", "lru"])
def test_loader_consumer_edits_never_reach_later_epochs(
    tmp_path: Path, cache: str, mode: str, collate: str, read_ahead: int
) -> None:
    ref = write_kinds(tmp_path / "t")
    ds = open_kinds(tmp_path / "t", cache)
    seen = run_loader(ds, mode, collate, read_ahead, epochs=3)
    assert check_rows(seen, {0: ref}) == 3 * ROWS
    for epoch in range(3):  # each epoch delivers every row once
        assert sorted(r["id"] for r in seen[epoch * ROWS : (epoch + 1) * ROWS]) == list(range(ROWS))
    check_every_read(ds, {0: ref}, ROWS)


@pytest.mark.parametrize("collate", ["custom", "default"])
def test_mixture_of_tables_consumer_edits_never_reach_later_reads(
    tmp_path: Path, collate: str
) -> None:
    refs = {s: write_kinds(tmp_path / f"t{s}", source=s, seed=10 + s) for s in (0, 1)}
    sources = {f"s{s}": open_kinds(tmp_path / f"t{s}", "slots") for s in (0, 1)}
    mixture = Mixture(sources, {"s0": 1, "s1": 2}, seed=3)
    seen = run_loader(mixture, "inline", collate, 4, epochs=3)
    assert check_rows(seen, refs) == 3 * ROWS
    for name, ds in sources.items():
        check_every_read(ds, {int(name[1]): refs[int(name[1])]}, ROWS)
    batch = mixture.fetch(np.arange(64, dtype=np.int64))
    assert check_rows(snapshot(batch, plain_numpy), refs) == 64


# ------------------------------------------------------------------ TokenWindows, ArrayDataset
SEQ = 7


def token_reference(root: Path) -> tuple[list[np.ndarray], list[list[int]]]:
    """Writes two uint16 token shards; returns them and the windows in id order (labels=True)."""
    rng = np.random.default_rng(4)
    root.mkdir(parents=True)
    shards = [rng.integers(0, 2**16, size=n).astype(np.uint16) for n in (120, 71)]
    windows = []
    for i, tokens in enumerate(shards):
        np.save(root / f"shard-{i}.npy", tokens)
        windows += [
            tokens[w * SEQ : w * SEQ + SEQ + 1].tolist() for w in range((len(tokens) - 1) // SEQ)
        ]
    return shards, windows


@pytest.mark.parametrize("collate", ["custom", "default"])
@pytest.mark.parametrize("mode", ["inline", "thread"])
def test_token_windows_edits_never_reach_the_shards_or_later_reads(
    tmp_path: Path, mode: str, collate: str
) -> None:
    shards, windows = token_reference(tmp_path / "tok")
    ds = TokenWindows(build_manifest(str(tmp_path / "tok")), SEQ)
    assert ds.num_samples == len(windows)
    order = GlobalOrder(len(windows), 5)
    seen: list[list[int]] = []

    def edit(batch: dict[str, np.ndarray]) -> list[list[int]]:
        rows: list[list[int]] = batch["tokens"].tolist()
        vandalize_numpy(batch)
        return rows

    total = 3 * 8 * (len(windows) // 8)
    loader = DataLoader(
        ds,
        global_batch_size=8,
        seed=5,
        options=LoaderOptions(
            total_samples=total, read=ReadOptions(worker_mode="thread", batches_ahead=4)
        ),
        num_workers=2 if mode == "thread" else 0,
        collate_fn=edit if collate == "custom" else None,
    )
    for batch in loader:
        if collate == "default":
            seen.extend(batch["tokens"].tolist())
            vandalize_torch(batch)
        else:
            seen.extend(batch)
    assert seen == [windows[i] for i in order.ids(np.arange(total))]
    assert ds.read(np.arange(len(windows))[::-1].copy())["tokens"].tolist() == windows[::-1]
    for i, tokens in enumerate(shards):
        np.testing.assert_array_equal(np.load(tmp_path / "tok" / f"shard-{i}.npy"), tokens)


def test_array_dataset_edits_never_reach_later_reads() -> None:
    ids = np.arange(40, dtype=np.int64)
    x = (ids[:, None] * 3 + np.arange(5)).astype(np.float32)
    ds = ArrayDataset({"id": ids.copy(), "x": x.copy()})

    def edit(batch: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        vandalize_numpy(batch)
        return batch

    for collate in (edit, None):
        for batch in DataLoader(
            ds,
            global_batch_size=8,
            seed=1,
            options=LoaderOptions(total_samples=80, read=ReadOptions(batches_ahead=2)),
            collate_fn=collate,
        ):
            if collate is None:
                vandalize_torch(batch)
    again = ds.read(ids)
    np.testing.assert_array_equal(again["id"], ids)
    np.testing.assert_array_equal(again["x"], x)


class ReusedBuffer:
    """A dataset that gathers into one buffer it reuses and hands it out read-only (legal: a
    read-only view may be shared). A delivered tensor must not see the next read's rows."""

    num_samples = 30

    def __init__(self) -> None:
        self.store = np.arange(self.num_samples * 4, dtype=np.int32).reshape(-1, 4)
        self.buffer = np.empty_like(self.store)

    def read(self, ids: np.ndarray) -> dict[str, np.ndarray]:
        out = self.buffer[: len(ids)]
        np.take(self.store, ids, axis=0, out=out)
        when = out[:, 0].astype("datetime64[s]")
        out.flags.writeable = False
        return {"id": ids.copy(), "x": out, "when": when}

    def identity(self) -> dict[str, Any]:
        return {"type": "reused-buffer"}


@pytest.mark.parametrize("mode", ["inline", "thread"])
def test_default_collate_copies_read_only_arrays(mode: str) -> None:
    data = ReusedBuffer()
    kept = list(
        DataLoader(
            data,
            global_batch_size=3,
            seed=2,
            options=LoaderOptions(
                total_samples=60, read=ReadOptions(worker_mode="thread", batches_ahead=1)
            ),
            num_workers=1 if mode == "thread" else 0,
        )
    )
    for batch in kept:  # kept batches still hold their own rows, not the buffer's latest
        ids = batch["id"].numpy()
        np.testing.assert_array_equal(batch["x"].numpy(), data.store[ids])
        assert batch["when"].tolist() == data.store[ids, 0].tolist()  # seconds since 1970
        batch["x"].fill_(-1)
    assert (data.store == np.arange(120, dtype=np.int32).reshape(-1, 4)).all()


@pytest.mark.parametrize(
    ("workers", "mode", "pin"),
    [(0, "process", False), (2, "thread", False), (1, "process", False), (0, "process", True)],
)
def test_a_delivered_batch_owns_its_memory(
    tmp_path: Path, workers: int, mode: str, pin: bool
) -> None:
    """DESIGN section 4: keeping one batch does not keep its read-ahead group alive, and
    ``torch.save(batch)`` writes the batch's own bytes, not the group's."""
    import torch

    import detdata

    data = detdata.ArrayDataset(
        {
            "x": np.arange(4096, dtype=np.int64),
            "y": np.arange(4096 * 256, dtype=np.float32).reshape(4096, 256),
        }
    )
    loader = detdata.DataLoader(
        data,
        global_batch_size=4,
        options=detdata.LoaderOptions(
            total_samples=64, read=detdata.ReadOptions(worker_mode=mode, batches_ahead=16)
        ),
        num_workers=workers,
        pin_memory=pin,
    )
    for batch in loader:
        for key, value in batch.items():
            assert value.untyped_storage().nbytes() == value.nbytes, (key, value.shape)
    torch.save(batch, tmp_path / "b.pt")
    solo = detdata.DataLoader(
        data,
        global_batch_size=4,
        options=detdata.LoaderOptions(total_samples=4, read=detdata.ReadOptions(batches_ahead=1)),
    )
    torch.save(next(iter(solo)), tmp_path / "solo.pt")
    kept, own = (tmp_path / "b.pt").stat().st_size, (tmp_path / "solo.pt").stat().st_size
    assert own > 4 * 1024 and kept < 1.5 * own  # a view of its group would write 16x
