"""A locality-aware order: shards shuffled, then samples shuffled inside windows of shards.

Algorithm ``locality-v1`` (exact definition; a re-implementation in any language must
reproduce the golden vectors in ``tests/golden/order_locality_v1.json``):

Inputs: the shard sizes ``c_0 .. c_{S-1}`` (samples per shard in dataset order, each
``>= 0``; sample ids of shard ``s`` are ``[start_s, start_s + c_s)`` with ``start_s =
c_0 + ... + c_{s-1}``), ``n = sum c_s`` (``1 <= n < 2**62``), the window ``k >= 1``
(shards per window), ``seed`` (``0 <= seed < 2**64``) and the global position ``g >= 0``.

1. ``epoch = g // n``, ``i = g % n``.
2. ``P(m, K)`` is a keyed bijection on ``[0, m)``: the `feistel-v1` network (rounds,
   ``F``, domain split and cycle walking exactly as in `detdata.order.feistel`, steps
   3-6, with ``m`` for ``n``) under the 8 round keys read little-endian from the 64 bytes
   ``K``. ``P(1, K)(0) = 0``.
3. Shards: ``sigma(j) = P(S, K_shards)(j)`` with ``K_shards = blake3(b"detdata:locality-v1:
   shards" + u64le(seed) + u64le(epoch))`` (XOF, 64 bytes): slot ``j`` of the epoch holds
   shard ``sigma(j)``. ``O_0 = 0``, ``O_{j+1} = O_j + c_{sigma(j)}``.
4. Windows: window ``w`` is the slots ``[w*k, min(w*k + k, S))``, covering the epoch
   positions ``[O_{wk}, O_{min(wk+k, S)})``, ``m_w`` of them. ``i`` lies in the window
   ``w`` with ``O_{wk} <= i < O_{min(wk+k,S)}``.
5. Inside the window: ``q = O_{wk} + P(m_w, K_w)(i - O_{wk})`` with ``K_w =
   blake3(b"detdata:locality-v1:window" + u64le(seed) + u64le(epoch) + u64le(w))``.
6. ``q`` lies in slot ``j`` with ``O_j <= q < O_{j+1}`` (a shard of 0 samples holds no
   position); the sample id is ``start_{sigma(j)} + q - O_j``.

So each epoch is a bijection on ``[0, n)``; the ``m_w`` consecutive positions of a window
read only its ``k`` shards (in a random order of samples), and windows come in a random
order of shards. ``k >= S`` is one window: a full shuffle (not the `feistel-v1` one). Keys
depend on ``(algorithm, seed, epoch[, window])`` through blake3 only.

Cost: O(S) once per epoch touched (cached for a few epochs), then O(1) per position; nothing
of size ``n`` is stored. Step 5 runs as `permute_many` or, when cheaper (`_tables_pay`),
`_walk_tables`: the same values.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Final

import numpy as np
import numpy.typing as npt

from detdata.base.checks import check_count, check_seed
from detdata.base.errors import ConfigError
from detdata.base.keys import derive, derive_many
from detdata.base.types import MAX_POSITION, IntArray
from detdata.order.feistel import (
    ROUNDS,
    cycle_walk,
    decrypt_many,
    domain_bits_many,
    encrypt_many,
    key_rows,
    permute_many,
)
from detdata.order.memo import LruCache
from detdata.order.positions import PositionOrder, check_positions_array, reverse_epochs

ALGORITHM: Final = "locality-v1"
_SHARD_TAG: Final = b"detdata:locality-v1:shards"
_WINDOW_TAG: Final = b"detdata:locality-v1:window"
_KEY_BYTES: Final = 8 * ROUNDS
_EPOCHS_KEPT: Final = 4  # epoch tables cached per order (O(S) each)
_MAX_EPOCHS_INVERTED: Final = 100_000  # per positions_of call (each costs O(shards))
U64Array = npt.NDArray[np.uint64]


@functools.lru_cache(maxsize=1024)
def _shard_keys(seed: int, epoch: int) -> U64Array:
    return np.frombuffer(derive(_SHARD_TAG, seed, epoch, length=_KEY_BYTES), dtype="<u8").astype(
        np.uint64
    )


def _window_keys(seed: int, epoch: int, windows: Sequence[int]) -> U64Array:
    """Round keys of each of ``windows`` as ``(ROUNDS, len(windows))``."""
    material = derive_many(_WINDOW_TAG, seed, epoch, last=windows, length=_KEY_BYTES)
    return key_rows(material, len(windows))


@dataclass(frozen=True, kw_only=True)
class _Epoch:
    """The O(S) tables of one epoch: window starts, slot starts, and per slot the id offset."""

    window_starts: IntArray  # O_{wk} for w in [0, W], with O_S = n last
    slot_starts: IntArray  # O_j for j in [0, S]
    id_offset: IntArray  # start_{sigma(j)} - O_j per slot j
    slot_of: IntArray  # sigma^-1: the slot of each shard


def check_shard_sizes(sizes: object) -> tuple[int, ...]:
    """``sizes`` as a tuple of ints ``>= 0`` with ``1 <= sum < 2**62``, else `ConfigError`."""
    if isinstance(sizes, (str, bytes)) or not isinstance(sizes, (Sequence, np.ndarray)):
        raise ConfigError(
            f"shard_sizes must be a sequence of sample counts per shard, got {sizes!r:.80}"
        )
    arr = np.asarray(sizes) if len(sizes) else np.zeros(0, dtype=np.int64)
    if arr.ndim == 1 and arr.dtype.kind in "iu" and (not arr.size or int(arr.min()) >= 0):
        out = tuple(arr.tolist())  # the common case, vectorised
    else:  # find the culprit
        out = tuple(
            check_count(c, f"shard_sizes[{i}]", minimum=0, maximum=MAX_POSITION - 1)
            for i, c in enumerate(sizes)
        )
    total = sum(out)
    if not out or total == 0:
        raise ConfigError(
            f"shard_sizes {list(out)[:8]} hold no samples; the order needs at least one sample"
        )
    if total >= MAX_POSITION:
        raise ConfigError(f"shard_sizes sum to {total} >= 2**62 samples")
    return out


#: Cost model of `_tables_pay`, in units of one element of one encryption pass: the fixed
#: cost of a pass (tens of numpy calls) and of one table-lookup step of cycle walking.
_PASS_COST: Final = 1500.0
_LOOKUP_COST: Final = 0.15


def _tables_pay(size: IntArray, bits: U64Array, count: int) -> bool:
    """Whether `_walk_tables` is cheaper than `permute_many` for ``count`` positions in windows
    of ``size`` samples and domains of ``2**bits`` (both give the same values)."""
    domain = np.left_shift(1, bits.astype(np.int64))
    walk = float(((domain - size) / domain).max())  # chance that one encryption walks on
    passes = 1.0 + math.log(max(count, 2)) / -math.log(max(walk, 1e-9))
    per_element = count / (1.0 - walk) + _PASS_COST * passes
    tables = float(domain.sum()) + _PASS_COST + count * _LOOKUP_COST * passes
    return tables < per_element


#: `WindowedOrder._in_epoch` finds the slots by a table over its windows' positions (not a
#: binary search per position) when they are at most this many times the request's.
_SLOT_TABLE_FACTOR: Final = 4


def _starts(counts: IntArray) -> IntArray:
    """Exclusive prefix sums of ``counts``: where each of them starts when concatenated."""
    out = np.zeros(counts.size, dtype=np.int64)
    np.cumsum(counts[:-1], out=out[1:])
    return out


def _walk_tables(
    offsets: IntArray, size: IntArray, keys: U64Array, bits: U64Array, inverse: IntArray
) -> IntArray:
    """``P(size[w], keys[:, w])(offsets[e])`` for ``w = inverse[e]``, as `permute_many`: each
    window's ``E`` applied once to its whole domain ``[0, 2**bits[w])`` (one 2-D pass per
    domain size), then cycle walking as lookups in those tables."""
    starts = np.empty(size.size, dtype=np.int64)
    parts = []
    at = 0
    for b in np.unique(bits).tolist():
        rows = np.flatnonzero(bits == b)
        width = 1 << b
        values = np.broadcast_to(np.arange(width, dtype=np.uint64), (rows.size, width))
        lo_bits = np.uint64(b // 2)
        hi_bits = np.uint64(b - b // 2)
        row_keys = keys[:, rows, None]  # (ROUNDS, rows, 1): one key per row
        parts.append(encrypt_many(values, row_keys, lo_bits, hi_bits).reshape(-1))
        starts[rows] = at + width * np.arange(rows.size, dtype=np.int64)
        at += width * rows.size
    table = (parts[0] if len(parts) == 1 else np.concatenate(parts)).astype(np.int64)
    base = starts[inverse]
    limit = size[inverse]
    out: IntArray = table[base + offsets]
    pending = np.flatnonzero(out >= limit)
    while pending.size:
        walked = table[base[pending] + out[pending]]
        out[pending] = walked
        pending = pending[walked >= limit[pending]]
    return out


class WindowedOrder(PositionOrder):
    """Global position -> sample id under ``locality-v1`` (module doc). Thread-safe; pickles
    without its caches."""

    algorithm: Final = ALGORITHM

    def __init__(self, shard_sizes: Sequence[int], seed: int, *, window_shards: int) -> None:
        self.shard_sizes = check_shard_sizes(shard_sizes)
        self.seed = check_seed(seed)
        self.window_shards = check_count(window_shards, "window_shards", maximum=(1 << 31) - 1)
        self.num_samples = sum(self.shard_sizes)
        sizes = np.asarray(self.shard_sizes, dtype=np.int64)
        self._starts = _starts(sizes)
        self._sizes = sizes
        self._epochs: LruCache[int, _Epoch] = LruCache(_EPOCHS_KEPT)

    def __repr__(self) -> str:
        return (
            f"WindowedOrder(shards={len(self.shard_sizes)}, num_samples={self.num_samples}, "
            f"seed={self.seed}, window_shards={self.window_shards}, algorithm={ALGORITHM!r})"
        )

    def _identity(self) -> tuple[object, ...]:
        return (ALGORITHM, self.shard_sizes, self.seed, self.window_shards)

    # ------------------------------------------------------------------ epochs
    def shard_order(self, epoch: int) -> IntArray:
        """``sigma``: the shard at each slot of ``epoch`` (step 3), a new array."""
        slots = np.arange(len(self.shard_sizes), dtype=np.uint64)
        keys = _shard_keys(self.seed, epoch)
        return cycle_walk(encrypt_many, slots, slots.size, keys).astype(np.int64)

    def _epoch(self, epoch: int) -> _Epoch:
        return self._epochs.get(epoch, self._epoch_tables)

    def _epoch_tables(self, epoch: int) -> _Epoch:
        sigma = self.shard_order(epoch)
        slot_starts = np.zeros(sigma.size + 1, dtype=np.int64)
        np.cumsum(self._sizes[sigma], out=slot_starts[1:])
        slot_of = np.empty_like(sigma)
        slot_of[sigma] = np.arange(sigma.size, dtype=np.int64)
        return _Epoch(
            window_starts=np.append(slot_starts[: -1 : self.window_shards], slot_starts[-1]),
            slot_starts=slot_starts,
            id_offset=self._starts[sigma] - slot_starts[:-1],
            slot_of=slot_of,
        )

    # ------------------------------------------------------------------ positions
    def ids(self, positions: npt.ArrayLike) -> IntArray:
        pos = check_positions_array(positions)
        flat = pos.astype(np.uint64, copy=False).reshape(-1)
        epochs, local = np.divmod(flat, np.uint64(self.num_samples))
        local = local.astype(np.int64)
        out = np.empty(flat.size, dtype=np.int64)
        if flat.size and bool((epochs == epochs[0]).all()):
            out[:] = self._in_epoch(int(epochs[0]), local)
        else:
            for e in np.unique(epochs).tolist():
                sel = np.flatnonzero(epochs == e)
                out[sel] = self._in_epoch(int(e), local[sel])
        return out.reshape(pos.shape)

    def _in_epoch(self, epoch: int, local: IntArray) -> IntArray:
        """Steps 4-6 for epoch-local positions ``local`` (1-D) of ``epoch``."""
        table = self._epoch(epoch)
        window = np.searchsorted(table.window_starts, local, side="right") - 1
        unique, inverse = np.unique(window, return_inverse=True)
        inverse = inverse.reshape(-1)
        first = table.window_starts[unique]
        size = table.window_starts[unique + 1] - first
        bits = domain_bits_many(size)
        keys = _window_keys(self.seed, epoch, unique.tolist())
        if _tables_pay(size, bits, local.size):
            shuffled = _walk_tables(local - first[inverse], size, keys, bits, inverse)
        else:
            m, b, k = size.astype(np.uint64), bits, keys
            if unique.size > 1:  # else one window: its key, size and bits broadcast to all
                k, m, b = keys[:, inverse], m[inverse], bits[inverse]
            inside = (local - first[inverse]).astype(np.uint64)
            shuffled = permute_many(inside, m, k, b).astype(np.int64)
        q = first[inverse] + shuffled
        if int(size.sum()) <= _SLOT_TABLE_FACTOR * local.size:
            offsets = self._slot_offsets(table, unique, size)
            result: IntArray = q + offsets[_starts(size)[inverse] + shuffled]
        else:
            slot = np.searchsorted(table.slot_starts, q, side="right") - 1
            result = q + table.id_offset[slot]
        return result

    def _slot_offsets(self, table: _Epoch, windows: IntArray, size: IntArray) -> IntArray:
        """Step 6 as a table: for each position of each of ``windows`` (their positions
        concatenated, ``size[w]`` each), ``id_offset`` of the slot holding it (the same
        values as a binary search over ``slot_starts``, in one pass over the positions)."""
        k = self.window_shards
        lo = windows * k
        count = np.minimum(lo + k, len(self.shard_sizes)) - lo  # slots per window
        slots = np.arange(int(count.sum()), dtype=np.int64) + np.repeat(lo - _starts(count), count)
        held = table.slot_starts[slots + 1] - table.slot_starts[slots]  # positions per slot
        return np.repeat(table.id_offset[slots], held)

    # ------------------------------------------------------------------ the reverse
    def positions_of(self, sample_id: int, *, until: int, start: int = 0) -> IntArray:
        """Every global position in ``[start, until)`` where ``sample_id`` is delivered,
        ascending (one per epoch): steps 6-3 undone, O(shards) per epoch (its tables)."""
        n = self.num_samples
        x, lo, hi, epochs = reverse_epochs(n, sample_id, start, until, most=_MAX_EPOCHS_INVERTED)
        shard = int(np.searchsorted(self._starts, x, side="right")) - 1
        offset = x - int(self._starts[shard])
        out = []
        for epoch in epochs:
            table = self._epoch(epoch)
            slot = int(table.slot_of[shard])
            w = slot // self.window_shards
            first = int(table.window_starts[w])
            size = int(table.window_starts[w + 1]) - first
            q = int(table.slot_starts[slot]) + offset - first
            keys = _window_keys(self.seed, epoch, [w])
            inside = cycle_walk(decrypt_many, np.array([q], dtype=np.uint64), size, keys[:, 0])
            g = epoch * n + first + int(inside[0])
            if lo <= g < hi:
                out.append(g)
        return np.asarray(out, dtype=np.int64)
