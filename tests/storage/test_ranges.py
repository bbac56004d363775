"""Range coalescing (`detdata.storage.ranges`): the rule against brute force, the bytes
against the writer's files on a real nginx, through the fault proxy (request counts,
resets in the middle of an answer)."""

from __future__ import annotations

import itertools
import logging
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest

from detdata.base.errors import ConfigError
from detdata.storage.fs import filesystem
from detdata.storage.ranges import coalesce, read_coalesced
from detdata.storage.retry import RetriesExhausted, RetryPolicy
from tests.faultproxy import FaultProxy, reset_all, schedule
from tests.servers import HttpServer

PATIENT = RetryPolicy(deadline_s=20.0, attempt_timeout_s=2.0, base_delay_s=0.01, max_delay_s=0.1)
FAST = RetryPolicy(deadline_s=1.0, attempt_timeout_s=0.5, base_delay_s=0.05, max_delay_s=0.2)


def brute_union(starts: list[int], ends: list[int]) -> list[tuple[int, int]]:
    merged: list[list[int]] = []
    for s, e in sorted(zip(starts, ends, strict=True)):
        if merged and s <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], e)
        else:
            merged.append([s, e])
    return [(s, e) for s, e in merged]


def brute_min_requests(starts: list[int], ends: list[int], waste: float) -> int:
    """Fewest requests over EVERY choice of bridged gaps within the byte budget."""
    runs = brute_union(starts, ends)
    needed = sum(e - s for s, e in runs)
    gaps = [runs[i + 1][0] - runs[i][1] for i in range(len(runs) - 1)]
    best = len(runs)
    for k in range(len(gaps) + 1):
        for chosen in itertools.combinations(gaps, k):
            if sum(chosen) <= waste * needed:
                best = min(best, len(runs) - k)
    return best


@pytest.mark.parametrize("waste", [0.0, 0.2, 1.0])
def test_coalesce_covers_every_range_within_the_waste_bound_with_fewest_requests(
    waste: float,
) -> None:
    rng = np.random.default_rng(3)
    for _ in range(400):
        n = int(rng.integers(1, 9))
        starts = rng.integers(0, 400, n).tolist()
        ends = [s + int(x) for s, x in zip(starts, rng.integers(1, 40, n), strict=True)]
        plan = coalesce(starts, ends, waste=waste)
        needed = sum(e - s for s, e in brute_union(starts, ends))
        assert int((plan.run_ends - plan.run_starts).sum()) <= (1 + waste) * needed
        runs = list(zip(plan.run_starts.tolist(), plan.run_ends.tolist(), strict=True))
        assert runs == sorted(runs) and all(a[1] < b[0] for a, b in itertools.pairwise(runs))
        for i, (s, e) in enumerate(zip(starts, ends, strict=True)):
            rs, re_ = runs[int(plan.run_of[i])]
            assert rs + int(plan.offset[i]) == s and e <= re_
        assert len(runs) == brute_min_requests(starts, ends, waste)


def test_adjacent_and_overlapping_ranges_are_one_request() -> None:
    # windows of 33 tokens every 32 tokens (the label token overlaps the next window)
    starts = [128 + 64 * w for w in range(50)]
    plan = coalesce(starts, [s + 66 for s in starts], waste=0.0)
    assert plan.run_starts.tolist() == [128] and plan.run_ends.tolist() == [128 + 64 * 49 + 66]


def test_bad_ranges_are_refused() -> None:
    with pytest.raises(ConfigError):
        coalesce([5], [4])
    with pytest.raises(ConfigError):
        coalesce([0], [1], waste=-1)


@pytest.fixture(scope="module")
def served(http_server: HttpServer) -> tuple[Path, str, dict[str, bytes]]:
    directory, url = http_server.new_dir()
    rng = np.random.default_rng(5)
    files = {
        f"f{i}.bin": rng.integers(0, 256, 50_000 + 1000 * i, dtype=np.uint8).tobytes()
        for i in range(3)
    }
    for name, data in files.items():
        (directory / name).write_bytes(data)
    return directory, url, files


def ranges_of(files: dict[str, bytes], seed: int, count: int) -> list[tuple[str, int, int]]:
    rng = np.random.default_rng(seed)
    out = []
    names = sorted(files)
    for _ in range(count):
        name = names[int(rng.integers(0, len(names)))]
        start = int(rng.integers(0, len(files[name]) - 600))
        out.append((name, start, start + int(rng.integers(1, 600))))
    return out


def fetch(
    url: str, wanted: list[tuple[str, int, int]], policy: RetryPolicy
) -> tuple[list[bytes], int]:
    fs, root = filesystem(url, skip_instance_cache=True)
    views, stats = read_coalesced(
        fs,
        [f"{root}/{n}" for n, _, _ in wanted],
        [s for _, s, _ in wanted],
        [e for _, _, e in wanted],
        policy=policy,
        shards=[n for n, _, _ in wanted],
        urls=[f"{url}/{n}" for n, _, _ in wanted],
    )
    assert stats.bytes_fetched <= 1.2 * stats.bytes_needed
    return [bytes(v) for v in views], stats.requests


def test_coalesced_reads_equal_the_files_with_fewer_requests(
    http_server: HttpServer,
    served: tuple[Path, str, dict[str, bytes]],
    fault_proxy: Callable[[int], FaultProxy],
) -> None:
    _, url, files = served
    proxy = fault_proxy(http_server.port)
    url = url.replace(f"127.0.0.1:{http_server.port}", proxy.address)
    # dense ranges (every byte of each file needed): one request per file
    wanted = [
        (n, s, min(s + 1000, len(files[n])))
        for n in sorted(files)
        for s in range(0, len(files[n]), 1000)
    ][::-1]
    got, requests = fetch(url, wanted, PATIENT)
    assert got == [files[n][s:e] for n, s, e in wanted]
    assert requests == len(files) and proxy.stats.requests == len(files)
    # sparse random ranges: still exact, never more requests than ranges
    wanted = ranges_of(files, 1, 300)
    got, requests = fetch(url, wanted, PATIENT)
    assert got == [files[n][s:e] for n, s, e in wanted]
    assert requests < 300


def test_resets_in_the_middle_of_covering_requests_are_retried_to_exact_bytes(
    http_server: HttpServer,
    served: tuple[Path, str, dict[str, bytes]],
    fault_proxy: Callable[[int], FaultProxy],
) -> None:
    _, url, files = served
    proxy = fault_proxy(http_server.port)
    proxy.set_plan(schedule(reset_every=2, reset_after=20_000))  # mid-answer of a 50 KB run
    url = url.replace(f"127.0.0.1:{http_server.port}", proxy.address)
    wanted = [(n, 0, len(files[n])) for n in sorted(files)] + ranges_of(files, 2, 50)
    got, _ = fetch(url, wanted, PATIENT)
    assert got == [files[n][s:e] for n, s, e in wanted]
    assert proxy.stats.resets > 0


def test_a_dead_link_fails_naming_the_shard_and_url(
    http_server: HttpServer,
    served: tuple[Path, str, dict[str, bytes]],
    fault_proxy: Callable[[int], FaultProxy],
    caplog: pytest.LogCaptureFixture,
) -> None:
    _, url, _ = served
    proxy = fault_proxy(http_server.port)
    proxy.set_plan(reset_all)
    url = url.replace(f"127.0.0.1:{http_server.port}", proxy.address)
    with caplog.at_level(logging.ERROR), pytest.raises(RetriesExhausted) as info:
        fetch(url, [("f1.bin", 10, 20), ("f1.bin", 30, 40)], FAST)
    assert "f1.bin" in str(info.value) and f"{url}/f1.bin" in str(info.value)
