"""benchmarks/remote.py runs end to end at smoke size (nginx + SeaweedFS behind the
emulated link; a missing server binary skips) and its rows are well formed. No speed is
asserted: speeds are the benchmark's output, not a test's."""

from __future__ import annotations

import pytest

from benchmarks.remote import MODES, ORDERS, remote_rows


@pytest.mark.slow
def test_remote_benchmark_smoke_rows() -> None:
    rows = remote_rows(smoke=True)
    assert {r["store"] for r in rows} == {"http", "s3"}
    assert {r["order"] for r in rows} == set(ORDERS)
    assert {r["mode"] for r in rows} == set(MODES)
    for row in rows:
        assert row["samples_per_s"] > 0 and row["batches"] > row["warmup_batches"], row
        assert row["fetched_per_delivered"] >= 1.0, row  # every delivered byte crossed the link
        if row["mode"].startswith("cache"):
            assert row["cache_bytes"] * 10 <= row["dataset_bytes"] + row["cache_bytes"], row
            assert row["stall_s"] is not None
