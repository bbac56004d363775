"""Chains of resumes with changes allowed by name (issue 40): save -> resume with a change
(``allow=``) -> train -> save -> resume without one -> train -> save -> resume with another
change ..., three changes per chain, for every checked field a resume can change.

Each chain is compared byte for byte, position by position, with an independent reference:
uninterrupted loaders built with the configuration in force at each position (for a mixture:
one uninterrupted loader over a `Mixture` built with the stitched phases, ``schedule=``), and
its history must hold every change, at the position the test expects, each ``new`` value the
field a fresh loader of that configuration reports and the next change's ``old``. Before the
fix, a state saved after an allowed mixture change was refused as "edited or corrupted": its
history recorded the new definition's fingerprint, its field the continued mixture's.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import detdata
from detdata.base.errors import StateError
from detdata.datasets.exclusions import Excluded, ExclusionList
from detdata.datasets.streams import OrderedStream
from detdata.datasets.tokens import TokenWindows
from detdata.identity.build import build_manifest
from detdata.loading.loader import DataLoader
from detdata.order.choice import LocalityOrder
from tests.conftest import write_token_shards

N = 97
GBS, MICRO = 8, 4

Make = Callable[[], DataLoader]


def _data(offset: int = 0) -> detdata.ArrayDataset:
    ids = np.arange(offset, offset + N, dtype=np.int64)
    return detdata.ArrayDataset({"id": ids, "x": (ids * 7 % 23).astype(np.int32)})


def _loader(data: Any, gbs: int = GBS, **kw: Any) -> DataLoader:
    return DataLoader(data, global_batch_size=gbs, micro_batch_size=MICRO, **kw)


def _row(batch: dict[str, Any], row: int) -> bytes:
    return b"".join(k.encode() + b"=" + batch[k][row].numpy().tobytes() for k in sorted(batch))


@dataclass(frozen=True)
class Link:
    """Resume ``make()`` from the previous link's state (allowing ``allow``), deliver
    ``micro`` micro batches, save. ``start``: where the test expects the resume to begin."""

    make: Make
    allow: tuple[str, ...]
    micro: int
    start: int
    mid_step: str | None = None


def run_chain(links: Sequence[Link]) -> tuple[dict[int, bytes], list[dict[str, Any]]]:
    """Position -> delivered bytes (a re-delivered step overwrites: the run trains on the last
    delivery), and the state saved after each link (through JSON, as a checkpoint holds it)."""
    delivered: dict[int, bytes] = {}
    states: list[dict[str, Any]] = []
    for i, link in enumerate(links):
        loader = link.make()
        if states:
            loader.load_state_dict(states[-1], allow=link.allow, mid_step=link.mid_step)
        assert loader.samples_consumed == link.start, (i, loader.samples_consumed, link.start)
        it = iter(loader)
        for _ in range(link.micro):
            positions = loader.positions_of_next().tolist()
            batch = next(it)
            for row, p in enumerate(positions):
                delivered[p] = _row(batch, row)
        states.append(json.loads(json.dumps(loader.state_dict())))
    return delivered, states


def uninterrupted(make: Make, end: int) -> dict[int, bytes]:
    """Position -> bytes of a loader that runs from position 0 without a stop."""
    out: dict[int, bytes] = {}
    loader = make()
    it = iter(loader)
    while len(out) < end:
        positions = loader.positions_of_next().tolist()
        batch = next(it)
        out.update((p, _row(batch, row)) for row, p in enumerate(positions))
    return out


def stitched(configs: Sequence[Make], starts: Sequence[int], end: int) -> dict[int, bytes]:
    """Position -> bytes of the configuration in force there: ``configs[k]`` from
    ``starts[k]`` on, each an uninterrupted run of its own."""
    runs = [uninterrupted(make, end) for make in configs]
    bounds = [*starts, end]
    return {p: runs[k][p] for k in range(len(configs)) for p in range(bounds[k], bounds[k + 1])}


def chain_links(configs: Sequence[Make], allow: tuple[str, ...]) -> tuple[list[Link], list[int]]:
    """c0 fresh, then per change: resume with it (allowed), train, save, resume with the same
    configuration (nothing allowed), train, save. The second change resumes from a state
    saved inside a step (by default the step is re-delivered: the change starts at the
    step's first position), the third from one saved inside a step with
    ``mid_step="continue"``. Returns the links and where each configuration starts."""
    c0, c1, c2, c3 = configs
    links = [
        Link(c0, (), 6, 0),  # -> 24 (step 3)
        Link(c1, allow, 4, 24),  # change 1 at 24 -> 40
        Link(c1, (), 3, 40),  # -> 52, inside step 6 (48..56)
        Link(c2, allow, 4, 48),  # change 2 at 48 (the step re-delivered) -> 64
        Link(c2, (), 3, 64),  # -> 76, inside step 9 (72..80)
        Link(c3, allow, 3, 76, "continue"),  # change 3 at 76 -> 88
        Link(c3, (), 4, 88),  # -> 104
    ]
    return links, [0, 24, 48, 76]


def check_history(
    states: list[dict[str, Any]], fields: tuple[str, ...], starts: list[int], values: list[Any]
) -> None:
    """The last state's history holds every change of ``fields``: at ``starts[1:]``, from
    ``values[k]`` to ``values[k + 1]`` (each field's value in force, from an independent
    fresh loader)."""
    final = states[-1]
    changes = [e for e in final["history"] if "field" in e]
    expected = [
        {"field": f, "position": starts[k + 1], "old": values[k][f], "new": values[k + 1][f]}
        for k in range(3)
        for f in fields
    ]
    assert [{k: c[k] for k in ("field", "position", "old", "new")} for c in changes] == expected
    assert [c["step"] for c in changes] == [starts[k + 1] // GBS for k in range(3) for _ in fields]
    for f in fields:
        assert final[f] == values[3][f]
        assert len({json.dumps(v[f]) for v in values}) == 4, f"{f}: not four different values"


def check_chain(
    configs: Sequence[Make],
    allow: tuple[str, ...],
    reference: Callable[[list[int], int], dict[int, bytes]],
    values: list[dict[str, Any]] | None = None,
) -> list[dict[str, Any]]:
    links, starts = chain_links(configs, allow)
    delivered, states = run_chain(links)
    end = max(delivered) + 1
    assert sorted(delivered) == list(range(end)) and end == 104
    expected = reference(starts, end)
    bad = [p for p in range(end) if delivered[p] != expected[p]]
    assert bad == [], f"positions delivered otherwise than the reference: {bad[:20]}"
    if values is None:
        values = [make().state_dict() for make in configs]
    check_history(states, allow, starts, values)
    # every later resume of the final state: no allow= needed, and allowing it changes nothing
    last = configs[-1]()
    last.load_state_dict(states[-1])
    again = last.state_dict()
    assert [e for e in again["history"] if "field" in e] == [
        e for e in states[-1]["history"] if "field" in e
    ]
    configs[-1]().load_state_dict(again, allow=allow)
    return states


# ------------------------------------------------------------------------------- mixture
WEIGHTS = [{"a": 1, "b": 2}, {"a": 1, "b": 5}, {"a": 3, "b": 1}, {"a": 1, "b": 1}]


def _mixture(**kw: Any) -> detdata.Mixture:
    return detdata.Mixture({"a": _data(), "b": _data(1000)}, seed=21, **kw)


def test_mixture_changes_chain_through_later_saves_and_resumes() -> None:
    """Three weight changes, each followed by a save and a plain resume: every state resumes,
    the bytes are those of one uninterrupted `Mixture` over the stitched phases, and the
    history's mixture values are those of mixtures built with the phases in force."""
    configs = [functools.partial(_loader, _mixture(weights=w)) for w in WEIGHTS]

    def phases(starts: list[int], k: int) -> list[tuple[int, dict[str, int]]]:
        return [(starts[i], WEIGHTS[i]) for i in range(k + 1)]

    def reference(starts: list[int], end: int) -> dict[int, bytes]:
        return uninterrupted(lambda: _loader(_mixture(schedule=phases(starts, 3))), end)

    starts = chain_links(configs, ("mixture",))[1]
    values = [_loader(_mixture(schedule=phases(starts, k))).state_dict() for k in range(4)]
    states = check_chain(configs, ("mixture",), reference, values)
    # the first weights again are a change back, refused by name, not taken as the same run
    with pytest.raises(StateError, match="mixture") as err:
        configs[0]().load_state_dict(states[-1])
    assert err.value.fields == ("mixture",)


def test_mixture_resume_with_the_weights_in_force_is_no_change() -> None:
    """After a change, ``allow=["mixture"]`` with the same weights adds nothing to the history
    and the loader reads the continued mixture, not the new weights from position 0."""
    first = _loader(_mixture(weights=WEIGHTS[0]))
    it = iter(first)
    for _ in range(4):
        next(it)
    changed = _loader(_mixture(weights=WEIGHTS[1]))
    changed.load_state_dict(first.state_dict(), allow=["mixture"])
    state = changed.state_dict()
    again = _loader(_mixture(weights=WEIGHTS[1]))
    again.load_state_dict(state, allow=["mixture"])
    assert again.state_dict()["history"] == state["history"]
    assert (
        again.state_dict()["mixture"]
        == state["mixture"]
        != _loader(_mixture(weights=WEIGHTS[1])).state_dict()["mixture"]
    )


def test_a_seed_change_after_mixture_changes_answers_every_step() -> None:
    """After the mixture chain, a change of the loader's own seed (over the caller's
    `Mixture`): `provenance` answers every step, before and after each change, as an
    uninterrupted loader over the stitched phases does (it used to take the continued
    mixture for a stream the loader had ordered, and refuse every step before the change)."""
    configs = [functools.partial(_loader, _mixture(weights=w)) for w in WEIGHTS]
    links, starts = chain_links(configs, ("mixture",))
    _, states = run_chain(links)
    reseeded = _loader(_mixture(weights=WEIGHTS[3]), seed=9)
    reseeded.load_state_dict(states[-1], allow=["seed"])
    reference = _loader(_mixture(schedule=[(starts[k], WEIGHTS[k]) for k in range(4)]))
    for step in range(13):
        got = [(r.position, r.source, r.sample_id) for r in reseeded.provenance(step)]
        assert got == [(r.position, r.source, r.sample_id) for r in reference.provenance(step)]


# ------------------------------------------------------------------------- other fields
def _shift(sample: dict[str, np.ndarray], rng: np.random.Generator, *, by: int) -> Any:
    return {k: v + by + int(rng.integers(0, 5)) for k, v in sample.items()}


CASES: dict[str, tuple[list[Make], tuple[str, ...]]] = {
    "seed": ([functools.partial(_loader, _data(), seed=s) for s in (1, 2, 3, 4)], ("seed",)),
    "stream_seed": (
        [functools.partial(_loader, OrderedStream(_data(), s), seed=5) for s in (11, 12, 13, 14)],
        ("stream_seed",),
    ),
    "transform": (
        [
            functools.partial(
                _loader,
                _data(),
                seed=3,
                options=detdata.LoaderOptions(transform=functools.partial(_shift, by=b)),
            )
            for b in (0, 10, 20, 30)
        ],
        ("transform",),
    ),
    "data": (
        [functools.partial(_loader, _data(off), seed=3) for off in (0, 1000, 2000, 3000)],
        ("manifests", "data"),
    ),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_field_changes_chain_through_later_saves_and_resumes(name: str) -> None:
    """The same chain for each other field a resume changes by name: the bytes are those of
    the configuration in force at each position, each run uninterrupted."""
    configs, allow = CASES[name]
    check_chain(configs, allow, lambda starts, end: stitched(configs, starts, end))


def test_global_batch_changes_chain_through_later_saves_and_resumes() -> None:
    """8 -> 16 -> 24 -> 8 samples per step, saved at step boundaries: the order is the
    unchanged run's, and the steps follow the schedules in force (counted here)."""
    batches = [8, 16, 24, 8]
    configs = [functools.partial(_loader, _data(), gbs=g, seed=3) for g in batches]
    links = [
        Link(configs[0], (), 6, 0),  # 3 steps of 8 -> 24
        Link(configs[1], ("global_batch_size",), 4, 24),  # 1 step of 16 -> 40
        Link(configs[1], (), 4, 40),  # -> 56
        Link(configs[2], ("global_batch_size",), 6, 56),  # 1 step of 24 -> 80
        Link(configs[2], (), 6, 80),  # -> 104
        Link(configs[3], ("global_batch_size",), 2, 104),  # -> 112
        Link(configs[3], (), 4, 112),  # -> 128
    ]
    delivered, states = run_chain(links)
    expected = uninterrupted(configs[0], 128)
    assert sorted(delivered) == list(range(128))
    assert [p for p in range(128) if delivered[p] != expected[p]] == []
    steps = 3 + 32 // 16 + 48 // 24 + 24 // 8  # counted from the schedule in force
    final = states[-1]
    assert final["step_position"] == {
        "step": steps,
        "first_position": 128,
        "global_batch_size": 8,
        "delivered_in_step": 0,
    }
    changes = [e for e in final["history"] if "field" in e]
    assert [(c["position"], c["step"], c["old"], c["new"]) for c in changes] == [
        (24, 3, 8, 16),
        (56, 5, 16, 24),
        (104, 7, 24, 8),
    ]
    configs[3]().load_state_dict(final)


def test_exclusions_chain_through_later_saves_and_resumes() -> None:
    """Lists added at three resumes: the bytes are those of one uninterrupted `Excluded` with
    the whole history, and no excluded sample is delivered from its list's position on
    (brute force over the deliveries)."""
    base = OrderedStream(_data(), 9)
    ids = base.sample_ids(np.arange(200)).tolist()
    starts = chain_links([_loader] * 4, ("exclusions",))[1]
    lists = [ExclusionList.of([ids[s + 1], ids[s + 5]]) for s in starts[1:]]
    history = [(starts[k + 1], lists[k]) for k in range(3)]
    configs = [functools.partial(_loader, Excluded(base, history[:k])) for k in range(4)]
    states = check_chain(configs, ("exclusions",), lambda _s, end: uninterrupted(configs[3], end))
    assert states[-1]["exclusions"] is not None
    delivered, _ = run_chain(chain_links(configs, ("exclusions",))[0])
    got = {p: int(np.frombuffer(row[3:11], np.int64)[0]) for p, row in delivered.items()}
    assert all(row.startswith(b"id=") for row in delivered.values())
    for k, lst in enumerate(lists):
        banned = set(lst.ids_of(None).tolist())
        assert [p for p in range(starts[k + 1], 104) if got[p] in banned] == []
        assert got[starts[k + 1] + 1] != ids[starts[k + 1] + 1]  # the list took effect there


@pytest.fixture
def shards(tmp_path: Path) -> TokenWindows:
    write_token_shards(tmp_path / "tok", sizes=(300, 260, 200, 240))
    return TokenWindows(build_manifest(str(tmp_path / "tok")), 16)


def test_algorithm_changes_chain_through_later_saves_and_resumes(shards: TokenWindows) -> None:
    """feistel-v1 -> locality-v1 -> feistel-v1 -> locality-v1 over sharded data."""
    orders = [None, LocalityOrder(window_shards=2), None, LocalityOrder(window_shards=2)]
    configs = [functools.partial(_loader, shards, seed=3, order=o) for o in orders]
    values = [make().state_dict() for make in configs]
    changed = tuple(f for f in ("algorithm", "data") if values[0][f] != values[1][f])
    assert "algorithm" in changed
    links, starts = chain_links(configs, changed)
    delivered, states = run_chain(links)
    expected = stitched(configs, starts, 104)
    assert [p for p in range(104) if delivered[p] != expected[p]] == []
    changes = [e for e in states[-1]["history"] if "field" in e]
    assert [(c["field"], c["position"]) for c in changes] == [
        (f, s) for s in starts[1:] for f in changed
    ]
    configs[3]().load_state_dict(states[-1])
