"""Every checked field a resume changes by name is in the state's history, logged, sealed, and
the diagnostics answer each step with the configuration in force then.

The reference is what the loaders delivered, recorded by the test itself (the ``id`` column
of an `ArrayDataset` is the sample id): `provenance` and `positions_seen` must give back
exactly those deliveries, position by position, before and after each change.

Covers: detdata/loading/resume.py, detdata/loading/lookup.py.
"""

from __future__ import annotations

import copy
import json
import logging
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest

import detdata
from detdata.base.errors import ConfigError, StateError
from detdata.datasets.streams import OrderedStream
from detdata.loading.loader import DataLoader

N = 97
GBS, MICRO, WORLD = 8, 2, 2


def _data(offset: int = 0) -> detdata.ArrayDataset:
    return detdata.ArrayDataset({"id": np.arange(offset, offset + N, dtype=np.int64)})


Make = Callable[[int], DataLoader]


def _run(
    make: Make,
    steps: int,
    delivered: dict[int, int],
    state: dict[str, Any] | None = None,
    allow: tuple[str, ...] = (),
) -> dict[str, Any]:
    """Deliver ``steps`` global steps on every rank (``make(rank)``, each resumed from
    ``state`` allowing ``allow``), recording position -> id; returns rank 0's state after."""
    out = None
    for rank in range(WORLD):
        loader = make(rank)
        if state is not None:
            loader.load_state_dict(state, allow=allow)
        it = iter(loader)
        for _ in range(steps * GBS // (MICRO * WORLD)):
            positions = loader.positions_of_next()
            batch = next(it)
            for p, i in zip(positions.tolist(), batch["id"].tolist(), strict=True):
                assert delivered.setdefault(p, i) == i
        if rank == 0:
            out = json.loads(json.dumps(loader.state_dict()))
    assert out is not None
    return out


def _wrapped(seed: int, offset: int = 0) -> Make:
    return lambda rank: DataLoader(
        _data(offset),
        global_batch_size=GBS,
        micro_batch_size=MICRO,
        options=detdata.LoaderOptions(rank=rank, world_size=WORLD),
        seed=seed,
    )


def _streamed(stream_seed: int) -> Make:
    return lambda rank: DataLoader(
        OrderedStream(_data(), stream_seed),
        global_batch_size=GBS,
        micro_batch_size=MICRO,
        options=detdata.LoaderOptions(rank=rank, world_size=WORLD),
        seed=5,
    )


CHANGES: dict[str, tuple[Make, Make, tuple[str, ...]]] = {
    "seed": (_wrapped(1), _wrapped(2), ("seed",)),
    "stream_seed": (_streamed(11), _streamed(12), ("stream_seed",)),
}


def _resumed(
    first: Make, second: Make, allow: tuple[str, ...]
) -> tuple[dict[str, Any], dict[int, int], int]:
    """5 steps with ``first``, then a resume with ``second`` allowing ``allow``, 4 more steps:
    (the last state, position -> delivered id, the change position)."""
    delivered: dict[int, int] = {}
    state = _run(first, 5, delivered)
    at = state["samples_consumed"]
    return _run(second, 4, delivered, state, allow), delivered, at


@pytest.mark.parametrize("name", sorted(CHANGES))
def test_a_change_is_in_the_history_and_logged(name: str, caplog: pytest.LogCaptureFixture) -> None:
    first, second, allow = CHANGES[name]
    delivered: dict[int, int] = {}
    state = _run(first, 5, delivered)
    old = state[name]
    resumed = second(0)
    with caplog.at_level(logging.WARNING, logger="detdata"):
        resumed.load_state_dict(state, allow=allow)
    new = resumed.state_dict()
    changes = [e for e in new["history"] if "field" in e]
    assert (
        changes == [{"field": name, "position": 40, "step": 5, "old": old, "new": new[name]}]
        and old != new[name]
    )
    assert any(name in r.getMessage() and "position 40" in r.getMessage() for r in caplog.records)
    second(0).load_state_dict(new)  # the saved state reads back, checked


def test_data_change_is_in_the_history() -> None:
    delivered: dict[int, int] = {}
    state = _run(_wrapped(1), 3, delivered)
    resumed = _wrapped(1, offset=1000)(0)
    resumed.load_state_dict(state, allow=["manifests", "data"])
    fields = [e["field"] for e in resumed.state_dict()["history"] if "field" in e]
    assert fields == ["manifests", "data"]


@pytest.mark.parametrize("name", sorted(CHANGES))
def test_provenance_and_seen_answer_each_step_with_the_configuration_then(name: str) -> None:
    first, second, allow = CHANGES[name]
    state, delivered, at = _resumed(first, second, allow)
    assert at == 40 and len(delivered) == 72
    fresh = second(0)
    fresh.load_state_dict(state)  # the final state: no allow= needed
    for step in range(9):
        records = fresh.provenance(step)
        positions = list(range(step * GBS, (step + 1) * GBS))
        assert [r.position for r in records] == positions
        assert [r.sample_id for r in records] == [delivered[p] for p in positions], step
        assert [(r.rank, r.micro_step, r.row) for r in records] == [
            ((q // MICRO) % WORLD, q // (MICRO * WORLD), q % MICRO) for q in range(GBS)
        ]
    # seen: brute force over the recorded deliveries, for every id delivered
    for sample in sorted(set(delivered.values())):
        expected = sorted(p for p, i in delivered.items() if i == sample)
        assert fresh.positions_seen(None, sample, until=72).tolist() == expected, sample


def test_data_change_earlier_steps_are_refused_naming_it() -> None:
    state, delivered, at = _resumed(_wrapped(1), _wrapped(1, offset=1000), ("manifests", "data"))
    fresh = _wrapped(1, offset=1000)(0)
    fresh.load_state_dict(state)
    late = fresh.provenance(6)
    assert [r.sample_id + 1000 for r in late] == [delivered[p] for p in range(48, 56)]
    with pytest.raises(StateError, match=r"'data' changed at position 40 \(step 5\)") as err:
        fresh.provenance(4)
    assert set(err.value.fields) == {"manifests", "data"}
    with pytest.raises(StateError, match="cannot rebuild the stream"):
        fresh.positions_seen(None, 3, until=72)
    # positions from the change on are answered: the brute-force reference of the new data
    later = {p: i for p, i in delivered.items() if p >= at}
    for sample in sorted(set(later.values()))[:10]:
        with pytest.raises(StateError):
            fresh.positions_seen(None, sample - 1000, until=72)  # reaches before the change


def _edit_change(edit: Callable[[dict[str, Any]], None]) -> dict[str, Any]:
    state, _, _ = _resumed(_wrapped(1), _wrapped(2), ("seed",))
    state = copy.deepcopy(state)
    edit(state)
    return state


def _change(state: dict[str, Any]) -> dict[str, Any]:
    return next(e for e in state["history"] if "field" in e)


@pytest.mark.parametrize(
    ("edit", "match"),
    [
        (lambda s: s["history"].remove(_change(s)), "does not match its seal"),
        (lambda s: _change(s).update(old=7), "does not match its seal"),
        (lambda s: _change(s).update(position=16), "position 16 is in step 2"),
        (lambda s: s["history"][0].update(world_size=1), "does not match its seal"),
        (lambda s: s.pop("history_b3"), "missing fields"),
    ],
)
def test_an_edited_change_history_is_refused_naming_it(
    edit: Callable[[dict[str, Any]], None], match: str
) -> None:
    state = _edit_change(edit)
    with pytest.raises(StateError, match=match) as err:
        _wrapped(2)(0).load_state_dict(state)
    assert "history" in err.value.fields or "history_b3" in err.value.fields


def test_a_resealed_history_must_still_lead_to_the_saved_fields() -> None:
    """An editor who recomputes the seal still cannot make the changes disagree with the
    fields, name a step the position is not in, or name an unknown field."""
    from detdata.loading.history import seal

    for edit, match in [
        (lambda s: _change(s).update(new=9), "leads to 9, but the field is 2"),
        (lambda s: _change(s).update(step=2), "names step 2, but position 40 is in step 5"),
        (lambda s: _change(s).update(field="layout"), "not a checked field"),
        (lambda s: _change(s).update(position=400, step=50), "lies after samples_consumed"),
    ]:
        state = _edit_change(edit)
        state["history_b3"] = seal(state["history"])
        with pytest.raises(StateError, match=match) as err:
            _wrapped(2)(0).load_state_dict(state)
        assert "history" in err.value.fields


def test_a_format_3_state_is_read_and_sealed() -> None:
    delivered: dict[int, int] = {}
    state = _run(_wrapped(1), 2, delivered)
    old = {k: v for k, v in state.items() if k != "history_b3"}
    old["format_version"] = 3
    resumed = _wrapped(1)(0)
    resumed.load_state_dict(old)
    assert resumed.state_dict()["history_b3"] == state["history_b3"]


def test_steps_past_total_samples_are_refused_naming_the_last() -> None:
    dl = DataLoader(
        _data(),
        global_batch_size=GBS,
        micro_batch_size=MICRO,
        options=detdata.LoaderOptions(total_samples=80),
    )
    assert [r.position for r in dl.provenance(9)] == list(range(72, 80))
    with pytest.raises(ConfigError, match=r"step 10 is never delivered.*last delivered step 9"):
        dl.provenance(10)
    with pytest.raises(ConfigError, match="until=81 is past the last position"):
        dl.positions_seen(None, 3, until=81)
    endless = DataLoader(_data(), global_batch_size=GBS, micro_batch_size=MICRO)
    last = 2**62 // GBS - 1  # the last step: its last position is 2**62 - 1
    assert endless.provenance(last)[-1].position < 2**62
    with pytest.raises(ConfigError, match=r"past the last addressable position"):
        endless.provenance(last + 1)


def _mixed(seed: int) -> Make:
    def make(rank: int) -> DataLoader:
        sources = {"a": _data(), "b": _data(1000)}
        mixture = detdata.Mixture(sources, {"a": 1, "b": 2}, seed=21)
        return DataLoader(
            mixture,
            global_batch_size=GBS,
            micro_batch_size=MICRO,
            options=detdata.LoaderOptions(rank=rank, world_size=WORLD),
            seed=seed,
        )

    return make


def test_a_loader_seed_change_over_a_caller_stream_answers_every_step() -> None:
    """The loader's own seed (transform randomness) changed over a Mixture the caller built:
    the stream is the same before and after, so every step is answered, none refused."""
    state, delivered, _ = _resumed(_mixed(1), _mixed(2), ("seed",))
    fresh = _mixed(2)(0)
    fresh.load_state_dict(state)
    assert [e["field"] for e in state["history"] if "field" in e] == ["seed"]
    for step in range(9):
        records = fresh.provenance(step)
        got = [r.sample_id + (1000 if r.source == "b" else 0) for r in records]
        assert got == [delivered[p] for p in range(step * GBS, (step + 1) * GBS)], step
