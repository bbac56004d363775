"""Device batches: pinned staging pool, copy stream, prefetch (issue: copy/compute overlap).

CPU tests run the same staging code with ``device="cpu"``; tests that need a
GPU are skipped without CUDA and run by ``scripts/gpu_check.sh``.
"""

from __future__ import annotations

import gc
import json
import weakref
from collections import namedtuple
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
import torch

import detdata
from detdata.loading.device import PinnedBufferPool, device_batches
from detdata.loading.loader import DataLoader
from tests.resume_checker import check_resume_everywhere, digest, run_digests, take

needs_cuda = pytest.mark.skipif(
    not torch.cuda.is_available(),
    reason="needs a CUDA GPU; run scripts/gpu_check.sh on a GPU machine",
)

N = 600
GBS = 16


def dataset(n: int = N, width: int = 33) -> detdata.ArrayDataset:
    ids = np.arange(n, dtype=np.int64)
    x = (ids[:, None] * 131 + np.arange(width)).astype(np.int32)
    return detdata.ArrayDataset({"id": ids, "x": x, "f": (x * 0.5).astype(np.float32)})


def loader(**kwargs: Any) -> DataLoader:
    args: dict[str, Any] = {"global_batch_size": GBS, "micro_batch_size": 4, "seed": 7}
    args.update(kwargs)
    return DataLoader(dataset(), **args)


def to_cpu(obj: Any) -> Any:
    if isinstance(obj, torch.Tensor):
        return obj.cpu()
    if isinstance(obj, dict):
        return {k: to_cpu(v) for k, v in obj.items()}
    return obj


def random_batches(count: int, rows: int = 64, seed: int = 0) -> list[dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    return [
        {
            "tokens": torch.randint(0, 2**31 - 1, (rows, 129), generator=g, dtype=torch.int64),
            "mask": torch.rand((rows, 129), generator=g) > 0.5,
        }
        for _ in range(count)
    ]


class CountingSource:
    """An iterator over ``batches`` that records how many were pulled."""

    def __init__(self, batches: list[Any], fail_after: int | None = None) -> None:
        self.batches = batches
        self.pulled = 0
        self.fail_after = fail_after

    def __iter__(self) -> Iterator[Any]:
        return self

    def __next__(self) -> Any:
        if self.fail_after is not None and self.pulled == self.fail_after:
            raise ValueError(f"source failed at batch {self.pulled}")
        if self.pulled >= len(self.batches):
            raise StopIteration
        self.pulled += 1
        return self.batches[self.pulled - 1]


# ------------------------------------------------------- order and bytes
@pytest.mark.parametrize(("depth", "workers"), [(1, 0), (2, 0), (5, 0), (2, 2)])
def test_device_path_same_order_and_bytes_as_plain(depth: int, workers: int) -> None:
    count = 30
    plain = run_digests(loader(num_workers=workers), count)
    # keep every delivered batch alive before hashing: a delivered tensor that aliased a
    # staging buffer would be overwritten by later batches and fail here
    kept = list(
        take(
            loader(
                num_workers=workers,
                options=detdata.LoaderOptions(
                    device=detdata.DeviceFeed(device="cpu", copies_ahead=depth)
                ),
            ),
            count,
        )
    )
    assert [digest(b) for b in kept] == plain
    assert all(t.device.type == "cpu" for b in kept for t in b.values())


def test_finite_loader_delivers_every_batch_then_stops() -> None:
    total = 10 * GBS  # 40 micro batches of 4
    plain = [digest(b) for b in loader(options=detdata.LoaderOptions(total_samples=total))]
    dl = loader(
        options=detdata.LoaderOptions(
            total_samples=total, device=detdata.DeviceFeed(device="cpu", copies_ahead=3)
        )
    )
    got = [digest(b) for b in dl]
    assert len(plain) == 40
    assert got == plain
    assert dl.samples_consumed == total


def test_nested_structure_and_non_tensor_leaves_kept() -> None:
    pair = namedtuple("pair", "a b")
    src = [
        {
            "x": torch.arange(12, dtype=torch.int16).view(3, 4) + i,
            "nested": {
                "list": [torch.full((i + 1,), float(i)), "tag"],
                "tuple": (torch.tensor(i), 3.5),
                "named": pair(torch.ones(2, dtype=torch.bool), None),
            },
            "meta": np.arange(3) + i,
        }
        for i in range(6)
    ]
    out = list(device_batches(iter(src), "cpu", 2))
    assert len(out) == len(src)
    for i, (got, want) in enumerate(zip(out, src, strict=True)):
        assert set(got) == set(want)
        assert digest(got["x"]) == digest(want["x"])
        assert isinstance(got["nested"]["list"], list) and got["nested"]["list"][1] == "tag"
        assert digest(got["nested"]["list"][0]) == digest(want["nested"]["list"][0])
        assert isinstance(got["nested"]["tuple"], tuple) and got["nested"]["tuple"][1] == 3.5
        assert int(got["nested"]["tuple"][0]) == i
        assert type(got["nested"]["named"]) is pair and got["nested"]["named"].b is None
        assert digest(got["nested"]["named"].a) == digest(want["nested"]["named"].a)
        assert got["meta"] is want["meta"]  # non-tensor leaves pass through untouched
        assert got["x"].data_ptr() != want["x"].data_ptr()  # copied, not the source tensor


# ------------------------------------------------------------ prefetch/state
def test_prefetch_pulls_exactly_depth_ahead() -> None:
    for depth in (1, 2, 4):
        src = CountingSource(random_batches(10, rows=2))
        it = device_batches(src, "cpu", depth)
        assert src.pulled == 0  # nothing happens before the first next()
        for k in range(1, 11):
            next(it)
            assert src.pulled == min(k + depth, 10), (depth, k)
        with pytest.raises(StopIteration):
            next(it)


def test_state_counts_yielded_batches_not_prefetched() -> None:
    pulled: list[int] = []

    def collate(batch: dict[str, np.ndarray]) -> dict[str, torch.Tensor]:
        pulled.append(int(batch["id"][0]))
        return {k: torch.from_numpy(v) for k, v in batch.items()}

    straight = run_digests(loader(), 12)
    dl = loader(
        options=detdata.LoaderOptions(
            read=detdata.ReadOptions(batches_ahead=1),
            device=detdata.DeviceFeed(device="cpu", copies_ahead=3),
        ),
        collate_fn=collate,
    )  # one read per pull
    it = iter(dl)
    got = [digest(next(it)) for _ in range(5)]
    assert got == straight[:5]
    assert len(pulled) == 5 + 3, "the prefetcher should have pulled 3 batches ahead"
    assert dl.samples_consumed == 5 * 4  # only the 5 yielded micro batches of 4 samples
    state = json.loads(json.dumps(dl.state_dict()))
    assert state["samples_consumed"] == 20
    for device in (None, "cpu"):  # resume on either path continues with exactly the next batch
        resumed = loader(
            options=detdata.LoaderOptions(device=detdata.DeviceFeed(device=device, copies_ahead=2))
        )
        # the observing collate delivers the default collate's bytes: allow the changed "transform"
        resumed.load_state_dict(state, allow=["transform"], mid_step="continue")
        assert run_digests(resumed, 7) == straight[5:]
    # the original iterator, after its state was read, still continues where it was
    assert [digest(next(it)) for _ in range(7)] == straight[5:]


def test_resume_everywhere_on_device_path() -> None:
    reference = check_resume_everywhere(
        lambda: loader(
            options=detdata.LoaderOptions(device=detdata.DeviceFeed(device="cpu", copies_ahead=2))
        ),
        16,
    )
    assert reference == run_digests(loader(), 16)


def test_source_error_raised_after_staged_batches() -> None:
    batches = random_batches(5, rows=2)
    src = CountingSource(batches, fail_after=3)
    it = device_batches(src, "cpu", 2)
    got = [digest(next(it)) for _ in range(3)]
    assert got == [digest(b) for b in batches[:3]]
    with pytest.raises(ValueError, match="source failed at batch 3"):
        next(it)


def test_generator_keeps_no_reference_to_delivered_batch() -> None:
    it = device_batches(iter(random_batches(6, rows=2)), "cpu", 2)
    batch = next(it)
    ref = weakref.ref(batch["tokens"])
    del batch
    gc.collect()
    assert ref() is None, "a delivered batch must be freeable while the iterator is suspended"
    next(it)


# ------------------------------------------------------------- buffer reuse
def test_pool_allocates_once_per_slot_and_key_over_many_batches() -> None:
    depth = 2
    batches = random_batches(60, rows=8)
    pool = PinnedBufferPool(depth + 1, pin=False)
    out = list(device_batches(iter(batches), "cpu", depth, pool=pool))
    assert [digest(b) for b in out] == [digest(b) for b in batches]
    assert pool.allocations == (depth + 1) * 2  # 3 slots x 2 keys, not 60 x 2
    per_batch = sum(t.numel() * t.element_size() for t in batches[0].values())
    assert sum(b.numel() for b in pool.buffers()) == (depth + 1) * per_batch


def test_pool_reuses_for_smaller_and_grows_for_larger_batches() -> None:
    pool = PinnedBufferPool(2, pin=False)
    small = random_batches(4, rows=4, seed=1)
    big = random_batches(3, rows=16, seed=2)
    out = list(device_batches(iter(random_batches(4, rows=8) + small), "cpu", 1, pool=pool))
    assert pool.allocations == 2 * 2  # the smaller batches fit the existing buffers
    assert [digest(b) for b in out[4:]] == [digest(b) for b in small]
    out = list(device_batches(iter(big), "cpu", 1, pool=pool))  # a later iterator reuses the pool
    assert [digest(b) for b in out] == [digest(b) for b in big]
    assert pool.allocations == 2 * 2 + 2 * 2  # each slot's two buffers grew once


def test_pool_used_by_one_live_iterator_at_a_time() -> None:
    pool = PinnedBufferPool(3, pin=False)
    first = device_batches(iter(random_batches(5, rows=2)), "cpu", 2, pool=pool)
    next(first)
    second = device_batches(iter(random_batches(5, rows=2)), "cpu", 2, pool=pool)
    with pytest.raises(detdata.ConfigError, match="already used"):
        next(second)
    first.close()  # closing the first releases the pool
    third = device_batches(iter(random_batches(5, rows=2)), "cpu", 2, pool=pool)
    assert len(list(third)) == 5


# ----------------------------------------------------------------- errors
def test_cuda_unavailable_is_a_clear_config_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    for device in ("cuda", "cuda:0", torch.device("cuda")):
        with pytest.raises(detdata.ConfigError, match="CUDA is not available") as info:
            device_batches(iter([]), device)  # raised eagerly, before iteration
        assert "device='cpu'" in str(info.value) and "device=None" in str(info.value)
    with pytest.raises(detdata.ConfigError, match="CUDA is not available"):
        next(
            iter(loader(options=detdata.LoaderOptions(device=detdata.DeviceFeed(device="cuda"))))
        )  # at construction or, at the latest, first batch


def test_cuda_index_out_of_range(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    with pytest.raises(detdata.ConfigError, match="index 3 is out of range"):
        device_batches(iter([]), "cuda:3")


@pytest.mark.parametrize("device", ["tpu", "not a device", 3, "meta"])
def test_bad_device_refused(device: Any) -> None:
    with pytest.raises(detdata.ConfigError, match="device"):
        device_batches(iter([]), device)


@pytest.mark.parametrize("depth", [0, -1, True, 2.0, "2", 65, None])
def test_bad_depth_refused(depth: Any) -> None:
    with pytest.raises(detdata.ConfigError, match="depth"):
        device_batches(iter([]), "cpu", depth)
    with pytest.raises(detdata.ConfigError, match=r"DeviceFeed\.copies_ahead"):
        next(
            iter(
                loader(
                    options=detdata.LoaderOptions(
                        device=detdata.DeviceFeed(device="cpu", copies_ahead=depth)
                    )
                )
            )
        )


def test_pool_checks() -> None:
    with pytest.raises(detdata.ConfigError, match="needs at least 4"):
        device_batches(iter([]), "cpu", 3, pool=PinnedBufferPool(3, pin=False))
    with pytest.raises(detdata.ConfigError, match="pin="):
        device_batches(iter([]), "cpu", 1, pool=PinnedBufferPool(2, pin=True))
    with pytest.raises(detdata.ConfigError, match="slots"):
        PinnedBufferPool(0, pin=False)


# ------------------------------------------------------------------- CUDA
SLEEP_CYCLES = 200_000_000  # ~0.1 s of GPU time at ~2 GHz


@needs_cuda
def test_cuda_same_order_and_bytes_and_state() -> None:
    straight = run_digests(loader(), 20)
    dl = loader(
        options=detdata.LoaderOptions(device=detdata.DeviceFeed(device="cuda", copies_ahead=2))
    )
    it = iter(dl)
    first = [next(it) for _ in range(8)]
    assert all(t.device.type == "cuda" for b in first for t in b.values())
    assert [digest(to_cpu(b)) for b in first] == straight[:8]
    assert dl.samples_consumed == 8 * 4
    resumed = loader(options=detdata.LoaderOptions(device=detdata.DeviceFeed(device="cuda")))
    resumed.load_state_dict(dl.state_dict(), mid_step="continue")
    assert [digest(to_cpu(b)) for b in take(resumed, 12)] == straight[8:]


@needs_cuda
def test_cuda_pool_is_pinned_and_bounded() -> None:
    pool = PinnedBufferPool(3, pin=True)
    batches = random_batches(40, rows=32)
    out = [to_cpu(b) for b in device_batches(iter(batches), "cuda", 2, pool=pool)]
    assert [digest(b) for b in out] == [digest(b) for b in batches]
    assert pool.allocations == 3 * 2
    assert len(pool.buffers()) == 6 and all(buf.is_pinned() for buf in pool.buffers())


@needs_cuda
def test_cuda_consumer_stream_waits_for_copy() -> None:
    stream = torch.cuda.Stream()
    batches = random_batches(3, rows=4096)  # ~6 MB per batch, random bytes
    with torch.cuda.stream(stream):
        torch.cuda._sleep(SLEEP_CYCLES)  # every copy queues behind this
    it = device_batches(iter(batches), "cuda", 1, copy_stream=stream)
    first = next(it)
    # .cpu() runs on the current stream: correct only if it waited on the copy's event
    assert digest(to_cpu(first)) == digest(batches[0])
    assert [digest(to_cpu(b)) for b in it] == [digest(b) for b in batches[1:]]


@needs_cuda
def test_cuda_pinned_buffer_not_rewritten_while_copy_in_flight() -> None:
    stream = torch.cuda.Stream()
    batches = random_batches(8, rows=4096)
    with torch.cuda.stream(stream):
        torch.cuda._sleep(SLEEP_CYCLES)  # copies stay in flight while the host stages more
    # depth 1 = 2 slots: staging batch 2 reuses batch 0's slot, whose copy is queued
    # behind the sleep; without the slot event the copy would read batch 2's bytes
    out = list(device_batches(iter(batches), "cuda", 1, copy_stream=stream))
    assert [digest(to_cpu(b)) for b in out] == [digest(b) for b in batches]


@needs_cuda
def test_cuda_delivered_memory_not_recycled_while_consumer_uses_it() -> None:
    batches = random_batches(6, rows=4096)
    copies = []
    for batch in device_batches(iter(batches), "cuda", 1):
        torch.cuda._sleep(SLEEP_CYCLES // 4)  # the consumer stream is busy...
        copies.append(batch["tokens"].clone())  # ...so this read runs later
        del batch  # freed now; without record_stream the next copy could reuse the block
    torch.cuda.synchronize()
    assert [digest(c.cpu()) for c in copies] == [digest(b["tokens"]) for b in batches]
