"""Fixed-length token windows over ``.npy`` / ``.bin`` token shards.

A `TokenWindows` dataset cuts every token shard of a manifest into windows of
``seq_len`` tokens. With ``labels=True`` (default) a window carries one extra
token for next-token labels, so window ``w`` of a shard covers tokens
``[w * seq_len, w * seq_len + seq_len + 1)`` and consecutive windows share one
token. Windows never cross shard boundaries; a shard of ``T`` tokens holds
``(T - 1) // seq_len`` windows with labels (``T // seq_len`` without) and its
tail tokens are dropped. Window ids are numbered shard by shard in manifest
(path) order.

Reading: ``read(ids)`` maps ids to shards with one ``np.searchsorted`` over the
cumulative window counts, then per touched shard does ONE fancy-index gather
from a strided 2-D view of a read-only memmap (local roots) or, for remote
fsspec roots, ONE ``fs.cat_ranges`` call for the whole batch. Memmaps and file
systems are opened lazily per process and dropped when pickled.
"""

from __future__ import annotations

import itertools
import os
from collections.abc import Mapping, Sequence
from typing import Any

import fsspec
import numpy as np
import numpy.typing as npt
from fsspec.implementations.local import LocalFileSystem

from detdata._dataset import Batch, IntArray, check_ids
from detdata._errors import ConfigError, FormatError, StorageError
from detdata._formats import TOKEN_DTYPES, Format
from detdata._manifest import Manifest, ShardEntry, Verify
from detdata._storage import filesystem, join

_WIDEN: dict[str, str] = {"uint16": "int32", "uint32": "int64", "int32": "int32", "int64": "int64"}


def resolve_manifest(manifest: Manifest | str, *, verify: str | Verify, root: str | None,
                     storage_options: Mapping[str, Any]) -> Manifest:
    """A verified `Manifest` from an object or a path/URL.

    A path is loaded with ``Manifest.load(path, root=root, verify=verify)``; a
    `Manifest` object is re-rooted at ``root`` if given and then verified with
    ``verify`` (``"quick"`` by default; ``"off"`` skips it).
    """
    if isinstance(manifest, str):
        return Manifest.load(manifest, root=root, verify=verify, **storage_options)
    if not isinstance(manifest, Manifest):
        raise ConfigError(f"expected a Manifest or a manifest path/URL, got {type(manifest).__name__}")
    if root is not None:
        manifest = manifest.with_root(root)
    if manifest.root is None:
        raise ConfigError("the manifest has no root; hint: pass root= or use Manifest.with_root()")
    manifest.verify(verify, **storage_options)
    return manifest


def check_positive_int(value: object, name: str, *, minimum: int = 1) -> int:
    """``value`` as an int ``>= minimum`` (bools refused), else `ConfigError`."""
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or int(value) < minimum:
        raise ConfigError(f"{name} must be an integer >= {minimum}, got {value!r}")
    return int(value)


def read_ranges(fs: fsspec.AbstractFileSystem, paths: list[str], starts: list[int],
                ends: list[int]) -> list[bytes]:
    """Bytes ``[start, end)`` of each path, fetched with one ``fs.cat_ranges`` call.

    The single place remote token bytes are read (a verified local cache hooks in
    here). Raises `StorageError` naming the first URL when the store fails.
    """
    try:
        blobs = fs.cat_ranges(paths, starts, ends)
    except Exception as exc:
        raise StorageError(f"reading {len(paths)} byte ranges failed (first: {paths[0]}): "
                           f"{type(exc).__name__}: {exc}") from exc
    for path, blob in zip(paths, blobs, strict=True):
        if isinstance(blob, BaseException):
            raise StorageError(f"reading {path} failed: {type(blob).__name__}: {blob}") from blob
    return list(blobs)


def _resolve_out_dtype(out_dtype: str | None, shard_dtypes: Sequence[str]) -> np.dtype[Any]:
    if out_dtype is None:
        return np.result_type(*(np.dtype(_WIDEN[d]) for d in shard_dtypes))
    try:
        dt = np.dtype(out_dtype)
    except TypeError:
        raise ConfigError(f"out_dtype {out_dtype!r} is not a numpy dtype; hint: 'int32' or 'int64'") from None
    if dt.kind not in "iu":
        raise ConfigError(f"out_dtype must be an integer dtype, got {dt.name}; hint: 'int32' or 'int64'")
    return dt


class TokenWindows:
    """Windows of ``seq_len`` (+1 label token) tokens over a token manifest.

    ``num_samples`` is the sum over shards of ``(T - 1) // seq_len`` with
    ``labels`` (``T // seq_len`` without); tail tokens that do not fill a window
    are dropped and windows never cross shards. ``read(ids)`` returns
    ``{"tokens": (len(ids), seq_len + labels)}`` in ``out_dtype`` (default: int32
    and int64 kept, uint16 -> int32, uint32 -> int64), rows in the order of
    ``ids``. A shard too short for one window raises `FormatError` unless
    ``allow_short_shards`` (then it holds 0 windows); an empty dataset raises
    `ConfigError`. Narrowing ``out_dtype`` casts are range-checked per batch.
    """

    def __init__(self, manifest: Manifest | str, seq_len: int, *, labels: bool = True,
                 out_dtype: str | None = None, verify: str | Verify = Verify.QUICK,
                 allow_short_shards: bool = False, root: str | None = None,
                 storage_options: Mapping[str, Any] | None = None) -> None:
        self.storage_options = dict(storage_options or {})
        self.manifest = resolve_manifest(manifest, verify=verify, root=root,
                                         storage_options=self.storage_options)
        self.seq_len = check_positive_int(seq_len, "seq_len")
        self.labels = bool(labels)
        self.window = self.seq_len + int(self.labels)
        shards = self.manifest.shards
        if not shards:
            raise ConfigError(f"manifest {self.manifest.id} has no shards; TokenWindows needs token shards")
        self._dtypes = tuple(_check_token_shard(s) for s in shards)
        self.out_dtype = _resolve_out_dtype(out_dtype, self._dtypes)
        counts = [self._count(s, allow_short_shards) for s in shards]
        self.windows_per_shard: tuple[int, ...] = tuple(counts)
        self._num = sum(counts)
        if self._num == 0:
            raise ConfigError(f"manifest {self.manifest.id}: no windows of seq_len={self.seq_len} "
                              f"(labels={self.labels}) in {len(shards)} shard(s); the dataset is "
                              "empty; hint: use a smaller seq_len")
        self._build_index()
        self._reset_process_state()

    # construction helpers --------------------------------------------------
    def _count(self, shard: ShardEntry, allow_short: bool) -> int:
        tokens = shard.num_samples
        count = max(0, (tokens - int(self.labels)) // self.seq_len)
        if count == 0 and not allow_short:
            raise FormatError(f"shard {shard.path}: {tokens} tokens is too short for one window of "
                              f"seq_len={self.seq_len} (needs {self.window} tokens with "
                              f"labels={self.labels}); hint: pass allow_short_shards=True to skip "
                              "such shards, or use a smaller seq_len")
        return count

    def _build_index(self) -> None:
        counts = np.asarray(self.windows_per_shard, dtype=np.int64)
        self._starts = np.concatenate([[0], np.cumsum(counts)[:-1]]).astype(np.int64)
        self._itemsize = np.asarray([np.dtype(d).itemsize for d in self._dtypes], dtype=np.int64)
        self._offsets = np.asarray([s.data_offset or 0 for s in self.manifest.shards], dtype=np.int64)

    def _reset_process_state(self) -> None:
        self._pid = os.getpid()
        self._fs: fsspec.AbstractFileSystem | None = None
        self._root_path = ""
        self._views: dict[int, np.ndarray[Any, Any]] = {}

    # pickling: parameters and manifest only, no memmaps or handles -----------
    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        for key in ("_fs", "_views", "_pid", "_starts", "_itemsize", "_offsets"):
            state.pop(key, None)
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._build_index()
        self._reset_process_state()

    # Dataset protocol --------------------------------------------------------
    @property
    def num_samples(self) -> int:
        """Number of windows over all shards."""
        return self._num

    def identity(self) -> dict[str, Any]:
        """Plain JSON pinning the manifest and windowing parameters."""
        return {"type": "token_windows", "manifest": self.manifest.id, "seq_len": self.seq_len,
                "labels": self.labels, "out_dtype": self.out_dtype.name, "num_samples": self._num}

    def locate(self, ids: npt.ArrayLike) -> tuple[IntArray, IntArray]:
        """``(shard_index, window_in_shard)`` int64 arrays for window ids (checked)."""
        arr = check_ids(ids, self._num, self._what())
        shard = np.searchsorted(self._starts, arr, side="right").astype(np.int64) - 1
        return shard, arr - self._starts[shard]

    def read(self, ids: npt.ArrayLike) -> Batch:
        """``{"tokens": (len(ids), window)}``: one batched read, rows in the order of ``ids``."""
        arr = check_ids(ids, self._num, self._what())
        out = np.empty((arr.size, self.window), dtype=self.out_dtype)
        if arr.size:
            fs = self._filesystem()
            if isinstance(fs, LocalFileSystem):
                self._gather_local(arr, out)
            else:
                self._gather_remote(fs, arr, out)
        return {"tokens": out}

    # reading -----------------------------------------------------------------
    def _what(self) -> str:
        return f"TokenWindows({self.manifest.id[:15]}…, seq_len={self.seq_len})"

    def _filesystem(self) -> fsspec.AbstractFileSystem:
        if self._pid != os.getpid():
            self._reset_process_state()
        if self._fs is None:
            root = self.manifest.root
            if root is None:
                raise ConfigError("the manifest has no root; hint: pass root=")
            self._fs, self._root_path = filesystem(root, **self.storage_options)
        return self._fs

    def _view(self, shard: int) -> np.ndarray[Any, Any]:
        view = self._views.get(shard)
        if view is None:
            entry = self.manifest.shards[shard]
            dtype = np.dtype(self._dtypes[shard])
            path = join(self._root_path, entry.path)
            mm = np.memmap(path, dtype=dtype, mode="r", offset=int(self._offsets[shard]),
                           shape=(entry.num_samples,))
            view = np.lib.stride_tricks.as_strided(
                mm, shape=(self.windows_per_shard[shard], self.window),
                strides=(self.seq_len * dtype.itemsize, dtype.itemsize), writeable=False)
            self._views[shard] = view
        return view

    def _groups(self, ids: IntArray) -> tuple[IntArray, IntArray, list[tuple[int, int, int]]]:
        """Sort ids (grouped by shard, ascending inside) -> (order, local ids, [(shard, a, b)])."""
        order = np.argsort(ids, kind="stable")
        sorted_ids = ids[order]
        shard = np.searchsorted(self._starts, sorted_ids, side="right").astype(np.int64) - 1
        local = sorted_ids - self._starts[shard]
        cuts = np.flatnonzero(np.diff(shard)) + 1
        bounds = np.concatenate([[0], cuts, [shard.size]])
        spans = [(int(shard[a]), a, b) for a, b in itertools.pairwise(bounds.tolist())]
        return order, local, spans

    def _gather_local(self, ids: IntArray, out: np.ndarray[Any, Any]) -> None:
        order, local, spans = self._groups(ids)
        for shard, a, b in spans:
            block = self._view(shard)[local[a:b]]
            self._check_range(block, shard)
            out[order[a:b]] = block

    def _gather_remote(self, fs: fsspec.AbstractFileSystem, ids: IntArray,
                       out: np.ndarray[Any, Any]) -> None:
        uniq, inverse = np.unique(ids, return_inverse=True)
        _, local, spans = self._groups(uniq)
        shard_of = np.empty(uniq.size, dtype=np.int64)
        for shard, a, b in spans:
            shard_of[a:b] = shard
        size = self._itemsize[shard_of]
        starts = self._offsets[shard_of] + local * self.seq_len * size
        ends = starts + self.window * size
        urls = np.asarray([join(self._root_path, s.path) for s in self.manifest.shards], dtype=object)
        blobs = read_ranges(fs, urls[shard_of].tolist(), starts.tolist(), ends.tolist())
        rows = np.empty((uniq.size, self.window), dtype=self.out_dtype)
        for shard, a, b in spans:
            data = b"".join(blobs[a:b])
            expected = (b - a) * self.window * int(self._itemsize[shard])
            if len(data) != expected:
                raise StorageError(f"shard {self.manifest.shards[shard].path}: expected {expected} "
                                   f"bytes for {b - a} windows, got {len(data)}; the file is "
                                   "shorter than the manifest says (rewritten?)")
            block = np.frombuffer(data, dtype=self._dtypes[shard]).reshape(b - a, self.window)
            self._check_range(block, shard)
            rows[a:b] = block
        out[...] = rows[inverse.reshape(-1)]

    def _check_range(self, block: np.ndarray[Any, Any], shard: int) -> None:
        """Refuse values that a narrowing ``out_dtype`` cast would wrap (vectorised)."""
        if np.can_cast(self._dtypes[shard], self.out_dtype, casting="safe") or block.size == 0:
            return
        info = np.iinfo(self.out_dtype)
        lo, hi = int(block.min()), int(block.max())
        if lo < info.min or hi > info.max:
            raise FormatError(f"shard {self.manifest.shards[shard].path}: token values in "
                              f"[{lo}, {hi}] do not fit out_dtype {self.out_dtype.name} "
                              f"[{info.min}, {info.max}]; hint: use a wider out_dtype (e.g. int64)")


def _check_token_shard(shard: ShardEntry) -> str:
    """The shard's token dtype; `FormatError` if it is not a 1-D token shard with a consistent size."""
    if shard.format not in (Format.NPY, Format.BIN):
        raise FormatError(f"shard {shard.path}: format {shard.format.value!r} is not a token format "
                          "(npy, bin); hint: use TableRows for parquet/arrow shards")
    if shard.dtype not in TOKEN_DTYPES:
        raise FormatError(f"shard {shard.path}: dtype {shard.dtype!r} is not a token dtype "
                          f"({', '.join(TOKEN_DTYPES)})")
    offset = shard.data_offset or 0
    expected = offset + shard.num_samples * np.dtype(shard.dtype).itemsize
    if expected != shard.bytes:
        raise FormatError(f"shard {shard.path}: manifest says {shard.num_samples} x {shard.dtype} "
                          f"after a {offset}-byte header ({expected} bytes) but {shard.bytes} bytes; "
                          "hint: rebuild the manifest")
    return shard.dtype
