"""The first batch of a shuffled Parquet corpus (issue 46): what it no longer pays for.

A shuffled first read touches most row groups of a corpus (1,024 rows over 391 groups of
128 rows decode 368 of them), so its fixed costs show at every start and resume:

* converting Arrow numbers to numpy imported pandas (pyarrow's ``Array.to_numpy`` imports
  it at its first call: ~0.3 s of CPU); `numbers` views the data buffer instead, with the
  same values and dtype as ``to_numpy`` (checked here against pyarrow's own conversion);
* the slot arrays of the row-group cache grew by doubling, copying everything decoded so far
  at each step; a read now makes room for its groups at once (`GroupSlots.reserve`).

Covers: detdata/datasets/arrow_numpy.py, detdata/datasets/rowgroups.py, detdata/datasets/tables.py.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

import detdata
from detdata.datasets.arrow_numpy import _numpy_dtype, numbers

ROOT = Path(__file__).resolve().parents[2]
NUMBER_TYPES = [
    pa.int8(),
    pa.int16(),
    pa.int32(),
    pa.int64(),
    pa.uint8(),
    pa.uint16(),
    pa.uint32(),
    pa.uint64(),
    pa.float16(),
    pa.float32(),
    pa.float64(),
    pa.bool_(),
    pa.timestamp("ms"),
    pa.date32(),
]


def _array(kind: pa.DataType, n: int) -> pa.Array:
    rng = np.random.default_rng(5)
    if kind == pa.bool_():
        return pa.array(rng.integers(0, 2, n).astype(bool))
    if kind == pa.float16():
        return pa.array(rng.random(n).astype(np.float16), type=kind)
    if pa.types.is_timestamp(kind) or pa.types.is_date(kind):
        return (
            pa.array(rng.integers(0, 10**6, n), type=pa.int64())
            .cast(pa.int32() if pa.types.is_date32(kind) else pa.int64())
            .cast(kind)
        )
    return pa.array(rng.integers(0, 100, n)).cast(kind)


@pytest.mark.parametrize("kind", NUMBER_TYPES, ids=str)
@pytest.mark.parametrize("offset", [0, 3])
def test_numbers_are_pyarrows_to_numpy(kind: pa.DataType, offset: int) -> None:
    array = _array(kind, 40).slice(offset, 30)  # a slice: its offset must be honoured
    got, want = numbers(array), array.to_numpy(zero_copy_only=False)
    assert got.dtype == want.dtype and got.shape == want.shape
    assert np.array_equal(got, want)
    assert got.flags.writeable == want.flags.writeable  # a read-only view where to_numpy gives one
    assert _numpy_dtype(kind) == want.dtype  # what a column of this type is said to hold


def _corpus(folder: Path, shards: int, rows: int, group: int, width: int) -> np.ndarray[Any, Any]:
    """``shards`` Parquet files of ``rows`` rows (a ``list<int32>`` column of ``width`` tokens
    and an ``int64`` id), row groups of ``group``; returns every row's tokens in id order."""
    folder.mkdir()
    tokens = np.arange(shards * rows * width, dtype=np.int32).reshape(-1, width)
    for s in range(shards):
        part = tokens[s * rows : (s + 1) * rows]
        column = pa.ListArray.from_arrays(
            pa.array(np.arange(0, part.size + 1, width, dtype=np.int32)), pa.array(part.ravel())
        )
        ids = pa.array(np.arange(s * rows, (s + 1) * rows, dtype=np.int64))
        pq.write_table(
            pa.table({"tokens": column, "id": ids}), folder / f"s{s}.parquet", row_group_size=group
        )
    return tokens


FIRST_READ = r"""
import json, sys
import numpy as np, pyarrow.parquet, torch
import detdata, detdata.loading.loader
before = "pandas" in sys.modules
ds = detdata.TableRows(sys.argv[1], ["tokens", "id"])
batch = next(iter(detdata.DataLoader(ds, global_batch_size=64, seed=3)))
print(json.dumps({"before": before, "after": "pandas" in sys.modules,
                  "tokens": batch["tokens"].tolist(), "id": batch["id"].tolist()}))
"""


def test_a_first_batch_imports_no_pandas(tmp_path: Path) -> None:
    import importlib.util

    assert importlib.util.find_spec("pandas") is not None  # else this test proves nothing
    tokens = _corpus(tmp_path / "pq", shards=3, rows=200, group=16, width=8)
    manifest = detdata.build_manifest(str(tmp_path / "pq"), pattern="*.parquet")
    manifest.save(str(tmp_path / "m.json"))
    proc = subprocess.run(
        [sys.executable, "-c", FIRST_READ, str(tmp_path / "m.json")],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=300,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["before"] is False and out["after"] is False
    ids = np.asarray(out["id"])
    assert np.array_equal(np.asarray(out["tokens"]), tokens[ids])  # the writer's rows


def test_a_first_read_allocates_the_slot_arrays_once(tmp_path: Path) -> None:
    width, group = 4, 10
    tokens = _corpus(tmp_path / "pq", shards=5, rows=100, group=group, width=width)
    ds = detdata.TableRows(detdata.build_manifest(str(tmp_path / "pq")), ["tokens"])
    ids = np.arange(0, 370, group)  # one row in each of 37 of the 50 row groups
    batch = ds.read(ids)
    assert np.array_equal(batch["tokens"], tokens[ids])
    slot = group * width * 4  # one row group's decoded tokens
    # room for exactly the 37 groups read (doubling grew 4, 8, ..., 64 -> 50 slots, copying)
    assert ds.cache.pool_bytes == 37 * slot
    later = np.arange(5, 500, group)  # every group: the arrays grow to the bound, no further
    assert np.array_equal(ds.read(later)["tokens"], tokens[later])
    assert ds.cache.pool_bytes == 50 * slot
