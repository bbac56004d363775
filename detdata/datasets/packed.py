"""`PackedWindows`: fixed ``seq_len`` windows packed from documents (``packing-v1``,
defined exactly in `detdata.order.packing`; docs/design.md "Documents and packing").

Each window delivers ``tokens``, ``doc_index`` (segment within the window, ``-1``:
padding), ``position_ids`` (offset within the segment), ``cu_seqlens`` (cumulative segment
ends over the ``seq_len`` input tokens, unused entries repeat ``seq_len``) and
``num_segments`` (``cu_seqlens[:n + 1]`` are used); shapes and dtypes: `schema`. With
``labels=True`` the targets are ``tokens[1:]``; a batch's flash-attention varlen
``cu_seqlens`` is a leading 0 then, over rows ``b``, ``cu_seqlens[b, 1 : num_segments[b] +
1] + b * seq_len``. Pass one ``max_segments`` to every source of a `Mixture` so their
columns agree. The packing index (16 bytes a document) is built once or loaded from
``index_dir`` (`detdata.datasets.index_files`).
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any, ClassVar

import numpy as np
import numpy.typing as npt

from detdata.base.checks import check_count, check_positive_int, check_seed
from detdata.base.errors import ConfigError
from detdata.base.progress import progress
from detdata.base.types import Batch, IntArray
from detdata.datasets.base import check_ids
from detdata.datasets.batch_columns import describe_dtype
from detdata.datasets.capabilities import DatasetInfo
from detdata.datasets.documents import Documents
from detdata.datasets.index_files import load_or_build, reload_index
from detdata.datasets.process_local import pickled_state
from detdata.datasets.text import TextDocuments
from detdata.order.packing import (
    ALGORITHM,
    Tail,
    build_offsets,
    copy_plan,
    covered_tokens,
    locate,
    packed_columns,
    parse_tail,
    segments_bound,
    shuffled_documents,
    window_count,
)


class PackedWindows(DatasetInfo):
    """``seq_len`` windows packed from ``documents`` (module docstring; ``packing-v1``).

    ``seed`` keys the document shuffle (``shuffle=False``: canonical document
    order). ``bos`` / ``eos``: token ids inserted before / after every document.
    ``tail``: ``"drop"`` (the last partial window is not delivered) or ``"pad"``
    (it is, filled with ``pad_id``). ``max_segments``: the width of ``cu_seqlens``
    (default and minimum: `segments_bound`). ``index_dir``: where the packing index is
    stored (default: ``documents.index_dir``; None: built at every construction).
    """

    #: made again when unpickled (from the packing index), never pickled
    _DERIVED: ClassVar[tuple[str, ...]] = ("_offsets", "_first", "_ramp", "_checked_counts")

    def __init__(
        self,
        documents: Documents | TextDocuments,
        seq_len: int,
        *,
        seed: int = 0,
        shuffle: bool = True,
        labels: bool = True,
        bos: int | None = None,
        eos: int | None = None,
        tail: str | Tail = Tail.DROP,
        pad_id: int | None = None,
        max_segments: int | None = None,
        index_dir: str | os.PathLike[str] | None = None,
        progress: bool | None = None,
    ) -> None:
        if not isinstance(documents, (Documents, TextDocuments)):
            raise ConfigError(
                "PackedWindows packs a detdata Documents or TextDocuments corpus, got "
                f"{type(documents).__name__}"
            )
        self.documents = documents
        self.seq_len = check_positive_int(seq_len, "seq_len")
        self.seed = check_seed(seed)
        self.shuffle = _check_bool(shuffle, "shuffle")
        self.labels = _check_bool(labels, "labels")
        self.window = self.seq_len + int(self.labels)
        self.tail = parse_tail(tail)
        dtype = documents.stored_dtype  # a token id the corpus could store (delivered wider)
        self.bos = _check_token(bos, "bos", dtype)
        self.eos = _check_token(eos, "eos", dtype)
        self.pad_id = _check_token(pad_id, "pad_id", dtype)
        if (self.tail is Tail.PAD) != (self.pad_id is not None):
            raise ConfigError(
                "pad_id= is needed with tail='pad' and only then (tail='drop' never pads); "
                f"got tail={self.tail.value!r}, pad_id={pad_id!r}"
            )
        self.index_dir = documents.index_dir if index_dir is None else os.fspath(index_dir)
        self.progress = progress
        self._index, meta = self._packing_index()
        self._num = int(meta["windows"])
        if self._num == 0:
            raise ConfigError(
                f"no windows of seq_len={self.seq_len} (labels={self.labels}, tail="
                f"{self.tail.value!r}) in {self.documents.num_tokens} tokens of "
                f"{self.documents.num_documents} documents; hint: use a smaller seq_len"
            )
        bound = int(meta["segments_bound"])
        self.max_segments = bound
        if max_segments is not None:
            self.max_segments = check_positive_int(max_segments, "max_segments")
        if self.max_segments < bound:
            raise ConfigError(
                f"max_segments={self.max_segments} is below the {bound} segments a window "
                f"of this corpus can have; hint: pass max_segments >= {bound} (or None)"
            )
        self._build_index()

    # the packing index ------------------------------------------------------------
    def _inputs(self) -> dict[str, Any]:
        """What the packing index is a function of (its key; also `identity`'s first keys)."""
        return {
            "algorithm": ALGORITHM,
            "documents": self.documents.identity(),
            "seed": self.seed,
            "shuffle": self.shuffle,
            "seq_len": self.seq_len,
            "labels": self.labels,
            "bos": self.bos,
            "eos": self.eos,
            "tail": self.tail.value,
        }

    def _packing_index(self) -> tuple[npt.NDArray[np.int64], dict[str, Any]]:
        """The packing index and its counts: loaded from ``index_dir`` (used only when
        `_check_index` finds it equal to a recomputation) or built."""
        stored = load_or_build(
            self.index_dir, "packing", self._inputs(), self._check_index, self._built_index
        )
        self._index_digest = stored.digest
        return stored.array, stored.meta  # a stored meta equals `_counts` (`_check_index`)

    def _built_index(self) -> tuple[npt.NDArray[np.int64], dict[str, int]]:
        offsets = self._offsets_of_documents()
        return offsets, self._counts(offsets)

    def _offsets_of_documents(self) -> npt.NDArray[np.int64]:
        extra = int(self.bos is not None) + int(self.eos is not None)
        with progress(
            self.documents.num_documents, "packing index", unit="doc", enabled=self.progress
        ) as update:
            return build_offsets(
                self.documents.starts,
                seed=self.seed,
                shuffle=self.shuffle,
                extra=extra,
                progress=update,
            )

    def _total(self) -> int:
        """Stream tokens, from the documents alone: their tokens plus the BOS / EOS inserted."""
        extra = int(self.bos is not None) + int(self.eos is not None)
        return self.documents.num_tokens + extra * self.documents.num_documents

    def _counts(self, offsets: npt.NDArray[np.int64]) -> dict[str, int]:
        """``{"windows", "segments_bound"}``: windows from the documents, bound from ``offsets``."""
        windows = window_count(self._total(), self.seq_len, self.labels, self.tail)
        with progress(windows, "segments bound", unit="doc", enabled=self.progress) as update:
            bound = segments_bound(offsets[0], windows, self.seq_len, update) if windows else 1
        return {"windows": windows, "segments_bound": bound}

    def _check_index(self, array: np.ndarray[Any, Any], meta: Mapping[str, Any]) -> str | None:
        """What is wrong with a stored packing index and its record (the offsets and every
        metadata field recomputed and compared in full), or None."""
        n = self.documents.num_documents
        if array.dtype != np.int64 or array.shape != (2, n + 1):
            return f"array {array.dtype} of shape {array.shape}, expected int64 (2, {n + 1})"
        want = self._offsets_of_documents()
        if not np.array_equal(array, want):
            row, col = (int(x[0]) for x in np.nonzero(array != want))
            found = int(array[row, col])
            return f"offsets[{row}, {col}]: expected {int(want[row, col])}, found {found}"
        counts = self._counts(want)
        for key in sorted(set(counts) | set(meta)):
            if meta.get(key) != counts.get(key):
                return f"meta.{key}: expected {counts.get(key)!r}, found {meta.get(key)!r}"
        return None

    def _build_index(self) -> None:
        self._offsets = self._index[0]
        self._first = self._index[1]
        self._ramp: IntArray | None = None

    def __getstate__(self) -> dict[str, Any]:
        return pickled_state(self, self._DERIVED, "_index")

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        if self._index is None:
            self._index = reload_index(
                self.index_dir,
                "packing",
                self._inputs(),
                str(self._index_digest),
                self._offsets_of_documents,
            )
        self._build_index()

    # Dataset protocol ---------------------------------------------------------------
    @property
    def num_samples(self) -> int:
        """Windows per epoch."""
        return self._num

    def __len__(self) -> int:
        return self.num_samples

    @property
    def tokens_per_sample(self) -> int:
        """``seq_len`` (padding is subtracted by ``DataLoader.tokens_consumed``)."""
        return self.seq_len

    @property
    def offsets(self) -> npt.NDArray[np.int64]:
        """The packing index: effective-token offsets of the shuffled positions (read-only)."""
        view: npt.NDArray[np.int64] = self._offsets.view()
        view.flags.writeable = False
        return view

    def schema(self) -> dict[str, str]:
        return {
            "tokens": describe_dtype(self.documents.out_dtype, (self.window,)),
            "doc_index": describe_dtype(np.dtype(np.int32), (self.window,)),
            "position_ids": describe_dtype(np.dtype(np.int32), (self.window,)),
            "cu_seqlens": describe_dtype(np.dtype(np.int32), (self.max_segments + 1,)),
            "num_segments": describe_dtype(np.dtype(np.int32)),
        }

    def identity(self) -> dict[str, Any]:
        """Plain JSON pinning the documents, the algorithm and every packing option."""
        return {
            "type": "packed_windows",
            **self._inputs(),
            "pad_id": self.pad_id,
            "max_segments": self.max_segments,
            "num_samples": self._num,
        }

    def padding_tokens(self) -> dict[int, int]:
        """Window id -> padding among its ``seq_len`` input tokens (``tail="pad"``: the last
        window, when the stream does not fill it; else none). Counted from the documents."""
        pad = self._num * self.seq_len - self._total()
        if self.tail is not Tail.PAD or pad <= 0:
            return {}
        return {self._num - 1: pad}

    def provenance(self, ids: IntArray) -> list[dict[str, Any]]:
        """Per window of ``ids``, ``{"documents": [...]}``: in window order, each document
        whose tokens it holds: ``document`` (corpus number), ``tokens`` ``[a, b)`` (the
        piece, as offsets in the document's packed tokens, ``bos`` / ``eos`` counted),
        ``window`` ``[a, b)`` (where it lies in the window) and, for `TextDocuments`, where
        its text is (`TextDocuments.location`). From the packing index alone (no token read).
        """
        win = check_ids(ids, self._num, f"PackedWindows(seq_len={self.seq_len})")
        pieces = locate(self._offsets, win, seq_len=self.seq_len, width=self.window)
        docs = self.document_at(pieces.position).tolist()
        out: list[dict[str, Any]] = [{"documents": []} for _ in range(int(win.size))]
        corpus = self.documents
        for row, d, off, start, n in zip(
            pieces.row.tolist(),
            docs,
            pieces.offset.tolist(),
            pieces.start.tolist(),
            pieces.count.tolist(),
            strict=True,
        ):
            entry: dict[str, Any] = {
                "document": int(d),
                "tokens": [off, off + n],
                "window": [start, start + n],
            }
            if isinstance(corpus, TextDocuments):
                entry.update(corpus.location(int(d)))
            out[row]["documents"].append(entry)
        return out

    def document_at(self, positions: IntArray) -> IntArray:
        """The document at each shuffled position (the packing order)."""
        return shuffled_documents(
            np.asarray(positions, dtype=np.int64),
            self.documents.num_documents,
            self.seed,
            self.shuffle,
        )

    def read(self, ids: npt.ArrayLike) -> Batch:
        """The columns of windows ``ids`` (module docstring), rows in the order of ``ids``:
        whole document pieces copied as token ranges (`copy_plan`), the mask columns from
        per-piece arithmetic (`packed_columns`)."""
        win = check_ids(ids, self._num, f"PackedWindows(seq_len={self.seq_len})")
        rows, width = int(win.size), self.window
        pieces = locate(self._offsets, win, seq_len=self.seq_len, width=width)
        covered = covered_tokens(self._offsets, win, seq_len=self.seq_len, width=width)
        plan = copy_plan(
            pieces, self._first, width=width, bos=self.bos is not None, eos=self.eos is not None
        )
        dtype = self.documents.out_dtype
        if int(covered.sum()) == rows * width:
            tokens = np.empty(rows * width, dtype=dtype)
        else:
            tokens = np.full(rows * width, self.pad_id or 0, dtype=dtype)
        self.documents.copy_ranges(plan.source, plan.count, plan.target, tokens)
        if self.bos is not None:
            tokens[plan.bos_at] = self.bos
        if self.eos is not None:
            tokens[plan.eos_at] = self.eos
        out: Batch = {"tokens": tokens.reshape(rows, width)}
        out.update(
            packed_columns(
                pieces,
                covered,
                width=width,
                seq_len=self.seq_len,
                max_segments=self.max_segments,
                ramp=self._ramp_of(rows * width),
            )
        )
        return out

    def _ramp_of(self, size: int) -> IntArray | None:
        """A cached int32 ``arange`` of at least ``size`` (grown on demand; never changes a
        delivered byte). Over 2**31 entries: None (`packed_columns` makes its own)."""
        if size >= 2**31:
            return None
        ramp = self._ramp
        if ramp is None or ramp.size < size:
            ramp = np.arange(size, dtype=np.int32)
            ramp.flags.writeable = False
            self._ramp = ramp
        return ramp


def _check_bool(value: object, name: str) -> bool:
    if not isinstance(value, (bool, np.bool_)):
        raise ConfigError(f"{name} must be True or False, got {value!r}")
    return bool(value)


def _check_token(value: int | None, name: str, dtype: np.dtype[Any]) -> int | None:
    """A token id that fits the delivered token dtype, or None."""
    if value is None:
        return None
    info = np.iinfo(dtype)
    return check_count(value, name, minimum=max(0, int(info.min)), maximum=int(info.max))
