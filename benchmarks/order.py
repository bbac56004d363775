"""Benchmark: `GlobalOrder` (feistel-v1) against ``numpy.random.Generator.permutation``.

For n = 10**6, 10**9, 10**12 it measures ids per second (one core, batches of
positions as a loader would ask for them) and memory: the transient peak per
position of a batch, and the persistent memory per sample (zero for
GlobalOrder: nothing of size n exists). The permutation is measured where it
fits (n = 10**6 and 10**7 here); for larger n it is reported as infeasible with
the memory it would need (8 bytes per sample for the int64 permutation alone).

Run: ``python -m benchmarks.order`` (``--quick`` for a short run). Prints a
table and writes ``benchmarks/results/order.json``.

``python -m benchmarks.order --locality`` (`order_rows`): the locality-aware order
``locality-v1`` (`detdata.WindowedOrder`) against ``feistel-v1`` on one epoch of a
corpus of equal shards, read in global batches: shuffle quality (the effective batch
size for a per-shard latent feature, its lag autocorrelation, |Spearman rho| of id
vs position) and I/O (distinct shards per batch, shard opens per epoch under an LRU of
open shards), plus ids/s. Writes ``benchmarks/results/order_locality.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np

from benchmarks.memory import peak_bytes
from benchmarks.timing import Stopwatch, best_of
from detdata import GlobalOrder, WindowedOrder

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


# ----------------------------------------------------------------- locality-v1 vs feistel-v1
LOCALITY_RESULTS = Path(__file__).parent / "results" / "order_locality.json"
WINDOWS = (1, 2, 4, 8, 16, 64, 256)


def _lru_opens(batches: np.ndarray, capacity: int) -> int:
    """Shard opens when each batch reads its distinct shards (first-use order) through an
    LRU of ``capacity`` open shards."""
    from collections import OrderedDict

    open_: OrderedDict[int, None] = OrderedDict()
    opens = 0
    for batch in batches:
        _, first = np.unique(batch, return_index=True)
        for shard in batch[np.sort(first)].tolist():
            if shard in open_:
                open_.move_to_end(shard)
                continue
            opens += 1
            open_[shard] = None
            if len(open_) > capacity:
                open_.popitem(last=False)
    return opens


def _autocorr(x: np.ndarray, lag: int) -> float:
    x = x - x.mean()
    return float(np.dot(x[:-lag], x[lag:]) / np.dot(x, x))


def _spearman_abs(ids: np.ndarray, chunk: int) -> float:
    """Mean |Spearman rho| of (position, id) over consecutive chunks of ``chunk`` positions."""
    pos_rank = np.arange(chunk, dtype=np.float64)
    out = []
    for a in range(0, ids.size - chunk + 1, chunk):
        r = np.argsort(np.argsort(ids[a : a + chunk])).astype(np.float64)
        out.append(abs(np.corrcoef(pos_rank, r)[0, 1]))
    return float(np.mean(out))


def quality_row(
    name: str, ids: np.ndarray, shard_of: np.ndarray, num_shards: int, batch: int, capacity: int
) -> dict[str, Any]:
    """Shuffle quality and I/O of one epoch of ``ids`` read in batches of ``batch``."""
    shards = shard_of[ids]
    batches = shards[: shards.size // batch * batch].reshape(-1, batch)
    distinct = np.array([np.unique(b).size for b in batches])
    rng = np.random.default_rng(0)
    b_eff, ac1, ac_b, ac_10b = [], [], [], []
    for _ in range(8):  # a latent per-shard feature ("topic"): x_t = f[shard of position t]
        x = rng.standard_normal(num_shards)[shards]
        b_eff.append(float(x.var() / x[: batches.size].reshape(-1, batch).mean(axis=1).var()))
        ac1.append(_autocorr(x, 1))
        ac_b.append(_autocorr(x, batch))
        ac_10b.append(_autocorr(x, 10 * batch))
    return {
        "benchmark": "order_locality",
        "order": name,
        "samples": int(ids.size),
        "shards": num_shards,
        "batch": batch,
        "effective_batch": float(np.mean(b_eff)),
        "autocorr_lag1": float(np.mean(ac1)),
        f"autocorr_lag{batch}": float(np.mean(ac_b)),
        f"autocorr_lag{10 * batch}": float(np.mean(ac_10b)),
        "spearman_abs_4096": _spearman_abs(ids, 4096),
        "distinct_shards_per_batch": float(distinct.mean()),
        "lru_capacity": capacity,
        "shard_opens_per_epoch": _lru_opens(batches, capacity),
    }


def _rate(fn: Any, positions: np.ndarray, seconds: float) -> float:
    return positions.size / best_of(lambda: fn(positions), 3, min_seconds=seconds)


def order_rows(
    num_shards: int = 1000,
    per_shard: int = 1000,
    batch: int = 512,
    capacity: int = 64,
    windows: tuple[int, ...] = WINDOWS,
    seconds: float = 0.3,
) -> list[dict[str, Any]]:
    """One row per order (``feistel-v1``, then ``locality-v1`` per window size) over one
    epoch of ``num_shards`` equal shards; also ids/s on contiguous batches of 4096
    positions and on 65,536 random positions (for ``benchmarks/scale.py``)."""
    sizes = [per_shard] * num_shards
    n = num_shards * per_shard
    shard_of = np.repeat(np.arange(num_shards), per_shard)
    epoch = np.arange(n, dtype=np.int64)
    contiguous = np.arange(5 * n + 3, 5 * n + 3 + 4096, dtype=np.int64)
    rand = np.random.default_rng(1).integers(0, 10 * n, size=1 << 16)
    orders: list[tuple[str, Any]] = [("feistel-v1", GlobalOrder(n, 1234))]
    for k in windows:
        orders.append(
            (f"locality-v1(window_shards={k})", WindowedOrder(sizes, 1234, window_shards=k))
        )
    rows = []
    for name, order in orders:
        row = quality_row(name, order.ids(epoch), shard_of, num_shards, batch, capacity)
        order.ids(contiguous)  # this epoch's tables are built once, not timed
        row["contiguous_ids_per_s"] = _rate(order.ids, contiguous, seconds)
        row["random_ids_per_s"] = _rate(order.ids, rand, seconds)
        rows.append(row)
        print_quality(rows[-1:], header=len(rows) == 1)
    big = [1000] * 100_000
    with Stopwatch() as table:
        WindowedOrder(big, 7, window_shards=8).ids(np.arange(16, dtype=np.int64))
    rows.append(
        {
            "benchmark": "order_locality_epoch_table",
            "shards": len(big),
            "seconds": table.seconds,
            "note": "first position of an epoch: the O(shards) shard permutation + prefix sums",
        }
    )
    print(f"epoch tables of 100,000 shards: {1e3 * table.seconds:.1f} ms (once per epoch)")
    return rows


def print_quality(rows: list[dict[str, Any]], header: bool = True) -> None:
    if header:
        print(
            f"{'order':32}{'B_eff':>8}{'ac(1)':>7}{'ac(B)':>7}{'|rho|':>7}{'shards/B':>9}"
            f"{'opens/ep':>9}{'contig ids/s':>13}{'random ids/s':>13}"
        )
    for r in rows:
        b = r["batch"]
        print(
            f"{r['order']:32}{r['effective_batch']:>8.1f}{r['autocorr_lag1']:>7.3f}"
            f"{r[f'autocorr_lag{b}']:>7.3f}{r['spearman_abs_4096']:>7.3f}"
            f"{r['distinct_shards_per_batch']:>9.1f}{r['shard_opens_per_epoch']:>9,}"
            f"{r['contiguous_ids_per_s'] / 1e6:>11.1f} M{r['random_ids_per_s'] / 1e6:>11.1f} M"
        )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--quick", action="store_true", help="shorter timing loops")
    parser.add_argument("--out", default=str(RESULTS))
    parser.add_argument(
        "--locality", action="store_true", help="only locality-v1 vs feistel-v1 (order_rows)"
    )
    args = parser.parse_args(argv)
    if args.locality:
        rows = order_rows(seconds=0.1 if args.quick else 0.3)
        doc = {"machine": platform.platform(), "cpus": os.cpu_count(), "rows": rows}
        LOCALITY_RESULTS.parent.mkdir(parents=True, exist_ok=True)
        LOCALITY_RESULTS.write_text(json.dumps(doc, indent=1) + "\n")
        print(f"wrote {LOCALITY_RESULTS}")
        return 0
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
