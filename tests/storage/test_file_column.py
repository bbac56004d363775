"""`detdata.storage.file_column.FileColumn`: an integer array read from a file with
``pread``. Every answer is compared with numpy over the same values, kept in memory (the
writer's own input)."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from detdata.storage.file_column import (
    BLOCK,
    PROMOTE_BLOCKS,
    SMALL_READS,
    FileColumn,
    OpenFile,
)

PAD = 24  # bytes before the column in its file (a column starts anywhere)


def _column(tmp_path: Path, values: np.ndarray, name: str = "col") -> FileColumn:
    path = tmp_path / name
    path.write_bytes(b"h" * PAD + values.tobytes() + b"tail")
    return FileColumn(OpenFile(str(path)), PAD, values.size, values.dtype)


@settings(max_examples=60, deadline=None)
@given(
    steps=st.lists(st.integers(0, 3), min_size=1, max_size=3 * BLOCK + 7),
    probes=st.lists(st.integers(-3, 4 * (3 * BLOCK + 7)), min_size=0, max_size=60),
    cut=st.tuples(st.integers(0, 3 * BLOCK + 7), st.integers(0, 3 * BLOCK + 7)),
)
def test_reads_and_searches_equal_numpy_on_the_same_values(
    tmp_path_factory: pytest.TempPathFactory,
    steps: list[int],
    probes: list[int],
    cut: tuple[int, int],
) -> None:
    values = np.cumsum(steps).astype(np.int64)  # ascending, with runs of equal values
    col = _column(tmp_path_factory.mktemp("c"), values)
    n = values.size
    assert len(col) == col.size == n and col.shape == (n,) and col.dtype == values.dtype
    assert np.array_equal(np.asarray(col), values)
    idx = np.asarray([p % (2 * n) - n for p in probes], dtype=np.int64)  # negatives too
    assert np.array_equal(col[idx], values[idx])
    assert np.array_equal(col.take(idx.reshape(-1, 1)), values[idx].reshape(-1, 1))
    for i in idx.tolist()[:5]:
        assert col[i] == values[i]
    vals = np.asarray(probes, dtype=np.int64)
    for side in ("left", "right"):
        assert np.array_equal(col.searchsorted(vals, side), values.searchsorted(vals, side))
        for v in probes[:3]:
            assert col.searchsorted(v, side) == values.searchsorted(v, side)
    a, b = sorted(cut)
    sub, ref = col[a:b], values[a:b]
    assert np.array_equal(np.asarray(sub), ref)
    if ref.size:
        for side in ("left", "right"):
            assert np.array_equal(sub.searchsorted(vals, side), ref.searchsorted(vals, side))
        inside = np.asarray([p % ref.size for p in probes], dtype=np.int64)
        assert np.array_equal(sub[inside], ref[inside])


def test_other_dtypes_and_a_prefix_slice_after_a_search(tmp_path: Path) -> None:
    codes = (np.arange(5 * BLOCK) % 7).astype("<i2")
    col = _column(tmp_path, codes, "codes")
    picks = np.asarray([0, BLOCK - 1, BLOCK, 4 * BLOCK + 3, -1])
    assert np.array_equal(col[picks], codes[picks]) and col[picks].dtype == codes.dtype
    starts = np.arange(0, 10 * (3 * BLOCK + 1), 10, dtype=np.int64)
    whole = _column(tmp_path, starts, "starts")
    assert whole.searchsorted(15, "right") == 2  # the coarse sample is read now
    head = whole[:-1]  # what TokenWindows keeps as its window starts
    assert np.array_equal(
        head.searchsorted(starts, "right"), starts[:-1].searchsorted(starts, "right")
    )


def test_out_of_range_and_non_integer_indices_raise(tmp_path: Path) -> None:
    col = _column(tmp_path, np.arange(10, dtype=np.int64))
    with pytest.raises(IndexError, match="index 10 is out of range for 10"):
        col[np.asarray([1, 10])]
    with pytest.raises(IndexError, match="-11"):
        col[-11]
    with pytest.raises(TypeError, match="integers"):
        col[np.asarray([1.0])]
    with pytest.raises(ValueError, match="side"):
        col.searchsorted(3, "middle")


def test_it_maps_nothing_reads_what_is_asked_then_the_whole_column_for_wide_reads(
    tmp_path: Path,
) -> None:
    """A few lookups read their elements alone, more keep the blocks they read; a run
    that has read `PROMOTE_BLOCKS` blocks (or half the column's) gets the column read whole
    (numpy's speed); answers equal numpy's throughout, and the file is never mapped."""
    values = np.arange(0, 3 * (PROMOTE_BLOCKS + 40) * BLOCK, 3, dtype=np.int64)
    col = _column(tmp_path, values)
    few = np.asarray([b * BLOCK + 7 for b in range(0, 20, 2)])  # 10 elements, 10 blocks
    assert np.array_equal(col[few], values[few])
    assert np.array_equal(col.searchsorted(values[few] + 1), few + 1)
    assert col._blocks == {} and col._whole is None  # the elements alone were read
    many = np.asarray([b * BLOCK + 7 for b in range(0, 2 * SMALL_READS + 2, 2)])
    assert np.array_equal(col[many], values[many])
    assert sorted(col._blocks) == list(range(0, 2 * SMALL_READS + 2, 2))
    assert col._whole is None
    rng = np.random.default_rng(5)
    for _ in range(20):
        idx = rng.integers(0, values.size, 300)
        assert np.array_equal(col[idx], values[idx])
        v = rng.integers(0, int(values[-1]), 300)
        for side in ("left", "right"):
            assert np.array_equal(col.searchsorted(v, side), values.searchsorted(v, side))
    assert col._whole is not None and np.array_equal(col._whole, values)
    assert col[5] == values[5] and np.array_equal(col[few], values[few])
    maps = Path(f"/proc/{os.getpid()}/maps").read_text()
    assert str(tmp_path / "col") not in maps  # read, never mapped


def test_a_file_cut_short_under_it_is_an_error_naming_it(tmp_path: Path) -> None:
    """Files under a column are replaced atomically, never rewritten in place; one cut
    short anyway is an `OSError` naming it (a mapping would have killed the process)."""
    values = np.arange(4 * BLOCK, dtype=np.int64)
    col = _column(tmp_path, values)
    os.truncate(tmp_path / "col", PAD + 8 * BLOCK)
    assert col[5] == 5  # still inside the file
    with pytest.raises(OSError, match=r"col: .* past its end"):
        col[3 * BLOCK]
