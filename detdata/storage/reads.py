"""Reads of byte ranges of local shard files, checked at every open: the one home of the
batched file loop, single-file reads, read plans and read-ahead.

A dataset turns sample ids into ``(shard, byte range, buffer)``; everything here moves the
bytes, checked by the reader's `OpenChecks` (size against the manifest, the file against the
one first opened, a missing file, a short read; each raises naming the shard). `execute`
reads a `ReadPlan` (per file: one open, ONE ``preadv``, an ``fstat`` after, a close) with the
native loop (`detdata.storage.fileread`) where `NATIVE`, else with its Python twin: the same
bytes and checks, in the same order. `ReadAhead` keeps plans whose first files are read on
native threads in the background. `opened` / `pread_exact`: one file without the batched loop.
"""

from __future__ import annotations

import collections
import os
import threading
from collections.abc import Callable
from typing import Any, NamedTuple, NoReturn

import numpy as np
import numpy.typing as npt

from detdata.base.errors import VerificationError
from detdata.storage import fileread
from detdata.storage.fileread import (
    INODE,
    MTIME_NS,
    SIZE,
    FileReads,
    PendingRead,
    read_files,
    start_read_files,
)
from detdata.storage.first_opens import RECORDED, FirstOpens, file_identity

IntArray = npt.NDArray[np.int64]
U64Array = npt.NDArray[np.uint64]

#: Whether reads go through the native loop (tests set it False to run the Python twin).
NATIVE: bool = fileread.NATIVE


class OpenChecks(NamedTuple):
    """The reader's checks of the files a read opens (each raises naming the shard):
    ``stats(shards, sizes, idents, prefix)`` of many ``fstat`` s taken after the reads (the
    first culprit raises); ``stat(shard, st, path)`` of one open (a first open is recorded);
    ``missing(shard, path)``: the error for an absent file; ``short(fd, shard, path, nbytes,
    offset)`` raises for a read that got fewer bytes."""

    stats: Callable[[IntArray, IntArray, U64Array, str], None]
    stat: Callable[[int, os.stat_result, str], None]
    missing: Callable[[int, str], BaseException]
    short: Callable[[int, int, str, int, int], NoReturn]


class ReadPlan(NamedTuple):
    """A read as a value: the `FileReads` to read in order, checked with ``checks`` before
    any byte is returned; ``first``: the reader's first-open records (``reads[i].first``,
    what the native loop records into, is None for cached copies)."""

    reads: tuple[FileReads, ...]
    checks: OpenChecks
    first: FirstOpens


def execute(plan: ReadPlan, started: PendingRead | None = None) -> None:
    """Read every file of ``plan`` into its buffers, in order, checked with ``plan.checks``:
    the native loop where `NATIVE`, then the Python twin from the first file it could not read
    (the twin raises the error). ``started``: the native read of ``plan.reads[0]`` already
    running (`ReadAhead`)."""
    for i, reads in enumerate(plan.reads):
        prefix = os.fsdecode(reads.prefix)
        done = 0
        if (started is not None and i == 0) or NATIVE:
            done, stats = started.wait() if started is not None and i == 0 else read_files(reads)
            plan.checks.stats(
                reads.shards[:done],
                stats[:done, SIZE],
                stats[:done, INODE : MTIME_NS + 1].view(np.uint64),
                prefix,
            )
            if done == reads.shards.size:
                continue
        _read_python(reads, done, plan.checks, prefix, plan.first.state)


def _read_python(
    reads: FileReads, done: int, checks: OpenChecks, prefix: str, recorded: bytearray
) -> None:
    """`execute`'s Python twin, from file ``done`` on: a first open is recorded before its
    read (``checks.stat``); the ``fstat`` s after the reads are checked at the end, and before
    any other error raises (the shards read before it are named first)."""
    skip = int(reads.iov_count[:done].sum())
    shards: list[int] = reads.shards[done:].tolist()
    iov_off: list[int] = reads.iov_off[skip:].tolist()
    iov_len: list[int] = reads.iov_len[skip:].tolist()
    iov_end: list[int] = np.cumsum(reads.iov_count[done:]).tolist()
    flat = reads.out.data
    names = reads.names
    open_, fstat, preadv, close = os.open, os.fstat, os.preadv, os.close
    flags = os.O_RDONLY
    stats: list[os.stat_result] = []  # fstat of each shard after its read
    a = 0
    for sh, at, want, b in zip(
        shards, reads.file_at[done:].tolist(), reads.wants[done:].tolist(), iov_end, strict=True
    ):
        bufs = [flat[o : o + n] for o, n in zip(iov_off[a:b], iov_len[a:b], strict=True)]
        a = b
        path = prefix + os.fsdecode(names[sh])
        try:
            fd = open_(path, flags)
        except FileNotFoundError:
            _check_all(checks, shards, stats, prefix)
            raise checks.missing(sh, path) from None
        try:
            if recorded[sh] != RECORDED:  # a first open is recorded before its read
                try:
                    checks.stat(sh, fstat(fd), path)
                except VerificationError:  # the shards read before it are named first
                    _check_all(checks, shards, stats, prefix)
                    raise
            got = preadv(fd, bufs, at)
            stats.append(fstat(fd))  # after the read: a write the read saw shows
            if got != want:
                _check_all(checks, shards, stats, prefix)
                checks.short(fd, sh, path, want, at)
        finally:
            close(fd)
    _check_all(checks, shards, stats, prefix)


def _check_all(
    checks: OpenChecks, shards: list[int], stats: list[os.stat_result], prefix: str
) -> None:
    """``checks.stats`` of the opens so far (``stats[i]``: shard ``shards[i]``'s file)."""
    if not stats:
        return
    n = len(stats)
    sizes = np.fromiter((st.st_size for st in stats), np.int64, n)
    now = np.array([file_identity(st) for st in stats], dtype=np.uint64).reshape(n, 3)
    checks.stats(np.asarray(shards[:n], dtype=np.int64), sizes, now, prefix)


class Planned(NamedTuple):
    """A read planned ahead: its key (the ids it reads), its plan, the background read of its
    first `FileReads` (or None), and the owner's ``result``, handed back by `finish`."""

    key: IntArray
    plan: ReadPlan
    pending: PendingRead | None
    result: Any

    def finish(self) -> Any:
        """``result``, after the plan is read (`execute`)."""
        execute(self.plan, self.pending)
        return self.result

    def drop(self) -> None:
        """Forget it (its background read is joined first)."""
        if self.pending is not None:
            self.pending.wait()


class ReadAhead:
    """At most ``depth`` reads planned ahead (the oldest dropped), each with its first file
    read running on ``threads`` native threads meanwhile; thread-safe. The checks run when a
    read is taken and finished, so planning changes when files are read, never what."""

    def __init__(self, depth: int, threads: int) -> None:
        self.depth = depth
        self.threads = threads
        self._planned: collections.deque[Planned] = collections.deque()
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._planned)

    def __getitem__(self, i: int) -> Planned:
        return self._planned[i]

    @property
    def enabled(self) -> bool:
        """Whether reads are planned ahead (only with the native loop: `NATIVE`)."""
        return NATIVE

    def start(self, key: IntArray, plan: ReadPlan, result: Any) -> None:
        """Start the first file read of ``plan`` in the background; keep it under ``key``."""
        pending = start_read_files(plan.reads[0], threads=self.threads) if plan.reads else None
        ready = Planned(key, plan, pending, result)
        with self._lock:
            self._planned.append(ready)
            stale = [self._planned.popleft()] if len(self._planned) > self.depth else []
        for old in stale:
            old.drop()

    def take(self, key: IntArray) -> Planned | None:
        """The planned read of exactly ``key`` (taken; those planned before it are
        dropped), or None (every planned read is kept)."""
        stale: list[Planned] = []
        found = None
        with self._lock:
            pending = self._planned
            for i, ready in enumerate(pending):
                if ready.key.size == key.size and np.array_equal(ready.key, key):
                    stale = [pending.popleft() for _ in range(i)]
                    found = pending.popleft()
                    break
        for old in stale:
            old.drop()
        return found

    def clear(self) -> None:
        """Drop every planned read (their background reads are joined first)."""
        with self._lock:
            stale = list(self._planned)
            self._planned.clear()
        for old in stale:
            old.drop()


class opened:
    """``path`` (shard ``shard``'s file) open for the block: ``checks.stat`` at the open and
    after the reads, closed after; a missing file raises ``checks.missing``. (A class, not a
    generator: it runs once per shard read.)"""

    __slots__ = ("checks", "fd", "path", "shard")

    def __init__(self, path: str, shard: int, checks: OpenChecks) -> None:
        self.path, self.shard, self.checks = path, shard, checks
        self.fd = -1

    def __enter__(self) -> int:
        try:
            self.fd = os.open(self.path, os.O_RDONLY)
        except FileNotFoundError:
            raise self.checks.missing(self.shard, self.path) from None
        try:
            self.checks.stat(self.shard, os.fstat(self.fd), self.path)
        except BaseException:
            os.close(self.fd)
            raise
        return self.fd

    def __exit__(self, kind: type[BaseException] | None, *_: object) -> None:
        try:
            if kind is None:
                self.checks.stat(self.shard, os.fstat(self.fd), self.path)
        finally:
            os.close(self.fd)


def pread_exact(
    fd: int, buf: np.ndarray[Any, Any], offset: int, shard: int, path: str, checks: OpenChecks
) -> None:
    """Fill ``buf`` (contiguous) from ``fd`` at byte ``offset``; a short read raises
    ``checks.short`` (the file was truncated)."""
    if os.preadv(fd, [buf.data], offset) != buf.nbytes:
        checks.short(fd, shard, path, buf.nbytes, offset)
