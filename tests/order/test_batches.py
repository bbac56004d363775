"""Batch schedules and the step <-> position map against brute force.

References are independent: Megatron-LM's ramp-up calculator re-implemented from its
published semantics (megatron/core/num_microbatches_calculator.py: ``update(consumed)``
before every step, then ``consumed += batch``), and a step-by-step walk of each schedule.
"""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from detdata.base.errors import ConfigError
from detdata.order.batches import BatchSchedule, BatchUnit, StepMap


def megatron_batch(consumed: int, start: int, inc: int, ramp: int, gbs: int) -> int:
    """`RampupBatchsizeNumMicroBatchesCalculator.update` (its float arithmetic included)."""
    num_increments = (gbs - start) // inc
    per_increment = ramp / num_increments
    if consumed > ramp:
        return gbs
    steps = int(consumed / per_increment)
    return start + steps * inc


def walk(batch_of_step: Any, steps: int) -> list[tuple[int, int]]:
    """``(start, batch)`` of steps ``0..steps-1``, one step after the other."""
    out, consumed = [], 0
    for t in range(steps):
        b = batch_of_step(t, consumed)
        out.append((consumed, b))
        consumed += b
    return out


def check_map(step_map: StepMap, expected: list[tuple[int, int]]) -> None:
    for t, (start, batch) in enumerate(expected):
        assert step_map.start_of(t) == start, t
        assert step_map.batch_of(t) == batch, t
        for p in (start, start + batch // 2, start + batch - 1):
            assert step_map.step_of(p) == t, (t, p)


@pytest.mark.parametrize(
    ("start", "inc", "ramp", "gbs"),
    [
        (32, 32, 1000, 256),
        (16, 16, 300, 64),
        (4, 4, 97, 32),  # a float per-increment (97 / 7)
        (8, 8, 3, 64),  # ramp shorter than the increments: several stages at one position
        (1, 1, 1, 2),
        (256, 128, 50_000, 1024),  # NeMo's documented example, scaled down
    ],
)
def test_rampup_matches_megatron(start: int, inc: int, ramp: int, gbs: int) -> None:
    schedule = BatchSchedule.rampup(start, inc, ramp, global_batch_size=gbs)
    assert schedule.unit is BatchUnit.SAMPLES and schedule.changes[-1][1] == gbs
    steps = ramp // start + 40
    expected = walk(lambda t, c: megatron_batch(c, start, inc, ramp, gbs), steps)
    check_map(StepMap([(0, schedule)]), expected)


@settings(max_examples=60, deadline=None)
@given(
    start=st.integers(1, 64),
    inc=st.integers(1, 64),
    n=st.integers(1, 12),
    ramp=st.integers(1, 5000),
)
def test_rampup_matches_megatron_everywhere(start: int, inc: int, n: int, ramp: int) -> None:
    gbs = start + n * inc
    schedule = BatchSchedule.rampup(start, inc, ramp, global_batch_size=gbs)
    expected = walk(lambda t, c: megatron_batch(c, start, inc, ramp, gbs), ramp // start + 5)
    check_map(StepMap([(0, schedule)]), expected)


def test_explicit_step_and_sample_changes() -> None:
    by_steps = BatchSchedule.by_steps([(0, 8), (3, 16), (5, 4)])
    expected = walk(lambda t, c: 8 if t < 3 else 16 if t < 5 else 4, 12)
    check_map(StepMap([(0, by_steps)]), expected)
    # sample changes take effect at the first step starting at or after them; a step may
    # cross two changes (40 -> 44 jumps over 41 and 43)
    changes = [(0, 8), (20, 4), (41, 12), (43, 2)]
    by_samples = BatchSchedule.by_samples(changes)

    def batch(t: int, c: int) -> int:
        return [b for at, b in changes if at <= c][-1]

    check_map(StepMap([(0, by_samples)]), walk(batch, 40))


def test_segments_follow_each_schedule_from_its_step() -> None:
    """A run at 512 changed to 504 at step 4, then to a ramp by samples at step 6."""
    ramp = BatchSchedule.by_samples([(0, 100), (3200, 200)])
    step_map = StepMap(
        [(0, BatchSchedule.constant(512)), (4, BatchSchedule.constant(504)), (6, ramp)]
    )

    def batch(t: int, c: int) -> int:
        if t < 4:
            return 512
        if t < 6:
            return 504
        return 100 if c < 3200 else 200

    check_map(step_map, walk(batch, 30))
    # a later segment at the same step replaces the earlier one
    again = StepMap([(0, BatchSchedule.constant(8)), (2, BatchSchedule.constant(4)), (2, ramp)])
    assert again.start_of(2) == 16 and again.batch_of(2) == 100


def test_identity_json_round_trip_and_equality() -> None:
    assert BatchSchedule.constant(512).to_json() == 512
    assert BatchSchedule.by_samples([(0, 8)]) == BatchSchedule.constant(8)  # constant: one form
    ramp = BatchSchedule.rampup(4, 4, 8, global_batch_size=12)
    assert ramp.to_json() == {"unit": "samples", "changes": [[0, 4], [4, 8], [8, 12]]}
    assert BatchSchedule.from_json(ramp.to_json()) == ramp
    assert BatchSchedule.by_samples([(0, 4), (4, 8), (8, 12)]) == ramp  # the same function
    assert BatchSchedule.from_json(512) == BatchSchedule.constant(512)
    assert BatchSchedule(changes=[[0, 4], [2, 8]], unit="steps").unit is BatchUnit.STEPS


@pytest.mark.parametrize(
    ("make", "match"),
    [
        (lambda: BatchSchedule.by_steps([(1, 8)]), r"start with \(0, global_batch\)"),
        (lambda: BatchSchedule.by_steps([]), r"start with \(0, global_batch\)"),
        (lambda: BatchSchedule.by_steps([(0, 8), (5, 16), (5, 32)]), r"changes\[2\] is at 5"),
        (lambda: BatchSchedule.by_steps([(0, 8), (5, 8)]), r"repeats the global batch 8"),
        (lambda: BatchSchedule.by_steps([(0, 0)]), r"changes\[0\] global batch"),
        (lambda: BatchSchedule.by_steps([(0, 8, 1)]), r"pair \(at, global_batch\)"),
        (lambda: BatchSchedule(changes=((0, 8), (1, 4)), unit="tokens"), r"unit must be one"),
        (lambda: BatchSchedule.rampup(32, 30, 100, global_batch_size=256), r"not divisible by"),
        (lambda: BatchSchedule.rampup(256, 32, 100, global_batch_size=256), r"must be below"),
        (lambda: BatchSchedule.rampup(32, 32, 0, global_batch_size=256), r"ramp_samples"),
        (lambda: BatchSchedule.from_json({"changes": [[0, 1]]}), r"keys"),
        (lambda: BatchSchedule.from_json("512"), r"global_batch_size must be an integer"),
    ],
)
def test_bad_schedules_refused_naming_the_entry(make: Any, match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        make()


def test_step_map_refuses_bad_segments() -> None:
    with pytest.raises(ConfigError, match="step 0"):
        StepMap([(3, BatchSchedule.constant(8))])
    with pytest.raises(ConfigError, match="go back"):
        StepMap(
            [
                (0, BatchSchedule.constant(8)),
                (5, BatchSchedule.constant(4)),
                (2, BatchSchedule.constant(2)),
            ]
        )


def test_far_positions_cost_changes_not_steps() -> None:
    """Position 2**61 with a long ramp: compiled in O(changes) (no walk over steps)."""
    schedule = BatchSchedule.rampup(1, 1, 10**6, global_batch_size=1000)
    step_map = StepMap([(0, schedule)])
    pieces = step_map.pieces
    assert len(pieces) == 1000 and pieces[-1].batch == 1000
    last = pieces[-1]
    far = 1 << 61
    t = step_map.step_of(far)
    assert t == last.step + (far - last.position) // 1000
    assert step_map.start_of(t) <= far < step_map.start_of(t + 1)
