"""`ShardReader`: what `TokenWindows` and `TableRows` share about reading shard files.

* Construction: ``storage_options``, the ``retry`` policy, the disk cache
  (``cache_dir`` + ``shard_cache_bytes`` + ``cache_verify``) checked, and the
  manifest resolved and verified (`resolve_manifest`).
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
* Truncation: a memory-mapped file shorter than the manifest says would crash the
  process (SIGBUS) when read, so readers check the file's size first
  (`check_not_truncated`: a `VerificationError` naming the shard).

Subclasses own their handles: they implement `ShardReader._forget_handle` and
extend `_build_index` / `_reset_process_state` (calling the base's).
"""

from __future__ import annotations

import abc
import os
import warnings
from collections.abc import Callable, Iterable, Mapping
from typing import Any, ClassVar, Final, TypeVar

import fsspec
from fsspec.implementations.local import LocalFileSystem

from detdata.base.checks import check_positive_int
from detdata.base.errors import ConfigError, StorageError, VerificationError
from detdata.datasets.process_local import ProcessLocal
from detdata.identity.manifest import Manifest, Verify
from detdata.storage.cache import ShardCache
from detdata.storage.fs import filesystem, join
from detdata.storage.retry import RetryPolicy, check_policy

#: Default bound of the disk cache of shard copies (``shard_cache_bytes``).
DEFAULT_SHARD_CACHE_BYTES: Final = 16 << 30
#: How often a copy evicted between its fill and its open is fetched again.
_OPEN_ATTEMPTS: Final = 5

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


def check_cache_verify(value: object) -> str:
    """``cache_verify``: how a cached shard copy is re-checked on open (``quick`` or ``full``)."""
    if value not in ("quick", "full"):
        raise ConfigError(
            f"cache_verify must be 'quick' (size + first/last MiB) or 'full' (re-hash "
            f"the whole copy on open), got {value!r}"
        )
    return str(value)


def check_cache_args(
    cache_dir: str | os.PathLike[str] | None, shard_cache_bytes: int | None
) -> tuple[str | None, int]:
    """``(cache_dir as str or None, shard_cache_bytes)``; `ConfigError` for bad values.

    ``shard_cache_bytes`` defaults to `DEFAULT_SHARD_CACHE_BYTES` and needs ``cache_dir``.
    """
    if cache_dir is None:
        if shard_cache_bytes is not None:
            raise ConfigError(
                "shard_cache_bytes was given without cache_dir; hint: pass "
                "cache_dir='/local/dir' to cache remote shards"
            )
        return None, DEFAULT_SHARD_CACHE_BYTES
    if not isinstance(cache_dir, (str, os.PathLike)):
        raise ConfigError(f"cache_dir must be a local directory path, got {cache_dir!r}")
    size = (
        DEFAULT_SHARD_CACHE_BYTES
        if shard_cache_bytes is None
        else check_positive_int(shard_cache_bytes, "shard_cache_bytes")
    )
    return os.fspath(cache_dir), size


def renamed_argument(
    new_value: T | None, old_value: T | None, *, new: str, old: str, owner: str
) -> T | None:
    """The value of argument ``new`` given under either name (None: neither given).

    ``old`` is its deprecated spelling: passing it emits a `DeprecationWarning` naming
    ``new`` (attributed to the caller of ``owner``'s constructor); passing both is a
    `ConfigError`.
    """
    if old_value is None:
        return new_value
    if new_value is not None:
        raise ConfigError(f"{owner}: {old}= is the deprecated name of {new}=; pass {new}= only")
    warnings.warn(
        f"{owner}({old}=...) is deprecated; use {new}=... instead", DeprecationWarning, stacklevel=3
    )
    return old_value


def check_not_truncated(name: str, path: str, expected: int, found: int) -> None:
    """`VerificationError` naming shard ``name`` when its mapped file has fewer bytes than
    expected."""
    if found < expected:
        raise VerificationError(
            f"shard {name} ({path}): the file was truncated while this run read it: the "
            f"manifest says {expected} bytes, the file now has {found}; reading on would "
            "crash the process (SIGBUS); hint: restore the shard (or rebuild the manifest) "
            "and resume from the last saved state",
            shard=name,
            field="bytes",
            expected=expected,
            found=found,
        )


class ShardReader(ProcessLocal, abc.ABC):
    """Base of datasets that read the shard files of one manifest (see the module docstring).

    After ``__init__``: ``manifest`` (verified, with a root), ``storage_options``,
    ``retry``, ``cache_dir`` (str or None), ``shard_cache_bytes`` and ``cache_verify``.
    None of these but the manifest changes the data read.
    """

    # pickling: parameters and manifest only, no file system, caches or handles
    _TRANSIENT: ClassVar[tuple[str, ...]] = (
        "_fs",
        "_root_path",
        "_pid",
        "_shard_cache",
        "_copy_files",
        "_sizes",
    )

    def __init__(
        self,
        manifest: Manifest | str,
        *,
        verify: str | Verify,
        root: str | None,
        storage_options: Mapping[str, Any] | None,
        retry: RetryPolicy | None,
        cache_dir: str | os.PathLike[str] | None,
        shard_cache_bytes: int | None,
        cache_verify: str,
    ) -> None:
        self.storage_options = dict(storage_options or {})
        self.retry = check_policy(retry)
        self.cache_dir, self.shard_cache_bytes = check_cache_args(cache_dir, shard_cache_bytes)
        self.cache_verify = check_cache_verify(cache_verify)
        self.manifest = resolve_manifest(
            manifest,
            verify=verify,
            root=root,
            storage_options=self.storage_options,
            retry=self.retry,
        )

    def _build_index(self) -> None:
        self._sizes: tuple[int, ...] = tuple(s.bytes for s in self.manifest.shards)

    def _reset_process_state(self) -> None:
        self._pid = os.getpid()
        self._fs: fsspec.AbstractFileSystem | None = None
        self._root_path = ""
        self._shard_cache: ShardCache | None = None
        self._copy_files: dict[int, tuple[str, int]] = {}  # shard -> (cached copy, inode)

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
            fs, root_path = filesystem(root, **self.storage_options)
            self._root_path = root_path  # before _fs: reader threads test _fs first
            self._fs = fs
            return fs, root_path
        return self._fs, self._root_path

    def _uses_shard_cache(self) -> bool:
        """Are shards read from verified local copies (``cache_dir`` and a remote root)?"""
        return self.cache_dir is not None and not isinstance(self._filesystem()[0], LocalFileSystem)

    # the cache of shard copies ---------------------------------------------------
    @property
    def shard_cache(self) -> ShardCache | None:
        """This process's verified local `ShardCache` (None without ``cache_dir``)."""
        if self.cache_dir is None:
            return None
        if self._pid != os.getpid():
            self._reset_process_state()
        if self._shard_cache is None:
            self._shard_cache = ShardCache(
                self.cache_dir,
                self.shard_cache_bytes,
                retry=self.retry,
                verify_on_open=self.cache_verify,
            )
        return self._shard_cache

    def _open_copy(self, shard: int, open_path: Callable[[str], tuple[H, int]]) -> tuple[H, str]:
        """``(handle, path)``: ``open_path(path) -> (handle, inode)`` on the cached copy of
        ``shard``.

        The copy is filled first if needed. A copy evicted by another process between
        the fill and the open (``FileNotFoundError``) is fetched again, up to 5 times.
        """
        for _ in range(_OPEN_ATTEMPTS):
            path = self._cached_path(shard)
            try:
                handle, inode = open_path(path)
            except FileNotFoundError:
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
        path = cache.path(entry, fs, join(root_path, entry.path), self.manifest.url(entry))
        if cache.stats.fills != fills:  # a fill may have evicted copies this process has open
            for other in [s for s in self._copy_files if s != shard]:
                self._drop_if_replaced(other)
        return path

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
        except FileNotFoundError:
            same = False
        if not same:
            self._forget_handle(shard)
            self._copy_files.pop(shard, None)
            return None
        return path

    def _refresh_copies(self, shards: Iterable[int]) -> None:
        """Before a batch: drop handles whose cached copy changed; refresh the others' LRU time."""
        cache = self.shard_cache
        for shard in shards:
            path = self._drop_if_replaced(shard)
            if path is not None and cache is not None:
                cache.touch(path)

    # truncation ------------------------------------------------------------------
    def _check_size(self, shard: int, found: int, path: str) -> None:
        """`VerificationError` when the mapped file ``path`` of ``shard`` has fewer bytes than
        the manifest says: touching a mapped page past the end of a truncated file kills the
        process with SIGBUS, so reads check the size first."""
        check_not_truncated(self.manifest.shards[shard].path, path, self._sizes[shard], found)

    def _check_file(self, shard: int, path: str) -> None:
        """`_check_size` with the size of file ``path`` (missing: 0 bytes; ``""``: not opened
        yet)."""
        if not path:
            return
        try:
            found = os.stat(path).st_size
        except FileNotFoundError:
            found = 0
        self._check_size(shard, found, path)
