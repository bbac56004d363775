"""DeterministicBatchSampler inside torch's DataLoader and torchdata's StatefulDataLoader."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch
import torch.utils.data as tud
from torchdata.stateful_dataloader import StatefulDataLoader

import detdata
from detdata.loading.sampler import DeterministicBatchSampler
from tests.resume_checker import digest

N = 300


class Rows(tud.Dataset[dict[str, Any]]):
    def __len__(self) -> int:
        return N

    def __getitem__(self, i: int) -> dict[str, Any]:
        return {"id": i, "x": torch.arange(4) + 10 * i}


def detdata_ids(count: int, seed: int = 5) -> list[list[int]]:
    ds = detdata.ArrayDataset({"id": np.arange(N)})
    dl = detdata.DataLoader(ds, global_batch_size=8, micro_batch_size=4, seed=seed)
    it = iter(dl)
    return [next(it)["id"].tolist() for _ in range(count)]


def test_same_ids_as_detdata_loader_in_vanilla_dataloader() -> None:
    sampler = DeterministicBatchSampler(N, global_batch_size=8, micro_batch_size=4, seed=5)
    dl = tud.DataLoader(Rows(), batch_sampler=sampler, num_workers=2)
    got = [b["id"].tolist() for _, b in zip(range(12), dl, strict=False)]
    assert got == detdata_ids(12)


@pytest.mark.parametrize("workers", [0, 2])
def test_stateful_dataloader_resume_gives_exact_next_batch(workers: int) -> None:
    def make() -> StatefulDataLoader:
        sampler = DeterministicBatchSampler(N, global_batch_size=8, micro_batch_size=4, seed=5)
        return StatefulDataLoader(Rows(), batch_sampler=sampler, num_workers=workers)

    straight = [digest(b) for _, b in zip(range(20), make(), strict=False)]
    dl = make()
    it = iter(dl)
    for _ in range(7):
        next(it)
    state = dl.state_dict()
    resumed = make()
    resumed.load_state_dict(state)
    rest = [digest(b) for _, b in zip(range(13), resumed, strict=False)]
    assert rest == straight[7:]


def test_state_after_for_vanilla_loader_and_reshard() -> None:
    ranks = [
        DeterministicBatchSampler(
            N, global_batch_size=8, micro_batch_size=2, seed=5, rank=r, world_size=2
        )
        for r in range(2)
    ]
    iters = [iter(s) for s in ranks]
    for it in iters:
        for _ in range(6):
            next(it)
    state = ranks[0].state_after(4)  # the training loop consumed 4 micro batches = 2 steps
    assert state["samples_consumed"] == 16
    single = DeterministicBatchSampler(N, global_batch_size=8, micro_batch_size=8, seed=5)
    single.load_state_dict(state)
    ids = detdata_ids(6)
    assert next(iter(single)) == ids[4] + ids[5]


def test_mismatched_state_lists_fields() -> None:
    a = DeterministicBatchSampler(N, global_batch_size=8, seed=5)
    b = DeterministicBatchSampler(N + 1, global_batch_size=16, seed=5)
    with pytest.raises(detdata.StateError) as err:
        b.load_state_dict(a.state_dict())
    assert set(err.value.fields) == {"num_samples", "global_batch_size"}


def test_mixture_sampler_yields_source_and_id_like_the_loader() -> None:
    sources = {
        "a": detdata.ArrayDataset({"x": np.arange(50)}),
        "b": detdata.ArrayDataset({"x": np.arange(30) + 1000}),
    }
    mix = detdata.Mixture(sources, {"a": "0.6", "b": "0.4"}, seed=4)
    sampler = DeterministicBatchSampler(mix, global_batch_size=8, micro_batch_size=4)
    items = [b for _, b in zip(range(6), sampler, strict=False)]
    loader = detdata.DataLoader(mix, global_batch_size=8, micro_batch_size=4)
    it = iter(loader)
    for batch in items:
        expected = next(it)["x"].tolist()
        assert [i if s == "a" else i + 1000 for s, i in batch] == expected
    state = sampler.state_dict()
    assert state["mixture"] == mix.fingerprint() and state["num_samples"] is None
    other = DeterministicBatchSampler(
        detdata.Mixture(sources, {"a": "0.5", "b": "0.5"}, seed=4),
        global_batch_size=8,
        micro_batch_size=4,
    )
    with pytest.raises(detdata.StateError) as err:
        other.load_state_dict(state)
    assert err.value.fields == ("mixture",)


def test_len_is_constant_and_the_batch_sampler_surface() -> None:
    def make(**kwargs: Any) -> DeterministicBatchSampler:
        return DeterministicBatchSampler(
            N, global_batch_size=8, micro_batch_size=4, seed=5, **kwargs
        )

    sampler = make()
    assert len(sampler) == N // 4  # one pass over the dataset, this rank's micro batches
    assert sampler.batch_size == 4 and sampler.drop_last is True and sampler.sampler is None
    got = [b for _, b in zip(range(7), sampler, strict=False)]
    assert len(sampler) == N // 4  # unchanged by consumption
    sampler.set_epoch(9)  # a no-op: the next item is still the 8th
    assert [*got, next(iter(sampler))] == detdata_ids(8)
    assert len(tud.DataLoader(Rows(), batch_sampler=sampler)) == N // 4
    bounded = make(total_samples=40)
    assert len(bounded) == 10 and len(list(bounded)) == 10
    assert len(make(rank=1, world_size=2)) == N // 8
    mix = detdata.Mixture({"a": detdata.ArrayDataset({"x": np.arange(5)})}, {"a": "1"}, seed=0)
    assert len(DeterministicBatchSampler(mix, global_batch_size=8)) == (1 << 62) // 8


def test_failed_load_leaves_the_position() -> None:
    sampler = DeterministicBatchSampler(N, global_batch_size=8, micro_batch_size=4, seed=5)
    state = sampler.state_after(0)
    it = iter(sampler)
    for _ in range(3):
        next(it)
    with pytest.raises(detdata.StateError, match="not a micro-step boundary"):
        sampler.load_state_dict({**state, "samples_consumed": 6})
    assert sampler.samples_consumed == 12
    sampler.load_state_dict({**state, "samples_consumed": 16})
    assert next(iter(sampler)) == detdata_ids(5)[4]


def test_world_change_between_iterations_continues_at_the_next_position(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Built before the process group (world 1), 4 micro batches of 2 are yielded; the group
    then comes up with world 2 and each rank iterates again: together they continue at
    position 8, with no gap or repeat against `GlobalOrder` by position. (The process group
    is simulated: the sampler's `Placement` reads it through `process_group_rank_world`.)"""
    import detdata.loading.layout as layout_module

    group = [(0, 1), (0, 1)]  # per sampler: (rank, world) its process group reports
    samplers = [
        DeterministicBatchSampler(1000, global_batch_size=8, micro_batch_size=2, seed=1)
        for _ in range(2)
    ]
    first: list[list[int]] = []
    for k, s in enumerate(samplers):
        monkeypatch.setattr(layout_module, "process_group_rank_world", lambda k=k: group[k])
        it = iter(s)
        batches = [next(it) for _ in range(4)]
        assert s.samples_consumed == 8
        first = [i for b in batches for i in b]
    group[:] = [(0, 2), (1, 2)]
    per_rank = []
    for k, s in enumerate(samplers):
        monkeypatch.setattr(layout_module, "process_group_rank_world", lambda k=k: group[k])
        it = iter(s)
        assert s.samples_consumed == 8
        per_rank.append([next(it) for _ in range(3)])
        assert s.samples_consumed == 8 + 3 * 4
    after = [i for k in range(3) for r in per_rank for i in r[k]]
    order = detdata.GlobalOrder(1000, 1).ids(np.arange(20)).tolist()
    assert first + after == order
