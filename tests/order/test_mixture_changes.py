"""`change_schedule` (issue 44): a weight change is a phase of the ``mixture-v1`` schedule.

References: the schedule built from scratch by `MixtureSchedule.build` with the phases the
changes make (latest change at a position wins, a change to the weights in force adds no
phase: written here from the contract), and the scalar reference of mixture-v1 written from
its docstring (tests/datasets/test_mixture.py `Ref`) at sampled positions.
"""

from __future__ import annotations

import random
from fractions import Fraction

import numpy as np
import pytest

from detdata.base.errors import ConfigError
from detdata.order.mixing import MixtureSchedule
from detdata.order.mixture_changes import change_schedule
from tests.datasets.test_mixture import Ref
from tests.soak import rounds


def expected_phases(
    w0: tuple[int, ...], changes: list[tuple[int, tuple[int, ...]]]
) -> list[tuple[int, tuple[int, ...]]]:
    phases = [(0, w0)]
    for position, w in changes:
        phases = [ph for ph in phases if ph[0] < position]
        if not phases or phases[-1][1] != w:
            phases.append((position, w))
    return phases


def reduced(w: tuple[int, ...]) -> tuple[int, ...]:
    import math

    g = math.gcd(*w)
    return tuple(v // g for v in w)


def random_changes(
    rng: random.Random, sources: int, count: int
) -> list[tuple[int, tuple[int, ...]]]:
    """Changes at ascending step starts (some repeated: a change replaced before it took
    effect; some to the weights in force)."""
    out: list[tuple[int, tuple[int, ...]]] = []
    position = 0
    for _ in range(count):
        position += rng.choice([0, 16, 48, 13 * 8, 256]) if out else rng.choice([0, 64])
        w = (
            out[-1][1]
            if out and rng.random() < 0.1
            else reduced(tuple(rng.randint(1, 9) for _ in range(sources)))
        )
        out.append((position, w))
    return out


@pytest.mark.parametrize("case", range(6))
def test_changes_one_at_a_time_equal_the_schedule_built_whole(case: int) -> None:
    rng = random.Random(440 + case)
    sources = 3 + case % 3
    seed = rng.randrange(2**63)
    w0 = reduced(tuple(rng.randint(1, 9) for _ in range(sources)))
    changes = random_changes(rng, sources, 60)
    phases = expected_phases(w0, changes)
    whole = MixtureSchedule.build(seed, [s for s, _ in phases], [w for _, w in phases])
    step = MixtureSchedule.build(seed, [0], [w0])
    for change in changes:  # as a run applies them: one at a time
        step = change_schedule(step, seed, [change])
    at_once = change_schedule(MixtureSchedule.build(seed, [0], [w0]), seed, changes)
    end = phases[-1][0] + 200
    pos = np.arange(end, dtype=np.int64)
    for got in (step, at_once):
        assert [(p.start, p.weights) for p in got.phases] == phases
        assert [p.offsets for p in got.phases] == [p.offsets for p in whole.phases]
        for a, b in zip(got.assign(pos), whole.assign(pos), strict=True):
            assert np.array_equal(a, b)
    ref = Ref(
        seed, [str(i) for i in range(sources)], [(s, [Fraction(v) for v in w]) for s, w in phases]
    )
    for g in rng.sample(range(end), 40):
        src, index = step.assign(np.array([g]))
        assert (int(src[0]), int(index[0])) == ref.locate(g), g
    # each source's stream continues across every change: indices in position order are
    # 0, 1, 2, ... per source (no repeat, no skip)
    src, index = step.assign(pos)
    for s in range(sources):
        assert index[src == s].tolist() == list(range(int((src == s).sum())))


def test_planned_phases_after_a_change_follow_it_again() -> None:
    """A curriculum phase planned after the change position stays (latest event wins)."""
    seed = 5
    planned = MixtureSchedule.build(seed, [0, 160], [(1, 1, 1), (1, 2, 3)])
    got = change_schedule(planned, seed, [(64, (5, 1, 1))])
    assert [(p.start, p.weights) for p in got.phases] == [
        (0, (1, 1, 1)),
        (64, (5, 1, 1)),
        (160, (1, 2, 3)),
    ]
    whole = MixtureSchedule.build(seed, [0, 64, 160], [(1, 1, 1), (5, 1, 1), (1, 2, 3)])
    pos = np.arange(400, dtype=np.int64)
    assert all(
        np.array_equal(a, b) for a, b in zip(got.assign(pos), whole.assign(pos), strict=True)
    )
    same = change_schedule(planned, seed, [(64, (1, 1, 1))])
    assert same is planned  # the weights in force: nothing changes


def test_ten_thousand_changes_lookup_and_consumed() -> None:
    """10,000 changes (bounded: 2,000): lookups and consumed counts equal the whole build."""
    n = rounds(10_000, 2_000)
    rng = random.Random(4404)
    w0 = (1, 1, 1, 1)
    changes = [
        (16 * (k + 1), reduced(tuple(rng.randint(1, 9) for _ in range(4)))) for k in range(n)
    ]
    phases = expected_phases(w0, changes)
    got = change_schedule(MixtureSchedule.build(3, [0], [w0]), 3, changes)
    whole = MixtureSchedule.build(3, [s for s, _ in phases], [w for _, w in phases])
    pos = np.array(rng.sample(range(16 * (n + 2)), 3000), dtype=np.int64)
    assert all(
        np.array_equal(a, b) for a, b in zip(got.assign(pos), whole.assign(pos), strict=True)
    )
    for g in pos[:50].tolist():
        assert got.consumed(g) == whole.consumed(g)
        assert got.phase_at(g).weights == whole.phase_at(g).weights


def test_bad_changes_are_refused() -> None:
    base = MixtureSchedule.build(1, [0], [(1, 2)])
    with pytest.raises(ConfigError, match="3 weights for 2 sources"):
        change_schedule(base, 1, [(16, (1, 2, 3))])
    with pytest.raises(ConfigError, match="position"):
        change_schedule(base, 1, [(-1, (1, 2))])
