"""Inverting the orders: sample -> the global positions that deliver it, O(1) per epoch.

``feistel-v1``: sample ``x`` sits at position ``e * n + D*(x)`` of every epoch ``e``, with
``D*`` the decryption with backward cycle walking (`detdata.order.feistel.cycle_walk` with ``D``).

``mixture-v1``: a source's sample at index ``i`` of its own stream is at the unique global
position ``g`` with ``consumed(g)[s] == i`` and ``assign(g) == (s, i)``;
`MixtureSchedule.consumed` is non-decreasing in ``g``, so ``g`` is found by binary search
(`position_of_index`), or first in a window around its estimate (`mixture_positions_of`).
Only the schedule's public functions are used.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Final

import numpy as np

from detdata.base.checks import check_count
from detdata.base.types import MAX_POSITION, IntArray
from detdata.order.feistel import GlobalOrder, U64Array, cycle_walk, decrypt_many, epoch_keys
from detdata.order.mixing import MixtureSchedule
from detdata.order.positions import reverse_epochs

#: A source's count of samples read by positions ``[0, p)``.
Consumed = Callable[[int], int]
_MAX_EPOCHS: Final = 1 << 24  # a guard: a reverse lookup over more epochs is refused
_CHUNK: Final = 1 << 16  # epochs per vectorised pass


def unpermute_epochs(ids: U64Array, epochs: U64Array, n: int, seed: int) -> U64Array:
    """The local indices ``i`` with ``permute(i, n, seed, epochs[j]) == ids[j]`` (1-D, same
    length, all ``< n``), vectorised over epochs."""
    return cycle_walk(decrypt_many, ids, n, epoch_keys(seed, epochs))


def positions_of(order: GlobalOrder, sample_id: int, *, until: int, start: int = 0) -> IntArray:
    """Every global position in ``[start, until)`` where ``order`` delivers ``sample_id``,
    ascending: exactly one per epoch, each found by one inversion (O(1) per epoch,
    vectorised over epochs)."""
    n = order.num_samples
    x, lo, hi, epoch_range = reverse_epochs(n, sample_id, start, until, most=_MAX_EPOCHS)
    if not epoch_range:
        return np.empty(0, dtype=np.int64)
    parts = []
    for a in range(epoch_range.start, epoch_range.stop, _CHUNK):
        epochs = np.arange(a, min(a + _CHUNK, epoch_range.stop), dtype=np.uint64)
        local = unpermute_epochs(np.full(epochs.size, x, dtype=np.uint64), epochs, n, order.seed)
        parts.append((epochs * np.uint64(n) + local).astype(np.int64))
    found = np.concatenate(parts)
    return found[(found >= lo) & (found < hi)]


def position_of_index(consumed: Consumed, index: int, *, until: int, after: int = 0) -> int | None:
    """The position ``g`` in ``[after, until)`` at which a source reads index ``index`` of its
    stream, or None: binary search on `Consumed` (non-decreasing, +1 exactly at the source's
    positions); ``after`` must be at or before the answer (``index`` itself always is)."""
    hi = check_count(until, "until", minimum=0, maximum=MAX_POSITION)
    lo = check_count(after, "after", minimum=0, maximum=MAX_POSITION)
    if hi <= lo or consumed(hi) <= index or consumed(lo) > index:
        return None
    # invariant: consumed(lo) <= index < consumed(hi)
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if consumed(mid) <= index:
            lo = mid
        else:
            hi = mid
    return lo


def mixture_positions_of(
    schedule: MixtureSchedule, source: int, order: GlobalOrder, sample_id: int, *, until: int
) -> IntArray:
    """Every global position ``< until`` at which a `MixtureSchedule` delivers sample
    ``sample_id`` of source index ``source`` (whose own order is ``order``), ascending.

    Per epoch of the source: ``order`` inverted gives the index in its stream, searched in a
    window around its estimate (the bound of `detdata.order.mixing`), all windows in one
    `MixtureSchedule.assign`; one not found (never, if the bound holds) falls back to
    `position_of_index`. Cost: O(sources + depth / p_s) per epoch of the source.
    """
    hi = check_count(until, "until", minimum=0, maximum=MAX_POSITION)
    if hi == 0:
        return np.empty(0, dtype=np.int64)
    reached = schedule.consumed(hi)[source]  # source indices [0, reached) are read before until
    indices = positions_of(order, sample_id, until=reached)
    if not indices.size:
        return indices
    windows = _windows(schedule, source, indices, hi)
    src, index = schedule.assign(windows)
    hit = (src == source) & np.isin(index, indices)
    found = dict(zip(index[hit].tolist(), windows[hit].tolist(), strict=True))
    out = []
    for i in indices.tolist():
        g = found.get(i)
        if g is None:
            g = position_of_index(lambda p: schedule.consumed(p)[source], i, until=hi, after=i)
        if g is not None:
            out.append(g)
    return np.array(sorted(out), dtype=np.int64)


def _windows(schedule: MixtureSchedule, source: int, indices: IntArray, until: int) -> IntArray:
    """Candidate positions (unique, sorted, ``< until``) around each index's estimated position."""
    depth = max(1, (len(schedule.phases[0].weights) - 1).bit_length())
    starts = [p.start for p in schedule.phases]
    offsets = np.array([p.offsets[source] for p in schedule.phases], dtype=np.int64)
    phase_of = np.searchsorted(offsets, indices, side="right") - 1
    parts = []
    for k in np.unique(phase_of).tolist():
        # an index past a phase whose weight is zero belongs to the last phase that reads it
        phase = schedule.phases[k]
        w, total = phase.weights[source], sum(phase.weights)
        sel = indices[phase_of == k]
        if w == 0:
            parts.append(sel)  # left to the exact search
            continue
        local = sel - offsets[k]
        centre = phase.start + (local * total) // w
        radius = ((depth + 5) * total) // w + 16
        end = starts[k + 1] if k + 1 < len(starts) else until
        lo = np.maximum(centre - radius, phase.start)
        hi = np.minimum(centre + radius + 1, min(end, until))
        lengths = np.maximum(hi - lo, 0)
        parts.append(np.repeat(lo, lengths) + _ranges(lengths))
    return np.unique(np.concatenate(parts))


def _ranges(lengths: IntArray) -> IntArray:
    """``concatenate([arange(n) for n in lengths])`` without the loop."""
    total = int(lengths.sum())
    firsts = np.repeat(np.cumsum(lengths) - lengths, lengths)
    return np.arange(total, dtype=np.int64) - firsts
