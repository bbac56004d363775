"""`TokenWindows.read_ahead`: a read hinted ahead is planned and its file reads run in the
background; the read later returns what it would have returned without the hint, with the
same checks.

References: the writer's own tokens cut into windows here (never the reader's output), and
the shard each test replaced, truncated or deleted. A spy on the background read proves
the hinted path ran (a test of the hint that silently read synchronously proves nothing).
"""

from __future__ import annotations

import os
import pickle
import shutil
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import detdata.storage.reads as reads_module
from detdata import Storage
from detdata.base.errors import ConfigError, VerificationError
from detdata.datasets import window_reads
from detdata.datasets.tokens import TokenWindows
from detdata.identity.build import build_manifest
from detdata.storage import fileread

#: hints need the native loop; where a C compiler is present it must be built, so these
#: run (and fail if the build broke) instead of skipping
pytestmark = pytest.mark.skipif(
    not fileread.NATIVE and not (shutil.which("cc") or shutil.which("gcc")),
    reason="no C compiler: the native loop (which hints need) cannot be built here",
)

SEQ = 8
SHARDS = 30
WINDOWS = 4  # per shard


def _corpus(root: Path, dtype: str = "int32") -> np.ndarray:
    """``SHARDS`` shards of ``WINDOWS`` windows (with labels); every window in id order."""
    root.mkdir(parents=True)
    out = []
    for s in range(SHARDS):
        tokens = (np.arange(WINDOWS * SEQ + 1) + 1000 * s).astype(dtype)
        np.save(root / f"s{s:03d}.npy", tokens)
        out.extend(tokens[w * SEQ : w * SEQ + SEQ + 1].astype(np.int32) for w in range(WINDOWS))
    return np.stack(out)


@pytest.fixture
def started(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Files of each background read started by a hint (a spy on `start_read_files`)."""
    seen: list[int] = []
    real = reads_module.start_read_files

    def spy(*args: object, **kwargs: object) -> fileread.PendingRead:
        seen.append(int(args[0].shards.size))  # type: ignore[attr-defined]
        return real(*args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(reads_module, "start_read_files", spy)
    return seen


def _dataset(root: Path, dtype: str = "int32") -> tuple[TokenWindows, np.ndarray]:
    ref = _corpus(root, dtype)
    # one handle: every other shard is read by the batched loop, which hints plan
    ds = TokenWindows(build_manifest(str(root)), SEQ, storage=Storage(max_open_shards=1))
    ds.read(np.asarray([0]))
    return ds, ref


@settings(max_examples=25, deadline=None)
@given(st.data())
def test_hinted_reads_deliver_the_writers_windows(
    tmp_path_factory: pytest.TempPathFactory,
    data,  # type: ignore[no-untyped-def]
) -> None:
    """Batches read in order, each hinted 0-3 reads ahead, some reads never hinted, some
    hints never read (and reads of ids no hint named): every read is the writer's
    windows, whatever the hints; the hinted path ran."""
    root = tmp_path_factory.mktemp("c")
    starts: list[int] = []
    real = reads_module.start_read_files

    def spy(*args: object, **kwargs: object) -> fileread.PendingRead:
        starts.append(1)
        return real(*args, **kwargs)  # type: ignore[arg-type]

    for dtype in ("int32", "uint16"):  # straight into the rows / staged and widened
        ds, ref = _dataset(root / dtype, dtype)
        starts.clear()
        reads_module.start_read_files = spy  # type: ignore[assignment]
        try:
            size = data.draw(st.integers(2, 60))
            rng = np.random.default_rng(data.draw(st.integers(0, 2**32)))
            batches = [rng.permutation(ds.num_samples)[:size] for _ in range(8)]
            ahead = data.draw(st.integers(0, 3))
            skip = data.draw(st.sets(st.integers(0, 7)))  # hinted but never read
            for i in range(min(ahead, len(batches))):
                ds.read_ahead(batches[i])
            for i, ids in enumerate(batches):
                if i + ahead < len(batches):
                    ds.read_ahead(batches[i + ahead])
                if i in skip:
                    continue
                np.testing.assert_array_equal(ds.read(ids)["tokens"], ref[ids])
            stray = rng.permutation(ds.num_samples)[:size]
            np.testing.assert_array_equal(ds.read(stray)["tokens"], ref[stray])
            ds.read_ahead(None)
        finally:
            reads_module.start_read_files = real  # type: ignore[assignment]
        if ahead:
            assert starts, "no hint started a background read"


def test_a_hint_reads_in_the_background_and_the_read_waits_for_it(
    tmp_path: Path, started: list[int], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A batch of one window from each of shards 1-29 (one batch of file reads): the hinted
    read does not read the files again (no `read_files` call), and returns the writer's
    windows."""
    ds, ref = _dataset(tmp_path / "d")
    rng = np.random.default_rng(1)
    ids = rng.permutation(np.arange(1, SHARDS) * WINDOWS + rng.integers(0, WINDOWS, SHARDS - 1))
    ds.read_ahead(ids)
    assert started and started[0] >= 10
    calls: list[int] = []
    real = reads_module.read_files
    monkeypatch.setattr(
        reads_module, "read_files", lambda *a, **k: calls.append(1) or real(*a, **k)
    )
    np.testing.assert_array_equal(ds.read(ids)["tokens"], ref[ids])
    assert calls == []  # what the hint read was used
    np.testing.assert_array_equal(ds.read(ids)["tokens"], ref[ids])  # the hint is spent
    assert calls == [1]


@pytest.mark.parametrize(
    "bad",
    [np.asarray([-1, 3]), np.asarray([0, 10_000]), np.asarray([0.5, 1.5]), np.zeros((2, 2))],
)
def test_a_hint_never_raises_and_the_read_reports_the_error(
    tmp_path: Path, bad: np.ndarray, started: list[int]
) -> None:
    ds, _ = _dataset(tmp_path / "d")
    ds.read_ahead(bad)  # nothing raised, nothing started
    ds.read_ahead(np.zeros(0, dtype=np.int64))
    assert started == []
    with pytest.raises(ConfigError, match="ids"):
        ds.read(bad)


class _Unconvertible:
    def __array__(self, *args: object, **kwargs: object) -> np.ndarray:
        raise RuntimeError("no array here")


def test_a_hint_of_what_is_not_an_id_array_does_not_raise(
    tmp_path: Path, started: list[int]
) -> None:
    """A ragged list or an object that cannot become an array: the hint does nothing."""
    ds, ref = _dataset(tmp_path / "d")
    ds.read_ahead([[1, 2], [3]])  # type: ignore[list-item]
    ds.read_ahead(_Unconvertible())  # type: ignore[arg-type]
    assert started == []
    np.testing.assert_array_equal(ds.read(np.arange(8))["tokens"], ref[np.arange(8)])


def test_reads_that_would_not_use_the_file_loop_are_not_planned(
    tmp_path: Path, started: list[int]
) -> None:
    """A narrowing ``out_dtype`` (int64 shards read as int32) and a handle LRU with room
    (shards get mapped): nothing is planned or held; the reads are the writer's windows."""
    ref = _corpus(tmp_path / "d", "int64")
    narrow = TokenWindows(build_manifest(str(tmp_path / "d")), SEQ, out_dtype="int32")
    roomy = TokenWindows(build_manifest(str(tmp_path / "d")), SEQ)
    ids = np.random.default_rng(6).permutation(SHARDS * WINDOWS)[:40]
    for ds in (narrow, roomy):
        ds.read_ahead(ids)
        assert not ds._reads.ahead
        np.testing.assert_array_equal(ds.read(ids)["tokens"], ref[ids])
    assert started == []


def _path(ds: TokenWindows, shard: int) -> Path:
    return Path(ds.files.filesystem()[1]) / ds.manifest.shards[shard].path


def _replace(path: Path, tokens: np.ndarray) -> None:
    tmp = path.with_suffix(".tmp")
    with open(tmp, "wb") as fh:
        np.save(fh, tokens)
    os.replace(tmp, path)


@pytest.mark.parametrize("change", ["replaced", "truncated", "deleted"])
def test_a_shard_changed_before_the_hinted_read_is_named(
    tmp_path: Path, change: str, started: list[int]
) -> None:
    """Every shard was opened once (recorded); then shard 7 is replaced by other tokens of
    the same size, truncated or deleted, and a batch over it is hinted and read: the read
    raises a VerificationError naming shard 7, never other bytes; the other shards of
    the batch still read the writer's windows."""
    ds, ref = _dataset(tmp_path / "d")
    everything = np.random.default_rng(2).permutation(ds.num_samples)
    np.testing.assert_array_equal(ds.read(everything)["tokens"], ref[everything])
    victim = _path(ds, 7)
    original = victim.read_bytes()
    if change == "replaced":
        _replace(victim, (np.arange(WINDOWS * SEQ + 1) + 55_555).astype(np.int32))
    elif change == "truncated":
        os.truncate(victim, len(original) - 8)
    else:
        victim.unlink()
    ids = np.arange(4 * WINDOWS, 12 * WINDOWS)  # shards 4-11
    ds.read_ahead(ids)
    with pytest.raises(VerificationError, match=r"s007\.npy"):
        ds.read(ids)
    assert started
    others = ids[(ids < 7 * WINDOWS) | (ids >= 8 * WINDOWS)]
    ds.read_ahead(others)
    np.testing.assert_array_equal(ds.read(others)["tokens"], ref[others])


def test_a_shard_deleted_after_its_hinted_read_ran_is_delivered_as_read(
    tmp_path: Path,
) -> None:
    """The documented timing: a hinted read's files are read, and checked, when the hint
    runs; a shard deleted after that (before the read) is delivered with the bytes read
    while it existed (the verified ones), and the next read of it names it missing."""
    ds, ref = _dataset(tmp_path / "d")
    ids = np.arange(4 * WINDOWS, 12 * WINDOWS)
    ds.read_ahead(ids)
    pending = ds._reads.ahead[0].pending
    assert pending is not None
    pending.wait()  # the background read is over
    _path(ds, 7).unlink()
    np.testing.assert_array_equal(ds.read(ids)["tokens"], ref[ids])
    with pytest.raises(VerificationError, match=r"s007\.npy"):
        ds.read(ids)


def test_pending_hints_are_not_pickled_and_a_forked_child_reads_afresh(
    tmp_path: Path, started: list[int]
) -> None:
    """A dataset with hints pending pickles (they stay behind) and its copy reads the
    writer's windows; a child forked with hints pending reads the hinted ids correctly
    (the parent's background threads are not there: the child reads for itself)."""
    ds, ref = _dataset(tmp_path / "d")
    ids = np.random.default_rng(3).permutation(ds.num_samples)[:64]
    ds.read_ahead(ids)
    ds.read_ahead(ids[::-1].copy())
    copy = pickle.loads(pickle.dumps(ds))
    assert not copy._reads.ahead
    np.testing.assert_array_equal(copy.read(ids)["tokens"], ref[ids])
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:
        try:
            ok = np.array_equal(ds.read(ids)["tokens"], ref[ids])
            ok &= np.array_equal(ds.read(ids[::-1].copy())["tokens"], ref[ids[::-1]])
            os.write(w, b"ok" if ok else b"wrong")
        except BaseException as exc:
            os.write(w, repr(exc).encode()[:200])
        os._exit(0)
    os.close(w)
    answer = os.read(r, 300)
    os.close(r)
    os.waitpid(pid, 0)
    assert answer == b"ok"
    np.testing.assert_array_equal(ds.read(ids)["tokens"], ref[ids])
    assert started


def test_dropping_hints_joins_their_reads(tmp_path: Path, started: list[int]) -> None:
    """``prefetch(None)`` drops every pending hint (joined): the next read of those ids
    reads the files itself; at most `PREFETCH_DEPTH` hints are kept."""
    ds, ref = _dataset(tmp_path / "d")
    rng = np.random.default_rng(4)
    batches = [rng.permutation(ds.num_samples)[:40] for _ in range(window_reads.PREFETCH_DEPTH + 2)]
    for ids in batches:
        ds.read_ahead(ids)
    assert len(ds._reads.ahead) == window_reads.PREFETCH_DEPTH
    ds.read_ahead(None)
    assert not ds._reads.ahead
    for ids in batches:
        np.testing.assert_array_equal(ds.read(ids)["tokens"], ref[ids])
