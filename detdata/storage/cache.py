"""A bounded, verified local cache of whole remote shards, safe across processes.

`ShardCache(directory, max_bytes)` keeps copies of remote shards on local disk
so that readers use the local fast path (memmaps, local Parquet/Arrow readers).
Layout under ``directory``::

    objects/<blake3 hex>                 a verified copy (named by its content digest)
    tmp/<hex>.<bytes>.<pid>.<n>.part     a fill in progress (counted at its full size)
    locks/<hex>.lock                     serialises fills of one shard (fcntl.flock)
    .lock                                serialises space accounting and eviction

Contracts:

* A copy is named by the manifest's blake3 of its content, so it can only hold
  those bytes: a fill streams the shard in retried range reads to a temp file,
  hashes every byte while writing, and is renamed into ``objects/`` only when
  size and blake3 match the manifest entry (else the temp file is dropped and
  the download repeated, then `VerificationError`). Nothing unverified is
  ever served.
* Every open (the first use of a shard in a process, or after the copy
  changed) re-checks the copy's size and quick digest (``verify_on_open="full"``
  re-hashes every byte). A copy that fails is deleted, logged and fetched again.
* ``max_bytes`` bounds the bytes in ``objects/`` plus fills in progress. Before
  a fill reserves its space, least recently used copies (file mtime, refreshed
  on use) are deleted. A shard larger than ``max_bytes`` is a `ConfigError`.
  Processes that still have an evicted copy open keep reading it (POSIX keeps
  unlinked files alive while open), so eviction never corrupts a reader.
* Fills of one shard are serialised by a per-shard ``flock`` (threads and
  processes): concurrent readers wait for one download instead of racing.
  Locks are released by the kernel when a process dies; a dead process's temp
  file is removed at the next accounting.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import itertools
import logging
import os
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, Final, Protocol

import blake3
import fsspec

from detdata.base.errors import ConfigError, VerificationError
from detdata.base.hashing import PREFIX, QUICK_SPAN, quick_digest_parts
from detdata.storage.fs import iter_chunks
from detdata.storage.retry import RetryPolicy, check_policy


class ShardEntry(Protocol):
    """What the cache needs of a manifest entry (`detdata.identity.manifest.ShardEntry` fits)."""

    @property
    def path(self) -> str: ...

    @property
    def bytes(self) -> int: ...

    @property
    def blake3(self) -> str: ...

    @property
    def quick(self) -> str: ...


log: Final = logging.getLogger("detdata.cache")
VERIFY_ON_OPEN: Final = ("quick", "full")
FILL_ATTEMPTS: Final = 3  # downloads of one shard whose blake3 does not match, before giving up
_TOUCH_EVERY_S: Final = 1.0


@dataclass
class CacheStats:
    """Counters of one `ShardCache` object (this process only)."""

    hits: int = 0
    fills: int = 0
    fill_bytes: int = 0
    corrupt: int = 0
    evictions: int = 0


def _hex(entry: ShardEntry) -> str:
    return entry.blake3[len(PREFIX) :]


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


class ShardCache:
    """Verified copies of remote shards under ``directory``, at most ``max_bytes`` in total.

    ``path(entry, fs, remote_path, url)`` returns the local path of a verified
    copy, filling it first if needed. ``retry`` governs the range reads of a
    fill (each ``chunk_bytes`` chunk is retried on its own). See the module
    docstring for the contracts.
    """

    def __init__(
        self,
        directory: str | os.PathLike[str],
        max_bytes: int,
        *,
        retry: RetryPolicy | None = None,
        chunk_bytes: int = 8 << 20,
        verify_on_open: str = "quick",
    ) -> None:
        if isinstance(max_bytes, bool) or not isinstance(max_bytes, int) or max_bytes < 1:
            raise ConfigError(f"cache max_bytes must be a positive integer, got {max_bytes!r}")
        if isinstance(chunk_bytes, bool) or not isinstance(chunk_bytes, int) or chunk_bytes < 1:
            raise ConfigError(f"cache chunk_bytes must be a positive integer, got {chunk_bytes!r}")
        if verify_on_open not in VERIFY_ON_OPEN:
            raise ConfigError(
                f"verify_on_open must be one of {VERIFY_ON_OPEN}, got {verify_on_open!r}"
            )
        directory = os.fspath(directory)
        if "://" in directory and not directory.startswith("file://"):
            raise ConfigError(f"cache_dir must be a local directory, got {directory!r}")
        self.directory = os.path.abspath(directory.removeprefix("file://"))
        self.max_bytes = max_bytes
        self.chunk_bytes = chunk_bytes
        self.verify_on_open = verify_on_open
        self.retry = check_policy(retry)
        self.stats = CacheStats()
        self._counter = itertools.count()
        self._touched: dict[str, float] = {}
        self._mutex = threading.Lock()
        for sub in ("objects", "tmp", "locks"):
            os.makedirs(os.path.join(self.directory, sub), exist_ok=True)

    def __repr__(self) -> str:
        return f"ShardCache({self.directory!r}, max_bytes={self.max_bytes})"

    # paths -------------------------------------------------------------------
    def object_path(self, entry: ShardEntry) -> str:
        """Where the verified copy of ``entry`` lives (whether or not it is there now)."""
        return os.path.join(self.directory, "objects", _hex(entry))

    def usage(self) -> int:
        """Bytes in verified copies plus fills in progress (their full size)."""
        objects, reserved = self._scan()
        return sum(size for _, size, _ in objects) + reserved

    # public API ------------------------------------------------------------
    def path(
        self, entry: ShardEntry, fs: fsspec.AbstractFileSystem, remote_path: str, url: str
    ) -> str:
        """The local path of a verified copy of ``entry`` (fetched from ``remote_path`` if needed).

        ``url`` names the shard's location in errors and logs.
        """
        final = self.object_path(entry)
        problem = self._check(final, entry)
        if problem is None:
            self.stats.hits += 1
            self.touch(final, force=True)
            return final
        with self._shard_lock(entry):
            problem = self._check(final, entry)  # another thread/process may have filled it
            if problem is None:
                self.stats.hits += 1
                self.touch(final, force=True)
                return final
            if problem != "missing":
                self.stats.corrupt += 1
                log.warning(
                    "detdata: cached copy of shard %s (%s) is corrupted: %s; deleting "
                    "it and fetching %s again",
                    entry.path,
                    final,
                    problem,
                    url,
                )
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(final)
            self._fill(entry, fs, remote_path, url, final)
            return final

    def touch(self, path: str, *, force: bool = False) -> None:
        """Mark a copy as recently used (LRU), at most once a second per copy unless forced."""
        now = time.monotonic()
        with self._mutex:
            if not force and now - self._touched.get(path, -1e9) < _TOUCH_EVERY_S:
                return
            self._touched[path] = now
        with contextlib.suppress(FileNotFoundError):
            os.utime(path)

    # checks ------------------------------------------------------------------
    def _check(self, path: str, entry: ShardEntry) -> str | None:
        """None if ``path`` holds ``entry``'s bytes (size + quick or full digest), else why not."""
        try:
            size = os.stat(path).st_size
        except FileNotFoundError:
            return "missing"
        if size != entry.bytes:
            return f"size {size} bytes, the manifest says {entry.bytes}"
        if self.verify_on_open == "full":
            found = _full_local(path)
            if found != entry.blake3:
                return f"blake3 {found}, the manifest says {entry.blake3}"
            return None
        found = _quick_local(path, size)
        if found != entry.quick:
            return f"quick digest {found}, the manifest says {entry.quick}"
        return None

    # filling -----------------------------------------------------------------
    def _fill(
        self,
        entry: ShardEntry,
        fs: fsspec.AbstractFileSystem,
        remote_path: str,
        url: str,
        final: str,
    ) -> None:
        if entry.bytes > self.max_bytes:
            raise ConfigError(
                f"shard {entry.path} ({url}) is {entry.bytes} bytes, more than the "
                f"whole cache ({self.max_bytes} bytes in {self.directory}); hint: "
                "raise shard_cache_bytes, or drop cache_dir to read it with range reads"
            )
        tmp = self._reserve(entry, final)
        try:
            found = ""
            for attempt in range(1, FILL_ATTEMPTS + 1):
                found, written = self._download(entry, fs, remote_path, url, tmp)
                if written == entry.bytes and found == entry.blake3:
                    break
                log.warning(
                    "detdata: download %d/%d of shard %s from %s gave %d bytes with "
                    "blake3 %s, expected %d bytes with %s",
                    attempt,
                    FILL_ATTEMPTS,
                    entry.path,
                    url,
                    written,
                    found,
                    entry.bytes,
                    entry.blake3,
                )
            else:
                raise VerificationError(
                    f"shard {entry.path} at {url}: {FILL_ATTEMPTS} downloads hashed to {found}, "
                    f"the manifest says {entry.blake3}; the stored object differs from the one "
                    "the manifest was built from (rewritten?); hint: rebuild the manifest or "
                    "restore the shard",
                    shard=entry.path,
                    field="blake3",
                    expected=entry.blake3,
                    found=found,
                )
            os.replace(tmp, final)
        except BaseException:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(tmp)
            raise
        self.stats.fills += 1
        self.stats.fill_bytes += entry.bytes
        self.touch(final, force=True)
        self._make_room(0, keep=final)

    def _download(
        self, entry: ShardEntry, fs: fsspec.AbstractFileSystem, remote_path: str, url: str, tmp: str
    ) -> tuple[str, int]:
        """Stream the shard into ``tmp`` (truncated first); return (blake3, bytes written)."""
        hasher = blake3.blake3()
        written = 0
        with open(tmp, "wb") as fh:
            for data in iter_chunks(
                fs,
                remote_path,
                entry.bytes,
                policy=self.retry,
                shard=entry.path,
                url=url,
                chunk=self.chunk_bytes,
            ):
                fh.write(data)
                hasher.update(data)
                written += len(data)
            fh.flush()
            os.fsync(fh.fileno())
        return PREFIX + hasher.hexdigest(), written

    # space accounting ----------------------------------------------------------
    def _reserve(self, entry: ShardEntry, final: str) -> str:
        """Evict until ``entry`` fits, then create its temp file (counted from now on)."""
        name = f"{_hex(entry)}.{entry.bytes}.{os.getpid()}.{next(self._counter)}.part"
        tmp = os.path.join(self.directory, "tmp", name)
        with self._global_lock():
            self._evict_locked(entry.bytes, keep=final)
            with open(tmp, "wb"):
                pass
        return tmp

    def _make_room(self, incoming: int, *, keep: str) -> None:
        with self._global_lock():
            self._evict_locked(incoming, keep=keep)

    def _evict_locked(self, incoming: int, *, keep: str) -> None:
        objects, reserved = self._scan()
        total = sum(size for _, size, _ in objects) + reserved + incoming
        for _, size, path in sorted(objects):  # oldest first (mtime, then name)
            if total <= self.max_bytes:
                break
            if path == keep:
                continue
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)
                self.stats.evictions += 1
                log.info("detdata: evicted %s (%d bytes) from the shard cache", path, size)
            total -= size
        if total > self.max_bytes:
            log.warning(
                "detdata: shard cache %s holds %d bytes (bound %d) while fills are in "
                "progress in other processes",
                self.directory,
                total,
                self.max_bytes,
            )

    def _scan(self) -> tuple[list[tuple[int, int, str]], int]:
        """``([(mtime_ns, size, path) of copies], bytes reserved by live fills)``."""
        objects = []
        odir = os.path.join(self.directory, "objects")
        for name in os.listdir(odir):
            path = os.path.join(odir, name)
            try:
                st = os.stat(path)
            except FileNotFoundError:
                continue
            objects.append((st.st_mtime_ns, st.st_size, path))
        reserved = 0
        tdir = os.path.join(self.directory, "tmp")
        for name in os.listdir(tdir):
            parts = name.split(".")
            if (
                len(parts) != 5
                or parts[-1] != "part"
                or not parts[1].isdigit()
                or not parts[2].isdigit()
            ):
                continue
            if int(parts[2]) != os.getpid() and not _pid_alive(int(parts[2])):
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(os.path.join(tdir, name))  # left behind by a dead process
                continue
            reserved += int(parts[1])
        return objects, reserved

    # locks -------------------------------------------------------------------
    @contextlib.contextmanager
    def _shard_lock(self, entry: ShardEntry) -> Iterator[None]:
        with _flock(os.path.join(self.directory, "locks", f"{_hex(entry)}.lock")):
            yield

    @contextlib.contextmanager
    def _global_lock(self) -> Iterator[None]:
        with _flock(os.path.join(self.directory, ".lock")):
            yield

    # pickling: parameters only ---------------------------------------------------
    def __getstate__(self) -> dict[str, Any]:
        return {
            "directory": self.directory,
            "max_bytes": self.max_bytes,
            "chunk_bytes": self.chunk_bytes,
            "verify_on_open": self.verify_on_open,
            "retry": self.retry,
        }

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__init__(  # type: ignore[misc]
            state["directory"],
            state["max_bytes"],
            retry=state["retry"],
            chunk_bytes=state["chunk_bytes"],
            verify_on_open=state["verify_on_open"],
        )


@contextlib.contextmanager
def _flock(path: str) -> Iterator[None]:
    """An exclusive ``flock`` on ``path`` (own descriptor: excludes threads and processes)."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX)
                break
            except OSError as exc:  # EINTR
                if exc.errno != errno.EINTR:
                    raise
        yield
    finally:
        os.close(fd)


def _quick_local(path: str, size: int) -> str:
    span = min(size, QUICK_SPAN)
    with open(path, "rb") as fh:
        head = fh.read(span)
        fh.seek(size - span)
        tail = fh.read(span)
    return quick_digest_parts(size, head, tail)


def _full_local(path: str) -> str:
    hasher = blake3.blake3()
    with open(path, "rb") as fh:
        while chunk := fh.read(8 << 20):
            hasher.update(chunk)
    return PREFIX + hasher.hexdigest()
