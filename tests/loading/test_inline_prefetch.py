"""``num_workers=0`` hints the next groups to the stream (`DataLoader._inline_batches`):
over a many-shard `TokenWindows` their file reads run in the background. The delivered
bytes, the resume points and the errors must be those of a loader that reads everything
itself.

References: the writer's windows at the order's ids (a brute-force read of the writer's
own arrays), a run with process workers (which never hint), and an uninterrupted run for
every resume point (`tests.resume_checker`).
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import numpy as np
import pytest

import detdata
import detdata.storage.reads as reads_module
from detdata import Storage
from detdata.base.errors import VerificationError
from detdata.datasets.streams import OrderedStream
from detdata.datasets.tokens import TokenWindows
from detdata.identity.build import build_manifest
from detdata.order.choice import LocalityOrder
from detdata.storage import fileread
from tests.resume_checker import check_resume_everywhere, run_digests

#: hints need the native loop; where a C compiler is present it must be built, so these
#: run (and fail if the build broke) instead of skipping
pytestmark = pytest.mark.skipif(
    not fileread.NATIVE and not (shutil.which("cc") or shutil.which("gcc")),
    reason="no C compiler: the native loop (which hints need) cannot be built here",
)

SEQ = 8
SHARDS = 48
WINDOWS = 4
BATCH = 6  # micro batches of 6 windows, groups of 4 micro batches: groups straddle shards


def _corpus(root: Path) -> np.ndarray:
    root.mkdir(parents=True)
    out = []
    for s in range(SHARDS):
        tokens = (np.arange(WINDOWS * SEQ + 1) + 1000 * s).astype(np.int32)
        np.save(root / f"s{s:03d}.npy", tokens)
        out.extend(tokens[w * SEQ : w * SEQ + SEQ + 1] for w in range(WINDOWS))
    return np.stack(out)


@pytest.fixture
def corpus(tmp_path: Path) -> tuple[Path, np.ndarray]:
    return tmp_path / "d", _corpus(tmp_path / "d")


@pytest.fixture
def started(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """One entry per background read a hint started (a spy)."""
    seen: list[int] = []
    real = reads_module.start_read_files

    def spy(*args: object, **kwargs: object) -> fileread.PendingRead:
        seen.append(1)
        return real(*args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(reads_module, "start_read_files", spy)
    return seen


def _stream(root: Path, order: object) -> OrderedStream:
    ds = TokenWindows(build_manifest(str(root)), SEQ, storage=Storage(max_open_shards=2))
    return OrderedStream(ds, 11, order=order)  # type: ignore[arg-type]


ORDERS = [detdata.Order.FEISTEL_V1, LocalityOrder(window_shards=3)]


@pytest.mark.parametrize("order", ORDERS, ids=["feistel", "locality"])
def test_hinted_batches_are_the_writers_windows_in_the_order(
    corpus: tuple[Path, np.ndarray], order: object, started: list[int]
) -> None:
    """Two epochs and a bit: micro batch j holds the writer's windows at the order's ids
    of positions [j * BATCH, (j + 1) * BATCH); the hints did start background reads."""
    root, ref = corpus
    stream = _stream(root, order)
    loader = detdata.DataLoader(
        stream,
        global_batch_size=BATCH,
        options=detdata.LoaderOptions(read=detdata.ReadOptions(batches_ahead=4)),
        seed=3,
    )
    count = 2 * SHARDS * WINDOWS // BATCH + 5
    for j, batch in zip(range(count), loader, strict=False):
        ids = stream.sample_ids(np.arange(j * BATCH, (j + 1) * BATCH))
        np.testing.assert_array_equal(batch["tokens"].numpy(), ref[ids])
    assert loader.samples_consumed == count * BATCH
    assert len(started) > count // 4 // 2  # most groups were hinted and read ahead


@pytest.mark.parametrize("order", ORDERS, ids=["feistel", "locality"])
def test_inline_bytes_equal_worker_processes_and_resume_anywhere(
    corpus: tuple[Path, np.ndarray], order: object, started: list[int]
) -> None:
    """The same digests as two worker processes (no hints there); restored at every micro
    batch (hints pending at each save point), the rest equals the uninterrupted run."""
    root, _ = corpus
    count = 30

    def make(workers: int = 0) -> detdata.DataLoader:
        return detdata.DataLoader(
            _stream(root, order),
            global_batch_size=BATCH,
            options=detdata.LoaderOptions(read=detdata.ReadOptions(batches_ahead=4)),
            seed=3,
            num_workers=workers,
        )

    inline = check_resume_everywhere(make, count)
    assert run_digests(make(2), count) == inline
    assert started


def test_leaving_the_loop_drops_the_hints(
    corpus: tuple[Path, np.ndarray], started: list[int]
) -> None:
    """A ``break`` with hints pending: they are dropped (their reads joined), so the
    dataset holds no buffer of batches never delivered, and the next epoch from the saved
    point is right."""
    root, ref = corpus
    stream = _stream(root, LocalityOrder(window_shards=3))
    loader = detdata.DataLoader(
        stream,
        global_batch_size=BATCH,
        options=detdata.LoaderOptions(read=detdata.ReadOptions(batches_ahead=4)),
        seed=3,
    )
    for j, _ in enumerate(loader):
        if j == 5:
            break
    assert started
    assert not stream.dataset._reads.ahead  # type: ignore[attr-defined]
    assert loader.samples_consumed == 6 * BATCH
    batch = next(iter(loader))
    np.testing.assert_array_equal(
        batch["tokens"].numpy(), ref[stream.sample_ids(np.arange(6 * BATCH, 7 * BATCH))]
    )


def test_a_shard_replaced_mid_run_stops_at_a_batch_after_the_good_ones(
    corpus: tuple[Path, np.ndarray], started: list[int]
) -> None:
    """After a first epoch, one shard is replaced (other tokens, same size) while hints
    are pending: the loader raises a VerificationError naming it; every batch delivered
    before is the writer's, and ``samples_consumed`` counts exactly those."""
    root, ref = corpus
    stream = _stream(root, LocalityOrder(window_shards=3))
    loader = detdata.DataLoader(
        stream,
        global_batch_size=BATCH,
        options=detdata.LoaderOptions(read=detdata.ReadOptions(batches_ahead=4)),
        seed=3,
    )
    epoch = SHARDS * WINDOWS // BATCH
    delivered = 0
    victim = root / "s017.npy"
    with pytest.raises(VerificationError, match=r"s017\.npy"):
        for j, batch in enumerate(loader):
            ids = stream.sample_ids(np.arange(j * BATCH, (j + 1) * BATCH))
            np.testing.assert_array_equal(batch["tokens"].numpy(), ref[ids])
            delivered += 1
            if j == epoch:  # every shard was opened once: replace one
                tmp = root / "s017.tmp"
                with open(tmp, "wb") as fh:
                    np.save(fh, (np.arange(WINDOWS * SEQ + 1) + 77_777).astype(np.int32))
                os.replace(tmp, victim)
    assert delivered > epoch
    assert loader.samples_consumed == delivered * BATCH
