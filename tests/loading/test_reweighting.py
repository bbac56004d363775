"""Mixture weights changed during a run (issue 44), brute force against independent references.

The reference of every run is a `Mixture` built by its constructor with the whole schedule
the changes make (``schedule=[(0, w0), (p1, w1), ...]``: the golden-tested path, not the
in-flight one), each change at the first position of the step it was asked for (the next
step's when asked inside one), a change to the weights already in force adding no phase.
The runs under test apply the same changes through `DataLoader.set_mixture_weights` (or a
`MixtureController`) on simulated data-parallel ranks (one loader per rank, ``rank=`` and
``world_size=`` options), save and resume at random steps on random layouts (DP 1/2/4/8 x
micro batch x workers, threads and processes), and the stitched stream must equal the
reference at every position; each source's delivered ids must be its own order's prefix
(no repeat, no skip), and the weights in force at every step must be the reference's.

Covers: detdata/loading/reweighting.py, detdata/loading/cursor.py, detdata/loading/iteration.py.
"""

from __future__ import annotations

import json
import random
from collections.abc import Mapping, Sequence
from fractions import Fraction
from typing import Any

import numpy as np
import pytest

import detdata
from detdata.base.errors import ConfigError, StateError
from detdata.datasets.exclusions import Excluded, ExclusionList
from detdata.loading.loader import DataLoader
from detdata.order.feistel import GlobalOrder
from detdata.order.mixing import source_seed
from tests.soak import rounds

SIZES = {"a": 61, "b": 37, "c": 53, "d": 29, "e": 41}
OFFSET = {name: 10_000 * (i + 1) for i, name in enumerate(SIZES)}
SEED = 11
GBS = 16


def sources(names: Sequence[str]) -> dict[str, detdata.ArrayDataset]:
    """Source ``name``'s sample ``i`` has id ``OFFSET[name] + i`` (so an id names both)."""
    return {
        n: detdata.ArrayDataset({"id": np.arange(SIZES[n], dtype=np.int64) + OFFSET[n]})
        for n in names
    }


def weights_of(rng: random.Random, names: Sequence[str]) -> dict[str, int]:
    return {n: rng.randint(1, 9) for n in names}


def proportions(weights: Mapping[str, Any]) -> dict[str, Fraction]:
    fr = {n: Fraction(str(w)) for n, w in weights.items()}
    total = sum(fr.values())
    return {n: f / total for n, f in fr.items()}


def reference_schedule(
    w0: Mapping[str, Any], changes: Sequence[tuple[int, Mapping[str, Any]]]
) -> list[tuple[int, dict[str, Fraction]]]:
    """The phases the changes make: latest change at a position wins, a change to the
    weights in force adds nothing (written from the issue's contract, not the code)."""
    phases = [(0, proportions(w0))]
    for position, w in changes:
        p = proportions(w)
        phases = [ph for ph in phases if ph[0] < position]
        if not phases or phases[-1][1] != p:
            phases.append((position, p))
    return phases


def reference_ids(names: Sequence[str], schedule: Sequence[Any], end: int) -> list[int]:
    mixture = detdata.Mixture(sources(names), seed=SEED, schedule=schedule)
    return mixture.fetch(np.arange(end, dtype=np.int64))["id"].tolist()


def weights_at(schedule: Sequence[tuple[int, dict[str, Fraction]]], position: int) -> Any:
    return [w for s, w in schedule if s <= position][-1]


def check_own_orders(names: Sequence[str], ids: Sequence[int]) -> None:
    """Each source's delivered ids, in position order, are its own order's prefix."""
    for n in names:
        got = [i - OFFSET[n] for i in ids if OFFSET[n] <= i < OFFSET[n] + 10_000]
        order = GlobalOrder(SIZES[n], source_seed(SEED, n))
        assert got == order.ids(np.arange(len(got))).tolist(), n


class Run:
    """Simulated data-parallel ranks reading one run, resumed on new layouts."""

    def __init__(self, names: Sequence[str], w0: Mapping[str, Any], *, exclude: Any = None):
        self.names, self.w0, self.exclude = names, w0, exclude
        self.delivered: dict[int, int] = {}
        self.loaders: list[DataLoader] = []
        self.iters: list[Any] = []

    def data(self) -> Any:
        m = detdata.Mixture(sources(self.names), self.w0, seed=SEED)
        return m if self.exclude is None else Excluded(m, self.exclude, seed=SEED)

    def start(self, world: int, micro: int, workers: int, mode: str, state: Any) -> None:
        for it in self.iters:
            it.close()
        self.loaders = [
            DataLoader(
                self.data(),
                global_batch_size=GBS,
                micro_batch_size=micro,
                seed=0,
                num_workers=workers,
                options=detdata.LoaderOptions(
                    rank=r, world_size=world, read=detdata.ReadOptions(worker_mode=mode)
                ),
            )
            for r in range(world)
        ]
        if state is not None:
            for loader in self.loaders:
                loader.load_state_dict(json.loads(json.dumps(state)))
        self.iters = [iter(loader) for loader in self.loaders]

    def micro_steps(self, count: int) -> None:
        for _ in range(count):
            for loader, it in zip(self.loaders, self.iters, strict=True):
                positions = loader.positions_of_next().tolist()
                batch = next(it)
                self.delivered.update(zip(positions, batch["id"].tolist(), strict=True))

    def set_weights(self, weights: Mapping[str, Any]) -> int:
        found = {loader.set_mixture_weights(weights) for loader in self.loaders}
        assert len(found) == 1
        return found.pop()

    @property
    def per_step(self) -> int:
        layout = self.loaders[0].layout
        return GBS // (layout.micro_batch_size * layout.world_size)

    def close(self) -> None:
        for it in self.iters:
            it.close()


LAYOUTS = [(d, m) for d in (1, 2, 4, 8) for m in (1, 2, 4, 8, 16) if GBS % (d * m) == 0]


def drive(
    run: Run,
    rng: random.Random,
    steps: int,
    n_changes: int,
    segments: int,
    modes: Sequence[tuple[int, str]],
) -> list[tuple[int, dict[str, int]]]:
    """``steps`` steps with ``n_changes`` weight changes at random steps (two in consecutive
    steps, one right after each resume, some asked inside a step), a save and a resume on a
    random layout at ``segments - 1`` random steps (some inside a step). Returns the
    changes as ``(position the test expects, weights)``."""
    change_steps = set(rng.sample(range(1, steps), n_changes))
    first = rng.randrange(1, steps - 1)
    change_steps |= {first, first + 1}  # two changes in consecutive steps
    cuts = sorted(rng.sample(range(2, steps - 1), segments - 1))
    change_steps |= set(cuts)  # a change at the step right after each resume
    changes: list[tuple[int, dict[str, int]]] = []
    world, micro = rng.choice(LAYOUTS)
    workers, mode = rng.choice(modes)
    run.start(world, micro, workers, mode, None)
    step = 0
    while step < steps:
        if step in cuts:
            state = run.loaders[0].state_dict()
            world, micro = rng.choice(LAYOUTS)
            workers, mode = rng.choice(modes)
            run.start(world, micro, workers, mode, state)
        w = weights_of(rng, run.names)
        if step in change_steps and rng.random() < 0.2 and step + 1 < steps and run.per_step > 1:
            run.micro_steps(1)  # asked inside the step: in force from the next step
            changes.append((GBS * (step + 1), w))
            assert run.set_weights(w) == GBS * (step + 1)
            run.micro_steps(run.per_step - 1)
            step += 1
            continue
        if step in change_steps:
            changes.append((GBS * step, w))
            assert run.set_weights(w) == GBS * step
        run.micro_steps(run.per_step)
        step += 1
    return changes


MODES_INLINE = [(0, "thread"), (1, "thread"), (2, "thread")]


@pytest.mark.slow
@pytest.mark.parametrize("case", range(3))
def test_changes_at_random_steps_resumed_on_other_layouts_equal_an_uninterrupted_run(
    case: int,
) -> None:
    """3-5 sources, 200-1,000 changes (bounded: 200-300), saves/resumes on DP 1/2/4/8."""
    rng = random.Random(4400 + case)
    names = sorted(SIZES)[: 3 + case]
    n_changes = rounds(1000, 200 + 50 * case) if case < 2 else rounds(600, 200)
    steps = n_changes + n_changes // 2
    w0 = weights_of(rng, names)
    run = Run(names, w0)
    changes = drive(run, rng, steps, n_changes, segments=rounds(12, 6), modes=MODES_INLINE)
    run.close()
    end = GBS * steps
    schedule = reference_schedule(w0, changes)
    assert len(changes) >= 200 and len(schedule) > 150
    ids = reference_ids(names, schedule, end)
    assert [run.delivered[p] for p in range(end)] == ids
    check_own_orders(names, ids)
    final = run.loaders[0]
    for step in rng.sample(range(steps), 40):  # the weights in force at each step
        expected = weights_at(schedule, GBS * step)
        assert final.mixture_weights_at_step(step) == expected, step
        for rec in final.provenance(step):  # provenance names the weights in force
            assert rec.to_json()["mixture_weights"] == {
                n: f"{f.numerator}/{f.denominator}" for n, f in expected.items()
            }
            assert rec.to_json()["sample_id"] + OFFSET[rec.source] == ids[rec.position]
    # the state holds the history, not per-step tables; it resumes again
    state = final.state_dict()
    again = DataLoader(run.data(), global_batch_size=GBS, micro_batch_size=4, seed=0)
    again.load_state_dict(state)
    assert again.state_dict()["mixture"] == state["mixture"]


@pytest.mark.slow
def test_worker_processes_and_threads_across_changes() -> None:
    """Process and thread workers: read-ahead batches are dropped at a change."""
    rng = random.Random(4471)
    names = ["a", "b", "c"]
    w0 = weights_of(rng, names)
    run = Run(names, w0)
    n = rounds(60, 24)
    changes = drive(
        run, rng, n + n // 2, n, segments=4, modes=[(2, "process"), (1, "process"), (2, "thread")]
    )
    run.close()
    end = GBS * (n + n // 2)
    ids = reference_ids(names, reference_schedule(w0, changes), end)
    assert [run.delivered[p] for p in range(end)] == ids


def test_exclusions_and_weight_changes() -> None:
    """An excluded sample is never delivered across weight changes and resumes, and the
    run equals an uninterrupted one (same changes, same exclusions)."""
    names = ["a", "b", "c"]
    banned = ExclusionList.of([("a", 3), ("b", 5), ("c", 7), ("a", 11)])
    rng = random.Random(4472)
    w0 = weights_of(rng, names)
    run = Run(names, w0, exclude=banned)
    changes = drive(run, rng, 90, 40, segments=4, modes=MODES_INLINE)
    run.close()
    end = GBS * 90
    got = [run.delivered[p] for p in range(end)]
    assert not {OFFSET["a"] + 3, OFFSET["b"] + 5, OFFSET["c"] + 7, OFFSET["a"] + 11} & set(got)
    schedule = reference_schedule(w0, changes)
    ref = Excluded(detdata.Mixture(sources(names), seed=SEED, schedule=schedule), banned, seed=SEED)
    assert got == ref.fetch(np.arange(end, dtype=np.int64))["id"].tolist()


def test_packed_documents_mixture_across_changes(tmp_path: Any) -> None:
    """Sources of packed document windows: the stitched run equals the reference mixture
    of the same packed sources, window for window."""
    from detdata.datasets.documents import Documents
    from detdata.datasets.packed import PackedWindows
    from tests.datasets.doc_corpora import random_documents, write_megatron

    rng_np = np.random.default_rng(44)
    packed = {}
    for name in ("a", "b", "c"):
        (tmp_path / name).mkdir()
        write_megatron(
            tmp_path / name / "part", random_documents(rng_np, 60, max_len=40, vocab=900)
        )
        docs = Documents(detdata.build_manifest(str(tmp_path / name)))
        packed[name] = PackedWindows(docs, 16, seed=1, max_segments=40)

    def loader(world: int, rank: int, data: Any) -> DataLoader:
        return DataLoader(
            data,
            global_batch_size=8,
            micro_batch_size=8 // world,
            seed=0,
            options=detdata.LoaderOptions(rank=rank, world_size=world),
        )

    w0 = {"a": 1, "b": 2, "c": 3}
    plan = {3: {"a": 5, "b": 1, "c": 1}, 4: {"a": 1, "b": 1, "c": 5}, 9: {"a": 2, "b": 7, "c": 1}}
    got: dict[int, bytes] = {}
    state = None
    for world, steps in ((1, range(0, 6)), (2, range(6, 12))):
        ranks = [loader(world, r, detdata.Mixture(packed, w0, seed=SEED)) for r in range(world)]
        for one in ranks:
            if state is not None:
                one.load_state_dict(state)
        its = [iter(one) for one in ranks]
        for step in steps:
            if step in plan:
                for one in ranks:
                    one.set_mixture_weights(plan[step])
            for one, it in zip(ranks, its, strict=True):
                positions = one.positions_of_next().tolist()
                batch = next(it)
                for row, p in enumerate(positions):
                    got[p] = batch["tokens"][row].numpy().tobytes()
        state = ranks[0].state_dict()
    schedule = reference_schedule(w0, [(8 * s, w) for s, w in plan.items()])
    ref = detdata.Mixture(packed, seed=SEED, schedule=schedule).fetch(np.arange(96))
    assert [got[p] for p in range(96)] == [ref["tokens"][p].tobytes() for p in range(96)]


class LossDriven:
    """A deterministic controller: weights from the step number and a fake loss history."""

    def __init__(self) -> None:
        self.asked: list[int] = []

    def mixture_weights(self, step: int) -> dict[str, int] | None:
        self.asked.append(step)
        if step % 3:
            return None
        return {"a": 1 + step % 5, "b": 1 + (step * 7) % 4, "c": 2}


def test_controller_run_resumes_without_the_controller() -> None:
    """A controller-driven run; a resume from any of its states, with no controller,
    continues the recorded trajectory; the controller was asked once per step."""
    names = ["a", "b", "c"]
    w0 = {"a": 1, "b": 1, "c": 1}
    data = detdata.Mixture(sources(names), w0, seed=SEED)
    loader = DataLoader(data, global_batch_size=GBS, micro_batch_size=4, seed=0)
    controller = LossDriven()
    loader.set_mixture_controller(controller)
    states, ids = [], []
    for batch in _take(loader, 4 * 30):
        ids += batch["id"].tolist()
        states.append(loader.state_dict())
    assert controller.asked == list(range(30))
    changes = [(GBS * s, LossDriven().mixture_weights(s)) for s in range(0, 30, 3)]
    ref = reference_ids(names, reference_schedule(w0, changes), GBS * 30)  # type: ignore[arg-type]
    assert ids == ref
    for k in (3, 12, 50, 118):  # anywhere, inside steps too (the step is re-delivered)
        again = DataLoader(
            detdata.Mixture(sources(names), w0, seed=SEED),
            global_batch_size=GBS,
            micro_batch_size=8,
            seed=0,
        )
        again.load_state_dict(states[k])
        start = again.samples_consumed
        rest = [i for b in _take(again, (GBS * 30 - start) // 8) for i in b["id"].tolist()]
        assert rest == ref[start:], k


def _take(loader: DataLoader, count: int) -> list[Any]:
    it = iter(loader)
    return [next(it) for _ in range(count)]


def test_pending_change_saved_inside_a_step_resumes_exactly() -> None:
    """Weights asked inside step 2 take effect at step 3; a state saved inside step 2
    (redo and continue) resumes into the same stream."""
    names = ["a", "b", "c"]
    w0 = {"a": 1, "b": 2, "c": 3}
    w1 = {"a": 7, "b": 1, "c": 1}
    make = lambda: DataLoader(  # noqa: E731
        detdata.Mixture(sources(names), w0, seed=SEED),
        global_batch_size=GBS,
        micro_batch_size=4,
        seed=0,
    )
    loader = make()
    it = iter(loader)
    for _ in range(9):
        next(it)
    assert loader.set_mixture_weights(w1) == 3 * GBS
    state = loader.state_dict()
    ref = reference_ids(names, reference_schedule(w0, [(3 * GBS, w1)]), 8 * GBS)
    for how in ("redo", "continue"):
        again = make()
        again.load_state_dict(state, mid_step=how)
        start = again.samples_consumed
        assert start == (2 * GBS if how == "redo" else 9 * 4)
        rest = [i for b in _take(again, (8 * GBS - start) // 4) for i in b["id"].tolist()]
        assert rest == ref[start:], how


def test_weight_changes_after_an_allowed_mixture_change_resume_again_and_again() -> None:
    """resume with other weights (allow mixture) -> in-flight change -> save -> resume ->
    save -> resume: every state is accepted and the stitched stream is the reference."""
    names = ["a", "b", "c"]
    w0, w1, w2, w3 = (
        {"a": 1, "b": 1, "c": 1},
        {"a": 3, "b": 1, "c": 1},
        {"a": 1, "b": 4, "c": 1},
        {"a": 1, "b": 1, "c": 6},
    )

    def make(w: Mapping[str, int]) -> DataLoader:
        m = detdata.Mixture(sources(names), w, seed=SEED)
        return DataLoader(m, global_batch_size=GBS, micro_batch_size=8, seed=0)

    got: list[int] = []
    loader = make(w0)
    got += [i for b in _take(loader, 4) for i in b["id"].tolist()]  # steps 0, 1
    state = loader.state_dict()
    loader = make(w1)
    loader.load_state_dict(state, allow=["mixture"])  # w1 from step 2
    got += [i for b in _take(loader, 2) for i in b["id"].tolist()]  # step 2
    loader.set_mixture_weights(w2)  # from step 3
    got += [i for b in _take(loader, 4) for i in b["id"].tolist()]  # steps 3, 4
    for _ in range(3):  # resume with the same loader definition again and again
        state = json.loads(json.dumps(loader.state_dict()))
        loader = make(w1)
        loader.load_state_dict(state)
        got += [i for b in _take(loader, 2) for i in b["id"].tolist()]
    loader.set_mixture_weights(w3)  # from step 8
    got += [i for b in _take(loader, 4) for i in b["id"].tolist()]
    state = loader.state_dict()
    loader = make(w1)
    loader.load_state_dict(state)
    got += [i for b in _take(loader, 2) for i in b["id"].tolist()]  # step 10
    schedule = [(0, w0), (2 * GBS, w1), (3 * GBS, w2), (8 * GBS, w3)]
    assert got == reference_ids(names, schedule, 11 * GBS)
    fields = [c["field"] for c in state["history"] if "field" in c]
    assert fields == ["mixture", "mixture_weights", "mixture_weights"]


def test_state_is_the_history_and_stays_small() -> None:
    """The state grows by the change entries only (no per-step tables): its size per
    change is bounded, whatever the number of steps."""
    names = ["a", "b", "c", "d"]
    rng = random.Random(4473)
    loader = DataLoader(
        detdata.Mixture(sources(names), weights_of(rng, names), seed=SEED),
        global_batch_size=GBS,
        micro_batch_size=16,
        seed=0,
    )
    it = iter(loader)
    sizes = {}
    for step in range(1, 401):
        loader.set_mixture_weights(weights_of(rng, names))
        next(it)
        if step in (100, 400):
            sizes[step] = len(json.dumps(loader.state_dict()))
    per_change = (sizes[400] - sizes[100]) / 300
    assert per_change < 600, per_change  # ~2 proportion maps and a position per change
    again = DataLoader(
        detdata.Mixture(sources(names), {"a": 1, "b": 1, "c": 1, "d": 1}, seed=SEED),
        global_batch_size=GBS,
        micro_batch_size=16,
        seed=0,
    )
    again.load_state_dict(loader.state_dict())
    assert next(iter(again))["id"].tolist() == next(it)["id"].tolist()


def test_bad_weights_are_refused_and_change_nothing() -> None:
    names = ["a", "b", "c"]
    loader = DataLoader(
        detdata.Mixture(sources(names), {"a": 1, "b": 1, "c": 1}, seed=SEED),
        global_batch_size=GBS,
        micro_batch_size=16,
        seed=0,
        options=detdata.LoaderOptions(total_samples=2 * GBS),
    )
    before = loader.state_dict()
    with pytest.raises(ConfigError, match=r"unknown source\(s\) \['z'\]"):
        loader.set_mixture_weights({"a": 1, "b": 1, "c": 1, "z": 1})
    with pytest.raises(ConfigError, match=r"no weight for source\(s\) \['c'\]"):
        loader.set_mixture_weights({"a": 1, "b": 1})
    with pytest.raises(ConfigError, match="negative"):
        loader.set_mixture_weights({"a": 1, "b": -1, "c": 1})
    next(iter(loader))
    next(iter(loader))
    with pytest.raises(ConfigError, match="never take effect"):
        loader.set_mixture_weights({"a": 1, "b": 2, "c": 1})
    assert loader.state_dict()["history"] == before["history"]  # nothing was recorded
    plain = DataLoader(detdata.ArrayDataset({"id": np.arange(10)}), global_batch_size=2, seed=0)
    with pytest.raises(ConfigError, match=r"not a detdata\.Mixture"):
        plain.set_mixture_weights({"a": 1})
    banned = ExclusionList.of([3])
    excluded = Excluded(detdata.ArrayDataset({"id": np.arange(10)}), banned, seed=0)
    over_one = DataLoader(excluded, global_batch_size=2, seed=0)
    with pytest.raises(ConfigError, match=r"not a detdata\.Mixture"):
        over_one.set_mixture_weights({"a": 1})
    assert over_one.provenance(0)[0].mixture_weights is None


def test_recorded_changes_need_a_mixture_on_resume() -> None:
    names = ["a", "b"]
    loader = DataLoader(
        detdata.Mixture(sources(names), {"a": 1, "b": 1}, seed=SEED),
        global_batch_size=GBS,
        seed=0,
    )
    loader.set_mixture_weights({"a": 1, "b": 3})
    state = loader.state_dict()
    other = DataLoader(sources(["a"])["a"], global_batch_size=GBS, seed=0)
    with pytest.raises(StateError):
        other.load_state_dict(state, allow=["data", "mixture", "manifests", "stream_seed"])


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _torchrun(out: Any, disagree: bool) -> list[dict[str, Any]]:
    import os
    import subprocess
    import sys
    from pathlib import Path

    repo = Path(__file__).resolve().parents[2]
    env = {
        **os.environ,
        "PYTHONPATH": str(repo),
        "OMP_NUM_THREADS": "1",
        "DISAGREE": "1" if disagree else "0",
    }
    subprocess.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--nproc-per-node",
            "3",
            "--master-addr",
            "127.0.0.1",
            "--master-port",
            str(_free_port()),
            str(repo / "tests" / "dist" / "reweight_check.py"),
            str(out),
        ],
        check=True,
        env=env,
        timeout=240,
        capture_output=True,
    )
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(3)]


@pytest.mark.multiproc
@pytest.mark.parametrize("disagree", [False, True])
def test_real_gloo_ranks_agree_or_are_refused_naming_the_ranks(
    tmp_path: Any, disagree: bool
) -> None:
    """3 real gloo processes: the same weights on every rank take effect at step 2 (the
    union of the ranks' reads is the reference mixture); rank 1 asking for other weights
    stops every rank before step 2 with an error naming ranks [0, 2] and [1] and the
    step, and no rank applies anything (the union is the unchanged mixture)."""
    records = _torchrun(tmp_path, disagree)
    union: dict[int, int] = {}
    for rec in records:
        union.update({int(p): i for p, i in rec["read"]})
    names = ["a", "b", "c"]
    srcs = {
        n: detdata.ArrayDataset({"id": np.arange(40, dtype=np.int64) + 1000 * (i + 1)})
        for i, n in enumerate(names)
    }
    w0 = {"a": 1, "b": 1, "c": 1}
    schedule = [(0, w0)] if disagree else [(0, w0), (24, {"a": 5, "b": 1, "c": 1})]
    ref = detdata.Mixture(srcs, seed=11, schedule=schedule).fetch(np.arange(48))["id"]
    assert [union[p] for p in range(48)] == ref.tolist()
    for rec in records:
        changes = [c for c in rec["history"] if c.get("field") == "mixture_weights"]
        if disagree:
            assert rec["error"] is not None and not changes
            assert "before step 2" in rec["error"]
            assert "rank(s) [0, 2] ask for {'a': '5/7'" in rec["error"]
            assert "rank(s) [1] ask for {'a': '1/7', 'b': '5/7'" in rec["error"]
        else:
            assert rec["error"] is None
            assert [(c["step"], c["position"]) for c in changes] == [(2, 24)]
