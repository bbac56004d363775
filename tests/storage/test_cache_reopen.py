"""ShardCache: nothing grows with the copies used, and re-opening a verified copy is cheap.

Copies are filled from an in-memory fsspec root (``memory://``, a real remote-style
file system in this process) into a real cache directory. "Cheap" is checked from
outside the code: the bytes this process read through ``read``/``pread`` system calls
(``rchar`` of ``/proc/thread-self/io``: this thread's, where the re-opens run; the process's
count also takes in other threads of the test worker, such as pytest-xdist's channel reads and
servers of other tests; memory-mapped reads do not count there) while copies
are re-opened after handle evictions. A quick digest re-check reads the whole copy of
a small shard (twice: head and tail), so without the memo every re-open reads it.
"""

from __future__ import annotations

import os
import time
import uuid
from pathlib import Path

import blake3
import fsspec
import numpy as np
import pytest

import detdata
from detdata.storage.cache import TOUCHED_MAX, ShardCache, forget_verified

SEQ = 64
WINDOWS = 256  # per shard: 256 x 64 int32 tokens + 1 = 64 KiB per copy
RACY_S = 0.15  # > the cache's racy-clean window (0.1 s): verifications after it are trusted


def rchar() -> int:
    with open("/proc/thread-self/io") as fh:
        for line in fh:
            if line.startswith("rchar:"):
                return int(line.split()[1])
    raise AssertionError("no rchar in /proc/thread-self/io")


@pytest.fixture()
def corpus(tmp_path: Path) -> tuple[str, np.ndarray]:
    """A memory:// root of 3 token shards; (root, every window as the writer wrote it)."""
    rng = np.random.default_rng(7)
    arrays = [rng.integers(0, 2**31 - 1, WINDOWS * SEQ + 1, dtype=np.int32) for _ in range(3)]
    src = tmp_path / "src"
    src.mkdir()
    name = f"reopen-{uuid.uuid4().hex}"
    fs = fsspec.filesystem("memory")
    for i, arr in enumerate(arrays):
        np.save(src / f"s{i}.npy", arr)
        fs.pipe_file(f"/{name}/s{i}.npy", (src / f"s{i}.npy").read_bytes())
    windows = np.stack([a[w * SEQ : w * SEQ + SEQ + 1] for a in arrays for w in range(WINDOWS)])
    return f"memory://{name}", windows


def reader(root: str, cache: Path) -> detdata.TokenWindows:
    return detdata.TokenWindows(
        detdata.build_manifest(root),
        SEQ,
        storage=detdata.Storage(cache_dir=cache, max_open_shards=1, verify="off"),
    )


def one_window_of_each(ds: detdata.TokenWindows, windows: np.ndarray, rounds: int) -> None:
    """Alternate between the shards with one open handle: every read re-opens a copy."""
    for r in range(rounds):
        for shard in range(3):
            ids = np.array([shard * WINDOWS + (r * 7) % WINDOWS])
            np.testing.assert_array_equal(ds.read(ids)["tokens"], windows[ids])


def test_reopening_a_copy_this_process_verified_reads_none_of_it(
    corpus: tuple[str, np.ndarray], tmp_path: Path
) -> None:
    root, windows = corpus
    ds = reader(root, tmp_path / "cache")
    one_window_of_each(ds, windows, 1)  # fills (verified while written)
    time.sleep(RACY_S)
    one_window_of_each(ds, windows, 1)  # re-verified once, now trusted
    copy_bytes = windows.nbytes // 3
    before = rchar()
    one_window_of_each(ds, windows, 30)  # 90 re-opens after evictions
    read = rchar() - before
    assert ds.files.local().handles.evictions >= 90
    assert read < copy_bytes, (read, copy_bytes)  # without the memo: 90 x 2 x 64 KiB
    # the old cost, for comparison: forgetting the memo makes each re-open read the copy
    before = rchar()
    for _ in range(10):
        forget_verified()
        one_window_of_each(ds, windows, 1)
    assert rchar() - before >= 30 * copy_bytes


def test_a_copy_this_process_filled_is_reopened_without_reading_it(
    corpus: tuple[str, np.ndarray], tmp_path: Path
) -> None:
    """A prefetched copy is hashed as it is written: the reader that opens it right after
    the fill (inside the racy-clean window) does not read it again."""
    root, windows = corpus
    ds = reader(root, tmp_path / "cache")
    one_window_of_each(ds, windows, 1)  # fills
    cache = ds.files.shard_cache
    assert cache is not None and cache.stats.fills == 3
    copy_bytes = windows.nbytes // 3
    digests = cache.stats.digests
    before = rchar()
    one_window_of_each(ds, windows, 5)  # 15 re-opens right after the fills, no sleep
    assert ds.files.local().handles.evictions >= 15
    assert rchar() - before < copy_bytes
    assert cache.stats.digests == digests


def test_a_copy_changed_right_after_its_fill_is_caught(
    corpus: tuple[str, np.ndarray], tmp_path: Path
) -> None:
    """Trusting a fresh fill does not trust later writes: a copy flipped in place after
    its fill (past one timestamp tick) is verified again, found corrupted and fetched
    again."""
    root, windows = corpus
    ds = reader(root, tmp_path / "cache")
    one_window_of_each(ds, windows, 1)
    cache = ds.files.shard_cache
    assert cache is not None
    victim = sorted((tmp_path / "cache" / "objects").iterdir())[0]
    time.sleep(0.02)
    data = bytearray(victim.read_bytes())
    data[200] ^= 0xFF
    with open(victim, "r+b") as fh:
        fh.write(bytes(data))
    corrupt = cache.stats.corrupt
    one_window_of_each(ds, windows, 2)  # the writer's bytes, from a copy fetched again
    assert cache.stats.corrupt - corrupt == 1
    assert blake3.blake3(victim.read_bytes()).hexdigest() == victim.name


def test_a_copy_changed_on_disk_is_verified_again(
    corpus: tuple[str, np.ndarray], tmp_path: Path
) -> None:
    """Rewritten in place, replaced by another file, or touched by another process: the
    memo does not vouch for it; corrupted copies are caught, deleted and fetched again."""
    root, windows = corpus
    ds = reader(root, tmp_path / "cache")
    one_window_of_each(ds, windows, 1)
    time.sleep(RACY_S)
    one_window_of_each(ds, windows, 2)
    cache = ds.files.shard_cache
    assert cache is not None
    copies = sorted((tmp_path / "cache" / "objects").iterdir())
    assert len(copies) == 3
    time.sleep(0.02)  # past this process's last touch: a write now shows in the timestamps
    # 1. flipped in place (same inode, same size)
    victim = copies[0]
    data = bytearray(victim.read_bytes())
    data[100] ^= 0xFF
    with open(victim, "r+b") as fh:
        fh.write(bytes(data))
    # 2. replaced by a corrupted file (another inode)
    other = copies[1]
    data = bytearray(other.read_bytes())
    data[-5] ^= 0xFF
    other.unlink()
    other.write_bytes(bytes(data))
    # 3. touched by another process: re-verified (and found good)
    os.utime(copies[2])
    digests, corrupt = cache.stats.digests, cache.stats.corrupt
    one_window_of_each(ds, windows, 3)  # every byte is still the writer's
    assert cache.stats.corrupt - corrupt == 2
    assert cache.stats.digests - digests >= 3
    for copy in copies:  # fetched again where corrupted: each holds what its name promises
        assert blake3.blake3(copy.read_bytes()).hexdigest() == copy.name


def test_the_touch_memo_stays_bounded_whatever_the_copies_touched(tmp_path: Path) -> None:
    cache = ShardCache(tmp_path / "cache", 1 << 20)
    folder = tmp_path / "files"
    folder.mkdir()
    paths = []
    for i in range(3 * TOUCHED_MAX):
        path = folder / f"f{i}"
        path.write_bytes(b"x")
        paths.append(str(path))
    for path in paths:
        cache.touch(path)
    assert len(cache._touched) <= TOUCHED_MAX
    time.sleep(1.1)  # entries older than the once-a-second limit carry no information
    cache.touch(paths[0])
    assert len(cache._touched) == 1
