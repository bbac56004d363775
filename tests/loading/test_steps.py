"""The optimizer step as a unit of the loader (issue 31): the state says where in its global
step it was saved, a resume from inside a step re-delivers the whole step unless
``mid_step="continue"`` is asked for, ``len()`` counts whole global steps, and a stale
iterator raises instead of ending quietly. Every expectation is an uninterrupted plain loader's
output (ids of the rows delivered), never a number read off the code under test."""

from __future__ import annotations

import json
import logging
from typing import Any

import numpy as np
import pytest

import detdata

N, GBS, MICRO = 100, 8, 2


def dataset(n: int = N) -> detdata.ArrayDataset:
    return detdata.ArrayDataset({"id": np.arange(n, dtype=np.int64)}, name=f"steps-{n}")


def loader(**kw: Any) -> detdata.DataLoader:
    args: dict[str, Any] = dict(global_batch_size=GBS, micro_batch_size=MICRO, seed=5)
    return detdata.DataLoader(dataset(kw.pop("n", N)), **(args | kw))


def ids(dl: detdata.DataLoader, count: int) -> list[list[int]]:
    it = iter(dl)
    return [next(it)["id"].tolist() for _ in range(count)]


REFERENCE = ids(loader(), 40)  # uninterrupted: 10 steps x 4 micro batches


def saved_after(micro_batches: int, **kw: Any) -> dict[str, Any]:
    dl = loader(**kw)
    ids(dl, micro_batches)
    return json.loads(json.dumps(dl.state_dict()))


@pytest.mark.parametrize("delivered", [0, 1, 3, 4, 5, 22])
def test_the_state_says_where_in_its_step_it_was_saved(delivered: int) -> None:
    state = saved_after(delivered)
    step, into = divmod(delivered, GBS // MICRO)
    assert state["step_position"] == {
        "step": step,
        "first_position": step * GBS,
        "global_batch_size": GBS,
        "delivered_in_step": into * MICRO,
    }


@pytest.mark.parametrize("delivered", [1, 2, 3, 21])
def test_a_mid_step_state_re_delivers_the_whole_step_by_default(
    delivered: int, caplog: pytest.LogCaptureFixture
) -> None:
    """Saved after micro batch 1..3 of a step: the resume starts at the step's first micro
    batch (the uninterrupted run's), and says so in a warning naming the step."""
    state = saved_after(delivered)
    first = delivered - delivered % (GBS // MICRO)
    resumed = loader()
    with caplog.at_level(logging.WARNING, logger="detdata.loader"):
        resumed.load_state_dict(state)
    assert f"re-delivering step {first // 4} whole" in caplog.text
    assert resumed.samples_consumed == first * MICRO
    assert ids(resumed, 40 - first) == REFERENCE[first:]


@pytest.mark.parametrize("how", ["continue", detdata.MidStep.CONTINUE])
def test_continuing_mid_step_is_asked_for_by_name(how: Any) -> None:
    state = saved_after(6)
    resumed = loader()
    resumed.load_state_dict(state, mid_step=how)
    assert ids(resumed, 34) == REFERENCE[6:]
    by_default = loader(
        options=detdata.LoaderOptions(resume=detdata.ResumePolicy(mid_step=how))
    )  # for callers that call load_state_dict(state)
    by_default.load_state_dict(state)
    assert ids(by_default, 34) == REFERENCE[6:]
    redo = loader(options=detdata.LoaderOptions(resume=detdata.ResumePolicy(mid_step="continue")))
    redo.load_state_dict(state, mid_step="redo")  # the call's own choice wins
    assert ids(redo, 36) == REFERENCE[4:]


def test_a_step_boundary_state_resumes_where_it_was() -> None:
    state = saved_after(8)
    resumed = loader()
    resumed.load_state_dict(state)
    assert ids(resumed, 32) == REFERENCE[8:]


def test_mid_step_redo_at_another_layout_and_after_a_mid_step_layout_change() -> None:
    """World 2 x micro 2 saved after one micro step of step 2 (position 20): resumed at world 1
    x micro 4 it re-delivers step 2 from 16. A state saved mid-step after a mid-step
    ``continue`` resume that changed the layout (a history entry inside the step) rewinds too."""
    ranks = [loader(options=detdata.LoaderOptions(rank=r, world_size=2)) for r in range(2)]
    for dl in ranks:
        ids(dl, 5)  # steps 0-1 (2 micro steps each) and one micro step of step 2
    state = ranks[0].state_dict()
    assert state["samples_consumed"] == 20
    one = loader(micro_batch_size=4)
    one.load_state_dict(state)
    assert one.samples_consumed == 16
    flat = [i for b in ids(one, 6) for i in b]
    assert flat == [i for b in REFERENCE[8:20] for i in b]
    # continue at world 1 x micro 2 (a history entry at 20, inside step 2), deliver one more
    # micro batch (to 22), save, and resume by default: step 2 again from 16
    cont = loader()
    cont.load_state_dict(state, mid_step="continue")
    assert cont.history[-1]["position"] == 20
    assert ids(cont, 1) == REFERENCE[10:11]
    again = loader(micro_batch_size=4)
    again.load_state_dict(json.loads(json.dumps(cont.state_dict())))
    assert again.samples_consumed == 16
    assert [i for b in ids(again, 2) for i in b] == [i for b in REFERENCE[8:12] for i in b]


def test_a_bad_mid_step_value_is_refused() -> None:
    with pytest.raises(detdata.ConfigError, match="mid_step must be 'redo'"):
        loader().load_state_dict(saved_after(1), mid_step="skip")
    with pytest.raises(detdata.ConfigError, match=r"ResumePolicy\.mid_step must be 'redo'"):
        loader(options=detdata.LoaderOptions(resume=detdata.ResumePolicy(mid_step=True)))


@pytest.mark.parametrize(("n", "want_steps"), [(100, 12), (96, 12), (7, 1), (8, 1), (17, 2)])
def test_len_counts_whole_global_steps(n: int, want_steps: int) -> None:
    """len() is the micro batches of the whole global steps within one pass (at least one
    step): a trainer that steps every 4 micro batches and at each epoch's end never takes a
    short step; epoch after epoch its step k holds the uninterrupted loader's step k."""
    dl = loader(n=n)
    assert len(dl) == want_steps * GBS // MICRO
    flat = iter(loader(n=n))
    want = [[next(flat)["id"].tolist() for _ in range(4)] for _ in range(3 * want_steps)]
    steps: list[list[list[int]]] = []
    for _epoch in range(3):  # what Lightning / HF Trainer do: len(loader) batches an epoch
        it = iter(dl)
        micro = [next(it)["id"].tolist() for _ in range(len(dl))]
        steps.extend(micro[i : i + 4] for i in range(0, len(micro), 4))
    assert steps == want


def test_len_with_world_size_and_total_samples() -> None:
    assert (
        len(loader(n=100, options=detdata.LoaderOptions(rank=1, world_size=2))) == 12 * 2
    )  # 2 micro steps a step
    assert len(loader(options=detdata.LoaderOptions(total_samples=48))) == 24


def _loop_until_stale(dl: detdata.DataLoader, action: Any) -> int:
    count = 0
    for _batch in dl:
        count += 1
        if count == 3:
            action()
        if count > 50:
            break
    return count


def test_load_state_dict_inside_the_loop_makes_the_iterator_raise() -> None:
    dl = loader()
    state = saved_after(2)
    with pytest.raises(detdata.StaleIteratorError, match=r"load_state_dict\(\)"):
        _loop_until_stale(dl, lambda: dl.load_state_dict(state))
    assert ids(dl, 2) == REFERENCE[0:2]  # a new loop continues at the loaded state (redo: 0)


@pytest.mark.parametrize("workers", [0, 2])
def test_a_second_iter_makes_the_first_iterator_raise(workers: int) -> None:
    dl = loader(
        num_workers=workers,
        options=detdata.LoaderOptions(read=detdata.ReadOptions(worker_mode="thread")),
    )
    first = iter(dl)
    assert next(first)["id"].tolist() == REFERENCE[0]
    second = iter(dl)
    with pytest.raises(detdata.StaleIteratorError, match=r"a second iter\(\)") as err:
        next(first)
    assert isinstance(err.value, RuntimeError)
    assert next(second)["id"].tolist() == REFERENCE[1]  # the new one continues the stream
    with pytest.raises(detdata.StaleIteratorError):
        next(first)  # and stays stale


def test_check_trainer_batch_names_both_sides_and_the_fix() -> None:
    dl = loader()
    dl.check_trainer_batch(
        micro_batch_size=2, accumulation=4, world_size=1, trainer="T", fix="accum={accumulation}"
    )
    with pytest.raises(detdata.ConfigError, match=r"3 micro batch.*global batch is 8.*accum=4"):
        dl.check_trainer_batch(
            micro_batch_size=2,
            accumulation=3,
            world_size=1,
            trainer="T",
            fix="accum={accumulation}",
        )


def test_at_step_resumes_at_the_trainers_step() -> None:
    """``at_step`` (an integration's restored optimizer step): the saved step's start, or the
    step before when the state was saved at its end before the trainer stepped (the last micro
    batch counted); anything further is refused, naming the saved position."""
    at_end = saved_after(12)  # 3 whole steps delivered: position 24
    for step, first in ((3, 12), (2, 8)):
        resumed = loader()
        resumed.load_state_dict(at_end, at_step=step)
        assert ids(resumed, 40 - first) == REFERENCE[first:]
    inside = saved_after(13)  # one micro batch into step 3
    resumed = loader()
    resumed.load_state_dict(inside, at_step=3)
    assert ids(resumed, 28) == REFERENCE[12:]
    for state, step in ((at_end, 1), (inside, 2), (inside, 4), (at_end, 4)):
        with pytest.raises(detdata.StateError, match="cannot resume at step"):
            loader().load_state_dict(state, at_step=step)


@pytest.mark.parametrize("how", ["continue", detdata.MidStep.CONTINUE])
def test_at_step_with_mid_step_continue_is_refused_naming_both(how: Any) -> None:
    """``at_step`` resumes at a step's first position, ``mid_step="continue"`` after the
    delivered part of it: asked together they contradict, and the call is refused (a
    `ConfigError` naming both, with a hint), leaving the loader where it was. ``at_step`` with
    ``mid_step="redo"``, or with a policy whose default is continue, resumes at the step."""
    inside = saved_after(13)  # one micro batch into step 3
    resumed = loader()
    with pytest.raises(detdata.ConfigError, match=r"at_step.*mid_step='continue'.*hint:"):
        resumed.load_state_dict(inside, at_step=3, mid_step=how)
    assert resumed.samples_consumed == 0 and ids(resumed, 2) == REFERENCE[:2]
    policy = detdata.LoaderOptions(resume=detdata.ResumePolicy(mid_step="continue"))
    for ok, mid_step in ((loader(), "redo"), (loader(options=policy), None)):
        ok.load_state_dict(inside, at_step=3, mid_step=mid_step)
        assert ids(ok, 28) == REFERENCE[12:]
