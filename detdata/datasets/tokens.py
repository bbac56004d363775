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
fsspec roots, ONE ``fs.cat_ranges`` call for the whole batch (failed ranges are
retried with backoff under ``retry``, a `RetryPolicy`). With ``cache_dir``,
remote shards are instead copied whole into a bounded, blake3-verified local
`ShardCache` and read through the memmap path. Memmaps, caches and file systems
are opened lazily per process and dropped when pickled.

Before touching a shard's mapping, every read checks that the mapped file still
has the manifest's size (one ``fstat`` per touched shard, ~0.5 us): a shard
truncated during the run is a `VerificationError` naming it, expected and found
sizes, instead of a SIGBUS that kills the process. Not caught: a truncation
racing with the read itself, and bytes rewritten in place at the same size
(verification happens when the manifest is opened).
"""

from __future__ import annotations

import bisect
import mmap
import os
import warnings
from collections.abc import Mapping, Sequence
from typing import Any

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
from detdata.datasets.shards import ShardReader, renamed_argument
from detdata.identity.formats import TOKEN_DTYPES, Format, disk_dtype
from detdata.identity.manifest import Manifest, ShardEntry, Verify
from detdata.storage.cache import ShardCache
from detdata.storage.fs import join, read_ranges_retrying
from detdata.storage.retry import RetryPolicy, check_policy

_WIDEN: dict[str, str] = {"uint16": "int32", "uint32": "int64", "int32": "int32", "int64": "int64"}


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

    Remote roots: ``retry`` (a `RetryPolicy`) governs every read; with
    ``cache_dir`` (and ``shard_cache_bytes``, default 16 GiB, on disk;
    ``cache_verify="full"`` re-hashes a cached copy whenever it is opened instead of
    checking size + first/last MiB) whole shards are copied into a verified, bounded
    local `ShardCache` (``shard_cache``) and read from there. Neither changes the data
    read, so neither is part of ``identity()``. ``cache_bytes`` is the deprecated name
    of ``shard_cache_bytes`` (a `DeprecationWarning`; passing both is a `ConfigError`).
    """

    # pickling: parameters and manifest only, no memmaps or handles
    _TRANSIENT = (
        *ShardReader._TRANSIENT,
        "_views",
        "_maps",
        "_starts",
        "_itemsize",
        "_offsets",
        "_start_list",
        "_narrowing",
    )

    def __init__(
        self,
        manifest: Manifest | str,
        seq_len: int,
        *,
        labels: bool = True,
        out_dtype: str | None = None,
        verify: str | Verify = Verify.QUICK,
        allow_short_shards: bool = False,
        root: str | None = None,
        storage_options: Mapping[str, Any] | None = None,
        retry: RetryPolicy | None = None,
        cache_dir: str | os.PathLike[str] | None = None,
        shard_cache_bytes: int | None = None,
        cache_verify: str = "quick",
        cache_bytes: int | None = None,
    ) -> None:
        shard_cache_bytes = renamed_argument(
            shard_cache_bytes,
            cache_bytes,
            new="shard_cache_bytes",
            old="cache_bytes",
            owner="TokenWindows",
        )
        super().__init__(
            manifest,
            verify=verify,
            root=root,
            storage_options=storage_options,
            retry=retry,
            cache_dir=cache_dir,
            shard_cache_bytes=shard_cache_bytes,
            cache_verify=cache_verify,
        )
        self.seq_len = check_positive_int(seq_len, "seq_len")
        self.labels = bool(labels)
        self.window = self.seq_len + int(self.labels)
        shards = self.manifest.shards
        if not shards:
            raise ConfigError(
                f"manifest {self.manifest.id} has no shards; TokenWindows needs token shards"
            )
        self._dtypes = tuple(_check_token_shard(s) for s in shards)
        self.out_dtype = _resolve_out_dtype(out_dtype, self._dtypes)
        counts = [self._count(s, allow_short_shards) for s in shards]
        self.windows_per_shard: tuple[int, ...] = tuple(counts)
        self._num = sum(counts)
        if self._num == 0:
            raise ConfigError(
                f"manifest {self.manifest.id}: no windows of seq_len={self.seq_len} "
                f"(labels={self.labels}) in {len(shards)} shard(s); the dataset is "
                "empty; hint: use a smaller seq_len"
            )
        self._build_index()
        self._reset_process_state()

    # construction helpers --------------------------------------------------
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
        counts = np.asarray(self.windows_per_shard, dtype=np.int64)
        self._starts = np.concatenate([[0], np.cumsum(counts)[:-1]]).astype(np.int64)
        self._itemsize = np.asarray([np.dtype(d).itemsize for d in self._dtypes], dtype=np.int64)
        self._offsets = np.asarray(
            [s.data_offset or 0 for s in self.manifest.shards], dtype=np.int64
        )
        self._start_list: list[int] = self._starts.tolist()
        # per shard: does a cast to out_dtype narrow (values must be range-checked)?
        self._narrowing: tuple[bool, ...] = tuple(
            not np.can_cast(d, self.out_dtype, casting="safe") for d in self._dtypes
        )

    def _reset_process_state(self) -> None:
        super()._reset_process_state()
        self._views: dict[int, np.ndarray[Any, Any]] = {}
        # shard -> (the mapping under its view, the file it maps): for the size checks
        self._maps: dict[int, tuple[mmap.mmap, str]] = {}

    def _forget_handle(self, shard: int) -> None:
        self._views.pop(shard, None)
        self._maps.pop(shard, None)

    # parameters under their old names ------------------------------------------
    @property
    def cache_bytes(self) -> int:
        """Deprecated name of ``shard_cache_bytes`` (a `DeprecationWarning`)."""
        warnings.warn(
            "TokenWindows.cache_bytes is deprecated; use shard_cache_bytes",
            DeprecationWarning,
            stacklevel=2,
        )
        return self.shard_cache_bytes

    @property
    def cache(self) -> ShardCache | None:
        """This process's `ShardCache` (None without ``cache_dir``): the same as ``shard_cache``."""
        return self.shard_cache

    # Dataset protocol --------------------------------------------------------
    @property
    def num_samples(self) -> int:
        """Number of windows over all shards."""
        return self._num

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
        self._check_size(shard, os.fstat(fh.fileno()).st_size, path)
        return mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ)

    def _checked_view(self, shard: int) -> np.ndarray[Any, Any]:
        """The strided window view of ``shard``, after checking its file still has every byte."""
        view = self._views.get(shard)
        mapped = self._maps.get(shard)
        if view is None or mapped is None:
            return self._view(shard)
        self._check_size(shard, mapped[0].size(), mapped[1])
        return view

    def _view(self, shard: int) -> np.ndarray[Any, Any]:
        entry = self.manifest.shards[shard]
        dtype = disk_dtype(self._dtypes[shard])
        if self._uses_shard_cache():
            mapping, path = self._map_cached(shard)
        else:
            path = join(self._filesystem()[1], entry.path)
            try:
                fh = open(path, "rb")  # noqa: SIM115 (closed below, the map outlives it)
            except FileNotFoundError:
                raise VerificationError(
                    f"shard {entry.path} ({path}): missing; it was verified when the dataset "
                    "was opened, then deleted or renamed; hint: restore it and resume from the "
                    "last saved state",
                    shard=entry.path,
                    field="exists",
                    expected=True,
                    found=False,
                ) from None
            with fh:
                mapping = self._map_file(shard, fh, path)
        tokens = np.frombuffer(
            mapping, dtype=dtype, count=entry.num_samples, offset=int(self._offsets[shard])
        )
        view = np.lib.stride_tricks.as_strided(
            tokens,
            shape=(self.windows_per_shard[shard], self.window),
            strides=(self.seq_len * dtype.itemsize, dtype.itemsize),
            writeable=False,
        )
        self._maps[shard] = (mapping, path)
        self._views[shard] = view
        return view

    def _shard_of(self, ids: IntArray) -> IntArray:
        """The shard index of each window id."""
        return self._starts.searchsorted(ids, "right") - 1

    def _gather_local(
        self, ids: IntArray, lo: int, hi: int, *, cached: bool = False
    ) -> np.ndarray[Any, Any]:
        """The windows ``ids`` (all in ``[lo, hi]``) from the shard memmaps, in ``out_dtype``.

        One fancy-index gather per touched shard (``take`` would first copy a whole
        overlapping window view). Ids of a single shard are gathered straight into the
        result; otherwise ids are grouped by shard (`stable_groups` of the shard index)
        and each shard's rows are gathered and scattered straight into the result
        (a staging buffer plus one big scatter measured ~3.7x slower for 1024 rows).
        """
        first = bisect.bisect_right(self._start_list, lo) - 1
        last = bisect.bisect_right(self._start_list, hi) - 1
        if first == last:
            if cached:
                self._refresh_copies((first,))
            start = self._start_list[first]
            block = self._checked_view(first)[ids - start if start else ids]
            if block.dtype == self.out_dtype:
                return block
            if self._narrowing[first]:
                self._check_range(block, first)
            return block.astype(self.out_dtype)
        order, shard, spans = stable_groups(self._shard_of(ids))
        local = ids[order] - self._starts[shard]
        if cached:
            self._refresh_copies(s for s, _, _ in spans)
        out = np.empty((ids.size, self.window), dtype=self.out_dtype)
        for s, a, b in spans:
            block = self._checked_view(s)[local[a:b]]
            if self._narrowing[s]:
                self._check_range(block, s)
            out[order[a:b]] = block  # casts to out_dtype (range checked above when narrowing)
        return out

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
        blobs = read_ranges(
            fs,
            paths[shard_of].tolist(),
            starts.tolist(),
            ends.tolist(),
            retry=self.retry,
            shards=names[shard_of].tolist(),
            urls=urls[shard_of].tolist(),
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
