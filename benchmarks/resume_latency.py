"""Resume latency against position and shard count, and start-up with verification (issue 46).

For each shard count N (``--shards``, default 1, 100, 10k, 100k) the same 100,000 windows of
64 int32 tokens (+1 label) are cut into N ``.npy`` shards (token ``j`` of window ``w`` is
``64 w + j``, so every delivered row is checked without a table); the manifest is built and
saved once (its build time is recorded). Every measured run is a fresh interpreter that
imports torch, numpy and detdata before the clock, then times:

* ``open``: ``TokenWindows(manifest_path, 64)`` with the default verification (``quick``) and
  ``DataLoader(ds, global_batch_size=64, seed=0)``, at a ``first`` start (a fresh receipt
  folder: every shard verified) and at a ``restart`` (the receipts of an earlier start);
* ``resume``: at a restart, ``load_state_dict`` of a state with ``samples_consumed = P``
  (``--positions``, default 0, 1,024, 1e6, 1e9: step boundaries of the 64-sample batch;
  0: no load) and ``next(iter(loader))``.

Every first batch is checked: each row is ``64 w + arange(65)`` and ``w`` is the id the
loader's order assigns to positions ``P .. P+63``. Wall and CPU seconds (every thread),
medians of ``--repeats`` rounds, the configurations interleaved in each round.

    python -m benchmarks.resume_latency [--shards 1,100,10000,100000] [--repeats 3]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
WINDOWS = 100_000
SEQ = 64

CHILD = r"""
import json, os, resource, sys, time
import numpy as np, torch
import detdata, detdata.loading.loader

def cpu():
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime

manifest, position = sys.argv[1], int(sys.argv[2])
c0, w0 = cpu(), time.perf_counter()
ds = detdata.TokenWindows(manifest, 64)
dl = detdata.DataLoader(ds, global_batch_size=64, seed=0)
c1, w1 = cpu(), time.perf_counter()
if position:
    state = dl.state_dict()
    state["samples_consumed"] = position
    dl.load_state_dict(state)
tokens = next(iter(dl))["tokens"].numpy()
c2, w2 = cpu(), time.perf_counter()
first = tokens[:, 0].astype(np.int64)
ids = first // 64
rows_ok = bool((tokens == first[:, None] + np.arange(65)).all() and (first % 64 == 0).all())
order = detdata.OrderedStream(ds, 0).sample_ids(np.arange(position, position + 64))
ok = rows_ok and ids.tolist() == order.tolist()
print(json.dumps({"open_s": w1 - w0, "open_cpu_s": c1 - c0, "resume_s": w2 - w1,
                  "resume_cpu_s": c2 - c1, "ok": ok}))
"""


def write_corpus(folder: Path, shards: int) -> dict[str, Any]:
    """`WINDOWS` windows cut into ``shards`` ``.npy`` files and the saved manifest (reused)."""
    import detdata

    done = folder / ".complete"
    if done.exists():
        return dict(json.loads(done.read_text()))
    data = folder / "data"
    data.mkdir(parents=True, exist_ok=True)
    t = time.perf_counter()
    bounds = np.linspace(0, WINDOWS, shards + 1).astype(np.int64)
    digits = len(str(shards - 1))
    for s in range(shards):
        lo, hi = int(bounds[s]), int(bounds[s + 1])
        sub = data / f"d{s // 1000:04d}"
        sub.mkdir(exist_ok=True)
        np.save(sub / f"s{s:0{digits}d}.npy", np.arange(lo * SEQ, hi * SEQ + 1, dtype=np.int32))
    written = time.perf_counter() - t
    t = time.perf_counter()
    manifest = detdata.build_manifest(str(data), pattern="**/*.npy", progress=False)
    manifest.save(str(folder / "manifest.json"))
    info = {"write_s": written, "build_manifest_s": time.perf_counter() - t, "shards": shards}
    done.write_text(json.dumps(info))
    return info


def child(manifest: Path, position: int, receipts: Path) -> dict[str, Any]:
    env = dict(os.environ, PYTHONPATH=str(ROOT), DETDATA_RECEIPTS=str(receipts))
    proc = subprocess.run(
        [sys.executable, "-c", CHILD, str(manifest), str(position)],
        capture_output=True,
        text=True,
        env=env,
        timeout=1200,
        check=False,
    )
    if proc.returncode:
        raise RuntimeError(f"{manifest} @ {position} failed:\n{proc.stderr[-3000:]}")
    return dict(json.loads(proc.stdout.strip().splitlines()[-1]))


def main(argv: list[str] | None = None) -> int:
    """Write the corpora, run the rounds, write the JSON and print the tables."""
    from benchmarks import matrix_report

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shards", default="1,100,10000,100000")
    parser.add_argument("--positions", default="0,1024,1000000,1000000000")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--data", type=Path, default=Path(tempfile.gettempdir()) / "detdata-rl")
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args(argv)
    prov = matrix_report.provenance(
        "python -m benchmarks.resume_latency " + " ".join(argv or sys.argv[1:])
    )
    shards = [int(s) for s in args.shards.split(",")]
    positions = [int(p) for p in args.positions.split(",")]
    corpora = {str(n): write_corpus(args.data / f"n{n}", n) for n in shards}
    runs: dict[str, list[dict[str, Any]]] = {}
    for round_ in range(args.repeats):
        for n in shards:
            manifest = args.data / f"n{n}" / "manifest.json"
            first = Path(tempfile.mkdtemp(prefix="receipts-", dir=args.data))
            runs.setdefault(f"{n}|first|0", []).append(child(manifest, 0, first))
            restart = args.data / f"n{n}" / "receipts"
            if round_ == 0:
                child(manifest, 0, restart)  # the earlier start a restart finds
            for p in positions:
                runs.setdefault(f"{n}|restart|{p}", []).append(child(manifest, p, restart))
            print(f"round {round_}: {n} shards done", flush=True)
    prov["load_after"] = round(os.getloadavg()[0], 1)
    summary = {
        key: {
            m: statistics.median(r[m] for r in rs)
            for m in ("open_s", "open_cpu_s", "resume_s", "resume_cpu_s")
        }
        | {"ok": all(r["ok"] for r in rs)}
        for key, rs in runs.items()
    }
    doc = {"provenance": prov, "corpora": corpora, "summary": summary, "runs": runs}
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "resume_latency.json").write_text(json.dumps(doc, indent=1) + "\n")
    figure(doc, args.out / "resume_latency.png")
    print(tables(doc))
    return 0 if all(s["ok"] for s in summary.values()) else 1


def figure(doc: dict[str, Any], path: Path) -> None:
    """Resume to first batch (CPU ms: the load-independent figure on a shared machine)
    against the position, one line per shard count."""
    from benchmarks import matrix_report

    series: dict[str, list[tuple[float, float]]] = {}
    for key, s in sorted(doc["summary"].items(), key=lambda kv: int(kv[0].split("|")[2])):
        n, mode, position = key.split("|")
        if mode == "restart":
            series.setdefault(f"{int(n):,} shards", []).append(
                (int(position), s["resume_cpu_s"] * 1e3)
            )
    commit = doc["provenance"]["commit"]
    matrix_report.lines(
        path,
        f"Resume: load_state_dict + first batch ({commit})",
        "position resumed at (samples; symlog scale)",
        "CPU ms, every thread (median)",
        series,
    )


def tables(doc: dict[str, Any]) -> str:
    """Markdown: start-up (first start, restart) and resume by position, per shard count."""
    p, summary = doc["provenance"], doc["summary"]
    shards = sorted({int(k.split("|")[0]) for k in summary})
    positions = sorted({int(k.split("|")[2]) for k in summary if "|restart|" in k})
    head = " | ".join(f"resume @{x:,}" for x in positions)
    lines = [
        f"`{p['command'].strip()}`: {p['date_utc']}, commit `{p['commit']}`, {p['machine']}; "
        f"load average {p['load_before']} before, {p['load_after']} after.",
        "",
        "| shards | build manifest s | open, first start: wall ms (CPU ms) | open, restart | "
        + head
        + " | checked |",
        "|---:|---:|---:|---:|" + "---:|" * len(positions) + "---|",
    ]
    for n in shards:
        first, restart = summary[f"{n}|first|0"], summary[f"{n}|restart|0"]
        cells = [
            f"{summary[f'{n}|restart|{x}']['resume_s'] * 1e3:.1f} "
            f"({summary[f'{n}|restart|{x}']['resume_cpu_s'] * 1e3:.0f})"
            for x in positions
        ]
        ok = all(v["ok"] for k, v in summary.items() if k.startswith(f"{n}|"))
        lines.append(
            f"| {n:,} | {doc['corpora'][str(n)]['build_manifest_s']:.1f} | "
            f"{first['open_s'] * 1e3:.0f} ({first['open_cpu_s'] * 1e3:.0f}) | "
            f"{restart['open_s'] * 1e3:.0f} ({restart['open_cpu_s'] * 1e3:.0f}) | "
            + " | ".join(cells)
            + f" | {'yes' if ok else 'NO'} |"
        )
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
