"""The loader's cursor alone (`detdata.loading.cursor`, issue 42): it counts micro batches
on the step grid, saves and resumes its position (a mid-step state redone or continued), and
its generations make older iterators stale; checked against arithmetic by hand."""

from __future__ import annotations

import numpy as np
import pytest

import detdata
from detdata.loading.cursor import Cursor, Definition
from detdata.loading.history import as_schedule
from detdata.loading.layout import Placement

WORKERS = {"num_workers": 0, "worker_mode": "process"}


def cursor(seed: int = 5, total: int | None = None, **policy: object) -> Cursor:
    data = detdata.ArrayDataset({"x": np.arange(100, dtype=np.int64)})
    definition = Definition.of(data, seed=seed, order=None, schedule=as_schedule(8), transform=None)
    # global batch 8 = micro batch 2 x world 2 x 2 micro steps; this is rank 1
    return Cursor(
        definition,
        Placement(8, 2, 1, 2),
        total_samples=total,
        policy=detdata.ResumePolicy(**policy),  # type: ignore[arg-type]
    )


def test_it_counts_micro_steps_on_the_step_grid() -> None:
    c = cursor()
    assert c.positions_of_next().tolist() == [2, 3]  # rank 1 of micro step 0
    for _ in range(5):
        c.advance()
    assert c.samples_consumed == 5 * 4 and c.step == 20 // 8
    assert c.positions_of_next().tolist() == [22, 23]
    assert (c.plan.start_of(3), c.plan.step_of(23)) == (24, 2)
    span = c.step_span()
    assert (span.step, span.start, span.size, span.next) == (2, 16, 8, 24)


def test_a_saved_position_resumes_redone_or_continued() -> None:
    c = cursor()
    for _ in range(5):  # 20 samples: inside step 2 (positions 16..23)
        c.advance()
    state = c.state_dict(WORKERS)
    redo = cursor()
    redo.load_state_dict(state)
    assert redo.samples_consumed == 16  # the step's first position: the step is redone
    cont = cursor(mid_step="continue")
    cont.load_state_dict(state)
    assert cont.samples_consumed == 20
    with pytest.raises(detdata.StateError, match="seed"):
        cursor(seed=6).load_state_dict(state)
    bounded = cursor(total=16)
    with pytest.raises(detdata.StateError, match="beyond this loader's total_samples 16"):
        bounded.load_state_dict(state, mid_step="continue")
    assert bounded.samples_consumed == 0  # a refused resume moves nothing


def test_a_move_makes_earlier_generations_stale() -> None:
    c = cursor()
    first = c.generation
    c.supersede("a second iter() started a new iterator")
    assert c.generation == first + 1
    assert "a second iter() started a new iterator" in str(c.stale())
    c.load_state_dict(cursor().state_dict(WORKERS))
    assert c.generation == first + 2
