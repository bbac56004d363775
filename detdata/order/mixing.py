"""The ``mixture-v1`` algorithm as pure functions: global position -> source, index in source.

Global position ``g`` -> ``(source index, index in that source's own stream)``,
computed per position with nothing of size ``n`` stored; `detdata.Mixture`
(`detdata.datasets.mixture`) turns it into a `Stream` over datasets. Exact
definition (a re-implementation in any language must reproduce the golden
vectors in ``tests/golden/mixture_v1.json``):

**Sources.** Sources are named; ``source index`` ``s`` is the position of the
name in the names sorted by Unicode code point (Python ``sorted``). Source ``s``
reads its samples in its own `GlobalOrder` (``feistel-v1``) over its
``num_samples`` under the derived seed
``u64le⁻¹(blake3(b"detdata:source-seed-v1" + u64le(seed) + utf8(name))[:8])``.
Index ``i`` in a source's stream is sample ``GlobalOrder(n_s, seed_s).ids(i)``:
past ``n_s`` the source simply continues into its next epoch, so the source's
epoch is ``i // n_s`` and ``consumed(P)[name] // n_s`` epochs of it are complete
after ``P`` positions. A source's order depends on the root seed and its name
only: adding, removing or reweighting other sources never changes it.

**Weights.** Each weight (int, `fractions.Fraction`, `decimal.Decimal`, str as
accepted by ``Fraction(str)`` such as ``"0.25"`` or ``"1/3"``, or float read as
``Fraction(repr(w))``, i.e. its shortest decimal) becomes an exact rational;
they are scaled by the lcm of their denominators and divided by the gcd, giving
positive integers ``w_s`` with total ``W < 2**31``. ``p_s = w_s / W``.

**MixtureSchedule.** Phases ``(start_i, weights_i)``, ``start_0 = 0``, strictly
increasing; phase ``i`` covers positions ``[start_i, start_{i+1})``. Phase-local
position ``t = g - start_i``. ``offset_i[s]`` is the number of samples of ``s``
consumed by positions ``[0, start_i)``, so each source's stream continues across
a phase change without repeating or skipping anything.

**Counts.** ``C_s(T)`` (samples of ``s`` among the first ``T`` phase-local
positions at block boundaries) comes from a balanced binary tree over the source
indices: a node covers ``[lo, hi)``; if ``hi - lo > 1`` its left child covers
``[lo, mid)`` with ``mid = lo + ceil((hi - lo) / 2)`` and its right child
``[mid, hi)``; node ids are heap numbers (root 1, children ``2k`` and ``2k+1``).
With ``a`` the weight of the left child, ``b`` the node's weight and ``T`` the
count arriving at the node (``T`` at the root), the left child gets
``floor((T*a + phi) / b)`` computed as ``q*a + (r*a + phi) // b`` with
``T = q*b + r`` (no int64 overflow), the right child the rest; ``b == 0`` gives
0 to both. ``phi = u64le⁻¹(blake3(b"detdata:mixture-v1:phi" + u64le(seed) +
u64le(phase index) + u64le(node id))[:8]) mod b``.

**Blocks.** Phase-local positions are cut in blocks of ``L = 16``; block ``k``
holds ``c_s = C_s(16(k+1)) - C_s(16k)`` positions of each source (they sum to
16). Block position ``j`` gets the hash
``h_j = splitmix64(key + (16k + j + 1) * 0x9E3779B97F4A7C15 mod 2**64)`` with
``key = u64le⁻¹(blake3(b"detdata:mixture-v1:block" + u64le(seed) +
u64le(phase index))[:8])`` and ``splitmix64(z)``: ``z ^= z >> 30;
z *= 0xBF58476D1CE4E5B9; z ^= z >> 27; z *= 0x94D049BB133111EB; z ^= z >> 31``
(all mod 2**64). Sorting the 16 positions by ``(h_j, j)``, the first ``c_0`` get
source 0, the next ``c_1`` source 1, and so on. The index in source of position
``16k + j`` with source ``s`` is ``offset_i[s] + C_s(16k) + #{j' < j in the
block with source s}`` (in position order, so after any prefix each source has
consumed a prefix of its own stream).

**Bound.** Within one phase, with ``d`` the depth of the tree
(``ceil(log2 S)``) and ``count_s(T)`` the number of positions of ``s`` among the
first ``T`` phase-local positions, for every ``T >= 0``::

    |count_s(T) - p_s * T| < d + 16 * p_s * (1 - p_s)   (<= d + 4)

(and ``count_s(T) == p_s * T`` exactly when ``S == 1``). Proof sketch: each tree
level adds an error in ``(-1, 1)`` and scales the parent's by ``a/b <= 1``, so
``e(T) = C_s(T) - p_s T`` is in ``(-d, d)`` at block boundaries. Inside a block,
``T = 16k + j``, the prefix holds ``x`` of the block's ``c`` positions of ``s``
with ``max(0, c - (16 - j)) <= x <= min(c, j)``; substituting ``c = 16 p_s +
e(16k+16) - e(16k)`` gives ``count_s - p_s T < d + min(j (1 - p_s), (16 - j) p_s)``
and ``> -d - min(j p_s, (16 - j)(1 - p_s))``, both at most ``16 p_s (1 - p_s)``
beyond ``d``. Across a schedule the deviation from the piecewise-linear target
is below the sum of the per-phase bounds of the phases reached.
"""

from __future__ import annotations

import decimal
import functools
import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from fractions import Fraction
from typing import Any, Final

import numpy as np
import numpy.typing as npt

from detdata.base.checks import check_count, check_seed
from detdata.base.errors import ConfigError
from detdata.base.keys import derive_u64
from detdata.base.types import MAX_POSITION, IntArray
from detdata.order.feistel import mix64
from detdata.order.positions import check_positions_array

ALGORITHM: Final = "mixture-v1"
BLOCK: Final = 16
MAX_TOTAL_WEIGHT: Final = 1 << 31  # exclusive
_GAMMA: Final = np.uint64(0x9E3779B97F4A7C15)
_J: Final = np.arange(BLOCK, dtype=np.int64)
_CHUNK: Final = 8192  # positions per vectorised pass: bounds the transient memory of a call
_DENSE: Final = 4  # from this many positions per distinct block on, locate by whole blocks
_SMALL: Final = 2  # up to this many blocks, the tree is descended with Python ints

WeightLike = int | float | str | Fraction | decimal.Decimal | np.integer[Any] | np.floating[Any]
ScheduleLike = Sequence[tuple[int, Mapping[str, WeightLike]]]
#: One phase as exact proportions: ``(start, p_s in sorted-name order)``.
PhaseSpec = tuple[int, tuple[Fraction, ...]]


# ------------------------------------------------------------------ seeds
def source_seed(seed: int, name: str) -> int:
    """The seed of source ``name``'s own `GlobalOrder` under root ``seed`` (blake3, never
    arithmetic)."""
    return derive_u64(b"detdata:source-seed-v1", check_seed(seed), tail=name.encode("utf-8"))


# ------------------------------------------------------------------ weights
def to_fraction(value: object, where: str) -> Fraction:
    """``value`` as an exact rational (sign not checked), or `ConfigError` naming ``where``."""
    if isinstance(value, (bool, np.bool_)):
        raise ConfigError(f"{where}: a weight cannot be a bool ({value!r}); hint: use 1 or 0")
    if isinstance(value, (float, np.floating)) and not math.isfinite(float(value)):
        raise ConfigError(f"{where}: weight {value!r} is not finite")
    if isinstance(value, decimal.Decimal) and not value.is_finite():
        raise ConfigError(f"{where}: weight {value!r} is not finite")
    try:
        if isinstance(value, (int, np.integer)):
            return Fraction(int(value))
        if isinstance(value, Fraction):
            return value
        if isinstance(value, (float, np.floating)):
            return Fraction(repr(float(value)))
        if isinstance(value, (decimal.Decimal, str)):
            return Fraction(value.strip() if isinstance(value, str) else value)
    except (ValueError, ZeroDivisionError) as exc:
        raise ConfigError(
            f"{where}: cannot read weight {value!r} as an exact number ({exc}); "
            f"hint: use an int, a decimal string like '0.25' or a ratio like '1/3'"
        ) from None
    raise ConfigError(
        f"{where}: weight {value!r} has unsupported type {type(value).__name__}; "
        f"hint: use int, float, str, fractions.Fraction or decimal.Decimal"
    )


def normalize_weights(
    weights: Mapping[str, object], names: Sequence[str], *, allow_zero: bool, where: str = "weights"
) -> tuple[int, ...]:
    """Exact integer weights in ``names`` order, divided by their gcd, total ``< 2**31``."""
    if not isinstance(weights, Mapping):
        raise ConfigError(
            f"{where} must be a mapping of source name -> weight, got {type(weights).__name__}"
        )
    unknown = sorted(str(k) for k in weights if k not in names)
    if unknown:
        raise ConfigError(f"{where}: unknown source(s) {unknown}; the sources are {list(names)}")
    missing = [n for n in names if n not in weights]
    if missing:
        raise ConfigError(
            f"{where}: no weight for source(s) {missing}; hint: give every source a "
            f"weight (a weight of 0 needs allow_zero=True)"
        )
    fracs = [to_fraction(weights[n], f"{where}[{n!r}]") for n in names]
    for name, f in zip(names, fracs, strict=True):
        if f < 0:
            raise ConfigError(f"{where}[{name!r}]: weight {f} is negative")
        if f == 0 and not allow_zero:
            raise ConfigError(
                f"{where}[{name!r}]: weight is 0; hint: remove the source or pass "
                f"allow_zero=True (the source then never appears in this phase)"
            )
    if all(f == 0 for f in fracs):
        raise ConfigError(
            f"{where}: every weight is 0; at least one source needs a positive weight"
        )
    scale = math.lcm(*(f.denominator for f in fracs))
    ints = [int(f * scale) for f in fracs]
    g = math.gcd(*ints)
    ints = [v // g for v in ints]
    total = sum(ints)
    if total >= MAX_TOTAL_WEIGHT:
        raise ConfigError(
            f"{where}: the exact integer weights sum to {total} >= 2**31 "
            f"(weights {dict(zip(names, map(str, fracs), strict=True))}); hint: round the weights, "
            f"e.g. to integers or to a few decimal places, or give ratios like '1/3'"
        )
    return tuple(ints)


# ------------------------------------------------------------------ phases
@dataclass(frozen=True, kw_only=True)
class _Tree:
    """A phase's internal nodes as rows, parents before children (row 0 is the root; none for
    one source). ``left[r]`` / ``right[r]``: the row of an internal child, or ``-1 - s`` for
    the leaf of source ``s``. ``b`` is at least 1: a node of weight 0 (``a == phi == 0``)
    only ever receives 0 (`_split`). O(sources) memory, built once per phase."""

    a: IntArray
    b: IntArray
    phi: IntArray
    left: IntArray
    right: IntArray
    offsets: IntArray
    lists: tuple[list[int], ...]  # a, b, phi, left, right as Python ints

    @classmethod
    def build(cls, weights: Sequence[int], seed: int, phase: int, offsets: Sequence[int]) -> _Tree:
        """The balanced tree over ``weights`` of phase ``phase`` (``phi`` by heap node id)."""
        lists = tuple([0] * (len(weights) - 1) for _ in range(5))
        a, b, phi, left, right = lists
        pending = [(0, 1, 0, len(weights))] if len(weights) > 1 else []  # row, node id, lo, hi
        rows = 1
        while pending:
            row, node_id, lo, hi = pending.pop()
            mid = lo + (hi - lo + 1) // 2
            a[row], total = sum(weights[lo:mid]), sum(weights[lo:hi])
            if total:
                phi[row] = derive_u64(b"detdata:mixture-v1:phi", seed, phase, node_id) % total
            b[row] = max(total, 1)
            for side, child, clo, chi in (
                (left, 2 * node_id, lo, mid),
                (right, 2 * node_id + 1, mid, hi),
            ):
                if chi - clo == 1:
                    side[row] = -1 - clo
                else:
                    side[row] = rows
                    pending.append((rows, child, clo, chi))
                    rows += 1
        a_, b_, phi_, left_, right_ = (np.array(values, dtype=np.int64) for values in lists)
        return cls(
            a=a_,
            b=b_,
            phi=phi_,
            left=left_,
            right=right_,
            offsets=np.asarray(offsets, dtype=np.int64),
            lists=lists,
        )


@dataclass(frozen=True, kw_only=True)
class Phase:
    """One schedule phase: exact integer weights (sorted-name order) from ``start`` on.

    ``offsets[s]`` is the number of samples of source ``s`` consumed before ``start``.
    """

    index: int
    start: int
    weights: tuple[int, ...]
    offsets: tuple[int, ...]
    key: int
    tree: _Tree = field(repr=False, compare=False)

    def fractions(self) -> tuple[Fraction, ...]:
        total = sum(self.weights)
        return tuple(Fraction(w, total) for w in self.weights)


def _tree_counts(phase: Phase, total: int) -> list[int]:
    """``C_s(total)`` for every source (Python ints): one pass over the tree, O(sources)."""
    a, b, phi, left, right = phase.tree.lists
    out = [total] * len(phase.weights)  # every leaf is set (one source: no rows)
    arriving = [total] + [0] * len(a)
    for row in range(len(a)):
        t = arriving[row]
        share = (t * a[row] + phi[row]) // b[row]
        for child, value in ((left[row], share), (right[row], t - share)):
            if child < 0:
                out[-1 - child] = value
            else:
                arriving[child] = value
    return out


def _split(t: IntArray, a: IntArray, b: IntArray, phi: IntArray) -> IntArray:
    """The left child's share ``floor((t*a + phi) / b)`` as ``q*a + (r*a + phi) // b`` (no
    int64 overflow); every node reached here has ``b > 0`` (a zero-weight subtree only ever
    receives 0, so it never has a count to split)."""
    q, r = np.divmod(t, b)
    return q * a + (r * a + phi) // b


def _hash_ranks(phase: Phase, blocks: IntArray) -> IntArray:
    """``(len(blocks), 16)``: the rank of each block position ``j`` when the block's
    positions are sorted by ``(h_j, j)``."""
    ctr = (blocks[:, None] * BLOCK + _J[None, :] + 1).astype(np.uint64)
    by_hash = np.argsort(mix64(np.uint64(phase.key) + ctr * _GAMMA), axis=1, kind="stable")
    ranks = np.empty_like(by_hash)
    np.put_along_axis(ranks, by_hash, np.broadcast_to(_J, by_hash.shape), axis=1)
    return ranks


def _descend(
    phase: Phase, blocks: IntArray, rank: IntArray
) -> tuple[IntArray, IntArray, IntArray, IntArray]:
    """For the position of hash rank ``rank`` in block ``blocks`` (both per position): its
    source ``s``, ``C_s(16k)``, ``c_s`` and the first rank of ``s`` in the block.

    The ranks ``[0, 16)`` of a block go to the sources in index order, ``c_s`` each; at a
    node whose count rises from ``lo = C(16k)`` to ``hi = C(16k + 16)`` the left child's
    sources take the first ``left(hi) - left(lo)`` ranks. One root-to-leaf path per
    position: O(depth) per position, nothing of size sources.
    """
    n = blocks.size
    lo = blocks * BLOCK
    if len(phase.weights) == 1:
        return np.zeros(n, dtype=np.int64), lo, np.full(n, BLOCK, dtype=np.int64), 0 * lo
    tree = phase.tree
    src, start, count = (np.empty(n, dtype=np.int64) for _ in range(3))
    first = rank.copy()  # the remaining rank is subtracted at the leaf
    item = np.arange(n, dtype=np.int64)
    node = np.zeros(n, dtype=np.int64)
    hi = lo + BLOCK
    r = rank.copy()
    while item.size:
        a, b, phi = tree.a[node], tree.b[node], tree.phi[node]
        left_lo, left_hi = _split(lo, a, b, phi), _split(hi, a, b, phi)
        taken = left_hi - left_lo
        go_left = r < taken
        node = np.where(go_left, tree.left[node], tree.right[node])
        lo = np.where(go_left, left_lo, lo - left_lo)
        hi = np.where(go_left, left_hi, hi - left_hi)
        r = np.where(go_left, r, r - taken)
        done = node < 0
        at = item[done]
        src[at], start[at], count[at] = -1 - node[done], lo[done], hi[done] - lo[done]
        first[at] -= r[done]
        more = ~done
        item, node, lo, hi, r = item[more], node[more], lo[more], hi[more], r[more]
    return src, start, count, first


def _unique_sorted(values: IntArray) -> tuple[IntArray, IntArray]:
    """``np.unique(values, return_inverse=True)`` with an O(n) path for non-decreasing input."""
    if values.size and bool((values[1:] >= values[:-1]).all()):
        new = np.empty(values.size, dtype=bool)
        new[0] = True
        np.not_equal(values[1:], values[:-1], out=new[1:])
        return values[new], np.cumsum(new) - 1
    uniq, inverse = np.unique(values, return_inverse=True)
    return uniq, inverse.reshape(-1)


def _locate_in_phase(phase: Phase, local: IntArray) -> tuple[IntArray, IntArray]:
    """Source index and index in source for phase-local positions ``local`` (1-D), `_CHUNK`
    positions at a time (bounded transient memory)."""
    src = np.empty(local.size, dtype=np.int64)
    index = np.empty(local.size, dtype=np.int64)
    for a in range(0, local.size, _CHUNK):
        src[a : a + _CHUNK], index[a : a + _CHUNK] = _locate_chunk(phase, local[a : a + _CHUNK])
    return src, index


def _locate_chunk(phase: Phase, local: IntArray) -> tuple[IntArray, IntArray]:
    """`_locate_in_phase` of one chunk: by whole blocks where positions share blocks
    (contiguous requests), else one tree path per position (random access)."""
    if not local.size:
        return np.zeros(0, dtype=np.int64), np.zeros(0, dtype=np.int64)
    blocks, inverse = _unique_sorted(local >> 4)
    if local.size >= _DENSE * blocks.size:
        return _locate_by_block(phase, local, blocks, inverse)
    return _locate_by_path(phase, local, blocks, inverse)


def _locate_by_path(
    phase: Phase, local: IntArray, blocks: IntArray, inverse: IntArray
) -> tuple[IntArray, IntArray]:
    """One root-to-leaf path per position (`_descend`). The index in source of position
    ``16k + j`` is ``offset[s] + C_s(16k)`` plus the number of block positions ``j' < j``
    whose rank lies in ``s``'s range of ranks."""
    ranks = _hash_ranks(phase, blocks)[inverse]  # (n, 16): the ranks of each one's block
    j = local & (BLOCK - 1)
    src, start, count, first = _descend(phase, local >> 4, ranks[np.arange(j.size), j])
    mine = (ranks >= first[:, None]) & (ranks < (first + count)[:, None]) & (j[:, None] > _J)
    return src, phase.tree.offsets[src] + start + np.count_nonzero(mine, axis=1)


def _locate_by_block(
    phase: Phase, local: IntArray, blocks: IntArray, inverse: IntArray
) -> tuple[IntArray, IntArray]:
    """Every position of each distinct block at once (`_block_leaves`, `_block_layout`)."""
    leaf_src, leaf_start, leaf_count = _block_leaves(phase, blocks)
    leaf_at, within = _block_layout(_hash_ranks(phase, blocks), leaf_count)
    flat = inverse * BLOCK + (local & (BLOCK - 1))
    leaf = leaf_at[flat]
    src = leaf_src[leaf]
    return src, phase.tree.offsets[src] + leaf_start[leaf] + within[flat]


def _block_leaves(phase: Phase, blocks: IntArray) -> tuple[IntArray, IntArray, IntArray]:
    """The sources present in each of ``blocks``: ``(source, C_s(16k), c_s)`` for each
    ``c_s > 0``, sorted by block then source (so each block's entries sum to 16).

    The tree is descended only where a block has positions: a node with
    ``C(16k) == C(16k + 16)`` hands 0 to both children in that block, so at most 16
    leaves per block are reached, through at most 16 nodes per level: O(16 x depth) per
    block, never blocks x sources.
    """
    nb = blocks.size
    if len(phase.weights) == 1:
        return np.zeros(nb, dtype=np.int64), blocks * BLOCK, np.full(nb, BLOCK, dtype=np.int64)
    if nb <= _SMALL:
        return _block_leaves_small(phase, blocks.tolist())
    tree = phase.tree
    row = np.zeros(nb, dtype=np.int64)  # the root, once per block
    blk = np.arange(nb, dtype=np.int64)
    bounds = np.stack((blocks * BLOCK, blocks * BLOCK + BLOCK))  # C(16k), C(16k + 16) at `row`
    found: list[tuple[IntArray, IntArray, IntArray]] = []
    while row.size:
        left = _split(bounds, tree.a[row], tree.b[row], tree.phi[row])
        child = np.concatenate((tree.left[row], tree.right[row]))
        bounds = np.concatenate((left, bounds - left), axis=1)
        blk = np.concatenate((blk, blk))
        present = bounds[1] > bounds[0]
        leaf = np.flatnonzero(present & (child < 0))
        found.append((blk[leaf], -1 - child[leaf], bounds[:, leaf]))
        inner = np.flatnonzero(present & (child >= 0))
        row, blk, bounds = child[inner], blk[inner], bounds[:, inner]
    leaf_blk = np.concatenate([f[0] for f in found])
    leaf_src = np.concatenate([f[1] for f in found])
    leaf_bounds = np.concatenate([f[2] for f in found], axis=1)
    order = np.argsort(leaf_blk * len(phase.weights) + leaf_src)
    start = leaf_bounds[0, order]
    return leaf_src[order], start, leaf_bounds[1, order] - start


def _block_leaves_small(phase: Phase, blocks: list[int]) -> tuple[IntArray, IntArray, IntArray]:
    """`_block_leaves` with Python ints (exact, so ``(t*a + phi) // b`` needs no overflow
    care): cheaper than numpy for a few blocks."""
    a, b, phi, left, right = phase.tree.lists
    out: list[tuple[int, int, int]] = []
    for k in blocks:
        found: list[tuple[int, int, int]] = []
        stack = [(0, k * BLOCK, k * BLOCK + BLOCK)]
        while stack:
            row, lo, hi = stack.pop()
            left_lo = (lo * a[row] + phi[row]) // b[row]
            left_hi = (hi * a[row] + phi[row]) // b[row]
            for child, clo, chi in (
                (left[row], left_lo, left_hi),
                (right[row], lo - left_lo, hi - left_hi),
            ):
                if chi > clo:
                    if child < 0:
                        found.append((-1 - child, clo, chi - clo))
                    else:
                        stack.append((child, clo, chi))
        out.extend(sorted(found))
    arr = np.array(out, dtype=np.int64).reshape(-1, 3)
    return arr[:, 0], arr[:, 1], arr[:, 2]


def _block_layout(ranks: IntArray, leaf_count: IntArray) -> tuple[IntArray, IntArray]:
    """For blocks with hash ``ranks`` ``(nb, 16)`` and their `_block_leaves` counts: per block
    position (flat, ``16 * row + j``) its leaf (an index into the leaves) and its rank
    among the block's positions of that leaf, in position order."""
    nb = ranks.shape[0]
    by_rank = np.repeat(np.arange(leaf_count.size, dtype=np.int64), leaf_count)  # block-major
    rows = np.arange(nb, dtype=np.int64)[:, None] * BLOCK
    leaf_at = by_rank[(ranks + rows).reshape(-1)]  # position j has the leaf of its rank
    grouped = np.argsort(leaf_at, kind="stable")  # by leaf (block, source); position order inside
    first = np.cumsum(leaf_count) - leaf_count  # where each leaf starts in that order
    within = np.empty(nb * BLOCK, dtype=np.int64)
    within[grouped] = np.arange(nb * BLOCK, dtype=np.int64) - first[leaf_at[grouped]]
    return leaf_at, within


def _consumed(phase: Phase, position: int) -> tuple[int, ...]:
    """Samples of each source consumed by global positions ``[0, position)``, ``position`` in
    ``phase`` or at its end: its offsets plus the counts of its first positions, O(sources)."""
    k, j = divmod(position - phase.start, BLOCK)
    total = [o + c for o, c in zip(phase.offsets, _tree_counts(phase, k * BLOCK), strict=True)]
    if j:
        src, _ = _locate_chunk(phase, np.arange(k * BLOCK, k * BLOCK + j, dtype=np.int64))
        for s in src.tolist():
            total[s] += 1
    return tuple(total)


def next_phase(phases: Sequence[Phase], seed: int, start: int, weights: tuple[int, ...]) -> Phase:
    """The phase after ``phases`` (none: the first, at 0) from ``start`` on with ``weights``:
    its offsets continue the last phase's consumption up to ``start``."""
    index = len(phases)
    offsets = _consumed(phases[-1], start) if phases else (0,) * len(weights)
    return Phase(
        index=index,
        start=start,
        weights=weights,
        offsets=offsets,
        tree=_Tree.build(weights, seed, index, offsets),
        key=derive_u64(b"detdata:mixture-v1:block", seed, index),
    )


# ------------------------------------------------------------------ validation
def check_schedule(schedule: object) -> list[tuple[int, Mapping[str, object]]]:
    """``schedule`` as ``[(start, weights), ...]``: pairs, first start 0, starts strictly
    increasing and in ``[0, 2**62)`` (the weights are not read here), else `ConfigError`."""
    if isinstance(schedule, (str, bytes, Mapping)) or not isinstance(schedule, Iterable):
        raise ConfigError(
            f"schedule must be a list of (start_position, weights) pairs, got {schedule!r:.80}"
        )
    phases: list[tuple[int, Mapping[str, object]]] = []
    for i, item in enumerate(schedule):
        if not isinstance(item, (tuple, list)) or len(item) != 2:
            raise ConfigError(
                f"schedule[{i}] must be a (start_position, weights) pair, got {item!r:.80}"
            )
        start = check_count(item[0], f"schedule[{i}] start", minimum=0, maximum=MAX_POSITION - 1)
        if i == 0 and start != 0:
            raise ConfigError(f"schedule[0] must start at position 0, got {start}")
        if phases and start <= phases[-1][0]:
            raise ConfigError(
                f"schedule[{i}] start {start} is not after schedule[{i - 1}] start "
                f"{phases[-1][0]}; starts must strictly increase"
            )
        phases.append((start, item[1]))
    if not phases:
        raise ConfigError("schedule is empty; hint: start it with (0, {name: weight, ...})")
    return phases


def check_positions(positions: npt.ArrayLike) -> IntArray:
    """``positions`` (any shape) as int64, every value in ``[0, 2**62)``, else `ConfigError`."""
    pos = check_positions_array(positions)
    if pos.size and int(pos.max()) >= MAX_POSITION:
        raise ConfigError(
            f"positions must be in [0, 2**62), found [{int(pos.min())}, {int(pos.max())}]"
        )
    return pos.astype(np.int64, copy=False)


# ------------------------------------------------------------------ the schedule
@dataclass(frozen=True)
class MixtureSchedule:
    """A mixture's phases: the source and index in source of every global position (module
    doc); pure, no datasets."""

    phases: tuple[Phase, ...]

    @functools.cached_property
    def _starts(self) -> IntArray:
        return np.array([p.start for p in self.phases], dtype=np.int64)

    @classmethod
    def build(
        cls, seed: int, starts: Sequence[int], weights: Sequence[tuple[int, ...]]
    ) -> MixtureSchedule:
        """Phases at ``starts`` (from `check_schedule`) with integer ``weights`` (from
        `normalize_weights`) under root ``seed``."""
        phases: list[Phase] = []
        for start, w in zip(starts, weights, strict=True):
            phases.append(next_phase(phases, seed, start, w))
        return cls(tuple(phases))

    def assign(self, positions: npt.ArrayLike) -> tuple[IntArray, IntArray]:
        """``(source_index, index_in_source)`` for each global position (same shape).

        Cost: O(positions + sources) per call (O(16 x tree depth) per distinct 16-position
        block touched, O(sources) once per phase), memory O(positions + sources).
        """
        pos = check_positions(positions)
        flat = pos.reshape(-1)
        if len(self.phases) == 1:
            src, index = _locate_in_phase(self.phases[0], flat)
            return src.reshape(pos.shape), index.reshape(pos.shape)
        src = np.empty(flat.size, dtype=np.int64)
        index = np.empty(flat.size, dtype=np.int64)
        which = np.searchsorted(self._starts, flat, side="right") - 1
        for p in np.unique(which):
            sel = which == p
            phase = self.phases[int(p)]
            src[sel], index[sel] = _locate_in_phase(phase, flat[sel] - phase.start)
        return src.reshape(pos.shape), index.reshape(pos.shape)

    def _phase_of(self, position: int) -> Phase:
        return self.phases[int(np.searchsorted(self._starts, position, side="right")) - 1]

    def phase_at(self, position: int) -> Phase:
        """The phase in effect at global ``position`` (in ``[0, 2**62)``)."""
        return self._phase_of(
            check_count(position, "position", minimum=0, maximum=MAX_POSITION - 1)
        )

    def consumed(self, position: int) -> tuple[int, ...]:
        """Samples of each source consumed by positions ``[0, position)``:
        O(phases + sources + 16)."""
        p = check_count(position, "position", minimum=0, maximum=MAX_POSITION)
        return _consumed(self._phase_of(p), p)

    def proportions(self) -> tuple[PhaseSpec, ...]:
        """``(start, exact p_s)`` of each phase."""
        return tuple((p.start, p.fractions()) for p in self.phases)


# ------------------------------------------------------------------ schedules as JSON
def rational(f: Fraction) -> str:
    """``"p/q"`` (always with a denominator): how proportions are written in identities."""
    return f"{f.numerator}/{f.denominator}"


def schedule_to_json(schedule: MixtureSchedule, names: Sequence[str]) -> list[list[Any]]:
    """``[[start, {name: "p/q"}], ...]`` with the exact normalised proportions."""
    return [
        [start, {n: rational(f) for n, f in zip(names, fracs, strict=True)}]
        for start, fracs in schedule.proportions()
    ]


def schedule_from_json(doc: object, names: Sequence[str]) -> tuple[PhaseSpec, ...]:
    """The proportions of a saved `schedule_to_json` over the sorted ``names``, or `ConfigError`
    (`check_schedule`, then `normalize_weights` with zeros allowed)."""
    phases = []
    for i, (start, start_weights) in enumerate(check_schedule(doc)):
        where = f"saved mixture schedule[{i}]"
        weights = normalize_weights(start_weights, names, allow_zero=True, where=where)
        phases.append((start, tuple(Fraction(w, sum(weights)) for w in weights)))
    return tuple(phases)


# ------------------------------------------------------------------ continuing
def continue_schedule(
    saved: Sequence[PhaseSpec], mine: Sequence[PhaseSpec], position: int
) -> list[PhaseSpec]:
    """The saved schedule's phases before ``position``, then ``mine`` from ``position`` on.

    The phase of ``mine`` in effect at ``position`` starts there, unless the saved
    phase in effect already has those proportions (and started before it): then that
    phase simply continues. Phase indices, keys and offsets of the saved phases before
    ``position`` are unchanged, so every earlier position keeps its source and index.
    """
    p = check_count(position, "position", minimum=0, maximum=MAX_POSITION - 1)
    past = [(s, w) for s, w in saved if s < p]
    in_effect = [(s, w) for s, w in saved if s <= p][-1]
    current = [w for s, w in mine if s <= p][-1]
    future = [(s, w) for s, w in mine if s > p]
    if not (in_effect[0] < p and tuple(in_effect[1]) == current):
        past.append((p, current))
    return past + future
