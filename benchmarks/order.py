"""Benchmark: `GlobalOrder` (feistel-v1) against ``numpy.random.Generator.permutation``.

For n = 10**6, 10**9, 10**12 it measures ids per second (one core, batches of
positions as a loader would ask for them) and memory: the transient peak per
position of a batch, and the persistent memory per sample (zero for
GlobalOrder: nothing of size n exists). The permutation is measured where it
fits (n = 10**6 and 10**7 here); for larger n it is reported as infeasible with
the memory it would need (8 bytes per sample for the int64 permutation alone).

Run: ``python -m benchmarks.order`` (``--quick`` for a short run). Prints a
table and writes ``benchmarks/results/order.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

from benchmarks.memory import peak_bytes
from benchmarks.timing import Stopwatch, best_of
from detdata import GlobalOrder

ALGORITHM = GlobalOrder.algorithm

RESULTS = Path(__file__).parent / "results" / "order.json"
BATCH = 1 << 16
CALLS = 16  # GlobalOrder.ids calls per timed repeat
SIZES = (10**6, 10**9, 10**12)
WORST_CASE = (1 << 30) + 1  # just above a power of two: most cycle-walking
PERMUTATION_SIZES = (10**6, 10**7)
PERM_BYTES_PER_SAMPLE = 8  # int64 result of Generator.permutation(n)


@dataclass(frozen=True, kw_only=True)
class Row:
    """One measured (or infeasible) configuration."""

    method: str
    n: int
    ids_per_s: float | None
    setup_s: float | None
    persistent_bytes_per_sample: float
    peak_bytes: int | None  # measured peak; for rows not run: the bytes it would need
    note: str


def pin_one_core() -> str:
    """Pin this process to one CPU (Linux); returns a description."""
    if hasattr(os, "sched_setaffinity"):
        cpu = min(os.sched_getaffinity(0))
        os.sched_setaffinity(0, {cpu})
        return f"pinned to cpu {cpu}"
    return "not pinned (no sched_setaffinity)"


def bench_order(n: int, seconds: float) -> Row:
    """GlobalOrder ids/s (best repeat over ``seconds``) on contiguous batches at spread starts."""
    order = GlobalOrder(n, 1234)
    starts = np.random.default_rng(0).integers(0, 3 * n, size=64)
    batches = [np.arange(s, s + BATCH, dtype=np.int64) for s in starts]
    state = {"i": 0}

    def run() -> None:
        for _ in range(CALLS):
            order.ids(batches[state["i"] % len(batches)])
            state["i"] += 1

    rate = CALLS * BATCH / best_of(run, 1, min_seconds=seconds)
    peak = peak_bytes(lambda: GlobalOrder(n, 99).ids(batches[0]))
    return Row(
        method=f"GlobalOrder ({ALGORITHM})",
        n=n,
        ids_per_s=rate,
        setup_s=0.0,
        persistent_bytes_per_sample=0.0,
        peak_bytes=peak,
        note=f"batch {BATCH}: transient {peak / BATCH:.0f} B/position, freed after",
    )


def bench_permutation(n: int, seconds: float) -> Row:
    """numpy permutation: build time, then ids/s = n / build time (lookups are then free)."""
    rng = np.random.default_rng(1234)
    with Stopwatch() as build:
        perm = rng.permutation(n)
    del perm
    rate = n / best_of(lambda: np.random.default_rng(5).permutation(n), 1, min_seconds=seconds)
    peak = peak_bytes(lambda: np.random.default_rng(7).permutation(n))
    return Row(
        method="numpy Generator.permutation",
        n=n,
        ids_per_s=rate,
        setup_s=build.seconds,
        persistent_bytes_per_sample=peak / n,
        peak_bytes=peak,
        note="whole permutation materialised; ids/s counts its construction",
    )


def infeasible_permutation(n: int, available: int, measured: Row) -> Row:
    """Not run: the memory it needs, and the build time extrapolated linearly from ``measured``."""
    need = n * PERM_BYTES_PER_SAMPLE
    eta = (measured.setup_s or 0.0) * n / measured.n
    return Row(
        method="numpy Generator.permutation",
        n=n,
        ids_per_s=None,
        setup_s=None,
        persistent_bytes_per_sample=PERM_BYTES_PER_SAMPLE,
        peak_bytes=need,
        note=f"not run (infeasible): needs >= {need / 2**30:,.1f} GiB for the int64 array "
        f"alone (machine: {available / 2**30:,.0f} GiB, shared), ~{eta:,.0f} s to "
        f"build by linear extrapolation from n={measured.n:,}",
    )


def total_memory() -> int:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return 0


def fmt_rate(rate: float | None) -> str:
    return "-" if rate is None else f"{rate / 1e6:,.1f} M"


def print_table(rows: list[Row]) -> None:
    head = (
        f"{'method':30} {'n':>16} {'ids/s':>10} {'setup s':>8} {'B/sample':>9} "
        f"{'peak MiB':>9}  note"
    )
    print(head)
    print("-" * len(head))
    for r in rows:
        setup = "-" if r.setup_s is None else f"{r.setup_s:.3f}"
        peak = "-" if r.peak_bytes is None or r.ids_per_s is None else f"{r.peak_bytes / 2**20:.2f}"
        print(
            f"{r.method:30} {r.n:>16,} {fmt_rate(r.ids_per_s):>10} {setup:>8} "
            f"{r.persistent_bytes_per_sample:>9.1f} {peak:>9}  {r.note}"
        )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--quick", action="store_true", help="shorter timing loops")
    parser.add_argument("--out", default=str(RESULTS))
    args = parser.parse_args(argv)
    seconds = 0.3 if args.quick else 2.0
    pinned = pin_one_core()
    memory = total_memory()
    rows: list[Row] = []
    for n in (*SIZES, WORST_CASE):
        rows.append(bench_order(n, seconds))
    measured = [bench_permutation(n, seconds) for n in PERMUTATION_SIZES]
    rows += measured
    rows += [
        infeasible_permutation(n, memory, measured[-1]) for n in SIZES if n not in PERMUTATION_SIZES
    ]
    print_table(rows)
    result = {
        "benchmark": "order",
        "algorithm": ALGORITHM,
        "batch": BATCH,
        "target_ids_per_s": 5e6,
        "machine": {
            "platform": platform.platform(),
            "python": platform.python_version(),
            "numpy": np.__version__,
            "cpus": os.cpu_count(),
            "affinity": pinned,
            "memory_bytes": memory,
        },
        "rows": [asdict(r) for r in rows],
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    print(f"\nwrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
