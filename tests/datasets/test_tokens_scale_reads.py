"""Many small shards read without mapping: the vectorised staged and direct ``preadv`` paths.

When the handle LRU is full, `TokenWindows` reads the windows of a shard that is not open
with one ``preadv`` of their covering range, either into one staging buffer per batch
(`_read_staged`) or, for runs of consecutive windows stored as delivered, straight into the
rows of the result (`_read_direct`). Every test compares the
delivered rows with a brute-force reference built from ``np.load`` of each shard file, and
checks (by counting calls) that the path it is about was taken.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import detdata.storage.reads as reads_module
from detdata import Storage
from detdata.base.errors import StorageError, VerificationError
from detdata.datasets.tokens import TokenWindows
from detdata.identity.build import build_manifest

SEQ = 8
#: tokens per shard: most hold a few windows and a partial tail; a few hold many windows
#: (the dense ones are read with one covering range of more than 256 windows: staged).
LENGTHS = tuple(
    SEQ * 400 + 5 if s % 13 == 0 else SEQ * (1 + s % 6) + (s % 5) + 1 for s in range(48)
)


def write(root: Path, dtype: str, lengths: tuple[int, ...] = LENGTHS) -> list[Path]:
    """``.npy`` shards of random tokens of ``dtype`` under ``root`` (two folders)."""
    rng = np.random.default_rng(len(lengths) + len(dtype))
    info = np.iinfo(dtype)
    paths = []
    for s, n in enumerate(lengths):
        sub = root / f"d{s % 2}"
        sub.mkdir(parents=True, exist_ok=True)
        lo, hi = max(int(info.min), -(2**40)), min(int(info.max), 2**40)
        path = sub / f"s{s:03d}.npy"
        np.save(path, rng.integers(lo, hi, size=n, endpoint=True).astype(dtype))
        paths.append(path)
    return paths


def reference(root: Path, labels: bool) -> np.ndarray:
    """Every window in id order, read back with ``np.load`` (the manifest's path order)."""
    files = sorted(str(p.relative_to(root)) for p in root.rglob("*.npy"))
    width = SEQ + int(labels)
    rows = []
    for name in files:
        tokens = np.load(root / name)
        for w in range((tokens.size - int(labels)) // SEQ):
            rows.append(tokens[w * SEQ : w * SEQ + width])
    return np.stack(rows)


@pytest.fixture(scope="module", params=["int32", "uint16", "int64"])
def corpus(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> tuple[Path, str]:
    root = tmp_path_factory.mktemp(f"scale-{request.param}")
    write(root, request.param)
    manifest = str(root.parent / f"{root.name}.json")
    build_manifest(str(root)).save(manifest)
    return root, manifest


@contextmanager
def counting(ds: object, *names: str) -> Iterator[dict[str, int]]:
    """Count calls of the reader methods ``names`` on ``ds`` (they still run)."""
    calls = dict.fromkeys(names, 0)

    def wrap(name: str) -> Callable[..., Any]:
        inner = getattr(ds, name)

        def counted(*args: Any, **kwargs: Any) -> Any:
            calls[name] += 1
            return inner(*args, **kwargs)

        return counted

    for name in names:
        setattr(ds, name, wrap(name))
    try:
        yield calls
    finally:
        for name in names:
            delattr(ds, name)


def poisoned_read(ds: TokenWindows, ids: np.ndarray) -> np.ndarray:
    """``ds.read(ids)["tokens"]`` right after freeing a block of its size full of -7, so a
    row byte the read leaves unwritten likely shows as -7 rather than as a stale copy of
    the same bytes from an earlier read (``np.empty`` reuses freed memory)."""
    junk = np.full((ids.size, ds.window), -7, dtype=ds.out_dtype)
    del junk
    got: np.ndarray = ds.read(ids)["tokens"]
    return got


def fill_lru(ds: TokenWindows) -> None:
    """Map ``max_open_shards`` shards (the last ones), so the LRU is full."""
    starts = np.asarray(ds._layout.starts)
    for s in range(len(starts) - ds.storage.max_open_shards, len(starts)):
        ds.read(np.asarray([starts[s]]))
    assert ds.files.local().handles.full


ids_strategy = st.lists(st.integers(0, 10**6), min_size=2, max_size=300)


@settings(max_examples=60, deadline=None)
@given(raw=ids_strategy, labels=st.booleans(), cap=st.integers(1, 4), whole=st.booleans())
def test_reads_of_shards_not_open_match_np_load(
    corpus: tuple[Path, str], raw: list[int], labels: bool, cap: int, whole: bool
) -> None:
    """Any ids (duplicates, unsorted, partial last windows dropped) and, with ``whole``,
    every window of a few random shards (covered runs): the bytes of ``np.load``."""
    root, manifest = corpus
    ds = TokenWindows(
        manifest, SEQ, labels=labels, storage=Storage(verify="off", max_open_shards=cap)
    )
    ref = reference(root, labels)
    assert ds.num_samples == len(ref)
    fill_lru(ds)
    ids = np.asarray(raw, dtype=np.int64) % ds.num_samples
    if whole:  # every window (once) of a few shards, shuffled with the other ids
        starts = np.append(np.asarray(ds._layout.starts), ds.num_samples)
        shards = np.unique(np.asarray(raw[:3]) % len(LENGTHS))
        runs = [np.arange(starts[s], starts[s + 1]) for s in shards.tolist()]
        if len(raw) % 2:  # a duplicate hiding a gap: as many ids as the run's extent
            for run in runs:
                run[1:2] = run[:1]
        rest = ids[~np.isin(np.searchsorted(starts, ids, side="right") - 1, shards)]
        ids = np.random.default_rng(len(raw)).permutation(np.concatenate([rest, *runs]))
    with counting(ds._reads, "_read_staged", "_read_direct") as calls:
        got = poisoned_read(ds, ids)
    np.testing.assert_array_equal(got, ref[ids])
    assert got.dtype == np.dtype("int32" if ds._layout.disk[0].itemsize <= 4 else "int64")
    shard_of = np.searchsorted(np.asarray(ds._layout.starts), ids, side="right") - 1
    touched, times = np.unique(shard_of, return_counts=True)
    closed_once = set(touched[times == 1].tolist()) - set(range(len(LENGTHS) - cap, len(LENGTHS)))
    if touched.size > 1 and closed_once:  # one window of a shard not open: one preadv
        assert calls["_read_staged"] + calls["_read_direct"] >= 1
    assert len(ds.files.open_shards()) <= cap


@pytest.mark.parametrize("labels", [False, True])
def test_direct_reads_go_straight_into_the_result(corpus: tuple[Path, str], labels: bool) -> None:
    """``int32`` / ``int64`` shards (stored as delivered): whole runs of windows are read
    into the result rows (`_read_direct`; with labels, the shared label tokens copied
    after), longer, gappy or duplicated runs staged; both exact."""
    root, manifest = corpus
    ds = TokenWindows(
        manifest, SEQ, labels=labels, storage=Storage(verify="off", max_open_shards=2)
    )
    ref = reference(root, labels=labels)
    fill_lru(ds)
    starts = np.append(np.asarray(ds._layout.starts), ds.num_samples)
    rng = np.random.default_rng(3)
    every = rng.permutation(ds.num_samples)  # long runs (> 256 windows) staged
    counts = ds.windows_per_shard
    big = [s for s, c in enumerate(counts) if c >= 100]
    small = [s for s, c in enumerate(counts) if c < 100 and s not in ds.files.open_shards()][:11]
    assert len(big) >= 3 and len(small) == 11
    runs = np.concatenate([np.arange(starts[s], starts[s + 1]) for s in small])
    gappy = np.concatenate([np.arange(starts[s], starts[s + 1], 2) for s in big])
    dups = np.repeat(runs[:40], 2)
    four = [s for s in small if counts[s] >= 4][:3]
    assert four
    hidden = np.concatenate([starts[s] + np.asarray([0, 0, 2, 3]) for s in four])
    cases = {  # ids -> read straight into the result (with `_direct`), staged
        "every window, shuffled": (every, True, True),
        "whole small shards, shuffled": (rng.permutation(runs), True, False),
        "whole small shards, reversed": (runs[::-1], True, False),
        "every 2nd window of big shards": (gappy[::-1], False, True),
        "each window twice": (dups, False, True),
        "a duplicate hiding a gap": (hidden[::-1], False, True),
    }
    for name, (ids, direct, staged) in cases.items():
        with counting(ds._reads, "_read_staged", "_read_direct") as calls:
            got = poisoned_read(ds, ids)
        np.testing.assert_array_equal(got, ref[ids], err_msg=name)
        assert calls["_read_direct"] == int(direct and ds._layout.direct), name
        assert calls["_read_staged"] == int(staged or not ds._layout.direct), name
    assert ds._layout.direct == (ds._layout.disk[0] == ds.out_dtype)  # uint16 shards widen: staged


@pytest.mark.parametrize("labels", [False, True])
def test_a_shard_truncated_under_a_staged_or_direct_read_is_named(
    tmp_path: Path, labels: bool
) -> None:
    """A shard not open, truncated after the manifest was built: the read raises a
    `VerificationError` naming it, with expected and found sizes (not short rows)."""
    root = tmp_path / "data"
    write(root, "int32", tuple(SEQ * 6 + 1 for _ in range(10)))
    ref = reference(root, labels)
    ds = TokenWindows(
        build_manifest(str(root)), SEQ, labels=labels, storage=Storage(max_open_shards=1)
    )
    ds.read(np.asarray([ds.num_samples - 1]))  # the last shard holds the only handle
    victim = ds.manifest.shards[2]
    size = victim.bytes
    os.truncate(root / victim.path, size - 3 * SEQ * 4)  # windows 0-2 of shard 2 remain
    with pytest.raises(VerificationError, match=r"truncated") as info:
        ds.read(np.arange(6, 18)[::-1])  # shards 1 and 2, every window
    err = info.value
    assert err.shard == victim.path and err.expected == size
    assert err.found == size - 3 * SEQ * 4
    assert victim.path in str(err) and f"{size} bytes" in str(err) and "hint:" in str(err)
    with pytest.raises(VerificationError, match=r"truncated"):
        ds.read(np.asarray([12]))  # even a window within the bytes left: the shard changed
    ids = np.asarray([7, 24, 6, 59])  # other shards are still read exactly
    np.testing.assert_array_equal(ds.read(ids)["tokens"], ref[ids])


@pytest.mark.parametrize("labels", [False, True])
def test_a_shard_deleted_before_a_staged_or_direct_read_is_named(
    tmp_path: Path, labels: bool
) -> None:
    write(tmp_path / "data", "int32", tuple(SEQ * 3 + 1 for _ in range(6)))
    ds = TokenWindows(
        build_manifest(str(tmp_path / "data")),
        SEQ,
        labels=labels,
        storage=Storage(max_open_shards=1),
    )
    ds.read(np.asarray([ds.num_samples - 1]))
    victim = ds.manifest.shards[3]
    (tmp_path / "data" / victim.path).unlink()
    with pytest.raises(VerificationError, match=r"missing.*hint:") as info:
        ds.read(np.arange(0, 12)[::-1])
    assert info.value.shard == victim.path and info.value.field == "exists"


def test_a_short_read_of_a_file_that_is_not_shorter_is_a_storage_error(tmp_path: Path) -> None:
    """A ``preadv`` that reads short while the file still has its size: `StorageError`."""
    write(tmp_path / "data", "int32", tuple(SEQ * 3 for _ in range(6)))
    ds = TokenWindows(
        build_manifest(str(tmp_path / "data")),
        SEQ,
        labels=False,
        storage=Storage(max_open_shards=1),
    )
    ds.read(np.asarray([ds.num_samples - 1]))
    real = os.preadv

    def short(fd: int, buffers: list[Any], offset: int) -> int:
        return real(fd, buffers, offset) - 1

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(reads_module, "NATIVE", False)  # the Python loop's os.preadv is patched
        mp.setattr(os, "preadv", short)
        with pytest.raises(StorageError, match=r"short read.*hint:"):
            ds.read(np.arange(0, 9))
