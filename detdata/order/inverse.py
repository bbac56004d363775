"""Inverting the orders: sample -> the global positions that deliver it, O(1) per epoch.

``feistel-v1`` (`detdata.order.feistel`) maps local index ``i`` of epoch ``e`` to
``y = E(i)`` cycle-walked into ``[0, n)``. Each Feistel round is its own inverse
given the other half, so the decryption ``D`` runs the rounds backwards
(round ``r`` from ``ROUNDS - 1`` down to 0, with the same keys and halves as the
encryption). Cycle walking inverts in the opposite direction: from ``y``,
``x = D(y)``; while ``x >= n``: ``x = D(x)``. (The forward walk
``i -> E(i) -> ... -> y`` passes only values ``>= n`` between ``i`` and ``y``;
walking it backwards from ``y`` stops at the first value ``< n``, which is ``i``.)
So sample ``x`` sits at position ``e * n + D*(x)`` of every epoch ``e``: one
inversion per epoch, nothing of size ``n``.

``mixture-v1`` (`detdata.order.mixing`): a source's sample at index ``i`` of its
own stream is at the unique global position ``g`` with ``consumed(g)[s] == i``
and ``assign(g) == (s, i)``. `MixtureSchedule.consumed` is non-decreasing in ``g``, so
``g`` is found by binary search over positions: O(log P) calls of ``consumed``
(each O(phases + sources + 16)) per source epoch. This uses the public functions
of the schedule only, so it stays correct whatever their internals become.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Final

import numpy as np
import numpy.typing as npt

from detdata.base.checks import check_count
from detdata.base.errors import ConfigError
from detdata.base.types import MAX_POSITION, IntArray
from detdata.order.feistel import (
    ROUNDS,
    GlobalOrder,
    _key_table,
    domain_bits,
    mix64,
    round_keys,
)
from detdata.order.mixing import MixtureSchedule

#: A source's count of samples read by positions ``[0, p)``.
Consumed = Callable[[int], int]
KeyRows = npt.NDArray[np.uint64]
_MAX_EPOCHS: Final = 1 << 24  # a guard: a reverse lookup over more epochs is refused
_CHUNK: Final = 1 << 16  # epochs per vectorised pass


def _decrypt(y: npt.NDArray[np.uint64], keys: KeyRows, bits: int) -> npt.NDArray[np.uint64]:
    """``D(y)``: the ``feistel-v1`` rounds backwards (``E(D(y)) == y``); ``keys[r]`` is round
    ``r``'s key, a scalar or one per element of ``y``."""
    lo_bits = bits // 2
    lo_mask = np.uint64((1 << lo_bits) - 1)
    hi_mask = np.uint64((1 << (bits - lo_bits)) - 1)
    shift = np.uint64(lo_bits)
    lo = y & lo_mask
    hi = y >> shift
    for r in range(ROUNDS - 1, -1, -1):
        if r % 2 == 0:
            hi ^= mix64(lo ^ keys[r]) & hi_mask
        else:
            lo ^= mix64(hi ^ keys[r]) & lo_mask
    return (hi << shift) | lo


def _walk_back(
    y: npt.NDArray[np.uint64], keys: npt.NDArray[np.uint64], n: int
) -> npt.NDArray[np.uint64]:
    """Inverse cycle walking: ``D`` until each value is ``< n`` (``keys``: ``(ROUNDS, size)``)."""
    bits = domain_bits(n)
    out = _decrypt(y, keys, bits)
    limit = np.uint64(n)
    pending = np.flatnonzero(out >= limit)
    while pending.size:
        walked = _decrypt(out[pending], keys[:, pending], bits)
        out[pending] = walked
        pending = pending[walked >= limit]
    return out


def unpermute(ids: npt.NDArray[np.uint64], n: int, seed: int, epoch: int) -> npt.NDArray[np.uint64]:
    """The local indices ``i`` with ``permute(i, n, seed, epoch) == ids`` (all ``< n``)."""
    if n == 1:
        return np.zeros_like(ids)
    keys = np.array(round_keys(seed, epoch), dtype=np.uint64)[:, None]
    return _walk_back(ids, np.repeat(keys, ids.size, axis=1), n)


def unpermute_epochs(
    ids: npt.NDArray[np.uint64], epochs: npt.NDArray[np.uint64], n: int, seed: int
) -> npt.NDArray[np.uint64]:
    """`unpermute` of each ``ids[j]`` under its own ``epochs[j]`` (1-D, same length), vectorised."""
    if n == 1:
        return np.zeros_like(ids)
    unique, inverse = np.unique(epochs, return_inverse=True)
    keys = np.take(_key_table(seed, unique), inverse.reshape(-1), axis=1)  # (ROUNDS, size)
    return _walk_back(ids, keys, n)


def positions_of(order: GlobalOrder, sample_id: int, *, until: int, start: int = 0) -> IntArray:
    """Every global position in ``[start, until)`` where ``order`` delivers ``sample_id``,
    ascending: exactly one per epoch, each found by one inversion (O(1) per epoch,
    vectorised over epochs)."""
    n = order.num_samples
    x = check_count(sample_id, "sample_id", minimum=0, maximum=n - 1)
    lo, hi = _check_range(start, until)
    if hi <= lo:
        return np.empty(0, dtype=np.int64)
    first, last = lo // n, (hi - 1) // n
    _check_epochs(last - first + 1)
    parts = []
    for a in range(first, last + 1, _CHUNK):
        epochs = np.arange(a, min(a + _CHUNK, last + 1), dtype=np.uint64)
        local = unpermute_epochs(np.full(epochs.size, x, dtype=np.uint64), epochs, n, order.seed)
        parts.append((epochs * np.uint64(n) + local).astype(np.int64))
    found = np.concatenate(parts)
    return found[(found >= lo) & (found < hi)]


def position_of_index(consumed: Consumed, index: int, *, until: int, after: int = 0) -> int | None:
    """The global position ``g < until`` at which a source reads index ``index`` of its own
    stream, or None if it is not reached before ``until``. ``consumed(p)`` is the source's
    count of samples read by positions ``[0, p)`` (non-decreasing, +1 exactly at the
    source's positions, e.g. from `MixtureSchedule.consumed`): binary search over
    ``[after, until)``, O(log(until - after)) calls (``after``: a position known to be
    at or before the answer, e.g. ``index`` itself or the previous epoch's answer + 1)."""
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

    Per epoch of the source's own stream: one inversion of ``order`` gives the index ``i``
    in the source's stream; its position is searched in a window around the estimate
    from the phase's proportion (``|count_s(T) - p_s T| < depth + 4`` within a phase,
    the bound of `detdata.order.mixing`), all windows in one vectorised
    `MixtureSchedule.assign`. An index not found in its window (never, if the bound holds) falls
    back to the exact binary search `position_of_index`. Cost: O(sources + depth / p_s)
    per epoch of the source.
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


def _check_range(start: int, until: int) -> tuple[int, int]:
    lo = check_count(start, "start", minimum=0, maximum=MAX_POSITION)
    hi = check_count(until, "until", minimum=0, maximum=MAX_POSITION)
    return lo, hi


def _check_epochs(count: int) -> None:
    if count > _MAX_EPOCHS:
        raise ConfigError(
            f"a reverse lookup over {count} epochs is refused (more than {_MAX_EPOCHS}); "
            "hint: ask over a shorter range of positions"
        )
