"""`ShardFiles`: the shard files of one manifest, a part held by `TokenWindows`, `TableRows`
and `Documents`: opened, mapped, cached and checked per process (pickled empty, made again
after a fork).

Reads check a file's size before touching its mapping (`ShardFiles.check_size`: a short
file would SIGBUS) and compare every open with the file this process first opened
(`ShardFiles.check_stat`), so a shard replaced or rewritten during the run is a
`VerificationError` naming it. Not caught: a replacement before the first open, bytes
rewritten in place under a live mapping.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable
from typing import Any, Final, NoReturn, TypeVar

import fsspec
import numpy as np
import numpy.typing as npt

from detdata.base.errors import ConfigError, StorageError, VerificationError
from detdata.base.redact import get_logger, redact_url
from detdata.datasets.handles import PROCESS_HANDLES, HandleLRU
from detdata.datasets.process_local import PerProcess
from detdata.datasets.shard_storage import (
    DEFAULT_SHARD_CACHE_BYTES,
    DefaultCache,
    Storage,
    user_cache,
)
from detdata.identity.manifest import Manifest
from detdata.storage.cache import ShardCache
from detdata.storage.file_column import IntColumn
from detdata.storage.first_opens import FirstOpens
from detdata.storage.first_opens import file_identity as _identity
from detdata.storage.fs import filesystem, is_local_fs, join
from detdata.storage.reads import OpenChecks

#: How often a copy evicted between its fill and its open is fetched again.
_OPEN_ATTEMPTS: Final = 5
log: Final = get_logger("detdata.cache")
H = TypeVar("H")


def resolve_manifest(manifest: Manifest | str, storage: Storage) -> Manifest:
    """A verified `Manifest` from an object (re-rooted at ``storage.root`` if given) or a
    path/URL (loaded under it), verified as ``storage.verify`` says."""
    root = None if storage.root is None else os.fspath(storage.root)
    options, retry = storage.fs_options, storage.retry
    if isinstance(manifest, str):
        return Manifest.load(manifest, root=root, verify=storage.verify, retry=retry, **options)
    if not isinstance(manifest, Manifest):
        raise ConfigError(
            f"expected a Manifest or a manifest path/URL, got {type(manifest).__name__}"
        )
    if root is not None:
        manifest = manifest.with_root(root)
    if manifest.root is None:
        raise ConfigError("the manifest has no root; hint: pass root= or use Manifest.with_root()")
    manifest.verify(storage.verify, retry=retry, **options)
    return manifest


class ProcessFiles:
    """This process's side of a `ShardFiles` besides its file system and shard cache:
    ``copies``: shard -> ``(path, inode)`` of the cached copy its open handle reads;
    ``first``: the first-open records; ``names``: `ShardFiles.encoded_names`."""

    __slots__ = ("copies", "first", "handles", "named", "names")

    def __init__(self, sizes: IntColumn, max_open_shards: int) -> None:
        copies: dict[int, tuple[str, int]] = {}
        self.copies = copies
        self.first = FirstOpens(sizes)
        self.names: list[bytes] | None = None  # built when needed
        self.named: npt.NDArray[np.bool_] = np.zeros(0, dtype=np.bool_)
        # an evicted handle's copy is forgotten (no reference to self)
        self.handles: HandleLRU[Any] = HandleLRU(
            max_open_shards, budget=PROCESS_HANDLES, forget=lambda shard: copies.pop(shard, None)
        )


class ShardFiles:
    """The shard files of ``manifest`` (verified, with a root) read as ``storage`` says (its
    ``cache_dir`` resolved from `DefaultCache.AUTO`), checked against ``sizes`` (bytes per
    shard). ``cache_dir`` / ``shard_cache_bytes``: the cache in force (the default cache may
    engage later, `use_user_cache`). Pickled without ``sizes`` (given again, `attach`) and
    this process's side."""

    def __init__(self, manifest: Manifest, storage: Storage, sizes: IntColumn) -> None:
        self.manifest = manifest
        self.storage = storage
        self.sizes = sizes
        self._local: PerProcess[ProcessFiles] = PerProcess()
        # made once per process (`PerProcess`: one maker at a time): fill threads and reader
        # threads may ask at once, and two would split one reader's counters and pools
        self._fs: PerProcess[tuple[fsspec.AbstractFileSystem, str]] = PerProcess()
        self._cache: PerProcess[ShardCache] = PerProcess()
        folder, bound = storage.cache_dir, storage.shard_cache_bytes
        self.cache_dir: str | None = None
        self.shard_cache_bytes = DEFAULT_SHARD_CACHE_BYTES
        # the default cache, usable but not used yet (the corpus is larger than its bound):
        # a locality order engages it (`use_user_cache`)
        self._user_cache: tuple[str, int] | None = None
        if not isinstance(folder, DefaultCache):
            self.cache_dir = None if folder is None else os.fspath(folder)
            self.shard_cache_bytes = DEFAULT_SHARD_CACHE_BYTES if bound is None else bound
        else:
            found, size = user_cache(manifest, bound)
            if found is not None and int(manifest.bytes_per_shard().sum()) <= size:
                self.cache_dir, self.shard_cache_bytes = found, size  # the whole corpus fits
            elif found is not None:
                self._user_cache = (found, size)
        self.local()  # joins the process's budget of handles now

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        state.pop("sizes", None)
        return state

    def attach(self, sizes: IntColumn) -> None:
        """After an unpickle: the bytes per shard (the owner's checked copy, never pickled);
        this process's side is made now (it joins the process's budget of handles)."""
        self.sizes = sizes
        self.local()

    def _new_local(self) -> ProcessFiles:
        return ProcessFiles(self.sizes, self.storage.max_open_shards)

    def local(self) -> ProcessFiles:
        """This process's side (made afresh after a fork or an unpickle)."""
        return self._local.get(self._new_local)

    def use_user_cache(self, window_shards: int) -> None:
        """Read through the default cache (of a corpus larger than its bound) from now on,
        for a `LocalityOrder` of ``window_shards`` shards, if the bound holds two such
        windows of the largest shard; else log why range reads go on."""
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
        self._local.reset()
        self._cache.reset()
        self.local()

    # handles -------------------------------------------------------------------------
    def keep(self, shard: int, handle: object) -> None:
        self.local().handles.put(shard, handle)

    def forget(self, shard: int) -> None:
        """Drop this process's open handle of ``shard`` (re-opened on its next use)."""
        self.local().handles.pop(shard)

    def open_shards(self) -> list[int]:
        """Shards this dataset holds an open handle of in this process, least recently used
        first (at most ``max_open_shards``; ``len(PROCESS_HANDLES)`` counts every dataset's)."""
        return self.local().handles.keys()

    # the file system -----------------------------------------------------------------
    def filesystem(self) -> tuple[fsspec.AbstractFileSystem, str]:
        """This process's ``(file system, root path)`` of the manifest's root (opened lazily)."""
        return self._fs.get(self._open_filesystem)

    def _open_filesystem(self) -> tuple[fsspec.AbstractFileSystem, str]:
        root = self.manifest.root
        if root is None:
            raise ConfigError("the manifest has no root; hint: pass root=")
        return filesystem(root, **self.storage.fs_options)

    def is_local(self) -> bool:
        return is_local_fs(self.filesystem()[0])

    def uses_shard_cache(self) -> bool:
        """Are shards read from verified local copies (``cache_dir`` and a remote root)? The
        lookahead (`detdata.datasets.prefetch`) fills the caches of such readers only."""
        return self.cache_dir is not None and not self.is_local()

    def path(self, shard: int) -> str:
        """The path of ``shard``'s file under the root (its name decoded alone: no manifest
        entry built)."""
        return join(self.filesystem()[1], self.manifest.shard_path(shard))

    # the cache of shard copies ---------------------------------------------------------
    @property
    def shard_cache(self) -> ShardCache | None:
        """This process's verified local `ShardCache` (None without ``cache_dir``)."""
        return None if self.cache_dir is None else self._cache.get(self._new_cache)

    def _new_cache(self) -> ShardCache:
        assert self.cache_dir is not None
        return ShardCache(
            self.cache_dir,
            self.shard_cache_bytes,
            retry=self.storage.retry,
            verify_on_open=self.storage.cache_verify,
        )

    def open_copy(self, shard: int, open_path: Callable[[str], tuple[H, int]]) -> tuple[H, str]:
        """``(handle, path)``: ``open_path(path) -> (handle, inode)`` on the cached copy of
        ``shard``, filled first if needed; a copy evicted or replaced before the open
        (`ShardCache.confirm_open`) is fetched again, up to `_OPEN_ATTEMPTS` times."""
        cache = self.shard_cache
        assert cache is not None  # only called with cache_dir
        for _ in range(_OPEN_ATTEMPTS):
            path = self.cached_path(shard)
            try:
                handle, inode = open_path(path)
            except (FileNotFoundError, NotADirectoryError):
                continue
            if not cache.confirm_open(path, inode):
                del handle  # not the file that was checked: closed with its last reference
                continue
            self.local().copies[shard] = (path, inode)
            return handle, path
        raise StorageError(
            f"shard {self.manifest.shards[shard].path}: its cached copy under "
            f"{self.cache_dir} was evicted {_OPEN_ATTEMPTS} times before it could "
            "be opened; hint: raise shard_cache_bytes (other processes share this "
            "cache)"
        )

    def cached_path(self, shard: int) -> str:
        """A verified local copy of ``shard`` (filled on first use); drops handles of evicted
        copies."""
        cache = self.shard_cache
        assert cache is not None  # only called with cache_dir
        fills = cache.stats.fills
        path = self._fill(cache, shard, background=False)
        if cache.stats.fills != fills:  # a fill may have evicted copies this process has open
            self._drop_replaced(but=shard)
        return path

    def _fill(self, cache: ShardCache, shard: int, *, background: bool) -> str:
        entry = self.manifest.shards[shard]
        fs, root_path = self.filesystem()
        url = redact_url(self.manifest.url(entry))
        return cache.path(entry, fs, join(root_path, entry.path), url, background=background)

    def prefetch_copy(self, shard: int) -> None:
        """Fill the verified cached copy of ``shard`` now, as a background prefetch would
        (`detdata.datasets.prefetch`); opens no handle. No-op without a shard cache."""
        if not self.uses_shard_cache():
            return
        cache = self.shard_cache
        assert cache is not None
        self._fill(cache, shard, background=True)

    def release_copy(self, shard: int) -> None:
        """Mark the cached copy of ``shard`` as the first to evict (its last use in a prefetch
        window has passed); it stays readable until evicted."""
        cache = self.shard_cache
        if cache is not None:
            cache.release(self.manifest.shards[shard])

    def drop_if_replaced(self, shard: int) -> str | None:
        """Forget the handle of ``shard`` if its cached copy was evicted or replaced; the
        copy's path when the handle is still current."""
        local = self.local()
        known = local.copies.get(shard)
        if known is None:
            return None
        path, inode = known
        try:
            same = os.stat(path).st_ino == inode
        except (FileNotFoundError, NotADirectoryError):  # evicted, or the cache folder removed
            same = False
        if not same:
            self.forget(shard)
            local.copies.pop(shard, None)
            return None
        return path

    def _drop_replaced(self, but: int = -1) -> None:
        """`drop_if_replaced` of every shard with an open copy (but ``but``)."""
        for other in list(self.local().copies):  # a snapshot: reader threads change it
            if other != but:
                self.drop_if_replaced(other)

    def refresh_copies(self, shards: Iterable[int]) -> None:
        """Before a batch: drop handles whose cached copy changed; refresh the others' LRU time."""
        cache = self.shard_cache
        if cache is not None and cache.copies_changed():  # another process filled or evicted
            self._drop_replaced()
        for shard in shards:
            path = self.drop_if_replaced(shard)
            if path is not None and cache is not None:
                cache.touch(path)

    def copy_path(self, shard: int) -> str:
        """The cached copy the open handle of ``shard`` reads (``""``: none open)."""
        return self.local().copies.get(shard, ("", 0))[0]

    # the checks of every open ----------------------------------------------------------
    def checks(self) -> OpenChecks:
        return OpenChecks(self.check_opened_arrays, self.check_stat, self.missing, self.short_read)

    def missing(self, shard: int, path: str) -> VerificationError:
        entry = self.manifest.shards[shard]
        return VerificationError(
            f"shard {entry.path} ({path}): missing; it was verified when the dataset "
            "was opened, then deleted or renamed; hint: restore it and resume from the "
            "last saved state",
            shard=entry.path,
            field="exists",
            expected=True,
            found=False,
        )

    def short_read(self, fd: int, shard: int, path: str, nbytes: int, offset: int) -> NoReturn:
        """A ``preadv`` of ``nbytes`` at ``offset`` read fewer: the file was truncated
        (`VerificationError` via `check_size`), else a `StorageError`; raises either way."""
        self.check_size(shard, os.fstat(fd).st_size, path)
        raise StorageError(
            f"shard {self.manifest.shards[shard].path} ({path}): short read of "
            f"{nbytes} bytes at offset {offset}; hint: check the file system"
        )

    def check_size(self, shard: int, found: int, path: str) -> None:
        """`VerificationError` naming ``shard`` when its file ``path`` does not have the
        manifest's bytes (fewer: truncated, and touching a mapped page past its end kills the
        process with SIGBUS, so reads check the size first; more: rewritten or replaced)."""
        expected = int(self.sizes[shard])
        if found == expected:
            return
        name = self.manifest.shards[shard].path
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

    def encoded_names(self, shards: npt.NDArray[np.int64]) -> list[bytes]:
        """A list indexed by shard holding, at least for ``shards``, each path under the root,
        file-system encoded (filled in as shards are first read)."""
        local = self.local()
        names = local.names
        if names is None:
            count = len(self.manifest.shards)
            local.named = np.zeros(count, dtype=np.bool_)
            names = local.names = [b""] * count
        missing = shards[~local.named[shards]]
        if missing.size:
            shard_path = self.manifest.shard_path  # the path alone: no entry built
            for shard in missing.tolist():
                names[shard] = os.fsencode(shard_path(shard))
            local.named[missing] = True  # after the names: a reader thread tests it first
        return names

    def check_opened(self, shard: int, fd: int, path: str) -> None:
        """`check_stat` of the open descriptor ``fd`` of ``shard``'s file ``path``."""
        self.check_stat(shard, os.fstat(fd), path)

    def check_stat(self, shard: int, st: os.stat_result, path: str) -> None:
        """`check_size`, then a `VerificationError` unless the file is the one (inode, device,
        mtime) this process first opened for ``shard`` (recorded at that open)."""
        self._check_identity(shard, st.st_size, _identity(st), path)

    def _check_identity(self, shard: int, size: int, now: tuple[int, int, int], path: str) -> None:
        if size != self.sizes[shard]:
            self.check_size(shard, size, path)
        if self.cache_dir is not None and self.uses_shard_cache():
            return  # cached copies: checked against their (path, inode) (`drop_if_replaced`)
        seen = self.local().first.record(shard, now)
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

    def check_opened_arrays(
        self,
        ids: npt.NDArray[np.int64],
        sizes: npt.NDArray[np.int64],
        now: npt.NDArray[np.uint64],
        prefix: str,
    ) -> None:
        """`check_stat` of many opens at once (vectorised): shard ``ids[i]``'s file ``prefix
        + path`` had ``sizes[i]`` bytes and identity ``now[i]`` (an ``fstat`` after its
        read); the first culprit, in the order given, raises `check_stat`'s error."""
        if not ids.size:
            return
        bad = sizes != self.sizes.take(ids)
        if not self.uses_shard_cache():
            first = self.local().first
            bad |= ~first.recorded(ids)
            changed = first.ident.take(ids, axis=0) != now  # (n, 3): take ~3x cheaper
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

    def check_file(self, shard: int, path: str) -> None:
        """`check_stat` of file ``path`` (missing: a size of 0 bytes; ``""``: not opened
        yet)."""
        if not path:
            return
        try:
            st = os.stat(path)
        except FileNotFoundError:
            self.check_size(shard, 0, path)
            return
        self.check_stat(shard, st, path)
