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
* Bounded handles: open handles (memory maps, readers; each holds at most one
  descriptor and one mapping) live in a `HandleLRU` of at most ``max_open_shards``
  (default `DEFAULT_MAX_OPEN_SHARDS`) shards per dataset, whatever the number of
  shards read: the least recently used handle is dropped (closed when its last
  reference goes) to make room, and re-opened on its next use. The bound is also
  process-wide: every reader's LRU shares this process's `ProcessHandles` budget, so
  all datasets of a process together (the N sources of a `detdata.Mixture`, several
  loaders, reader threads) hold at most ``max(set_max_open_shards bound (default
  128), the largest max_open_shards of a live dataset)`` handles; a put over it
  evicts the least recently used handle of any dataset. A forked child starts with
  no handles (its inherited ones are dropped at the fork); an unpickled dataset
  starts empty and joins its process's budget. Nothing else kept per shard grows
  with the shards touched: the remembered cached copies (``(path, inode)``) are
  dropped with their handle. The bounds never change the bytes read, so they are
  not part of ``identity()``.

Subclasses own their handles: they implement `ShardReader._forget_handle` and
extend `_build_index` / `_reset_process_state` (calling the base's).
"""

from __future__ import annotations

import abc
import enum
import itertools
import os
import shutil
import threading
import warnings
import weakref
from collections import OrderedDict
from collections.abc import Callable, Iterable, Mapping
from typing import Any, ClassVar, Final, Generic, TypeVar

import fsspec
import numpy as np
import numpy.typing as npt
from fsspec.implementations.local import LocalFileSystem

from detdata.base.checks import check_positive_int
from detdata.base.errors import ConfigError, StorageError, VerificationError
from detdata.base.redact import get_logger, redact_url
from detdata.datasets.process_local import ProcessLocal
from detdata.identity.entry import Verify
from detdata.identity.manifest import Manifest
from detdata.storage.cache import ShardCache
from detdata.storage.first_opens import FirstOpens
from detdata.storage.first_opens import file_identity as _identity
from detdata.storage.fs import filesystem, is_url, join
from detdata.storage.retry import RetryPolicy, check_policy

#: Default bound of the disk cache of shard copies (``shard_cache_bytes``).
DEFAULT_SHARD_CACHE_BYTES: Final = 16 << 30
#: Bound of the default cache (`DefaultCache.USER`) when ``shard_cache_bytes`` is not given;
#: also at most half the free space of its file system when the dataset is made.
DEFAULT_USER_CACHE_BYTES: Final = 4 << 30
#: The default cache is used only where it holds this many of the largest shard at once.
USER_CACHE_MIN_SHARDS: Final = 4
#: The environment variable naming the default cache's folder (it chooses where copies
#: live, never which bytes are read).
ENV_CACHE_DIR: Final = "DETDATA_CACHE_DIR"
#: How often a copy evicted between its fill and its open is fetched again.
_OPEN_ATTEMPTS: Final = 5
#: Default bound of the shards with an open handle per process (``max_open_shards``): well
#: under the usual 1,024-descriptor soft limit, with room for a few readers in one process.
DEFAULT_MAX_OPEN_SHARDS: Final = 128

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


def check_cache_verify(value: object) -> str:
    """``cache_verify``: how a cached shard copy is re-checked on open (``quick`` or ``full``)."""
    if value not in ("quick", "full"):
        raise ConfigError(
            f"cache_verify must be 'quick' (size + first/last MiB) or 'full' (re-hash "
            f"the whole copy on open), got {value!r}"
        )
    return str(value)


class DefaultCache(enum.Enum):
    """``cache_dir``'s default for `TokenWindows`: ``USER`` is a bounded per-user folder
    (`user_cache_dir`) used for remote roots only (see `user_cache`)."""

    USER = "user"


def user_cache_dir() -> str:
    """The default cache's folder: ``$DETDATA_CACHE_DIR``, else
    ``$XDG_CACHE_HOME/detdata/shards``, else ``~/.cache/detdata/shards``."""
    found = os.environ.get(ENV_CACHE_DIR, "")
    if found:
        return found
    base = os.environ.get("XDG_CACHE_HOME", "") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "detdata", "shards")


def user_cache(manifest: Manifest, shard_cache_bytes: int | None) -> tuple[str | None, int]:
    """``(cache_dir, shard_cache_bytes)`` of the default cache for ``manifest`` (resolved,
    with a root). A reader uses it at once where the whole corpus fits in the bound (each
    shard is then fetched once, in any order), else only for a locality order
    (`ShardReader.use_user_cache`): under a global shuffle a cache smaller than the corpus
    would fetch a whole shard for each sample, where range reads fetch the sample.

    None (coalesced range reads, as with ``cache_dir=None``) for a local root, and, with a
    logged warning, where the folder cannot be made or written, or where the bound (
    ``shard_cache_bytes``, else `DEFAULT_USER_CACHE_BYTES` and at most half the free space)
    holds fewer than `USER_CACHE_MIN_SHARDS` of the largest shard. Which of these applies
    never changes a byte read: copies are verified against the manifest's blake3."""
    root = manifest.root or ""
    if not is_url(root) or root.startswith("file://"):
        return None, DEFAULT_SHARD_CACHE_BYTES
    folder = user_cache_dir()
    try:
        os.makedirs(folder, exist_ok=True)
        if not os.access(folder, os.W_OK | os.X_OK):
            raise PermissionError(f"{folder} is not writable")
        free = shutil.disk_usage(folder).free
    except OSError as exc:
        log.warning(
            "detdata: the default shard cache %s cannot be used (%s); remote shards are read "
            "with range requests (slower); hint: set %s or pass cache_dir=",
            folder,
            exc,
            ENV_CACHE_DIR,
        )
        return None, DEFAULT_SHARD_CACHE_BYTES
    bound = shard_cache_bytes
    if bound is None:
        bound = min(DEFAULT_USER_CACHE_BYTES, free // 2)
    sizes = manifest.bytes_per_shard()
    largest = int(sizes.max()) if sizes.size else 0
    if largest * USER_CACHE_MIN_SHARDS > bound:
        log.warning(
            "detdata: the default shard cache %s (bound %d bytes) holds fewer than %d of the "
            "largest shard (%d bytes); remote shards are read with range requests (slower); "
            "hint: pass cache_dir= and shard_cache_bytes= for a larger cache",
            folder,
            bound,
            USER_CACHE_MIN_SHARDS,
            largest,
        )
        return None, DEFAULT_SHARD_CACHE_BYTES
    return folder, bound


def check_cache_args(
    cache_dir: str | os.PathLike[str] | DefaultCache | None, shard_cache_bytes: int | None
) -> tuple[str | DefaultCache | None, int | None]:
    """``(cache_dir as str, `DefaultCache` or None, shard_cache_bytes)``; `ConfigError`
    for bad values.

    With a folder, ``shard_cache_bytes`` defaults to `DEFAULT_SHARD_CACHE_BYTES`; with
    `DefaultCache.USER` it stays None when not given (`user_cache` picks the bound);
    with None (no cache) it must not be given.
    """
    if isinstance(cache_dir, DefaultCache):
        if shard_cache_bytes is None:
            return cache_dir, None
        return cache_dir, check_positive_int(shard_cache_bytes, "shard_cache_bytes")
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


def check_max_open_shards(value: object) -> int:
    """``max_open_shards`` (None: `DEFAULT_MAX_OPEN_SHARDS`) as an int >= 1, else `ConfigError`."""
    if value is None:
        return DEFAULT_MAX_OPEN_SHARDS
    return check_positive_int(value, "max_open_shards")


class ProcessHandles:
    """The process-wide budget of open shard handles, shared by every `HandleLRU` given it.

    It orders ``(owner, shard)`` pairs of all its owners least recently used first and holds
    at most `capacity` of them: ``max(bound, the largest capacity of a live owner)``, where
    ``bound`` is set with `set_bound` (`set_max_open_shards` for the process's budget). A put
    that goes over it evicts the least recently used handle of *any* owner (the owner's
    ``forget`` callback runs). Owners are held weakly: a dead owner's entries are purged at
    the next put. After a fork the child starts empty (`after_fork`: every owner's handles
    are dropped, the lock made anew), as the per-process file system state does.
    """

    def __init__(self, bound: int = DEFAULT_MAX_OPEN_SHARDS) -> None:
        self.bound = check_positive_int(bound, "max_open_shards")
        self._capacity = self.bound
        self.evictions = 0
        self.lock = threading.Lock()
        self.order: OrderedDict[tuple[int, int], None] = OrderedDict()
        self._owners: dict[int, weakref.ref[HandleLRU[Any]]] = {}
        self._caps: dict[int, int] = {}
        self._dead: list[int] = []  # appended by weakref callbacks (any thread, even mid-put)
        self._tokens = itertools.count()

    def __len__(self) -> int:
        return len(self.order)

    @property
    def capacity(self) -> int:
        """The most handles all owners together hold: ``max(bound, live owners' capacities)``."""
        if self._dead:
            with self.lock:
                self._purge_locked()
        return self._capacity

    @property
    def full(self) -> bool:
        """Would one more handle (of any owner) evict another?"""
        return len(self.order) >= self.capacity

    def register(self, owner: HandleLRU[Any]) -> int:
        """Add ``owner`` (held weakly); returns its token."""
        token = next(self._tokens)
        dead = self._dead
        with self.lock:
            self._owners[token] = weakref.ref(owner, lambda _: dead.append(token))
            self._caps[token] = owner.capacity
            self._resize_locked()
        return token

    def set_bound(self, bound: int) -> None:
        """Change the bound; evicts at once down to the new `capacity`."""
        bound = check_positive_int(bound, "max_open_shards")
        with self.lock:
            self.bound = bound
            self._purge_locked()
            self._resize_locked()
            self._shrink_locked(-1)

    def after_fork(self) -> None:
        """In a forked child: a new lock, no handles (each owner's are dropped), same bound."""
        self.lock = threading.Lock()
        for ref in list(self._owners.values()):
            owner = ref()
            if owner is not None:
                owner._drop_all()
        self.order.clear()

    # under the lock ----------------------------------------------------------------
    def _resize_locked(self) -> None:
        self._capacity = max([self.bound, *self._caps.values()])

    def _purge_locked(self) -> None:
        dead = set()
        while self._dead:
            dead.add(self._dead.pop())
        if not dead:
            return
        for token in dead:
            self._owners.pop(token, None)
            self._caps.pop(token, None)
        for key in [k for k in list(self.order) if k[0] in dead]:  # a snapshot (C-level copy)
            del self.order[key]
        self._resize_locked()

    def _shrink_locked(self, token: int) -> list[int]:
        """Evict down to `capacity`; returns the evicted shards of owner ``token``."""
        mine: list[int] = []
        while len(self.order) > self._capacity:
            (owner_token, shard), _ = self.order.popitem(last=False)
            self.evictions += 1
            if owner_token == token:
                mine.append(shard)
                continue
            ref = self._owners.get(owner_token)
            owner = ref() if ref is not None else None
            if owner is not None:
                owner._evicted(shard)
        return mine


#: This process's budget of open shard handles (all `ShardReader` instances share it).
_PROCESS_HANDLES: Final = ProcessHandles()
os.register_at_fork(after_in_child=_PROCESS_HANDLES.after_fork)
#: Serialises the lazy creation of a reader's file system and shard cache: the lookahead's
#: fill threads and reader threads may ask for them at the same time, and two caches would
#: split the counters (and two file systems the connection pools) of one reader.
_LAZY = threading.Lock()


def _new_lazy_lock() -> None:
    global _LAZY
    _LAZY = threading.Lock()  # a thread of the parent may have held it at the fork


os.register_at_fork(after_in_child=_new_lazy_lock)


def set_max_open_shards(bound: int | None) -> None:
    """Bound the shards with an open handle in this process, over all datasets together.

    The process budget is ``max(bound, the largest max_open_shards of a live dataset)``
    (None restores the default, `DEFAULT_MAX_OPEN_SHARDS`), so a dataset's own
    ``max_open_shards`` is always honoured while any number of datasets (the sources of a
    `detdata.Mixture`, several loaders) together hold at most the budget. Lowering it
    evicts at once. Per process: a forked or spawned worker starts with the default
    unless it calls this itself (e.g. in ``worker_init_fn``). Never changes the bytes read.
    """
    _PROCESS_HANDLES.set_bound(DEFAULT_MAX_OPEN_SHARDS if bound is None else bound)


def process_max_open_shards() -> int:
    """This process's budget of shards with an open handle (see `set_max_open_shards`)."""
    return _PROCESS_HANDLES.capacity


def process_open_shards() -> int:
    """Shards with an open handle in this process, over every dataset (<= the budget)."""
    return len(_PROCESS_HANDLES)


class HandleLRU(Generic[H]):
    """At most ``capacity`` open handles keyed by shard index, least recently used evicted first.

    ``get`` marks a handle most recently used; ``put`` adds (or replaces) one and, when
    more than ``capacity`` are held, drops the least recently used ones and returns
    their shards. With a ``budget`` (a `ProcessHandles`; every `ShardReader` uses the
    process's), the handles of all its owners together also stay within the budget's
    capacity: a put may evict another owner's handle (that owner's ``forget(shard)``
    runs, and its `evictions` counts it). A dropped handle is only unreferenced: it is
    closed when its last user (e.g. a reader thread still gathering from it) lets it go,
    so eviction never invalidates a read in progress. Thread-safe: ``get``/``put``/``pop``
    hold the (budget's) lock while they change the order (``get`` once per touched shard
    per read), and ``forget`` runs under it too, so an eviction's late forget can never
    drop the copy record of a handle another thread has reopened meanwhile.
    """

    def __init__(
        self,
        capacity: int,
        *,
        budget: ProcessHandles | None = None,
        forget: Callable[[int], object] | None = None,
    ) -> None:
        self.capacity = capacity
        self.evictions = 0
        self._items: OrderedDict[int, H] = OrderedDict()
        self._budget = budget
        self._forget = forget
        self._lock = threading.Lock() if budget is None else budget.lock
        self._token = -1 if budget is None else budget.register(self)

    def __len__(self) -> int:
        return len(self._items)

    @property
    def full(self) -> bool:
        """Would a new handle evict another (this LRU's, or, with a budget, any owner's)?"""
        if len(self._items) >= self.capacity:
            return True
        return self._budget is not None and self._budget.full

    def keys(self) -> list[int]:
        """Shards with an open handle, least recently used first."""
        with self._lock_now():
            return list(self._items)

    def get(self, shard: int) -> H | None:
        """The handle of ``shard`` (now the most recently used), or None."""
        handle = self._items.get(shard)
        if handle is None:
            return None
        # under the lock: a put/purge iterating the budget's order must not see it move
        with self._lock_now():
            try:
                self._items.move_to_end(shard)
                if self._budget is not None:
                    self._budget.order.move_to_end((self._token, shard))
            except KeyError:  # evicted by another thread meanwhile: still valid for this read
                pass
        return handle

    def put(self, shard: int, handle: H) -> list[int]:
        """Hold ``handle`` for ``shard`` as the most recently used; returns the shards whose
        handles were evicted to stay within ``capacity`` (and the budget)."""
        evicted: list[int] = []
        budget = self._budget
        with self._lock_now():
            self._items[shard] = handle
            self._items.move_to_end(shard)
            if budget is not None:
                budget._purge_locked()
                budget.order[(self._token, shard)] = None
                budget.order.move_to_end((self._token, shard))
            while len(self._items) > self.capacity:
                old = self._items.popitem(last=False)[0]
                evicted.append(old)
                if budget is not None:
                    budget.order.pop((self._token, old), None)
            if budget is not None:
                for old in budget._shrink_locked(self._token):
                    self._items.pop(old, None)
                    evicted.append(old)
            self.evictions += len(evicted)
            # under the lock: a late forget must not drop the record of a handle reopened
            # (and put) by another thread meanwhile
            if self._forget is not None:
                for old in evicted:
                    self._forget(old)
        return evicted

    def pop(self, shard: int) -> H | None:
        """Forget the handle of ``shard`` (not counted as an eviction); returns it, or None."""
        with self._lock_now():
            if self._budget is not None:
                self._budget.order.pop((self._token, shard), None)
            return self._items.pop(shard, None)

    # the budget's side (called under its lock) ------------------------------------------
    def _lock_now(self) -> threading.Lock:
        """The lock to take now (a budget's lock is made anew in a forked child)."""
        return self._lock if self._budget is None else self._budget.lock

    def _evicted(self, shard: int) -> None:
        """Another owner's put evicted ``shard``'s handle from the shared budget."""
        if self._items.pop(shard, None) is not None:
            self.evictions += 1
        if self._forget is not None:
            self._forget(shard)

    def _drop_all(self) -> None:
        """Drop every handle (a forked child must not keep its parent's)."""
        shards = list(self._items)
        self._items.clear()
        if self._forget is not None:
            for shard in shards:
                self._forget(shard)


class ShardReader(ProcessLocal, abc.ABC):
    """Base of datasets that read the shard files of one manifest (see the module docstring).

    After ``__init__``: ``manifest`` (verified, with a root), ``storage_options``,
    ``retry``, ``cache_dir`` (str or None), ``shard_cache_bytes``, ``cache_verify`` and
    ``max_open_shards``. None of these but the manifest changes the data read.
    Subclasses keep their handles in ``self._handles`` (a `HandleLRU`), added with
    `_keep_handle`.
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

    def __init__(
        self,
        manifest: Manifest | str,
        *,
        verify: str | Verify,
        root: str | None,
        storage_options: Mapping[str, Any] | None,
        retry: RetryPolicy | None,
        cache_dir: str | os.PathLike[str] | DefaultCache | None,
        shard_cache_bytes: int | None,
        cache_verify: str,
        max_open_shards: int | None = None,
    ) -> None:
        self.max_open_shards = check_max_open_shards(max_open_shards)
        self.storage_options = dict(storage_options or {})
        self.retry = check_policy(retry)
        folder, bound = check_cache_args(cache_dir, shard_cache_bytes)
        self.cache_verify = check_cache_verify(cache_verify)
        self.manifest = resolve_manifest(
            manifest,
            verify=verify,
            root=root,
            storage_options=self.storage_options,
            retry=self.retry,
        )
        self.cache_dir: str | None = None
        self.shard_cache_bytes = DEFAULT_SHARD_CACHE_BYTES
        # the default cache, usable but not used yet (the corpus is larger than its bound):
        # a locality order engages it (`use_user_cache`)
        self._user_cache: tuple[str, int] | None = None
        if not isinstance(folder, DefaultCache):
            self.cache_dir = folder
            self.shard_cache_bytes = DEFAULT_SHARD_CACHE_BYTES if bound is None else bound
            return
        found, size = user_cache(self.manifest, bound)
        if found is None:
            return
        if int(self.manifest.bytes_per_shard().sum()) <= size:
            self.cache_dir, self.shard_cache_bytes = found, size  # the whole corpus fits
        else:
            self._user_cache = (found, size)

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
                "requests (slower); hint: pass cache_dir= and shard_cache_bytes=",
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
        self._size_array: npt.NDArray[np.int64] = self.manifest.bytes_per_shard()
        self._sizes = self._size_array

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
        self._first = FirstOpens(self.manifest.bytes_per_shard())
        self._names_bytes: list[bytes] | None = None  # `_encoded_names`, built when needed
        self._named: npt.NDArray[np.bool_] = np.zeros(0, dtype=np.bool_)
        # in the process's budget; an evicted handle's copy is forgotten (no reference to self)
        self._handles: HandleLRU[Any] = HandleLRU(
            self.max_open_shards,
            budget=_PROCESS_HANDLES,
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
        the fill and the open (``FileNotFoundError``) is fetched again, up to 5 times.
        """
        for _ in range(_OPEN_ATTEMPTS):
            path = self._cached_path(shard)
            try:
                handle, inode = open_path(path)
            except (FileNotFoundError, NotADirectoryError):
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
            entries = self.manifest.shards
            for shard in missing.tolist():
                names[shard] = os.fsencode(entries[shard].path)
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
