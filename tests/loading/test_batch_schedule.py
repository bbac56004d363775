"""Global batch schedules in the loader, and elastic resume off the old grid (issue 14).

Every sample's bytes encode its id, so what a rank delivered is read back from the data
itself and compared with an uninterrupted reference (a one-rank loader over the same
positions, and `GlobalOrder` by position). Steps are checked against independent
arithmetic: Megatron-LM's ramp-up calculator re-implemented here, and the history entries.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest

import detdata
from detdata.base.errors import ConfigError, StateError
from detdata.loading.loader import DataLoader
from detdata.order.batches import BatchSchedule
from tests.resume_checker import check_resume_everywhere

N = 100_003  # rows; the worked example's window [20_478_976, 20_482_024) is inside one epoch
SEED = 17


def id_rows(n: int = N) -> detdata.ArrayDataset:
    """Row ``i`` is the 8 little-endian bytes of ``i``."""
    rows = np.arange(n, dtype="<u8").view(np.uint8).reshape(n, 8)
    return detdata.ArrayDataset({"row": rows}, name="ids")


DATA = id_rows()


def decode(batch: Any) -> list[int]:
    """The ids a delivered batch holds, read back from its bytes."""
    raw = np.ascontiguousarray(batch["row"].numpy())
    return [int(v) for v in raw.view("<u8").reshape(-1)]


def delivered(
    dl: DataLoader, count: int | None = None
) -> Iterator[tuple[int, list[int], list[int]]]:
    """``(step, positions, ids)`` of each micro batch, ``step`` read before it was delivered."""
    it = iter(dl)
    n = 0
    while count is None or n < count:
        step, positions = dl.step, dl.positions_of_next().tolist()
        try:
            batch = next(it)
        except StopIteration:
            return
        n += 1
        yield step, positions, decode(batch)


def positioned(dl: DataLoader, samples: int) -> DataLoader:
    """``dl`` resumed from its own state saved at ``samples`` consumed (a jump, not a replay)."""
    state = dl.state_dict()
    state["samples_consumed"] = samples
    dl.load_state_dict(state, mid_step="continue")
    return dl


def reference_ids(start: int, stop: int) -> list[int]:
    """Ids at positions ``[start, stop)`` from an uninterrupted one-rank run."""
    ref = positioned(DataLoader(DATA, global_batch_size=8, seed=SEED), start)
    ids = [i for _, _, batch in delivered(ref, (stop - start) // 8) for i in batch]
    by_order = detdata.GlobalOrder(N, SEED).ids(np.arange(start, stop)).tolist()
    assert ids == by_order
    return ids


def merge(per_rank: list[list[tuple[int, list[int], list[int]]]]) -> dict[int, list[int]]:
    """Per step, the ids of micro step 0 of ranks 0..D-1, then micro step 1, ... (position
    order, docs/design.md section 4)."""
    by_step: dict[int, list[list[list[int]]]] = {}
    for rank, records in enumerate(per_rank):
        for step, _, ids in records:
            by_step.setdefault(step, [[] for _ in per_rank])[rank].append(ids)
    out = {}
    for step, ranks in sorted(by_step.items()):
        assert len({len(r) for r in ranks}) == 1, f"ranks delivered unequal micro steps in {step}"
        out[step] = [i for k in range(len(ranks[0])) for r in ranks for i in r[k]]
    return out


# ------------------------------------------------------------ DP 8 -> DP 7
def start_from_history(history: list[dict[str, Any]], step: int) -> int:
    """First position of ``step`` from a history of constant global batches (each entry at a
    step boundary): the arithmetic a reader of the state does by hand."""
    entry = [e for e in history if "field" not in e and e["step"] <= step][-1]  # batch entries
    return int(entry["position"] + (step - entry["step"]) * entry["global_batch_size"])


def test_dp8_to_dp7_worked_example() -> None:
    """512 on DP 8 (micro 16 x 4 accumulation) loses a node at step 40,000 and resumes on DP 7
    at 504 (micro 24 x 3): nothing repeated or skipped, steps where the history says."""
    p_save, p_change = 39_998 * 512, 40_000 * 512

    def loader(
        rank: int, world: int, gbs: int, micro: int, mode: str = "process", **kw: Any
    ) -> DataLoader:
        return DataLoader(
            DATA,
            global_batch_size=gbs,
            micro_batch_size=micro,
            seed=SEED,
            options=detdata.LoaderOptions(
                rank=rank, world_size=world, read=detdata.ReadOptions(worker_mode=mode)
            ),
            **kw,
        )

    saved = loader(0, 8, 512, 16).state_dict()
    saved["samples_consumed"] = p_save  # the state a DP 8 run saved at step 39,998
    dp8, states = [], []
    for rank in range(8):
        dl = loader(rank, 8, 512, 16)
        dl.load_state_dict(saved, mid_step="continue")
        assert dl.step == 39_998
        dp8.append(list(delivered(dl, 2 * 4)))  # two steps of 4 micro steps
        states.append(dl.state_dict())
    state = states[0]
    assert all(s["samples_consumed"] == p_change for s in states)
    assert all(s["history"] == state["history"] for s in states)

    dp7 = []
    for rank in range(7):
        kw: dict[str, Any] = {}
        if rank == 3:
            kw = {"num_workers": 1}  # a worker process reads this rank's micro batches
        elif rank == 5:
            kw = {"num_workers": 2, "mode": "thread"}
        dl = loader(rank, 7, 504, 24, **kw)
        with pytest.raises(StateError) as err:
            dl.load_state_dict(state, mid_step="continue")  # a global-batch change is never silent
        assert err.value.fields == ("global_batch_size",)
        dl.load_state_dict(state, allow=("global_batch_size",), mid_step="continue")
        assert (dl.step, dl.global_batch_size, dl.samples_consumed) == (40_000, 504, p_change)
        dl.set_total_samples(p_change + 2 * 504)  # two steps, then the run ends by itself
        dp7.append(list(delivered(dl)))
        assert len(dp7[-1]) == 2 * 3 and dl.step == 40_002
        final = dl.state_dict()
        dl.close()

    history = final["history"]
    assert history == [
        {
            "position": 0,
            "step": 0,
            "global_batch_size": 512,
            "world_size": 8,
            "micro_batch_size": 16,
        },
        {
            "position": p_change,
            "step": 40_000,
            "global_batch_size": 504,
            "world_size": 7,
            "micro_batch_size": 24,
        },
        {
            "field": "global_batch_size",
            "position": p_change,
            "step": 40_000,
            "old": 512,
            "new": 504,
        },
    ]
    # every micro batch lies in the step the loader said, where the history puts that step
    for records in dp8 + dp7:
        for step, positions, ids in records:
            lo, hi = start_from_history(history, step), start_from_history(history, step + 1)
            assert lo <= positions[0] and positions[-1] < hi, (step, positions[0])
            assert ids == detdata.GlobalOrder(N, SEED).ids(np.array(positions)).tolist()
    resumed = loader(0, 7, 504, 24)
    resumed.load_state_dict(final, mid_step="continue")  # no change this time: the history is kept
    assert resumed.step == 40_002 and resumed.history == history
    for t in (0, 1, 39_998, 39_999, 40_000, 40_001, 40_002, 10**6):
        start = start_from_history(history, t)
        assert resumed.position_of_step(t) == start
        assert resumed.step_of_position(start) == t
        assert resumed.step_of_position(start - 1) == t - 1 if t else True
    # the union of what the 15 ranks delivered is the uninterrupted run, each sample once
    steps = {**merge(dp8), **merge(dp7)}
    assert sorted(steps) == [39_998, 39_999, 40_000, 40_001]
    assert [len(steps[t]) for t in sorted(steps)] == [512, 512, 504, 504]
    union = [i for t in sorted(steps) for i in steps[t]]
    end = p_change + 2 * 504
    assert union == reference_ids(p_save, end)
    assert len(set(union)) == len(union) == end - p_save


def test_dp7_at_the_old_global_batch_is_refused_naming_the_divisibility() -> None:
    with pytest.raises(ConfigError, match="global_batch_size 512 is not divisible by world_size 7"):
        DataLoader(DATA, global_batch_size=512, options=detdata.LoaderOptions(rank=0, world_size=7))


# ------------------------------------------------------------------ ramp-up
START, INC, RAMP, GBS = 4, 4, 48, 16  # Megatron: --global-batch-size 16 --rampup-batch-size 4 4 48
SCHEDULE = BatchSchedule.rampup(START, INC, RAMP, global_batch_size=GBS)


def megatron_steps(count: int) -> list[tuple[int, int]]:
    """``(first position, global batch)`` of steps ``0..count-1`` as Megatron-LM runs them:
    ``update_num_microbatches(consumed)`` before each step, then ``consumed += batch``."""
    per_increment = RAMP / ((GBS - START) // INC)
    out, consumed = [], 0
    for _ in range(count):
        batch = GBS if consumed > RAMP else START + int(consumed / per_increment) * INC
        out.append((consumed, batch))
        consumed += batch
    return out


STEPS = 12
EXPECTED = megatron_steps(STEPS)
MICRO_BATCHES = sum(b for _, b in EXPECTED) // 4  # per rank at micro 2 x world 2


def ramp_loader(
    rank: int = 0, world: int = 2, micro: int = 2, total: int | None = None, **kw: Any
) -> DataLoader:
    return DataLoader(
        DATA,
        global_batch_size=SCHEDULE,
        micro_batch_size=micro,
        seed=SEED,
        options=detdata.LoaderOptions(rank=rank, world_size=world, total_samples=total),
        **kw,
    )


def test_ramp_up_follows_megatron() -> None:
    assert [b for _, b in EXPECTED[:9]] == [4, 4, 4, 4, 8, 8, 12, 12, 16]
    per_rank = []
    for rank in range(2):
        dl = ramp_loader(rank)
        length = len(dl)
        records = list(delivered(dl, MICRO_BATCHES))
        assert len(dl) == length  # the micro batch is fixed: len is unchanged by the schedule
        assert dl.step == STEPS and dl.samples_consumed == sum(b for _, b in EXPECTED)
        per_rank.append(records)
    steps = merge(per_rank)
    assert sorted(steps) == list(range(STEPS))
    ids = reference_ids(0, sum(b for _, b in EXPECTED))
    for t, (start, batch) in enumerate(EXPECTED):
        assert steps[t] == ids[start : start + batch]  # step t is [c(t), c(t) + B(t))
    dl = ramp_loader()
    for t, (start, batch) in enumerate(EXPECTED):
        assert dl.position_of_step(t) == start and dl.step_of_position(start) == t
        positioned(dl, start)
        assert dl.step == t and dl.global_batch_size == batch


@pytest.mark.parametrize("rank", [0, 1])
def test_ramp_up_resumed_at_every_micro_batch_gives_the_same_bytes(rank: int) -> None:
    check_resume_everywhere(lambda: ramp_loader(rank), MICRO_BATCHES)


@pytest.mark.parametrize(("world", "micro"), [(1, 4), (4, 1)])
def test_ramp_up_stopped_at_every_step_and_resumed_on_another_world(world: int, micro: int) -> None:
    """Stop the DP 2 ramp at each step boundary, resume on ``world`` ranks: the steps after are
    the uninterrupted run's, and ``step`` stays right."""
    straight = [list(delivered(ramp_loader(r), MICRO_BATCHES)) for r in range(2)]
    reference = merge(straight)
    for stop in range(STEPS):
        first = ramp_loader(0)
        list(delivered(first, sum(b for _, b in EXPECTED[:stop]) // 4))
        state = json.loads(json.dumps(first.state_dict()))
        after = []
        for rank in range(world):
            dl = ramp_loader(rank, world, micro)
            dl.load_state_dict(state, mid_step="continue")
            assert dl.step == stop
            after.append(list(delivered(dl, sum(b for _, b in EXPECTED[stop:]) // (micro * world))))
        resumed = merge(after)
        assert resumed == {t: reference[t] for t in range(stop, STEPS)}
        assert dl.history[-1]["world_size"] == world


def test_schedule_arguments_are_validated() -> None:
    with pytest.raises(ConfigError, match="needs micro_batch_size"):
        DataLoader(DATA, global_batch_size=SCHEDULE)
    with pytest.raises(ConfigError, match=r"global batch 4 \(steps from 0, position 0"):
        iter(ramp_loader(world=2, micro=4))  # 4 x 2 = 8 does not divide the first batches
    with pytest.raises(ConfigError, match=r"global batch 16 \(steps from"):
        ramp_loader(world=2, micro=3)  # 6 divides no batch, not even the settled one
    with pytest.raises(ConfigError, match=r"total_samples 20 is not a step boundary.*\[16, 24\)"):
        ramp_loader(total=20)
    with pytest.raises(ConfigError, match=r"positive integer or a detdata\.BatchSchedule"):
        DataLoader(DATA, global_batch_size=[4, 8])  # type: ignore[arg-type]
    bounded = ramp_loader(total=24)
    assert [s for s, _, _ in delivered(bounded)] == [0, 1, 2, 3, 4, 4]
    assert bounded.samples_consumed == 24


def test_schedule_is_a_checked_field() -> None:
    dl = ramp_loader()
    list(delivered(dl, 4))
    state = dl.state_dict()
    assert state["global_batch_size"] == SCHEDULE.to_json()
    other = BatchSchedule.rampup(START, INC, RAMP + 4, global_batch_size=GBS)
    changed = DataLoader(
        DATA,
        global_batch_size=other,
        micro_batch_size=2,
        seed=SEED,
        options=detdata.LoaderOptions(rank=0, world_size=2),
    )
    with pytest.raises(StateError, match="global_batch_size") as err:
        changed.load_state_dict(state, mid_step="continue")
    assert err.value.fields == ("global_batch_size",)
    ramp_loader().load_state_dict(state, mid_step="continue")  # the same schedule: accepted


# ------------------------------------------------------ changes inside a step
def constant(gbs: int) -> DataLoader:
    return DataLoader(DATA, global_batch_size=gbs, micro_batch_size=4, seed=SEED)


def test_global_batch_change_inside_a_step_completes_that_step() -> None:
    """Saved 4 samples into step 1 at 8; resumed at 16: step 1 is [8, 24), step 2 [24, 40)."""
    run = constant(8)
    first = list(delivered(run, 3))
    resumed = constant(16)
    resumed.load_state_dict(run.state_dict(), allow=["global_batch_size"], mid_step="continue")
    assert (resumed.step, resumed.global_batch_size) == (1, 16)
    assert resumed.position_of_step(1) == 8 and resumed.position_of_step(2) == 24
    rest = list(delivered(resumed, 7))
    assert [s for s, _, _ in first + rest] == [0, 0, 1, 1, 1, 1, 2, 2, 2, 2]
    assert [i for _, _, ids in first + rest for i in ids] == reference_ids(0, 40)
    assert resumed.history == [
        {"position": 0, "step": 0, "global_batch_size": 8, "world_size": 1, "micro_batch_size": 4},
        {
            "position": 12,
            "step": 1,
            "global_batch_size": 16,
            "world_size": 1,
            "micro_batch_size": 4,
        },
        {"field": "global_batch_size", "position": 12, "step": 1, "old": 8, "new": 16},
    ]


def test_global_batch_change_refused_when_the_step_is_already_over_full() -> None:
    run = constant(16)
    list(delivered(run, 3))  # 12 samples of step 0
    smaller = constant(8)
    with pytest.raises(StateError, match="more than the new global batch 8"):
        smaller.load_state_dict(run.state_dict(), allow=["global_batch_size"], mid_step="continue")
    assert smaller.samples_consumed == 0 and smaller.history[-1]["global_batch_size"] == 8


def test_resume_with_total_samples_off_the_resumed_steps_is_refused_with_a_hint() -> None:
    run = constant(8)
    list(delivered(run, 2))
    bounded = DataLoader(
        DATA,
        global_batch_size=12,
        micro_batch_size=4,
        seed=SEED,
        options=detdata.LoaderOptions(total_samples=36),
    )
    with pytest.raises(StateError, match="set_total_samples"):
        bounded.load_state_dict(  # steps 8, 20, 32
            run.state_dict(), allow=["global_batch_size"], mid_step="continue"
        )


def test_rank_steps_are_the_global_step_on_every_rank() -> None:
    """Each rank's ``step`` and ``global_batch_size`` agree at every micro batch of the ramp."""
    loaders = [ramp_loader(r) for r in range(2)]
    iters = [iter(dl) for dl in loaders]
    for _ in range(MICRO_BATCHES):
        assert loaders[0].step == loaders[1].step
        assert loaders[0].global_batch_size == loaders[1].global_batch_size
        for it in iters:
            next(it)


def test_dp_change_after_a_ramp_up_resumes_from_the_saved_step() -> None:
    """Ramp 8, 16, 24 then 32 on 2 ranks x micro 4, saved past the ramp (position 336): 4 ranks
    x micro 8 (32 per micro step) fits every batch from the saved step on, so it resumes and the
    4 ranks together deliver exactly the positions an uninterrupted run delivers next; a fresh
    run with that layout is refused at iteration, naming the batch and step it does not fit."""
    sched = BatchSchedule.rampup(8, 8, 64, global_batch_size=32)

    def make(world: int, rank: int, micro: int) -> DataLoader:
        return DataLoader(
            DATA,
            global_batch_size=sched,
            micro_batch_size=micro,
            seed=SEED,
            options=detdata.LoaderOptions(rank=rank, world_size=world),
        )

    def by_position(loaders: list[DataLoader], count: int) -> dict[int, int]:
        got: dict[int, int] = {}
        for dl in loaders:
            for _, positions, ids in delivered(dl, count):
                for p, i in zip(positions, ids, strict=True):
                    assert p not in got, f"position {p} delivered twice"
                    got[p] = i
        return got

    first = [make(2, r, 4) for r in range(2)]
    before = by_position(first, 42)  # 42 micro steps of 8: a step end
    assert sorted(before) == list(range(336))
    assert [before[p] for p in range(336)] == reference_ids(0, 336)
    state = json.loads(json.dumps(first[0].state_dict()))
    assert state["samples_consumed"] == 336
    resumed = [make(4, r, 8) for r in range(4)]
    for dl in resumed:
        dl.load_state_dict(state, mid_step="continue")
    assert resumed[0].global_batch_size == 32
    got = by_position(resumed, 3)
    assert sorted(got) == list(range(336, 336 + 3 * 32))
    assert [got[p] for p in sorted(got)] == reference_ids(336, 336 + 3 * 32)
    with pytest.raises(ConfigError, match=r"global batch 8 \(steps from 0, position 0"):
        iter(make(4, 0, 8))
