"""`detdata.storage.reads` / `mapped` / `digest`: storage's one home for moving and hashing
stored bytes, driven directly (the datasets' tests drive them through `TokenWindows`).

References: the bytes the test wrote (sliced in Python), ``os.stat`` of each file, and
blake3 of the written bytes computed here with the ``blake3`` package.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import NoReturn

import blake3
import fsspec
import numpy as np
import pytest

from detdata.base.errors import StorageError, VerificationError
from detdata.storage import digest, fileread, reads
from detdata.storage.fileread import FileReads
from detdata.storage.first_opens import FirstOpens, file_identity
from detdata.storage.mapped import map_checked, record_view
from detdata.storage.reads import OpenChecks, ReadAhead, ReadPlan, execute, opened, pread_exact


class Checks:
    """An `OpenChecks` that logs every call and checks sizes against ``sizes`` (a shard of
    another size raises `VerificationError` naming it), as a reader's checks do."""

    def __init__(self, sizes: list[int]) -> None:
        self.sizes = sizes
        self.log: list[tuple[str, int]] = []

    def stats(self, shards: np.ndarray, sizes: np.ndarray, now: np.ndarray, prefix: str) -> None:
        for shard, size in zip(shards.tolist(), sizes.tolist(), strict=True):
            self.log.append(("stats", shard))
            if size != self.sizes[shard]:
                raise VerificationError(f"shard {shard}: size {size}", shard=str(shard))

    def stat(self, shard: int, st: os.stat_result, path: str) -> None:
        self.log.append(("stat", shard))
        if st.st_size != self.sizes[shard]:
            raise VerificationError(f"shard {shard}: size {st.st_size}", shard=str(shard))

    def missing(self, shard: int, path: str) -> BaseException:
        self.log.append(("missing", shard))
        return VerificationError(f"shard {shard}: missing", shard=str(shard))

    def short(self, fd: int, shard: int, path: str, nbytes: int, offset: int) -> NoReturn:
        self.log.append(("short", shard))
        raise StorageError(f"shard {shard}: short read of {nbytes} at {offset}")

    def checks(self) -> OpenChecks:
        return OpenChecks(self.stats, self.stat, self.missing, self.short)


def _files(root: Path, sizes: list[int]) -> list[bytes]:
    rng = np.random.default_rng(len(sizes))
    contents = []
    for i, size in enumerate(sizes):
        data = rng.integers(0, 256, size, dtype=np.uint8).tobytes()
        (root / f"f{i}").write_bytes(data)
        contents.append(data)
    return contents


def _reads(root: Path, sizes: list[int], shards: list[int], first: FirstOpens) -> FileReads:
    """Each of ``shards`` read whole, one after the other, into one buffer."""
    wants = [sizes[s] for s in shards]
    at = np.cumsum([0, *wants]).tolist()
    return FileReads(
        os.fsencode(str(root) + os.sep),
        [f"f{i}".encode() for i in range(len(sizes))],
        np.asarray(shards, dtype=np.int64),
        np.zeros(len(shards), dtype=np.int64),
        np.asarray(wants, dtype=np.int64),
        np.zeros(max(at[-1], 1), dtype=np.uint8),
        np.asarray(at[:-1], dtype=np.int64),
        np.asarray(wants, dtype=np.int64),
        np.ones(len(shards), dtype=np.int64),
        first,
    )


@pytest.fixture(params=["native", "python"])
def loop(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    if request.param == "python":
        monkeypatch.setattr(reads, "NATIVE", False)
    else:
        assert fileread.NATIVE, "detdata.storage._fileread was not built (pip install -e .)"
    return str(request.param)


def test_both_loops_read_the_written_bytes_and_check_every_open(tmp_path: Path, loop: str) -> None:
    sizes = [100, 37, 512, 1]
    contents = _files(tmp_path, sizes)
    first = FirstOpens(np.asarray(sizes))
    job = _reads(tmp_path, sizes, [2, 0, 3, 1], first)
    log = Checks(sizes)
    execute(ReadPlan((job,), log.checks(), first))
    assert job.out.tobytes() == contents[2] + contents[0] + contents[3] + contents[1]
    assert [s for what, s in log.log if what == "stats"] == [2, 0, 3, 1]  # all, in order
    if loop == "python":  # the twin checks each first open before its read
        assert [s for what, s in log.log if what == "stat"] == [2, 0, 3, 1]


@pytest.mark.parametrize("change", ["missing", "wrong size"])
def test_both_loops_name_the_shards_read_before_a_bad_one_first(
    tmp_path: Path, loop: str, change: str
) -> None:
    """File 2 of 4 is missing or of another size: the files read before it are checked
    first (in order), then the bad one raises, whichever loop read them."""
    sizes = [64, 64, 64, 64]
    _files(tmp_path, sizes)
    if change == "missing":
        (tmp_path / "f2").unlink()
    else:
        (tmp_path / "f2").write_bytes(b"x" * 10)
    first = FirstOpens(np.asarray(sizes))
    log = Checks(sizes)
    with pytest.raises(VerificationError) as info:
        execute(ReadPlan((_reads(tmp_path, sizes, [0, 1, 2, 3], first),), log.checks(), first))
    assert info.value.shard == "2"
    named = [s for _, s in log.log]
    assert named.index(0) < named.index(1) < named.index(2) and 3 not in named


def test_a_short_read_raises_the_readers_error(tmp_path: Path, loop: str) -> None:
    sizes = [64, 64]
    _files(tmp_path, sizes)
    first = FirstOpens(np.asarray(sizes))
    job = _reads(tmp_path, sizes, [0, 1], first)
    job.wants[1] = job.iov_len[1] = 80  # more than the file holds; the buffer has room
    job = job._replace(out=np.zeros(200, dtype=np.uint8))
    log = Checks(sizes)
    with pytest.raises(StorageError, match="short read"):
        execute(ReadPlan((job,), log.checks(), first))
    assert ("stats", 0) in log.log


def test_read_ahead_keeps_at_most_depth_and_hands_over_the_read(tmp_path: Path) -> None:
    """Plans started ahead: the oldest beyond ``depth`` is dropped; `take` returns the one
    planned for exactly those ids (dropping those planned before it), and finishing it
    gives the written bytes without reading again."""
    if not fileread.NATIVE:
        pytest.skip("read-ahead needs the native loop")
    sizes = [256] * 8
    contents = _files(tmp_path, sizes)
    first = FirstOpens(np.asarray(sizes))
    ahead = ReadAhead(depth=2, threads=1)
    assert ahead.enabled
    keys = [np.asarray([k]) for k in range(4)]
    jobs = [_reads(tmp_path, sizes, [k, k + 4], first) for k in range(4)]
    for key, job in zip(keys, jobs, strict=True):
        ahead.start(key, ReadPlan((job,), Checks(sizes).checks(), first), key)
    assert len(ahead) == 2 and [p.key.tolist() for p in ahead] == [[2], [3]]
    assert ahead.take(keys[0]) is None and len(ahead) == 2  # never planned (dropped): kept
    found = ahead.take(keys[3])
    assert found is not None and len(ahead) == 0  # the one before it was dropped
    assert found.finish() is keys[3]  # the owner's result, handed back once read
    assert jobs[3].out.tobytes() == contents[3] + contents[7]
    ahead.start(keys[1], ReadPlan((jobs[1],), Checks(sizes).checks(), first), keys[1])
    ahead.clear()
    assert len(ahead) == 0


def test_opened_checks_at_the_open_and_after_the_reads(tmp_path: Path) -> None:
    contents = _files(tmp_path, [64])
    log = Checks([64])
    buf = np.zeros(16, dtype=np.uint8)
    with opened(str(tmp_path / "f0"), 0, log.checks()) as fd:
        pread_exact(fd, buf, 8, 0, "f0", log.checks())
    assert buf.tobytes() == contents[0][8:24]
    assert log.log == [("stat", 0), ("stat", 0)]
    with (
        pytest.raises(StorageError, match="short read"),
        opened(str(tmp_path / "f0"), 0, log.checks()) as fd,
    ):
        pread_exact(fd, buf, 60, 0, "f0", log.checks())
    with (
        pytest.raises(VerificationError, match="missing"),
        opened(str(tmp_path / "nothing"), 0, log.checks()),
    ):
        pass


def test_a_record_view_over_a_mapping_is_the_written_windows(tmp_path: Path) -> None:
    tokens = np.arange(1000, dtype=np.int32) * 3
    header = b"h" * 16
    (tmp_path / "t").write_bytes(header + tokens.tobytes())
    log = Checks([16 + tokens.nbytes])
    with open(tmp_path / "t", "rb") as fh:
        mapping = map_checked(fh.fileno(), 0, "t", log.checks())
    view = record_view(
        mapping, np.dtype(np.int32), offset=16, count=1000, rows=99, step=10, width=11
    )
    assert not view.flags.writeable
    for r in (0, 1, 50, 98):
        np.testing.assert_array_equal(view[r], tokens[r * 10 : r * 10 + 11])
    assert log.log == [("stat", 0)]
    log.sizes[0] = 1  # another size: refused before anything is mapped
    with open(tmp_path / "t", "rb") as fh, pytest.raises(VerificationError):
        map_checked(fh.fileno(), 0, "t", log.checks())


def test_file_identity_is_the_unsigned_stat_triple(tmp_path: Path) -> None:
    (tmp_path / "f").write_bytes(b"x")
    st = os.stat(tmp_path / "f")
    assert file_identity(st) == (st.st_ino, st.st_dev, st.st_mtime_ns)


@pytest.mark.parametrize("size", [0, 1, 5000, (1 << 20) + 17, (9 << 20) + 3])
def test_every_file_digest_is_blake3_of_the_written_bytes(tmp_path: Path, size: int) -> None:
    data = np.random.default_rng(size).integers(0, 256, size, dtype=np.uint8).tobytes()
    path = tmp_path / "f"
    path.write_bytes(data)
    want = "b3:" + blake3.blake3(data).hexdigest()
    span = min(size, 1 << 20)
    quick_hasher = blake3.blake3(b"detdata:quick-v1" + size.to_bytes(8, "little"))
    quick_hasher.update(data[:span])
    quick_hasher.update(data[size - span :])
    quick = "b3:" + quick_hasher.hexdigest()
    fs = fsspec.filesystem("file")
    assert digest.full_digest_path(str(path)) == want
    assert digest.full_digest_file(fs, str(path)) == want
    assert digest.digests_file(fs, str(path), size) == (want, quick)
    assert digest.digest_chunks(data[i : i + 999] for i in range(0, size, 999)) == want
    fd = os.open(path, os.O_RDONLY)
    try:
        assert digest.quick_digest_fd(fd, size) == quick
        assert digest.full_digest_fd(fd) == want
    finally:
        os.close(fd)
