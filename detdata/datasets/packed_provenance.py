"""Where the tokens of packed windows come from: each window's documents and their pieces.

`window_documents(packed, ids)` (`PackedWindows.provenance`) lists, for each window id,
the documents whose tokens it holds, in window order: ``document`` (corpus number),
``tokens`` ``[a, b)`` (the piece, as offsets in the document's packed tokens: ``bos`` /
``eos`` inserted by packing counted), ``window`` ``[a, b)`` (where the piece lies in the
window) and, for a `TextDocuments` corpus, where the document's text is (``shard`` and
``line`` or ``row``, `TextDocuments.location`). Computed from the packing index alone,
with the same `locate` the reads use (no token is read).
"""

from __future__ import annotations

from typing import Any, Protocol

import numpy as np
import numpy.typing as npt

from detdata.base.types import IntArray
from detdata.datasets.base import check_ids
from detdata.datasets.text import TextDocuments
from detdata.order.packing import locate


class Packed(Protocol):
    """What `window_documents` reads of a `PackedWindows` (declared here: no import cycle)."""

    @property
    def num_samples(self) -> int: ...

    @property
    def offsets(self) -> npt.NDArray[np.int64]: ...

    seq_len: int
    window: int

    @property
    def documents(self) -> object: ...

    def document_at(self, positions: IntArray) -> IntArray: ...


def window_documents(packed: Packed, ids: IntArray) -> list[dict[str, Any]]:
    """One ``{"documents": [...]}`` per window of ``ids`` (module docstring)."""
    win = check_ids(ids, packed.num_samples, f"PackedWindows(seq_len={packed.seq_len})")
    pieces = locate(packed.offsets, win, seq_len=packed.seq_len, width=packed.window)
    docs = packed.document_at(pieces.position).tolist()
    out: list[dict[str, Any]] = [{"documents": []} for _ in range(int(win.size))]
    corpus = packed.documents
    text = isinstance(corpus, TextDocuments)
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
        if text:
            assert isinstance(corpus, TextDocuments)
            entry.update(corpus.location(int(d)))
        out[row]["documents"].append(entry)
    return out
