"""Mixture benchmark: detdata ``mixture-v1`` vs per-sample multinomial and greedy blending.

Run: ``python benchmarks/mixture.py [--quick]``. Prints a table and writes
``benchmarks/results/mixture.json``.

* Throughput of ``Mixture.locate`` (source, index in source and sample id) and
  of ``Mixture.assign`` (source and index in source only) for
  2, 10 and 100 sources: one contiguous range of 2**20 positions far into the
  run, 8-position micro batches, and random positions in ``[0, 10**15)``.
* Deviation from the target proportions, ``max_s |count_s(P) - p_s P|``: at
  ``P = 10**6`` (also the max over every prefix up to 10**6) and ``P = 10**9``
  (``consumed(10**9)``, O(sources + phases), no replay).
* Baselines that must materialise one entry per position to reach position P:
  a multinomial draw per sample (torchdata-style, ``Generator.choice`` per
  position, also timed vectorised) and a sequential greedy blend
  (Megatron-style: at position i pick the source with the largest deficit
  ``p_s (i + 1) - count_s``). They are measured on 10**6 (per-sample loops) or
  10**7 (vectorised) positions and **extrapolated linearly** to 10**9; their
  memory is the index arrays they keep (Megatron: uint8/int16 source + int64
  index; multinomial: int64 + int64), measured with tracemalloc and
  extrapolated the same way. detdata jumps to position 10**9 directly.
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np

if not __package__:  # run as ``python benchmarks/mixture.py``: benchmarks.* from this checkout
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.memory import peak_bytes
from benchmarks.timing import Stopwatch, best_of
from detdata import Mixture
from detdata.cli.mix import CountDataset

RESULTS = Path(__file__).parent / "results" / "mixture.json"
TARGET = 10**9


def make_mixture(num_sources: int, seed: int = 1234) -> Mixture:
    """Skewed weights 1..S (so small and large sources coexist), sources of 10**9 samples."""
    names = [f"src{i:03d}" for i in range(num_sources)]
    return Mixture(
        {n: CountDataset(10**9, name=n) for n in names},
        {n: i + 1 for i, n in enumerate(names)},
        seed=seed,
    )


def throughput(m: Mixture, quick: bool) -> dict[str, float]:
    start = 10**12 + 3
    contiguous = np.arange(start, start + (1 << 18 if quick else 1 << 20), dtype=np.int64)
    t_contig = best_of(lambda: m.locate(contiguous))
    calls = 200 if quick else 1000
    micro = [np.arange(start + 8 * k, start + 8 * k + 8, dtype=np.int64) for k in range(calls)]
    t_micro = best_of(lambda: [m.locate(p) for p in micro])
    t_micro_assign = best_of(lambda: [m.assign(p) for p in micro])
    rand = np.random.default_rng(0).integers(0, 10**15, size=1 << 12 if quick else 1 << 14)
    t_rand = best_of(lambda: m.locate(rand), 1)
    t_rand_assign = best_of(lambda: m.assign(rand))
    t_contig_assign = best_of(lambda: m.assign(contiguous))
    peak = peak_bytes(lambda: m.locate(contiguous))
    return {
        "contiguous_pos_per_s": contiguous.size / t_contig,
        "contiguous_assign_only_pos_per_s": contiguous.size / t_contig_assign,
        "micro_batch8_pos_per_s": 8 * calls / t_micro,
        "micro_batch8_us_per_call": 1e6 * t_micro / calls,
        "micro_batch8_assign_only_us_per_call": 1e6 * t_micro_assign / calls,
        "random_pos_per_s": rand.size / t_rand,
        "random_assign_only_pos_per_s": rand.size / t_rand_assign,
        "contiguous_peak_bytes_per_pos": peak / contiguous.size,
    }


def deviation(m: Mixture) -> dict[str, Any]:
    p = [float(f) for f in m.weights_at(0).values()]
    src = m.locate(np.arange(10**6, dtype=np.int64))[0]
    t = np.arange(1, 10**6 + 1)
    every_prefix = max(float(np.abs(np.cumsum(src == s) - p[s] * t).max()) for s in range(len(p)))

    def at(P: int) -> float:
        got = m.consumed(P)
        return max(abs(got[n] - f * P) for n, f in zip(m.source_names, p, strict=True))

    with Stopwatch() as jump:
        dev_1e9 = at(TARGET)
    depth = int(np.ceil(np.log2(len(p)))) if len(p) > 1 else 0
    bound = max(depth + 16 * q * (1 - q) for q in p)
    return {
        "at_1e6": at(10**6),
        "max_over_prefixes_to_1e6": every_prefix,
        "at_1e9": dev_1e9,
        "documented_bound": bound,
        "consumed_1e9_seconds": jump.seconds,
        "consumed_1e9_peak_bytes": peak_bytes(lambda: m.consumed(TARGET)),
        "locate_1e9_seconds": best_of(lambda: m.locate(np.array([TARGET], dtype=np.int64))),
    }


# ----------------------------------------------------------------- baselines
def multinomial_per_sample(p: np.ndarray, n: int) -> tuple[np.ndarray, np.ndarray]:
    """torchdata-style: one Generator.choice per position, then each source's running index."""
    rng = np.random.default_rng(0)
    src = np.empty(n, dtype=np.int64)
    for i in range(n):
        src[i] = rng.choice(p.size, p=p)
    return src, _running_index(src, p.size)


def multinomial_vectorised(p: np.ndarray, n: int) -> tuple[np.ndarray, np.ndarray]:
    src = np.random.default_rng(0).choice(p.size, size=n, p=p)
    return src, _running_index(src, p.size)


def _running_index(src: np.ndarray, num_sources: int) -> np.ndarray:
    index = np.empty(src.size, dtype=np.int64)
    for s in range(num_sources):
        sel = src == s
        index[sel] = np.arange(int(sel.sum()))
    return index


def greedy_blend(p: np.ndarray, n: int) -> tuple[np.ndarray, np.ndarray]:
    """Megatron-style: largest deficit first, one array entry per position (pure Python loop)."""
    weights = p.tolist()
    counts = [0] * p.size
    src = np.empty(n, dtype=np.uint8 if p.size < 256 else np.int16)
    index = np.empty(n, dtype=np.int64)
    order = range(p.size)
    for i in range(n):
        best = max(order, key=lambda s: weights[s] * (i + 1) - counts[s])
        src[i] = best
        index[i] = counts[best]
        counts[best] += 1
    return src, index


Blend = Callable[[np.ndarray, int], tuple[np.ndarray, np.ndarray]]
NOTES = [
    "baseline times and memory to 1e9 are linear extrapolations of the measured runs",
    "multinomial deviation at 1e9 is one draw of Generator.multinomial(1e9, p): the same "
    "distribution as 1e9 per-sample draws",
    "greedy at 100 sources is measured on a tenth of the positions (pure-Python loop)",
    "detdata reaches 1e9 with consumed()/locate() directly: no replay, no arrays",
]


def baseline(name: str, fn: Blend, p: np.ndarray, n: int) -> dict[str, Any]:
    with Stopwatch() as clock:
        src, _ = fn(p, n)
    seconds = clock.seconds
    held = peak_bytes(lambda: fn(p, min(n, 10**5)))  # memory per position on a slice, then scaled
    counts = np.bincount(src.astype(np.int64), minlength=p.size)
    return {
        "method": name,
        "measured_positions": n,
        "measured_seconds": seconds,
        "extrapolated_seconds_to_1e9": seconds * TARGET / n,
        "peak_bytes_per_position": held / min(n, 10**5),
        "extrapolated_bytes_to_1e9": held / min(n, 10**5) * TARGET,
        "deviation_at_measured": float(np.abs(counts - p * n).max()),
    }


def measure_sources(num_sources: int, quick: bool) -> dict[str, Any]:
    """detdata and the baselines for one mixture of ``num_sources`` sources."""
    m = make_mixture(num_sources)
    p = np.array([float(f) for f in m.weights_at(0).values()])
    row: dict[str, Any] = {
        "sources": num_sources,
        "detdata": {**throughput(m, quick), **deviation(m)},
    }
    per_sample = 10**5 if quick else 10**6
    greedy_n = per_sample // (10 if num_sources == 100 else 1)
    row["greedy_megatron_style"] = baseline("greedy", greedy_blend, p, greedy_n)
    if num_sources == 10:
        row["multinomial_per_sample"] = baseline(
            "multinomial choice per position", multinomial_per_sample, p, per_sample
        )
    vectorised = baseline(
        "multinomial choice vectorised", multinomial_vectorised, p, 10**6 if quick else 10**7
    )
    vectorised["deviation_at_1e9_one_draw"] = float(
        np.abs(np.random.default_rng(1).multinomial(TARGET, p) - p * TARGET).max()
    )
    row["multinomial_vectorised"] = vectorised
    return row


def run(quick: bool) -> dict[str, Any]:
    rows: list[dict[str, Any]] = []
    for num_sources in (2, 10, 100):
        row = measure_sources(num_sources, quick)
        rows.append(row)
        print_row(row)
    return {
        "benchmark": "mixture",
        "algorithm": "mixture-v1",
        "quick": quick,
        "machine": platform.platform(),
        "python": platform.python_version(),
        "numpy": np.__version__,
        "rows": rows,
        "notes": NOTES,
    }


def print_row(row: dict[str, Any]) -> None:
    print(f"\n== {row['sources']} sources ==")
    _print_detdata(row["detdata"])
    _print_baselines(row)


def _print_detdata(d: dict[str, Any]) -> None:
    print(
        f"detdata locate  contiguous {d['contiguous_pos_per_s']:>11,.0f} pos/s | micro-batch(8) "
        f"{d['micro_batch8_us_per_call']:7.1f} us/call | random "
        f"{d['random_pos_per_s']:>10,.0f} pos/s"
    )
    print(
        f"detdata assign  contiguous {d['contiguous_assign_only_pos_per_s']:>11,.0f} pos/s "
        f"| micro-batch(8) {d['micro_batch8_assign_only_us_per_call']:7.1f} us/call | random "
        f"{d['random_assign_only_pos_per_s']:>10,.0f} pos/s"
        "   (assign = without GlobalOrder sample ids)"
    )
    print(
        f"detdata  deviation @1e6 {d['at_1e6']:.3f}  max over prefixes<=1e6 "
        f"{d['max_over_prefixes_to_1e6']:.3f}  @1e9 {d['at_1e9']:.3f}  "
        f"(bound {d['documented_bound']:.3f});  jump to 1e9: "
        f"consumed {1e3 * d['consumed_1e9_seconds']:.2f} ms, "
        f"locate {1e3 * d['locate_1e9_seconds']:.2f} ms, "
        f"{d['consumed_1e9_peak_bytes'] / 1024:.0f} KiB"
    )


def _print_baselines(row: dict[str, Any]) -> None:
    print(
        f"{'method':<36}{'measured':>12}{'seconds':>10}{'-> 1e9 (extrap.)':>20}"
        f"{'memory @1e9':>14}{'dev@meas.':>12}"
    )
    for key in ("greedy_megatron_style", "multinomial_per_sample", "multinomial_vectorised"):
        if key in row:
            b = row[key]
            print(
                f"{b['method']:<36}{b['measured_positions']:>12,}"
                f"{b['measured_seconds']:>10.2f}{b['extrapolated_seconds_to_1e9']:>18,.0f} s"
                f"{b['extrapolated_bytes_to_1e9'] / 2**30:>11.1f} GiB"
                f"{b['deviation_at_measured']:>12.1f}"
            )
    if "multinomial_vectorised" in row:
        one_draw = row["multinomial_vectorised"]["deviation_at_1e9_one_draw"]
        print(f"multinomial deviation @1e9 (one draw): {one_draw:,.0f}")


# ----------------------------------------------------------------- cost in the number of sources
SCALE_SOURCES = (2, 10, 100, 1000)
SCALE_POSITIONS = 10**5
SCALE_RESULTS = Path(__file__).parent / "results" / "mixture_scale.json"


def _loader_rate(num_sources: int, batches: int) -> float:
    """Samples/s of a `DataLoader` (``num_workers=0``, global batch 256) over a Mixture of
    ``num_sources`` in-memory sources of 1,000 samples: the loader's hot path (chunk-cached
    ``locate``, one batched read per source present in a batch)."""
    from detdata import ArrayDataset, DataLoader

    names = [f"src{i:04d}" for i in range(num_sources)]
    sources = {
        n: ArrayDataset({"x": np.arange(1000, dtype=np.int64) + 1000 * i}, name=n)
        for i, n in enumerate(names)
    }
    m = Mixture(sources, {n: i + 1 for i, n in enumerate(names)}, seed=7)
    loader = DataLoader(m, global_batch_size=256, seed=0)
    it = iter(loader)
    for _ in range(16):  # warm-up: one read-ahead group (16 micro batches)
        next(it)
    with Stopwatch() as clock:
        for _ in range(batches):
            next(it)
    return 256 * batches / clock.seconds


def scale_row(
    num_sources: int, positions: int = SCALE_POSITIONS, quick: bool = False
) -> dict[str, Any]:
    """Memory (tracemalloc peak) and positions/s of ``assign`` and ``locate`` for ``positions``
    random positions in ``[0, 10**15)``, and loader samples/s, at ``num_sources`` sources."""
    m = make_mixture(num_sources)
    rand = np.random.default_rng(0).integers(0, 10**15, size=positions)
    repeats = 1 if num_sources >= 1000 else 3
    t_assign = best_of(lambda: m.assign(rand), repeats)
    t_locate = best_of(lambda: m.locate(rand), repeats)
    return {
        "benchmark": "mixture_scale",
        "sources": num_sources,
        "positions": positions,
        "assign_pos_per_s": positions / t_assign,
        "assign_peak_bytes": peak_bytes(lambda: m.assign(rand)),
        "locate_pos_per_s": positions / t_locate,
        "locate_peak_bytes": peak_bytes(lambda: m.locate(rand)),
        "loader_samples_per_s": _loader_rate(num_sources, 32 if quick else 160),
    }


def mixture_rows(
    sources: Sequence[int] = SCALE_SOURCES, positions: int = SCALE_POSITIONS, quick: bool = False
) -> list[dict[str, Any]]:
    """One `scale_row` per number of sources (for ``benchmarks/scale.py``'s growth table)."""
    return [scale_row(s, positions, quick) for s in sources]


def print_scale(rows: Sequence[dict[str, Any]]) -> None:
    print(
        f"{'sources':>8}{'assign pos/s':>14}{'assign peak':>13}{'locate pos/s':>14}"
        f"{'locate peak':>13}{'loader samples/s':>18}"
    )
    for r in rows:
        print(
            f"{r['sources']:>8}{r['assign_pos_per_s']:>14,.0f}"
            f"{r['assign_peak_bytes'] / 2**20:>10.1f} MiB{r['locate_pos_per_s']:>14,.0f}"
            f"{r['locate_peak_bytes'] / 2**20:>10.1f} MiB{r['loader_samples_per_s']:>18,.0f}"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--quick", action="store_true", help="smaller measurements (smoke test)")
    parser.add_argument(
        "--scale",
        action="store_true",
        help="only the cost in the number of sources (2..1000): memory and positions/s for "
        "1e5 random positions, loader samples/s; writes results/mixture_scale.json",
    )
    parser.add_argument("--label", default="", help="stored with the --scale rows (e.g. 'before')")
    args = parser.parse_args()
    if args.scale:
        rows = []
        for s in SCALE_SOURCES:
            rows.append(scale_row(s, quick=args.quick))
            print_scale(rows[-1:])
        out = SCALE_RESULTS.with_name(f"mixture_scale{'_' + args.label if args.label else ''}.json")
        out.parent.mkdir(parents=True, exist_ok=True)
        doc = {"label": args.label, "machine": platform.platform(), "rows": rows}
        out.write_text(json.dumps(doc, indent=1) + "\n", encoding="utf-8")
        print(f"wrote {out}")
        return
    result = run(args.quick)
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps(result, indent=1) + "\n", encoding="utf-8")
    print(f"\nwrote {RESULTS}")


if __name__ == "__main__":
    main()
