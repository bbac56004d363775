"""Seeded, exact, random-access mixtures of several datasets (algorithm ``mixture-v1``).

A `Mixture` is a `Stream`: global position ``g`` -> ``(source, index in that
source's own stream)`` -> sample id, computed per position with nothing of size
``n`` stored. Exact definition (a re-implementation in any language must
reproduce the golden vectors in ``tests/golden/mixture_v1.json``):

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

**Schedule.** Phases ``(start_i, weights_i)``, ``start_0 = 0``, strictly
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

import bisect
import decimal
import itertools
import json
import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from fractions import Fraction
from typing import Any, Final

import numpy as np
import numpy.typing as npt

from detdata.base.checks import check_count, check_seed
from detdata.base.errors import ConfigError, FormatError
from detdata.base.hashing import digest_bytes
from detdata.base.keys import derive_u64
from detdata.base.types import MAX_POSITION, Batch, IntArray
from detdata.datasets.base import Dataset
from detdata.datasets.columns import describe_column, same_kind
from detdata.order.feistel import ALGORITHM as ORDER_ALGORITHM
from detdata.order.feistel import GlobalOrder, mix64
from detdata.order.memo import ChunkMemo

ALGORITHM: Final = "mixture-v1"
BLOCK: Final = 16
MAX_TOTAL_WEIGHT: Final = 1 << 31  # exclusive
_GAMMA: Final = np.uint64(0x9E3779B97F4A7C15)
_U64: Final = (1 << 64) - 1
_J: Final = np.arange(BLOCK, dtype=np.int64)
_SMALL: Final = 32  # up to this many block boundaries, the tree runs on Python ints

WeightLike = int | float | str | Fraction | decimal.Decimal | np.integer[Any] | np.floating[Any]
ScheduleLike = Sequence[tuple[int, Mapping[str, WeightLike]]]


# ------------------------------------------------------------------ hashing
def _u64(tag: bytes, *words: int) -> int:
    """First 8 bytes (little-endian) of blake3(tag + u64le(word)...)."""
    return derive_u64(tag, *words)


def source_seed(seed: int, name: str) -> int:
    """The seed of source ``name``'s own `GlobalOrder` under root ``seed`` (blake3, never arithmetic)."""
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
        raise ConfigError(f"{where}: cannot read weight {value!r} as an exact number ({exc}); "
                          f"hint: use an int, a decimal string like '0.25' or a ratio like '1/3'") from None
    raise ConfigError(f"{where}: weight {value!r} has unsupported type {type(value).__name__}; "
                      f"hint: use int, float, str, fractions.Fraction or decimal.Decimal")


def normalize_weights(weights: Mapping[str, object], names: Sequence[str], *, allow_zero: bool,
                      where: str = "weights") -> tuple[int, ...]:
    """Exact integer weights in ``names`` order, divided by their gcd, total ``< 2**31``."""
    if not isinstance(weights, Mapping):
        raise ConfigError(f"{where} must be a mapping of source name -> weight, got {type(weights).__name__}")
    unknown = sorted(str(k) for k in weights if k not in names)
    if unknown:
        raise ConfigError(f"{where}: unknown source(s) {unknown}; the sources are {list(names)}")
    missing = [n for n in names if n not in weights]
    if missing:
        raise ConfigError(f"{where}: no weight for source(s) {missing}; hint: give every source a "
                          f"weight (a weight of 0 needs allow_zero=True)")
    fracs = [to_fraction(weights[n], f"{where}[{n!r}]") for n in names]
    for name, f in zip(names, fracs, strict=True):
        if f < 0:
            raise ConfigError(f"{where}[{name!r}]: weight {f} is negative")
        if f == 0 and not allow_zero:
            raise ConfigError(f"{where}[{name!r}]: weight is 0; hint: remove the source or pass "
                              f"allow_zero=True (the source then never appears in this phase)")
    if all(f == 0 for f in fracs):
        raise ConfigError(f"{where}: every weight is 0; at least one source needs a positive weight")
    scale = math.lcm(*(f.denominator for f in fracs))
    ints = [int(f * scale) for f in fracs]
    g = math.gcd(*ints)
    ints = [v // g for v in ints]
    total = sum(ints)
    if total >= MAX_TOTAL_WEIGHT:
        raise ConfigError(f"{where}: the exact integer weights sum to {total} >= 2**31 "
                          f"(weights {dict(zip(names, map(str, fracs), strict=True))}); hint: round the weights, "
                          f"e.g. to integers or to a few decimal places, or give ratios like '1/3'")
    return tuple(ints)


# ------------------------------------------------------------------ phases
@dataclass(frozen=True, kw_only=True)
class _Node:
    """One internal tree node: splits the count arriving at ``node_id`` between two children."""

    node_id: int
    left: tuple[int, int]  # (child node id, source index if the child is a leaf else -1)
    right: tuple[int, int]
    a: int
    b: int
    phi: int


@dataclass(frozen=True, kw_only=True)
class Phase:
    """One schedule phase: exact integer weights (sorted-name order) from ``start`` on.

    ``offsets[s]`` is the number of samples of source ``s`` consumed before ``start``.
    """

    index: int
    start: int
    weights: tuple[int, ...]
    offsets: tuple[int, ...]
    nodes: tuple[_Node, ...]
    key: int

    @property
    def total(self) -> int:
        return sum(self.weights)

    def fractions(self) -> tuple[Fraction, ...]:
        return tuple(Fraction(w, self.total) for w in self.weights)


def _build_nodes(weights: Sequence[int], seed: int, phase: int) -> tuple[_Node, ...]:
    """The internal nodes of the balanced tree, parents before children (none for one source)."""
    nodes: list[_Node] = []
    if len(weights) == 1:
        return ()
    stack = [(1, 0, len(weights))]
    while stack:
        node_id, lo, hi = stack.pop()
        mid = lo + (hi - lo + 1) // 2
        a, b = sum(weights[lo:mid]), sum(weights[lo:hi])
        phi = _u64(b"detdata:mixture-v1:phi", seed, phase, node_id) % b if b else 0
        children = []
        for child_id, clo, chi in ((2 * node_id, lo, mid), (2 * node_id + 1, mid, hi)):
            children.append((child_id, clo if chi - clo == 1 else -1))
            if chi - clo > 1:
                stack.append((child_id, clo, chi))
        nodes.append(_Node(node_id=node_id, left=children[0], right=children[1], a=a, b=b, phi=phi))
    return tuple(nodes)


def _tree_counts_small(phase: Phase, totals: Sequence[int]) -> IntArray:
    """`_tree_counts` with Python ints: cheaper than numpy for a few boundaries."""
    out = np.empty((len(totals), len(phase.weights)), dtype=np.int64)
    for row, total in enumerate(totals):
        arriving = {1: total}
        for node in phase.nodes:
            t = arriving.pop(node.node_id)
            left = (t * node.a + node.phi) // node.b if node.b else 0
            for (child, leaf), value in ((node.left, left), (node.right, t - left)):
                if leaf >= 0:
                    out[row, leaf] = value
                else:
                    arriving[child] = value
    return out


def _tree_counts(phase: Phase, totals: IntArray) -> IntArray:
    """``C_s(T)`` for each ``T`` in ``totals`` (block boundaries): shape ``(len(totals), S)``."""
    if not phase.nodes:
        return totals.astype(np.int64).reshape(-1, 1)
    if totals.size <= _SMALL:
        return _tree_counts_small(phase, totals.tolist())
    out = np.empty((totals.size, len(phase.weights)), dtype=np.int64)
    arriving: dict[int, IntArray] = {1: totals}
    for node in phase.nodes:
        t = arriving.pop(node.node_id)
        if node.b == 0:
            left = np.zeros_like(t)
        else:
            q, r = np.divmod(t, node.b)
            left = q * node.a + (r * node.a + node.phi) // node.b
        for (child, leaf), value in ((node.left, left), (node.right, t - left)):
            if leaf >= 0:
                out[:, leaf] = value
            else:
                arriving[child] = value
    return out


def _block_layout(phase: Phase, blocks: IntArray, counts: IntArray) -> tuple[IntArray, IntArray]:
    """For blocks ``(nb,)`` with per-source counts ``(nb, S)``: source and within-source rank, ``(nb, 16)``."""
    nb, num_sources = counts.shape
    rows = np.arange(nb, dtype=np.int64)[:, None]
    ctr = (blocks[:, None] * BLOCK + _J[None, :] + 1).astype(np.uint64)
    by_hash = np.argsort(mix64(np.uint64(phase.key) + ctr * _GAMMA), axis=1, kind="stable")
    by_rank = np.repeat(np.tile(np.arange(num_sources, dtype=np.int64), nb), counts.reshape(-1))
    src = np.empty(nb * BLOCK, dtype=np.int64)
    src[(by_hash + rows * BLOCK).reshape(-1)] = by_rank  # the r-th smallest hash gets by_rank[r]
    src = src.reshape(nb, BLOCK)
    grouped = np.argsort(src, axis=1, kind="stable") + rows * BLOCK  # by source, position order inside
    first = (np.cumsum(counts, axis=1) - counts).reshape(-1)  # block rank where each source starts
    within = np.empty(nb * BLOCK, dtype=np.int64)
    flat = grouped.reshape(-1)
    within[flat] = np.tile(_J, nb) - first[src.reshape(-1)[flat] + (flat // BLOCK) * num_sources]
    return src, within.reshape(nb, BLOCK)


def _unique_sorted(values: IntArray) -> tuple[IntArray, IntArray]:
    """``np.unique(values, return_inverse=True)`` with an O(n) path for non-decreasing input."""
    if values.size and bool((values[1:] >= values[:-1]).all()):
        new = np.empty(values.size, dtype=bool)
        new[0] = True
        np.not_equal(values[1:], values[:-1], out=new[1:])
        return values[new], np.cumsum(new) - 1
    uniq, inverse = np.unique(values, return_inverse=True)
    return uniq, inverse.reshape(-1)


def _boundary_counts(phase: Phase, blocks: IntArray) -> tuple[IntArray, IntArray]:
    """``C(16k)`` and per-block counts for sorted unique ``blocks``, both ``(nb, S)``."""
    if blocks.size and int(blocks[-1]) - int(blocks[0]) == blocks.size - 1:  # contiguous
        bounds = _tree_counts(phase, np.arange(int(blocks[0]), int(blocks[-1]) + 2, dtype=np.int64) * BLOCK)
        return bounds[:-1], np.diff(bounds, axis=0)
    both = _tree_counts(phase, np.concatenate((blocks, blocks + 1)) * BLOCK)
    start = both[: blocks.size]
    return start, both[blocks.size:] - start


def _locate_in_phase(phase: Phase, local: IntArray) -> tuple[IntArray, IntArray]:
    """Source index and index in source for phase-local positions ``local`` (1-D)."""
    blocks, inverse = _unique_sorted(local >> 4)
    start, counts = _boundary_counts(phase, blocks)
    src_blk, within_blk = _block_layout(phase, blocks, counts)
    j = local & (BLOCK - 1)
    src = src_blk[inverse, j]
    offsets = np.asarray(phase.offsets, dtype=np.int64)
    index = offsets[src] + start[inverse, src] + within_blk[inverse, j]
    return src, index


def _phase_prefix_counts(phase: Phase, length: int) -> tuple[int, ...]:
    """Samples of each source among the first ``length`` phase-local positions."""
    k, j = divmod(length, BLOCK)
    blocks = np.array([k], dtype=np.int64)
    start, counts = _boundary_counts(phase, blocks)
    total = start[0].copy()
    if j:
        src, _ = _block_layout(phase, blocks, counts)
        total += np.bincount(src[0, :j], minlength=len(phase.weights))
    return tuple(int(v) for v in total)


def _make_phases(seed: int, starts: Sequence[int], weights: Sequence[tuple[int, ...]]) -> tuple[Phase, ...]:
    phases: list[Phase] = []
    offsets = (0,) * len(weights[0])
    for index, (start, w) in enumerate(zip(starts, weights, strict=True)):
        phase = Phase(index=index, start=start, weights=w, offsets=offsets,
                      nodes=_build_nodes(w, seed, index), key=_u64(b"detdata:mixture-v1:block", seed, index))
        phases.append(phase)
        if index + 1 < len(starts):
            used = _phase_prefix_counts(phase, starts[index + 1] - start)
            offsets = tuple(o + u for o, u in zip(offsets, used, strict=True))
    return tuple(phases)


# ------------------------------------------------------------------ validation
def _check_sources(sources: object) -> dict[str, Dataset]:
    if not isinstance(sources, Mapping) or not sources:
        raise ConfigError("Mixture needs a non-empty mapping of source name -> dataset, got "
                          f"{sources!r:.80}")
    for name in sources:
        if not isinstance(name, str) or not name:
            raise ConfigError(f"Mixture source names must be non-empty strings, got {name!r}")
    out: dict[str, Dataset] = {}
    for name in sorted(sources):
        data = sources[name]
        if not isinstance(data, Dataset):
            raise ConfigError(f"Mixture source {name!r}: expected a Dataset (num_samples, read, identity), "
                              f"got {type(data).__name__}")
        n = data.num_samples
        if isinstance(n, (int, np.integer)) and not isinstance(n, bool) and int(n) == 0:
            raise ConfigError(f"Mixture source {name!r} is empty (num_samples == 0); hint: drop it")
        check_count(n, f"Mixture source {name!r} num_samples")
        out[name] = data
    return out


def source_columns(name: str, dataset: Dataset) -> dict[str, str]:
    """Column -> `describe_column` of what ``dataset`` delivers: its ``schema()`` if it has
    one that answers in that form (without reading samples, e.g. `TableRows`), else
    described from ``read([0])`` (a ``schema()`` of another kind, say a pyarrow schema, is
    not ours to interpret)."""
    schema = getattr(dataset, "schema", None)
    if callable(schema):
        found = schema()
        if isinstance(found, Mapping) and all(
                isinstance(k, str) and isinstance(v, str) for k, v in found.items()):
            return dict(found)
    try:
        batch = dataset.read(np.zeros(1, dtype=np.int64))
    except Exception as exc:
        exc.add_note(f"(while reading sample 0 of Mixture source {name!r} to learn its columns)")
        raise
    if not isinstance(batch, Mapping):
        raise ConfigError(f"Mixture source {name!r}: read must return a mapping of column -> "
                          f"array, got {type(batch).__name__}")
    return {str(k): describe_column(v) for k, v in batch.items()}


def _common_columns(sources: Mapping[str, Dataset]) -> dict[str, str]:
    """The columns every source delivers (`source_columns`), or `FormatError` naming each
    source that differs from the first (by name) and each differing column."""
    found = {name: source_columns(name, data) for name, data in sources.items()}
    first, *others = found
    ref = found[first]
    problems = []
    for name in others:
        cols = found[name]
        diffs = [f"column {c!r}: {first!r} gives {ref.get(c, 'nothing')}, {name!r} gives "
                 f"{cols.get(c, 'nothing')}"
                 for c in dict.fromkeys([*ref, *cols])
                 if c not in ref or c not in cols or not same_kind(ref[c], cols[c])]
        if diffs:
            problems.append(f"sources {first!r} and {name!r}: " + "; ".join(diffs))
        else:  # keep the most specific description ('str' over 'object': all None so far)
            ref = {c: cols[c] if t == "object" else t for c, t in ref.items()}
    if problems:
        raise FormatError("Mixture sources deliver different columns (a batch would change dtype "
                          "or shape with the sources it draws from, or fail mid-run): "
                          + " | ".join(problems) + "; hint: make every source deliver the same "
                          "columns with the same dtype and shape (TokenWindows out_dtype= and "
                          "seq_len=, TableRows columns=)")
    return ref


def _check_schedule(schedule: object) -> list[tuple[int, Mapping[str, object]]]:
    if isinstance(schedule, (str, bytes, Mapping)) or not isinstance(schedule, Iterable):
        raise ConfigError(f"schedule must be a list of (start_position, weights) pairs, got {schedule!r:.80}")
    phases: list[tuple[int, Mapping[str, object]]] = []
    for i, item in enumerate(schedule):
        if not isinstance(item, (tuple, list)) or len(item) != 2:
            raise ConfigError(f"schedule[{i}] must be a (start_position, weights) pair, got {item!r:.80}")
        start = check_count(item[0], f"schedule[{i}] start", minimum=0, maximum=MAX_POSITION - 1)
        if i == 0 and start != 0:
            raise ConfigError(f"schedule[0] must start at position 0, got {start}")
        if phases and start <= phases[-1][0]:
            raise ConfigError(f"schedule[{i}] start {start} is not after schedule[{i - 1}] start "
                              f"{phases[-1][0]}; starts must strictly increase")
        phases.append((start, item[1]))
    if not phases:
        raise ConfigError("schedule is empty; hint: start it with (0, {name: weight, ...})")
    return phases


def _check_positions(positions: npt.ArrayLike) -> IntArray:
    pos = np.asarray(positions)
    if pos.dtype.kind not in "iu":
        raise ConfigError(f"positions must be integers, got dtype {pos.dtype}")
    if pos.size and (int(pos.min()) < 0 or int(pos.max()) >= MAX_POSITION):
        raise ConfigError(f"positions must be in [0, 2**62), found [{int(pos.min())}, {int(pos.max())}]")
    return pos.astype(np.int64, copy=False)


def _rational(f: Fraction) -> str:
    return f"{f.numerator}/{f.denominator}"


# ------------------------------------------------------------------ the stream
class Mixture:
    """Several datasets mixed with exact, seeded, resumable proportions (``mixture-v1``).

    ``Mixture(sources={name: dataset}, weights={name: w}, seed=s)`` or with
    ``schedule=[(0, {...}), (start, {...}), ...]`` instead of ``weights``. A `Stream`:
    ``fetch``/``sample_ids``/``identity``, plus ``locate``, ``consumed`` and
    ``continue_from``. See the module docstring for the exact algorithm and the
    proportion bound ``|count_s(T) - p_s T| < ceil(log2 S) + 16 p_s (1 - p_s)`` per phase.

    Every source must deliver the same columns with the same dtype, trailing shape
    and object kind (str, bytes, ragged ``list<dtype>``): checked at construction from
    each source's ``schema()`` (`TableRows`) or else its ``read([0])``, with a
    `FormatError` naming both sources and each differing column; ``columns`` holds
    the result, and every read is checked against it (a `FormatError` naming the
    source instead of a batch whose dtype depends on the sources it draws from).
    `fetch` returns new arrays (nothing aliases a source's memory).
    """

    algorithm: Final = ALGORITHM

    def __init__(self, sources: Mapping[str, Dataset], weights: Mapping[str, WeightLike] | None = None,
                 *, seed: int, schedule: ScheduleLike | None = None, allow_zero: bool = False) -> None:
        self.seed = check_seed(seed)
        self.sources = _check_sources(sources)
        self.source_names: tuple[str, ...] = tuple(self.sources)
        self.allow_zero = bool(allow_zero)
        if (weights is None) == (schedule is None):
            raise ConfigError("Mixture needs exactly one of weights={...} or schedule=[(0, {...}), ...]")
        raw = [(0, weights)] if weights is not None else _check_schedule(schedule)
        ints = [normalize_weights(w, self.source_names, allow_zero=self.allow_zero,
                                  where="weights" if schedule is None else f"schedule[{i}] weights")
                for i, (_, w) in enumerate(raw)]
        self.phases = _make_phases(self.seed, [s for s, _ in raw], ints)
        self._starts = np.array([p.start for p in self.phases], dtype=np.int64)
        self.source_seeds = {n: source_seed(self.seed, n) for n in self.source_names}
        self.orders = {n: GlobalOrder(self.sources[n].num_samples, self.source_seeds[n])
                       for n in self.source_names}
        self.columns: dict[str, str] = _common_columns(self.sources)
        self._memo = ChunkMemo(self.locate)

    def __repr__(self) -> str:
        weights = {n: _rational(f) for n, f in zip(self.source_names, self.phases[0].fractions(), strict=True)}
        return (f"Mixture(sources={list(self.source_names)}, weights={weights}, seed={self.seed}, "
                f"phases={len(self.phases)}, algorithm={ALGORITHM!r})")

    # -------------------------------------------------------------- mapping
    def assign(self, positions: npt.ArrayLike) -> tuple[IntArray, IntArray]:
        """``(source_index, index_in_source)`` for each global position (same shape), no sample ids.

        Cost: O(sources) per distinct 16-position block touched, plus O(1) per position.
        """
        pos = _check_positions(positions)
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

    def locate(self, positions: npt.ArrayLike) -> tuple[IntArray, IntArray, IntArray]:
        """``(source_index, index_in_source, sample_id)`` for each global position (same shape).

        ``source_index`` indexes `source_names`; ``sample_id`` is the id in that source's
        dataset: ``GlobalOrder(n_s, source_seeds[name]).ids(index_in_source)``.
        """
        src, index = self.assign(positions)
        ids = np.empty(src.shape, dtype=np.int64)
        for s, name in enumerate(self.source_names):
            sel = src == s
            if sel.any():
                ids[sel] = self.orders[name].ids(index[sel])
        return src, index, ids

    def sample_ids(self, positions: IntArray) -> IntArray:
        """Sample ids (within their source; pair them with ``locate(...)[0]``) of ``positions``."""
        return self.locate(positions)[2]

    def fetch(self, positions: IntArray) -> Batch:
        """The samples at ``positions``, rows in position order: one batched read per source.

        Positions are resolved through a per-process chunk cache of `locate`
        (identical values; amortised O(1) per position for loader-style requests).
        """
        src, _, ids = self._memo(np.asarray(positions, dtype=np.int64).reshape(-1))
        if src.size == 0:
            return self.sources[self.source_names[0]].read(np.empty(0, dtype=np.int64))
        first = int(src[0])
        runs: list[tuple[int, IntArray | None]]
        if len(self.source_names) == 1 or not (src != first).any():
            runs = [(first, None)]  # one source: every row, in order
            parts = {first: self.sources[self.source_names[first]].read(ids)}
        else:  # group positions by source: stable, so each source's ids stay in position order
            order = src.argsort(kind="stable")
            by_source = src[order]
            cuts = ((by_source[1:] != by_source[:-1]).nonzero()[0] + 1).tolist()
            runs = [(int(by_source[a]), order[a:b])
                    for a, b in itertools.pairwise([0, *cuts, src.size])]
            parts = {s: self.sources[self.source_names[s]].read(ids[rows]) for s, rows in runs}
        return self._assemble(src.size, runs, parts)

    def _assemble(self, size: int, runs: Sequence[tuple[int, IntArray | None]],
                  parts: Mapping[int, Batch]) -> Batch:
        """One new output array per column, each source's rows scattered to its positions
        (``rows`` of a run; None: all of them). Every part must hold exactly the columns
        `columns` found at construction (`FormatError` naming the source otherwise), so
        a batch's dtypes never depend on which sources it happens to draw from."""
        for s, batch in parts.items():
            self._check_part(self.source_names[s], batch)
        first = next(iter(parts.values()))
        out: Batch = {}
        for col, ref in first.items():
            arr = np.empty((size, *ref.shape[1:]), dtype=ref.dtype)
            for s, rows in runs:
                value = np.asarray(parts[s][col])
                if rows is None:
                    arr[...] = value
                else:
                    arr[rows] = value
            out[col] = arr
        return out

    def _check_part(self, name: str, batch: Batch) -> None:
        if set(batch) != set(self.columns):
            raise FormatError(f"Mixture source {name!r} read columns {sorted(batch)}, but the "
                              f"sources were found at construction to have {sorted(self.columns)}; "
                              "hint: a dataset's read must always return the same columns")
        for col, expected in self.columns.items():
            found = describe_column(batch[col])
            if not same_kind(found, expected):
                raise FormatError(f"Mixture source {name!r} column {col!r}: read gave {found}, "
                                  f"but the sources were found at construction to give {expected}; "
                                  "hint: a dataset's read must always give one dtype and shape "
                                  "per column")

    def consumed(self, position: int) -> dict[str, int]:
        """Samples of each source consumed by positions ``[0, position)``: O(phases + sources + 16)."""
        p = check_count(position, "position", minimum=0, maximum=MAX_POSITION)
        phase = self.phases[bisect.bisect_right(self._starts.tolist(), p) - 1]
        used = _phase_prefix_counts(phase, p - phase.start)
        return {n: o + u for n, o, u in zip(self.source_names, phase.offsets, used, strict=True)}

    def epochs_completed(self, position: int) -> dict[str, int]:
        """Complete epochs of each source's own order after positions ``[0, position)``."""
        return {n: c // self.sources[n].num_samples for n, c in self.consumed(position).items()}

    def weights_at(self, position: int) -> dict[str, Fraction]:
        """The exact proportions ``p_s`` in effect at global ``position``."""
        p = check_count(position, "position", minimum=0, maximum=MAX_POSITION - 1)
        phase = self.phases[bisect.bisect_right(self._starts.tolist(), p) - 1]
        return dict(zip(self.source_names, phase.fractions(), strict=True))

    # -------------------------------------------------------------- identity
    def schedule_json(self) -> list[list[Any]]:
        """``[[start, {name: "p/q"}], ...]`` with exact normalised proportions."""
        return [[p.start, {n: _rational(f) for n, f in zip(self.source_names, p.fractions(), strict=True)}]
                for p in self.phases]

    def identity(self) -> dict[str, Any]:
        """Plain JSON pinning sources, seed, schedule and algorithms."""
        return {"type": "mixture", "algorithm": ALGORITHM, "seed": self.seed,
                "sources": {n: self.sources[n].identity() for n in self.source_names},
                "schedule": self.schedule_json(), "source_order_algorithm": ORDER_ALGORITHM}

    def fingerprint(self) -> str:
        """``b3:<hex>`` of the canonical JSON (sorted keys, no whitespace, UTF-8) of `identity`."""
        return digest_bytes(json.dumps(self.identity(), sort_keys=True, separators=(",", ":"),
                                       ensure_ascii=False, allow_nan=False).encode("utf-8"))

    def continue_from(self, saved_identity: Mapping[str, Any], position: int) -> Mixture:
        """This mixture's weights from ``position`` on, after the saved mixture's schedule before it.

        The result agrees with the saved mixture on every position ``< position``
        (same phases, indices and offsets) and then follows this mixture's
        schedule (its phase in effect at ``position`` starts there). Every
        source continues from its consumed count, so no source sample is
        repeated or skipped because of the change. If the weights in effect do
        not change at ``position``, the saved phase simply continues. Sources
        (names and identities), seed and algorithms must match the saved ones.
        """
        saved = _SavedMixture.parse(saved_identity)
        diffs = saved.differences(self)
        if diffs:
            raise ConfigError("cannot continue the saved mixture: " + "; ".join(diffs)
                              + "; hint: continue_from only changes weights")
        p = check_count(position, "position", minimum=0, maximum=MAX_POSITION - 1)
        past = [(s, w) for s, w in saved.schedule if s < p]
        in_effect = [(s, w) for s, w in saved.schedule if s <= p][-1]
        mine = [(ph.start, ph.fractions()) for ph in self.phases]
        current = [(s, w) for s, w in mine if s <= p][-1][1]
        future = [(s, w) for s, w in mine if s > p]
        if not (in_effect[0] < p and tuple(in_effect[1]) == current):
            past.append((p, current))
        schedule = [(s, dict(zip(self.source_names, w, strict=True))) for s, w in past + future]
        zero = any(f == 0 for _, w in schedule for f in w.values())
        return Mixture(self.sources, seed=self.seed, schedule=schedule, allow_zero=zero or self.allow_zero)


@dataclass(frozen=True, kw_only=True)
class _SavedMixture:
    """A parsed mixture identity (as saved in a loader state)."""

    seed: object
    algorithm: object
    order_algorithm: object
    sources: Mapping[str, Any]
    schedule: tuple[tuple[int, tuple[Fraction, ...]], ...]

    @classmethod
    def parse(cls, doc: Mapping[str, Any]) -> _SavedMixture:
        if not isinstance(doc, Mapping) or doc.get("type") != "mixture":
            raise ConfigError(f"saved identity is not a mixture identity (type {doc.get('type') if isinstance(doc, Mapping) else type(doc).__name__!r})")
        sources = doc.get("sources")
        schedule = doc.get("schedule")
        if not isinstance(sources, Mapping) or not isinstance(schedule, list) or not schedule:
            raise ConfigError("saved mixture identity needs 'sources' (object) and 'schedule' (non-empty list)")
        names = sorted(sources)
        phases = []
        for i, (start, start_weights) in enumerate(_check_schedule(schedule)):
            if not isinstance(start_weights, Mapping) or sorted(start_weights) != names:
                raise ConfigError(f"saved mixture schedule[{i}] does not weight exactly the sources {names}")
            fracs = [to_fraction(start_weights[n], f"saved schedule[{i}][{n!r}]") for n in names]
            if any(f < 0 for f in fracs) or sum(fracs) <= 0:
                raise ConfigError(f"saved mixture schedule[{i}] has negative or all-zero weights")
            phases.append((start, tuple(f / sum(fracs) for f in fracs)))
        return cls(seed=doc.get("seed"), algorithm=doc.get("algorithm"),
                   order_algorithm=doc.get("source_order_algorithm"), sources=sources,
                   schedule=tuple(phases))

    def differences(self, mixture: Mixture) -> list[str]:
        """Human-readable differences that forbid continuing into ``mixture``."""
        diffs = []
        if self.algorithm != ALGORITHM:
            diffs.append(f"algorithm: saved {self.algorithm!r}, now {ALGORITHM!r}")
        if self.order_algorithm != ORDER_ALGORITHM:
            diffs.append(f"source_order_algorithm: saved {self.order_algorithm!r}, now {ORDER_ALGORITHM!r}")
        if self.seed != mixture.seed:
            diffs.append(f"seed: saved {self.seed!r}, now {mixture.seed}")
        saved_names, names = set(self.sources), set(mixture.source_names)
        if saved_names - names:
            diffs.append(f"sources removed: {sorted(saved_names - names)}")
        if names - saved_names:
            diffs.append(f"sources added: {sorted(names - saved_names)}")
        for n in sorted(saved_names & names):
            if self.sources[n] != mixture.sources[n].identity():
                diffs.append(f"source {n!r} identity differs: saved {self.sources[n]!r:.120}, "
                             f"now {mixture.sources[n].identity()!r:.120}")
        return diffs
