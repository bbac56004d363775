"""Fixed-length token windows over ``.npy`` / ``.bin`` token shards.

A `TokenWindows` dataset cuts every token shard of a manifest into windows of
``seq_len`` tokens. With ``labels=True`` (default) a window carries one extra
token for next-token labels, so window ``w`` of a shard covers tokens
``[w * seq_len, w * seq_len + seq_len + 1)`` and consecutive windows share one
token. Windows never cross shard boundaries; a shard of ``T`` tokens holds
``(T - 1) // seq_len`` windows with labels (``T // seq_len`` without) and its
tail tokens are dropped. Window ids are numbered shard by shard in manifest
(path) order.

Reading (`read`, `prefetch`) is `detdata.datasets.window_reads.WindowReads`: window ids ->
(shard, byte range) arithmetic over the index built here, the bytes moved by
`detdata.storage` (memory maps, the batched file loop, coalesced remote ranges). A shard
changed, truncated or deleted during the run is a `VerificationError` naming it, never
other bytes.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Generic, TypeVar

import numpy as np
import numpy.typing as npt
from fsspec.implementations.local import LocalFileSystem

from detdata.base.checks import check_positive_int
from detdata.base.errors import ConfigError
from detdata.base.types import Batch, IntArray
from detdata.datasets.base import check_ids
from detdata.datasets.columns import describe_dtype
from detdata.datasets.shard_storage import DefaultCache, Storage, storage_for
from detdata.datasets.window_index import WindowIndex, open_window_index
from detdata.datasets.window_reads import WindowReads
from detdata.identity.formats import disk_dtype
from detdata.identity.manifest import Manifest
from detdata.order.choice import LocalityOrder, OrderChoice
from detdata.storage.cache import ShardCache
from detdata.storage.file_column import FileColumn, IntColumn

T = TypeVar("T")

_WIDEN: dict[str, str] = {"uint16": "int32", "uint32": "int64", "int32": "int32", "int64": "int64"}


class ByCode(Generic[T]):
    """A per-shard value looked up through the shard's code: ``self[shard]`` is
    ``values[codes[shard]]`` (a few distinct values for many shards, O(values) to build)."""

    __slots__ = ("codes", "values")

    def __init__(
        self, codes: npt.NDArray[np.integer[Any]] | FileColumn, values: tuple[T, ...]
    ) -> None:
        self.codes = codes
        self.values = values

    def __getitem__(self, shard: int | np.integer[Any]) -> T:
        return self.values[int(self.codes[shard])]


class ArrayByCode:
    """A per-shard int64 value looked up through the shard's code, for one shard or an
    array of them: ``self[shards]`` is ``values[codes[shards]]`` (int64), O(values) to
    build and to keep."""

    __slots__ = ("codes", "values")

    def __init__(
        self, codes: npt.NDArray[np.integer[Any]] | FileColumn, values: npt.ArrayLike
    ) -> None:
        self.codes = codes
        self.values = np.asarray(values, dtype=np.int64)

    def __getitem__(self, shard: Any) -> Any:
        return self.values[self.codes[shard]]


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


class TokenWindows(WindowReads):
    """Windows of ``seq_len`` (+1 label token) tokens over a token manifest.

    ``num_samples`` is the sum over shards of ``(T - 1) // seq_len`` with
    ``labels`` (``T // seq_len`` without); tail tokens that do not fill a window
    are dropped and windows never cross shards. ``read(ids)`` returns
    ``{"tokens": (len(ids), seq_len + labels)}`` in ``out_dtype`` (default: int32
    and int64 kept, uint16 -> int32, uint32 -> int64), rows in the order of
    ``ids``. A shard too short for one window raises `FormatError` unless
    ``allow_short_shards`` (then it holds 0 windows); an empty dataset raises
    `ConfigError`. Narrowing ``out_dtype`` casts are range-checked per batch.

    Opening: the per-shard facts (window starts, token offsets, sizes, dtype codes) and the
    open-time checks come from the window index (`detdata.datasets.window_index`): for a
    fast-form manifest a file built once per job and mapped, after a full check of its
    digest, by every process; so a rank's open touches none of the manifest's columns.

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
        *WindowReads._TRANSIENT,
        "_disk",
        "_dtypes",
        "_batch_covers",
        "_starts",
        "_itemsize",
        "_offsets",
        "_narrowing",
        "_windows_tuple",
        "_direct",
        "_index",
        "_bounds",
        "_dtype_names",
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
        self.allow_short_shards = bool(allow_short_shards)
        self.window = self.seq_len + int(self.labels)
        shards = self.manifest.shards
        if not shards:
            raise ConfigError(
                f"manifest {self.manifest.id} has no shards; TokenWindows needs token shards"
            )
        index = self._index = self._open_index()  # the open-time checks: once per job
        self.out_dtype = _resolve_out_dtype(out_dtype, [index.dtypes[c] for c in index.used])
        self._num = index.windows
        if self._num == 0:
            raise ConfigError(
                f"manifest {self.manifest.id}: no windows of seq_len={self.seq_len} "
                f"(labels={self.labels}) in {len(shards)} shard(s); the dataset is "
                "empty; hint: use a smaller seq_len"
            )
        self._build_index()
        self._reset_process_state()

    # construction helpers --------------------------------------------------
    def _open_index(self, *, meet: bool = True) -> WindowIndex:
        """The per-shard index (`detdata.datasets.window_index`): mapped from the file built
        once per job for a fast-form manifest, else built here. Its build runs the open-time
        checks: `FormatError` naming the first shard that is not a token shard of a
        consistent size, or, unless ``allow_short_shards``, too short for one window.
        ``meet=False``: unpickled in a worker (no meeting through a process group)."""
        return open_window_index(
            self.manifest, self.seq_len, self.labels, self.allow_short_shards, meet=meet
        )

    @property
    def windows_per_shard(self) -> tuple[int, ...]:
        """Windows per shard, in manifest order (a tuple built on first use: O(shards))."""
        found: tuple[int, ...] | None = self.__dict__.get("_windows_tuple")
        if found is None:
            found = tuple(np.diff(np.asarray(self._bounds)).tolist())  # O(shards): read whole
            self.__dict__["_windows_tuple"] = found
        return found

    def _build_index(self) -> None:
        index: WindowIndex | None = self.__dict__.get("_index")
        if index is None:  # unpickled in another process: mapped (or built) again
            index = self._index = self._open_index(meet=False)
        super()._build_index()
        self._bounds = index.starts  # count + 1: shard s holds windows [s], [s + 1]
        self._starts = index.starts[:-1]
        code = index.codes
        names = self._dtype_names = index.dtypes
        # bytes per token of each shard, looked up through its dtype code (no per-shard copy)
        self._itemsize = ArrayByCode(code, np.asarray([np.dtype(d).itemsize for d in names]))
        self._offsets = index.offsets
        # per shard, looked up through its dtype code (O(dtypes) to build, not O(shards))
        self._disk = ByCode(code, tuple(disk_dtype(d) for d in names))
        self._dtypes = ByCode(code, names)
        # per shard: does a cast to out_dtype narrow (values must be range-checked)?
        narrowing = tuple(not np.can_cast(d, self.out_dtype, casting="safe") for d in names)
        self._narrowing = ByCode(code, narrowing)
        used = index.used
        disks = {self._disk.values[c] for c in used}
        # covered spans of a batch are read into one staging buffer (`_read_staged`)
        self._batch_covers = len(disks) == 1 and not any(narrowing[c] for c in used)
        # windows stored as delivered (disk dtype == out_dtype): read straight into the result
        self._direct = self._batch_covers and self._disk[0] == self.out_dtype

    def _shard_bytes(self) -> IntColumn:
        """Bytes per shard: the window index's copy (checked with it: the manifest's column
        is not touched at open)."""
        return self._index.sizes

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
        shard = self._starts.searchsorted(arr, side="right").astype(np.int64) - 1
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

    def _what(self) -> str:
        return f"TokenWindows({self.manifest.id[:15]}…, seq_len={self.seq_len})"
