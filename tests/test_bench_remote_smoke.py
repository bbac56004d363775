"""benchmarks/remote.py runs end to end at smoke size (nginx + SeaweedFS behind the
emulated link; a missing server binary skips) and its rows are well formed. No speed is
asserted: speeds are the benchmark's output, not a test's."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest

from benchmarks import remote_report
from benchmarks.remote import MODES, ORDERS, remote_rows


@pytest.mark.slow
def test_remote_benchmark_smoke_rows(tmp_path: Path) -> None:
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
    # the HTTP server is nginx where the machine has one (and it is not forced off), else Twisted
    nginx = shutil.which("nginx") or os.access("/usr/sbin/nginx", os.X_OK)
    forced = os.environ.get("DETDATA_TEST_HTTP", "")
    expected = "nginx" if forced == "nginx" or (nginx and forced != "twisted") else "twisted"
    assert {(r["store"], r["server"]) for r in rows} == {("http", expected), ("s3", "seaweedfs")}
    _generated_block_shows_every_row(rows, tmp_path / "benchmarks.md")


def _generated_block_shows_every_row(rows: list[dict[str, object]], doc_path: Path) -> None:
    """``--doc``: one table line per row, in order, with its rate; the block replaces only
    the text between its markers."""
    provenance = {"command": "python -m benchmarks.remote --smoke --doc", "date_utc": "d"}
    provenance |= {"commit": "c", "machine": "m", "load_before": 1.0, "load_after": 2.0}
    section = remote_report.markdown({"provenance": provenance, "rows": rows})
    lines = [x for x in section.splitlines() if x.startswith(("| http |", "| s3 |"))]
    assert len(lines) == len(rows)
    for line, row in zip(lines, rows, strict=True):
        rate = float(str(row["samples_per_s"]))
        assert line.startswith(f"| {row['store']} | {row['order']} | {row['mode']} | {rate:,.0f} |")
    assert "`python -m benchmarks.remote --smoke --doc`" in section
    doc_path.write_text(f"before\n{remote_report.BEGIN}\nold table\n{remote_report.END}\nafter\n")
    remote_report.write_doc(section, doc_path)
    assert doc_path.read_text() == f"before\n{section}\nafter\n"
    assert "](../benchmarks/results/remote.png)" in section
    png = doc_path.with_name("remote.png")
    remote_report.figure({"provenance": provenance, "rows": rows}, png)
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 1000
