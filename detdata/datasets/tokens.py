"""`TokenWindows`: fixed-length token windows over ``.npy`` / ``.bin`` token shards.

With ``labels=True`` (default) window ``w`` of a shard covers tokens ``[w * seq_len,
w * seq_len + seq_len + 1)``: consecutive windows share one token. Windows never cross
shards; a shard of ``T`` tokens holds ``(T - 1) // seq_len`` windows with labels (``T //
seq_len`` without), its tail dropped; ids are numbered shard by shard in manifest order.
A `TokenWindows` delegates to its parts: the window index and `WindowLayout`, the shard
files (`ShardFiles`) and the read path (`WindowReads`). A shard changed, truncated or
deleted during the run is a `VerificationError` naming it, never other bytes.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Any, Never

import numpy as np
import numpy.typing as npt

from detdata.base.checks import check_positive_int
from detdata.base.errors import ConfigError
from detdata.base.types import Batch, IntArray
from detdata.datasets.base import check_ids
from detdata.datasets.batch_columns import describe_dtype
from detdata.datasets.capabilities import DatasetInfo
from detdata.datasets.process_local import pickled_state
from detdata.datasets.shard_files import ShardFiles, resolve_manifest
from detdata.datasets.shard_storage import DefaultCache, Storage, checked_storage
from detdata.datasets.window_index import WindowIndex, open_window_index
from detdata.datasets.window_layout import WindowLayout
from detdata.datasets.window_reads import WindowReads
from detdata.identity.manifest import Manifest
from detdata.order.choice import LocalityOrder, OrderChoice

_WIDEN: dict[str, str] = {"uint16": "int32", "uint32": "int64", "int32": "int32", "int64": "int64"}


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


class TokenWindows(DatasetInfo):
    """Windows of ``seq_len`` (+1 label token) tokens over a token manifest (module
    docstring). ``read(ids)`` returns ``{"tokens": (len(ids), seq_len + labels)}`` in
    ``out_dtype`` (default: int32 and int64 kept, uint16 -> int32, uint32 -> int64),
    narrowing casts range-checked. A shard too short for one window raises `FormatError`
    unless ``allow_short_shards`` (then it holds 0 windows); an empty dataset raises
    `ConfigError`. ``storage`` (default ``Storage()``, its ``cache_dir`` default here
    `DefaultCache.USER`) says where and how shards are read; none of it changes the data or
    ``identity()``. Pickled with its parameters, manifest and ``files`` only.
    """

    #: what ``Storage(cache_dir=DefaultCache.AUTO)`` (the default) means here: remote
    #: windows are small reads, so whole shards are copied
    DEFAULT_CACHE = DefaultCache.USER
    #: made again when unpickled, never pickled
    _DERIVED = ("_index", "_layout", "_reads", "windows_per_shard")

    def __init__(
        self,
        manifest: Manifest | str,
        seq_len: int,
        *,
        labels: bool = True,
        out_dtype: str | None = None,
        allow_short_shards: bool = False,
        storage: Storage | None = None,
        **refused: Never,
    ) -> None:
        storage = checked_storage("TokenWindows", storage, refused)
        self.storage = storage.with_default_cache(self.DEFAULT_CACHE)
        self.manifest = resolve_manifest(manifest, self.storage)
        self.seq_len = check_positive_int(seq_len, "seq_len")
        self.labels = bool(labels)
        self.allow_short_shards = bool(allow_short_shards)
        self.window = self.seq_len + int(self.labels)
        shards = self.manifest.shards
        if not shards:
            raise ConfigError(
                f"manifest {self.manifest.id} has no shards; TokenWindows needs token shards"
            )
        index = self._open_index()  # the open-time checks: once per job
        self.out_dtype = _resolve_out_dtype(out_dtype, [index.dtypes[c] for c in index.used])
        if index.windows == 0:
            raise ConfigError(
                f"manifest {self.manifest.id}: no windows of seq_len={self.seq_len} "
                f"(labels={self.labels}) in {len(shards)} shard(s); the dataset is "
                "empty; hint: use a smaller seq_len"
            )
        #: the shard files (its sizes: the window index's checked copy)
        self.files = ShardFiles(self.manifest, self.storage, index.sizes)
        self._wire(index)

    def _wire(self, index: WindowIndex) -> None:
        """The parts made from the window index: its layout and the read path."""
        self._index = index
        self._layout = WindowLayout(index, self.seq_len, self.labels, self.out_dtype)
        self._reads = WindowReads(self._layout, self.files)

    def __getstate__(self) -> dict[str, Any]:
        return pickled_state(self, self._DERIVED)

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        index = self._open_index(meet=False)  # mapped (or built) again in this process
        self.files.attach(index.sizes)
        self._wire(index)

    def _open_index(self, *, meet: bool = True) -> WindowIndex:
        """`open_window_index` of this dataset (its `FormatError` for a bad shard)."""
        return open_window_index(
            self.manifest, self.seq_len, self.labels, self.allow_short_shards, meet=meet
        )

    @functools.cached_property
    def windows_per_shard(self) -> tuple[int, ...]:
        """Windows per shard, in manifest order (a tuple built on first use: O(shards))."""
        return tuple(np.diff(np.asarray(self._layout.bounds)).tolist())  # read whole

    # Dataset protocol --------------------------------------------------------
    @property
    def num_samples(self) -> int:
        """Number of windows over all shards."""
        return self._layout.num

    def __len__(self) -> int:
        return self.num_samples

    def use_order(self, choice: OrderChoice) -> None:
        """A `LocalityOrder` over shards engages the default cache of a remote corpus larger
        than its bound (`ShardFiles.use_user_cache`)."""
        if isinstance(choice, LocalityOrder) and choice.window_shards is not None:
            self.files.use_user_cache(choice.window_shards)

    @property
    def shard_sizes(self) -> tuple[int, ...]:
        return self.windows_per_shard

    @property
    def tokens_per_sample(self) -> int:
        return self.seq_len

    def schema(self) -> dict[str, str]:
        return {"tokens": describe_dtype(self.out_dtype, (self.window,))}

    def identity(self) -> dict[str, Any]:
        """Plain JSON pinning the manifest and windowing parameters."""
        return {
            "type": "token_windows",
            "manifest": self.manifest.id,
            "seq_len": self.seq_len,
            "labels": self.labels,
            "out_dtype": self.out_dtype.name,
            "num_samples": self._layout.num,
        }

    def locate(self, ids: npt.ArrayLike) -> tuple[IntArray, IntArray]:
        """``(shard_index, window_in_shard)`` int64 arrays for window ids (checked)."""
        arr = check_ids(ids, self._layout.num, self._what())
        shard = self._layout.shard_of(arr)
        return shard, arr - self._layout.starts[shard]

    def read(self, ids: npt.ArrayLike) -> Batch:
        """``{"tokens": (len(ids), window)}``: one batched read, rows in the order of ``ids``."""
        num = self._layout.num
        arr = np.asarray(ids)
        if arr.ndim != 1 or arr.dtype.kind not in "iu":
            arr = check_ids(arr, num, self._what())  # raises the error
        arr = arr.astype(np.int64, copy=False)
        if not arr.size:
            return {"tokens": np.empty((0, self.window), dtype=self.out_dtype)}
        lo, hi = int(arr.min()), int(arr.max())
        if lo < 0 or hi >= num:
            check_ids(arr, num, self._what())  # raises the error
        local = self.files.is_local()
        if local or self.files.cache_dir is not None:
            return {"tokens": self._reads.gather_local(arr, lo, hi, cached=not local)}
        out = np.empty((arr.size, self.window), dtype=self.out_dtype)
        self._reads.gather_remote(self.files.filesystem()[0], arr, out)
        return {"tokens": out}

    def read_ahead(self, ids: npt.ArrayLike | None) -> None:
        """`ReadsAhead`: at most `PREFETCH_DEPTH` hints kept, the oldest dropped (a read drops
        those hinted before its own). A local read over several shards is planned now and
        its file reads start on native threads."""
        self._reads.read_ahead(ids)

    def _what(self) -> str:
        return f"TokenWindows({self.manifest.id[:15]}…, seq_len={self.seq_len})"
