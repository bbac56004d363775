"""The native batched read loop (`detdata.storage.fileread.read_files`, C without the GIL).

References: the bytes the test wrote (sliced in Python), and ``os.stat`` of each file.
"""

from __future__ import annotations

import contextlib
import os
import pickle
import shutil
import threading
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from detdata.storage import fileread, first_opens
from detdata.storage.fileread import DEVICE, GOT, INODE, MTIME_NS, SIZE, FileReads, read_files
from detdata.storage.first_opens import NONE, RECORDED, FirstOpens

#: the tests of the loop itself need it built (the first test fails where it could be)
native = pytest.mark.skipif(not fileread.NATIVE, reason="not built: see the first test")


def test_the_native_loop_is_built_where_a_c_compiler_is() -> None:
    """`pip install -e .` builds it (setup.py); without it every read takes the slower
    Python loop, which would hide here as a silent slowdown."""
    if shutil.which("cc") or shutil.which("gcc"):
        assert fileread.NATIVE, "detdata.storage._fileread was not built; reinstall detdata"


def _files(root: Path, sizes: list[int]) -> tuple[bytes, list[bytes], list[bytes]]:
    """Files ``f{i}`` of ``sizes[i]`` distinct bytes; returns (prefix, names, contents)."""
    root.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(len(sizes))
    contents = []
    for i, size in enumerate(sizes):
        data = rng.integers(0, 256, size, dtype=np.uint8).tobytes()
        (root / f"f{i}").write_bytes(data)
        contents.append(data)
    return os.fsencode(str(root) + os.sep), [f"f{i}".encode() for i in range(len(sizes))], contents


def _arrays(*values: list[int]) -> list[np.ndarray]:
    return [np.asarray(v, dtype=np.int64) for v in values]


@native
def test_scattered_buffers_get_the_files_bytes_and_stats_after_the_read(tmp_path: Path) -> None:
    prefix, names, contents = _files(tmp_path, [100, 50, 80])
    out = np.zeros(300, dtype=np.uint8)
    # file 2: 30 bytes at 10 into out[200:210] + out[0:20]; file 0: 60 at 40 into out[100:160]
    shards, file_at, wants, count = _arrays([2, 0], [10, 40], [30, 60], [2, 1])
    iov_off, iov_len = _arrays([200, 0, 100], [10, 20, 60])
    done, stats = read_files(
        FileReads(prefix, names, shards, file_at, wants, out, iov_off, iov_len, count)
    )
    assert done == 2
    assert out[200:210].tobytes() + out[0:20].tobytes() == contents[2][10:40]
    assert out[100:160].tobytes() == contents[0][40:100]
    assert not out[20:100].any() and not out[160:200].any()  # nothing else written
    for row, shard in zip(stats, (2, 0), strict=True):
        st = os.stat(tmp_path / f"f{shard}")
        assert row[GOT] == wants[list(shards).index(shard)]
        assert row[SIZE] == st.st_size
        ident = row[INODE : MTIME_NS + 1].view(np.uint64).tolist()
        assert ident == [st.st_ino, st.st_dev, st.st_mtime_ns]
    assert DEVICE == INODE + 1


@native
@settings(max_examples=40, deadline=None)
@given(st.data())
def test_any_layout_matches_a_python_read(tmp_path_factory: pytest.TempPathFactory, data) -> None:  # type: ignore[no-untyped-def]
    """Random files, ranges and buffer splits: ``out`` gets each range's bytes in order."""
    sizes = data.draw(st.lists(st.integers(1, 300), min_size=1, max_size=6))
    prefix, names, contents = _files(tmp_path_factory.mktemp("f"), sizes)
    order = data.draw(st.permutations(range(len(sizes))))
    pieces, shards, file_at, wants, count = [], [], [], [], []
    for shard in order:
        at = data.draw(st.integers(0, sizes[shard] - 1))
        want = data.draw(st.integers(0, sizes[shard] - at))
        cuts = sorted(data.draw(st.lists(st.integers(0, want), max_size=4)))
        parts = [b - a for a, b in zip([0, *cuts], [*cuts, want], strict=True)]
        shards.append(shard)
        file_at.append(at)
        wants.append(want)
        count.append(len(parts))
        pieces.extend(parts)
    where = np.random.default_rng(len(pieces)).permutation(len(pieces))  # scattered in out
    slot = 300
    iov_off = [int(w) * slot for w in where]
    out = np.zeros(slot * max(len(pieces), 1), dtype=np.uint8)
    done, _ = read_files(
        FileReads(
            prefix, names, *_arrays(shards, file_at, wants), out, *_arrays(iov_off, pieces, count)
        )
    )
    assert done == len(order)
    j = 0
    for shard, at, want, k in zip(shards, file_at, wants, count, strict=True):
        got = b"".join(
            out[iov_off[j + m] : iov_off[j + m] + pieces[j + m]].tobytes() for m in range(k)
        )
        assert got == contents[shard][at : at + want]
        j += k


@native
def test_it_stops_at_the_first_file_it_cannot_read_whole(tmp_path: Path) -> None:
    """A missing file, a short read, a path too long or more buffers than IOV_MAX: ``done``
    is that file's index and the files before it were read (the caller's loop raises)."""
    prefix, names, contents = _files(tmp_path, [40, 40, 40])
    names.append(b"missing")
    names.append(b"x" * 5000)

    def run(shards: list[int], wants: list[int], count: list[int] | None = None) -> int:
        count = count or [1] * len(shards)
        out = np.zeros(2048, dtype=np.uint8)
        lens = [w // c for w, c in zip(wants, count, strict=True) for _ in range(c)]
        offs = list(range(0, len(lens)))
        done, _ = read_files(
            FileReads(
                prefix,
                names,
                *_arrays(shards, [0] * len(shards), wants),
                out,
                *_arrays(offs, lens, count),
            )
        )
        if done:
            assert out[0:1].tobytes() == contents[shards[0]][:1] or wants[0] == 0
        return done

    assert run([0, 3, 1], [40, 10, 40]) == 1  # missing
    assert run([0, 1, 2], [40, 41, 40]) == 1  # short: the file has 40 bytes
    assert run([1, 4], [40, 10]) == 1  # name too long for PATH_MAX
    assert run([0, 1], [1, 2000], [1, 2000]) == 1  # 2000 buffers of 1 byte > IOV_MAX
    assert run([2, 1, 0], [40, 40, 40]) == 3
    names[1] = b"f1\x00x"  # a NUL byte: not the file "f1"
    assert run([0, 1, 2], [40, 40, 40]) == 1


@native
@pytest.mark.parametrize("missing", [(), (70,), (10, 70), (50,), (99,)])
def test_two_threads_count_the_files_read_from_the_first_on(
    tmp_path: Path, missing: tuple[int, ...]
) -> None:
    """100 files on 2 threads (shares 0-49 and 50-99): ``done`` is the first missing file
    whichever thread met it, and every file before it has its bytes."""
    prefix, names, contents = _files(tmp_path, [64 + i for i in range(100)])
    for i in missing:
        (tmp_path / f"f{i}").unlink()
    shards = list(range(100))
    wants = [64 + i for i in shards]
    offs = [i * 256 for i in shards]
    out = np.zeros(256 * 100, dtype=np.uint8)
    done, stats = read_files(
        FileReads(
            prefix, names, *_arrays(shards, [0] * 100, wants), out, *_arrays(offs, wants, [1] * 100)
        ),
        threads=2,
    )
    assert done == (min(missing) if missing else 100)
    for i in range(done):
        assert out[offs[i] : offs[i] + wants[i]].tobytes() == contents[i]
        assert stats[i, SIZE] == wants[i]


@native
def test_arguments_that_do_not_fit_raise_before_any_read(tmp_path: Path) -> None:
    prefix, names, _ = _files(tmp_path, [40])
    out = np.zeros(64, dtype=np.uint8)
    one = _arrays([0], [0], [40])

    def call(*args: object) -> None:
        read_files(FileReads(*args))  # type: ignore[arg-type]

    with pytest.raises(ValueError, match="outside"):
        call(prefix, names, *one, out, *_arrays([40], [40], [1]))
    with pytest.raises(ValueError, match="mismatched"):
        call(prefix, names, *_arrays([0], [0], [40, 1]), out, *_arrays([0], [40], [1]))
    with pytest.raises(ValueError, match="out of range"):
        call(prefix, names, *_arrays([1], [0], [40]), out, *_arrays([0], [40], [1]))
    with pytest.raises(ValueError, match="add up"):
        call(prefix, names, *one, out, *_arrays([0], [40], [2]))
    with pytest.raises(ValueError, match="bytes"):
        call(prefix, ["f0"], *one, out, *_arrays([0], [40], [1]))
    frozen = np.zeros(64, dtype=np.uint8)
    frozen.flags.writeable = False
    with pytest.raises(ValueError, match="threads"):
        read_files(FileReads(prefix, names, *one, out, *_arrays([0], [40], [1])), threads=0)
    with pytest.raises(ValueError, match="writable"):
        call(prefix, names, *one, frozen, *_arrays([0], [40], [1]))
    assert not out.any()


def test_without_the_extension_nothing_is_read(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    prefix, names, _ = _files(tmp_path, [40])
    monkeypatch.setattr(fileread, "_fileread", None)
    out = np.zeros(40, dtype=np.uint8)
    done, stats = read_files(
        FileReads(prefix, names, *_arrays([0], [0], [40]), out, *_arrays([0], [40], [1]))
    )
    assert done == 0 and not out.any() and not stats.any()


def test_read_threads_are_clamped_and_a_loader_worker_reads_on_one(tmp_path: Path) -> None:
    """`set_read_threads` keeps 1..2; a DataLoader worker process sets 1 (its siblings read
    side by side) before the user's ``worker_init_fn`` runs."""
    import detdata

    before = fileread._threads
    try:
        fileread.set_read_threads(8)
        assert fileread._threads == 2
        fileread.set_read_threads(0)
        assert fileread._threads == 1
    finally:
        fileread.set_read_threads(before)
    seen = tmp_path / "threads"

    def init(worker_id: int) -> None:
        seen.write_text(str(fileread._threads))

    loader = detdata.DataLoader(
        detdata.ArrayDataset({"x": np.arange(64, dtype=np.int64).reshape(16, 4)}),
        global_batch_size=4,
        num_workers=1,
        seed=0,
        worker_init_fn=init,
    )
    next(iter(loader))
    assert seen.read_text() == "1"


@native
def test_buffer_counts_that_wrap_around_are_refused(tmp_path: Path) -> None:
    """Counts whose int64 sum wraps to the real number of buffers (which would send the
    second thread's share before the start of the buffer arrays): a ValueError, no read."""
    prefix, names, _ = _files(tmp_path, [64] * 32)
    count = np.zeros(32, dtype=np.int64)
    count[0], count[1] = (1 << 63) - 1, (1 << 63) - 1  # sum == -2 (mod 2**64)
    count[16:] = 1  # 16 more: the wrapped total is 14
    wants = np.zeros(32, dtype=np.int64)
    wants[16:] = 64
    out = np.zeros(64 * 32, dtype=np.uint8)
    offs, lens = np.arange(14, dtype=np.int64) * 64, np.full(14, 64, dtype=np.int64)
    with pytest.raises(ValueError, match="add up"):
        read_files(
            FileReads(
                prefix, names, np.arange(32), np.zeros(32, np.int64), wants, out, offs, lens, count
            ),
            threads=2,
        )
    assert not out.any()


@native
def test_names_replaced_by_another_thread_during_the_read_are_not_followed(
    tmp_path: Path,
) -> None:
    """The loop reads without the GIL; a thread emptying ``names`` meanwhile frees the
    bytes objects (refilled here with names of other files) unless the loop holds them.
    Every buffer must hold its own file's bytes (reference: the bytes written)."""
    import threading

    n = 3000
    for i in range(n):
        (tmp_path / f"f{i:06d}").write_bytes(b"\x11" * 16)
        (tmp_path / f"g{i:06d}").write_bytes(b"\xee" * 16)
    prefix = os.fsencode(str(tmp_path) + os.sep)
    read = 0
    for _ in range(20):
        names = [f"f{i:06d}".encode() for i in range(n)]
        out = np.zeros(16 * n, dtype=np.uint8)
        got: list[int] = []
        args = (
            prefix,
            names,
            *_arrays(list(range(n)), [0] * n, [16] * n),
            out,
            *_arrays([16 * i for i in range(n)], [16] * n, [1] * n),
        )
        reader = threading.Thread(target=_read_into, args=(got, args))
        reader.start()
        time.sleep(0.002)  # the loop has taken the names (~15 ms of reads follow)
        names[:] = []
        others = [f"g{i:06d}".encode() for i in range(n)]  # reuses the freed blocks
        reader.join()
        if got == [-1]:  # emptied before the call looked at it: a clean ValueError
            continue
        assert got == [n] and others
        assert (out == 0x11).all()
        read += 1
    assert read >= 5


def _read_into(got: list[int], args: tuple[object, ...]) -> None:
    try:
        got.append(read_files(FileReads(*args), threads=1)[0])  # type: ignore[arg-type]
    except ValueError:
        got.append(-1)


def _read_whole(prefix: bytes, names: list[bytes], shards: list[int], size: int) -> list[bytes]:
    """Each of ``shards`` read whole (``size`` bytes) by one `read_files` call, or []."""
    out = np.zeros(size * len(shards), dtype=np.uint8)
    offs = [size * i for i in range(len(shards))]
    done, _ = read_files(
        FileReads(
            prefix,
            names,
            *_arrays(shards, [0] * len(shards), [size] * len(shards)),
            out,
            *_arrays(offs, [size] * len(shards), [1] * len(shards)),
        ),
        threads=1,
    )
    return [out[o : o + size].tobytes() for o in offs] if done == len(shards) else []


@native
def test_a_prefix_folder_renamed_over_between_reads_is_seen_by_the_next_read(
    tmp_path: Path,
) -> None:
    """The loop opens files through the prefix's folder, opened afresh by each call: a
    folder renamed away and another put at its path between two reads is read from its
    new files by the next read (as opens by path), never from the old folder's; names
    of subfolders are walked as usual."""
    root = tmp_path / "data"
    prefix, _, old = _files(root / "sub", [64, 64])
    prefix = os.fsencode(str(root) + os.sep)
    names = [b"sub/f0", b"sub/f1"]
    assert _read_whole(prefix, names, [1, 0], 64) == [old[1], old[0]]
    root.rename(tmp_path / "data.old")
    rng = np.random.default_rng(99)
    new = [rng.integers(0, 256, 64, dtype=np.uint8).tobytes() for _ in range(2)]
    (root / "sub").mkdir(parents=True)
    for i, data in enumerate(new):
        (root / "sub" / f"f{i}").write_bytes(data)
    assert new != old
    assert _read_whole(prefix, names, [0, 1], 64) == new
    shutil.rmtree(root)
    assert _read_whole(prefix, names, [0], 64) == []  # gone: the caller's loop raises


@native
def test_names_and_prefixes_that_the_folder_cannot_serve_are_opened_by_path(
    tmp_path: Path,
) -> None:
    """A name starting with ``/`` is still the file prefix + name (not opened from the
    file system's root); a prefix not ending in a separator (a file name prefix) and a
    prefix that is not a folder read what prefix + name names, or nothing."""
    prefix, _, contents = _files(tmp_path / "d", [32, 32])
    assert _read_whole(prefix, [b"/f1", b"f0"], [0, 1], 32) == [contents[1], contents[0]]
    bare = os.fsencode(str(tmp_path / "d" / "f"))  # "<dir>/f" + "0" -> "<dir>/f0"
    assert _read_whole(bare, [b"0", b"1"], [1, 0], 32) == [contents[1], contents[0]]
    not_folder = os.fsencode(str(tmp_path / "d" / "f0") + os.sep)
    assert _read_whole(not_folder, [b"f1"], [0], 32) == []


def _ident(path: Path) -> list[int]:
    st = os.stat(path)
    return [st.st_ino, st.st_dev, st.st_mtime_ns]


def _whole(sizes: list[int], shards: list[int]) -> list[np.ndarray]:
    """`read_files` arguments reading each of ``shards`` whole, one after the other."""
    at = np.cumsum([0] + [sizes[s] for s in shards]).tolist()
    wants = [sizes[s] for s in shards]
    return [np.asarray(v, dtype=np.int64) for v in (shards, [0] * len(shards), wants)] + [
        np.zeros(max(at[-1], 1), dtype=np.uint8),
        np.asarray(at[:-1], dtype=np.int64),
        np.asarray(wants, dtype=np.int64),
        np.ones(len(shards), dtype=np.int64),
    ]


@native
def test_the_loop_records_a_first_open_and_keeps_it_after_a_replacement(tmp_path: Path) -> None:
    """With a first-open table, each shard it has no record of gets the identity of the
    file opened (``os.stat`` of it); a shard already recorded keeps its record when the
    file is replaced, while the read's own stats show the new file (what the caller's
    check compares); shards not read stay unrecorded."""
    sizes = [10, 20, 30]
    prefix, names, contents = _files(tmp_path, sizes)
    first = FirstOpens(np.asarray(sizes))
    shards, file_at, wants, out, iov_off, iov_len, count = _whole(sizes, [2, 0])
    done, _ = read_files(
        FileReads(prefix, names, shards, file_at, wants, out, iov_off, iov_len, count, first)
    )
    assert done == 2 and out.tobytes() == contents[2] + contents[0]
    assert first.states.tolist() == [RECORDED, NONE, RECORDED]
    assert first.ident[0].tolist() == _ident(tmp_path / "f0")
    assert first.ident[2].tolist() == _ident(tmp_path / "f2")
    original = _ident(tmp_path / "f2")
    (tmp_path / "new").write_bytes(contents[2][::-1])
    os.replace(tmp_path / "new", tmp_path / "f2")
    shards, file_at, wants, out, iov_off, iov_len, count = _whole(sizes, [2])
    done, stats = read_files(
        FileReads(prefix, names, shards, file_at, wants, out, iov_off, iov_len, count, first)
    )
    assert done == 1 and out.tobytes() == contents[2][::-1]
    assert first.ident[2].tolist() == original != _ident(tmp_path / "f2")
    assert stats[0, INODE : MTIME_NS + 1].view(np.uint64).tolist() == _ident(tmp_path / "f2")


@native
@pytest.mark.parametrize("threads", [1, 2])
def test_a_file_of_the_wrong_size_stops_the_loop_unread_and_unrecorded(
    tmp_path: Path, threads: int
) -> None:
    """A first open whose file is not the table's size stops the loop there, before its
    read: nothing of it is written or recorded (the caller's loop raises the error)."""
    sizes = [64] * 40
    prefix, names, contents = _files(tmp_path, sizes)
    (tmp_path / "f5").write_bytes(contents[5][:32])  # truncated: 32 bytes, table says 64
    first = FirstOpens(np.asarray(sizes))
    order = list(range(40))
    shards, file_at, wants, out, iov_off, iov_len, count = _whole([64] * 40, order)
    wants[5] = iov_len[5] = 32  # a read of what the file holds would succeed
    done, _ = read_files(
        FileReads(prefix, names, shards, file_at, wants, out, iov_off, iov_len, count, first),
        threads=threads,
    )
    assert done == 5
    assert out[5 * 64 : 6 * 64].tobytes() == bytes(64)  # unread
    assert first.states[5] == NONE and first.states[:5].tolist() == [RECORDED] * 5
    assert first.states[6:20].tolist() == [NONE] * 14  # the first share stops there


@native
def test_a_shard_outside_the_table_and_a_partial_table_raise_before_any_read(
    tmp_path: Path,
) -> None:
    from detdata.storage import _fileread

    sizes = [16, 16, 16]
    prefix, names, _ = _files(tmp_path, sizes)
    first = FirstOpens(np.asarray(sizes[:2]))  # no row for shard 2
    shards, file_at, wants, out, iov_off, iov_len, count = _whole(sizes, [0, 2])
    with pytest.raises(ValueError, match="outside the first-open table"):
        read_files(
            FileReads(prefix, names, shards, file_at, wants, out, iov_off, iov_len, count, first)
        )
    assert not out.any() and first.states.tolist() == [NONE, NONE]
    stats = np.zeros((2, 5), dtype=np.int64)
    args = (prefix, names, shards, file_at, wants, out, iov_off, iov_len, count, stats, 1)
    with pytest.raises(ValueError, match="go together"):
        _fileread.read_shards(*args, first.state, None, None)
    with pytest.raises(ValueError, match="mismatched"):
        _fileread.read_shards(*args, first.state, first.ident[:1], first.sizes)


@native
def test_arrays_of_another_element_type_raise_before_any_read(tmp_path: Path) -> None:
    """Index arrays, tables and stats of the wrong element type (same byte length: int32
    pairs for int64, float64 for uint64) are refused naming the argument, nothing read or
    recorded."""
    from detdata.storage import _fileread

    sizes = [16, 16]
    prefix, names, _ = _files(tmp_path, sizes)
    first = FirstOpens(np.asarray(sizes))
    shards, file_at, wants, out, iov_off, iov_len, count = _whole(sizes, [0, 1])
    stats = np.zeros((2, 5), dtype=np.int64)
    good = [shards, file_at, wants, out, iov_off, iov_len, count, stats]
    for i, name in [(0, "shards"), (1, "file_at"), (6, "iov_count"), (7, "stats")]:
        bad = list(good)
        bad[i] = good[i].view(np.int32)  # the same bytes read as twice as many int32
        with pytest.raises(ValueError, match=f"{name} must hold native int64"):
            _fileread.read_shards(prefix, names, *bad, 1, first.state, first.ident, first.sizes)
    with pytest.raises(ValueError, match="ident must hold native uint64"):
        _fileread.read_shards(
            prefix, names, *good, 1, first.state, first.ident.view(np.float64), first.sizes
        )
    with pytest.raises(ValueError, match="state must hold native uint8"):
        _fileread.read_shards(
            prefix, names, *good, 1, first.states.view(np.int8), first.ident, first.sizes
        )
    now = np.zeros((2, 3), dtype=np.uint64)
    with pytest.raises(ValueError, match="ids must hold native int64"):
        _fileread.record_firsts(first.state, first.ident, np.zeros(4, np.int32), now, now.copy())
    with pytest.raises(ValueError, match="seen must hold native uint64"):
        _fileread.record_firsts(
            first.state, first.ident, shards, now, np.zeros((2, 3), dtype=np.float64)
        )
    assert not out.any() and first.states.tolist() == [NONE, NONE]
    assert read_files(FileReads(prefix, names, *good[:7], first))[0] == 2  # the right types read


@pytest.mark.parametrize("native_record", [True, False])
def test_threads_recording_at_once_agree_on_one_first_file(
    monkeypatch: pytest.MonkeyPatch, native_record: bool
) -> None:
    """8 threads record different identities for the same 500 shards at once (each its own
    shard order): every shard ends with exactly one of them, and every thread was told
    that one. Both the native compare-and-swap and the Python lock (no extension)."""
    if native_record:
        assert fileread.NATIVE, "detdata.storage._fileread was not built"
    else:
        monkeypatch.setattr(first_opens, "_fileread", None)
    n, threads = 500, 8
    first = FirstOpens(np.full(n, 8))
    seen: dict[int, np.ndarray] = {}
    start = threading.Barrier(threads)

    def run(t: int) -> None:
        ids = np.random.default_rng(t).permutation(n).astype(np.int64)
        now = np.stack([ids, np.full(n, 100 + t), np.full(n, 7)], axis=1).astype(np.uint64)
        start.wait()
        got = np.concatenate(
            [first.record_many(ids[i : i + 10], now[i : i + 10]) for i in range(0, n, 10)]
        )
        out = np.empty_like(got)
        out[ids] = got
        seen[t] = out

    pool = [threading.Thread(target=run, args=(t,)) for t in range(threads)]
    for th in pool:
        th.start()
    for th in pool:
        th.join()
    assert first.states.tolist() == [RECORDED] * n
    for t in range(threads):
        np.testing.assert_array_equal(seen[t], first.ident)
    assert (first.ident[:, 0] == np.arange(n)).all() and (first.ident[:, 2] == 7).all()
    assert set(first.ident[:, 1].tolist()) <= set(range(100, 100 + threads))
    assert first.record(3, (1, 2, 3)) == tuple(first.ident[3].tolist())  # kept, not replaced


def test_a_first_open_table_is_never_pickled() -> None:
    with pytest.raises(TypeError, match="per process"):
        pickle.dumps(FirstOpens(np.asarray([1, 2])))


# ------------------------------------------------------------------ start_read_files
@native
@settings(max_examples=30, deadline=None)
@given(st.data())
def test_a_background_read_gives_what_read_files_gives(
    tmp_path_factory: pytest.TempPathFactory,
    data,  # type: ignore[no-untyped-def]
) -> None:
    """Random files (some missing), ranges, buffer splits and 1 or 2 threads: `wait` returns
    the ``done`` of `read_files` (the first missing file's index) and ``out`` holds each
    range read (the writer's bytes); the stats of the files read are those of `read_files`."""
    sizes = data.draw(st.lists(st.integers(1, 300), min_size=1, max_size=40))
    prefix, names, contents = _files(tmp_path_factory.mktemp("f"), sizes)
    gone = data.draw(st.sets(st.integers(0, len(sizes) - 1), max_size=2))
    for i in gone:
        os.unlink(os.fsdecode(prefix) + f"f{i}")
    order = data.draw(st.lists(st.integers(0, len(sizes) - 1), min_size=1, max_size=60))
    file_at = [data.draw(st.integers(0, sizes[s] - 1)) for s in order]
    wants = [sizes[s] - at for s, at in zip(order, file_at, strict=True)]
    iov_off = np.cumsum([0, *wants[:-1]]).tolist()
    args = (*_arrays(order, file_at, wants), None, *_arrays(iov_off, wants, [1] * len(order)))
    total = sum(wants)
    threads = data.draw(st.sampled_from([1, 2]))
    ref_out = np.zeros(total, dtype=np.uint8)
    ref_done, ref_stats = read_files(FileReads(prefix, names, *args[:3], ref_out, *args[4:]))
    out = np.zeros(total, dtype=np.uint8)
    pending = fileread.start_read_files(
        FileReads(prefix, names, *args[:3], out, *args[4:]), threads=threads
    )
    done, stats = pending.wait()
    first_gone = next((i for i, s in enumerate(order) if s in gone), len(order))
    assert done == ref_done == first_gone
    for i in range(done):
        at, want = file_at[i], wants[i]
        assert out[iov_off[i] : iov_off[i] + want].tobytes() == contents[order[i]][at : at + want]
    np.testing.assert_array_equal(stats[:done], ref_stats[:done])
    assert pending.wait()[0] == done  # waiting again answers the same


@native
def test_dropping_a_background_read_joins_it_first(tmp_path: Path) -> None:
    """A PendingRead dropped without `wait` joins its threads: once ``del`` returns, the
    whole file is in ``out`` and nothing writes there any more (64 MiB: tens of ms to read,
    so a drop that did not wait would be caught mid-read)."""
    prefix, names, contents = _files(tmp_path, [64 << 20])
    out = np.zeros(64 << 20, dtype=np.uint8)
    args = _arrays([0], [0], [64 << 20])
    pending = fileread.start_read_files(
        FileReads(prefix, names, *args, out, *_arrays([0], [64 << 20], [1])), threads=1
    )
    del pending
    assert out[-4096:].tobytes() == contents[0][-4096:]  # the last page first: read already
    assert out.tobytes() == contents[0]


@native
def test_a_background_read_keeps_its_buffer_alive(tmp_path: Path) -> None:
    """The caller may drop its own reference to ``out`` (and the index arrays): the
    PendingRead holds them until the read ends (no write into freed memory)."""
    prefix, names, _contents = _files(tmp_path, [4096] * 20)
    pendings = [
        fileread.start_read_files(
            FileReads(
                prefix,
                names,
                *_arrays(list(range(20)), [0] * 20, [4096] * 20),
                np.zeros(20 * 4096, dtype=np.uint8),
                *_arrays([i * 4096 for i in range(20)], [4096] * 20, [1] * 20),
            ),
            threads=2,
        )
        for _ in range(50)
    ]
    assert [p.wait()[0] for p in pendings] == [20] * 50


def _in_child(run: Callable[[], str]) -> str:
    """``run()`` in a forked child; what it returned (or its error)."""
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:
        try:
            answer = run()
        except BaseException as exc:  # reported to the parent
            answer = f"error {exc!r}"
        os.write(w, answer.encode()[:500])
        os._exit(0)
    os.close(w)
    got = os.read(r, 600).decode()
    os.close(r)
    os.waitpid(pid, 0)
    return got


def _fds_on(path: Path) -> int:
    """Descriptors of this process open on ``path``."""
    count = 0
    for fd in os.listdir("/proc/self/fd"):
        with contextlib.suppress(OSError):
            count += os.readlink(f"/proc/self/fd/{fd}") == str(path)
    return count


@native
def test_a_fork_waits_for_background_reads_so_no_child_inherits_their_files(
    tmp_path: Path,
) -> None:
    """A fork while reads run (a torch worker forked mid-read): the reads are joined first
    (`_join_before_fork`), so the child holds no descriptor of a file being read (it would
    have no thread to close it) and sees the whole read; 20 forks, each right after a
    start, with a 32 MiB file (milliseconds of reading)."""
    prefix, names, contents = _files(tmp_path, [32 << 20])
    for _ in range(20):
        out = np.zeros(32 << 20, dtype=np.uint8)
        pending = fileread.start_read_files(
            FileReads(
                prefix, names, *_arrays([0], [0], [32 << 20]), out, *_arrays([0], [32 << 20], [1])
            )
        )

        def child(pending: fileread.PendingRead = pending, out: np.ndarray = out) -> str:
            done, _ = pending.wait()
            whole = out.tobytes() == contents[0]
            return f"{_fds_on(tmp_path / 'f0')} {done} {whole}"

        assert _in_child(child) == "0 1 True"
        assert pending.wait()[0] == 1 and out.tobytes() == contents[0]


@native
def test_a_raw_background_read_in_a_forked_child_counts_nothing_read(tmp_path: Path) -> None:
    """The native object itself (not joined by the fork hook): its threads do not exist in
    a forked child, so the child's `wait` joins nothing and returns 0 at once (the caller
    reads again); the parent's read is whole."""
    from detdata.storage import _fileread

    prefix, names, contents = _files(tmp_path, [32 << 20])
    out = np.zeros(32 << 20, dtype=np.uint8)
    stats = np.zeros((1, 5), dtype=np.int64)
    raw = _fileread.start_read_shards(
        prefix, names, *_arrays([0], [0], [32 << 20]), out, *_arrays([0], [32 << 20], [1]), stats
    )

    def child() -> str:
        began = time.perf_counter()
        done = raw.wait()
        return f"{done} {time.perf_counter() - began:.3f}"

    done, seconds = _in_child(child).split()
    assert int(done) == 0 and float(seconds) < 5.0
    assert raw.wait() == 1 and out.tobytes() == contents[0]


@native
def test_a_background_read_copies_its_index_arrays(tmp_path: Path) -> None:
    """The caller may reuse its offset arrays at once: shifting every buffer offset (out of
    ``out``'s range) right after the start changes nothing the threads read or write."""
    prefix, names, contents = _files(tmp_path, [4096] * 200)
    shards, file_at, wants = _arrays(list(range(200)), [0] * 200, [4096] * 200)
    iov_off, iov_len, count = _arrays([i * 4096 for i in range(200)], [4096] * 200, [1] * 200)
    out = np.zeros(200 * 4096, dtype=np.uint8)
    guard = np.zeros(1 << 20, dtype=np.uint8)  # memory that a stray write could hit
    pending = fileread.start_read_files(
        FileReads(prefix, names, shards, file_at, wants, out, iov_off, iov_len, count), threads=2
    )
    iov_off += 1 << 30
    count[:] = 7
    shards[:] = 0
    done, _ = pending.wait()
    assert done == 200
    assert out.tobytes() == b"".join(contents)
    assert not guard.any()


def _wait_into(pending: fileread.PendingRead, answers: list[int]) -> None:
    answers.append(pending.wait()[0])


@native
def test_waiting_from_several_threads_answers_each_the_same(tmp_path: Path) -> None:
    prefix, names, _ = _files(tmp_path, [1 << 20] * 8)
    for _ in range(20):
        out = np.zeros(8 << 20, dtype=np.uint8)
        pending = fileread.start_read_files(
            FileReads(
                prefix,
                names,
                *_arrays(list(range(8)), [0] * 8, [1 << 20] * 8),
                out,
                *_arrays([i << 20 for i in range(8)], [1 << 20] * 8, [1] * 8),
            ),
            threads=2,
        )
        answers: list[int] = []
        waiters = [threading.Thread(target=_wait_into, args=(pending, answers)) for _ in range(4)]
        for t in waiters:
            t.start()
        for t in waiters:
            t.join()
        assert answers == [8] * 4


@native
def test_a_background_read_refuses_arguments_that_do_not_fit_before_reading(
    tmp_path: Path,
) -> None:
    prefix, names, _ = _files(tmp_path, [40])
    out = np.zeros(10, dtype=np.uint8)
    with pytest.raises(ValueError, match="outside `out`"):
        fileread.start_read_files(
            FileReads(prefix, names, *_arrays([0], [0], [40]), out, *_arrays([0], [40], [1]))
        )
    assert not out.any()


def test_a_background_read_without_the_extension_reads_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    prefix, names, _ = _files(tmp_path, [40])
    monkeypatch.setattr(fileread, "_fileread", None)
    out = np.zeros(40, dtype=np.uint8)
    pending = fileread.start_read_files(
        FileReads(prefix, names, *_arrays([0], [0], [40]), out, *_arrays([0], [40], [1]))
    )
    done, stats = pending.wait()
    assert done == 0 and not out.any() and stats.shape == (1, 5)
