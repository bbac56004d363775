"""Reverse-lookup benchmark: the cost per epoch of "where was sample X delivered?".

Run: ``python benchmarks/provenance.py [--smoke]``. Prints a table and writes
``benchmarks/results/provenance.json`` (not with ``--smoke``).

For an `OrderedStream` (``feistel-v1``) and a `Mixture` (``mixture-v1``, 2 and 100
sources), `positions_seen` over ``until`` positions is timed and divided by the
number of epochs it covered (of the dataset, or of the looked-up source's own
stream). The brute-force alternative (``ids(arange(until)) == x``) is timed at the
smallest size, for scale. Also times ``loader.provenance(step)`` for one step of
1024 in-memory samples.
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

if not __package__:  # run as ``python benchmarks/provenance.py``: benchmarks.* from this checkout
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from detdata import ArrayDataset, DataLoader, Mixture, OrderedStream
from detdata.cli.mix import CountDataset
from detdata.loading.provenance import positions_seen

RESULTS = Path(__file__).parent / "results" / "provenance.json"


def _time(fn: Any, repeats: int = 3) -> float:
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t)
    return best


def per_epoch(smoke: bool) -> list[dict[str, Any]]:
    rows = []
    n = 1000
    stream = OrderedStream(CountDataset(n, name="d"), seed=1)
    for until in (10**5,) if smoke else (10**5, 10**6, 10**7):
        seconds = _time(lambda u=until: positions_seen(stream, None, 7, until=u))
        epochs = until // n
        rows.append({"stream": "ordered", "until": until, "epochs": epochs, "s": seconds})
    for sources in (2,) if smoke else (2, 100):
        names = [f"s{i:03d}" for i in range(sources)]
        mix = Mixture(
            {k: CountDataset(1000, name=k) for k in names},
            {k: i + 1 for i, k in enumerate(names)},
            seed=3,
        )
        for until in (10**5,) if smoke else (10**6, 10**7):
            name = names[-1]
            seconds = _time(lambda u=until, m=mix, k=name: positions_seen(m, k, 7, until=u))
            epochs = max(1, mix.consumed(until)[name] // 1000)
            rows.append(
                {"stream": f"mixture-{sources}", "until": until, "epochs": epochs, "s": seconds}
            )
    for row in rows:
        row["us_per_epoch"] = 1e6 * row["s"] / row["epochs"]
    return rows


def brute_force(smoke: bool) -> dict[str, Any]:
    until = 10**5 if smoke else 10**6
    order = OrderedStream(CountDataset(1000, name="d"), seed=1).order
    seconds = _time(lambda: np.flatnonzero(order.ids(np.arange(until)) == 7), repeats=1)
    return {"until": until, "s": seconds}


def step_provenance() -> dict[str, Any]:
    loader = DataLoader(
        ArrayDataset({"x": np.arange(10**5, dtype=np.int64)}), global_batch_size=1024
    )
    return {"global_batch": 1024, "s": _time(lambda: loader.provenance(5))}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--smoke", action="store_true", help="tiny sizes, no results file")
    args = parser.parse_args(argv)
    doc = {
        "machine": platform.platform(),
        "reverse_lookup": per_epoch(args.smoke),
        "brute_force": brute_force(args.smoke),
        "step_provenance": step_provenance(),
    }
    print(f"{'stream':<14}{'until':>12}{'epochs':>10}{'seconds':>10}{'us/epoch':>10}")
    for r in doc["reverse_lookup"]:
        print(
            f"{r['stream']:<14}{r['until']:>12}{r['epochs']:>10}{r['s']:>10.4f}"
            f"{r['us_per_epoch']:>10.1f}"
        )
    bf = doc["brute_force"]
    print(f"brute force scan of {bf['until']} positions: {bf['s']:.3f} s")
    print(f"provenance of one step of 1024: {doc['step_provenance']['s']:.3f} s")
    if not args.smoke:
        RESULTS.parent.mkdir(parents=True, exist_ok=True)
        RESULTS.write_text(json.dumps(doc, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
