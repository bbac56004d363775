"""Fixed-length token windows over ``.npy`` / ``.bin`` token shards.

A `TokenWindows` dataset cuts every token shard of a manifest into windows of
``seq_len`` tokens. With ``labels=True`` (default) a window carries one extra
token for next-token labels, so window ``w`` of a shard covers tokens
``[w * seq_len, w * seq_len + seq_len + 1)`` and consecutive windows share one
token. Windows never cross shard boundaries; a shard of ``T`` tokens holds
``(T - 1) // seq_len`` windows with labels (``T // seq_len`` without) and its
tail tokens are dropped. Window ids are numbered shard by shard in manifest
(path) order.

Reading: ``read(ids)`` checks the ids once (min/max), and when they all fall in
one shard does ONE fancy-index gather from a strided 2-D view of that shard's
read-only memory map straight into the result. Otherwise it maps ids to shards with
one ``np.searchsorted`` over the cumulative window counts, groups them by shard
(stable argsort of the shard index), does one gather per touched shard into a
buffer and one scatter into the result (local roots) or, for remote
fsspec roots, ONE ``fs.cat_ranges`` call for the whole batch, after the windows of
each shard are coalesced into few covering requests (`detdata.storage.ranges`: at
most 20% extra bytes per shard; failed requests are retried with backoff under
``retry``, a `RetryPolicy`). With ``cache_dir``,
remote shards are instead copied whole into a bounded, blake3-verified local
`ShardCache` and read through the memmap path. Memmaps, caches and file systems
are opened lazily per process and dropped when pickled.

Bounded handles (local roots and cached copies): at most ``max_open_shards``
shards (default 128) of a dataset are memory-mapped per process, in a `HandleLRU`
(one descriptor and one mapping each), and all datasets of the process together
stay within its budget (`detdata.set_max_open_shards`); the least
recently used mapping is dropped to make room. When the LRU (or the budget) is
full, a shard that is not mapped is read without keeping anything open
(`_pread_rows`: open, read, close) unless the read needs at least `MAP_MIN_ROWS`
of its windows and they are not `covered` (then it is mapped, evicting one):
windows that are ``covered`` (dense, in at most `COVER_MAX_BYTES`; or a single
window) are read with ONE ``preadv`` of the range that covers them, other windows
with one ``preadv`` each. Either costs a few syscalls instead of a ~40 us map + page
faults + unmap. For a batch over many shards the bookkeeping is vectorised (one
argsort of the ids gives every touched shard's rows, counts and byte offsets):
covered ranges of all such shards are read into one staging buffer and gathered with
ONE fancy index (`_read_staged`), or, for runs of consecutive windows stored as
delivered, straight into the rows of the result (`_read_direct`: one buffer per row
in the ``preadv``; with ``labels`` each row's shared label token is copied from the
next row after), leaving about 3 syscalls and ~2 us of Python per touched shard.
So many-shard shuffled reads hold O(``max_open_shards``) resources. The bound and
the read path never change the bytes read.

Read-ahead: the order is known ahead, so a caller may hint a coming read
(`TokenWindows.prefetch`; the ``num_workers=0`` loader hints its next groups). The read
is planned then and its first batch of file reads (``open`` + ONE ``preadv`` + ``fstat``
+ ``close`` per shard, `detdata.storage.fileread.start_read_files`) runs on native
threads without the GIL, overlapping the caller's work; the read later waits for it and
runs the rest of the plan (the checks, any further reads). A hint changes when files
are read, not how: the bytes and checks are those of a read without it, taken when the
files are read (a shard changed after its background read but before the read is
delivered as it was read, and named at its next read).

Before touching a shard's mapping, every read checks that the mapped file still
has the manifest's size (one ``fstat`` per touched shard, ~0.5 us): a shard
truncated during the run is a `VerificationError` naming it, expected and found
sizes, instead of a SIGBUS that kills the process. Every open of a shard's path (a
mapping, or a ``preadv`` read without one) checks the file's size against the
manifest's and its inode, device and mtime against the file this process first
opened for the shard (`ShardReader._check_opened`): a shard truncated, grown,
replaced (renamed over) or rewritten during the run is a `VerificationError` naming
it, whichever path and ``max_open_shards`` read it, never other bytes. Not caught: a
truncation racing with the read itself, a replacement before this process first
opened the shard, and bytes rewritten in place under a live mapping at the same size
(verification happens when the manifest is opened).
"""

from __future__ import annotations

import collections
import mmap
import os
import threading
from collections.abc import Generator, Sequence
from typing import Any, Final, Generic, NamedTuple, TypeVar

import fsspec
import numpy as np
import numpy.typing as npt
from fsspec.implementations.local import LocalFileSystem

from detdata.base.checks import check_positive_int
from detdata.base.errors import ConfigError, FormatError, StorageError, VerificationError
from detdata.base.groupby import stable_groups
from detdata.base.types import Batch, IntArray
from detdata.datasets.base import check_ids
from detdata.datasets.columns import describe_dtype
from detdata.datasets.shard_storage import DefaultCache, Storage, storage_for
from detdata.datasets.shards import ShardReader
from detdata.identity.entry import ShardEntry
from detdata.identity.formats import TOKEN_DTYPES, Format, disk_dtype
from detdata.identity.manifest import Manifest
from detdata.order.choice import LocalityOrder, OrderChoice
from detdata.storage.cache import ShardCache
from detdata.storage.fileread import (
    INODE,
    MTIME_NS,
    NATIVE,
    SIZE,
    FileReads,
    PendingRead,
    read_files,
    start_read_files,
)
from detdata.storage.first_opens import RECORDED
from detdata.storage.fs import join, read_ranges_retrying
from detdata.storage.ranges import read_coalesced
from detdata.storage.retry import RetryPolicy, check_policy

T = TypeVar("T")

_WIDEN: dict[str, str] = {"uint16": "int32", "uint32": "int64", "int32": "int32", "int64": "int64"}
#: A shard that is not mapped while the handle LRU is full is mapped (and kept) when a read
#: needs at least this many of its windows (and they are not `covered`); fewer are read
#: with ``preadv`` (a map, its page faults and its unmap cost ~10 window reads).
MAP_MIN_ROWS: Final = 8
#: Windows of one shard whose covering range holds at most this many times as many windows
#: (and at most `COVER_MAX_BYTES`) are read with one ``preadv`` of that range.
DENSE_SPAN: Final = 2
#: The largest covering range read with one ``preadv`` (larger: mapped, or one per window).
COVER_MAX_BYTES: Final = 64 << 10
#: At most this many windows (one buffer each) in one ``preadv`` straight into the result
#: (well under the usual ``IOV_MAX`` of 1,024).
_IOV_ROWS: Final = 256
#: Native threads reading one `TokenWindows.prefetch` in the background.
PREFETCH_THREADS: Final = 2
#: Reads a `TokenWindows` keeps planned by `TokenWindows.prefetch` (an older one is dropped;
#: each holds its result buffer).
PREFETCH_DEPTH: Final = 4

#: A read's plan (`TokenWindows._gather_steps`): it yields the native file reads it needs
#: and is sent what `detdata.storage.fileread.read_files` returns for each; it returns
#: the windows.
_Steps = Generator[FileReads, tuple[int, IntArray], np.ndarray[Any, Any]]


def _drive(steps: _Steps, sent: tuple[int, IntArray] | None = None) -> np.ndarray[Any, Any]:
    """Run ``steps`` to its end, each file read it yields now; ``sent``: the result of the
    read it is waiting on (it was started by `TokenWindows.prefetch`)."""
    try:
        job = steps.send(sent)  # type: ignore[arg-type]  # None starts a fresh generator
        while True:
            job = steps.send(read_files(*job))
    except StopIteration as stop:
        result: np.ndarray[Any, Any] = stop.value
        return result


class _Prefetched(NamedTuple):
    """A read planned by `TokenWindows.prefetch`: its ids, and either the plan waiting on
    its first file read (``steps``, ``pending``) or its windows (no file read needed)."""

    ids: IntArray
    steps: _Steps | None
    pending: PendingRead | None
    windows: np.ndarray[Any, Any] | None

    def finish(self) -> np.ndarray[Any, Any]:
        """The windows (waits for the background read, then runs the rest of the plan)."""
        if self.steps is None or self.pending is None:
            assert self.windows is not None
            return self.windows
        return _drive(self.steps, self.pending.wait())

    def drop(self) -> None:
        """Forget it (its background read is joined first)."""
        if self.pending is not None:
            self.pending.wait()
        if self.steps is not None:
            self.steps.close()


class _Mapped(NamedTuple):
    """An open shard: its strided window view, the mapping under it, and the mapped file."""

    view: np.ndarray[Any, Any]
    mapping: mmap.mmap
    path: str


def read_ranges(
    fs: fsspec.AbstractFileSystem,
    paths: list[str],
    starts: list[int],
    ends: list[int],
    *,
    retry: RetryPolicy | None = None,
    shards: list[str] | None = None,
    urls: list[str] | None = None,
) -> list[bytes]:
    """Bytes ``[start, end)`` of each path: one ``fs.cat_ranges`` call per attempt.

    The single place uncached remote token bytes are read. Failed or short
    ranges are read again with backoff under ``retry``; when the deadline
    passes, `StorageError` names the shard and URL and the last error.
    """
    return read_ranges_retrying(
        fs,
        paths,
        starts,
        ends,
        policy=check_policy(retry),
        shards=shards if shards is not None else paths,
        urls=urls if urls is not None else paths,
        what="token range read",
    )


class ByCode(Generic[T]):
    """A per-shard value looked up through the shard's code: ``self[shard]`` is
    ``values[codes[shard]]`` (a few distinct values for many shards, O(values) to build)."""

    __slots__ = ("codes", "values")

    def __init__(self, codes: IntArray, values: tuple[T, ...]) -> None:
        self.codes = codes
        self.values = values

    def __getitem__(self, shard: int | np.integer[Any]) -> T:
        return self.values[int(self.codes[shard])]


class ArrayByCode:
    """A per-shard int64 value looked up through the shard's code, for one shard or an
    array of them: ``self[shards]`` is ``values[codes[shards]]`` (int64), O(values) to
    build and to keep."""

    __slots__ = ("codes", "values")

    def __init__(self, codes: IntArray, values: npt.ArrayLike) -> None:
        self.codes = codes
        self.values = np.asarray(values, dtype=np.int64)

    def __getitem__(self, shard: Any) -> Any:
        return self.values[self.codes[shard]]


def _distinct_codes(code: IntArray) -> list[int]:
    """The distinct values of ``code`` (non-negative dtype codes), ascending: `np.unique`'s
    answer without its first-call import of ``numpy.ma`` (~20 ms of a small corpus's open)."""
    return np.flatnonzero(np.bincount(code)).tolist() if code.size else []


def _resolve_out_dtype(out_dtype: str | None, shard_dtypes: Sequence[str]) -> np.dtype[Any]:
    if out_dtype is None:
        return np.result_type(*(np.dtype(_WIDEN[d]) for d in shard_dtypes))
    try:
        dt = np.dtype(out_dtype)
    except TypeError:
        raise ConfigError(
            f"out_dtype {out_dtype!r} is not a numpy dtype; hint: 'int32' or 'int64'"
        ) from None
    if dt.kind not in "iu":
        raise ConfigError(
            f"out_dtype must be an integer dtype, got {dt.name}; hint: 'int32' or 'int64'"
        )
    if not dt.isnative:
        raise ConfigError(
            f"out_dtype {out_dtype!r} is not in this machine's byte order; batches "
            "become torch tensors, which hold native byte order only; hint: pass "
            f"{dt.name!r}"
        )
    return dt


class TokenWindows(ShardReader):
    """Windows of ``seq_len`` (+1 label token) tokens over a token manifest.

    ``num_samples`` is the sum over shards of ``(T - 1) // seq_len`` with
    ``labels`` (``T // seq_len`` without); tail tokens that do not fill a window
    are dropped and windows never cross shards. ``read(ids)`` returns
    ``{"tokens": (len(ids), seq_len + labels)}`` in ``out_dtype`` (default: int32
    and int64 kept, uint16 -> int32, uint32 -> int64), rows in the order of
    ``ids``. A shard too short for one window raises `FormatError` unless
    ``allow_short_shards`` (then it holds 0 windows); an empty dataset raises
    `ConfigError`. Narrowing ``out_dtype`` casts are range-checked per batch.

    ``storage`` (a `Storage`, default ``Storage()``) says where and how shards are read.
    Remote roots: its ``retry`` (a `RetryPolicy`) governs every read; with its
    ``cache_dir`` (and ``shard_cache_bytes``, default 16 GiB, on disk;
    ``cache_verify="full"`` re-hashes a cached copy whenever it is opened instead of
    checking size + first/last MiB) whole shards are copied into a verified, bounded
    local `ShardCache` (``shard_cache``) and read from there. By default
    (``cache_dir=DefaultCache.AUTO``, here `DefaultCache.USER`) a remote root uses a
    per-user folder (``$DETDATA_CACHE_DIR``, else ``~/.cache/detdata/shards``) bounded by
    ``shard_cache_bytes`` or else 4 GiB and half the free space (`user_cache`: without
    room for 4 of the largest shard, or a writable folder, it reads with range requests
    and logs why); ``cache_dir=None`` reads remote shards with coalesced range requests
    and keeps no copy. Neither changes the data read, so neither is part of ``identity()``.

    Its ``max_open_shards`` (default 128) bounds the shards this dataset memory-maps at
    once per process (one descriptor + one mapping each; see the module docstring);
    all datasets of a process together also stay within the process budget
    (`detdata.set_max_open_shards`). Other shards are read without keeping anything
    open. It never changes the data read and is not part of ``identity()``. The keywords
    of `Storage`'s fields given directly (``verify=``, ``root=``, ``cache_dir=``, ...) are
    deprecated (`storage_for`; ``cache_bytes=`` is ``shard_cache_bytes``).
    """

    # pickling: parameters and manifest only, no memmaps or handles
    _TRANSIENT = (
        *ShardReader._TRANSIENT,
        "_disk",
        "_dtypes",
        "_batch_covers",
        "_starts",
        "_itemsize",
        "_offsets",
        "_narrowing",
        "_windows_tuple",
        "_direct",
        "_prefetched",
        "_prefetch_lock",
    )
    DEFAULT_CACHE = DefaultCache.USER  # remote windows are small reads: copy whole shards

    def __init__(
        self,
        manifest: Manifest | str,
        seq_len: int,
        *,
        labels: bool = True,
        out_dtype: str | None = None,
        allow_short_shards: bool = False,
        storage: Storage | None = None,
        **legacy: Any,
    ) -> None:
        super().__init__(manifest, storage_for("TokenWindows", storage, legacy))
        self.seq_len = check_positive_int(seq_len, "seq_len")
        self.labels = bool(labels)
        self.window = self.seq_len + int(self.labels)
        shards = self.manifest.shards
        if not shards:
            raise ConfigError(
                f"manifest {self.manifest.id} has no shards; TokenWindows needs token shards"
            )
        self._dtype_names = self._check_token_shards()
        used = _distinct_codes(self._dtype_code())
        self.out_dtype = _resolve_out_dtype(out_dtype, [self._dtype_names[c] for c in used])
        self._windows = self._count_windows(allow_short_shards)
        self._num = int(self._windows.sum())
        if self._num == 0:
            raise ConfigError(
                f"manifest {self.manifest.id}: no windows of seq_len={self.seq_len} "
                f"(labels={self.labels}) in {len(shards)} shard(s); the dataset is "
                "empty; hint: use a smaller seq_len"
            )
        self._build_index()
        self._reset_process_state()

    def _reset_process_state(self) -> None:
        super()._reset_process_state()
        self._prefetched: collections.deque[_Prefetched] = collections.deque()  # `prefetch`
        self._prefetch_lock = threading.Lock()

    # construction helpers --------------------------------------------------
    def _dtype_code(self) -> IntArray:
        """Each shard's index into ``_dtype_names`` (from the manifest's columns: no entry
        is built)."""
        return self.manifest.codes("dtype")[1]

    def _check_token_shards(self) -> tuple[str, ...]:
        """The manifest's token dtypes (indexed by `_dtype_code`); `FormatError` naming the
        first shard that is not a token shard with a consistent size (`_check_token_shard`).
        Vectorised over the manifest's columns: an entry is built only for a culprit."""
        formats, fcode = self.manifest.codes("format")
        dtypes, dcode = self.manifest.codes("dtype")
        token_fmt = np.array([Format(f) in (Format.NPY, Format.BIN) for f in formats] + [False])
        token_dt = np.array([d in TOKEN_DTYPES for d in dtypes] + [False])
        bad = ~token_fmt[fcode] | ~token_dt[dcode]  # code -1 picks the trailing False
        sizes = np.array([np.dtype(d).itemsize if d in TOKEN_DTYPES else 0 for d in dtypes] + [0])
        expected = np.maximum(self.manifest.data_offsets(), 0) + (
            self.manifest.samples_per_shard() * sizes[dcode]
        )
        bad |= expected != self.manifest.bytes_per_shard()  # a size the dtype does not explain
        if bad.any():
            _check_token_shard(self.manifest.shards[int(np.flatnonzero(bad)[0])])
        return dtypes

    def _count_windows(self, allow_short: bool) -> IntArray:
        """Windows per shard (int64, vectorised); `FormatError` naming the first shard too
        short for one window unless ``allow_short``."""
        tokens = self.manifest.samples_per_shard()
        counts = np.maximum(0, (tokens - int(self.labels)) // self.seq_len)
        if not allow_short:
            short = np.flatnonzero(counts == 0)
            if short.size:
                self._count(self.manifest.shards[int(short[0])], False)
        counts.flags.writeable = False
        return counts

    @property
    def windows_per_shard(self) -> tuple[int, ...]:
        """Windows per shard, in manifest order (a tuple built on first use: O(shards))."""
        found: tuple[int, ...] | None = self.__dict__.get("_windows_tuple")
        if found is None:
            found = tuple(self._windows.tolist())
            self.__dict__["_windows_tuple"] = found
        return found

    def _count(self, shard: ShardEntry, allow_short: bool) -> int:
        tokens = shard.num_samples
        count = max(0, (tokens - int(self.labels)) // self.seq_len)
        if count == 0 and not allow_short:
            raise FormatError(
                f"shard {shard.path}: {tokens} tokens is too short for one window of "
                f"seq_len={self.seq_len} (needs {self.window} tokens with "
                f"labels={self.labels}); hint: pass allow_short_shards=True to skip "
                "such shards, or use a smaller seq_len"
            )
        return count

    def _build_index(self) -> None:
        super()._build_index()
        counts = self._windows
        self._starts = np.zeros(counts.size, dtype=np.int64)
        np.cumsum(counts[:-1], out=self._starts[1:])
        code = self._dtype_code()
        names = self._dtype_names
        # bytes per token of each shard, looked up through its dtype code (no per-shard copy)
        self._itemsize = ArrayByCode(code, np.asarray([np.dtype(d).itemsize for d in names]))
        self._offsets = np.maximum(self.manifest.data_offsets(), 0)
        # per shard, looked up through its dtype code (O(dtypes) to build, not O(shards))
        self._disk = ByCode(code, tuple(disk_dtype(d) for d in names))
        self._dtypes = ByCode(code, names)
        # per shard: does a cast to out_dtype narrow (values must be range-checked)?
        narrowing = tuple(not np.can_cast(d, self.out_dtype, casting="safe") for d in names)
        self._narrowing = ByCode(code, narrowing)
        used = _distinct_codes(code)
        disks = {self._disk.values[c] for c in used}
        # covered spans of a batch are read into one staging buffer (`_read_staged`)
        self._batch_covers = len(disks) == 1 and not any(narrowing[c] for c in used)
        # windows stored as delivered (disk dtype == out_dtype): read straight into the result
        self._direct = self._batch_covers and self._disk[0] == self.out_dtype

    def _forget_handle(self, shard: int) -> None:
        self._handles.pop(shard)

    # parameters under their old names ------------------------------------------
    @property
    def cache(self) -> ShardCache | None:
        """This process's `ShardCache` (None without ``cache_dir``): the same as ``shard_cache``."""
        return self.shard_cache

    # Dataset protocol --------------------------------------------------------
    @property
    def num_samples(self) -> int:
        """Number of windows over all shards."""
        return self._num

    def __len__(self) -> int:
        """`num_samples` (samples of one epoch), as torch's ``len(dataset)``."""
        return self.num_samples

    def use_order(self, choice: OrderChoice) -> None:
        """Announce the order this dataset is read in (`OrderedStream` does): a
        `LocalityOrder` over shards engages the default cache of a remote corpus larger than
        its bound (`use_user_cache`). Changes where shards are read from, never the bytes."""
        if isinstance(choice, LocalityOrder) and choice.window_shards is not None:
            self.use_user_cache(choice.window_shards)

    @property
    def shard_sizes(self) -> tuple[int, ...]:
        """Windows per shard in manifest order (ids are laid out shard after shard): what
        a `detdata.LocalityOrder` groups into windows of shards."""
        return self.windows_per_shard

    @property
    def tokens_per_sample(self) -> int:
        """``seq_len``: the input tokens of a window (not the extra label token), as
        ``DataLoader.tokens_consumed`` counts them (`TokenCounting`)."""
        return self.seq_len

    def schema(self) -> dict[str, str]:
        """Column -> what `read` delivers (`detdata.datasets.columns.describe_column` form), without
        a read."""
        return {"tokens": describe_dtype(self.out_dtype, (self.window,))}

    def identity(self) -> dict[str, Any]:
        """Plain JSON pinning the manifest and windowing parameters."""
        return {
            "type": "token_windows",
            "manifest": self.manifest.id,
            "seq_len": self.seq_len,
            "labels": self.labels,
            "out_dtype": self.out_dtype.name,
            "num_samples": self._num,
        }

    def locate(self, ids: npt.ArrayLike) -> tuple[IntArray, IntArray]:
        """``(shard_index, window_in_shard)`` int64 arrays for window ids (checked)."""
        arr = check_ids(ids, self._num, self._what())
        shard = np.searchsorted(self._starts, arr, side="right").astype(np.int64) - 1
        return shard, arr - self._starts[shard]

    def read(self, ids: npt.ArrayLike) -> Batch:
        """``{"tokens": (len(ids), window)}``: one batched read, rows in the order of ``ids``."""
        arr = np.asarray(ids)
        if arr.ndim != 1 or arr.dtype.kind not in "iu":
            arr = check_ids(arr, self._num, self._what())  # raises the error
        arr = arr.astype(np.int64, copy=False)
        if not arr.size:
            return {"tokens": np.empty((0, self.window), dtype=self.out_dtype)}
        lo, hi = int(arr.min()), int(arr.max())
        if lo < 0 or hi >= self._num:
            check_ids(arr, self._num, self._what())  # raises the error
        fs, _ = self._filesystem()
        if isinstance(fs, LocalFileSystem):
            return {"tokens": self._gather_local(arr, lo, hi)}
        if self.cache_dir is not None:
            return {"tokens": self._gather_local(arr, lo, hi, cached=True)}
        out = np.empty((arr.size, self.window), dtype=self.out_dtype)
        self._gather_remote(fs, arr, out)
        return {"tokens": out}

    # reading -----------------------------------------------------------------
    def _what(self) -> str:
        return f"TokenWindows({self.manifest.id[:15]}…, seq_len={self.seq_len})"

    def _map_cached(self, shard: int) -> tuple[mmap.mmap, str]:
        """Mapping of the cached copy of ``shard`` and its path.

        The map is made from the file we opened, so a copy evicted by another
        process between the fill and the open is simply fetched again.
        """

        def open_path(path: str) -> tuple[mmap.mmap, int]:
            with open(path, "rb") as fh:
                return self._map_file(shard, fh, path), os.fstat(fh.fileno()).st_ino

        return self._open_copy(shard, open_path)

    def _map_file(self, shard: int, fh: Any, path: str) -> mmap.mmap:
        """A read-only mapping of the whole open file ``fh`` (size-checked first)."""
        self._check_opened(shard, fh.fileno(), path)
        return mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ)

    def _mapped_view(
        self, shard: int, rows: int, cover: bool, *, cached: bool
    ) -> np.ndarray[Any, Any] | None:
        """The strided window view of ``shard`` for a read of ``rows`` of its windows
        (``cover``: they are `covered`), after checking its file still has every byte;
        None: read them with `_pread_rows` instead.

        A shard already mapped is used (and marked recently used); otherwise it is mapped
        (evicting the least recently used mapping when the LRU is full) when it is a cached
        copy, the LRU has room, or the read needs `MAP_MIN_ROWS` windows not ``cover``-ed."""
        handle: _Mapped | None = self._handles.get(shard)
        if handle is not None:
            self._check_size(shard, handle.mapping.size(), handle.path)
            return handle.view
        if cached or not self._handles.full or (rows >= MAP_MIN_ROWS and not cover):
            return self._view(shard)
        return None

    def covered(self, shard: int, rows: int, extent: int) -> bool:
        """Are ``rows`` windows of ``shard`` spread over ``extent`` windows (max - min + 1)
        read with one ``preadv`` of their covering range (dense, and small)?"""
        return (
            rows > 1
            and extent <= DENSE_SPAN * rows
            and extent * self.seq_len * self._disk[shard].itemsize <= COVER_MAX_BYTES
        )

    def _missing(self, shard: int, path: str) -> VerificationError:
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

    def _view(self, shard: int) -> np.ndarray[Any, Any]:
        """Map ``shard`` (size-checked), keep it in the handle LRU, return its window view."""
        entry = self.manifest.shards[shard]
        dtype = self._disk[shard]
        if self._uses_shard_cache():
            mapping, path = self._map_cached(shard)
        else:
            path = join(self._filesystem()[1], entry.path)
            try:
                fh = open(path, "rb")  # noqa: SIM115 (closed below, the map outlives it)
            except FileNotFoundError:
                raise self._missing(shard, path) from None
            with fh:
                mapping = self._map_file(shard, fh, path)
        tokens = np.frombuffer(
            mapping, dtype=dtype, count=entry.num_samples, offset=int(self._offsets[shard])
        )
        view = np.lib.stride_tricks.as_strided(
            tokens,
            shape=(int(self._windows[shard]), self.window),
            strides=(self.seq_len * dtype.itemsize, dtype.itemsize),
            writeable=False,
        )
        self._keep_handle(shard, _Mapped(view, mapping, path))
        return view

    def _shard_of(self, ids: IntArray) -> IntArray:
        """The shard index of each window id."""
        return self._starts.searchsorted(ids, "right") - 1

    def _gather_local(
        self, ids: IntArray, lo: int, hi: int, *, cached: bool = False
    ) -> np.ndarray[Any, Any]:
        """The windows ``ids`` (all in ``[lo, hi]``) from the shard files, in ``out_dtype``.

        Mapped shards: one fancy-index gather per touched shard (``take`` would first
        copy a whole overlapping window view). Ids of a single mapped shard are gathered
        straight into the result; otherwise (`_gather_steps`) ids are grouped by shard
        once and each mapped shard's rows are gathered and scattered straight into the
        result (a staging buffer plus one big scatter measured ~3.7x slower for 1024
        rows). Shards not mapped (see `_mapped_view`) are read with ``preadv``: `covered`
        windows (and single windows) of all such shards in one vectorised pass
        (`_read_staged` / `_read_direct`), others one ``preadv`` per window."""
        first = int(self._starts.searchsorted(lo, "right")) - 1
        last = int(self._starts.searchsorted(hi, "right")) - 1
        if first == last:
            if cached:
                self._refresh_copies((first,))
            start = int(self._starts[first])
            local = ids - start if start else ids
            extent = int(local.max()) - int(local.min()) + 1
            cover = self.covered(first, int(ids.size), extent)
            view = self._mapped_view(first, int(ids.size), cover, cached=cached)
            if view is None:
                out = np.empty((ids.size, self.window), dtype=self.out_dtype)
                where = self._byte_offsets(np.full(ids.size, first, dtype=np.int64), local)
                prefix = join(self._root_path, "")
                self._pread_rows(first, prefix, list(range(ids.size)), where, out, cover)
                return out
            block = view[local]
            if block.dtype == self.out_dtype:
                return block
            if self._narrowing[first]:
                self._check_range(block, first)
            return block.astype(self.out_dtype)
        prefetched = self._take_prefetched(ids, cached) if self._prefetched else None
        if prefetched is not None:
            return prefetched.finish()
        return _drive(self._gather_steps(ids, cached))

    # read-ahead ------------------------------------------------------------------
    def prefetch(self, ids: npt.ArrayLike | None) -> None:
        """A hint: a coming `read` asks for ``ids`` (hints in the order of the reads; at
        most `PREFETCH_DEPTH` are kept, the oldest dropped). With a local root (no
        ``cache_dir``), a read over several shards is planned now and its file reads start
        on native threads in the background (`detdata.storage.fileread.start_read_files`,
        without the GIL), overlapping whatever the caller does until that read, which then
        waits for them and finishes the plan. The bytes and the checks are those of the
        read without the hint (each file's ``fstat`` is taken after its read and checked
        against the manifest and the file first opened when the read comes; a file that
        could not be read is read again then, raising the read's own error). ``None``
        drops every pending hint, and a read drops those hinted before its own (their
        reads are joined first); a read not hinted keeps them. Nothing is raised here:
        bad ids or unreadable files are the read's to report."""
        if ids is None:
            self._drop_prefetched()
            return
        ready = self._plan(ids) if NATIVE else None
        if ready is None:
            return
        with self._prefetch_lock:
            self._prefetched.append(ready)
            stale = [self._prefetched.popleft()] if len(self._prefetched) > PREFETCH_DEPTH else []
        for old in stale:
            old.drop()

    def _plan(self, ids: npt.ArrayLike) -> _Prefetched | None:
        """`prefetch`: the read of ``ids`` planned, its first file read started (None: not
        a read with file reads to start, or the plan failed: the read reports it). Reads
        that would not go through the batched file loop (a narrowing or mixed-dtype
        dataset, a handle LRU with room: shards get mapped) are not planned: there would
        be nothing to overlap."""
        try:
            if not (self._batch_covers and self._handles.full):
                return None
            arr = np.array(ids, copy=True)  # the caller may reuse its array
            if arr.ndim != 1 or arr.dtype.kind not in "iu" or not arr.size:
                return None
            arr = arr.astype(np.int64, copy=False)
            lo, hi = int(arr.min()), int(arr.max())
            if lo < 0 or hi >= self._num:
                return None
            fs, _ = self._filesystem()
            first = int(self._starts.searchsorted(lo, "right")) - 1
            last = int(self._starts.searchsorted(hi, "right")) - 1
            if not isinstance(fs, LocalFileSystem) or first == last:
                return None  # remote reads (and cached copies) are not planned; one shard: mapped
            steps = self._gather_steps(arr, False)
            try:
                job = next(steps)
            except StopIteration as stop:  # every shard it touches is mapped: read now
                return _Prefetched(arr, None, None, stop.value)
            return _Prefetched(arr, steps, start_read_files(*job, threads=PREFETCH_THREADS), None)
        except Exception:  # a hint: the read raises the error itself
            return None

    def _take_prefetched(self, ids: IntArray, cached: bool) -> _Prefetched | None:
        """The pending `prefetch` that planned exactly this read (taken; the hints before
        it are dropped), or None (the hints are kept)."""
        stale: list[_Prefetched] = []
        found = None
        with self._prefetch_lock:
            pending = self._prefetched
            for i, ready in enumerate(pending):
                if not cached and ready.ids.size == ids.size and np.array_equal(ready.ids, ids):
                    stale = [pending.popleft() for _ in range(i)]
                    found = pending.popleft()
                    break
        for old in stale:
            old.drop()
        return found

    def _drop_prefetched(self) -> None:
        with self._prefetch_lock:
            stale = list(self._prefetched)
            self._prefetched.clear()
        for old in stale:
            old.drop()

    def _gather_steps(self, ids: IntArray, cached: bool) -> _Steps:
        """`_gather_local` for ids of several shards (a plan: see `_Steps`).

        Grouping is vectorised: one argsort of the ids (ids of a shard are consecutive, so
        sorted ids are grouped by shard, windows ascending) and one ``searchsorted`` of the
        sorted ids (~4x cheaper than of unsorted ones) give per touched shard its first row,
        count and extent (max - min + 1 windows). When the handle LRU is full, shards
        without a handle whose windows are `covered` (or a single window) are read by
        `_read_staged` / `_read_direct` with no per-shard Python beyond open / ``preadv`` /
        close; only shards with a handle, shards to map and scattered windows take the
        per-shard loop (`_gather_loop`).
        """
        n = ids.size
        order = ids.argsort(kind="stable")
        sorted_ids = ids[order]
        shard = self._starts.searchsorted(sorted_ids, "right") - 1
        local = sorted_ids - self._starts[shard]
        cuts = np.flatnonzero(shard[1:] != shard[:-1]) + 1
        begin = np.concatenate((np.zeros(1, dtype=np.int64), cuts))
        end = np.concatenate((cuts, np.full(1, n, dtype=np.int64)))
        gshard = shard[begin]
        count = end - begin
        extent = local[end - 1] - local[begin] + 1
        if cached:
            self._refresh_copies(gshard.tolist())
        handles = self._handles
        staged_ok = self._batch_covers and not cached
        covers = (count == 1) | (
            (extent <= DENSE_SPAN * count)
            & (extent * (self.seq_len * self._itemsize[gshard]) <= COVER_MAX_BYTES)
        )
        staged: list[int] | IntArray = []
        if staged_ok and handles.full:
            fast = covers.copy()
            open_now = np.sort(np.asarray(handles.keys(), dtype=np.int64))
            if open_now.size:  # ~10x cheaper than np.isin for a few hundred shards
                at = open_now.searchsorted(gshard).clip(max=open_now.size - 1)
                fast &= open_now[at] != gshard
            staged = np.flatnonzero(fast)
            loop: list[int] = np.flatnonzero(~fast).tolist()
        else:
            loop = list(range(gshard.size))
        if len(staged) == gshard.size and not self._direct:  # one gather builds the result
            sliding, starts, _ = yield from self._read_staged(
                np.asarray(staged), gshard, begin, count, extent, local, order, whole=True
            )
            got = sliding[starts]
            return got if got.dtype == self.out_dtype else got.astype(self.out_dtype)
        out = np.empty((n, self.window), dtype=self.out_dtype)
        more = self._gather_loop(
            loop, cached, staged_ok, covers, gshard, begin, count, extent, shard, local, order, out
        )
        chosen = np.concatenate((np.asarray(staged, dtype=np.int64), more))
        if chosen.size and self._direct:  # runs of distinct windows: into `out` itself
            fresh = np.ones(n, dtype=np.int64)  # 0 where a sorted id repeats the one before
            fresh[1:] = local[1:] != local[:-1]
            fresh[begin] = 1
            distinct = np.add.reduceat(fresh, begin)[chosen]  # windows of each shard, once
            whole_run = (
                (distinct == count[chosen])
                & (extent[chosen] == count[chosen])
                & (count[chosen] <= _IOV_ROWS)
            )
            if whole_run.any():
                yield from self._read_direct(
                    chosen[whole_run], gshard, begin, count, local, order, out
                )
                chosen = chosen[~whole_run]
        if chosen.size:
            sliding, starts, dest = yield from self._read_staged(
                chosen, gshard, begin, count, extent, local, order, whole=False
            )
            out[dest] = sliding[starts]
        return out

    def _gather_loop(
        self,
        loop: list[int],
        cached: bool,
        staged_ok: bool,
        covers: npt.NDArray[np.bool_],
        gshard: IntArray,
        begin: IntArray,
        count: IntArray,
        extent: IntArray,
        shard: IntArray,
        local: IntArray,
        order: IntArray,
        out: np.ndarray[Any, Any],
    ) -> IntArray:
        """The per-shard loop of `_gather_steps` over the groups ``loop`` (O(1) Python work
        each): a mapped shard (or one to map) is gathered from its window view, scattered
        windows are read by `_pread_rows`; returns the groups left for `_read_staged`."""
        if not loop:
            return np.zeros(0, dtype=np.int64)
        handles, sizes, narrowing = self._handles, self._sizes, self._narrowing
        shards, begins = gshard.tolist(), begin.tolist()
        counts, cover = count.tolist(), covers.tolist()
        rows: list[int] | None = None
        windows: list[int] | None = None
        offsets: list[int] | None = None  # byte offsets of the sorted ids, when first needed
        prefix = ""
        more: list[int] = []
        for g in loop:
            s, a = shards[g], begins[g]
            b = a + counts[g]
            handle: _Mapped | None = handles.get(s)
            if handle is None:
                k = b - a
                mapit = cached or not handles.full
                if not (mapit or (k >= MAP_MIN_ROWS and not (k > 1 and cover[g]))):
                    if staged_ok and cover[g]:
                        more.append(g)
                        continue
                    if offsets is None or rows is None:
                        offsets = self._byte_offsets(shard, local)
                        rows = order.tolist()
                        prefix = join(self._root_path, "")
                    self._pread_rows(s, prefix, rows[a:b], offsets[a:b], out, k > 1 and cover[g])
                    continue
                view = self._view(s)  # size-checked when mapped
            else:
                found = handle.mapping.size()
                if found < sizes[s]:
                    self._check_size(s, found, handle.path)
                view = handle.view
            if b - a == 1 and not narrowing[s]:
                if rows is None or windows is None:
                    rows, windows = order.tolist(), local.tolist()
                out[rows[a]] = view[windows[a]]  # basic indexing: ~3x cheaper for one row
                continue
            block = view[local[a:b]]
            if narrowing[s]:
                self._check_range(block, s)
            out[order[a:b]] = block  # casts to out_dtype (range checked above when narrowing)
        return np.asarray(more, dtype=np.int64)

    def _read_direct(
        self,
        groups: IntArray,
        gshard: IntArray,
        begin: IntArray,
        count: IntArray,
        local: IntArray,
        order: IntArray,
        out: np.ndarray[Any, Any],
    ) -> Generator[FileReads, tuple[int, IntArray], None]:
        """Read each of ``groups`` (``count[g]`` distinct consecutive windows of shard
        ``gshard[g]``: sorted rows ``[begin[g], begin[g] + count[g])``) with one open, ONE
        ``preadv`` straight into its rows of ``out`` (one buffer per row) and one close.
        Only when the disk dtype is ``out_dtype`` (`_direct`). With ``labels`` consecutive
        windows share a token: each row but a run's last gets its first ``seq_len`` tokens
        from the file and its label token from the next row afterwards (one vectorised
        copy). A missing shard or a short read (truncated file) is a `VerificationError`
        naming the shard."""
        item = out.itemsize
        nbytes, step = self.window * item, self.seq_len * item  # a row; file bytes a window
        starts, cnt = begin[groups], count[groups]
        sel = np.repeat(starts - (np.cumsum(cnt) - cnt), cnt) + np.arange(
            int(cnt.sum()), dtype=np.int64
        )  # the sorted rows read, shard by shard
        if self.labels:  # a run's last row is read whole, the others without the label
            size = np.full(sel.size, step, dtype=np.int64)
            size[np.cumsum(cnt) - 1] = nbytes
        else:
            size = np.full(sel.size, nbytes, dtype=np.int64)
        s = gshard[groups]
        file_at = self._offsets[s] + local[starts] * step
        wants = cnt * step + (nbytes - step)  # a run's last label token
        flat = out.view(np.uint8).reshape(-1)
        yield from self._preadv_shards(s, file_at, wants, flat, order[sel] * nbytes, size, cnt)
        if self.labels:  # row i's label token is row i+1's first token (same run)
            inner = sel[np.repeat(starts + cnt - 1, cnt) != sel]  # not a run's last
            out[order[inner], self.seq_len] = out[order[inner + 1], 0]

    def _read_staged(
        self,
        groups: IntArray,
        gshard: IntArray,
        begin: IntArray,
        count: IntArray,
        extent: IntArray,
        local: IntArray,
        order: IntArray,
        *,
        whole: bool,
    ) -> Generator[
        FileReads, tuple[int, IntArray], tuple[np.ndarray[Any, Any], IntArray, IntArray]
    ]:
        """Read the covering range of each of ``groups`` (shard ``gshard[g]``, sorted rows
        ``[begin[g], begin[g] + count[g])`` over ``extent[g]`` windows) with one open,
        ONE ``preadv`` and one close per shard into one staging buffer (all shards of one
        disk dtype, no narrowing cast: `_batch_covers`); the byte offsets and the rows are
        computed vectorised. Returns ``(sliding, starts, dest)``: ``sliding[starts]`` are
        the windows of result rows ``dest`` (with ``whole``: every group is read, and
        ``starts`` is in result-row order, ``dest`` empty). A missing shard or a short
        read (truncated file) is a `VerificationError` naming the shard."""
        dtype = self._disk[int(gshard[groups[0]])]
        item, width, seq = dtype.itemsize, self.window, self.seq_len
        s = gshard[groups]
        cnt = count[groups]
        first = local[begin[groups]]
        tokens = (extent[groups] - 1) * seq + width  # tokens of each covering range
        pos = np.zeros(s.size + 1, dtype=np.int64)
        np.cumsum(tokens, out=pos[1:])
        base = np.repeat(pos[:-1] - first * seq, cnt)  # staging position of window 0
        if whole:
            starts = np.empty(order.size, dtype=np.int64)
            starts[order] = base + local * seq  # result row order
            dest = np.zeros(0, dtype=np.int64)
        else:  # the sorted rows of these groups: concatenated ranges [begin, begin + count)
            sel = np.repeat(begin[groups] - (np.cumsum(cnt) - cnt), cnt) + np.arange(
                int(cnt.sum()), dtype=np.int64
            )
            starts = base + local[sel] * seq
            dest = order[sel]
        staging = np.empty(int(pos[-1]), dtype=dtype)
        file_at = self._offsets[s] + first * (seq * item)
        lengths = np.diff(pos) * item
        flat = staging.view(np.uint8)
        yield from self._preadv_shards(
            s, file_at, lengths, flat, pos[:-1] * item, lengths, np.ones_like(s)
        )
        sliding = np.lib.stride_tricks.as_strided(
            staging,
            shape=(staging.size - width + 1, width),
            strides=(item, item),
            writeable=False,
        )
        return sliding, starts, dest

    def _preadv_shards(
        self,
        shards: IntArray,
        file_at: IntArray,
        wants: IntArray,
        flat: npt.NDArray[np.uint8],
        iov_off: IntArray,
        iov_len: IntArray,
        iov_count: IntArray,
    ) -> Generator[FileReads, tuple[int, IntArray], None]:
        """For each shard ``shards[i]`` (each at most once): one open, ONE ``preadv`` of
        ``wants[i]`` bytes at ``file_at[i]`` into its ``iov_count[i]`` buffers (the next
        ``flat[iov_off[j]:][:iov_len[j]]``), one ``fstat`` after the read and one close.
        With the native loop (`detdata.storage.fileread`, no GIL), a shard not opened
        before in this process is recorded in the loop itself, from an ``fstat`` right
        after its open and before its read (`detdata.storage.first_opens`: one open serves
        the record and the read); the loop's ``fstat`` s are checked at once
        (`_check_opened_arrays`) and the shards from the first it could not read on go
        through `_preadv_python`, which raises the error. The bytes and checks do not
        depend on which loop read them."""
        done = 0
        if NATIVE:
            done, stats = yield FileReads(
                os.fsencode(join(self._root_path, "")),
                self._encoded_names(shards),
                shards,
                file_at,
                wants,
                flat,
                iov_off,
                iov_len,
                iov_count,
                None if self._uses_shard_cache() else self._first,
            )
            self._check_opened_arrays(
                shards[:done],
                stats[:done, SIZE],
                stats[:done, INODE : MTIME_NS + 1].view(np.uint64),
                join(self._root_path, ""),
            )
            if done == shards.size:
                return
        skip = int(iov_count[:done].sum())
        self._preadv_python(
            shards[done:].tolist(),
            file_at[done:].tolist(),
            wants[done:].tolist(),
            flat.data,
            iov_off[skip:].tolist(),
            iov_len[skip:].tolist(),
            np.cumsum(iov_count[done:]).tolist(),
        )

    def _preadv_python(
        self,
        shards: list[int],
        file_at: list[int],
        wants: list[int],
        flat: memoryview,
        iov_off: list[int],
        iov_len: list[int],
        iov_end: list[int],
    ) -> None:
        """`_preadv_shards` in Python (``iov_end[i]``: the end of shard i's buffers). A
        shard's first open in this process is recorded before its bytes are read
        (`_check_stat`); every read is checked against an ``fstat`` taken after it, all at
        once at the end (`_check_opened_all`), also before a missing shard or a short read
        raises. A missing shard or a short read (truncated file) is a `VerificationError`
        naming it."""
        prefix = join(self._root_path, "")
        entries = self.manifest.shards
        open_, fstat, preadv, close = os.open, os.fstat, os.preadv, os.close
        flags = os.O_RDONLY
        recorded, first_open = self._first.state, self._check_stat
        stats: list[os.stat_result] = []  # fstat of each shard after its read
        a = 0
        for sh, at, want, b in zip(shards, file_at, wants, iov_end, strict=True):
            bufs = [flat[o : o + n] for o, n in zip(iov_off[a:b], iov_len[a:b], strict=True)]
            a = b
            path = prefix + entries[sh].path
            try:
                fd = open_(path, flags)
            except FileNotFoundError:
                self._check_opened_all(shards, stats, prefix)
                raise self._missing(sh, path) from None
            try:
                if recorded[sh] != RECORDED:  # a first open is recorded before its read
                    try:
                        first_open(sh, fstat(fd), path)
                    except VerificationError:  # the shards read before it are named first
                        self._check_opened_all(shards, stats, prefix)
                        raise
                got = preadv(fd, bufs, at)
                stats.append(fstat(fd))  # after the read: a write the read saw shows
                if got != want:
                    self._check_opened_all(shards, stats, prefix)
                    self._short_read(fd, sh, path, want, at)
            finally:
                close(fd)
        self._check_opened_all(shards, stats, prefix)

    def _byte_offsets(self, shard: IntArray, local: IntArray) -> list[int]:
        """File offset of window ``local[i]`` of shard ``shard[i]``, for the batch at once."""
        offsets: list[int] = (
            self._offsets[shard] + local * self.seq_len * self._itemsize[shard]
        ).tolist()
        return offsets

    def _pread_rows(
        self,
        shard: int,
        prefix: str,
        rows: list[int],
        offsets: list[int],
        out: np.ndarray[Any, Any],
        cover: bool,
    ) -> None:
        """Read without mapping: one window of ``shard`` (file ``prefix + path``; for a local
        root ``prefix + path == join(root, path)``) at each byte offset into row ``rows[i]``
        of ``out``: one open and close, and one ``preadv`` of the range covering all the
        windows when ``cover`` (they are `covered`), else one ``preadv`` per window."""
        dtype = self._disk[shard]
        path = prefix + self.manifest.shards[shard].path
        try:
            fd = os.open(path, os.O_RDONLY)
        except FileNotFoundError:
            raise self._missing(shard, path) from None
        try:
            self._check_opened(shard, fd, path)
            if cover:
                self._pread_covering(fd, shard, path, rows, offsets, out)
            elif dtype == self.out_dtype:
                for row, offset in zip(rows, offsets, strict=True):
                    self._pread_window(fd, shard, path, out[row], offset)
            else:
                block = np.empty((len(rows), self.window), dtype=dtype)
                for i, offset in enumerate(offsets):
                    self._pread_window(fd, shard, path, block[i], offset)
                self._check_range(block, shard)
                out[rows] = block
            self._check_opened(shard, fd, path)  # again after the reads: a write they saw
        finally:
            os.close(fd)

    def _pread_covering(
        self,
        fd: int,
        shard: int,
        path: str,
        rows: list[int],
        offsets: list[int],
        out: np.ndarray[Any, Any],
    ) -> None:
        """One ``preadv`` of the bytes of ``shard`` that cover the windows at ``offsets``, then
        each window copied into its row of ``rows`` (basic slices, cast; range-checked)."""
        dtype = self._disk[shard]
        item, width = dtype.itemsize, self.window
        lo = min(offsets)
        buf = np.empty((max(offsets) - lo) // item + width, dtype=dtype)
        self._pread_window(fd, shard, path, buf, lo)
        starts = [(offset - lo) // item for offset in offsets]
        if self._narrowing[shard]:  # check exactly the delivered values
            block = np.stack([buf[a : a + width] for a in starts])
            self._check_range(block, shard)
            out[rows] = block
            return
        for row, a in zip(rows, starts, strict=True):
            out[row] = buf[a : a + width]

    def _pread_window(
        self, fd: int, shard: int, path: str, row: np.ndarray[Any, Any], offset: int
    ) -> None:
        """Fill ``row`` (contiguous, disk byte order) from ``fd`` at byte ``offset``; a short
        read means the file was truncated (`VerificationError` via `_check_size`)."""
        if os.preadv(fd, [row.data], offset) != row.nbytes:
            self._short_read(fd, shard, path, row.nbytes, offset)

    def _short_read(self, fd: int, shard: int, path: str, nbytes: int, offset: int) -> None:
        """A ``preadv`` of ``nbytes`` at ``offset`` read fewer: the file was truncated
        (`VerificationError` via `_check_size`), else a `StorageError`; raises either way."""
        self._check_size(shard, os.fstat(fd).st_size, path)
        raise StorageError(
            f"shard {self.manifest.shards[shard].path} ({path}): short read of "
            f"{nbytes} bytes at offset {offset}; hint: check the file system"
        )

    def _gather_remote(
        self, fs: fsspec.AbstractFileSystem, ids: IntArray, out: np.ndarray[Any, Any]
    ) -> None:
        uniq, inverse = np.unique(ids, return_inverse=True)
        _, shard_of, spans = stable_groups(self._shard_of(uniq))  # uniq is sorted: order = identity
        local = uniq - self._starts[shard_of]
        size = self._itemsize[shard_of]
        starts = self._offsets[shard_of] + local * self.seq_len * size
        ends = starts + self.window * size
        shards = self.manifest.shards
        paths = np.asarray([join(self._root_path, s.path) for s in shards], dtype=object)
        names = np.asarray([s.path for s in shards], dtype=object)
        urls = np.asarray([self.manifest.url(s) for s in shards], dtype=object)
        # ranges of one shard are coalesced into few requests (detdata.storage.ranges rule:
        # bytes fetched <= 1.2 x bytes needed per shard), all shards in one cat_ranges call
        blobs, _ = read_coalesced(
            fs,
            paths[shard_of].tolist(),
            starts.tolist(),
            ends.tolist(),
            policy=self.retry,
            shards=names[shard_of].tolist(),
            urls=urls[shard_of].tolist(),
            what="token range read",
        )
        rows = np.empty((uniq.size, self.window), dtype=self.out_dtype)
        for shard, a, b in spans:
            data = b"".join(blobs[a:b])
            expected = (b - a) * self.window * int(self._itemsize[shard])
            if len(data) != expected:
                raise StorageError(
                    f"shard {self.manifest.shards[shard].path}: expected {expected} "
                    f"bytes for {b - a} windows, got {len(data)}; the file is "
                    "shorter than the manifest says (rewritten?)"
                )
            block = np.frombuffer(data, dtype=disk_dtype(self._dtypes[shard])).reshape(
                b - a, self.window
            )
            self._check_range(block, shard)
            rows[a:b] = block
        out[...] = rows[inverse.reshape(-1)]

    def _check_range(self, block: np.ndarray[Any, Any], shard: int) -> None:
        """Refuse values that a narrowing ``out_dtype`` cast would wrap (vectorised)."""
        if not self._narrowing[shard] or block.size == 0:
            return
        info = np.iinfo(self.out_dtype)
        lo, hi = int(block.min()), int(block.max())
        if lo < info.min or hi > info.max:
            raise FormatError(
                f"shard {self.manifest.shards[shard].path}: token values in "
                f"[{lo}, {hi}] do not fit out_dtype {self.out_dtype.name} "
                f"[{info.min}, {info.max}]; hint: use a wider out_dtype (e.g. int64)"
            )


def _check_token_shard(shard: ShardEntry) -> str:
    """The shard's token dtype; `FormatError` if it is not a 1-D token shard with a consistent
    size."""
    if shard.format not in (Format.NPY, Format.BIN):
        raise FormatError(
            f"shard {shard.path}: format {shard.format.value!r} is not a token format "
            "(npy, bin); hint: use TableRows for parquet/arrow shards"
        )
    if shard.dtype not in TOKEN_DTYPES:
        raise FormatError(
            f"shard {shard.path}: dtype {shard.dtype!r} is not a token dtype "
            f"({', '.join(TOKEN_DTYPES)})"
        )
    offset = shard.data_offset or 0
    expected = offset + shard.num_samples * np.dtype(shard.dtype).itemsize
    if expected != shard.bytes:
        raise FormatError(
            f"shard {shard.path}: manifest says {shard.num_samples} x {shard.dtype} "
            f"after a {offset}-byte header ({expected} bytes) but {shard.bytes} bytes; "
            "hint: rebuild the manifest"
        )
    return shard.dtype
