"""A bounded, verified local cache of whole remote shards, safe across processes.

Layout under ``directory``: ``objects/<blake3 hex>`` (verified copies), ``tmp/*.part`` (fills
in progress, locked by their filler), ``locks/<hex>.lock`` (one fill per shard, ``flock``),
``.lock`` (space accounting and eviction), ``checked-<boot id>`` (`detdata.storage.boot`).
Contracts (docs/design.md, "Remote reads: coalescing and lookahead prefetch"):

* Nothing unverified is served: a fill hashes every byte as it writes and is renamed into
  ``objects/`` only when size and blake3 match the manifest (else downloaded again, then
  `VerificationError`). Every open re-checks size and quick digest (``verify_on_open="full"``:
  every byte); a copy that fails is deleted, logged and fetched again. A copy this process
  verified is not hashed again while its stamp holds (`detdata.storage.verified`).
* Who can write the folder decides what is trusted (`detdata.storage.cache_folder`).
* ``max_bytes`` bounds copies plus fills in progress: least recently used copies are evicted
  first, and a fill with no room waits for other fills; a larger shard is a `ConfigError`.
  Eviction never corrupts a reader (POSIX keeps an open unlinked file alive).
* A stopped lock holder is a `StorageError` after ``retry.deadline_s``; a full or failing
  disk is a `StorageError` naming the folder, with the hint.
"""

from __future__ import annotations

import contextlib
import errno
import functools
import os
import stat
import threading
import time
from collections import OrderedDict
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, Final, Protocol

import fsspec

from detdata.base.checks import check_positive_int
from detdata.base.errors import ConfigError, DetdataError, StorageError, VerificationError
from detdata.base.hashing import PREFIX
from detdata.base.redact import get_logger
from detdata.storage.boot import CheckedThisBoot
from detdata.storage.cache_folder import (
    LayoutDirs,
    LockWait,
    TempFill,
    copies,
    drop_damaged,
    make_layout,
    note_shared,
    owned_alone,
    reserved_bytes,
)
from detdata.storage.digest import digest_chunks, full_digest_fd, quick_digest_fd
from detdata.storage.fs import iter_chunks
from detdata.storage.locks import flock
from detdata.storage.retry import RetryPolicy, check_policy
from detdata.storage.verified import (
    forget_verified,
    remember_verified,
    utime_remembered,
    verified_identity,
    was_verified,
)


class CacheEntry(Protocol):
    """What the cache needs of a manifest entry (`detdata.identity.entry.ShardEntry` fits)."""

    @property
    def path(self) -> str: ...

    @property
    def bytes(self) -> int: ...

    @property
    def blake3(self) -> str: ...

    @property
    def quick(self) -> str: ...


log: Final = get_logger("detdata.cache")
VERIFY_ON_OPEN: Final = ("quick", "full")
FILL_ATTEMPTS: Final = 3  # downloads of one shard whose blake3 does not match, before giving up
_TOUCH_EVERY_S: Final = 1.0
#: Copies whose last touch time one `ShardCache` remembers (for the once-a-second limit).
TOUCHED_MAX: Final = 1024


@dataclass
class CacheStats:
    """Counters of one `ShardCache` object (this process only)."""

    hits: int = 0
    fills: int = 0
    corrupt: int = 0
    evictions: int = 0
    stalls: int = 0  # reader calls of `path` that were not an immediate hit
    stall_s: float = 0.0  # time those reader calls waited (a fill, or another's fill)
    releases: int = 0
    digests: int = 0  # opens that re-read a copy to check its digest


def _hex(entry: CacheEntry) -> str:
    return entry.blake3[len(PREFIX) :]


#: Errors of a disk that cannot take a fill's bytes (full, over quota, read-only, failing).
_DISK_ERRNOS: Final = frozenset({errno.ENOSPC, errno.EDQUOT, errno.EROFS, errno.EIO, errno.EFBIG})
#: How a copy is opened to be checked: never through a link, never blocking on a FIFO.
_OPEN_COPY: Final = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC


class ShardCache:
    """Verified copies of remote shards under ``directory``, at most ``max_bytes`` in total
    (the module docstring). ``retry`` governs each 8 MiB range read of a fill."""

    def __init__(
        self,
        directory: str | os.PathLike[str],
        max_bytes: int,
        *,
        retry: RetryPolicy | None = None,
        verify_on_open: str = "quick",
    ) -> None:
        max_bytes = check_positive_int(max_bytes, "cache max_bytes")
        if verify_on_open not in VERIFY_ON_OPEN:
            raise ConfigError(
                f"verify_on_open must be one of {VERIFY_ON_OPEN}, got {verify_on_open!r}"
            )
        directory = os.fspath(directory)
        if "://" in directory and not directory.startswith("file://"):
            raise ConfigError(f"cache_dir must be a local directory, got {directory!r}")
        self.directory = os.path.abspath(directory.removeprefix("file://"))
        self.max_bytes = max_bytes
        self.verify_on_open = verify_on_open
        self.retry = check_policy(retry)
        self.stats = CacheStats()
        self._touched: OrderedDict[str, float] = OrderedDict()  # bounded: TOUCHED_MAX
        self._generation = -1  # objects/ mtime when `copies_changed` last looked
        self._mutex = threading.Lock()
        try:
            self._make_layout()
        except StorageError:
            raise
        except OSError as exc:
            raise self._unusable(exc) from exc
        self._boot = CheckedThisBoot(self.directory, trusted=self.shared is None)

    def __repr__(self) -> str:
        return f"ShardCache({self.directory!r}, max_bytes={self.max_bytes})"

    # paths -------------------------------------------------------------------
    def object_path(self, entry: CacheEntry) -> str:
        """Where the verified copy of ``entry`` lives (whether or not it is there now)."""
        return os.path.join(self.directory, "objects", _hex(entry))

    def usage(self) -> int:
        """Bytes in verified copies plus fills in progress (their full size), read under the
        accounting lock (never an evicted copy and the reservation that replaced it both)."""
        with self._global_lock():
            objects, reserved = self._scan()
        return sum(size for _, size, _ in objects) + reserved

    def path(
        self,
        entry: CacheEntry,
        fs: fsspec.AbstractFileSystem,
        remote_path: str,
        url: str,
        *,
        background: bool = False,
    ) -> str:
        """The local path of a verified copy of ``entry`` (fetched from ``remote_path`` if needed).

        ``url`` names the shard in errors and logs; ``background``: a prefetch (its waits are
        not stalls). A cache folder removed while in use is recreated, with a warning; one
        that cannot be written is a `StorageError` naming it.
        """
        for again in (False, True):
            try:
                return self._path(entry, fs, remote_path, url, background)
            except OSError as exc:
                if not self._is_mine(exc):
                    raise
                if again or not isinstance(exc, (FileNotFoundError, NotADirectoryError)):
                    raise self._unusable(exc) from exc
                try:
                    self._make_layout()
                except OSError as remade:
                    raise self._unusable(remade) from exc
                log.warning(
                    "detdata: shard cache folder %s was removed while in use (%s); recreated "
                    "it: its copies are fetched again",
                    self.directory,
                    exc.strerror or exc,
                )
        raise AssertionError("unreachable: the second try returns or raises")

    def _is_mine(self, exc: OSError) -> bool:
        """Whether ``exc`` is about a file of this cache (not a storage client's error)."""
        if isinstance(exc, DetdataError):
            return False
        names = (exc.filename, exc.filename2)
        return any(isinstance(n, str) and n.startswith(self.directory) for n in names)

    def _unusable(self, exc: OSError) -> StorageError:
        if exc.errno in _DISK_ERRNOS:
            return self._disk_failed(exc, exc.filename)
        return StorageError(
            f"shard cache folder {self.directory} cannot be used: {exc.strerror or exc} "
            f"({exc.filename}); hint: give cache_dir= a writable local folder with free "
            "space (it holds only verified copies: a new folder is refilled)"
        )

    def _disk_failed(self, exc: OSError, path: object) -> StorageError:
        """The error of a disk that cannot take a fill (full, over quota, failing)."""
        return StorageError(
            f"shard cache folder {self.directory}: writing {path} failed: "
            f"{exc.strerror or exc} (errno {exc.errno}); hint: free space on that disk, "
            f"lower shard_cache_bytes (now {self.max_bytes}) under the space it has, or "
            "pass cache_dir=None to read shards with range reads and no local copies"
        )

    def _make_layout(self) -> None:
        """Make the folders; ``shared``: why others can write them, or None."""
        make_layout(self.directory)
        old = getattr(self, "_dirs", None)
        self._dirs = LayoutDirs(self.directory)
        if old is not None:
            old.close()
        self.shared = self._dirs.shared_reason()
        note_shared(self.directory, self.shared)

    def _path(
        self,
        entry: CacheEntry,
        fs: fsspec.AbstractFileSystem,
        remote_path: str,
        url: str,
        background: bool,
    ) -> str:
        final = self.object_path(entry)
        if self._hit(final, entry) is None:
            return final
        began = time.monotonic()
        try:
            with self._shard_lock(entry):
                problem = self._hit(final, entry)  # another thread/process may have filled it
                if problem is None:
                    return final
                if problem != "missing":
                    self._count("corrupt")
                    log.warning(
                        "detdata: cached copy of shard %s (%s) is corrupted: %s; deleting "
                        "it and fetching %s again",
                        entry.path,
                        final,
                        problem,
                        url,
                    )
                    drop_damaged(final, entry.path)
                self._fill(entry, fs, remote_path, url, final)
                return final
        finally:
            if not background:
                with self._mutex:
                    self.stats.stalls += 1
                    self.stats.stall_s += time.monotonic() - began

    def _hit(self, final: str, entry: CacheEntry) -> str | None:
        """`_check` of ``final``; a hit (None) is counted and touched."""
        problem = self._check(final, entry)
        if problem is None:
            self._count("hits")
            self.touch(final, force=True)
        return problem

    def _count(self, counter: str) -> None:
        """Add one to ``stats.<counter>`` (fill threads and readers count concurrently)."""
        with self._mutex:
            setattr(self.stats, counter, getattr(self.stats, counter) + 1)

    def release(self, entry: CacheEntry) -> None:
        """Make the copy of ``entry`` (if any) the first to be evicted; it stays usable."""
        final = self.object_path(entry)
        with contextlib.suppress(FileNotFoundError, NotADirectoryError, PermissionError):
            utime_remembered(final, (0, 0))
            with self._mutex:
                self.stats.releases += 1
                self._touched.pop(final, None)

    def copies_changed(self) -> bool:
        """Was a copy added to or removed from ``objects/`` (by any process) since this object
        last asked? (One ``stat`` of the directory; True the first time.)"""
        try:
            now = os.stat(os.path.join(self.directory, "objects")).st_mtime_ns
        except (FileNotFoundError, NotADirectoryError):
            return True  # removed: every copy changed (the next `path` recreates the folder)
        with self._mutex:
            changed, self._generation = now != self._generation, now
        return changed

    def touch(self, path: str, *, force: bool = False) -> None:
        """Mark a copy as recently used (LRU), at most once a second per copy unless forced."""
        now = time.monotonic()
        with self._mutex:
            touched = self._touched
            if not force and now - touched.get(path, -1e9) < _TOUCH_EVERY_S:
                return
            touched[path] = now
            touched.move_to_end(path)
            # oldest first: entries older than the limit no longer matter; at most TOUCHED_MAX
            while touched and (
                len(touched) > TOUCHED_MAX or now - next(iter(touched.values())) >= _TOUCH_EVERY_S
            ):
                touched.popitem(last=False)
        # another user's copy in a shared folder: its LRU time is not ours to set
        with contextlib.suppress(FileNotFoundError, NotADirectoryError, PermissionError):
            utime_remembered(path, None)

    # checks ------------------------------------------------------------------
    def _check(self, path: str, entry: CacheEntry) -> str | None:
        """None if ``path`` holds ``entry``'s bytes (size + quick or full digest), else why not.
        One open file is stat-ed, hashed and remembered (in a shared folder another process
        could swap the file between two opens)."""
        seen_ns = time.time_ns()  # the wall clock of file timestamps, just before the stat
        try:
            fd = os.open(path, _OPEN_COPY)
        except (FileNotFoundError, NotADirectoryError):
            return "missing"
        except OSError as exc:
            if exc.errno == errno.ELOOP:
                return "a symbolic link, not a copy"
            raise
        try:
            return self._check_open(path, fd, entry, seen_ns)
        finally:
            os.close(fd)

    def _check_open(self, path: str, fd: int, entry: CacheEntry, seen_ns: int) -> str | None:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            return "not a regular file"
        if st.st_size != entry.bytes:
            return f"size {st.st_size} bytes, the manifest says {entry.bytes}"
        if was_verified(path, st, entry.blake3, self.verify_on_open):
            return None
        self._count("digests")
        # a copy not known whole in this boot may have lost unsynced writes in a crash; one
        # others can write (a shared folder, another's copy) is hashed in full
        name = os.path.basename(path)
        trusted = self.shared is None and owned_alone(st)
        level = self.verify_on_open if trusted and self._boot.has(name) else "full"
        if level == "full":
            field, found, want = "blake3", full_digest_fd(fd), entry.blake3
        else:
            field, found, want = "quick digest", quick_digest_fd(fd, st.st_size), entry.quick
        if found != want:
            forget_verified(path)
            return f"{field} {found}, the manifest says {want}"
        remember_verified(path, st, seen_ns, entry.blake3, level)
        if level == "full" and trusted:  # read from disk and found whole: known whole
            self._boot.add(name)
        return None

    def confirm_open(self, path: str, inode: int) -> bool:
        """Is the file a reader opened at ``path`` (its ``inode``) the one this process last
        checked there? Always True in a private folder (nobody else can swap it); in a
        shared one, False means another process put another file there between the check
        and the open: call `path` again (it checks the new file)."""
        if self.shared is None:
            return True
        known = verified_identity(path)
        return known is not None and known[1] == inode

    # filling -----------------------------------------------------------------
    def _fill(
        self,
        entry: CacheEntry,
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
            with self._global_lock():  # else a scan between the two dirs would miss this copy
                os.replace(
                    tmp.name,
                    os.path.basename(final),
                    src_dir_fd=tmp.tmp_fd,
                    dst_dir_fd=self._dirs.fd("objects"),
                )
            self._filled(entry, final, tmp)
        except BaseException:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(tmp.name, dir_fd=tmp.tmp_fd)
            raise
        finally:
            tmp.close()
        self._count("fills")
        self.touch(final, force=True)
        with self._global_lock():
            self._evict_locked(0, keep=final)

    def _filled(self, entry: CacheEntry, final: str, tmp: TempFill) -> None:
        """Remember the copy just renamed to ``final`` as verified in full, if it is still
        the file this fill wrote (in a shared folder another process may have swapped it:
        then it is checked at its next open like any other)."""
        seen_ns = time.time_ns()
        try:
            st = os.stat(final)
        except FileNotFoundError:
            return
        if not os.path.samestat(st, os.fstat(tmp.fd)):
            return
        if self.shared is None:
            self._boot.add(os.path.basename(final))  # every byte hashed as written
        remember_verified(final, st, seen_ns, entry.blake3, "full", own_fill=True)

    def _download(
        self,
        entry: CacheEntry,
        fs: fsspec.AbstractFileSystem,
        remote_path: str,
        url: str,
        tmp: TempFill,
    ) -> tuple[str, int]:
        """Stream the shard into ``tmp`` (emptied first); return (blake3, bytes written). A
        disk that cannot take the bytes is a `StorageError` naming the cache folder."""
        written = 0
        try:
            tmp.rewind()
        except OSError as exc:
            raise self._disk_failed(exc, tmp.path) from exc
        with os.fdopen(os.dup(tmp.fd), "wb") as fh:

            def kept(chunks: Iterator[bytes]) -> Iterator[bytes]:
                nonlocal written
                for data in chunks:
                    try:
                        fh.write(data)
                    except OSError as exc:
                        raise self._disk_failed(exc, tmp.path) from exc
                    written += len(data)
                    yield data

            chunks = iter_chunks(
                fs, remote_path, entry.bytes, policy=self.retry, shard=entry.path, url=url
            )
            found = digest_chunks(kept(chunks))
            try:
                fh.flush()
                if not self._boot.enabled:  # else not synced: the per-boot record covers it
                    os.fsync(fh.fileno())
            except OSError as exc:
                raise self._disk_failed(exc, tmp.path) from exc
        return found, written

    # space accounting ----------------------------------------------------------
    def _reserve(self, entry: CacheEntry, final: str) -> TempFill:
        """Evict until ``entry`` fits, then create its temp file (counted from now on). Where
        fills in progress leave no room, wait for them; after ``retry.deadline_s`` (a fill
        that hangs), go ahead with a warning."""
        tmp_dir = os.path.join(self.directory, "tmp")
        began = time.monotonic()
        pause = 0.002
        while True:
            with self._global_lock():
                total = self._evict_locked(entry.bytes, keep=final)
                late = time.monotonic() - began > self.retry.deadline_s
                if total <= self.max_bytes or late:
                    if total > self.max_bytes:
                        log.warning(
                            "detdata: shard cache %s will hold %d bytes (bound %d): fills in "
                            "progress did not finish within %gs",
                            self.directory,
                            total,
                            self.max_bytes,
                            self.retry.deadline_s,
                        )
                    return TempFill(self._dirs.fd("tmp"), tmp_dir, _hex(entry), entry.bytes)
            time.sleep(pause)  # other fills hold the room: they finish or fail
            pause = min(0.05, pause * 2)

    def _evict_locked(self, incoming: int, *, keep: str) -> int:
        """Evict oldest copies (never ``keep``) until ``incoming`` more bytes fit; return the
        bytes that copies, fills in progress and ``incoming`` then add up to."""
        objects, reserved = self._scan()
        total = sum(size for _, size, _ in objects) + reserved + incoming
        for _, size, path in sorted(objects):  # oldest first (mtime, then name)
            if total <= self.max_bytes:
                break
            if path == keep:
                continue
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)
                self._count("evictions")
                log.info("detdata: evicted %s (%d bytes) from the shard cache", path, size)
            total -= size
        return total

    def _scan(self) -> tuple[list[tuple[int, int, str]], int]:
        """``([(mtime_ns, size, path) of copies], bytes reserved by live fills)``."""
        return copies(self.directory), reserved_bytes(os.path.join(self.directory, "tmp"))

    # locks -------------------------------------------------------------------
    def _shard_lock(self, entry: CacheEntry) -> contextlib.AbstractContextManager[None]:
        lock = os.path.join(self.directory, "locks", f"{_hex(entry)}.lock")
        tmp = os.path.join(self.directory, "tmp")
        return flock(
            lock,
            dir_fd=self._dirs.fd("locks"),
            stalled=LockWait(lock, self.retry.deadline_s, tmp_dir=tmp, hex_digest=_hex(entry)),
        )

    def _global_lock(self) -> contextlib.AbstractContextManager[None]:
        lock = os.path.join(self.directory, ".lock")
        return flock(lock, stalled=LockWait(lock, self.retry.deadline_s))

    def __reduce__(self) -> tuple[Any, ...]:
        """Pickled as its parameters: the copy opens the folder anew."""
        remake = functools.partial(
            ShardCache,
            retry=self.retry,
            verify_on_open=self.verify_on_open,
        )
        return remake, (self.directory, self.max_bytes)
