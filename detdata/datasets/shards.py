"""`ShardReader`: what `TokenWindows`, `TableRows` and `Documents` share about reading shards.

* Construction: one `Storage` (`detdata.datasets.shard_storage`: root, verification,
  fsspec options, the ``retry`` policy, the disk cache ``cache_dir`` +
  ``shard_cache_bytes`` + ``cache_verify``, ``max_open_shards``; each field checked when
  it was made), its ``cache_dir=DefaultCache.AUTO`` resolved to the dataset's
  `ShardReader.DEFAULT_CACHE`, and the manifest resolved and verified (`resolve_manifest`).
* A lazy per-process file system: opened on first use and opened afresh after a
  fork or an unpickle (`ProcessLocal` drops it from pickles; a pid check resets
  it after a fork).
* With ``cache_dir`` and a remote root, whole shards are copied into a bounded,
  blake3-verified local `ShardCache` (``shard_cache``, one per process) and
  opened from there. Each open handle (a memory map, a reader) remembers the
  copy it reads: ``(path, inode)``. Before a batch, a handle whose copy was
  evicted or replaced (another inode now, or no file) is dropped and re-opened;
  a copy that is still current gets its LRU time refreshed. A fill may evict
  copies this process has open, so after each fill every handle is checked.
* Truncation and replacement: a memory-mapped file shorter than the manifest says would
  crash the process (SIGBUS) when read, so readers check the file's size first
  (`check_not_truncated`: a `VerificationError` naming the shard when it differs from
  the manifest's, shorter or longer). Each time a shard's path is opened again (a
  mapping, or a read without one) the file is compared with the one this process
  first opened for it (`_check_opened`: inode, device, size and modification time), so
  a shard replaced (renamed over) or rewritten during the run is an error naming it,
  whatever ``max_open_shards`` is, never other bytes. Not caught: a replacement before
  this process first opened the shard (verification at open covers that, fully only
  with ``verify="full"``), and bytes rewritten in place under a live mapping.
* Bounded handles: open handles live in a `HandleLRU` of at most ``max_open_shards``
  shards per dataset, inside this process's budget (`detdata.datasets.handles`). A
  forked child starts with no handles; an unpickled dataset starts empty and joins its
  process's budget. Nothing else kept per shard grows with the shards touched: the
  remembered cached copies (``(path, inode)``) are dropped with their handle. The
  bounds never change the bytes read, so they are not part of ``identity()``.

Subclasses own their handles: they implement `ShardReader._forget_handle` and
extend `_build_index` / `_reset_process_state` (calling the base's).
"""

from __future__ import annotations

import abc
import os
import threading
from collections.abc import Callable, Iterable, Mapping
from typing import Any, ClassVar, Final, TypeVar

import fsspec
import numpy as np
import numpy.typing as npt
from fsspec.implementations.local import LocalFileSystem

from detdata.base.errors import ConfigError, StorageError, VerificationError
from detdata.base.redact import get_logger, redact_url
from detdata.datasets.handles import PROCESS_HANDLES, HandleLRU
from detdata.datasets.process_local import ProcessLocal
from detdata.datasets.shard_storage import (
    DEFAULT_SHARD_CACHE_BYTES,
    DefaultCache,
    Storage,
    user_cache,
)
from detdata.identity.entry import Verify
from detdata.identity.manifest import Manifest
from detdata.storage.cache import ShardCache
from detdata.storage.file_column import IntColumn
from detdata.storage.first_opens import FirstOpens
from detdata.storage.first_opens import file_identity as _identity
from detdata.storage.fs import filesystem, join
from detdata.storage.retry import RetryPolicy

#: How often a copy evicted between its fill and its open is fetched again.
_OPEN_ATTEMPTS: Final = 5
log: Final = get_logger("detdata.cache")
H = TypeVar("H")
T = TypeVar("T")


def resolve_manifest(
    manifest: Manifest | str,
    *,
    verify: str | Verify,
    root: str | None,
    storage_options: Mapping[str, Any],
    retry: RetryPolicy | None = None,
) -> Manifest:
    """A verified `Manifest` from an object or a path/URL.

    A path is loaded with ``Manifest.load(path, root=root, verify=verify)``; a
    `Manifest` object is re-rooted at ``root`` if given and then verified with
    ``verify`` (``"quick"`` by default; ``"off"`` skips it).
    """
    if isinstance(manifest, str):
        return Manifest.load(manifest, root=root, verify=verify, retry=retry, **storage_options)
    if not isinstance(manifest, Manifest):
        raise ConfigError(
            f"expected a Manifest or a manifest path/URL, got {type(manifest).__name__}"
        )
    if root is not None:
        manifest = manifest.with_root(root)
    if manifest.root is None:
        raise ConfigError("the manifest has no root; hint: pass root= or use Manifest.with_root()")
    manifest.verify(verify, retry=retry, **storage_options)
    return manifest


def check_not_truncated(name: str, path: str, expected: int, found: int) -> None:
    """`VerificationError` naming shard ``name`` when its file does not have the manifest's
    ``expected`` bytes (fewer: truncated, which a mapped read would turn into SIGBUS; more:
    rewritten or replaced by another file)."""
    if found == expected:
        return
    what = (
        "was truncated while this run read it"
        if found < expected
        else "grew or was replaced by another file while this run read it"
    )
    crash = "; reading on would crash the process (SIGBUS)" if found < expected else ""
    raise VerificationError(
        f"shard {name} ({path}): the file {what}: the manifest says {expected} bytes, the "
        f"file now has {found}{crash}; hint: restore the shard (or rebuild the manifest) "
        "and resume from the last saved state",
        shard=name,
        field="bytes",
        expected=expected,
        found=found,
    )


#: Serialises the lazy creation of a reader's file system and shard cache: the lookahead's
#: fill threads and reader threads may ask for them at the same time, and two caches would
#: split the counters (and two file systems the connection pools) of one reader.
_LAZY = threading.Lock()


def _new_lazy_lock() -> None:
    global _LAZY
    _LAZY = threading.Lock()  # a thread of the parent may have held it at the fork


os.register_at_fork(after_in_child=_new_lazy_lock)


class ShardReader(ProcessLocal, abc.ABC):
    """Base of datasets that read the shard files of one manifest (see the module docstring).

    After ``__init__``: ``manifest`` (verified, with a root), ``storage`` (the `Storage`
    it reads with, ``cache_dir=DefaultCache.AUTO`` resolved to `DEFAULT_CACHE`; its fields
    also as ``storage_options``, ``retry``, ``cache_verify`` and ``max_open_shards``), and
    the cache in force: ``cache_dir`` (str or None) and ``shard_cache_bytes`` (the default
    cache may engage later, `use_user_cache`). None of these but the manifest changes the
    data read. Subclasses keep their handles in ``self._handles`` (a `HandleLRU`), added
    with `_keep_handle`.
    """

    # pickling: parameters and manifest only, no file system, caches or handles
    _TRANSIENT: ClassVar[tuple[str, ...]] = (
        "_fs",
        "_root_path",
        "_pid",
        "_shard_cache",
        "_copy_files",
        "_handles",
        "_sizes",
        "_size_array",
        "_first",
        "_names_bytes",
        "_named",
    )

    #: what ``Storage(cache_dir=DefaultCache.AUTO)`` (the default) means for this dataset
    DEFAULT_CACHE: ClassVar[DefaultCache | None] = None

    def __init__(self, manifest: Manifest | str, storage: Storage) -> None:
        self.storage = storage = storage.with_default_cache(self.DEFAULT_CACHE)
        self.manifest = resolve_manifest(
            manifest,
            verify=storage.verify,
            root=None if storage.root is None else os.fspath(storage.root),
            storage_options=self.storage_options,
            retry=self.retry,
        )
        folder, bound = storage.cache_dir, storage.shard_cache_bytes
        self.cache_dir: str | None = None
        self.shard_cache_bytes = DEFAULT_SHARD_CACHE_BYTES
        # the default cache, usable but not used yet (the corpus is larger than its bound):
        # a locality order engages it (`use_user_cache`)
        self._user_cache: tuple[str, int] | None = None
        if not isinstance(folder, DefaultCache):
            self.cache_dir = None if folder is None else os.fspath(folder)
            self.shard_cache_bytes = DEFAULT_SHARD_CACHE_BYTES if bound is None else bound
            return
        found, size = user_cache(self.manifest, bound)
        if found is None:
            return
        if int(self.manifest.bytes_per_shard().sum()) <= size:
            self.cache_dir, self.shard_cache_bytes = found, size  # the whole corpus fits
        else:
            self._user_cache = (found, size)

    # the storage's fields, under the names the readers use -----------------------------
    @property
    def storage_options(self) -> Mapping[str, Any]:
        """The fsspec file system's keyword arguments (``storage.fs_options``)."""
        return self.storage.fs_options

    @property
    def retry(self) -> RetryPolicy:
        """How remote reads retry (``storage.retry``)."""
        return self.storage.retry

    @property
    def cache_verify(self) -> str:
        """How a cached copy is re-checked when opened (``storage.cache_verify``)."""
        return self.storage.cache_verify

    @property
    def max_open_shards(self) -> int:
        """The bound of this dataset's open handles per process (``storage.max_open_shards``)."""
        return self.storage.max_open_shards

    def use_user_cache(self, window_shards: int) -> None:
        """Read through the default cache from now on, for an order that reads
        ``window_shards`` shards at a time (`LocalityOrder`), if its bound holds two such
        windows of the largest shard (the one read and the one prefetched); else the range
        reads go on, logged. Only for the default ``cache_dir`` of a corpus larger than its
        bound (a corpus that fits uses it already). Never changes a byte read."""
        if self._user_cache is None or self.cache_dir is not None:
            return
        folder, bound = self._user_cache
        largest = int(self.manifest.bytes_per_shard().max())
        if 2 * window_shards * largest > bound:
            log.warning(
                "detdata: the default shard cache %s (bound %d bytes) is too small for two "
                "windows of %d shards of up to %d bytes; remote shards are read with range "
                "requests (slower); hint: pass Storage(cache_dir=..., shard_cache_bytes=...)",
                folder,
                bound,
                window_shards,
                largest,
            )
            return
        self.cache_dir, self.shard_cache_bytes = folder, bound
        self._user_cache = None
        self._reset_process_state()

    def _build_index(self) -> None:
        # bytes per shard: the manifest's column (mapped for the fast form: no entry built)
        self._size_array: IntColumn = self._shard_bytes()
        self._sizes = self._size_array

    def _shard_bytes(self) -> IntColumn:
        """Bytes of every shard in manifest order: the manifest's column (a subclass may
        give an equal column it already holds checked, read on demand)."""
        return self.manifest.bytes_per_shard()

    def _reset_process_state(self) -> None:
        self._pid = os.getpid()
        self._fs: fsspec.AbstractFileSystem | None = None
        self._root_path = ""
        self._shard_cache: ShardCache | None = None
        # shard -> (cached copy, inode), for shards with an open handle only
        copy_files: dict[int, tuple[str, int]] = {}
        self._copy_files = copy_files
        # per shard, the file this process first opened: (inode, device, mtime_ns), each as
        # an unsigned 64-bit pattern (`_identity`), recorded once (reader threads and the
        # native loop may first open a shard at once)
        self._first = FirstOpens(self._shard_bytes())
        self._names_bytes: list[bytes] | None = None  # `_encoded_names`, built when needed
        self._named: npt.NDArray[np.bool_] = np.zeros(0, dtype=np.bool_)
        # in the process's budget; an evicted handle's copy is forgotten (no reference to self)
        self._handles: HandleLRU[Any] = HandleLRU(
            self.max_open_shards,
            budget=PROCESS_HANDLES,
            forget=lambda shard: copy_files.pop(shard, None),
        )

    def _keep_handle(self, shard: int, handle: object) -> None:
        """Hold ``handle`` of ``shard`` in the LRU (and the process's budget); the cached
        copies of evicted handles (this reader's or another's) are forgotten."""
        self._handles.put(shard, handle)

    def open_shards(self) -> list[int]:
        """Shards this dataset holds an open handle of in this process, least recently used
        first (at most ``max_open_shards``; `process_open_shards` counts every dataset's)."""
        if self._pid != os.getpid():
            self._reset_process_state()
        return self._handles.keys()

    @abc.abstractmethod
    def _forget_handle(self, shard: int) -> None:
        """Drop this process's open handle(s) of ``shard`` (its copy was evicted/replaced)."""

    # the file system -----------------------------------------------------------
    def _filesystem(self) -> tuple[fsspec.AbstractFileSystem, str]:
        """This process's ``(file system, root path)`` of the manifest's root (opened lazily)."""
        if self._pid != os.getpid():
            self._reset_process_state()
        if self._fs is None:
            root = self.manifest.root
            if root is None:
                raise ConfigError("the manifest has no root; hint: pass root=")
            with _LAZY:
                if self._fs is None:
                    fs, root_path = filesystem(root, **self.storage_options)
                    self._root_path = root_path  # before _fs: reader threads test _fs first
                    self._fs = fs
                return self._fs, self._root_path
        return self._fs, self._root_path

    def uses_shard_cache(self) -> bool:
        """Are shards read from verified local copies (``cache_dir`` and a remote root)? The
        lookahead (`detdata.datasets.prefetch`) fills the caches of such readers only."""
        return self.cache_dir is not None and not isinstance(self._filesystem()[0], LocalFileSystem)

    _uses_shard_cache = uses_shard_cache  # the spelling the subclasses' read paths use

    # the cache of shard copies ---------------------------------------------------
    @property
    def shard_cache(self) -> ShardCache | None:
        """This process's verified local `ShardCache` (None without ``cache_dir``)."""
        if self.cache_dir is None:
            return None
        if self._pid != os.getpid():
            self._reset_process_state()
        cache = self._shard_cache
        if cache is None:
            with _LAZY:
                if self._shard_cache is None:
                    self._shard_cache = ShardCache(
                        self.cache_dir,
                        self.shard_cache_bytes,
                        retry=self.retry,
                        verify_on_open=self.cache_verify,
                    )
                cache = self._shard_cache
        return cache

    def _open_copy(self, shard: int, open_path: Callable[[str], tuple[H, int]]) -> tuple[H, str]:
        """``(handle, path)``: ``open_path(path) -> (handle, inode)`` on the cached copy of
        ``shard``.

        The copy is filled first if needed. A copy evicted by another process between
        the fill and the open (``FileNotFoundError``), or in a shared cache folder replaced
        by another file since it was checked (`ShardCache.confirm_open`), is fetched or
        checked again, up to 5 times.
        """
        cache = self.shard_cache
        assert cache is not None  # only called with cache_dir
        for _ in range(_OPEN_ATTEMPTS):
            path = self._cached_path(shard)
            try:
                handle, inode = open_path(path)
            except (FileNotFoundError, NotADirectoryError):
                continue
            if not cache.confirm_open(path, inode):
                del handle  # not the file that was checked: closed with its last reference
                continue
            self._copy_files[shard] = (path, inode)
            return handle, path
        raise StorageError(
            f"shard {self.manifest.shards[shard].path}: its cached copy under "
            f"{self.cache_dir} was evicted {_OPEN_ATTEMPTS} times before it could "
            "be opened; hint: raise shard_cache_bytes (other processes share this "
            "cache)"
        )

    def _cached_path(self, shard: int) -> str:
        """A verified local copy of ``shard`` (filled on first use); drops handles of evicted
        copies."""
        cache = self.shard_cache
        assert cache is not None  # only called with cache_dir
        entry = self.manifest.shards[shard]
        fs, root_path = self._filesystem()
        fills = cache.stats.fills
        path = cache.path(
            entry, fs, join(root_path, entry.path), redact_url(self.manifest.url(entry))
        )
        if cache.stats.fills != fills:  # a fill may have evicted copies this process has open
            for other in list(self._copy_files):  # a snapshot: reader threads change it
                if other != shard:
                    self._drop_if_replaced(other)
        return path

    def prefetch_copy(self, shard: int) -> None:
        """Fill the verified cached copy of ``shard`` now, as a background prefetch would
        (`detdata.datasets.prefetch`); opens no handle. No-op without a shard cache."""
        if not self.uses_shard_cache():
            return
        cache = self.shard_cache
        assert cache is not None
        entry = self.manifest.shards[shard]
        fs, root_path = self._filesystem()
        cache.path(
            entry, fs, join(root_path, entry.path), self.manifest.url(entry), background=True
        )

    def release_copy(self, shard: int) -> None:
        """Mark the cached copy of ``shard`` as the first to evict (its last use in a prefetch
        window has passed); it stays readable until evicted."""
        cache = self.shard_cache
        if cache is not None:
            cache.release(self.manifest.shards[shard])

    def _drop_if_replaced(self, shard: int) -> str | None:
        """Forget the handle of ``shard`` if its cached copy was evicted or replaced.

        Returns the copy's path when the handle is still current (safe with reader
        threads: a concurrent drop just means the next use re-opens the copy).
        """
        known = self._copy_files.get(shard)
        if known is None:
            return None
        path, inode = known
        try:
            same = os.stat(path).st_ino == inode
        except (FileNotFoundError, NotADirectoryError):  # evicted, or the cache folder removed
            same = False
        if not same:
            self._forget_handle(shard)
            self._copy_files.pop(shard, None)
            return None
        return path

    def _refresh_copies(self, shards: Iterable[int]) -> None:
        """Before a batch: drop handles whose cached copy changed; refresh the others' LRU time."""
        cache = self.shard_cache
        if cache is not None and cache.copies_changed():  # another process filled or evicted
            for other in list(self._copy_files):  # a snapshot: reader threads change it
                self._drop_if_replaced(other)
        for shard in shards:
            path = self._drop_if_replaced(shard)
            if path is not None and cache is not None:
                cache.touch(path)

    # truncation ------------------------------------------------------------------
    def _check_size(self, shard: int, found: int, path: str) -> None:
        """`VerificationError` when the mapped file ``path`` of ``shard`` has fewer bytes than
        the manifest says: touching a mapped page past the end of a truncated file kills the
        process with SIGBUS, so reads check the size first."""
        expected = int(self._sizes[shard])
        check_not_truncated(self.manifest.shards[shard].path, path, expected, found)

    def _encoded_names(self, shards: npt.NDArray[np.int64]) -> list[bytes]:
        """A list indexed by shard holding, at least for ``shards``, each path under the root,
        file-system encoded (for `detdata.storage.fileread.read_files`). Names are filled in
        as shards are first read: the entries of shards never read are never built."""
        names = self._names_bytes
        if names is None:
            count = len(self.manifest.shards)
            self._named = np.zeros(count, dtype=np.bool_)
            names = self._names_bytes = [b""] * count
        missing = shards[~self._named[shards]]
        if missing.size:
            shard_path = self.manifest.shard_path  # the path alone: no entry built
            for shard in missing.tolist():
                names[shard] = os.fsencode(shard_path(shard))
            self._named[missing] = True  # after the names: a reader thread tests it first
        return names

    def _check_opened(self, shard: int, fd: int, path: str) -> None:
        """At an open of ``shard``'s local file ``path`` (descriptor ``fd``): its size is the
        manifest's, and it is the file this process first opened for the shard (same inode,
        device and modification time), else a `VerificationError` naming the shard."""
        self._check_stat(shard, os.fstat(fd), path)

    def _check_stat(self, shard: int, st: os.stat_result, path: str) -> None:
        """`_check_size`, then the file's identity against the first one this process opened
        for ``shard``; the first open records it (only a file of the manifest's size is
        recorded, and of two threads first opening the shard at once, one records and the
        other is compared with it)."""
        self._check_identity(shard, st.st_size, _identity(st), path)

    def _check_identity(self, shard: int, size: int, now: tuple[int, int, int], path: str) -> None:
        """`_check_stat` of a file of ``size`` bytes and identity ``now`` (`_identity`)."""
        if size != self._sizes[shard]:
            self._check_size(shard, size, path)
        if self.cache_dir is not None and self.uses_shard_cache():
            return  # cached copies: checked against their (path, inode) (`_drop_if_replaced`)
        seen = self._first.record(shard, now)
        if seen != now:
            name = self.manifest.shards[shard].path
            raise VerificationError(
                f"shard {name} ({path}): the file was replaced or rewritten while this run "
                f"read it (inode, device, mtime_ns {seen} when first opened, {now} now; size "
                "unchanged); its bytes may no longer be the manifest's; hint: restore the "
                "shard (or rebuild the manifest) and resume from the last saved state",
                shard=name,
                field="file",
                expected=list(seen),
                found=list(now),
            )

    def _check_opened_arrays(
        self,
        ids: npt.NDArray[np.int64],
        sizes: npt.NDArray[np.int64],
        now: npt.NDArray[np.uint64],
        prefix: str,
    ) -> None:
        """`_check_stat` of many opens at once: shard ``ids[i]``'s file ``prefix + path``
        had ``sizes[i]`` bytes and identity ``now[i]`` (`_identity`, an ``fstat`` taken
        after its bytes were read). One vectorised comparison instead of ~6 us of Python
        per shard. The first culprit, in the order given, raises `_check_stat`'s error. A
        shard not recorded yet goes through `_check_identity` (callers record first opens
        before reading: the native loop does, see `detdata.storage.reads.read_checked`). Callers
        check before any byte
        read under these opens is returned."""
        if not ids.size:
            return
        bad = sizes != self._size_array.take(ids)
        if not self.uses_shard_cache():
            bad |= ~self._first.recorded(ids)
            changed = self._first.ident.take(ids, axis=0) != now  # (n, 3): take ~3x cheaper
            bad |= changed[:, 0] | changed[:, 1] | changed[:, 2]  # ~2x cheaper than any(1)
        for i in np.flatnonzero(bad).tolist():  # the first real culprit raises
            shard = int(ids[i])
            ident = now[i].tolist()
            self._check_identity(
                shard,
                int(sizes[i]),
                (ident[0], ident[1], ident[2]),
                prefix + self.manifest.shards[shard].path,
            )

    def _check_file(self, shard: int, path: str) -> None:
        """`_check_stat` of file ``path`` (missing: a size of 0 bytes; ``""``: not opened
        yet)."""
        if not path:
            return
        try:
            st = os.stat(path)
        except FileNotFoundError:
            self._check_size(shard, 0, path)
            return
        self._check_stat(shard, st, path)
