"""Mixture weights changed during a run (issue 44): cost against the number of changes.

Run: ``python benchmarks/mixture_changes.py [--quick] [--out DIR]``. Prints a table and
writes ``mixture_changes.json`` (default ``benchmarks/results/``). Side by side in one run,
for 0, 100 and 10,000 weight changes (one every 4 global steps of 256 samples):

* lookup cost: ``Mixture.weights_at`` (the phase in force: a bisection over phase starts),
  ``Mixture.assign`` of one 256-position micro batch at random steps of the run, and
  ``Mixture.consumed`` at random positions, in microseconds per call;
* loader throughput: a `DataLoader` (inline reads, global batch 256, micro batch 256) over
  the mixture after the changes (the stream a resume replays from the state) of five
  in-memory sources, reading 400 micro batches from position 0 (crossing 100 changes when
  there are changes), in samples per second, and its ratio to the fixed mixture (the
  goal: within 5% at 10,000 changes);
* a real run of one-sample steps calling `DataLoader.set_mixture_weights` before each
  step, that many times (``--quick``: at most 1,000): the mean cost of its last 100 calls
  and the size of its final state (``len(json.dumps(loader.state_dict()))``).

Measurements are interleaved round by round (every configuration once per round, best
round kept) so that the load of a shared machine spreads over all of them; on a busy
machine the ratios are the meaningful numbers, and a few percent either way is noise.
"""

from __future__ import annotations

import argparse
import json
import platform
import random
import sys
import time
from pathlib import Path

import numpy as np

if not __package__:  # run as ``python benchmarks/mixture_changes.py``: this checkout
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import detdata
from detdata import DataLoader, Mixture

RESULTS = Path(__file__).parent / "results"
NAMES = ("books", "code", "math", "news", "web")
GBS = 256
EVERY = 4  # steps between two changes


def sources() -> dict[str, detdata.ArrayDataset]:
    return {
        n: detdata.ArrayDataset({"tokens": np.arange(20_000 * 8, dtype=np.int32).reshape(-1, 8)})
        for n in NAMES
    }


def trajectory(count: int) -> list[tuple[int, dict[str, int]]]:
    rng = random.Random(44)
    return [(GBS * EVERY * (k + 1), {n: rng.randint(1, 20) for n in NAMES}) for k in range(count)]


def changed(count: int) -> Mixture:
    """The mixture after ``count`` changes: the stream a resume replays from the state."""
    return Mixture(sources(), dict.fromkeys(NAMES, 1), seed=7).with_weight_changes(
        trajectory(count)
    )


def loader_over(mixture: Mixture) -> DataLoader:
    return DataLoader(mixture, global_batch_size=GBS, micro_batch_size=GBS, seed=0)


def lookup_cost(count: int, calls: int) -> dict[str, float]:
    mixture = changed(count)
    end = GBS * EVERY * (count + 2)
    rng = np.random.default_rng(1)
    positions = rng.integers(0, end, size=calls).tolist()
    steps = (rng.integers(0, end // GBS, size=calls) * GBS).tolist()
    t0 = time.perf_counter()
    for p in positions:
        mixture.weights_at(p)
    t1 = time.perf_counter()
    for s in steps:
        mixture.assign(np.arange(s, s + GBS, dtype=np.int64))
    t2 = time.perf_counter()
    for p in positions:
        mixture.consumed(p)
    t3 = time.perf_counter()
    return {
        "weights_at_us": 1e6 * (t1 - t0) / calls,
        "assign_micro_batch_us": 1e6 * (t2 - t1) / calls,
        "consumed_us": 1e6 * (t3 - t2) / calls,
    }


def throughput(mixture: Mixture, micro: int) -> float:
    """Samples per second of a fresh loader over ``mixture`` reading ``micro`` micro batches
    from position 0 (with changes every 4 steps: crossing ``micro / 4`` of them)."""
    loader = loader_over(mixture)
    it = iter(loader)
    next(it)  # readers started
    t0 = time.perf_counter()
    for _ in range(micro):
        next(it)
    elapsed = time.perf_counter() - t0
    loader.close()
    return GBS * micro / elapsed


def live_run(count: int) -> tuple[int, float]:
    """A real run of ``count`` steps of one sample, ``set_mixture_weights`` before each:
    the size of its final state (bytes of JSON) and the mean seconds of the last 100
    ``set_mixture_weights`` calls (with ``count - 100`` changes before them)."""
    loader = DataLoader(
        Mixture(sources(), dict.fromkeys(NAMES, 1), seed=7), global_batch_size=1, seed=0
    )
    rng = random.Random(5)
    it = iter(loader)
    spent = 0.0
    for step in range(count):
        weights = {n: rng.randint(1, 20) for n in NAMES}
        t0 = time.perf_counter()
        loader.set_mixture_weights(weights)
        if step >= count - 100:
            spent += time.perf_counter() - t0
        next(it)
    size = len(json.dumps(loader.state_dict()))
    loader.close()
    return size, spent / min(count, 100) if count else 0.0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer calls and rounds")
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args(argv)
    counts = (0, 100, 10_000)
    calls, micro, rounds = (300, 60, 2) if args.quick else (3000, 400, 5)
    mixtures = {c: changed(c) for c in counts}
    lookups: dict[int, list[dict[str, float]]] = {c: [] for c in counts}
    rates: dict[int, list[float]] = {c: [] for c in counts}
    for _ in range(rounds):  # interleaved: each configuration once per round
        for c in counts:
            lookups[c].append(lookup_cost(c, calls))
            rates[c].append(throughput(mixtures[c], micro))
    rows = []
    for c in counts:
        best = {k: min(r[k] for r in lookups[c]) for k in lookups[c][0]}
        rate = max(rates[c])
        live = min(c, 1000) if args.quick else c
        state_bytes, set_s = live_run(live)
        rows.append(
            {
                "changes": c,
                **best,
                "loader_samples_per_s": rate,
                "loader_vs_fixed": rate / max(rates[0]),
                "live_run_changes": live,
                "set_mixture_weights_ms": 1e3 * set_s,
                "state_bytes": state_bytes,
            }
        )
    doc = {
        "benchmark": "mixture_changes",
        "machine": platform.platform(),
        "python": platform.python_version(),
        "quick": args.quick,
        "note": "interleaved rounds, best kept; a shared machine: a few percent is noise",
        "rows": rows,
    }
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "mixture_changes.json").write_text(json.dumps(doc, indent=2) + "\n")
    head = (
        f"{'changes':>8} {'weights_at us':>14} {'assign 256 us':>14} {'consumed us':>12} "
        f"{'loader samples/s':>17} {'vs fixed':>9} {'set ms':>8} {'state bytes':>12}"
    )
    print(head)
    for r in rows:
        print(
            f"{r['changes']:>8} {r['weights_at_us']:>14.2f} {r['assign_micro_batch_us']:>14.1f} "
            f"{r['consumed_us']:>12.1f} {r['loader_samples_per_s']:>17.0f} "
            f"{r['loader_vs_fixed']:>9.3f} {r['set_mixture_weights_ms']:>8.2f} "
            f"{r['state_bytes']:>12}"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
