"""Packing documents into fixed windows as pure functions (``packing-v1``): index in, index out.

Algorithm ``packing-v1`` (exact definition; a re-implementation must reproduce the
golden vectors in ``tests/golden/packing_v1.json``):

Inputs: ``starts`` (``N + 1`` non-decreasing int64: document ``d`` is tokens
``[starts[d], starts[d + 1])`` of the corpus, in canonical order), ``seed``,
``shuffle``, ``bos`` / ``eos`` (optional token ids), ``seq_len`` ``L``, ``labels``
and the ``tail`` policy.

1. Effective documents: document ``d`` becomes ``[bos] + tokens(d) + [eos]`` (each
   only when given); its effective length is ``len(d) + (bos given) + (eos given)``.
2. Document order: with ``shuffle``, shuffled position ``k`` holds document
   ``permute(k, N, s, epoch=0)`` (`detdata.order.feistel.permute`, ``feistel-v1``)
   with ``s = derive_u64(b"detdata:packing-v1", seed)``; without, document ``k``.
   The order is the same for every epoch (the windows are re-ordered per epoch by
   the loader's `GlobalOrder` instead).
3. The stream: the effective documents concatenated in shuffled order, ``T``
   tokens. ``offsets[k]`` = effective tokens before shuffled position ``k``
   (``N + 1`` int64). The packing index (`build_offsets`, 16 bytes a document) holds
   ``offsets`` and, per shuffled position, the corpus start of its document.
4. Windows: window ``w`` is stream tokens ``[w L, w L + L + labels)``; documents are
   split across windows wherever the boundary falls, and consecutive windows share
   one token when ``labels`` (as `TokenWindows`). Tail policy ``drop``:
   ``W = (T - labels) // L`` windows; the stream tokens ``[W L + labels, T)`` are
   never delivered and token ``W L`` only as the last window's label. ``pad``:
   ``W = ceil(T / L)`` windows; positions at or past ``T`` hold ``pad_id``: every
   token is an input exactly once.
5. Per window, a *segment* is a maximal run of one document's tokens (zero-length
   pieces are dropped). Columns: ``doc_index`` (segment number within the window,
   from 0; ``-1`` for padding), ``position_ids`` (offset within the segment:
   positions restart at every segment, including a document continued from the
   previous window), ``cu_seqlens`` (``max_segments + 1`` int32 cumulative segment
   ends over the ``L`` *input* tokens, the layout of flash-attention's varlen
   kernels; a padded tail is one more segment; unused entries repeat ``L``, i.e.
   zero-length segments) and ``num_segments`` (the used count, so
   ``cu_seqlens[: num_segments + 1]`` is exact).

Nothing here reads files (`build_offsets`, `locate`, `copy_plan`, `packed_columns`); the
per-token formulation they are tested against is tests/order/packing_per_token.py. Window
``w`` costs O(log N + its tokens) wherever it is.
"""

from __future__ import annotations

import enum
from collections.abc import Callable
from dataclasses import dataclass
from typing import Final

import numpy as np
import numpy.typing as npt

from detdata.base.checks import check_seed
from detdata.base.errors import ConfigError
from detdata.base.keys import derive_u64
from detdata.base.types import IntArray
from detdata.order.feistel import permute

ALGORITHM: Final = "packing-v1"
_TAG: Final = b"detdata:" + ALGORITHM.encode()
#: Documents per vectorised pass when building an index (bounded temporaries).
CHUNK: Final = 1 << 20
#: ``doc_index`` of padding tokens.
PAD_SEGMENT: Final = -1


class Tail(str, enum.Enum):
    """What happens to the stream's last partial window."""

    DROP = "drop"
    PAD = "pad"


def parse_tail(value: str | Tail) -> Tail:
    """`Tail` from ``"drop"`` / ``"pad"``, else `ConfigError`."""
    try:
        return Tail(value)
    except ValueError:
        raise ConfigError(f"tail must be 'drop' or 'pad', got {value!r}") from None


def shuffled_documents(positions: IntArray, n: int, seed: int, shuffle: bool) -> IntArray:
    """The document at each shuffled position (all in ``[0, n)``), int64 (step 2)."""
    pos = np.asarray(positions, dtype=np.int64)
    if not shuffle:
        return pos.copy()
    document_seed = derive_u64(_TAG, check_seed(seed))
    return permute(pos.astype(np.uint64), n, document_seed, 0).astype(np.int64)


def build_offsets(
    starts: npt.NDArray[np.int64],
    *,
    seed: int,
    shuffle: bool,
    extra: int,
    progress: Callable[[int], None] | None = None,
    out: npt.NDArray[np.int64] | None = None,
) -> npt.NDArray[np.int64]:
    """The packing index (step 3), ``(2, N + 1)`` int64, into ``out`` if given: row 0
    ``offsets``, row 1 the corpus start of the document at each shuffled position (last
    entry: the corpus size). ``extra``: BOS/EOS tokens a document. ``CHUNK`` documents at a
    time, ``progress(done)`` after each."""
    n = int(starts.shape[0]) - 1
    result = np.empty((2, n + 1), dtype=np.int64) if out is None else out
    offsets, first = result[0], result[1]
    offsets[0] = 0
    first[n] = starts[n]
    carry = 0
    for a in range(0, n, CHUNK):
        b = min(n, a + CHUNK)
        docs = shuffled_documents(np.arange(a, b, dtype=np.int64), n, seed, shuffle)
        first[a:b] = starts[docs]
        lengths = starts[docs + 1] - first[a:b] + extra
        np.cumsum(lengths, out=offsets[a + 1 : b + 1])
        offsets[a + 1 : b + 1] += carry
        carry = int(offsets[b])
        if progress is not None:
            progress(b - a)
    return result


def window_count(total: int, seq_len: int, labels: bool, tail: Tail) -> int:
    """Windows of a stream of ``total`` tokens (module docstring, step 4)."""
    if tail is Tail.DROP:
        return max(0, (total - int(labels)) // seq_len)
    return -(-total // seq_len)


@dataclass(frozen=True)
class Pieces:
    """The non-empty pieces of some windows, in window then stream order: piece ``j`` is
    ``count[j]`` effective tokens of the document at shuffled position ``position[j]``, from
    ``offset[j]`` in it, at ``start[j]`` of requested window ``row[j]``, its ``segment[j]``."""

    row: IntArray
    position: IntArray
    offset: IntArray
    start: IntArray
    count: IntArray
    segment: IntArray
    length: IntArray  # effective length of the piece's document


def locate(
    offsets: npt.NDArray[np.int64], windows: IntArray, *, seq_len: int, width: int
) -> Pieces:
    """The pieces of ``windows`` (ids with ``w * seq_len < T``), each ``width`` tokens wide;
    stream positions at or past ``T`` (a padded tail) are in no piece."""
    win = np.asarray(windows, dtype=np.int64)
    total = int(offsets[-1])
    s = win * seq_len
    e = np.minimum(s + width, total)
    k0 = np.searchsorted(offsets, s, side="right").astype(np.int64, copy=False) - 1
    per = np.searchsorted(offsets, e - 1, side="right").astype(np.int64, copy=False) - k0
    row = np.repeat(np.arange(win.size, dtype=np.int64), per)
    first = np.cumsum(per)
    first -= per
    run = np.arange(row.size, dtype=np.int64)
    k = np.repeat(k0 - first, per)
    k += run
    lo, hi = offsets[k], offsets[k + 1]
    ps = np.maximum(lo, s[row])
    count = np.minimum(hi, e[row])
    count -= ps
    keep = count > 0
    if keep.all():  # no empty documents among them: nothing to drop
        segment = run - np.repeat(first, per)
    else:
        row, k, ps, count, lo, hi = row[keep], k[keep], ps[keep], count[keep], lo[keep], hi[keep]
        kept_per = np.bincount(row, minlength=win.size)
        segment = np.arange(row.size, dtype=np.int64) - np.repeat(
            np.cumsum(kept_per) - kept_per, kept_per
        )
    return Pieces(
        row=row,
        position=k,
        offset=ps - lo,
        start=ps - s[row],
        count=count,
        segment=segment,
        length=hi - lo,
    )


def segments_bound(
    offsets: npt.NDArray[np.int64],
    windows: int,
    seq_len: int,
    progress: Callable[[int], None] | None = None,
) -> int:
    """An upper bound of the segments any of the ``windows`` windows has in its input tokens.

    Per window: the shuffled positions its ``seq_len`` input tokens touch, plus one
    for a padded tail (zero-length documents inside a window count too: a bound).
    """
    total = int(offsets[-1])
    best = 0
    for a in range(0, windows, CHUNK):
        w = np.arange(a, min(windows, a + CHUNK), dtype=np.int64)
        s = w * seq_len
        e = np.minimum(s + seq_len, total)
        k0 = np.searchsorted(offsets, s, side="right")
        k1 = np.searchsorted(offsets, e - 1, side="right")
        n = k1 - k0 + 1 + (s + seq_len > total)
        best = max(best, int(n.max()))
        if progress is not None:
            progress(int(w.size))
    return best


def _cu_seqlens(
    pieces: Pieces, rows: int, seq_len: int, max_segments: int, last: IntArray
) -> tuple[np.ndarray, np.ndarray]:
    """``(cu_seqlens, num_segments)`` of the rows; ``last[r]``: the end of row ``r``'s last
    input piece (``< seq_len``: a padded tail, one more segment closed by the sentinel)."""
    inputs = pieces.start < seq_len
    row, seg = pieces.row[inputs], pieces.segment[inputs]
    ends = np.minimum(pieces.start[inputs] + pieces.count[inputs], seq_len)
    count = np.bincount(row, minlength=rows) + (last < seq_len)  # input pieces: segments 0, 1, ..
    if int(count.max(initial=0)) > max_segments:
        raise ConfigError(
            f"a window has {int(count.max())} segments, more than max_segments="
            f"{max_segments}; hint: raise max_segments (or leave it None)"
        )
    cu = np.full((rows, max_segments + 1), seq_len, dtype=np.int32)
    cu[:, 0] = 0
    cu.reshape(-1)[row * (max_segments + 1) + seg + 1] = ends
    return cu, count.astype(np.int32)


def covered_tokens(
    offsets: npt.NDArray[np.int64], windows: IntArray, *, seq_len: int, width: int
) -> IntArray:
    """Stream tokens each window holds (``width``, or fewer in a padded tail): its pieces
    tile positions ``[0, covered)`` of the window, in piece order; the rest is padding."""
    s = np.asarray(windows, dtype=np.int64) * seq_len
    return np.minimum(s + width, int(offsets[-1])) - s


def packed_columns(
    pieces: Pieces,
    covered: IntArray,
    *,
    width: int,
    seq_len: int,
    max_segments: int,
    ramp: IntArray | None = None,
) -> dict[str, np.ndarray]:
    """The step-5 columns of ``pieces`` (int32; ``doc_index``, ``position_ids`` ``(rows,
    width)``), byte for byte the per-token ``window_columns`` (tests/order/packing_per_token.py)
    in O(tokens) vectorised passes. ``ramp``: optionally a cached ``arange`` (int32, or int64
    past 2**31 tokens) at least as long as the pieces' tokens."""
    rows = int(covered.size)
    total = int(pieces.count.sum())
    idx = np.int32 if rows * width < 2**31 else np.int64
    if ramp is None or ramp.dtype != idx or ramp.size < total:
        ramp = np.arange(total, dtype=idx)
    firsts = np.cumsum(pieces.count)
    firsts -= pieces.count
    run = np.repeat(firsts.astype(idx), pieces.count)
    np.subtract(ramp[:total], run, out=run)  # offset within each piece
    seg = np.repeat(pieces.segment.astype(np.int32), pieces.count)
    if total == rows * width:
        doc_index, positions = seg, run.astype(np.int32, copy=False)
        last = np.full(rows, min(width, seq_len), dtype=np.int64)
    else:
        inside = (np.arange(width, dtype=np.int64)[None, :] < covered[:, None]).reshape(-1)
        doc_index = np.full(rows * width, PAD_SEGMENT, dtype=np.int32)
        positions = np.zeros(rows * width, dtype=np.int32)
        doc_index[inside] = seg
        positions[inside] = run
        last = np.minimum(covered, seq_len)  # pieces tile [0, covered): the last input end
    cu, count = _cu_seqlens(pieces, rows, seq_len, max_segments, last)
    return {
        "doc_index": doc_index.reshape(rows, width),
        "position_ids": positions.reshape(rows, width),
        "cu_seqlens": cu,
        "num_segments": count,
    }


@dataclass(frozen=True)
class CopyPlan:
    """How to fill a flat ``(rows * width)`` token buffer: corpus tokens ``[source[j],
    source[j] + count[j])`` (``count >= 1``, inside one document, so one shard) go to
    ``[target[j], ...)``; BOS / EOS ids to ``bos_at`` / ``eos_at``; the rest is padding."""

    source: IntArray
    target: IntArray
    count: IntArray
    bos_at: IntArray
    eos_at: IntArray


def copy_plan(
    pieces: Pieces, first: npt.NDArray[np.int64], *, width: int, bos: bool, eos: bool
) -> CopyPlan:
    """The `CopyPlan` of ``pieces`` (``first``: row 1 of the packing index), O(pieces): the
    tokens of the per-token ``raw_tokens`` (tests/order/packing_per_token.py)."""
    at = pieces.row * width + pieces.start  # flat position of each piece's first token
    b = int(bos)
    end = pieces.offset + pieces.count
    lo = np.maximum(pieces.offset, b)
    hi = np.minimum(end, pieces.length - int(eos))
    count = hi - lo
    keep = count > 0
    empty = np.empty(0, dtype=np.int64)
    return CopyPlan(
        source=(first[pieces.position] + lo - b)[keep],
        target=(at + lo - pieces.offset)[keep],
        count=count[keep],
        bos_at=at[pieces.offset == 0] if bos else empty,
        eos_at=(at + (end - 1 - pieces.offset))[end == pieces.length] if eos else empty,
    )
