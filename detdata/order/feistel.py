"""Order as a function: global position -> sample id, per index, O(1) memory.

Algorithm ``feistel-v1`` (exact definition; a re-implementation in any language
must reproduce the golden vectors in ``tests/golden/order_feistel_v1.json``):

Inputs: ``n`` (1 <= n < 2**62 samples), ``seed`` (0 <= seed < 2**64), global
position ``g >= 0``. All arithmetic is on unsigned 64-bit integers, wrapping.

1. ``epoch = g // n``, ``i = g % n``. If ``n == 1`` the answer is 0.
2. Round keys: ``K = blake3(b"detdata:feistel-v1" + u64le(seed) + u64le(epoch))``
   extended (XOF) to ``8 * ROUNDS`` bytes; key ``k_r`` is bytes ``[8r, 8r+8)``
   read little-endian. ``ROUNDS = 8``.
3. Domain: ``bits = max(2, bit_length(n - 1))``, ``lo_bits = bits // 2``,
   ``hi_bits = bits - lo_bits``. A value ``x < 2**bits`` is split into
   ``lo = x & (2**lo_bits - 1)`` and ``hi = x >> lo_bits``.
4. One encryption ``E(x)``: for ``r`` in ``0..ROUNDS-1``: if ``r`` is even,
   ``hi ^= F(k_r, lo) & (2**hi_bits - 1)``, else ``lo ^= F(k_r, hi) & (2**lo_bits - 1)``;
   then ``x = (hi << lo_bits) | lo``. Each round is invertible, so ``E`` is a
   bijection on ``[0, 2**bits)``.
5. ``F(k, v) = mix(v ^ k)`` with the splitmix64 finaliser:
   ``z ^= z >> 30; z *= 0xBF58476D1CE4E5B9; z ^= z >> 27; z *= 0x94D049BB133111EB; z ^= z >> 31``.
6. Cycle walking: ``y = E(i)``; while ``y >= n``: ``y = E(y)``. The result ``y``
   is the sample id. Because ``2**bits < 2n`` (for n > 2), the expected number
   of encryptions is below 2.

Keys depend on ``(algorithm, seed, epoch)`` through blake3 only: seed ``s`` at
epoch 1 and seed ``s + 1`` at epoch 0 are unrelated permutations.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterable
from typing import Final

import numpy as np
import numpy.typing as npt

from detdata.base.checks import check_count, check_seed
from detdata.base.keys import derive
from detdata.base.types import MAX_POSITION, IntArray
from detdata.order.positions import PositionOrder, check_positions_array

ALGORITHM: Final = "feistel-v1"
ROUNDS: Final = 8
MAX_SAMPLES: Final = MAX_POSITION
_M1: Final = np.uint64(0xBF58476D1CE4E5B9)
_M2: Final = np.uint64(0x94D049BB133111EB)
_CHUNK: Final = 65536  # positions per vectorised pass: keeps temporaries in cache

_KEY_PREFIX: Final = b"detdata:" + ALGORITHM.encode()
_KEY_BYTES: Final = 8 * ROUNDS
U64Array = npt.NDArray[np.uint64]


@functools.lru_cache(maxsize=4096)
def _key_material(seed: int, epoch: int) -> bytes:
    """The ``8 * ROUNDS`` blake3 XOF bytes holding the round keys of ``(seed, epoch)``."""
    return derive(_KEY_PREFIX, seed, epoch, length=_KEY_BYTES)


def key_rows(material: bytes, count: int) -> U64Array:
    """``count`` runs of ``8 * ROUNDS`` key bytes as a ``(ROUNDS, count)`` table: row ``r`` holds
    the round keys ``k_r`` (read little-endian)."""
    table = np.frombuffer(material, dtype="<u8").reshape(count, ROUNDS)
    return np.ascontiguousarray(table.T, dtype=np.uint64)  # native order, one row per round


def _key_table(seed: int, epochs: U64Array) -> U64Array:
    """Round keys of each of ``epochs`` as a ``(ROUNDS, len(epochs))`` table."""
    return key_rows(b"".join([_key_material(seed, e) for e in epochs.tolist()]), epochs.size)


def mix64(z: U64Array) -> U64Array:
    """splitmix64 finaliser, in place on ``z`` (which is returned)."""
    _mix_into(z, np.empty_like(z))
    return z


_S30: Final = np.uint64(30)
_S27: Final = np.uint64(27)
_S31: Final = np.uint64(31)


def _mix_into(z: U64Array, tmp: U64Array) -> None:
    """`mix64` on ``z`` in place, with ``tmp`` (same shape) as scratch: no allocations."""
    np.right_shift(z, _S30, out=tmp)
    z ^= tmp
    z *= _M1
    np.right_shift(z, _S27, out=tmp)
    z ^= tmp
    z *= _M2
    np.right_shift(z, _S31, out=tmp)
    z ^= tmp


#: A 64-bit word, or one per element of ``x`` (`_feistel`).
_Words = np.uint64 | U64Array
_ONE: Final = np.uint64(1)


def _feistel(
    x: U64Array, keys: U64Array, lo_bits: _Words, hi_bits: _Words, rounds: Iterable[int]
) -> U64Array:
    """The Feistel rounds ``rounds`` of step 4, in that order, on ``x``; ``keys[r]``, ``lo_bits``
    and ``hi_bits`` are scalars or shaped like ``x``. Each round is its own inverse (an xor)."""
    lo_mask = (_ONE << lo_bits) - _ONE
    hi_mask = (_ONE << hi_bits) - _ONE
    lo = x & lo_mask
    hi = x >> lo_bits
    z = np.empty_like(lo)
    tmp = np.empty_like(lo)
    for r in rounds:
        if r % 2 == 0:  # hi ^= F(k, lo) & hi_mask
            np.bitwise_xor(lo, keys[r], out=z)
            _mix_into(z, tmp)
            z &= hi_mask
            hi ^= z
        else:  # lo ^= F(k, hi) & lo_mask
            np.bitwise_xor(hi, keys[r], out=z)
            _mix_into(z, tmp)
            z &= lo_mask
            lo ^= z
    hi <<= lo_bits
    hi |= lo
    return hi


def domain_bits(n: int) -> int:
    """Number of bits of the Feistel domain used for ``n`` samples."""
    return max(2, (n - 1).bit_length())


#: Below this many samples `domain_bits_many` takes the exponent of a float64 (exact).
_EXACT_FLOAT: Final = 1 << 52


def domain_bits_many(n: npt.ArrayLike) -> npt.NDArray[np.uint64]:
    """`domain_bits` of each of ``n`` (each ``>= 1``), vectorised."""
    sizes = np.asarray(n, dtype=np.int64)
    if sizes.size and int(sizes.max()) < _EXACT_FLOAT:  # frexp(x)[1] == bit_length(x)
        bits = np.frexp((sizes - 1).astype(np.float64))[1]
        return np.maximum(bits, 2).astype(np.uint64)
    return np.array([domain_bits(int(m)) for m in sizes.tolist()], dtype=np.uint64)


def permute(indices: U64Array, n: int, seed: int, epoch: int) -> U64Array:
    """Apply the epoch permutation to ``indices`` (all ``< n``); vectorised, cycle-walking."""
    return cycle_walk(
        encrypt_many, indices, n, _key_table(seed, np.array([epoch], dtype=np.uint64))
    )


def epoch_keys(seed: int, epochs: U64Array) -> U64Array:
    """The round keys of each element's epoch (1-D ``epochs``) as ``(ROUNDS, size)``, derived
    once per distinct epoch; ``(ROUNDS, 1)``, broadcast to all, when they share one epoch."""
    if epochs.size and bool((epochs == epochs[0]).all()):
        return _key_table(seed, epochs[:1])
    unique, inverse = np.unique(epochs, return_inverse=True)
    return np.take(_key_table(seed, unique), inverse.reshape(-1), axis=1)


def permute_epochs(indices: U64Array, epochs: U64Array, n: int, seed: int) -> U64Array:
    """`permute` of each ``indices[j]`` under its own ``epochs[j]`` (1-D, same length), in one
    set of vectorised Feistel passes."""
    return cycle_walk(encrypt_many, indices, n, epoch_keys(seed, epochs))


# ------------------------------------------------------------------ per-element domains
def encrypt_many(x: U64Array, keys: U64Array, lo_bits: _Words, hi_bits: _Words) -> U64Array:
    """``E(x)`` (step 4) with per-element round keys ``keys[r]`` and domain split (each an
    array shaped like ``x``, or one value broadcast to all); allocates its temporaries."""
    return _feistel(x, keys, lo_bits, hi_bits, range(ROUNDS))


def decrypt_many(y: U64Array, keys: U64Array, lo_bits: _Words, hi_bits: _Words) -> U64Array:
    """The inverse of `encrypt_many`: the rounds undone in reverse order."""
    return _feistel(y, keys, lo_bits, hi_bits, reversed(range(ROUNDS)))


#: `encrypt_many` or `decrypt_many`.
Step = Callable[[U64Array, U64Array, _Words, _Words], U64Array]


def cycle_walk(step: Step, x: U64Array, n: int, keys: U64Array) -> U64Array:
    """Step 6 on ``[0, n)``: ``step`` (``E``, or ``D`` to invert) applied until each value is
    ``< n``, under ``keys``: ``(ROUNDS,)`` for all elements, or ``(ROUNDS, size)``, one column
    per element. Never writes ``x``; ``n == 1`` gives 0 without walking. Walking back with
    ``D`` from ``y`` stops at ``x``: the forward walk passes only values ``>= n`` between."""
    if n == 1:
        return np.zeros_like(x)
    m, bits = np.array([n], dtype=np.uint64), np.array([domain_bits(n)], dtype=np.uint64)
    return permute_many(x, m, keys[:, None] if keys.ndim == 1 else keys, bits, step=step)


def _at(values: U64Array, index: IntArray) -> U64Array:
    """``values[..., index]``, or ``values`` itself when it is one column broadcast to all."""
    return values if values.shape[-1] == 1 else values[..., index]


def permute_many(
    x: U64Array, m: U64Array, keys: U64Array, bits: U64Array, *, step: Step = encrypt_many
) -> U64Array:
    """Step 6 per element: the bijection on ``[0, m[e])`` under ``keys[:, e]`` of ``x[e] < m[e]``
    (``bits[e] = domain_bits(m[e])``; its inverse with ``step=decrypt_many``). ``m``, ``bits``
    (``(1,)``) and ``keys`` (``(ROUNDS, 1)``) may be one value for all."""
    lo_bits = bits // np.uint64(2)
    hi_bits = bits - lo_bits
    out = step(x, keys, lo_bits, hi_bits)
    pending = np.flatnonzero(out >= m)
    while pending.size:
        walked = step(
            out[pending], _at(keys, pending), _at(lo_bits, pending), _at(hi_bits, pending)
        )
        out[pending] = walked
        pending = pending[walked >= _at(m, pending)]
    return out


def _distinct_pairs(
    a: npt.NDArray[np.uint64], b: npt.NDArray[np.uint64]
) -> tuple[npt.NDArray[np.uint64], npt.NDArray[np.uint64], npt.NDArray[np.intp]]:
    """The distinct ``(a[e], b[e])`` pairs (two arrays) and each element's pair index."""
    order = np.lexsort((b, a))
    sa, sb = a[order], b[order]
    new = np.ones(order.size, dtype=bool)
    new[1:] = (sa[1:] != sa[:-1]) | (sb[1:] != sb[:-1])
    inverse = np.empty(order.size, dtype=np.intp)
    inverse[order] = np.cumsum(new) - 1
    return sa[new], sb[new], inverse


def permute_sources(
    indices: npt.NDArray[np.uint64], n: npt.NDArray[np.uint64], seeds: npt.NDArray[np.uint64]
) -> npt.NDArray[np.uint64]:
    """``GlobalOrder(n[e], seeds[e]).ids(indices[e])`` for each element ``e``, the elements of
    many orders (a mixture's sources) in one vectorised pass; keys derived once per distinct
    ``(seed, epoch)``."""
    if indices.size > _CHUNK:  # bounded temporaries (keys: 64 bytes per element)
        out = np.empty_like(indices)
        for a in range(0, indices.size, _CHUNK):
            part = slice(a, a + _CHUNK)
            out[part] = permute_sources(indices[part], n[part], seeds[part])
        return out
    epochs, local = np.divmod(indices, n)
    pair_seeds, pair_epochs, inverse = _distinct_pairs(seeds, epochs)
    material = b"".join(map(_key_material, pair_seeds.tolist(), pair_epochs.tolist()))
    keys = key_rows(material, pair_seeds.size)[:, inverse]
    sizes, which = np.unique(n, return_inverse=True)
    return permute_many(local, n, keys, domain_bits_many(sizes)[which.reshape(-1)])


class GlobalOrder(PositionOrder):
    """Global position -> sample id for ``num_samples`` samples under ``seed`` (``feistel-v1``,
    module doc); nothing of size ``n`` is stored, any position costs the same."""

    algorithm: Final = ALGORITHM

    def __init__(self, num_samples: int, seed: int) -> None:
        self.num_samples = check_count(num_samples, "num_samples")
        self.seed = check_seed(seed)

    def __repr__(self) -> str:
        return (
            f"GlobalOrder(num_samples={self.num_samples}, seed={self.seed}, "
            f"algorithm={ALGORITHM!r})"
        )

    def _identity(self) -> tuple[object, ...]:
        return (ALGORITHM, self.num_samples, self.seed)

    def ids(self, positions: npt.ArrayLike) -> IntArray:
        pos = check_positions_array(positions).astype(np.uint64, copy=False)
        epochs, local = np.divmod(pos, np.uint64(self.num_samples))
        out = np.empty(pos.shape, dtype=np.uint64)
        flat_e, flat_l, flat_o = epochs.reshape(-1), local.reshape(-1), out.reshape(-1)
        for start in range(0, flat_o.size, _CHUNK):
            stop = start + _CHUNK
            flat_o[start:stop] = permute_epochs(
                flat_l[start:stop], flat_e[start:stop], self.num_samples, self.seed
            )
        return out.view(np.int64)  # ids < n < 2**62: the same bits, no copy
