"""`detdata.Split` (``split-v1``): the rule against a brute-force reference, and stability of the
content-keyed split when shards are re-ordered, re-sharded or moved (real .npy and Parquet).

Covers: detdata/datasets/sample_framing.py.
"""

from __future__ import annotations

import itertools
import shutil
import struct
from fractions import Fraction
from pathlib import Path
from typing import Any

import blake3
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from detdata import (
    ConfigError,
    DataLoader,
    Split,
    SplitKey,
    StateError,
    TableRows,
    TokenWindows,
    build_manifest,
)

SALT = "val-v1"
ROWS = 1500


# -- an independent reference: the documented rule, written out by hand ------------------
def _frame(*fields: bytes) -> bytes:
    return b"".join(struct.pack("<Q", len(f)) + f for f in fields)


def _ref_key(columns: dict[str, bytes]) -> bytes:
    """blake3 of the framed sample; ``columns`` name -> that column's framed value bytes."""
    parts = [b"detdata:split-content-v1"]
    parts += [_frame(name.encode(), columns[name]) for name in sorted(columns)]
    return blake3.blake3(_frame(*parts)).digest()


def _nd(arr: np.ndarray) -> bytes:
    return _frame(b"nd", arr.dtype.str.encode(), str(arr.shape).encode(), arr.tobytes())


def _ref_is_val(key: bytes, salt: str, fraction: Fraction) -> bool:
    s = salt.encode()
    u = int.from_bytes(
        blake3.blake3(b"detdata:split-v1" + struct.pack("<Q", len(s)) + s + key).digest(8),
        "little",
    )
    return u * fraction.denominator < fraction.numerator * 2**64


# -- data ---------------------------------------------------------------------------------
def _rows() -> list[dict[str, Any]]:
    rng = np.random.default_rng(3)
    return [
        {"doc": int(i), "text": f"document {i} " + "x" * int(rng.integers(0, 20))}
        for i in range(ROWS)
    ]


def _write_parquet(root: Path, rows: list[dict[str, Any]], cuts: list[int], names: list[str]):
    root.mkdir(parents=True)
    bounds = [0, *cuts, len(rows)]
    for name, (a, b) in zip(names, itertools.pairwise(bounds), strict=True):
        chunk = rows[a:b]
        table = pa.table({"doc": [r["doc"] for r in chunk], "text": [r["text"] for r in chunk]})
        pq.write_table(table, root / name, row_group_size=100)
    return TableRows(build_manifest(str(root)))


def _val_contents(split: Split) -> set[tuple[Any, ...]]:
    batch = split.validation.read(np.arange(split.validation.num_samples))
    return {
        tuple(
            batch[k][j].tolist() if hasattr(batch[k][j], "tolist") else batch[k][j]
            for k in sorted(batch)
        )
        for j in range(split.validation.num_samples)
    }


def test_table_split_equals_a_brute_force_reference(tmp_path: Path) -> None:
    rows = _rows()
    ds = _write_parquet(
        tmp_path / "a", rows, [500, 1100], ["p0.parquet", "p1.parquet", "p2.parquet"]
    )
    fraction = Fraction(1, 10)
    split = Split(ds, fraction=fraction, salt=SALT)
    # reference: straight from the writer's rows (in file order = id order here)
    expected = [
        i
        for i, r in enumerate(rows)
        if _ref_is_val(
            _ref_key(
                {
                    "doc": _nd(np.asarray(np.int64(r["doc"]))),
                    "text": _frame(b"str", r["text"].encode()),
                }
            ),
            SALT,
            fraction,
        )
    ]
    assert split.validation.ids.tolist() == expected
    assert split.train.ids.tolist() == sorted(set(range(ROWS)) - set(expected))
    assert 0.06 < len(expected) / ROWS < 0.14
    # views read the base rows; identity carries the rule and the assignment digest
    got = split.validation.read(np.array([0, 2]))
    want = ds.read(np.array([expected[0], expected[2]]))
    assert {k: v.tolist() for k, v in got.items()} == {k: v.tolist() for k, v in want.items()}
    ident = split.validation.identity()
    assert ident["rule"] == {
        "algorithm": "split-v1",
        "key": "content",
        "fraction": "1/10",
        "salt": SALT,
    }
    mask = np.zeros(ROWS, dtype=bool)
    mask[expected] = True
    bits = struct.pack("<Q", ROWS) + np.packbits(mask).tobytes()
    assert ident["assignment"] == "b3:" + blake3.blake3(bits).hexdigest()
    assert ident["part"] == "validation" and ident["num_samples"] == len(expected)
    assert ident["dataset"] == ds.identity()
    assert split.train.identity()["part"] == "train"
    # an id-keyed split, the same reference with u64le(id) as the key
    by_id = Split(ds, fraction=fraction, salt=SALT, key=SplitKey.ID)
    ref_id = [i for i in range(ROWS) if _ref_is_val(struct.pack("<Q", i), SALT, fraction)]
    assert by_id.validation.ids.tolist() == ref_id
    assert by_id.identity()["rule"]["key"] == "id"


def test_table_split_is_stable_when_reordered_resharded_and_moved(tmp_path: Path) -> None:
    rows = _rows()
    three = ["p0.parquet", "p1.parquet", "p2.parquet"]
    original = _write_parquet(tmp_path / "orig", rows, [500, 1100], three)
    # re-ordered: the same files under names that sort the other way round
    reordered = _write_parquet(
        tmp_path / "reord", rows, [500, 1100], ["z.parquet", "m.parquet", "a.parquet"]
    )
    # re-sharded: the same rows cut into five files of other sizes
    resharded = _write_parquet(
        tmp_path / "reshard", rows, [7, 300, 301, 999], [f"s{i}.parquet" for i in range(5)]
    )
    # moved: the original folder copied elsewhere, opened under its new root
    shutil.copytree(tmp_path / "orig", tmp_path / "moved")
    moved = TableRows(original.manifest.with_root(str(tmp_path / "moved")))
    assert reordered.num_samples == resharded.num_samples == ROWS
    splits = [Split(d, fraction="1/20", salt=SALT) for d in (original, reordered, resharded, moved)]
    contents = [_val_contents(s) for s in splits]
    assert contents[0] and all(c == contents[0] for c in contents)
    assert len({s.validation_keys for s in splits}) == 1
    # ids: the moved copy keeps them, the re-ordered one renumbers them
    assert splits[3].assignment == splits[0].assignment
    assert splits[1].assignment != splits[0].assignment
    # id keying is not stable under re-ordering (documented): other contents
    by_id = [Split(d, fraction="1/20", salt=SALT, key="id") for d in (original, reordered, moved)]
    assert _val_contents(by_id[0]) == _val_contents(by_id[2])
    assert _val_contents(by_id[0]) != _val_contents(by_id[1])


def _token_copy(root: Path, stream: np.ndarray, lengths: list[int], names: list[str]) -> None:
    root.mkdir(parents=True)
    start = 0
    for name, n in zip(names, lengths, strict=True):
        np.save(root / name, stream[start : start + n])
        start += n


def test_token_windows_split_is_stable_when_reordered_resharded_and_moved(tmp_path: Path) -> None:
    seq = 8
    rng = np.random.default_rng(0)
    stream = rng.integers(0, 50_000, size=seq * 600).astype(np.uint16)
    _token_copy(tmp_path / "orig", stream, [seq * 200, seq * 400], ["a.npy", "b.npy"])
    # re-sharded: window-aligned cuts (same windows, other files)
    _token_copy(
        tmp_path / "reshard",
        stream,
        [seq * 50, seq * 333, seq * 217],
        ["x0.npy", "x1.npy", "x2.npy"],
    )
    # re-ordered: the second half first in path order
    _token_copy(
        tmp_path / "reord",
        np.concatenate([stream[seq * 200 :], stream[: seq * 200]]),
        [seq * 400, seq * 200],
        ["a.npy", "b.npy"],
    )
    shutil.copytree(tmp_path / "orig", tmp_path / "moved")
    datasets = [
        TokenWindows(build_manifest(str(tmp_path / n)), seq, labels=False)
        for n in ("orig", "reshard", "reord")
    ]
    datasets.append(
        TokenWindows(datasets[0].manifest.with_root(str(tmp_path / "moved")), seq, labels=False)
    )
    fraction = Fraction(3, 100)
    splits = [Split(d, fraction=fraction, salt=SALT) for d in datasets]
    # reference: every window of the token stream, keyed by hand
    windows = stream.reshape(-1, seq)
    out_dtype = datasets[0].read(np.array([0]))["tokens"].dtype
    ref = {
        w.tobytes()
        for w in windows
        if _ref_is_val(_ref_key({"tokens": _nd(w.astype(out_dtype))}), SALT, fraction)
    }
    for s in splits:
        got = s.validation.read(np.arange(s.validation.num_samples))["tokens"]
        assert {row.astype(np.uint16).tobytes() for row in got} == ref
    assert len({s.validation_keys for s in splits}) == 1


def test_cache_is_used_and_checked(tmp_path: Path) -> None:
    ds = _write_parquet(tmp_path / "a", _rows(), [700], ["p0.parquet", "p1.parquet"])
    cache = tmp_path / "cache"
    first = Split(ds, fraction="1/10", salt=SALT, cache_dir=cache)
    (path,) = cache.iterdir()

    class Counting:
        def __init__(self) -> None:
            self.reads = 0

        @property
        def num_samples(self) -> int:
            return ds.num_samples

        def read(self, ids: Any) -> Any:
            self.reads += 1
            return ds.read(ids)

        def identity(self) -> dict[str, Any]:
            return ds.identity()

    counting = Counting()
    again = Split(counting, fraction="1/10", salt=SALT, cache_dir=cache)
    assert counting.reads == 0
    assert again.assignment == first.assignment
    assert again.validation.ids.tolist() == first.validation.ids.tolist()
    path.write_text(path.read_text().replace('"validation_ids":[', '"validation_ids":[1,'))
    rebuilt = Split(counting, fraction="1/10", salt=SALT, cache_dir=cache)
    assert counting.reads > 0 and rebuilt.assignment == first.assignment


def test_a_loader_over_a_side_checks_the_rule(tmp_path: Path) -> None:
    ds = _write_parquet(tmp_path / "a", _rows(), [700], ["p0.parquet", "p1.parquet"])
    train = Split(ds, fraction="1/10", salt=SALT).train
    loader = DataLoader(train, global_batch_size=4, seed=1)
    assert "split-v1" in loader.state_dict()["algorithm"]
    other = DataLoader(Split(ds, fraction="1/10", salt="other").train, global_batch_size=4, seed=1)
    with pytest.raises(StateError, match="data"):
        other.load_state_dict(loader.state_dict())


@pytest.mark.parametrize("bad", [0, 1, "1/0", "abc", Fraction(3, 2), True, None])
def test_bad_fractions_are_refused(bad: Any, tmp_path: Path) -> None:
    ds = _write_parquet(tmp_path / "a", _rows()[:10], [], ["p0.parquet"])
    with pytest.raises(ConfigError, match="fraction"):
        Split(ds, fraction=bad, salt=SALT)


def test_a_float_fraction_is_its_decimal() -> None:
    from detdata.datasets.split import check_fraction

    assert check_fraction(0.01) == Fraction(1, 100)
    assert check_fraction("0.25") == Fraction(1, 4)
