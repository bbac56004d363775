"""The loader state's ``history`` (format 3): written, read back, upgraded, checked.

A history that disagrees with the rest of the state, or with itself, was edited or
corrupted: it is refused naming ``history`` rather than mapping steps to the wrong
positions.
"""

from __future__ import annotations

import copy
import io
import json
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
import torch

import detdata
from detdata.base.errors import StateError
from detdata.loading.loader import DataLoader
from detdata.loading.state import READABLE_VERSIONS, STATE_VERSION
from detdata.order.batches import BatchSchedule

DATA = detdata.ArrayDataset({"id": np.arange(500, dtype=np.int64)})


def loader(gbs: int | BatchSchedule = 8, micro: int = 4) -> DataLoader:
    return DataLoader(DATA, global_batch_size=gbs, micro_batch_size=micro, seed=3)


def saved_after(dl: DataLoader, batches: int) -> dict[str, Any]:
    it = iter(dl)
    for _ in range(batches):
        next(it)
    return json.loads(json.dumps(dl.state_dict()))


def test_history_is_written_as_plain_json() -> None:
    state = saved_after(loader(), 3)
    assert state["format_version"] == STATE_VERSION == 5 and READABLE_VERSIONS == (1, 2, 3, 4, 5)
    assert state["history"] == [
        {"position": 0, "step": 0, "global_batch_size": 8, "world_size": 1, "micro_batch_size": 4}
    ]
    buffer = io.BytesIO()
    torch.save(state, buffer)
    buffer.seek(0)
    assert torch.load(buffer, weights_only=True) == state  # plain types only


def test_format_2_state_is_read_with_a_one_entry_history() -> None:
    state = saved_after(loader(), 5)
    old = {k: v for k, v in state.items() if k != "history"}
    old["format_version"] = 2
    resumed = loader(micro=2)  # another layout: a new history entry at the saved position
    resumed.load_state_dict(old, mid_step="continue")
    assert resumed.samples_consumed == 20 and resumed.step == 2
    assert resumed.history == [
        {"position": 0, "step": 0, "global_batch_size": 8, "world_size": 1, "micro_batch_size": 4},
        {"position": 20, "step": 2, "global_batch_size": 8, "world_size": 1, "micro_batch_size": 2},
    ]


def _set(path: tuple[Any, ...], value: Any) -> Callable[[dict[str, Any]], None]:
    def edit(state: dict[str, Any]) -> None:
        target = state
        for key in path[:-1]:
            target = target[key]
        target[path[-1]] = value

    return edit


def _append(entry: dict[str, Any]) -> Callable[[dict[str, Any]], None]:
    return lambda state: state["history"].append(entry)


ENTRY = {"position": 40, "step": 5, "global_batch_size": 4, "world_size": 1, "micro_batch_size": 4}


@pytest.mark.parametrize(
    ("edit", "match"),
    [
        (_set(("history",), "[]"), "must be a list"),
        (_set(("history",), []), "non-empty list"),
        (_set(("history", 0, "position"), 8), "must start at position 0, step 0"),
        (_set(("history", 0, "step"), -1), r"history\[0\]\.step must be a non-negative"),
        (_set(("history", 0, "global_batch_size"), 16), "history ends with the global batch 16"),
        (_set(("history", 0, "global_batch_size"), {"unit": "steps"}), r"history\[0\]"),
        (_set(("history", 0, "world_size"), 0), r"world_size must be a positive"),
        (_set(("history", 0), {"position": 0}), "must be an object with the keys"),
        (
            _append({**ENTRY, "global_batch_size": 8, "position": 52}),
            r"position 52 is not in step 5",
        ),
        (
            _append({**ENTRY, "position": 0, "step": 0, "global_batch_size": 8}),
            "does not match its seal",  # a duplicate entry: the history was edited
        ),
        (
            _append({**ENTRY, "global_batch_size": 8, "position": 24, "step": 3}),
            "does not match its seal",  # a layout entry added by hand
        ),
        (_set(("history", 0, "world_size"), 2), "does not match its seal"),
        (_set(("history", 0, "micro_batch_size"), 2), "does not match its seal"),
        (_append({**ENTRY, "step": 2}), r"position 40 is not in step 2"),
        (
            _append({**ENTRY, "global_batch_size": 8, "position": 48, "step": 6}),
            "samples_consumed 24 is before the start 48",
        ),
    ],
)
def test_edited_history_is_refused_naming_it(
    edit: Callable[[dict[str, Any]], None], match: str
) -> None:
    state = copy.deepcopy(saved_after(loader(), 6))
    edit(state)
    with pytest.raises(StateError, match=match) as err:
        loader().load_state_dict(state, mid_step="continue")
    assert "history" in err.value.fields or "global_batch_size" in err.value.fields


def test_history_going_back_is_refused() -> None:
    state = saved_after(loader(), 6)
    state["history"] += [
        {**ENTRY, "global_batch_size": 8, "position": 16, "step": 2},
        {**ENTRY, "global_batch_size": 8, "position": 8, "step": 1},
    ]
    with pytest.raises(StateError, match=r"history\[2\] \(position 8, step 1\) goes back"):
        loader().load_state_dict(state, mid_step="continue")


def test_two_changes_keep_every_earlier_step() -> None:
    """8 -> 4 at step 3 -> a ramp by samples at step 6: each state's history extends the last."""
    run = loader()
    state = saved_after(run, 6)  # step 3 starts at 24
    second = loader(4)
    second.load_state_dict(state, allow=["global_batch_size"], mid_step="continue")
    state = saved_after(second, 3)  # steps 3, 4, 5 of 4 samples: position 36
    ramp = BatchSchedule.by_samples([(0, 4), (40, 12)])
    third = loader(ramp)
    third.load_state_dict(state, allow=["global_batch_size"], mid_step="continue")
    starts = [third.position_of_step(t) for t in range(10)]
    assert starts == [0, 8, 16, 24, 28, 32, 36, 40, 52, 64]  # 8 x3, 4 x4 (36 < 40), then 12
    assert [e["step"] for e in third.history if "field" not in e] == [0, 3, 6]
    changes = [e for e in third.history if "field" in e]  # both changes, logged in the history
    assert changes == [
        {"field": "global_batch_size", "position": 24, "step": 3, "old": 8, "new": 4},
        {"field": "global_batch_size", "position": 36, "step": 6, "old": 4, "new": ramp.to_json()},
    ]
    assert third.step == 6 and third.global_batch_size == 4
