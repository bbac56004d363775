"""Provenance of a step equals the bytes delivered at that step, read straight from the shard files.

Each test iterates two DP ranks of a real loader to the step, then checks every
`SampleRecord` of ``loader.provenance(step)`` against (a) the row the rank actually
received at the reported micro step and row, and (b) the shard file itself, opened
with ``np.load`` / ``open`` / ``pyarrow`` at the reported path and range.

Covers: detdata/loading/lookup.py, detdata/datasets/sample_framing.py.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import blake3
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from detdata.base.errors import ConfigError
from detdata.datasets.base import ArrayDataset
from detdata.datasets.exclusions import Excluded, ExclusionList
from detdata.datasets.mixture import Mixture
from detdata.datasets.streams import OrderedStream
from detdata.datasets.tables import TableRows
from detdata.datasets.tokens import TokenWindows
from detdata.identity.build import build_manifest
from detdata.loading.loader import DataLoader
from detdata.loading.options import LoaderOptions
from detdata.loading.provenance import positions_seen
from tests.conftest import write_token_shards

SEQ = 16
GBS, MICRO, WORLD = 8, 2, 2  # two micro steps per step on each of two ranks
STEP = 3


def _step_batches(make: Any, step: int) -> dict[tuple[int, int], dict[str, np.ndarray]]:
    """``(rank, micro step in step) -> delivered batch`` of ``step``, from two real loaders."""
    per_step = GBS // (MICRO * WORLD)
    out = {}
    for rank in range(WORLD):
        loader = make(rank)
        it = iter(loader)
        for j in range((step + 1) * per_step):
            batch = next(it)
            if j >= step * per_step:
                out[(rank, j - step * per_step)] = {k: v.numpy() for k, v in batch.items()}
        loader.close()
    return out


def _independent_digest(sample: dict[str, Any]) -> str:
    """The documented `sample_digest` framing, written out again here from the docstring."""

    def framed(*parts: bytes) -> bytes:
        return b"".join(len(p).to_bytes(8, "little") + p for p in parts)

    cols = []
    for name in sorted(sample):
        arr = np.ascontiguousarray(sample[name])
        value = framed(b"nd", arr.dtype.str.encode(), str(arr.shape).encode(), arr.tobytes())
        cols.append(framed(name.encode(), value))
    return "b3:" + blake3.blake3(framed(b"detdata:sample-v1", *cols)).hexdigest()


def _check_tokens(records: list[Any], delivered: Any, root: Path | dict[str, Path]) -> None:
    assert len(records) == GBS
    assert [r.position for r in records] == list(range(STEP * GBS, (STEP + 1) * GBS))
    for rec in records:
        row = delivered[(rec.rank, rec.micro_step)]["tokens"][rec.row]
        path = Path(rec.to_json()["url"])
        assert path.parent == (root[rec.source] if isinstance(root, dict) else root)
        start, end = rec.to_json()["tokens"]
        on_disk = np.load(path, mmap_mode="r")[start:end]
        np.testing.assert_array_equal(row, on_disk)
        lo, hi = rec.to_json()["bytes"]
        with open(path, "rb") as fh:
            fh.seek(lo)
            raw = fh.read(hi - lo)
        assert raw == np.ascontiguousarray(on_disk).tobytes()
        assert rec.digest == _independent_digest({"tokens": on_disk.astype(row.dtype)})


def test_token_windows_step_provenance_matches_the_files(tmp_path: Path) -> None:
    root = tmp_path / "tok"
    write_token_shards(root, sizes=(300, 500, 90))
    ds = TokenWindows(build_manifest(str(root)), SEQ)

    def make(rank: int) -> DataLoader:
        return DataLoader(
            ds,
            global_batch_size=GBS,
            micro_batch_size=MICRO,
            options=LoaderOptions(rank=rank, world_size=WORLD),
            seed=5,
        )

    records = make(0).provenance(STEP)
    _check_tokens(records, _step_batches(make, STEP), root)
    assert {r.rank for r in records} == {0, 1} and {r.micro_step for r in records} == {0, 1}
    assert all(r.source is None for r in records)


def test_mixture_step_provenance_matches_the_files(tmp_path: Path) -> None:
    roots = {"web": tmp_path / "web", "code": tmp_path / "code"}
    write_token_shards(roots["web"], sizes=(400, 200), seed=1)
    write_token_shards(roots["code"], sizes=(150, 260), seed=2)
    sources = {n: TokenWindows(build_manifest(str(r)), SEQ) for n, r in roots.items()}
    mix = Mixture(sources, {"web": 3, "code": 1}, seed=9)

    def make(rank: int) -> DataLoader:
        return DataLoader(
            mix,
            global_batch_size=GBS,
            micro_batch_size=MICRO,
            options=LoaderOptions(rank=rank, world_size=WORLD),
        )

    records = make(1).provenance(STEP)
    _check_tokens(records, _step_batches(make, STEP), roots)
    src, _, ids = mix.locate(np.arange(STEP * GBS, (STEP + 1) * GBS))
    assert [r.source for r in records] == [mix.source_names[s] for s in src]
    assert [r.sample_id for r in records] == ids.tolist()


def test_table_rows_step_provenance_matches_the_files(tmp_path: Path) -> None:
    root = tmp_path / "tab"
    root.mkdir()
    rng = np.random.default_rng(0)
    for i, n in enumerate((37, 50)):
        table = pa.table(
            {"x": rng.integers(0, 1000, n).astype(np.int64), "y": rng.random(n).astype(np.float32)}
        )
        pq.write_table(table, root / f"part-{i}.parquet", row_group_size=8)
    ds = TableRows(build_manifest(str(root)))

    def make(rank: int) -> DataLoader:
        return DataLoader(
            ds,
            global_batch_size=GBS,
            micro_batch_size=MICRO,
            options=LoaderOptions(rank=rank, world_size=WORLD),
            seed=2,
        )

    records = make(0).provenance(STEP)
    delivered = _step_batches(make, STEP)
    for rec in records:
        doc = rec.to_json()
        lo, hi = doc["rows"]
        table = pq.read_table(doc["url"]).slice(lo, hi - lo)
        got = delivered[(rec.rank, rec.micro_step)]
        for col in ("x", "y"):
            assert got[col][rec.row] == table.column(col)[0].as_py()
        file_sample = {c: table.column(c).to_numpy()[0] for c in ("x", "y")}
        assert rec.digest == _independent_digest(file_sample)
        meta = pq.ParquetFile(doc["url"]).metadata
        starts = np.cumsum([0] + [meta.row_group(g).num_rows for g in range(meta.num_row_groups)])
        assert starts[doc["row_group"]] <= lo < starts[doc["row_group"] + 1]


def test_decode_callback_and_excluded_note() -> None:
    ds = ArrayDataset({"v": np.arange(40, dtype=np.int64) * 10})
    stream = OrderedStream(ds, seed=1)
    victim = int(stream.sample_ids(np.array([2]))[0])
    excluded = Excluded(stream, ExclusionList.of([victim]))
    loader = DataLoader(excluded, global_batch_size=4)
    records = loader.provenance(0, decode=lambda s: f"v={int(s['v'])}")
    assert records[2].replaced == {"excluded": victim, "draws": records[2].replaced["draws"]}
    assert records[2].sample_id != victim
    assert [r.text for r in records] == [f"v={r.sample_id * 10}" for r in records]
    assert all(r.replaced is None for i, r in enumerate(records) if i != 2)


# ------------------------------------------------------------------ reverse lookup
P = 1_000_000


def test_seen_equals_a_brute_force_scan_ordered() -> None:
    n = 7919
    stream = OrderedStream(ArrayDataset({"v": np.zeros(n, dtype=np.int8)}), seed=11)
    ids = stream.order.ids(np.arange(P))
    for x in (0, 1, 4000, n - 1):
        np.testing.assert_array_equal(
            positions_seen(stream, None, x, until=P), np.flatnonzero(ids == x)
        )
    with pytest.raises(ConfigError, match="one dataset"):
        positions_seen(stream, "web", 0, until=10)


def test_seen_equals_a_brute_force_scan_mixture() -> None:
    sizes = {"a": 301, "b": 5000, "c": 97}
    sources = {k: ArrayDataset({"v": np.zeros(v, dtype=np.int8)}, name=k) for k, v in sizes.items()}
    mix = Mixture(
        sources,
        schedule=[(0, {"a": 1, "b": 5, "c": 2}), (400_000, {"a": 3, "b": 1, "c": 1})],
        seed=4,
    )
    src, _, ids = mix.locate(np.arange(P))
    for name, x in (("a", 0), ("a", 300), ("b", 17), ("c", 50)):
        s = mix.source_names.index(name)
        expected = np.flatnonzero((src == s) & (ids == x))
        np.testing.assert_array_equal(positions_seen(mix, name, x, until=P), expected)
    with pytest.raises(ConfigError, match="unknown source"):
        positions_seen(mix, "zzz", 0, until=10)


def test_seen_through_exclusions_equals_a_brute_force_scan() -> None:
    n = 211
    stream = OrderedStream(ArrayDataset({"v": np.zeros(n, dtype=np.int8)}), seed=3)
    lists = [(0, ExclusionList.of([5, 6])), (30_000, ExclusionList.of([7]))]
    excluded = Excluded(stream, lists)
    until = 60_000
    ids = excluded.sample_ids(np.arange(until))
    for x in (5, 7, 8, 100):
        np.testing.assert_array_equal(
            positions_seen(excluded, None, x, until=until), np.flatnonzero(ids == x)
        )
