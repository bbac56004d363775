"""packing-v1's step written token by token (every token placed through a `TokenLayout`):
the formulation `copy_plan` and `packed_columns` (detdata/order/packing.py) are checked
against, byte for byte. It shares `Pieces` and ``_cu_seqlens`` with them."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from detdata.base.types import IntArray
from detdata.order.packing import PAD_SEGMENT, Pieces, _cu_seqlens


@dataclass(frozen=True)
class TokenLayout:
    """Per-token positions of pieces: flat output index, piece, and offset within the piece."""

    flat: IntArray
    piece: IntArray
    within: IntArray


def token_layout(pieces: Pieces, width: int) -> TokenLayout:
    """Where each token of ``pieces`` goes in a ``(rows, width)`` output, flattened."""
    piece = np.repeat(np.arange(pieces.count.size, dtype=np.int64), pieces.count)
    firsts = np.cumsum(pieces.count) - pieces.count
    within = np.arange(piece.size, dtype=np.int64) - firsts[piece]
    flat = pieces.row[piece] * width + pieces.start[piece] + within
    return TokenLayout(flat=flat, piece=piece, within=within)


def window_columns(
    pieces: Pieces, layout: TokenLayout, *, rows: int, width: int, seq_len: int, max_segments: int
) -> dict[str, np.ndarray]:
    """``doc_index``, ``position_ids`` (``(rows, width)`` int32), ``cu_seqlens``
    (``(rows, max_segments + 1)`` int32) and ``num_segments`` (``(rows,)`` int32).

    The per-token formulation (every token placed through ``layout``): the reference
    `packed_columns` is checked against; `PackedWindows` reads with `packed_columns`.
    """
    doc_index = np.full(rows * width, PAD_SEGMENT, dtype=np.int32)
    positions = np.zeros(rows * width, dtype=np.int32)
    doc_index[layout.flat] = pieces.segment[layout.piece]
    positions[layout.flat] = layout.within
    ends = np.minimum(pieces.start + pieces.count, seq_len)
    inputs = pieces.start < seq_len
    last = np.zeros(rows, dtype=np.int64)
    if inputs.any():
        np.maximum.at(last, pieces.row[inputs], ends[inputs])
    cu, count = _cu_seqlens(pieces, rows, seq_len, max_segments, last)
    return {
        "doc_index": doc_index.reshape(rows, width),
        "position_ids": positions.reshape(rows, width),
        "cu_seqlens": cu,
        "num_segments": count,
    }


def raw_tokens(
    pieces: Pieces,
    layout: TokenLayout,
    first: npt.NDArray[np.int64],
    *,
    bos: bool,
    eos: bool,
) -> tuple[IntArray, npt.NDArray[np.bool_], npt.NDArray[np.bool_]]:
    """``(corpus token index, is_bos, is_eos)`` of every token of ``pieces``.

    ``first`` is row 1 of the packing index (corpus start of the document at each
    shuffled position). Inserted tokens get index -1.
    """
    eff = pieces.offset[layout.piece] + layout.within
    is_bos = eff == 0 if bos else np.zeros(eff.size, dtype=np.bool_)
    is_eos = (eff == pieces.length[layout.piece] - 1) if eos else np.zeros(eff.size, dtype=np.bool_)
    index = first[pieces.position][layout.piece] + eff - int(bos)
    index[is_bos | is_eos] = -1
    return index, is_bos, is_eos
