"""mixture-v1 at O(positions + sources): the new `MixtureSchedule.assign` equals the old dense one.

The reference below is the dense implementation of ``detdata.order.mixing`` as it stood
before the sparse rewrite (copied verbatim, only renamed): it builds ``blocks x sources``
arrays, so it costs O(blocks x sources) per call, and it reproduced the golden vectors
``tests/golden/mixture_v1.json``. The new implementation must agree with it on every
position for random weights (zeros included), seeds, schedules and positions. The golden
file itself (and an independent scalar reference from the docstring) is checked in
``tests/datasets/test_mixture.py``.
"""

from __future__ import annotations

import tracemalloc
from collections.abc import Callable, Sequence
from typing import Final

import numpy as np
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from detdata.base.types import IntArray
from detdata.order import mixing as mx
from detdata.order.feistel import mix64
from detdata.order.mixing import BLOCK, MixtureSchedule, Phase

_GAMMA: Final = np.uint64(0x9E3779B97F4A7C15)
_J: Final = np.arange(BLOCK, dtype=np.int64)
_SMALL: Final = 32
MASK: Final = (1 << 64) - 1
HYP = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])


# --------------------------------------------------------------------- the old dense code
def _tree_counts_small(phase: Phase, totals: Sequence[int]) -> IntArray:
    """`_tree_counts` with Python ints: cheaper than numpy for a few boundaries."""
    out = np.empty((len(totals), len(phase.weights)), dtype=np.int64)
    a, b, phi, left_row, right_row = phase.tree.lists
    for row, total in enumerate(totals):
        arriving = {0: total}
        for node in range(len(a)):
            t = arriving.pop(node)
            left = (t * a[node] + phi[node]) // b[node]
            for child, value in ((left_row[node], left), (right_row[node], t - left)):
                if child < 0:
                    out[row, -1 - child] = value
                else:
                    arriving[child] = value
    return out


def _tree_counts(phase: Phase, totals: IntArray) -> IntArray:
    """``C_s(T)`` for each ``T`` in ``totals`` (block boundaries): shape ``(len(totals), S)``."""
    if len(phase.weights) == 1:
        return totals.astype(np.int64).reshape(-1, 1)
    if totals.size <= _SMALL:
        return _tree_counts_small(phase, totals.tolist())
    out = np.empty((totals.size, len(phase.weights)), dtype=np.int64)
    a, b, phi, left_row, right_row = phase.tree.lists  # b >= 1: a weight-0 node has a == phi == 0
    arriving: dict[int, IntArray] = {0: totals}
    for node in range(len(a)):
        t = arriving.pop(node)
        q, r = np.divmod(t, b[node])
        left = q * a[node] + (r * a[node] + phi[node]) // b[node]
        for child, value in ((left_row[node], left), (right_row[node], t - left)):
            if child < 0:
                out[:, -1 - child] = value
            else:
                arriving[child] = value
    return out


def _block_layout(phase: Phase, blocks: IntArray, counts: IntArray) -> tuple[IntArray, IntArray]:
    """For blocks ``(nb,)`` with per-source counts ``(nb, S)``: source and within-source rank,
    ``(nb, 16)``."""
    nb, num_sources = counts.shape
    rows = np.arange(nb, dtype=np.int64)[:, None]
    ctr = (blocks[:, None] * BLOCK + _J[None, :] + 1).astype(np.uint64)
    by_hash = np.argsort(mix64(np.uint64(phase.key) + ctr * _GAMMA), axis=1, kind="stable")
    by_rank = np.repeat(np.tile(np.arange(num_sources, dtype=np.int64), nb), counts.reshape(-1))
    src = np.empty(nb * BLOCK, dtype=np.int64)
    src[(by_hash + rows * BLOCK).reshape(-1)] = by_rank  # the r-th smallest hash gets by_rank[r]
    src = src.reshape(nb, BLOCK)
    grouped = (
        np.argsort(src, axis=1, kind="stable") + rows * BLOCK
    )  # by source, position order inside
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
        bounds = _tree_counts(
            phase, np.arange(int(blocks[0]), int(blocks[-1]) + 2, dtype=np.int64) * BLOCK
        )
        return bounds[:-1], np.diff(bounds, axis=0)
    both = _tree_counts(phase, np.concatenate((blocks, blocks + 1)) * BLOCK)
    start = both[: blocks.size]
    return start, both[blocks.size :] - start


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


def old_assign(schedule: MixtureSchedule, positions: IntArray) -> tuple[IntArray, IntArray]:
    """The old ``MixtureSchedule.assign`` (on checked int64 positions)."""
    flat = positions.reshape(-1)
    if len(schedule.phases) == 1:
        src, index = _locate_in_phase(schedule.phases[0], flat)
        return src.reshape(positions.shape), index.reshape(positions.shape)
    src = np.empty(flat.size, dtype=np.int64)
    index = np.empty(flat.size, dtype=np.int64)
    starts = np.array([p.start for p in schedule.phases], dtype=np.int64)
    which = np.searchsorted(starts, flat, side="right") - 1
    for p in np.unique(which):
        sel = which == p
        phase = schedule.phases[int(p)]
        src[sel], index[sel] = _locate_in_phase(phase, flat[sel] - phase.start)
    return src.reshape(positions.shape), index.reshape(positions.shape)


# --------------------------------------------------------------------- strategies
@st.composite
def schedules(draw: st.DrawFn, max_sources: int = 40) -> MixtureSchedule:
    """Random integer weights (zeros allowed, at least one positive per phase, total < 2**31),
    1-3 phases, any seed."""
    num = draw(st.integers(1, max_sources))
    big = draw(st.booleans())
    weight = st.integers(0, (1 << 31) // (num + 1) if big else 20)
    starts = [0, *sorted(draw(st.sets(st.integers(1, 10**6), max_size=2)))]
    phases = []
    for _ in starts:
        w = [draw(weight) for _ in range(num)]
        if not any(w):
            w[draw(st.integers(0, num - 1))] = 1
        phases.append(tuple(w))
    return MixtureSchedule.build(draw(st.integers(0, MASK)), starts, phases)


@st.composite
def positions(draw: st.DrawFn) -> IntArray:
    """Random positions in [0, 2**62), contiguous runs, repeats, near phase starts, any order."""
    kind = draw(st.sampled_from(["random", "contiguous", "mixed", "small"]))
    rng = np.random.default_rng(draw(st.integers(0, MASK)))
    size = draw(st.integers(0, 600))
    if kind == "random":
        return rng.integers(0, 1 << 62, size=size, dtype=np.int64)
    if kind == "small":
        return rng.integers(0, 3 * 10**6, size=size, dtype=np.int64)
    start = draw(st.integers(0, (1 << 62) - 10**4))
    run = np.arange(start, start + size, dtype=np.int64)
    if kind == "contiguous":
        return run
    return rng.permutation(np.concatenate([run, run[: size // 3], rng.integers(0, 10**6, 50)]))


# --------------------------------------------------------------------- new == old
@HYP
@given(schedule=schedules(), pos=positions())
def test_assign_equals_the_old_dense_implementation(
    schedule: MixtureSchedule, pos: IntArray
) -> None:
    src, index = schedule.assign(pos)
    old_src, old_index = old_assign(schedule, pos)
    np.testing.assert_array_equal(src, old_src)
    np.testing.assert_array_equal(index, old_index)


@HYP
@given(schedule=schedules(), pos=positions())
def test_both_strategies_equal_old(schedule: MixtureSchedule, pos: IntArray) -> None:
    """Per-position tree paths (random access) and whole blocks (contiguous requests, with
    its Python-int path for one or two blocks) give the same as the old code on any input."""
    phase = schedule.phases[0]
    local = pos[pos < (schedule.phases[1].start if len(schedule.phases) > 1 else 1 << 62)]
    expected = _locate_in_phase(phase, local)
    for size in (len(local), 1, 17, 40):  # 1 and 17 positions: one or two blocks
        part = local[:size]
        if not part.size:
            continue
        blocks, inverse = mx._unique_sorted(part >> 4)
        for strategy in (mx._locate_by_path, mx._locate_by_block):
            src, index = strategy(phase, part, blocks, inverse)
            np.testing.assert_array_equal(src, expected[0][:size])
            np.testing.assert_array_equal(index, expected[1][:size])


@settings(max_examples=8, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(schedule=schedules(max_sources=600), pos=positions())
def test_assign_equals_old_with_many_sources(schedule: MixtureSchedule, pos: IntArray) -> None:
    src, index = schedule.assign(pos)
    old_src, old_index = old_assign(schedule, pos)
    np.testing.assert_array_equal(src, old_src)
    np.testing.assert_array_equal(index, old_index)


@HYP
@given(schedule=schedules(), position=st.integers(0, 3 * 10**6))
def test_consumed_equals_old_prefix_counts(schedule: MixtureSchedule, position: int) -> None:
    """`consumed` (now a sparse partial block) against old `_boundary_counts`/`_block_layout`
    of the phase in effect, plus its offsets."""
    starts = [p.start for p in schedule.phases]
    phase = schedule.phases[int(np.searchsorted(starts, position, side="right")) - 1]
    k, j = divmod(position - phase.start, BLOCK)
    blocks = np.array([k], dtype=np.int64)
    start, counts = _boundary_counts(phase, blocks)
    total = start[0].copy()
    if j:
        src, _ = _block_layout(phase, blocks, counts)
        total += np.bincount(src[0, :j], minlength=len(phase.weights))
    expected = tuple(int(o + t) for o, t in zip(phase.offsets, total, strict=True))
    assert schedule.consumed(position) == expected


def test_shapes_and_empty() -> None:
    schedule = MixtureSchedule.build(3, [0], [(1, 2, 3)])
    pos = np.arange(24, dtype=np.int64).reshape(2, 3, 4)
    src, index = schedule.assign(pos)
    assert src.shape == index.shape == (2, 3, 4)
    old_src, old_index = old_assign(schedule, pos)
    np.testing.assert_array_equal(src, old_src)
    np.testing.assert_array_equal(index, old_index)
    src, index = schedule.assign(np.zeros(0, dtype=np.int64))
    assert src.shape == index.shape == (0,)


# --------------------------------------------------------------------- memory: bounded
def _peak(fn: Callable[[], object]) -> int:
    tracemalloc.start()
    try:
        fn()
        return tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


def _assign_peak(sources: int, size: int) -> int:
    schedule = MixtureSchedule.build(11, [0], [tuple(range(1, sources + 1))])
    pos = np.random.default_rng(0).integers(0, 10**15, size=size, dtype=np.int64)
    schedule.assign(pos[:10])  # warm (imports, caches)
    return _peak(lambda: schedule.assign(pos))


def test_memory_does_not_grow_with_sources_times_positions() -> None:
    """Random positions (one distinct block each): the dense code held several
    ``blocks x sources`` int64 arrays (2,000 sources x 20,000 blocks: >= 320 MB each).
    Now the peak is a bound per call plus the outputs: 5x the positions add at most
    40 bytes per added position, and 1,000x the sources at most 3x the peak."""
    few, many = _assign_peak(2, 20_000), _assign_peak(2000, 20_000)
    assert many < 48 * 2**20, many
    assert many < 3 * few, (few, many)
    more = _assign_peak(2000, 100_000)
    assert more < many + 40 * 80_000, (many, more)


def test_long_requests_in_chunks_equal_old() -> None:
    """More positions than one vectorised pass (chunked): the same as the old code, over
    three phases, random and contiguous positions, with zero weights."""
    weights = [tuple((i * 7919) % 13 for i in range(1, 301)), (0,) * 299 + (5,)]
    weights.append(tuple(range(300, 0, -1)))
    schedule = MixtureSchedule.build(99, [0, 40_000, 90_001], weights)
    rng = np.random.default_rng(5)
    pos = np.concatenate(
        [rng.integers(0, 200_000, 30_000), np.arange(35_000, 60_000), rng.integers(0, 1 << 62, 9)]
    ).astype(np.int64)
    for request in (pos, np.sort(pos)):
        src, index = schedule.assign(request)
        old_src, old_index = old_assign(schedule, request)
        np.testing.assert_array_equal(src, old_src)
        np.testing.assert_array_equal(index, old_index)
