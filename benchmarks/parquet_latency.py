"""Parquet latency (issue 46): time to the first batch, fresh and after a resume at 40,000.

Data: 50,000 rows of 512 int32 tokens (one ``list<int32>`` column, snappy), 20 shards, row
groups of 128 rows (`benchmarks.bench_data`: token ``j`` of row ``s`` is ``512 s + j``).
Batch 64, shuffled, ``num_workers=0``. Every run is a fresh interpreter that imports torch,
numpy, pyarrow and the loader's own modules (torchdata for StatefulDataLoader; detdata with
``detdata.loading.loader``; not each other's: torchdata imports pandas, which would hide what
a loader's first Arrow conversion costs) before the clock, then times from the dataset's
construction to the first batch in hand:

* ``torch``: torch's ``DataLoader(shuffle=True)`` over a per-sample ``Dataset`` that reads each
  shard's table (``pq.read_table(memory_map=True)``) at first use (`benchmarks.contenders.
  ParquetSamples`); its resume replays and discards 625 batches;
* ``torch batched``: the same with a hand-written ``__getitems__`` (one ``take`` per shard);
* ``StatefulDataLoader``: torchdata's, per-sample; its resume loads the ``state_dict`` saved
  after 625 batches by a preparing run (not timed);
* ``detdata``: ``TableRows(manifest, ["tokens"])`` (default cache) and
  ``detdata.DataLoader(ds, global_batch_size=64, seed=0)``; its resume loads a state with
  ``samples_consumed=40000``.

Every first batch is checked: its rows are whole samples (``512 s + j``), and detdata's ids are
those its order assigns to positions 0..63 (40,000..40,063 after the resume); the resumed
StatefulDataLoader's batch equals the batch its saving run delivered next. Runs are
interleaved round-robin for ``--repeats`` rounds after one discarded warm-up round (page cache
warm, ``.pyc`` written); medians. ``--before PATH`` also runs detdata from the checkout at PATH
in the same rounds.

    python -m benchmarks.parquet_latency [--repeats 5] [--before /tmp/old] [--out DIR]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
SPEC = {"samples_per_shard": 2500, "shards": 20, "row_group": 128}
BATCH = 64
RESUME_AT = 40_000
LOADERS = ("torch", "torch batched", "StatefulDataLoader", "detdata")

CHILD = r"""
import json, resource, sys, time
import numpy as np, pyarrow, pyarrow.parquet, torch, torch.utils.data
# each loader's own imports, no other's (torchdata imports pandas, which a first
# conversion of Arrow numbers would otherwise import on the clock)
if sys.argv[1] == "detdata":
    import detdata, detdata.loading.loader
else:
    from benchmarks.contenders import ParquetBatched, ParquetSamples
    if sys.argv[1] == "StatefulDataLoader":
        import torchdata.stateful_dataloader
from benchmarks.bench_data import data_files, check_rows

def cpu():
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime

loader_name, root, resume, state_path = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4]
from pathlib import Path
root = Path(root)
kw = dict(batch_size=64, shuffle=True, drop_last=True, generator=torch.Generator().manual_seed(0))
c0, w0 = cpu(), time.perf_counter()
expected = None
if loader_name == "detdata":
    ds = detdata.TableRows(str(root / "parquet" / "manifest.json"), ["tokens"])
    dl = detdata.DataLoader(ds, global_batch_size=64, seed=0)
    if resume:
        state = dl.state_dict()
        state["samples_consumed"] = resume
        dl.load_state_dict(state)
    batch = next(iter(dl))["tokens"]
else:
    files = data_files(root, "parquet")
    ds = ParquetBatched(files) if loader_name == "torch batched" else ParquetSamples(files)
    if loader_name == "torch batched":
        kw["collate_fn"] = lambda b: b
    if loader_name == "StatefulDataLoader":
        dl = torchdata.stateful_dataloader.StatefulDataLoader(ds, **kw)
    else:
        dl = torch.utils.data.DataLoader(ds, **kw)
    if resume and loader_name == "StatefulDataLoader":
        if state_path == "-":  # the preparing run: save the state after resume // 64 batches
            it = iter(dl)
            for _ in range(resume // 64):
                next(it)
            saved = {"state": dl.state_dict(), "next": check_rows(next(it).numpy(), 50000).tolist()}
            torch.save(saved, sys.argv[5])
            print(json.dumps({"prepared": True}))
            sys.exit(0)
        saved = torch.load(state_path, weights_only=False)
        dl.load_state_dict(saved["state"])
        expected = saved["next"]
        batch = next(iter(dl))
    else:
        it = iter(dl)
        for _ in range(resume // 64):  # the vanilla resume: replay and discard
            next(it)
        batch = next(it)
c1, w1 = cpu(), time.perf_counter()
ids = check_rows(np.asarray(batch), 50000)
ok = True
if loader_name == "detdata":
    order = detdata.OrderedStream(ds, 0)
    ok = ids.tolist() == order.sample_ids(np.arange(resume, resume + 64)).tolist()
elif expected is not None:
    ok = ids.tolist() == expected
print(json.dumps({"wall_s": w1 - w0, "cpu_s": c1 - c0, "ok": bool(ok), "ids": ids[:4].tolist()}))
"""


def child(loader: str, root: Path, resume: int, state: str, checkout: Path) -> dict[str, Any]:
    """One fresh interpreter's run (detdata imported from ``checkout``)."""
    env = dict(os.environ, PYTHONPATH=f"{checkout}{os.pathsep}{ROOT}")
    proc = subprocess.run(
        [sys.executable, "-c", CHILD, loader, str(root), str(resume), state],
        capture_output=True,
        text=True,
        env=env,
        cwd=root,  # not ROOT: ``python -c`` puts the working folder first on sys.path
        timeout=600,
        check=False,
    )
    if proc.returncode:
        raise RuntimeError(f"{loader} (resume {resume}) failed:\n{proc.stderr[-3000:]}")
    return dict(json.loads(proc.stdout.strip().splitlines()[-1]))


def main(argv: list[str] | None = None) -> int:
    """Generate the data (reused when present), run the rounds, write the JSON and table."""
    from benchmarks import matrix_report
    from benchmarks.bench_data import DataSpec, generate

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--before", type=Path, help="a checkout of the code before the change")
    parser.add_argument("--data", type=Path, default=Path(tempfile.gettempdir()) / "detdata-pqlat")
    parser.add_argument("--out", type=Path, default=RESULTS)
    parser.add_argument("--loaders", default=",".join(LOADERS), help="a subset of " + str(LOADERS))
    args = parser.parse_args(argv)
    prov = matrix_report.provenance(
        "python -m benchmarks.parquet_latency " + " ".join(argv or sys.argv[1:])
    )
    generate(args.data, DataSpec(**SPEC))
    state = args.data / "stateful.pt"
    prepare = ["StatefulDataLoader", str(args.data), str(RESUME_AT), "-", str(state)]
    prepared = subprocess.run(
        [sys.executable, "-c", CHILD, *prepare],
        capture_output=True,
        text=True,
        env=dict(os.environ, PYTHONPATH=str(ROOT)),
        cwd=ROOT,
        check=False,
    )
    if prepared.returncode:
        raise RuntimeError(f"preparing StatefulDataLoader's state failed:\n{prepared.stderr}")
    runs: list[tuple[str, Path]] = [(name, ROOT) for name in args.loaders.split(",")]
    if args.before:
        runs.append(("detdata (before)", args.before))
    results: dict[str, dict[str, list[dict[str, Any]]]] = {}
    for round_ in range(args.repeats + 1):
        for name, checkout in runs:
            loader = "detdata" if name.startswith("detdata") else name
            for label, resume in (("first", 0), ("resume", RESUME_AT)):
                run = child(loader, args.data, resume, str(state), checkout)
                if round_:  # round 0 warms the page cache and the .pyc files
                    results.setdefault(name, {}).setdefault(label, []).append(run)
                print(name, label, f"{run['wall_s'] * 1e3:.0f} ms", "ok" if run["ok"] else "BAD")
    prov["load_after"] = round(os.getloadavg()[0], 1)
    summary = {
        name: {
            label: {
                "wall_s": statistics.median(r["wall_s"] for r in rs),
                "cpu_s": statistics.median(r["cpu_s"] for r in rs),
                "ok": all(r["ok"] for r in rs),
            }
            for label, rs in by.items()
        }
        for name, by in results.items()
    }
    doc = {"provenance": prov, "spec": SPEC, "summary": summary, "runs": results}
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "parquet_latency.json").write_text(json.dumps(doc, indent=1) + "\n")
    figure(doc, args.out / "parquet_latency.png")
    print(table(doc))
    return 0 if all(v["ok"] for s in summary.values() for v in s.values()) else 1


def figure(doc: dict[str, Any], path: Path) -> None:
    """CPU ms of the first batch and of the resume, per loader (hatched bars)."""
    from benchmarks import matrix_report

    groups = {
        name: {
            "first batch": s["first"]["cpu_s"] * 1e3,
            "resume @40,000": s["resume"]["cpu_s"] * 1e3,
        }
        for name, s in doc["summary"].items()
    }
    commit = doc["provenance"]["commit"]
    title = f"Parquet, 50k x 512 int32, 20 shards, 128-row groups: CPU to first batch ({commit})"
    matrix_report.bars(path, title, "CPU ms (median)", groups)


def table(doc: dict[str, Any]) -> str:
    """The markdown table of a result document."""
    p = doc["provenance"]
    lines = [
        f"`{p['command'].strip()}`: {p['date_utc']}, commit `{p['commit']}`, {p['machine']}; "
        f"load average {p['load_before']} before, {p['load_after']} after.",
        "",
        "| loader | first batch: wall ms | CPU ms | resume @40,000: wall ms | CPU ms | checked |",
        "|---|---:|---:|---:|---:|---|",
    ]
    for name, s in doc["summary"].items():
        first, resume = s["first"], s["resume"]
        ok = "yes" if first["ok"] and resume["ok"] else "NO"
        lines.append(
            f"| {name} | {first['wall_s'] * 1e3:.0f} | {first['cpu_s'] * 1e3:.0f} | "
            f"{resume['wall_s'] * 1e3:.0f} | {resume['cpu_s'] * 1e3:.0f} | {ok} |"
        )
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
