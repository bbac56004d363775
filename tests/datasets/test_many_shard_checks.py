"""The open checks of many-shard reads (`TokenWindows` with its handle LRU full): every
shard opened by one batch is checked against the manifest's size and against the file
this process first opened for it, all at once after the batch's reads and before any byte
is returned (`ShardFiles.check_opened_arrays`). Every test over `opened` runs with each
read loop: the native one (`detdata.storage.fileread`, taken once every shard of a batch
was opened before; a spy proves it read) and the Python one.

References: the writer's own tokens (cut into windows here), and the shard each test
replaced, grew, truncated or deleted.
"""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import detdata.storage.reads as reads_module
from detdata import Storage
from detdata.base.errors import DetdataError, VerificationError
from detdata.datasets.tokens import TokenWindows
from detdata.identity.build import build_manifest
from detdata.storage import fileread

SEQ = 8
SHARDS = 40
WINDOWS = 4  # per shard


def _corpus(root: Path, dtype: str, labels: bool) -> np.ndarray:
    """``SHARDS`` shards of ``WINDOWS`` windows; returns every window in id order."""
    root.mkdir(parents=True)
    tokens_per = WINDOWS * SEQ + int(labels)
    out = []
    for s in range(SHARDS):
        tokens = (np.arange(tokens_per) + 1000 * s).astype(dtype)
        np.save(root / f"s{s:03d}.npy", tokens)
        for w in range(WINDOWS):
            out.append(tokens[w * SEQ : w * SEQ + SEQ + int(labels)].astype(np.int32))
    return np.stack(out)


def _replace(path: Path, tokens: np.ndarray) -> None:
    tmp = path.with_suffix(".tmp")
    with open(tmp, "wb") as fh:
        np.save(fh, tokens)
    os.replace(tmp, path)


def _rewrite_in_place(path: Path) -> None:
    """Other bytes at the same size and inode, with a later modification time."""
    data = bytearray(path.read_bytes())
    data[-1] ^= 0xFF
    st = os.stat(path)
    with open(path, "r+b") as fh:
        fh.write(bytes(data))
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns + 5_000_000_000))
    assert os.stat(path).st_ino == st.st_ino


@pytest.fixture(params=["native", "python"])
def loop(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """The read loop under test; returns the files each native call read (a spy)."""
    read: list[int] = []
    if request.param == "python":
        monkeypatch.setattr(reads_module, "NATIVE", False)
        return read
    assert fileread.NATIVE, "detdata.storage._fileread was not built (pip install -e .)"
    real = reads_module.read_files

    def spy(*args: object, **kwargs: object) -> tuple[int, np.ndarray]:
        done, stats = real(*args, **kwargs)  # type: ignore[arg-type]
        read.append(done)
        return done, stats

    monkeypatch.setattr(reads_module, "read_files", spy)
    return read


@pytest.fixture(params=[("int32", False), ("int32", True), ("uint16", False)])
def opened(
    request: pytest.FixtureRequest, tmp_path: Path, loop: list[int]
) -> tuple[TokenWindows, np.ndarray]:
    """A dataset over the corpus (int32: reads straight into the rows; uint16: staged and
    widened) whose first epoch was read with a full handle LRU, against the reference,
    then a second epoch (all shards opened before: the native loop reads it, if chosen)."""
    dtype, labels = request.param
    ref = _corpus(tmp_path / "d", dtype, labels)
    ds = TokenWindows(
        build_manifest(str(tmp_path / "d")), SEQ, labels=labels, storage=Storage(max_open_shards=1)
    )
    rng = np.random.default_rng(5)
    ds.read(np.asarray([0]))  # the only handle: shard 0
    for _ in range(2):
        everything = rng.permutation(ds.num_samples)
        np.testing.assert_array_equal(ds.read(everything)["tokens"], ref[everything])
    if reads_module.NATIVE:
        assert sum(loop) >= SHARDS - 1, loop  # the second epoch went through the native loop
    return ds, ref


def _victim_path(ds: TokenWindows, shard: int) -> Path:
    return Path(ds.files.filesystem()[1]) / ds.manifest.shards[shard].path


def _all_but_shard_0() -> np.ndarray:
    return np.random.default_rng(9).permutation(np.arange(WINDOWS, SHARDS * WINDOWS))


@pytest.mark.parametrize("how", ["same size", "longer", "shorter", "in place"])
@pytest.mark.parametrize("victim", [1, 17, SHARDS - 1])
def test_a_changed_shard_in_a_many_shard_batch_is_named(
    opened: tuple[TokenWindows, np.ndarray], how: str, victim: int
) -> None:
    ds, ref = opened
    path = _victim_path(ds, victim)
    old = np.load(path)
    if how == "same size":
        _replace(path, old[::-1].copy())
    elif how == "longer":
        _replace(path, np.concatenate([old, old]))
    elif how == "shorter":
        _replace(path, old[: old.size // 2].copy())
    else:
        _rewrite_in_place(path)
    ids = _all_but_shard_0()
    with pytest.raises(VerificationError) as info:
        ds.read(ids)
    assert info.value.shard == ds.manifest.shards[victim].path
    assert isinstance(info.value, DetdataError)
    others = ids[(ids // WINDOWS) != victim]
    np.testing.assert_array_equal(ds.read(others)["tokens"], ref[others])  # no false alarm


def test_two_changed_shards_name_the_first_read(opened: tuple[TokenWindows, np.ndarray]) -> None:
    ds, _ = opened
    for victim in (30, 12):
        path = _victim_path(ds, victim)
        _replace(path, np.load(path)[::-1].copy())
    with pytest.raises(VerificationError) as info:
        ds.read(_all_but_shard_0())
    assert info.value.shard == ds.manifest.shards[12].path


def test_a_replaced_shard_is_named_before_a_later_first_open_of_the_wrong_size(
    tmp_path: Path, loop: list[int], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Shard 3 (opened before) replaced at the same size, shard 10 (never opened) cut short:
    a batch over shards 1..20 reads 3 first, so shard 3 is named (field ``file``) by either
    loop, and also when the native loop hands the whole batch to the Python loop (as it
    does when a file cannot be opened mid-replace: here it reads nothing)."""
    _corpus(tmp_path / "d", "int32", False)
    ds = TokenWindows(
        build_manifest(str(tmp_path / "d")), SEQ, labels=False, storage=Storage(max_open_shards=1)
    )
    ds.read(np.asarray([0]))  # the only handle: shard 0
    ds.read(np.arange(2 * WINDOWS, 4 * WINDOWS))  # first opens of shards 2 and 3
    path = _victim_path(ds, 3)
    _replace(path, np.load(path)[::-1].copy())
    path = _victim_path(ds, 10)
    _replace(path, np.load(path)[:5].copy())
    ids = np.arange(WINDOWS, 21 * WINDOWS)
    with pytest.raises(VerificationError) as info:
        ds.read(ids)
    assert (info.value.shard, info.value.field) == (ds.manifest.shards[3].path, "file")
    if reads_module.NATIVE:
        monkeypatch.setattr(
            reads_module, "read_files", lambda r, **k: (0, np.zeros((r.shards.size, 5), np.int64))
        )
        with pytest.raises(VerificationError) as again:
            ds.read(ids)
        assert (again.value.shard, again.value.field) == (ds.manifest.shards[3].path, "file")


def test_shards_opened_before_a_missing_one_are_remembered(tmp_path: Path) -> None:
    """The first read of the run fails on a deleted shard; the shards it opened before
    are still recorded, so replacing one of them afterwards is caught."""
    _corpus(tmp_path / "d", "int32", False)
    ds = TokenWindows(
        build_manifest(str(tmp_path / "d")), SEQ, labels=False, storage=Storage(max_open_shards=1)
    )
    ds.read(np.asarray([0]))
    _victim_path(ds, 20).unlink()
    with pytest.raises(VerificationError) as info:
        ds.read(_all_but_shard_0())
    assert info.value.shard == ds.manifest.shards[20].path
    path = _victim_path(ds, 5)
    _replace(path, np.load(path)[::-1].copy())
    with pytest.raises(VerificationError) as again:
        ds.read(np.arange(4 * WINDOWS, 8 * WINDOWS))  # shards 4-7, not 20
    assert again.value.shard == ds.manifest.shards[5].path


def test_file_identities_with_the_top_bit_set_are_compared(tmp_path: Path) -> None:
    """An inode with bit 63 set (overlayfs) and an mtime before 1970 are recorded and
    compared like any other (no overflow), and a change in either is caught."""
    _corpus(tmp_path / "d", "int32", False)
    ds = TokenWindows(build_manifest(str(tmp_path / "d")), SEQ, labels=False)
    size = ds.manifest.shards[3].bytes
    fields = [0o100644, (1 << 63) + 12345, 77, 1, 0, 0, size, 0, 0, 0]
    extra = [0.0, -1.5, 0.0, 0, -1_500_000_000, 0]  # st_atime..st_ctime, then *_ns
    first = os.stat_result(fields + extra)
    assert first.st_ino == (1 << 63) + 12345 and first.st_mtime_ns == -1_500_000_000
    ds.files.check_stat(3, first, "p")
    ds.files.check_stat(3, os.stat_result(fields + extra), "p")  # the same file: no error
    moved = list(fields)
    moved[1] += 1
    with pytest.raises(VerificationError):
        ds.files.check_stat(3, os.stat_result(moved + extra), "p")
    touched = list(extra)
    touched[4] -= 1
    with pytest.raises(VerificationError):
        ds.files.check_stat(3, os.stat_result(fields + touched), "p")


def _fresh(tmp_path: Path) -> tuple[TokenWindows, np.ndarray]:
    """A dataset over the int32 corpus with a full handle LRU, before its first epoch."""
    ref = _corpus(tmp_path / "d", "int32", False)
    ds = TokenWindows(
        build_manifest(str(tmp_path / "d")), SEQ, labels=False, storage=Storage(max_open_shards=1)
    )
    ds.read(np.asarray([0]))  # the only handle: shard 0
    return ds, ref


def test_a_shard_truncated_at_its_first_open_is_accepted_once_restored(tmp_path: Path) -> None:
    """A file of the wrong size is never recorded as the shard's first file: the batch that
    met it fails naming it (size), and the restored file is read, not refused as replaced."""
    ds, ref = _fresh(tmp_path)
    path = _victim_path(ds, 7)
    good = np.load(path)
    _replace(path, good[: good.size // 2].copy())
    ids = _all_but_shard_0()
    with pytest.raises(VerificationError) as info:
        ds.read(ids)
    assert info.value.shard == ds.manifest.shards[7].path and info.value.field == "bytes"
    _replace(path, good)
    np.testing.assert_array_equal(ds.read(ids)["tokens"], ref[ids])


@pytest.mark.parametrize("reader", ["native", "python"])
def test_a_shard_replaced_while_another_thread_reads_it_first_is_named(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, reader: str
) -> None:
    """Thread A has opened and read shard 7 (its first open in the process) and is still in
    its batch when the shard is renamed over with other bytes; thread B then reads shard 7:
    B must raise naming it, and A must deliver the original bytes. A pauses right after
    its read: inside ``os.preadv`` (Python loop) or after the native loop returned."""
    ds, ref = _fresh(tmp_path)
    path = _victim_path(ds, 7)
    inode = os.stat(path).st_ino
    paused, resume = threading.Event(), threading.Event()
    thread_a: list[threading.Thread] = []

    def pause_in_a() -> None:
        if threading.current_thread() is thread_a[0] and not paused.is_set():
            paused.set()
            resume.wait(10)

    if reader == "python":
        monkeypatch.setattr(reads_module, "NATIVE", False)
        real = os.preadv

        def preadv(fd: int, buffers: list[memoryview], offset: int) -> int:
            got = real(fd, buffers, offset)
            if os.fstat(fd).st_ino == inode:
                pause_in_a()
            return got

        monkeypatch.setattr(os, "preadv", preadv)
    else:
        assert fileread.NATIVE, "detdata.storage._fileread was not built"
        real_files = reads_module.read_files

        def read_files(*args: object, **kwargs: object) -> tuple[int, np.ndarray]:
            got = real_files(*args, **kwargs)  # type: ignore[arg-type]
            pause_in_a()
            return got

        monkeypatch.setattr(reads_module, "read_files", read_files)
    results: dict[str, object] = {}

    def read(name: str, ids: np.ndarray) -> None:
        try:
            results[name] = ds.read(ids)["tokens"]
        except VerificationError as exc:
            results[name] = exc

    ids_a = np.arange(4 * WINDOWS, 12 * WINDOWS)
    ids_b = np.arange(6 * WINDOWS, 9 * WINDOWS)
    thread_a.append(threading.Thread(target=read, args=("A", ids_a)))
    thread_a[0].start()
    assert paused.wait(10)
    _replace(path, np.load(path)[::-1].copy())
    b = threading.Thread(target=read, args=("B", ids_b))
    b.start()
    b.join(10)
    resume.set()
    thread_a[0].join(10)
    assert isinstance(results["B"], VerificationError)
    assert results["B"].shard == ds.manifest.shards[7].path
    assert isinstance(results["A"], np.ndarray)
    np.testing.assert_array_equal(results["A"], ref[ids_a])


def test_a_shard_rewritten_in_place_before_its_read_fails_that_batch(
    opened: tuple[TokenWindows, np.ndarray], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Rewritten in place (same inode and size, a real write) after its first open was
    recorded and before the batch's read (after the batch opened it: Python loop; after
    the batch was planned, as the native loop starts: native loop): the batch that read
    the new bytes raises, not the next one."""
    ds, _ = opened
    path = _victim_path(ds, 17)
    inode = os.stat(path).st_ino
    done: list[int] = []

    def rewrite() -> None:
        done.append(1)
        time.sleep(0.01)  # past one timestamp tick
        data = bytearray(path.read_bytes())
        data[-1] ^= 0xFF
        with open(path, "r+b") as fh:
            fh.write(bytes(data))

    if reads_module.NATIVE:  # the batch is planned; its native read starts after this
        real_files = reads_module.read_files

        def read_files(*args: Any, **kwargs: Any) -> tuple[int, np.ndarray]:
            if not done and 17 in args[0].shards.tolist():
                rewrite()
            return real_files(*args, **kwargs)

        monkeypatch.setattr(reads_module, "read_files", read_files)
    else:
        real = os.preadv

        def preadv(fd: int, buffers: list[memoryview], offset: int) -> int:
            if not done and os.fstat(fd).st_ino == inode:
                rewrite()
            return real(fd, buffers, offset)

        monkeypatch.setattr(os, "preadv", preadv)
    with pytest.raises(VerificationError) as info:
        ds.read(_all_but_shard_0())
    assert done and info.value.shard == ds.manifest.shards[17].path


def test_a_shard_deleted_after_its_first_open_is_named_after_the_ones_read_before(
    opened: tuple[TokenWindows, np.ndarray],
) -> None:
    """A shard deleted after the first epoch: the batch fails naming it ("exists"); a
    shard replaced and read before it in the same batch is named first. The native loop
    stops at the missing file and the Python loop raises (the same error either way)."""
    ds, ref = opened
    ids = np.arange(WINDOWS, SHARDS * WINDOWS)  # sorted: shards 1..39 in order
    _victim_path(ds, 25).unlink()
    with pytest.raises(VerificationError) as info:
        ds.read(ids)
    assert info.value.shard == ds.manifest.shards[25].path and info.value.field == "exists"
    path = _victim_path(ds, 9)
    _replace(path, np.load(path)[::-1].copy())
    with pytest.raises(VerificationError) as first:
        ds.read(ids)
    assert first.value.shard == ds.manifest.shards[9].path and first.value.field == "file"
    rest = ids[(ids // WINDOWS != 25) & (ids // WINDOWS != 9)]
    np.testing.assert_array_equal(ds.read(rest)["tokens"], ref[rest])
