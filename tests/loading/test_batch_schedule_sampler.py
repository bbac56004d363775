"""`DeterministicBatchSampler` under a batch-size ramp-up (issue 14).

References: the ids `GlobalOrder` gives at positions written out by hand (micro step ``j``
of rank ``r`` at DP 2, micro 2 is positions ``4j + 2r + {0, 1}``), and steps from Megatron-LM's
ramp-up rule re-implemented here.
"""

from __future__ import annotations

import json

import numpy as np
import pytest

import detdata
from detdata.base.errors import ConfigError, StateError
from detdata.loading.sampler import DeterministicBatchSampler, FrameworkBatchSampler
from detdata.order.batches import BatchSchedule

N, SEED = 2_003, 11
START, INC, RAMP, GBS = 4, 4, 48, 16  # Megatron: --global-batch-size 16 --rampup-batch-size 4 4 48
SCHEDULE = BatchSchedule.rampup(START, INC, RAMP, global_batch_size=GBS)


def megatron_steps(count: int) -> list[tuple[int, int]]:
    per_increment = RAMP / ((GBS - START) // INC)
    out, consumed = [], 0
    for _ in range(count):
        batch = GBS if consumed > RAMP else START + int(consumed / per_increment) * INC
        out.append((consumed, batch))
        consumed += batch
    return out


EXPECTED = megatron_steps(12)
TOTAL = sum(b for _, b in EXPECTED)


def sampler(rank: int, world: int = 2, micro: int = 2) -> DeterministicBatchSampler:
    return DeterministicBatchSampler(
        N,
        global_batch_size=SCHEDULE,
        micro_batch_size=micro,
        seed=SEED,
        rank=rank,
        world_size=world,
        total_samples=TOTAL,
    )


def step_of(position: int) -> int:
    return max(t for t, (start, _) in enumerate(EXPECTED) if start <= position)


def test_ramp_up_items_and_steps_are_the_hand_computed_ones() -> None:
    order = detdata.GlobalOrder(N, SEED)
    for rank in range(2):
        s = sampler(rank)
        got = []
        for j, items in enumerate(s):
            positions = np.array([4 * j + 2 * rank, 4 * j + 2 * rank + 1])
            assert items == order.ids(positions).tolist()
            got.append(items)
            assert s.step == step_of(s.samples_consumed) if s.samples_consumed < TOTAL else True
        assert len(got) == TOTAL // 4
        assert s.step == len(EXPECTED) and s.samples_consumed == TOTAL
    s = sampler(0)
    for t, (start, _) in enumerate(EXPECTED):
        assert s.position_of_step(t) == start and s.step_of_position(start) == t
    s.load_state_dict(dict(s.state_dict(), samples_consumed=EXPECTED[5][0]))
    assert (s.step, s.global_batch_size) == (5, EXPECTED[5][1])


def test_ramp_up_sampler_resumes_at_a_step_on_another_world() -> None:
    """Stopped at every micro batch on DP 2; resumed on DP 2, and on DP 1 x micro 4 at step
    boundaries (a position inside a step that the new layout cannot continue is refused)."""
    straight = [list(sampler(r)) for r in range(2)]
    for k in range(TOTAL // 4):
        first = sampler(0)
        it = iter(first)
        for _ in range(k):
            next(it)
        state = json.loads(json.dumps(first.state_after(k)))
        assert isinstance(state["global_batch_size"], dict)  # the schedule, as JSON
        for rank in range(2):
            again = sampler(rank)
            again.load_state_dict(state)
            assert list(again) == straight[rank][k:]
        one = sampler(0, world=1, micro=4)
        one.load_state_dict(state)  # 4 samples per micro step on both layouts: always fits
        merged = [a + b for a, b in zip(straight[0][k:], straight[1][k:], strict=True)]
        assert list(one) == merged


def test_schedule_is_checked_and_framework_sampler_refuses_it() -> None:
    state = sampler(0).state_dict()
    constant = DeterministicBatchSampler(N, global_batch_size=16, micro_batch_size=2, seed=SEED)
    with pytest.raises(StateError) as err:
        constant.load_state_dict(state)
    assert err.value.fields == ("global_batch_size",)
    with pytest.raises(ConfigError, match="needs micro_batch_size"):
        DeterministicBatchSampler(N, global_batch_size=SCHEDULE, seed=SEED)
    with pytest.raises(ConfigError, match=r"global batch 4 \(steps from 0.*not divisible"):
        iter(DeterministicBatchSampler(N, global_batch_size=SCHEDULE, micro_batch_size=8))
    with pytest.raises(ConfigError, match="not divisible"):  # not even the settled batch 16
        DeterministicBatchSampler(N, global_batch_size=SCHEDULE, micro_batch_size=32, seed=SEED)
    with pytest.raises(ConfigError, match="FrameworkBatchSampler takes one global batch"):
        FrameworkBatchSampler(N, global_batch_size=SCHEDULE, batch_size=4)  # type: ignore[arg-type]
    # constant global batches keep their int state field
    assert constant.state_dict()["global_batch_size"] == 16
