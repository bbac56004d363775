"""TokenWindows over real .npy / .bin token shards (local and a non-local fsspec root).

Covers: detdata/datasets/shard_files.py, detdata/datasets/shard_windows.py,
  detdata/datasets/window_layout.py.
"""

from __future__ import annotations

import itertools
import multiprocessing as mp
import pickle
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import fsspec
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from detdata import Storage
from detdata.base.errors import ConfigError, FormatError
from detdata.datasets.base import Dataset
from detdata.datasets.tokens import TokenWindows
from detdata.identity.build import build_manifest
from detdata.identity.manifest import Manifest

SEQ = 7
LENGTHS = (101, 57, 8, 200)  # 8 tokens = exactly one labelled window of 7


def random_tokens(rng: np.random.Generator, dtype: str, n: int) -> np.ndarray:
    info = np.iinfo(dtype)
    lo = max(int(info.min), -(2**40))
    hi = min(int(info.max), 2**40)
    if dtype == "uint32":
        lo = 2**31  # values that do not fit int32: widening to int64 must keep them
    return rng.integers(lo, hi, size=n, endpoint=True).astype(dtype)


def write_npy_shards(
    root: Path, dtype: str, lengths: tuple[int, ...], seed: int = 0
) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    root.mkdir(parents=True, exist_ok=True)
    arrays = [random_tokens(rng, dtype, n) for n in lengths]
    for i, arr in enumerate(arrays):
        np.save(root / f"shard-{i:02d}.npy", arr)
    return arrays


def reference_windows(arrays: list[np.ndarray], seq_len: int, labels: bool) -> list[np.ndarray]:
    """Per-sample slicing of the original arrays, shard by shard in path order."""
    width = seq_len + int(labels)
    out = []
    for arr in arrays:
        w = 0
        while w * seq_len + width <= len(arr):
            out.append(arr[w * seq_len : w * seq_len + width])
            w += 1
    return out


@pytest.fixture(scope="module", params=["uint16", "uint32", "int32", "int64"])
def npy_data(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> tuple[TokenWindows, list[np.ndarray]]:
    dtype = request.param
    root = tmp_path_factory.mktemp(f"npy-{dtype}")
    arrays = write_npy_shards(root, dtype, LENGTHS, seed=len(dtype))
    return TokenWindows(build_manifest(str(root)), SEQ), arrays


EXPECTED_OUT = {"uint16": "int32", "uint32": "int64", "int32": "int32", "int64": "int64"}

ids_lists = st.lists(st.integers(0, 10**6), min_size=0, max_size=70)


@settings(max_examples=40, deadline=None)
@given(raw=ids_lists)
def test_read_matches_per_sample_reference(
    npy_data: tuple[TokenWindows, list[np.ndarray]], raw: list[int]
) -> None:
    ds, arrays = npy_data
    ref = reference_windows(arrays, SEQ, labels=True)
    ids = np.asarray(raw, dtype=np.int64) % ds.num_samples
    got = ds.read(ids)["tokens"]
    assert got.shape == (len(raw), SEQ + 1)
    assert got.dtype == np.dtype(EXPECTED_OUT[arrays[0].dtype.name])
    expected = np.stack([ref[i] for i in ids]) if len(ids) else np.empty((0, SEQ + 1))
    np.testing.assert_array_equal(got, expected.astype(np.int64))


def test_counts_and_identity(npy_data: tuple[TokenWindows, list[np.ndarray]]) -> None:
    ds, arrays = npy_data
    assert ds.windows_per_shard == tuple((n - 1) // SEQ for n in LENGTHS)
    assert ds.num_samples == len(reference_windows(arrays, SEQ, labels=True))
    assert isinstance(ds, Dataset)
    ident = ds.identity()
    assert ident == {
        "type": "token_windows",
        "manifest": ds.manifest.id,
        "seq_len": SEQ,
        "labels": True,
        "out_dtype": EXPECTED_OUT[arrays[0].dtype.name],
        "num_samples": ds.num_samples,
    }


def test_duplicates_and_reverse_order(npy_data: tuple[TokenWindows, list[np.ndarray]]) -> None:
    ds, arrays = npy_data
    ref = reference_windows(arrays, SEQ, labels=True)
    ids = np.concatenate([np.arange(ds.num_samples)[::-1], [3, 3, 3, 0, ds.num_samples - 1]])
    got = ds.read(ids)["tokens"]
    for row, i in zip(got, ids, strict=True):
        np.testing.assert_array_equal(row, ref[i])


@pytest.mark.parametrize("labels", [True, False])
def test_windows_never_cross_shards(tmp_path: Path, labels: bool) -> None:
    # shard k holds k * 10_000 + arange(n): a window is one contiguous run inside one shard
    lengths = (50, 15, 9, 33)
    for k, n in enumerate(lengths):
        np.save(tmp_path / f"s{k}.npy", (k * 10_000 + np.arange(n)).astype(np.int32))
    ds = TokenWindows(build_manifest(str(tmp_path)), 8, labels=labels)
    width = 8 + int(labels)
    assert ds.windows_per_shard == tuple((n - int(labels)) // 8 for n in lengths)
    ids = np.arange(ds.num_samples)
    rows = ds.read(ids)["tokens"]
    shard, window = ds.locate(ids)
    np.testing.assert_array_equal(rows[:, 0], shard * 10_000 + window * 8)
    np.testing.assert_array_equal(np.diff(rows, axis=1), np.ones((len(ids), width - 1)))
    last_token = rows[:, -1] - shard * 10_000
    assert np.all(last_token < np.asarray(lengths)[shard])


def test_bin_shards_with_dtype(tmp_path: Path) -> None:
    rng = np.random.default_rng(5)
    arrays = [random_tokens(rng, "uint16", n) for n in (64, 99)]
    for i, arr in enumerate(arrays):
        arr.tofile(tmp_path / f"part{i}.bin")
    ds = TokenWindows(build_manifest(str(tmp_path), dtype="uint16"), 16, labels=False)
    ref = reference_windows(arrays, 16, labels=False)
    assert ds.num_samples == 64 // 16 + 99 // 16 == len(ref)
    ids = rng.integers(0, ds.num_samples, size=40)
    np.testing.assert_array_equal(ds.read(ids)["tokens"], np.stack([ref[i] for i in ids]))


def test_mixed_dtypes_widen_to_common_type(tmp_path: Path) -> None:
    np.save(tmp_path / "a.npy", np.arange(20, dtype=np.uint16))
    np.save(tmp_path / "b.npy", np.arange(20, dtype=np.uint32) + 2**31)
    ds = TokenWindows(build_manifest(str(tmp_path)), 9)
    out = ds.read(np.array([2, 0]))["tokens"]
    assert out.dtype == np.int64
    np.testing.assert_array_equal(out[0], np.arange(10) + 2**31)  # a.npy holds 2 windows
    np.testing.assert_array_equal(out[1], np.arange(10))


def test_out_dtype_explicit_and_range_checked(tmp_path: Path) -> None:
    np.save(tmp_path / "a.npy", np.array([1, 2, 3, 70_000, 5], dtype=np.int64))
    manifest = build_manifest(str(tmp_path))
    wide = TokenWindows(manifest, 2, out_dtype="int64")
    assert wide.read(np.array([0]))["tokens"].dtype == np.int64
    narrow = TokenWindows(manifest, 2, out_dtype="uint16")
    np.testing.assert_array_equal(narrow.read(np.array([0]))["tokens"], [[1, 2, 3]])
    with pytest.raises(FormatError, match=r"a\.npy.*70000.*uint16"):
        narrow.read(np.array([1]))
    with pytest.raises(ConfigError, match="integer"):
        TokenWindows(manifest, 2, out_dtype="float32")


def test_short_shard_is_an_error_naming_it(tmp_path: Path) -> None:
    np.save(tmp_path / "long.npy", np.arange(100, dtype=np.int32))
    np.save(tmp_path / "tiny.npy", np.arange(8, dtype=np.int32))
    manifest = build_manifest(str(tmp_path))
    with pytest.raises(FormatError, match=r"tiny\.npy.*8 tokens.*seq_len=8.*allow_short_shards"):
        TokenWindows(manifest, 8)
    ds = TokenWindows(manifest, 8, allow_short_shards=True)
    assert ds.windows_per_shard == (12, 0)
    shard, _ = ds.locate(np.arange(ds.num_samples))
    assert set(shard.tolist()) == {0}
    # without labels 8 tokens make exactly one window
    assert TokenWindows(manifest, 8, labels=False).windows_per_shard == (12, 1)


def test_zero_window_shard_in_the_middle_is_skipped(tmp_path: Path) -> None:
    for name, n in (("a", 20), ("b", 3), ("c", 20)):
        np.save(tmp_path / f"{name}.npy", (ord(name) * 1000 + np.arange(n)).astype(np.int32))
    ds = TokenWindows(build_manifest(str(tmp_path)), 4, allow_short_shards=True)
    assert ds.windows_per_shard == (4, 0, 4)
    rows = ds.read(np.arange(8))["tokens"]
    assert np.all(rows[:4] // 1000 == ord("a")) and np.all(rows[4:] // 1000 == ord("c"))


def test_empty_dataset_is_an_error(tmp_path: Path) -> None:
    np.save(tmp_path / "a.npy", np.arange(5, dtype=np.int32))
    with pytest.raises(ConfigError, match="empty"):
        TokenWindows(build_manifest(str(tmp_path)), 8, allow_short_shards=True)
    empty = Manifest(shards=(), root=str(tmp_path))
    with pytest.raises(ConfigError, match="no shards"):
        TokenWindows(empty, 8)


@pytest.mark.parametrize("bad", [[-1], [10**9], [[0, 1]], [0.5]])
def test_bad_ids_are_config_errors(
    npy_data: tuple[TokenWindows, list[np.ndarray]], bad: Any
) -> None:
    ds, _ = npy_data
    with pytest.raises(ConfigError):
        ds.read(np.asarray(bad))
    with pytest.raises(ConfigError):
        ds.locate(np.asarray(bad))


def test_bad_arguments(tmp_path: Path) -> None:
    np.save(tmp_path / "a.npy", np.arange(50, dtype=np.int32))
    manifest = build_manifest(str(tmp_path))
    for seq_len in (0, -3, True, 2.5):
        with pytest.raises(ConfigError, match="seq_len"):
            TokenWindows(manifest, seq_len)  # type: ignore[arg-type]


def test_table_shards_are_refused(tmp_path: Path) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"x": [1, 2, 3]}), tmp_path / "t.parquet")
    with pytest.raises(FormatError, match=r"t\.parquet.*TableRows"):
        TokenWindows(build_manifest(str(tmp_path)), 2)


def test_empty_ids_give_an_empty_batch(npy_data: tuple[TokenWindows, list[np.ndarray]]) -> None:
    ds, _ = npy_data
    out = ds.read(np.array([], dtype=np.int64))["tokens"]
    assert out.shape == (0, SEQ + 1)


def test_pickle_after_use_is_small_and_reads(tmp_path: Path) -> None:
    arrays = write_npy_shards(tmp_path, "int32", (40_000, 30_000))
    ds = TokenWindows(build_manifest(str(tmp_path)), 64)
    ids = np.array([5, 900, 2, 700, 5])
    before = ds.read(ids)["tokens"]
    blob = pickle.dumps(ds)
    assert len(blob) < 4096 < sum(a.nbytes for a in arrays) // 10
    clone = pickle.loads(blob)
    np.testing.assert_array_equal(clone.read(ids)["tokens"], before)
    assert clone.identity() == ds.identity()


def _child(ds: TokenWindows, ids: np.ndarray, queue: Any) -> None:
    queue.put((ds.read(ids)["tokens"], sorted(ds.files.open_shards())))


def test_forked_worker_reopens_memmaps(tmp_path: Path) -> None:
    write_npy_shards(tmp_path, "uint16", (500, 300))
    ds = TokenWindows(build_manifest(str(tmp_path)), 16)
    ds.read(np.array([0, 40]))  # memmaps of both shards now open in the parent
    assert sorted(ds.files.open_shards()) == [0, 1]
    ids = np.array([40, 33, 35, 33])  # all in shard 1 (shard 0 holds 31 windows)
    ctx = mp.get_context("fork")
    queue = ctx.Queue()
    proc = ctx.Process(target=_child, args=(ds, ids, queue))  # inherited, not pickled
    proc.start()
    got, child_views = queue.get(timeout=30)
    proc.join(timeout=30)
    np.testing.assert_array_equal(got, ds.read(ids)["tokens"])
    assert child_views == [1]  # the child dropped the inherited maps and opened only shard 1


@pytest.fixture
def memory_root() -> Iterator[str]:
    name = f"/detdata-tokens-{uuid.uuid4().hex}"
    fs = fsspec.filesystem("memory")
    yield f"memory://{name}"
    if fs.exists(name):
        fs.rm(name, recursive=True)


@pytest.fixture(scope="module")
def pair(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[TokenWindows, TokenWindows]]:
    """One local dataset and the same bytes under a memory:// (non-local fsspec) root."""
    root = tmp_path_factory.mktemp("pair")
    write_npy_shards(root, "uint16", (90, 41, 300), seed=9)
    (root / "raw.bin").write_bytes(np.arange(77, dtype=np.uint16).tobytes())
    local = TokenWindows(build_manifest(str(root), dtype="uint16"), 10)
    fs = fsspec.filesystem("memory")
    mem = f"/detdata-tokens-{uuid.uuid4().hex}"
    for path in sorted(root.iterdir()):
        fs.pipe(f"{mem}/{path.name}", path.read_bytes())
    remote_manifest = build_manifest(f"memory://{mem}", dtype="uint16")
    assert remote_manifest.id == local.manifest.id
    yield (
        local,
        TokenWindows(remote_manifest, 10, storage=Storage(cache_dir=None)),
    )  # range reads, no cache
    fs.rm(mem, recursive=True)


@settings(max_examples=15, deadline=None)
@given(raw=ids_lists)
def test_remote_root_matches_local(pair: tuple[TokenWindows, TokenWindows], raw: list[int]) -> None:
    local, remote = pair
    assert remote.num_samples == local.num_samples == 8 + 4 + 29 + 7
    ids = np.asarray(raw, dtype=np.int64) % local.num_samples
    np.testing.assert_array_equal(remote.read(ids)["tokens"], local.read(ids)["tokens"])


def test_remote_reads_are_one_cat_ranges_call(
    pair: tuple[TokenWindows, TokenWindows], monkeypatch: pytest.MonkeyPatch
) -> None:
    local, remote = pair
    calls: list[int] = []
    fs = fsspec.filesystem("memory")
    original = type(fs).cat_ranges

    def counting(self: Any, paths: list[str], *args: Any, **kwargs: Any) -> Any:
        calls.append(len(paths))
        return original(self, paths, *args, **kwargs)

    monkeypatch.setattr(type(fs), "cat_ranges", counting)
    ids = np.array([0, 40, 3, 3, 39, 12, 0])
    np.testing.assert_array_equal(remote.read(ids)["tokens"], local.read(ids)["tokens"])
    # one call; duplicates fetched once and overlapping windows (39 and 40 share a token)
    # merged into one range, so fewer ranges than distinct ids
    assert len(calls) == 1 and calls[0] < len(set(ids.tolist()))


def test_remote_pickle_round_trip(memory_root: str) -> None:
    fs = fsspec.filesystem("memory")
    tokens = np.arange(1000, dtype=np.int32)
    fs.pipe(f"{memory_root[len('memory://') :]}/a.npy", _npy_bytes(tokens))
    ds = TokenWindows(build_manifest(memory_root), 100)
    ids = np.array([8, 0, 4])
    clone = pickle.loads(pickle.dumps(ds))
    np.testing.assert_array_equal(
        clone.read(ids)["tokens"], np.stack([tokens[i * 100 : i * 100 + 101] for i in ids])
    )


def _npy_bytes(arr: np.ndarray) -> bytes:
    import io

    buf = io.BytesIO()
    np.save(buf, arr)
    return buf.getvalue()


@pytest.fixture(scope="module")
def mixed_data(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[np.ndarray]]:
    """Shards of different dtypes in one manifest (uint16, int64, int32, uint16)."""
    root = tmp_path_factory.mktemp("npy-mixed")
    rng = np.random.default_rng(11)
    arrays = [
        rng.integers(0, 60_000, size=n).astype(dt)
        for n, dt in zip((90, 41, 64, 150), ("uint16", "int64", "int32", "uint16"), strict=True)
    ]
    for i, arr in enumerate(arrays):
        np.save(root / f"m-{i}.npy", arr)
    return root, arrays


@settings(max_examples=40, deadline=None)
@given(raw=ids_lists, out_dtype=st.sampled_from([None, "int32", "int64", "uint16"]))
def test_mixed_dtype_shards_match_reference(
    mixed_data: tuple[Path, list[np.ndarray]], raw: list[int], out_dtype: str | None
) -> None:
    root, arrays = mixed_data
    ds = TokenWindows(build_manifest(str(root)), SEQ, out_dtype=out_dtype)
    ref = reference_windows(arrays, SEQ, labels=True)
    ids = np.asarray(raw, dtype=np.int64) % ds.num_samples
    got = ds.read(ids)["tokens"]
    assert got.dtype == np.dtype(out_dtype or "int64") and got.shape == (len(raw), SEQ + 1)
    assert got.flags.c_contiguous and got.flags.writeable
    for row, i in zip(got, ids.tolist(), strict=True):
        np.testing.assert_array_equal(row, ref[i])


def test_single_shard_batches_and_whole_dataset(
    npy_data: tuple[TokenWindows, list[np.ndarray]],
) -> None:
    ds, arrays = npy_data
    ref = np.stack(reference_windows(arrays, SEQ, labels=True))
    starts = np.concatenate([[0], np.cumsum(ds.windows_per_shard)])
    for a, b in itertools.pairwise(starts.tolist()):
        ids = np.arange(a, b)[::-1].copy()  # one shard, reversed, then with duplicates
        for batch in (ids, np.concatenate([ids, ids[:3]])):
            got = ds.read(batch)["tokens"]
            assert got.dtype == np.dtype(EXPECTED_OUT[arrays[0].dtype.name]) and got.flags.owndata
            np.testing.assert_array_equal(got, ref[batch])
    every = np.random.default_rng(3).permutation(ds.num_samples)
    np.testing.assert_array_equal(ds.read(every)["tokens"], ref[every])
    np.testing.assert_array_equal(ds.read(every.astype(np.uint32))["tokens"], ref[every])


@pytest.mark.parametrize("max_open", [None, 1])  # 1: most shards read by preadv, not mapped
def test_narrowing_check_names_the_first_offending_shard(
    tmp_path: Path, max_open: int | None
) -> None:
    np.save(tmp_path / "a.npy", np.array([1, 2, 3, 4, 5], dtype=np.int64))
    np.save(tmp_path / "b.npy", np.array([6, 7, 70_000, 9, 10], dtype=np.int64))
    np.save(tmp_path / "c.npy", np.array([11, -1, 13, 14, 15], dtype=np.int64))
    np.save(tmp_path / "d.npy", np.array([16, 17, 18, 19, 20], dtype=np.uint16))
    narrow = TokenWindows(
        build_manifest(str(tmp_path)),
        2,
        out_dtype="uint16",
        storage=Storage(max_open_shards=max_open),
    )
    # windows: a 0-1, b 2-3, c 4-5, d 6-7
    np.testing.assert_array_equal(
        narrow.read(np.array([7, 0, 6, 1]))["tokens"],
        [[18, 19, 20], [1, 2, 3], [16, 17, 18], [3, 4, 5]],
    )
    for ids, shard, values in (
        ([4, 2], "b", r"\[6, 70000\]"),
        ([5, 3, 0], "b", r"\[9, 70000\]"),
        ([4, 7, 0], "c", r"\[-1, 13\]"),
        ([4], "c", r"\[-1, 13\]"),
        ([3], "b", r"\[9, 70000\]"),
    ):
        with pytest.raises(FormatError, match=rf"{shard}\.npy.*{values}.*uint16"):
            narrow.read(np.array(ids))
    np.testing.assert_array_equal(
        narrow.read(np.array([5, 6]))["tokens"], [[13, 14, 15], [16, 17, 18]]
    )
    with pytest.raises(ConfigError, match=r"ids must be in \[0, 8\)"):
        narrow.read(np.array([8, 0]))
    with pytest.raises(ConfigError, match="1-D integer"):
        narrow.read(np.array([0.0]))
    assert narrow.read(np.array([], dtype=np.int64))["tokens"].shape == (0, 3)


# --------------------------------------------------------- shard truncated during a run
_TRUNCATE_CHILD = r"""
import json, os, sys
import fsspec
import numpy as np
from detdata import Storage, TokenWindows, VerificationError, build_manifest

root, case = sys.argv[1], sys.argv[2]
seq = 16
if case == "cached":
    fs = fsspec.filesystem("memory")
    for name in sorted(os.listdir(root)):
        with open(os.path.join(root, name), "rb") as fh:
            fs.pipe_file(f"/trunc/{name}", fh.read())
    ds = TokenWindows(
        build_manifest("memory://trunc"),
        seq,
        storage=Storage(cache_dir=os.path.join(root, "..", "c")),
    )
else:
    bound = 1 if case.startswith("pread") else None
    ds = TokenWindows(build_manifest(root), seq, storage=Storage(max_open_shards=bound))
victim = ds.manifest.shards[1]
last = ds.windows_per_shard[0] + ds.windows_per_shard[1] - 1   # the last window of shard 1
ids = {"single": [last, last - 1], "multi": [0, last, 1], "before-first-read": [last],
       "cached": [last, 2], "pread": [0, last], "pread-dense": [0, last - 1, last]}[case]
if case.startswith("pread"):  # shard 0 holds the only handle: shard 1 is read by preadv
    ds.read(np.asarray([0]))
first = None
if case != "before-first-read":
    first = ds.read(np.asarray(ids))["tokens"].tolist()
path = (ds.files.shard_cache.object_path(victim) if case == "cached"
        else os.path.join(root, victim.path))
os.truncate(path, 4096)
try:
    ds.read(np.asarray(ids))
    out = {"outcome": "no error"}
except VerificationError as exc:
    out = {"outcome": "VerificationError", "message": str(exc), "shard": exc.shard,
           "expected": exc.expected, "found": exc.found}
out["first"], out["ids"], out["size"] = first, ids, victim.bytes
print(json.dumps(out))
"""


@pytest.mark.multiproc
@pytest.mark.parametrize(
    "case", ["single", "multi", "before-first-read", "cached", "pread", "pread-dense"]
)
def test_shard_truncated_during_a_run_is_a_named_error_not_sigbus(
    tmp_path: Path, case: str
) -> None:
    """A memory-mapped shard truncated between two reads: the next read raises a
    `VerificationError` naming the shard, expected and found sizes. Run in a child process,
    so a SIGBUS (what touching the mapping past the new end does) fails this test instead of
    killing pytest."""
    import json
    import os
    import subprocess
    import sys

    import detdata

    root = tmp_path / "data"
    arrays = write_npy_shards(root, "uint16", (3000, 60_000, 2000), seed=5)
    repo = Path(detdata.__file__).resolve().parent.parent  # the detdata this test imported
    env = {**os.environ, "PYTHONPATH": str(repo)}
    proc = subprocess.run(
        [sys.executable, "-c", _TRUNCATE_CHILD, str(root), case],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, (f"child died with {proc.returncode} (-7 is SIGBUS)", proc.stderr)
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    if out["first"] is not None:  # the read before the truncation delivered the written tokens
        windows = [(s, w) for s, a in enumerate(arrays) for w in range((a.size - 1) // 16)]
        want = [
            arrays[s][w * 16 : w * 16 + 17].tolist() for s, w in (windows[i] for i in out["ids"])
        ]
        assert out["first"] == want
    assert out["outcome"] == "VerificationError", out
    name = "shard-01.npy"
    assert out["shard"] == name and out["expected"] == out["size"] and out["found"] == 4096
    assert name in out["message"] and "truncated" in out["message"] and "hint:" in out["message"]
    assert f"{out['size']} bytes" in out["message"] and "4096" in out["message"]


@pytest.mark.parametrize("max_open", [None, 1])  # 1: shard 1 would be read by preadv
def test_shard_deleted_after_opening_is_a_named_error(tmp_path: Path, max_open: int | None) -> None:
    from detdata.base.errors import VerificationError

    arrays = write_npy_shards(tmp_path / "data", "uint16", (300, 400), seed=2)
    ds = TokenWindows(
        build_manifest(str(tmp_path / "data")), SEQ, storage=Storage(max_open_shards=max_open)
    )
    np.testing.assert_array_equal(ds.read(np.array([0]))["tokens"][0], arrays[0][: SEQ + 1])
    (tmp_path / "data" / "shard-01.npy").unlink()
    with pytest.raises(VerificationError, match=r"shard-01\.npy.*missing.*hint:") as info:
        ds.read(np.array([ds.num_samples - 1]))
    assert info.value.shard == "shard-01.npy" and info.value.field == "exists"


# --------------------------------------------------------- bounded handles (max_open_shards)
@settings(max_examples=40, deadline=None)
@given(raw=ids_lists, out_dtype=st.sampled_from([None, "int32", "int64"]), cap=st.integers(1, 3))
def test_reads_with_few_open_shards_match_reference(
    mixed_data: tuple[Path, list[np.ndarray]], raw: list[int], out_dtype: str | None, cap: int
) -> None:
    """Mapped, mapped-then-evicted and preadv reads (casting, mixed dtypes) deliver the
    writer's windows; never more than ``cap`` shards stay open."""
    root, arrays = mixed_data
    ds = TokenWindows(
        build_manifest(str(root)), SEQ, out_dtype=out_dtype, storage=Storage(max_open_shards=cap)
    )
    ref = reference_windows(arrays, SEQ, labels=True)
    for ids in (np.asarray(raw, dtype=np.int64) % ds.num_samples, np.arange(ds.num_samples)):
        got = ds.read(ids)["tokens"]
        assert got.dtype == np.dtype(out_dtype or "int64") and got.shape == (ids.size, SEQ + 1)
        for row, i in zip(got, ids.tolist(), strict=True):
            np.testing.assert_array_equal(row, ref[i])
        assert len(ds.files.open_shards()) <= cap


def test_many_shards_keep_only_the_bound_open_and_reopen_after_eviction(tmp_path: Path) -> None:
    arrays = write_npy_shards(tmp_path, "int32", [SEQ * (1 + i % 20) + 1 for i in range(60)])
    ds = TokenWindows(build_manifest(str(tmp_path)), SEQ, storage=Storage(max_open_shards=4))
    ref = np.stack(reference_windows(arrays, SEQ, labels=True))
    rng = np.random.default_rng(4)
    for _ in range(30):
        ids = np.sort(rng.integers(0, ds.num_samples, size=rng.integers(1, 200)))
        np.testing.assert_array_equal(ds.read(ids)["tokens"], ref[ids])
        assert len(ds.files.open_shards()) <= 4 and not ds.files.local().copies
    assert ds.files.local().handles.evictions > 0
    every = rng.permutation(ds.num_samples)
    np.testing.assert_array_equal(ds.read(every)["tokens"], ref[every])


@settings(max_examples=30, deadline=None)
@given(raw=ids_lists, cap=st.integers(1, 3))
def test_uniform_dtype_reads_with_few_open_shards_match_reference(
    npy_data: tuple[TokenWindows, list[np.ndarray]], raw: list[int], cap: int
) -> None:
    """One disk dtype: covered windows of several shards go through one staging buffer."""
    ds, arrays = npy_data
    bounded = TokenWindows(ds.manifest, SEQ, storage=Storage(max_open_shards=cap))
    ref = np.stack(reference_windows(arrays, SEQ, labels=True))
    base = np.asarray(raw, dtype=np.int64) % ds.num_samples
    for ids in (base, np.sort(base), np.arange(ds.num_samples)[::-1]):
        got = bounded.read(ids)["tokens"]
        assert got.dtype == np.dtype(EXPECTED_OUT[arrays[0].dtype.name])
        np.testing.assert_array_equal(got, ref[ids])
        assert len(bounded.files.open_shards()) <= cap
