"""Type mismatches are refused up front, naming both sides, instead of failing mid-run.

A `Mixture` whose sources deliver different columns, dtypes, trailing shapes or
object kinds is refused at construction (a batch drawn from one source would
otherwise have another dtype than a batch drawn from both, or fail at the first
mixed batch, hours in). A loader transform whose outputs change keys from sample
to sample is refused at the sample that differs (instead of silently dropping
keys), and so is one whose dtypes change.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from detdata import (
    ArrayDataset,
    ConfigError,
    DataLoader,
    FormatError,
    GlobalOrder,
    LoaderOptions,
    Mixture,
    ReadOptions,
    TableRows,
    TokenWindows,
    build_manifest,
)


def tokens(root: Path, dtype: str, n: int = 400) -> str:
    root.mkdir(parents=True)
    np.save(root / "shard.npy", np.arange(n).astype(dtype))
    return str(root)


def table(root: Path, columns: dict[str, pa.Array]) -> TableRows:
    root.mkdir(parents=True)
    pq.write_table(pa.table(columns), root / "t.parquet", row_group_size=8)
    ragged = [n for n, a in columns.items() if pa.types.is_list(a.type)]
    return TableRows(build_manifest(str(root)), ragged=ragged)


def refused(sources: dict[str, Any]) -> str:
    with pytest.raises(FormatError) as err:
        Mixture(sources, dict.fromkeys(sources, 1), seed=0)
    return str(err.value)


# ------------------------------------------------------------------ Mixture at construction
def test_token_sources_of_different_dtypes_are_refused_naming_both(tmp_path: Path) -> None:
    """uint16 shards read as int32, uint32 shards as int64: batches would alternate dtypes."""
    narrow = TokenWindows(build_manifest(tokens(tmp_path / "a", "uint16")), 8)
    wide = TokenWindows(build_manifest(tokens(tmp_path / "b", "uint32")), 8)
    message = refused({"web": narrow, "code": wide})
    assert "'code'" in message and "'web'" in message and "'tokens'" in message
    assert "int64 (9,)" in message and "int32 (9,)" in message and "hint:" in message
    same = TokenWindows(build_manifest(str(tmp_path / "a")), 8, out_dtype="int64")
    mixed = Mixture({"web": same, "code": wide}, {"web": 1, "code": 1}, seed=0)  # agreed: accepted
    assert mixed.fetch(np.arange(40))["tokens"].dtype == np.int64


def test_token_sources_of_different_windows_are_refused(tmp_path: Path) -> None:
    root = tokens(tmp_path / "a", "int32")
    message = refused(
        {
            "short": TokenWindows(build_manifest(root), 8),
            "long": TokenWindows(build_manifest(root), 16),
        }
    )
    assert "'short'" in message and "'long'" in message
    assert "int32 (9,)" in message and "int32 (17,)" in message


def test_table_sources_with_other_columns_are_refused_naming_the_column(tmp_path: Path) -> None:
    a = table(tmp_path / "a", {"x": pa.array(np.arange(20)), "label": pa.array(np.arange(20))})
    b = table(tmp_path / "b", {"x": pa.array(np.arange(20))})
    message = refused({"a": a, "b": b})
    assert "column 'label'" in message and "'b' gives nothing" in message


def test_table_sources_with_other_kinds_are_refused(tmp_path: Path) -> None:
    """Same name, same numpy dtype (object) but different kinds: text vs ragged tokens."""
    text = table(tmp_path / "a", {"doc": pa.array([f"d{i}" for i in range(20)])})
    ragged = table(
        tmp_path / "b", {"doc": pa.array([[i] * (i % 3) for i in range(20)], pa.list_(pa.int32()))}
    )
    message = refused({"text": text, "ids": ragged})
    assert "column 'doc'" in message and "str" in message and "list<int32>" in message


def test_sources_without_schema_are_compared_by_a_sample(tmp_path: Path) -> None:
    message = refused(
        {
            "a": ArrayDataset({"x": np.arange(10)}, name="a"),
            "b": ArrayDataset({"x": np.arange(10, dtype=np.int16)}, name="b"),
        }
    )
    assert "column 'x'" in message and "int64" in message and "int16" in message
    message = refused(
        {
            "a": ArrayDataset({"x": np.zeros((10, 3))}, name="a"),
            "b": ArrayDataset({"x": np.zeros((10, 4))}, name="b"),
        }
    )
    assert "float64 (3,)" in message and "float64 (4,)" in message


def test_table_and_array_sources_that_agree_are_mixed(tmp_path: Path) -> None:
    """The schema() path and the sample path describe the same kinds the same way."""
    n = 24
    docs = [f"doc{i}" for i in range(n)]
    rows = [np.arange(i % 4, dtype=np.int64) for i in range(n)]
    tab = table(
        tmp_path / "a",
        {
            "id": pa.array(np.arange(n)),
            "doc": pa.array(docs),
            "toks": pa.array([r.tolist() for r in rows], pa.list_(pa.int64())),
            "when": pa.array(np.arange(n), pa.timestamp("ms")),
        },
    )
    objects = np.empty(n, dtype=object)
    for i, r in enumerate(rows):
        objects[i] = r + 100
    arr = ArrayDataset(
        {
            "id": np.arange(n) + 1000,
            "doc": np.asarray(docs, dtype=object),
            "toks": objects,
            "when": np.arange(n).astype("datetime64[ms]"),
        }
    )
    mixture = Mixture({"tab": tab, "arr": arr}, {"tab": 1, "arr": 1}, seed=1)
    assert mixture.columns == {
        "id": "int64",
        "doc": "str",
        "toks": "list<int64>",
        "when": "datetime64[ms]",
    }
    batch = mixture.fetch(np.arange(48))
    src, _, ids = mixture.locate(np.arange(48))
    for j in range(48):
        i, from_arr = int(ids[j]), mixture.source_names[int(src[j])] == "arr"
        assert int(batch["id"][j]) == i + 1000 * from_arr
        assert batch["doc"][j] == docs[i]
        assert batch["toks"][j].tolist() == (rows[i] + 100 * from_arr).tolist()


class Flaky:
    """A dataset whose read alternates between int32 and int64: caught at the batch."""

    num_samples = 50

    def __init__(self) -> None:
        self.calls = 0

    def read(self, ids: np.ndarray) -> dict[str, np.ndarray]:
        self.calls += 1
        return {"x": ids.astype(np.int32 if self.calls % 2 else np.int64)}

    def identity(self) -> dict[str, Any]:
        return {"type": "flaky"}


def test_a_source_whose_dtype_changes_between_reads_is_refused_at_the_batch() -> None:
    mixture = Mixture(
        {"steady": ArrayDataset({"x": np.arange(50, dtype=np.int32)}), "flaky": Flaky()},
        {"steady": 1, "flaky": 1},
        seed=0,
    )
    dtypes = set()
    with pytest.raises(FormatError, match=r"source 'flaky' column 'x': read gave int64.*int32"):
        for batch in DataLoader(
            mixture, global_batch_size=4, seed=0, options=LoaderOptions(total_samples=400)
        ):
            dtypes.add(batch["x"].dtype)
    assert len(dtypes) <= 1


# ------------------------------------------------------------------ loader transforms
N = 64
order = GlobalOrder(N, 7)
BAD_POSITION = 4 * 9 + 2  # third sample of micro batch 9: not the first of any read


def ids_dataset() -> ArrayDataset:
    return ArrayDataset({"id": np.arange(N), "x": np.arange(N, dtype=np.float32) * 2})


@pytest.mark.parametrize("read_ahead", [1, 4])
@pytest.mark.parametrize("change", ["extra", "missing"])
def test_transform_keys_changing_at_one_position_are_refused(change: str, read_ahead: int) -> None:
    bad_id = int(order[BAD_POSITION])

    def transform(sample: dict[str, Any], rng: np.random.Generator) -> dict[str, Any]:
        out = {"id": sample["id"], "y": sample["x"] + 1}
        if int(sample["id"]) == bad_id:
            if change == "extra":
                out["debug"] = np.int64(1)
            else:
                del out["y"]
        return out

    loader = DataLoader(
        ids_dataset(),
        global_batch_size=4,
        seed=7,
        options=LoaderOptions(
            total_samples=N, transform=transform, read=ReadOptions(batches_ahead=read_ahead)
        ),
    )
    delivered = 0
    with pytest.raises(ConfigError) as err:
        for _ in loader:
            delivered += 1
    message = str(err.value)
    assert f"position {BAD_POSITION}" in message
    assert ("debug" if change == "extra" else "'y'") in message
    assert delivered == 9 and loader.samples_consumed == 36  # the batches before it were delivered


def test_transform_dtype_changing_at_one_position_is_refused() -> None:
    bad_id = int(order[BAD_POSITION])

    def transform(sample: dict[str, Any], rng: np.random.Generator) -> dict[str, Any]:
        return {
            "id": sample["id"],
            "y": np.float64(1) if int(sample["id"]) == bad_id else np.float32(1),
        }

    with pytest.raises(ConfigError) as err:
        for _ in DataLoader(
            ids_dataset(),
            global_batch_size=4,
            seed=7,
            options=LoaderOptions(total_samples=N, transform=transform),
        ):
            pass
    message = str(err.value)
    assert "'y'" in message and "float64" in message and "float32" in message
    assert f"position {BAD_POSITION}" in message


@pytest.mark.parametrize(
    ("read_ahead", "workers", "mode"),
    [(1, 0, "process"), (16, 0, "process"), (16, 2, "thread"), (4, 2, "process")],
)
def test_transform_output_changing_between_micro_batches_is_refused(
    read_ahead: int, workers: int, mode: str
) -> None:
    """Keys or dtypes that change from one micro batch to another (one sample per batch here,
    so each batch is self-consistent) are refused before the odd batch is delivered or counted."""
    import detdata

    ids = np.arange(100, dtype=np.int64)
    bad = int(detdata.GlobalOrder(100, 0).ids(np.array([6]))[0])

    def transform(sample: dict[str, np.ndarray], rng: np.random.Generator) -> dict[str, Any]:
        odd = int(sample["x"]) == bad
        out: dict[str, Any] = {"x": sample["x"].astype(np.int32 if odd else np.int64)}
        if odd:
            out["extra"] = np.int64(1)
        return out

    loader = detdata.DataLoader(
        detdata.ArrayDataset({"x": ids}),
        global_batch_size=1,
        seed=0,
        options=detdata.LoaderOptions(
            total_samples=40,
            transform=transform,
            read=detdata.ReadOptions(worker_mode=mode, batches_ahead=read_ahead),
        ),
        num_workers=workers,
    )
    got = []
    with pytest.raises(
        detdata.ConfigError,
        match=r"transform output changed at the micro batch of "
        r"positions \[6, 6\]",
    ):
        for batch in loader:
            got.append(int(batch["x"][0]))
    assert got == detdata.GlobalOrder(100, 0).ids(np.arange(6)).tolist()
    assert loader.samples_consumed == 6


class _RawSource:
    """A user dataset handing out its arrays as stored (here: big-endian)."""

    def __init__(self, values: np.ndarray, name: str) -> None:
        self.values, self.name = values, name

    @property
    def num_samples(self) -> int:
        return len(self.values)

    def read(self, ids: np.ndarray) -> dict[str, np.ndarray]:
        return {"x": self.values[ids]}

    def identity(self) -> dict[str, Any]:
        return {"type": "raw", "name": self.name}


def test_mixture_of_sources_in_other_byte_orders_is_refused() -> None:
    import detdata

    be = _RawSource(np.arange(16, dtype=">i4"), "be")
    le = _RawSource(np.arange(100, 116, dtype="<i4"), "le")
    with pytest.raises(detdata.FormatError, match=r"'be' gives int32 \[>\], 'le' gives int32"):
        detdata.Mixture({"be": be, "le": le}, {"be": 1, "le": 1}, seed=0)


def test_array_dataset_delivers_big_endian_input_as_native_values() -> None:
    import detdata

    values = np.arange(100, 116, dtype=">i4")
    ds = detdata.ArrayDataset({"x": values})
    got = ds.read(np.arange(16))["x"]
    assert got.dtype.isnative and got.tolist() == values.tolist()
    mixed = detdata.Mixture(
        {"be": ds, "le": detdata.ArrayDataset({"x": np.arange(16, dtype="<i4")})},
        {"be": 1, "le": 1},
        seed=0,
    )
    assert mixed.fetch(np.arange(8))["x"].dtype == np.dtype("<i4")
