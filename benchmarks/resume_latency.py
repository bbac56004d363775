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
loader's order assigns to positions ``P .. P+63``. The shard counts of ``--startup-shards``
(1M in the docs) use instead the corpus of `benchmarks.startup` (N shards of 2 KiB, 960
uint16 tokens: token ``j`` of shard ``s`` is ``(7 j + 13 s) mod 60000``, 14 windows a shard),
written once with its manifest under ``--startup-data`` and shared with
`benchmarks.shared_verify`; there window ``w`` is checked against that formula at shard
``w // 14``, offset ``64 (w mod 14)``. Wall and CPU seconds (every thread),
medians of ``--repeats`` rounds, the configurations interleaved in each round.

    python -m benchmarks.resume_latency [--shards 1,100,10000,100000] [--repeats 3]
    python -m benchmarks.resume_latency --shards 1000000 --startup-shards 1000000 \
        --startup-data /tmp/bench1m --repeats 1 --keep
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

manifest, position, kind = sys.argv[1], int(sys.argv[2]), sys.argv[3]
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
order = detdata.OrderedStream(ds, 0).sample_ids(np.arange(position, position + 64))
if kind == "startup":  # benchmarks.startup's corpus: the writer's formula, 14 windows a shard
    s, o = order[:, None] // 14, (order[:, None] % 14) * 64 + np.arange(65)
    ok = bool((tokens.astype(np.int64) == (7 * o + 13 * s) % 60000).all())
else:
    first = tokens[:, 0].astype(np.int64)
    ids = first // 64
    rows_ok = bool((tokens == first[:, None] + np.arange(65)).all() and (first % 64 == 0).all())
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


def startup_corpus(folder: Path, shards: int) -> dict[str, Any]:
    """`benchmarks.startup`'s corpus of ``shards`` 2 KiB shards (written once, with its
    manifest's entries computed as it writes: no `build_manifest` timed)."""
    from benchmarks import startup

    t = time.perf_counter()
    startup.write_corpus(folder, shards)
    return {
        "write_s": time.perf_counter() - t,
        "build_manifest_s": None,
        "shards": shards,
        "kind": "startup",
        "tokens_per_shard": startup.TOKENS,
    }


def child(manifest: Path, position: int, receipts: Path, kind: str) -> dict[str, Any]:
    env = dict(os.environ, PYTHONPATH=str(ROOT), DETDATA_RECEIPTS=str(receipts))
    proc = subprocess.run(
        [sys.executable, "-c", CHILD, str(manifest), str(position), kind],
        capture_output=True,
        text=True,
        env=env,
        timeout=3600,
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
    parser.add_argument(
        "--startup-shards",
        default="",
        help="shard counts that use benchmarks.startup's corpus (2 KiB shards) instead",
    )
    parser.add_argument(
        "--startup-data",
        type=Path,
        default=Path(tempfile.gettempdir()) / "detdata-startup",
        help="where benchmarks.startup's corpora are (n<shards>/)",
    )
    parser.add_argument(
        "--keep",
        action="store_true",
        help="keep the results file's shard counts this run does not measure",
    )
    args = parser.parse_args(argv)
    prov = matrix_report.provenance(
        "python -m benchmarks.resume_latency " + " ".join(argv or sys.argv[1:])
    )
    shards = [int(s) for s in args.shards.split(",")]
    positions = [int(p) for p in args.positions.split(",")]
    big = {int(s) for s in args.startup_shards.split(",") if s}
    folders = {n: (args.startup_data if n in big else args.data) / f"n{n}" for n in shards}
    corpora = {
        str(n): startup_corpus(folders[n], n) if n in big else write_corpus(folders[n], n)
        for n in shards
    }
    runs: dict[str, list[dict[str, Any]]] = {}
    for round_ in range(args.repeats):
        for n in shards:
            kind = "startup" if n in big else "windows"
            manifest = folders[n] / "manifest.json"
            first = Path(tempfile.mkdtemp(prefix="receipts-", dir=folders[n]))
            runs.setdefault(f"{n}|first|0", []).append(child(manifest, 0, first, kind))
            restart = folders[n] / "receipts"
            if round_ == 0:
                child(manifest, 0, restart, kind)  # the earlier start a restart finds
            for p in positions:
                runs.setdefault(f"{n}|restart|{p}", []).append(child(manifest, p, restart, kind))
            print(f"round {round_}: {n} shards done", flush=True)
    prov["load_after"] = round(os.getloadavg()[0], 1)
    prov["shards"] = shards
    summary = {
        key: {
            m: statistics.median(r[m] for r in rs)
            for m in ("open_s", "open_cpu_s", "resume_s", "resume_cpu_s")
        }
        | {"ok": all(r["ok"] for r in rs)}
        for key, rs in runs.items()
    }
    doc = {"provenance": prov, "corpora": corpora, "summary": summary, "runs": runs}
    if args.keep and (args.out / "resume_latency.json").exists():
        doc = merged(json.loads((args.out / "resume_latency.json").read_text()), doc)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "resume_latency.json").write_text(json.dumps(doc, indent=1) + "\n")
    figure(doc, args.out / "resume_latency.png")
    print(tables(doc))
    return 0 if all(s["ok"] for s in summary.values()) else 1


def merged(old: dict[str, Any], new: dict[str, Any]) -> dict[str, Any]:
    """``new`` with the shard counts of ``old`` it did not measure, and the provenance of
    the earlier runs that measured those (under ``earlier``)."""
    ran = {str(n) for n in new["provenance"]["shards"]}
    kept = {n for n in old["corpora"] if n not in ran}
    earlier = [
        p
        for p in [*old.get("earlier", []), old["provenance"]]
        if {str(n) for n in p.get("shards", old["corpora"])} & kept
    ]
    for p in earlier:  # the shard counts each earlier run stands for here
        p["shards"] = sorted(int(n) for n in set(map(str, p.get("shards", kept))) & kept)

    def pick(table: dict[str, Any]) -> dict[str, Any]:
        return {k: v for k, v in table.items() if k.split("|")[0] in kept}

    return {
        "provenance": new["provenance"],
        "earlier": earlier,
        "corpora": {n: old["corpora"][n] for n in kept} | new["corpora"],
        "summary": pick(old["summary"]) | new["summary"],
        "runs": pick(old["runs"]) | new["runs"],
    }


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
    commit = ", ".join(p["commit"] for p in [*doc.get("earlier", []), doc["provenance"]])
    matrix_report.lines(
        path,
        f"Resume: load_state_dict + first batch ({commit})",
        "position resumed at (samples; symlog scale)",
        "CPU ms, every thread (median)",
        series,
    )


def tables(doc: dict[str, Any]) -> str:
    """Markdown: start-up (first start, restart) and resume by position, per shard count."""
    summary = doc["summary"]
    shards = sorted({int(k.split("|")[0]) for k in summary})
    positions = sorted({int(k.split("|")[2]) for k in summary if "|restart|" in k})
    head = " | ".join(f"resume @{x:,}" for x in positions)
    lines = [
        f"`{p['command'].strip()}`: {p['date_utc']}, commit `{p['commit']}`, {p['machine']}; "
        f"load average {p['load_before']} before, {p['load_after']} after"
        + (f" (shards {', '.join(f'{n:,}' for n in p['shards'])})." if "shards" in p else ".")
        for p in [*doc.get("earlier", []), doc["provenance"]]
    ]
    lines += [
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
            if f"{n}|restart|{x}" in summary
            else "not run"
            for x in positions
        ]
        ok = all(v["ok"] for k, v in summary.items() if k.startswith(f"{n}|"))
        corpus = doc["corpora"][str(n)]
        built = corpus["build_manifest_s"]
        lines.append(
            f"| {n:,}{' (2 KiB shards)' if corpus.get('kind') == 'startup' else ''} | "
            f"{'written with its entries' if built is None else f'{built:.1f}'} | "
            f"{first['open_s'] * 1e3:.0f} ({first['open_cpu_s'] * 1e3:.0f}) | "
            f"{restart['open_s'] * 1e3:.0f} ({restart['open_cpu_s'] * 1e3:.0f}) | "
            + " | ".join(cells)
            + f" | {'yes' if ok else 'NO'} |"
        )
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
