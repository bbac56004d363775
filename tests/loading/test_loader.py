"""DataLoader: positions, reshard invariance, resume, state checks, randomness (issue 3)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

import detdata
from detdata.loading.loader import DataLoader
from detdata.loading.reading import Reads
from tests.resume_checker import batch_bytes, check_resume_everywhere, digest, run_digests, take

N = 1000  # samples


def dataset(n: int = N, width: int = 6) -> detdata.ArrayDataset:
    ids = np.arange(n, dtype=np.int64)
    return detdata.ArrayDataset(
        {"id": ids, "x": (ids[:, None] * 7 + np.arange(width)).astype(np.int32)}
    )


def global_steps(
    world: int,
    micro: int,
    workers: int,
    steps: int,
    gbs: int = 16,
    seed: int = 3,
    start_state: dict[str, Any] | None = None,
) -> list[bytes]:
    """Bytes of each global step, concatenated over ranks in position order."""
    loaders = []
    for rank in range(world):
        dl = DataLoader(
            dataset(),
            global_batch_size=gbs,
            micro_batch_size=micro,
            seed=seed,
            options=detdata.LoaderOptions(rank=rank, world_size=world),
            num_workers=workers,
        )
        if start_state is not None:
            dl.load_state_dict(start_state, mid_step="continue")
        loaders.append(list(take(dl, steps * gbs // (micro * world))))
    per_step = gbs // (micro * world)
    out = []
    for s in range(steps):
        cols: dict[str, list[torch.Tensor]] = {}
        for k in range(s * per_step, (s + 1) * per_step):
            for rank in range(world):
                for key, val in loaders[rank][k].items():
                    cols.setdefault(key, []).append(val)
        out.append(batch_bytes({k: torch.cat(v) for k, v in cols.items()}))
    return out


def test_micro_batches_follow_design_positions() -> None:
    order = detdata.GlobalOrder(N, 3)
    dl = DataLoader(
        dataset(),
        global_batch_size=16,
        micro_batch_size=2,
        seed=3,
        options=detdata.LoaderOptions(rank=1, world_size=4),
    )
    for j, batch in enumerate(take(dl, 5)):
        step, k = divmod(j, 2)  # 2 micro steps per step (16 / (2*4))
        first = step * 16 + k * 8 + 1 * 2
        assert batch["id"].tolist() == order.ids(np.arange(first, first + 2)).tolist()


@pytest.mark.parametrize("workers", [0, 2])
def test_reshard_matrix_global_steps_identical(workers: int) -> None:
    reference = global_steps(world=1, micro=16, workers=0, steps=4)
    for world in (1, 2, 4, 8):
        for micro in sorted({1, 2, 16 // world}):
            got = global_steps(world=world, micro=micro, workers=workers, steps=4)
            assert got == reference, (world, micro, workers)


def test_state_saved_at_world4_resumes_at_2_and_1() -> None:
    ranks = [
        DataLoader(
            dataset(),
            global_batch_size=16,
            micro_batch_size=2,
            seed=3,
            options=detdata.LoaderOptions(rank=r, world_size=4),
        )
        for r in range(4)
    ]
    for dl in ranks:
        list(take(dl, 6))  # 6 micro steps = 3 global steps
    states = [dl.state_dict() for dl in ranks]
    assert all(s == states[0] for s in states[1:]), "state must not depend on the rank"
    assert states[0]["samples_consumed"] == 48
    straight = global_steps(world=1, micro=16, workers=0, steps=6)
    for world in (2, 1):
        assert global_steps(world, 16 // world, 0, 3, start_state=states[0]) == straight[3:]


def test_resume_at_every_step_of_50_step_run() -> None:
    def make() -> DataLoader:
        return DataLoader(dataset(), global_batch_size=8, micro_batch_size=4, seed=11)

    reference = check_resume_everywhere(make, 100)  # 50 steps x 2 micro batches
    assert len(set(reference)) == len(reference)


def test_resume_with_workers_at_several_steps() -> None:
    def make() -> DataLoader:
        return DataLoader(
            dataset(),
            global_batch_size=8,
            micro_batch_size=4,
            seed=11,
            num_workers=2,
            prefetch_factor=4,
        )

    straight = make()
    states: list[dict[str, Any]] = []
    reference = run_digests(straight, 30, states)
    for k in (0, 7, 18, 29):
        resumed = make()
        resumed.load_state_dict(states[k], mid_step="continue")
        assert run_digests(resumed, 30 - k - 1) == reference[k + 1 :]


def test_state_counts_delivered_not_prefetched() -> None:
    dl = DataLoader(
        dataset(), global_batch_size=8, micro_batch_size=4, seed=1, num_workers=2, prefetch_factor=8
    )
    it = iter(dl)
    next(it)
    next(it)
    assert dl.samples_consumed == 8
    assert dl.state_dict()["samples_consumed"] == 8


@pytest.mark.multiproc
def test_resume_in_fresh_process(tmp_path: Path) -> None:
    data = np.arange(N * 6, dtype=np.int32).reshape(N, 6)
    np.save(tmp_path / "data.npy", data)
    script = textwrap.dedent(f"""
        import json, sys
        import numpy as np
        import detdata
        from tests.resume_checker import run_digests
        ds = detdata.ArrayDataset({{"x": np.load({str(tmp_path / "data.npy")!r})}})
        dl = detdata.DataLoader(ds, global_batch_size=8, micro_batch_size=4, seed=5)
        if len(sys.argv) > 1:
            dl.load_state_dict(json.load(open(sys.argv[1])), mid_step="continue")
        print(json.dumps(run_digests(dl, int(sys.argv[2] if len(sys.argv) > 2 else 40))))
    """)
    (tmp_path / "run.py").write_text(script)
    ds = detdata.ArrayDataset({"x": data})
    dl = DataLoader(ds, global_batch_size=8, micro_batch_size=4, seed=5)
    reference = run_digests(dl, 40)
    fresh = DataLoader(ds, global_batch_size=8, micro_batch_size=4, seed=5)
    run_digests(fresh, 17)
    (tmp_path / "state.json").write_text(json.dumps(fresh.state_dict()))
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])}
    out = subprocess.run(
        [sys.executable, str(tmp_path / "run.py"), str(tmp_path / "state.json"), "23"],
        check=True,
        capture_output=True,
        text=True,
        env=env,
    ).stdout
    assert json.loads(out) == reference[17:]


def test_one_epoch_has_no_repeats_or_skips_any_layout() -> None:
    for world, micro in ((1, 8), (2, 4), (4, 1)):
        seen: list[int] = []
        for rank in range(world):
            dl = DataLoader(
                dataset(),
                global_batch_size=8,
                micro_batch_size=micro,
                seed=9,
                options=detdata.LoaderOptions(rank=rank, world_size=world, total_samples=N),
            )
            seen.extend(int(v) for b in dl for v in b["id"])
        assert sorted(seen) == list(range(N))


def test_total_samples_stops_and_len() -> None:
    dl = DataLoader(
        dataset(),
        global_batch_size=8,
        micro_batch_size=4,
        options=detdata.LoaderOptions(total_samples=40),
    )
    assert len(dl) == 10  # constant: the run's micro batches of this rank
    assert len(list(dl)) == 10
    assert len(dl) == 10 and list(dl) == []  # exhausted; a new iter() does not restart


def _noisy(sample: dict[str, np.ndarray], rng: np.random.Generator) -> dict[str, np.ndarray]:
    return {"id": sample["id"], "noise": rng.integers(0, 2**31, size=3)}


def test_transform_randomness_depends_only_on_position() -> None:
    def noise_by_id(world: int, workers: int, micro: int) -> dict[int, tuple[int, ...]]:
        found: dict[int, tuple[int, ...]] = {}
        for rank in range(world):
            dl = DataLoader(
                dataset(),
                global_batch_size=16,
                micro_batch_size=micro,
                seed=2,
                options=detdata.LoaderOptions(
                    rank=rank, world_size=world, total_samples=64, transform=_noisy
                ),
                num_workers=workers,
            )
            for batch in dl:
                for i, v in zip(batch["id"].tolist(), batch["noise"].tolist(), strict=True):
                    found[i] = tuple(v)
        return found

    a = noise_by_id(1, 0, 16)
    assert a == noise_by_id(2, 2, 4) == noise_by_id(4, 0, 2)
    assert len(set(a.values())) == len(a), "different positions must get different randomness"


def _doubled(sample: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    return {"id": sample["id"], "twice": 2 * sample["id"]}


def test_a_one_argument_transform_is_called_without_a_generator() -> None:
    """``transform(sample)`` (no randomness) is called with the sample alone, in process and in
    worker processes; its rows equal the transform applied to the plain rows."""
    plain = torch.cat(
        [
            b["id"]
            for b in DataLoader(
                dataset(), global_batch_size=8, options=detdata.LoaderOptions(total_samples=48)
            )
        ]
    )
    for workers in (0, 2):
        dl = DataLoader(
            dataset(),
            global_batch_size=8,
            options=detdata.LoaderOptions(total_samples=48, transform=_doubled),
            num_workers=workers,
        )
        got = list(dl)
        ids = torch.cat([b["id"] for b in got])
        assert torch.equal(ids, plain)
        assert torch.equal(torch.cat([b["twice"] for b in got]), 2 * plain)


def test_which_transforms_take_a_generator() -> None:
    import functools

    from detdata.loading.reading import takes_rng

    def two(sample: object, rng: object) -> None: ...
    def default(sample: object, rng: object = None) -> None: ...
    def star(*args: object) -> None: ...
    def kw_only(sample: object, *, scale: int = 1) -> None: ...

    class Callable3:
        def __call__(self, sample: object, rng: object) -> None: ...

    assert takes_rng(two) and takes_rng(default) and takes_rng(star) and takes_rng(Callable3())
    assert not takes_rng(_doubled) and not takes_rng(kw_only)
    assert not takes_rng(functools.partial(two, rng=None))  # rng bound by keyword
    assert takes_rng(functools.partial(lambda k, sample, rng: None, 3))
    assert takes_rng(print)  # a builtin: its signature may not be readable; it gets one


def test_worker_globals_seeded_from_seed_rank_worker() -> None:
    def draws(seed: int, rank: int) -> list[int]:
        class Probe:
            num_samples = N

            def read(self, ids: np.ndarray) -> dict[str, np.ndarray]:
                return {"r": np.full(len(ids), np.random.randint(0, 2**31), dtype=np.int64)}

            def identity(self) -> dict[str, Any]:
                return {"type": "probe"}

        dl = DataLoader(
            Probe(),
            global_batch_size=4,
            micro_batch_size=2,
            seed=seed,
            options=detdata.LoaderOptions(rank=rank, world_size=2, total_samples=16),
            num_workers=2,
        )
        return [int(b["r"][0]) for b in dl]

    assert draws(1, 0) == draws(1, 0)
    assert draws(1, 0) != draws(1, 1)
    assert draws(1, 0) != draws(2, 0)


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"seed": 99}, "seed"),
        ({"global_batch_size": 16, "micro_batch_size": 4}, "global_batch_size"),
        ({"data": "other"}, "data"),
    ],
)
def test_mismatched_state_refused_naming_fields(kwargs: dict[str, Any], field: str) -> None:
    base = DataLoader(dataset(), global_batch_size=8, micro_batch_size=4, seed=1)
    list(take(base, 3))
    state = base.state_dict()
    data = dataset(width=7) if kwargs.pop("data", None) else dataset()
    args = {"global_batch_size": 8, "micro_batch_size": 4, "seed": 1, **kwargs}
    other = DataLoader(data, **args)
    with pytest.raises(detdata.StateError) as err:
        other.load_state_dict(state, mid_step="continue")
    assert field in str(err.value) and field in err.value.fields
    assert "allow=" in str(err.value)
    other.load_state_dict(state, allow=err.value.fields, mid_step="continue")
    assert other.samples_consumed == 12


def test_other_manifest_refused_naming_manifests(tmp_path: Path) -> None:
    def loader(seed_file: int) -> DataLoader:
        class FromManifest:
            num_samples = 10

            def __init__(self, mid: str) -> None:
                self.mid = mid

            def read(self, ids: np.ndarray) -> dict[str, np.ndarray]:
                return {"x": ids}

            def identity(self) -> dict[str, Any]:
                return {"type": "fake_manifest_reader", "manifest": self.mid}

        return DataLoader(FromManifest(f"b3:{seed_file:064x}"), global_batch_size=2)

    state = loader(1).state_dict()
    with pytest.raises(detdata.StateError, match="manifests"):
        loader(2).load_state_dict(state, mid_step="continue")


def test_state_is_pure_json_with_documented_fields() -> None:
    dl = DataLoader(dataset(), global_batch_size=8, seed=4)
    state = dl.state_dict()
    assert json.loads(json.dumps(state)) == state
    for key in (
        "format_version",
        "samples_consumed",
        "seed",
        "manifests",
        "algorithm",
        "mixture",
        "global_batch_size",
        "layout",
        "environment",
    ):
        assert key in state
    assert state["algorithm"] == ["feistel-v1"]


@pytest.mark.parametrize(
    "bad",
    [
        {"kind": "detdata.loader_state", "format_version": 99},
        {"kind": "something"},
        "not json",
        [1, 2],
    ],
)
def test_malformed_state_refused(bad: Any) -> None:
    dl = DataLoader(dataset(), global_batch_size=8)
    with pytest.raises(detdata.StateError):
        dl.load_state_dict(bad, mid_step="continue")


def test_negative_position_refused() -> None:
    dl = DataLoader(dataset(), global_batch_size=8)
    state = dl.state_dict()
    state["samples_consumed"] = -8
    with pytest.raises(detdata.StateError, match="samples_consumed"):
        dl.load_state_dict(state, mid_step="continue")


def test_resume_off_micro_step_boundary_refused() -> None:
    dl = DataLoader(dataset(), global_batch_size=8, micro_batch_size=2)
    list(take(dl, 1))
    other = DataLoader(dataset(), global_batch_size=8, micro_batch_size=4)
    with pytest.raises(detdata.StateError, match="micro-step boundary"):
        other.load_state_dict(dl.state_dict(), mid_step="continue")


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        (
            {"global_batch_size": 10, "options": detdata.LoaderOptions(world_size=4, rank=0)},
            "divisible",
        ),
        ({"global_batch_size": 8, "micro_batch_size": 3}, "divisible"),
        ({"global_batch_size": 8, "options": detdata.LoaderOptions(rank=2, world_size=2)}, "rank"),
        ({"global_batch_size": 0}, "global_batch_size"),
        ({"global_batch_size": 8, "seed": -1}, "seed"),
        (
            {"global_batch_size": 8, "options": detdata.LoaderOptions(total_samples=12)},
            "total_samples",
        ),
    ],
)
def test_bad_arguments(kwargs: dict[str, Any], match: str) -> None:
    with pytest.raises(detdata.ConfigError, match=match):
        DataLoader(dataset(), **kwargs)


def test_order_resume_costs_o1_far_position() -> None:
    dl = DataLoader(dataset(), global_batch_size=8, seed=3)
    state = dl.state_dict()
    state["samples_consumed"] = 8 * 10**12
    dl.load_state_dict(state, mid_step="continue")
    batch = next(iter(dl))
    expected = detdata.GlobalOrder(N, 3).ids(np.arange(8 * 10**12, 8 * 10**12 + 8))
    assert batch["id"].tolist() == expected.tolist()


def test_same_seed_same_bytes_different_seed_differs() -> None:
    a = run_digests(DataLoader(dataset(), global_batch_size=8, seed=1), 5)
    b = run_digests(DataLoader(dataset(), global_batch_size=8, seed=1), 5)
    c = run_digests(DataLoader(dataset(), global_batch_size=8, seed=2), 5)
    assert a == b and a != c
    assert digest({"x": torch.zeros(1)}) != digest({"x": torch.ones(1)})


def test_thread_workers_same_bytes_and_resume() -> None:
    def make(mode: str, workers: int) -> DataLoader:
        return DataLoader(
            dataset(),
            global_batch_size=16,
            micro_batch_size=4,
            seed=8,
            num_workers=workers,
            options=detdata.LoaderOptions(
                transform=_noisy, read=detdata.ReadOptions(worker_mode=mode)
            ),
        )

    states: list[dict[str, Any]] = []
    reference = run_digests(make("process", 0), 24)
    assert run_digests(make("thread", 2), 24, states) == reference
    for k in (0, 5, 13):
        resumed = make("thread", 3)
        resumed.load_state_dict(states[k], mid_step="continue")
        assert run_digests(resumed, 24 - k - 1) == reference[k + 1 :]


def test_thread_worker_error_names_positions_and_keeps_state() -> None:
    class Failing:
        num_samples = N

        def read(self, ids: np.ndarray) -> dict[str, np.ndarray]:
            if (ids == 7).any():
                raise OSError("disk gone")
            return {"id": ids}

        def identity(self) -> dict[str, Any]:
            return {"type": "failing"}

    dl = DataLoader(
        Failing(),
        global_batch_size=4,
        seed=0,
        num_workers=2,
        options=detdata.LoaderOptions(read=detdata.ReadOptions(worker_mode="thread")),
    )
    order = detdata.GlobalOrder(N, 0)
    bad_step = int(np.flatnonzero(order.ids(np.arange(N)) == 7)[0]) // 4
    with pytest.raises(OSError, match="disk gone") as err:
        for _ in dl:
            pass
    assert dl.samples_consumed == bad_step * 4
    assert f"[{bad_step * 4}" in "".join(getattr(err.value, "__notes__", []))


def test_worker_mode_validated() -> None:
    with pytest.raises(detdata.ConfigError, match="worker_mode"):
        DataLoader(
            dataset(),
            global_batch_size=8,
            options=detdata.LoaderOptions(read=detdata.ReadOptions(worker_mode="fibers")),
        )


@pytest.mark.parametrize("read_ahead", [1, 3, 4, 64])
def test_read_ahead_groups_never_change_bytes(read_ahead: int) -> None:
    def make(ra: int, mode: str = "process", **kw: Any) -> DataLoader:
        return DataLoader(
            dataset(),
            global_batch_size=16,
            micro_batch_size=4,
            seed=6,
            options=detdata.LoaderOptions(
                total_samples=16 * 7, read=detdata.ReadOptions(batches_ahead=ra, worker_mode=mode)
            ),
            **kw,
        )

    reference = [digest(b) for b in make(1)]
    assert len(reference) == 28
    assert [digest(b) for b in make(read_ahead)] == reference
    assert [digest(b) for b in make(read_ahead, "thread", num_workers=2)] == reference
    assert [digest(b) for b in make(read_ahead, num_workers=2)] == reference  # worker processes
    seen: list[int] = []
    collated = make(read_ahead, collate_fn=lambda b: seen.append(len(b["id"])) or b)
    assert len(list(collated)) == 28 and set(seen) == {4}


@pytest.mark.parametrize("mode", ["inline", "process", "thread"])
def test_failure_inside_a_read_ahead_group_delivers_the_batches_before_it(mode: str) -> None:
    class FailsAt:
        num_samples = N

        def read(self, ids: np.ndarray) -> dict[str, np.ndarray]:
            if (ids == bad_id).any():
                raise OSError(f"cannot read sample {bad_id}")
            return {"id": ids}

        def identity(self) -> dict[str, Any]:
            return {"type": "fails-at"}

    order = detdata.GlobalOrder(N, 2)
    bad_position = 4 * 9 + 2  # third sample of micro batch 9: inside the 3rd group of 4
    bad_id = int(order[bad_position])
    dl = DataLoader(
        FailsAt(),
        global_batch_size=4,
        seed=2,
        options=detdata.LoaderOptions(
            read=detdata.ReadOptions(
                worker_mode="thread" if mode == "thread" else "process", batches_ahead=4
            )
        ),
        num_workers=0 if mode == "inline" else 2,
    )
    delivered = []
    with pytest.raises(OSError, match="cannot read sample"):
        for batch in dl:
            delivered.append(batch["id"].tolist())
    assert len(delivered) == 9 and dl.samples_consumed == 36
    assert delivered[-1] == order.ids(np.arange(32, 36)).tolist()


class _Unpicklable(Exception):
    def __init__(self, shard: str, detail: str) -> None:  # two required args: pickling fails
        super().__init__(f"{shard}: {detail}")
        self.handle = lambda: None


class _RaisesUnpicklable:
    num_samples = N

    def read(self, ids: np.ndarray) -> dict[str, np.ndarray]:
        if (ids == 5).any():
            raise _Unpicklable("shard-3.npy", "checksum mismatch")
        return {"id": ids}

    def identity(self) -> dict[str, Any]:
        return {"type": "raises-unpicklable"}


def test_unpicklable_worker_error_still_reaches_the_main_process() -> None:
    """A worker's error travels as a value (after the group's earlier batches): unpicklable ones
    become text."""
    dl = DataLoader(_RaisesUnpicklable(), global_batch_size=4, seed=0, num_workers=2)
    with pytest.raises(RuntimeError, match=r"_Unpicklable: shard-3\.npy: checksum mismatch") as err:
        for _ in dl:
            pass
    notes = "".join(getattr(err.value, "__notes__", []))
    assert "in DataLoader worker process" in notes and "Traceback" in notes
    position = int(np.flatnonzero(detdata.GlobalOrder(N, 0).ids(np.arange(N)) == 5)[0])
    assert dl.samples_consumed == position // 4 * 4  # every batch before the failing one delivered


def test_process_workers_send_one_group_as_one_tensor_per_column() -> None:
    """With the default collate, what a worker process returns for a group (the unit torch
    transfers) holds one tensor per column, its micro batches views of it; the batches then
    delivered own their memory and carry the same bytes as a plain run."""
    dl = DataLoader(
        dataset(),
        global_batch_size=8,
        micro_batch_size=4,
        seed=4,
        num_workers=2,
        options=detdata.LoaderOptions(read=detdata.ReadOptions(batches_ahead=4)),
    )
    reads = Reads(transform=None, seed=4, collate_fn=None, pin_memory=False, batches_ahead=4)
    reader = reads.reader(dl.stream, in_worker=True)  # what each worker process reads with
    group = [dl.layout.positions(j) for j in range(4)]
    sent = reader(group)
    storages = {b["x"].untyped_storage().data_ptr() for b in sent.batches}
    assert len(storages) == 1 and sent.error is None
    batches = list(take(dl, 8))
    assert all(b["x"].untyped_storage().nbytes() == b["x"].nbytes for b in batches)
    reference = list(
        take(DataLoader(dataset(), global_batch_size=8, micro_batch_size=4, seed=4), 8)
    )
    assert [digest(b) for b in batches] == [digest(b) for b in reference]


def test_persistent_workers_resume_mid_group() -> None:
    """Loading a state between iterations restarts the persistent workers' groups at that
    position."""

    def make() -> DataLoader:
        return DataLoader(
            dataset(),
            global_batch_size=8,
            micro_batch_size=4,
            seed=9,
            num_workers=2,
            persistent_workers=True,
            options=detdata.LoaderOptions(read=detdata.ReadOptions(batches_ahead=4)),
        )

    reference = [digest(b) for b in take(make(), 24)]
    dl = make()
    for _ in take(dl, 7):  # stop inside the second group of 4
        pass
    state = dl.state_dict()
    assert [digest(b) for b in take(dl, 5)] == reference[7:12]  # a new epoch of iter() continues
    dl.load_state_dict(state, mid_step="continue")
    assert [digest(b) for b in take(dl, 17)] == reference[7:]


@pytest.mark.parametrize("workers", [0, 2])
def test_collate_failure_inside_a_group_surfaces_at_its_batch(workers: int) -> None:
    """A collate_fn that fails on one micro batch: the batches before it in the group are
    delivered."""
    order = detdata.GlobalOrder(N, 8)
    bad_id = int(order[4 * 6 + 1])  # micro batch 6, inside the first group of 16

    def collate(batch: dict[str, np.ndarray]) -> dict[str, torch.Tensor]:
        if bad_id in batch["id"].tolist():
            raise ValueError(f"cannot collate sample {bad_id}")
        return {k: torch.from_numpy(v) for k, v in batch.items()}

    dl = DataLoader(dataset(), global_batch_size=4, seed=8, collate_fn=collate, num_workers=workers)
    delivered = []
    with pytest.raises(ValueError, match=f"cannot collate sample {bad_id}"):
        for batch in dl:
            delivered.append(batch["id"].tolist())
    assert len(delivered) == 6 and dl.samples_consumed == 24
    assert delivered[-1] == order.ids(np.arange(20, 24)).tolist()


class _ConnectionDrops:
    num_samples = N

    def read(self, ids: np.ndarray) -> dict[str, np.ndarray]:
        if (ids == 9).any():
            raise ConnectionResetError(104, "Connection reset by peer")
        return {"id": ids}

    def identity(self) -> dict[str, Any]:
        return {"type": "connection-drops"}


@pytest.mark.parametrize("workers", [0, 2])
def test_connection_errors_carry_position_note_and_worker_hint(workers: int) -> None:
    """A connection error reaching the loop (e.g. a worker dying mid hand-over) keeps the state
    exact and says where it happened; with worker processes it also hints at a dead worker."""
    dl = DataLoader(_ConnectionDrops(), global_batch_size=4, seed=0, num_workers=workers)
    with pytest.raises(ConnectionResetError) as err:
        for _ in dl:
            pass
    position = int(np.flatnonzero(detdata.GlobalOrder(N, 0).ids(np.arange(N)) == 9)[0])
    assert dl.samples_consumed == position // 4 * 4
    notes = "\n".join(getattr(err.value, "__notes__", []))
    assert f"global positions [{position // 4 * 4}" in notes
    assert ("worker process probably died" in notes) == (workers > 0)
