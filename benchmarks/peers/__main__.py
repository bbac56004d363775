"""``python -m benchmarks.peers``: detdata next to the peer loaders, on the same bytes.

Run it through ``make bench-peers`` (it builds ``benchmarks/peers/.venv``, with torch
pinned at the project's version; see ``benchmarks/peers/README.md``). Every run is a
child process (`benchmarks.peers.one`), repeated ``--repeats`` times (medians
reported); the page cache is warmed by one untimed read of each data file first.
Writes ``benchmarks/results/peers.json`` and ``benchmarks/results/peers.md``, and the
README's figure ``peers.png`` where matplotlib is installed (`benchmarks.peers.figure`).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from benchmarks.peers import data as peer_data

RESULTS = Path(__file__).resolve().parents[1] / "results"
BATCH = 64
SEED = 0

# (row label, contender, format, samples, extra spec); workers 0 and 2 unless noted
#: (row label, contender, format, samples, extra spec)
Entry = tuple[str, str, str, int, dict[str, Any]]
TOKENS: list[Entry] = [
    ("torch DataLoader, per-sample `__getitem__`", "torch", "tokens", 200_000, {}),
    ("torchdata StatefulDataLoader, per-sample", "stateful", "tokens", 200_000, {}),
    ("torch DataLoader, batched `__getitems__`", "torch-batched", "tokens", 200_000, {}),
    ("detdata `TokenWindows`, worker processes (slots)", "detdata", "tokens", 200_000, {}),
    (
        "detdata `TokenWindows`, worker processes (torch's transfer)",
        "detdata-noslots",
        "tokens",
        200_000,
        {"slots": False, "only_workers": [2]},
    ),
    (
        "detdata `TokenWindows`, worker threads",
        "detdata-threads",
        "tokens",
        200_000,
        {"worker_mode": "thread", "only_workers": [2]},
    ),
    ("litData (`StreamingDataset`, shuffle)", "litdata", "litdata", 200_000, {}),
    ("grain (numpy source, in-thread reads)", "grain-numpy", "tokens", 50_000, {}),
    ("grain (ArrayRecord, in-thread reads)", "grain-arrayrecord", "arrayrecord", 50_000, {}),
    ("WebDataset (shuffle buffer 1000)", "wds", "wds", 50_000, {}),
    ("Mosaic Streaming MDS", "mds", "mds", 50_000, {}),
]
GIL: list[Entry] = [
    ("torch DataLoader, per-sample + transform", "torch", "tokens", 50_000, {"gil": True}),
    ("detdata, worker processes (slots) + transform", "detdata", "tokens", 50_000, {"gil": True}),
    (
        "detdata, worker processes (torch's transfer) + transform",
        "detdata-noslots",
        "tokens",
        50_000,
        {"gil": True, "slots": False, "only_workers": [2]},
    ),
    (
        "detdata, worker threads + transform",
        "detdata-threads",
        "tokens",
        50_000,
        {"gil": True, "worker_mode": "thread", "only_workers": [2]},
    ),
]
#: ``row_group_cache_bytes`` of the bounded rows: about 40% of the 100 MB of decoded rows
BOUNDED = 40 << 20
PARQUET: list[Entry] = [
    ("torch DataLoader, per-sample (pyarrow table)", "torch-parquet", "parquet", 50_000, {}),
    (
        "detdata `TableRows`, default cache (`feistel-v1`: every row group)",
        "detdata-pq-default",
        "parquet",
        50_000,
        {},
    ),
    (
        "detdata `TableRows`, default cache, worker threads",
        "detdata-pq-default-threads",
        "parquet",
        50_000,
        {"worker_mode": "thread", "only_workers": [2]},
    ),
    (
        "detdata `TableRows`, 40 MiB cache, `feistel-v1`",
        "detdata-pq-bounded",
        "parquet",
        50_000,
        {"cache_bytes": BOUNDED},
    ),
    (
        "detdata `TableRows`, 40 MiB cache, `locality-v1(window_row_groups=8)`",
        "detdata-pq-locality-rg",
        "parquet",
        50_000,
        {"cache_bytes": BOUNDED, "order": {"window_row_groups": 8}},
    ),
    (
        "detdata `TableRows`, 40 MiB cache, `locality-v1(window_shards=8)` (one file: one window)",
        "detdata-pq-locality",
        "parquet",
        50_000,
        {"cache_bytes": BOUNDED, "order": {"window_shards": 8}},
    ),
]
RESUMABLE = ("detdata", "stateful", "litdata", "mds", "grain-numpy", "grain-arrayrecord")
FAR = ("detdata",)  # a state can name position 1e9 without running to it


def peer_available(contender: str) -> str | None:
    """None, or why the peer cannot run in this environment."""
    module = {
        "stateful": "torchdata",
        "litdata": "litdata",
        "grain-numpy": "grain",
        "grain-arrayrecord": "array_record",
        "wds": "webdataset",
        "mds": "streaming",
    }.get(contender)
    if module is None or importlib.util.find_spec(module) is not None:
        return None
    return f"n/a: `{module}` is not importable in this environment (see README.md)"


def warm(folder: Path) -> None:
    for path in sorted(folder.rglob("*")):
        if path.is_file():
            with path.open("rb") as fh:
                while fh.read(1 << 24):
                    pass


def child(spec: dict[str, Any], timeout: float) -> dict[str, Any]:
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "result.json"
        spec = {**spec, "out": str(out)}
        env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])}
        try:
            proc = subprocess.run(
                [sys.executable, "-m", "benchmarks.peers.one", json.dumps(spec)],
                capture_output=True,
                text=True,
                timeout=timeout,
                env=env,
                check=False,
            )
        except subprocess.TimeoutExpired:
            return {"ok": False, "error": f"timed out after {timeout:.0f} s"}
        if not out.exists():
            return {"ok": False, "error": f"exit {proc.returncode}: {proc.stderr[-800:]}"}
        result: dict[str, Any] = json.loads(out.read_text())
        return result


def median_of(runs: list[dict[str, Any]]) -> dict[str, Any]:
    ok = [r for r in runs if r.get("ok")]
    if len(ok) < len(runs):
        bad = next(r for r in runs if not r.get("ok"))
        return {"ok": False, "error": bad.get("error"), "traceback": bad.get("traceback")}
    out: dict[str, Any] = {"ok": True, "repeats": len(ok)}
    for key, value in ok[0].items():
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            out[key] = value if key != "validated" else all(r[key] for r in ok)
        elif key != "pid":
            values = [r[key] for r in ok if isinstance(r.get(key), (int, float))]
            out[key] = statistics.median(values) if values else None
    return out


def machine(load_before: tuple[float, float, float]) -> dict[str, Any]:
    import torch

    from benchmarks.bench_data import cpu_description

    return {
        "cpu": cpu_description(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "load_average_before": load_before,
        "load_average_after": os.getloadavg(),
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--data", type=Path, default=Path(tempfile.gettempdir()) / "detdata-peers")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--timeout", type=float, default=900)
    p.add_argument("--only", default="", help="comma-separated contenders (default: all)")
    p.add_argument("--out", type=Path, default=RESULTS / "peers.json")
    args = p.parse_args(argv)
    only = {c for c in args.only.split(",") if c}
    load_before = os.getloadavg()
    rows: list[dict[str, Any]] = []
    for table, entries in (("tokens", TOKENS), ("gil", GIL), ("parquet", PARQUET)):
        for label, contender, fmt, n, extra in entries:
            if only and contender not in only:
                continue
            row: dict[str, Any] = {
                "table": table,
                "label": label,
                "contender": contender,
                "n": n,
                "results": {},
            }
            rows.append(row)
            missing = peer_available(contender)
            if missing:
                row["na"] = missing
                print(f"{label}: {missing}", flush=True)
                continue
            folder = peer_data.prepare(args.data, fmt, n)
            warm(folder)
            base = {
                "contender": contender,
                "format": fmt,
                "root": str(folder),
                "n": n,
                "source_n": n,
                "batch": BATCH,
                "seed": SEED,
                **extra,
            }
            for workers in extra.get("only_workers", [0, 2]):
                spec = {**base, "mode": "epoch", "workers": workers}
                t0 = time.perf_counter()
                result = median_of([child(spec, args.timeout) for _ in range(args.repeats)])
                row["results"][f"w{workers}"] = result
                print(
                    f"{label} w{workers}: {_short(result)} ({time.perf_counter() - t0:.0f} s)",
                    flush=True,
                )
            if table == "tokens" and contender in (*RESUMABLE, "torch", "wds"):
                for at in (40_000, 10**9):
                    if at >= 10**9 and contender not in FAR:
                        row["results"][f"resume_{at}"] = {"ok": False, "na": _far_na(contender)}
                        continue
                    spec = {**base, "mode": "resume", "workers": 0, "resume_at": at}
                    row["results"][f"resume_{at}"] = median_of(
                        [child(spec, args.timeout) for _ in range(args.repeats)]
                    )
    report = {"machine": machine(load_before), "batch": BATCH, "rows": rows}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=1))
    md = markdown(report)
    args.out.with_suffix(".md").write_text(md)
    print(md)
    if importlib.util.find_spec("matplotlib") is not None:
        from benchmarks.peers.figure import plot

        plot(report, args.out.with_suffix(".png"))
    return 0


def _far_na(contender: str) -> str:
    if contender in ("torch", "wds"):
        return "n/a: no state; only a replay of 1e9 samples"
    return "n/a: its state is produced by running to the position"


def _short(r: dict[str, Any]) -> str:
    if not r.get("ok"):
        return f"FAILED {r.get('error')}"
    return f"{r['whole_sps']:,.0f} whole, {r['steady_sps']:,.0f} steady, valid={r['validated']}"


def _k(x: float | None) -> str:
    return "n/a" if x is None else f"{x / 1000:,.0f}k"


def _cell(r: dict[str, Any] | None) -> str:
    if r is None:
        return ""
    if not r.get("ok"):
        text = r.get("na") or f"failed: {str(r.get('error'))[:80]}"
        return " ".join(text.replace("|", "/").split())
    if "resume_s" in r:
        same = r.get("same_as_uninterrupted")
        tag = "" if same is None else (" exact" if same else " NOT the same batch")
        return f"{r['resume_s'] * 1e3:,.0f} ms ({r['how']}{tag})"
    valid = "" if r["validated"] else " INVALID"
    return f"{_k(r['whole_sps'])} / {_k(r['steady_sps'])}{valid}"


def markdown(report: dict[str, Any]) -> str:
    m = report["machine"]
    lines = [
        f"Machine: {m['cpu']}, Python {m['python']}, torch {m['torch']}; load average "
        f"{m['load_average_before'][0]:.1f} before, {m['load_average_after'][0]:.1f} after "
        "(the cores were shared with other jobs). Batch 64, shuffled, page cache warm, "
        "one full epoch per run, medians of the repeats.",
        "",
        "Samples/s, whole run (constructing the loader to the last batch) / steady "
        "(first to last batch):",
        "",
        "| loader | samples | workers 0 | workers 2 | first batch (w0) | resume at 40k | "
        "resume at 1e9 | peak RSS w0 / w2 (MB, main+workers) | shuffle (spearman, w0) | "
        "decoded / delivered bytes (Parquet, w0) |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for row in report["rows"]:
        if row.get("na"):
            lines.append(f"| {row['label']} | {row['n']:,} | {row['na']} |  |  |  |  |  |  |  |")
            continue
        res = row["results"]
        w0, w2 = res.get("w0"), res.get("w2")

        def rss(r: dict[str, Any] | None) -> str:
            if not r or not r.get("ok"):
                return "-"
            return f"{r['peak_rss_mb'] + r['peak_rss_children_mb']:,.0f}"

        ttfb = f"{w0['ttfb_s'] * 1e3:,.0f} ms" if w0 and w0.get("ok") else "-"
        spear = f"{w0['spearman']:.3f}" if w0 and w0.get("ok") else "-"
        dec = w0.get("decoded_per_delivered") if w0 and w0.get("ok") else None
        decoded = "-" if dec is None else f"{dec:.2f}"
        lines.append(
            f"| {row['label']} | {row['n']:,} | {_cell(w0) or '-'} | {_cell(w2) or '-'} | "
            f"{ttfb} | {_cell(res.get('resume_40000')) or '-'} | "
            f"{_cell(res.get('resume_1000000000')) or '-'} | {rss(w0)} / {rss(w2)} | {spear} | "
            f"{decoded} |"
        )
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    sys.exit(main())
