"""`Documents`: the documents of a manifest's shards, read in place (no conversion step).

Where document boundaries come from, per shard format:

* **Megatron indexed datasets** (a ``P.bin`` ``bin`` shard + its ``P.idx`` ``megatron_idx``
  shard): document ``d`` is sequences ``[document_index[d], document_index[d + 1])`` of the
  ``.idx``, which must describe the ``.bin`` exactly (consecutive pointers:
  ``pointers[i + 1] = pointers[i] + sizes[i] * itemsize``; sizes adding up to the ``.bin``'s
  tokens; a document index from 0 to the sequence count), else a `FormatError` naming it.
* **Token shards** (``npy`` / ``bin`` without a ``.idx``) with ``eod_token``: a
  document ends after each ``eod_token`` (the token belongs to the document it
  ends); tokens after a shard's last ``eod_token`` are one more document.
* **Tables** (``parquet``, ``arrow``, ``arrow_stream`` such as Hugging Face
  ``datasets`` cache files) with ``column``: one row is one document, its tokens
  the row's list in the integer list column ``column``. Null lists or tokens are a
  `FormatError` naming the shard and column.

Documents are numbered in manifest (path) order, and within a shard in file order. The
*document table* ``starts`` (``N + 1`` int64) says document ``d`` is corpus tokens
``[starts[d], starts[d + 1])``; it is built once and, with ``index_dir``, stored there
(`detdata.datasets.index_files`; docs/design.md, "Documents and packing"). Token files and
Arrow files are memory-mapped, Parquet row groups decoded a few at a time per process.
"""

from __future__ import annotations

import functools
import mmap
import os
from abc import ABC, abstractmethod
from collections.abc import Mapping
from typing import Any, ClassVar, Final, Generic, NamedTuple, Never, TypeVar

import numpy as np
import numpy.typing as npt

from detdata.base.checks import check_count
from detdata.base.errors import ConfigError, FormatError
from detdata.base.lazy import ipc, pa, pq
from detdata.base.progress import progress
from detdata.base.types import IntArray
from detdata.datasets.doc_table import (
    ALGORITHM,
    Unit,
    UnitPlanner,
    check_stored_table,
    common_dtype,
    eod_starts,
    megatron_starts,
    stored_dtype,
    table_meta,
    table_starts,
)
from detdata.datasets.index_files import Check, load_or_build, reload_index
from detdata.datasets.process_local import PerProcess, pickled_state
from detdata.datasets.shard_files import ShardFiles, resolve_manifest
from detdata.datasets.shard_storage import Storage, checked_storage
from detdata.identity.formats import Format, disk_dtype
from detdata.identity.manifest import Manifest
from detdata.order.memo import LruCache

#: Decoded Parquet row groups kept per process.
_PARQUET_GROUPS: Final = 8
#: `Documents.copy_ranges` copies ranges one slice at a time when they average at least
#: this many tokens, else through one fancy-index gather per touched shard.
_SLICE_MIN_TOKENS: Final = 48

V = TypeVar("V")


class _MappedTokens(NamedTuple):
    """An open token file: its token view, the mapping under it, and the mapped file."""

    view: np.ndarray[Any, Any]
    mapping: mmap.mmap
    path: str


class Held(NamedTuple, Generic[V]):
    """An open shard kept in its process's handle LRU: what was read from it (``data``) and
    the local file (``path``)."""

    data: V
    path: str


def open_table(fmt: Format, path: str) -> Any:
    """A reader of local table file ``path``: Parquet (memory-mapped), Arrow IPC stream or file."""
    if fmt is Format.PARQUET:
        return pq.ParquetFile(path, memory_map=True)
    source = pa.memory_map(path)
    return ipc.open_stream(source) if fmt is Format.ARROW_STREAM else ipc.open_file(source)


class CorpusBase(ABC):
    """A document corpus `PackedWindows` packs (`Documents`, `TextDocuments`): the index
    ``_index`` (stored as index ``_KIND``; its ``_DERIVED`` attributes, the document table
    ``_starts`` among them, are made from it) over the shards of ``manifest`` (``files``),
    and the reads each kind declares. Pickled without the index when ``index_dir`` holds it.
    """

    #: the ``type`` of `identity`; the name of the stored index (`detdata.datasets.index_files`)
    _TYPE: ClassVar[str]
    _KIND: ClassVar[str]
    #: made again when unpickled, never pickled
    _DERIVED: ClassVar[tuple[str, ...]]

    @abstractmethod
    def _inputs(self) -> dict[str, Any]:
        """Plain JSON pinning the manifest and how documents are cut from it (the index key)."""

    @abstractmethod
    def _build(self) -> tuple[npt.NDArray[np.int64], dict[str, Any]]:
        """The index read from the shards, and its record."""

    @abstractmethod
    def _derive(self) -> None:
        """Make the `_DERIVED` attributes from ``_index``."""

    @abstractmethod
    def copy_ranges(
        self, source: IntArray, count: IntArray, target: IntArray, out: np.ndarray[Any, Any]
    ) -> None:
        """Copy corpus tokens ``[source[j], source[j] + count[j])`` to
        ``out[target[j] : target[j] + count[j]]`` (1-D int64 arrays, ``count >= 1``; ``out``
        1-D, tokens cast to its dtype). Each range lies inside one document."""

    manifest: Manifest
    files: ShardFiles
    index_dir: str | None
    out_dtype: np.dtype[Any]
    _index: npt.NDArray[np.int64]
    _starts: npt.NDArray[np.int64]

    def _open(
        self,
        name: str,
        manifest: Manifest | str,
        storage: Storage,
        index_dir: str | os.PathLike[str] | None,
        progress: bool | None,
    ) -> None:
        """Set ``storage`` (no shard copies unless asked for), ``manifest``, ``files``,
        ``index_dir`` and ``progress``; `ConfigError` for a remote root without a cache of
        local copies."""
        self.storage = storage.with_default_cache(None)
        self.manifest = resolve_manifest(manifest, self.storage)
        self.files = ShardFiles(self.manifest, self.storage, self.manifest.bytes_per_shard())
        self.index_dir = None if index_dir is None else os.fspath(index_dir)
        self.progress = progress
        if self.files.cache_dir is None and not self.files.is_local():
            raise ConfigError(
                f"{name} reads the shards of a remote root ({self.manifest.root}) from "
                "verified local copies; hint: pass storage=Storage(cache_dir='/local/dir')"
            )

    def _load(self, check: Check) -> None:
        """Set ``_index``, loaded from ``index_dir`` when ``check`` accepts it, else built
        and saved there by one process of those opening it at once (`building`), and what
        is derived from it."""
        stored = load_or_build(self.index_dir, self._KIND, self._inputs(), check, self._build)
        self._index, self._digest = np.asarray(stored.array), stored.digest
        self._derive()

    def __getstate__(self) -> dict[str, Any]:
        return pickled_state(self, self._DERIVED, "_index")

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self.files.attach(self.manifest.bytes_per_shard())
        if self._index is None:
            self._index = reload_index(
                self.index_dir,
                self._KIND,
                self._inputs(),
                str(self._digest),
                lambda: self._build()[0],
            )
        self._derive()

    def identity(self) -> dict[str, Any]:
        """Plain JSON pinning the manifest and how documents are cut and tokens delivered."""
        return {
            "type": self._TYPE,
            **self._inputs(),
            "out_dtype": self.out_dtype.name,
            "num_documents": self.num_documents,
            "num_tokens": self.num_tokens,
        }

    @property
    def num_documents(self) -> int:
        """Documents in the corpus."""
        return int(self._starts.shape[0]) - 1

    @property
    def num_tokens(self) -> int:
        """Tokens in the corpus (every document's)."""
        return int(self._starts[-1])

    @property
    def starts(self) -> npt.NDArray[np.int64]:
        """The document table: ``N + 1`` corpus offsets (read-only)."""
        view = self._starts.view()
        view.flags.writeable = False
        return view

    def document(self, d: int) -> np.ndarray[Any, Any]:
        """The tokens of document ``d`` (a new array, ``out_dtype``)."""
        d = check_count(d, "document", minimum=0, maximum=self.num_documents - 1)
        a, b = int(self._starts[d]), int(self._starts[d + 1])
        out = np.empty(b - a, dtype=self.out_dtype)
        if b > a:
            source, count, target = np.array([[a], [b - a], [0]], dtype=np.int64)
            self.copy_ranges(source, count, target, out)
        return out

    def lengths(self) -> npt.NDArray[np.int64]:
        """Tokens per document (a new array)."""
        return np.diff(self._starts)

    def _path(self, shard: int) -> str:
        """A local path of ``shard``: the file, or its verified cached copy."""
        if self.files.uses_shard_cache():
            return self.files.cached_path(shard)
        path = self.files.path(shard)
        if not os.path.exists(path):
            raise self.files.missing(shard, path)
        return path


class Documents(CorpusBase):
    """The documents of a manifest, read in place (see the module docstring).

    ``eod_token``: the end-of-document token of plain token shards; ``column``: the
    token-list column of table shards (each required where such shards are, refused
    otherwise). ``out_dtype``: the dtype of gathered tokens (default: `common_dtype`; an
    explicit one must hold every token). ``index_dir``: where the document table is stored
    (None: rebuilt at each construction). ``storage``: where and how the shards are read
    (`Storage`; a remote root needs ``Storage(cache_dir=...)``); not in ``identity()``.
    """

    _TYPE: ClassVar[str] = "documents"
    _KIND: ClassVar[str] = "documents"
    _DERIVED: ClassVar[tuple[str, ...]] = (
        "_starts",
        "_all_token_files",
        "_unit_base",
        "_group_bases",
    )

    def __init__(
        self,
        manifest: Manifest | str,
        *,
        eod_token: int | None = None,
        column: str | None = None,
        out_dtype: str | None = None,
        index_dir: str | os.PathLike[str] | None = None,
        progress: bool | None = None,
        storage: Storage | None = None,
        **refused: Never,
    ) -> None:
        storage = checked_storage("Documents", storage, refused)
        self.eod_token = (
            None if eod_token is None else check_count(eod_token, "eod_token", minimum=0)
        )
        if column is not None and (not isinstance(column, str) or not column):
            raise ConfigError(f"column must be a column name, got {column!r}")
        self.column = column
        self._open("Documents", manifest, storage, index_dir, progress)
        self._groups: PerProcess[LruCache[tuple[int, int], np.ndarray[Any, Any]]] = PerProcess()
        planner = UnitPlanner(self.manifest, self.eod_token, self.column, self._table_schema)
        planned = planner.units()
        #: what the shards store (token ids must fit it); `out_dtype` is what is delivered
        self.stored_dtype = stored_dtype(planned)
        self.out_dtype = common_dtype(planned, out_dtype)
        #: the token spaces, with their token counts once the document table is loaded or built
        self.units: tuple[Unit, ...] = tuple(planned)

        def check(array: np.ndarray[Any, Any], meta: Mapping[str, Any]) -> str | None:
            problem, done = check_stored_table(self.manifest, planned, array, meta)
            if problem is None:
                self.units = tuple(done)
            return problem

        self._load(check)

    def _table_schema(self, shard: int) -> pa.Schema:
        entry = self.manifest.shards[shard]
        reader = self._table_reader(shard)
        schema = reader.schema_arrow if isinstance(reader, pq.ParquetFile) else reader.schema
        if self.column not in schema.names:
            raise ConfigError(
                f"shard {entry.path}: no column {self.column!r}; it has {schema.names}"
            )
        kind = schema.field(self.column).type
        if not (pa.types.is_list(kind) or pa.types.is_large_list(kind)):
            raise FormatError(
                f"shard {entry.path} column {self.column!r}: type {kind} is not a list of "
                "token ids (one row = one document)"
            )
        return schema

    def _inputs(self) -> dict[str, Any]:
        return {
            "algorithm": ALGORITHM,
            "manifest": self.manifest.id,
            "eod_token": self.eod_token,
            "column": self.column,
        }

    def _build(self) -> tuple[npt.NDArray[np.int64], dict[str, Any]]:
        """The document table read from the shards (``units`` given their token counts)."""
        parts: list[npt.NDArray[np.int64]] = []
        done: list[Unit] = []
        base = 0
        sizes = self.manifest.bytes_per_shard()
        total_bytes = int(sum(int(sizes[u.shard]) for u in self.units))
        with progress(total_bytes, "documents", unit="doc", enabled=self.progress) as update:
            for unit in self.units:
                local, unit = self._unit_documents(unit)
                parts.append(local[:-1] + base)
                base += int(local[-1])
                done.append(unit)
                update(int(sizes[unit.shard]))
        parts.append(np.array([base], dtype=np.int64))
        self.units = tuple(done)
        return np.concatenate(parts).astype(np.int64, copy=False), table_meta(done)

    def _unit_documents(self, unit: Unit) -> tuple[npt.NDArray[np.int64], Unit]:
        """Local document starts (ending with the unit's token count) and the unit's sizes."""
        if unit.kind == "megatron":
            path = self._path(unit.index)
            with open(path, "rb") as fh:
                self.files.check_opened(unit.index, fh.fileno(), path)
                raw = mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ)
            with raw:
                return megatron_starts(self.manifest, unit, raw), unit
        if unit.kind == "eod":
            assert self.eod_token is not None  # planned only with one
            return eod_starts(self._token_view(unit), unit.tokens, self.eod_token), unit
        entry = self.manifest.shards[unit.shard]
        groups = (self._read_group(unit.shard, g) for g in range(len(entry.row_groups or ())))
        return table_starts(unit, entry.path, str(self.column), groups)

    def _derive(self) -> None:
        """The document table, and where each unit's tokens start in the corpus (from the
        units: no file read)."""
        self._starts = self._index
        self._all_token_files = all(u.kind != "table" for u in self.units)
        base = np.zeros(len(self.units) + 1, dtype=np.int64)
        np.cumsum([u.tokens for u in self.units], out=base[1:])
        self._unit_base = base
        self._group_bases: dict[int, npt.NDArray[np.int64]] = {}

    def _bases(self, u: int) -> npt.NDArray[np.int64]:
        """First token of each row group of table unit ``u`` (and its end), in the unit."""
        found = self._group_bases.get(u)
        if found is None:
            groups = self.units[u].groups
            found = np.concatenate([[0], np.cumsum(groups)]).astype(np.int64)
            self._group_bases[u] = found
        return found

    def gather(self, index: IntArray) -> np.ndarray[Any, Any]:
        """The corpus tokens at ``index`` (1-D int64 in ``[0, num_tokens)``), in ``out_dtype``:
        `copy_ranges` of one-token ranges."""
        index = np.asarray(index, dtype=np.int64)
        out = np.empty(index.size, dtype=self.out_dtype)
        ones = np.ones(index.size, dtype=np.int64)
        self.copy_ranges(index, ones, np.arange(index.size, dtype=np.int64), out)
        return out

    def copy_ranges(
        self, source: IntArray, count: IntArray, target: IntArray, out: np.ndarray[Any, Any]
    ) -> None:
        """`CorpusBase.copy_ranges`: long ranges are copied slice by slice, many short ones by
        one gather per shard or row group."""
        if not count.size:
            return
        unit = np.searchsorted(self._unit_base, source, side="right").astype(np.int64) - 1
        local = source - self._unit_base[unit]
        touched = np.flatnonzero(np.bincount(unit)).tolist()
        if self._all_token_files and int(count.sum()) >= _SLICE_MIN_TOKENS * count.size:
            views = {u: self._token_view(self._refreshed(u)) for u in touched}  # one per shard
            if out.flags.c_contiguous and all(v.dtype == out.dtype for v in views.values()):
                _copy_bytes(views, unit, local, count, target, out)
                return
            for u, s, n, t in zip(
                unit.tolist(), local.tolist(), count.tolist(), target.tolist(), strict=True
            ):
                out[t : t + n] = views[u][s : s + n]
            return
        for u in touched:
            mine = slice(None) if len(touched) == 1 else unit == u
            self._copy_unit(u, local[mine], count[mine], target[mine], out)

    def _refreshed(self, u: int) -> Unit:
        """Unit ``u``, its shard's cached copy refreshed first (when reading copies)."""
        unit = self.units[u]
        if self.files.uses_shard_cache():
            self.files.refresh_copies((unit.shard,))
        return unit

    def _copy_unit(
        self, u: int, local: IntArray, count: IntArray, target: IntArray, out: np.ndarray[Any, Any]
    ) -> None:
        unit = self._refreshed(u)
        if unit.kind != "table":
            _copy_from(self._token_view(unit), local, count, target, out)
            return
        bases = self._bases(u)
        group = np.searchsorted(bases, local, side="right").astype(np.int64) - 1
        groups = np.unique(group).tolist()
        for g in groups:
            mine = slice(None) if len(groups) == 1 else group == g
            values = self._group_values(unit, g)
            _copy_from(values, local[mine] - bases[g], count[mine], target[mine], out)

    def _token_view(self, unit: Unit) -> np.ndarray[Any, Any]:
        """The tokens of a token-file unit: a read-only view of its memory map (size-checked)."""
        files = self.files
        held: _MappedTokens | None = files.local().handles.get(unit.shard)
        if held is not None:
            files.check_size(unit.shard, held.mapping.size(), held.path)
            return held.view
        entry = self.manifest.shards[unit.shard]
        path = self._path(unit.shard)
        with open(path, "rb") as fh:
            files.check_opened(unit.shard, fh.fileno(), path)
            mapping = mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ) if entry.bytes else None
        if mapping is None:
            view: np.ndarray[Any, Any] = np.empty(0, dtype=disk_dtype(unit.dtype))
            return view
        view = np.frombuffer(
            mapping, dtype=disk_dtype(unit.dtype), count=unit.tokens, offset=entry.data_offset or 0
        )
        view.flags.writeable = False
        files.keep(unit.shard, _MappedTokens(view, mapping, path))
        return view

    def _table_reader(self, shard: int) -> Any:
        return open_table(self.manifest.shards[shard].format, self._path(shard))

    def _read_group(self, shard: int, group: int) -> pa.ListArray:
        """Row group / record batch ``group`` of the token column of ``shard`` (one chunk)."""
        if self.manifest.shards[shard].format is not Format.PARQUET:
            return self._arrow_batches(shard)[group]
        table = self._table_reader(shard).read_row_group(group, columns=[self.column])
        return table.column(self.column).combine_chunks()

    def _arrow_batches(self, shard: int) -> list[Any]:
        reader = self._table_reader(shard)
        if self.manifest.shards[shard].format is Format.ARROW_STREAM:
            batches = list(reader)
        else:
            batches = [reader.get_batch(i) for i in range(reader.num_record_batches)]
        return [b.column(self.column) for b in batches]

    def _group_values(self, unit: Unit, group: int) -> np.ndarray[Any, Any]:
        """The flattened tokens of row group ``group`` of a table unit (cached per process)."""
        entry = self.manifest.shards[unit.shard]
        if entry.format is not Format.PARQUET:
            files = self.files
            held: Held[list[np.ndarray[Any, Any]]] | None = files.local().handles.get(unit.shard)
            if held is None:
                path = self._path(unit.shard)
                values = [
                    np.asarray(c.flatten().to_numpy(zero_copy_only=False))
                    for c in self._arrow_batches(unit.shard)
                ]
                held = Held(values, path)
                files.keep(unit.shard, held)
            files.check_file(unit.shard, held.path)
            return held.data[group]

        def decode(key: tuple[int, int]) -> np.ndarray[Any, Any]:
            decoded = np.asarray(self._read_group(*key).flatten().to_numpy())
            decoded.setflags(write=False)
            return decoded

        groups = self._groups.get(functools.partial(LruCache, _PARQUET_GROUPS))
        return groups.get((unit.shard, group), decode)


def _copy_bytes(
    views: dict[int, np.ndarray[Any, Any]],
    unit: IntArray,
    source: IntArray,
    count: IntArray,
    target: IntArray,
    out: np.ndarray[Any, Any],
) -> None:
    """`_copy_from` over several token views of ``out``'s dtype, as raw byte copies
    (a ``memoryview`` slice assignment per range: a ``memcpy`` with the least Python)."""
    size = out.dtype.itemsize
    dst = out.data.cast("B")
    src = {u: v.data.cast("B") for u, v in views.items()}
    for u, s, n, t in zip(
        unit.tolist(),
        (source * size).tolist(),
        (count * size).tolist(),
        (target * size).tolist(),
        strict=True,
    ):
        dst[t : t + n] = src[u][s : s + n]


def _copy_from(
    values: np.ndarray[Any, Any],
    source: IntArray,
    count: IntArray,
    target: IntArray,
    out: np.ndarray[Any, Any],
) -> None:
    """``out[target[j] : target[j] + count[j]] = values[source[j] : source[j] + count[j]]``."""
    total = int(count.sum())
    if total >= _SLICE_MIN_TOKENS * count.size:
        for s, n, t in zip(source.tolist(), count.tolist(), target.tolist(), strict=True):
            out[t : t + n] = values[s : s + n]
        return
    run = np.arange(total, dtype=np.int64) - np.repeat(np.cumsum(count) - count, count)
    out[np.repeat(target, count) + run] = values[np.repeat(source, count) + run]
