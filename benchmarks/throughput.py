"""Throughput and resume: detdata vs the vanilla torch DataLoader and peers, same data, same run.

``python -m benchmarks [--smoke] [--out DIR]`` (or ``detdata bench``):

1. generates token windows (``.npy``) and Parquet shards whose tokens encode
   their sample id (`benchmarks.bench_data`), reused while the size is the same;
2. measures the machine's ceilings (memcpy, page-cache read, random row gather);
3. runs every (contender, data, num_workers) in its own process, forked from a
   pre-imported server so imports are not timed, interleaved round-robin for
   ``--repeats`` rounds; resume runs likewise;
4. reports medians, ratios to the vanilla DataLoader on the same data and
   workers, and fractions of the ceilings as Markdown, JSON and a PNG.

Every delivered sample is checked against its expected tokens; each epoch must
not repeat a sample; a shuffle score (rank correlation of delivery order and
id, fraction of consecutive-id neighbours) is reported so that a loader that
does not shuffle cannot win. detdata's batches are also checked against the
exact ids its order defines, including after resuming.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import multiprocessing as mp
import os
import platform
import sys
import tempfile
from collections.abc import Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any

from benchmarks.bench_data import (
    BYTES_PER_SAMPLE,
    DataSpec,
    cpu_description,
    disk_bytes,
    generate,
)
from benchmarks.timing import Stopwatch, median

FAR = 10**9
_DEFAULT_START = mp.get_start_method()
KINDS = ("tokens", "parquet")
CONTENDERS = ("vanilla", "vanilla-batched", "stateful", "detdata", "detdata-threads")
LABELS = {
    "vanilla": "torch DataLoader, per-sample __getitem__",
    "vanilla-batched": "torch DataLoader, hand-written __getitems__",
    "stateful": "torchdata StatefulDataLoader, per-sample",
    "detdata": "detdata.DataLoader",
    "detdata-threads": "detdata.DataLoader, worker_mode='thread'",
}
OPTIONAL = {"mosaicml-streaming": "streaming", "grain": "grain", "litdata": "litdata"}
PRELOAD = [
    "numpy",
    "torch",
    "torch.utils.data",
    "pyarrow",
    "pyarrow.parquet",
    "detdata",
    "detdata.datasets.tokens",
    "detdata.datasets.tables",
    "detdata.loading.threads",
    "torchdata.stateful_dataloader",
    "benchmarks.contenders",
    "benchmarks.ceilings",
]


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m benchmarks", description=__doc__.splitlines()[0])
    p.add_argument(
        "--smoke", action="store_true", help="tiny data, one round (well under a minute)"
    )
    p.add_argument(
        "--out",
        default=str(Path(__file__).parent / "results"),
        help="folder for throughput.{md,json,png} (default: benchmarks/results)",
    )
    p.add_argument(
        "--data-dir", default=None, help="where to generate data (default: a temp folder)"
    )
    p.add_argument("--samples-per-shard", type=int, default=None, help="default 16384 (smoke 1024)")
    p.add_argument("--shards", type=int, default=None, help="default 8 (smoke 2)")
    p.add_argument(
        "--row-group", type=int, default=None, help="Parquet rows per group (1024; smoke 256)"
    )
    p.add_argument(
        "--repeats", type=int, default=None, help="rounds of every run (default 3; smoke 1)"
    )
    p.add_argument(
        "--budget",
        type=float,
        default=None,
        help="seconds of steady-state loading per throughput run (default 1.5; smoke 0.2)",
    )
    p.add_argument(
        "--warmup",
        type=int,
        default=None,
        help="batches after the first one, before the throughput window (32; smoke 4)",
    )
    p.add_argument(
        "--resume-at", type=int, default=None, help="resume position (40000; smoke 1024)"
    )
    p.add_argument("--workers", default="0,2", help="num_workers values (default 0,2)")
    p.add_argument(
        "--resume-workers",
        default=None,
        help="num_workers values for resume runs (default: same as --workers; smoke 0)",
    )
    p.add_argument("--contenders", default=",".join(CONTENDERS))
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--timeout", type=float, default=300.0, help="seconds before a run is killed")
    return p.parse_args(argv)


def settings(args: argparse.Namespace) -> dict[str, Any]:
    smoke = args.smoke
    spec = DataSpec(
        samples_per_shard=args.samples_per_shard or (1024 if smoke else 16384),
        shards=args.shards or (2 if smoke else 8),
        row_group=args.row_group or (256 if smoke else 1024),
    )
    workers = [int(w) for w in args.workers.split(",") if w != ""]
    resume_workers = (
        [int(w) for w in args.resume_workers.split(",") if w != ""]
        if args.resume_workers is not None
        else ([0] if smoke else workers)
    )
    resume_at = args.resume_at if args.resume_at is not None else (1024 if smoke else 40000)
    if resume_at % args.batch or FAR % args.batch:
        raise SystemExit(
            f"--resume-at {resume_at} and {FAR} must be multiples of --batch {args.batch}"
        )
    contenders = [c for c in args.contenders.split(",") if c]
    unknown = sorted(set(contenders) - set(CONTENDERS))
    if unknown:
        raise SystemExit(f"unknown contenders {unknown}; choose from {list(CONTENDERS)}")
    return {
        "smoke": smoke,
        "data": spec,
        "workers": workers,
        "resume_workers": resume_workers,
        "resume_at": resume_at,
        "far": FAR,
        "contenders": contenders,
        "batch": args.batch,
        "seed": args.seed,
        "repeats": args.repeats or (1 if smoke else 3),
        "budget_s": args.budget if args.budget is not None else (0.2 if smoke else 1.5),
        "warmup": args.warmup if args.warmup is not None else (4 if smoke else 32),
    }


# --------------------------------------------------------------------- child runs
def _child(spec_json: str) -> None:
    # A forkserver child inherits the "forkserver" default; DataLoader workers must start
    # the way they do in a fresh Python process on this platform (fork on Linux < 3.14).
    mp.set_start_method(_DEFAULT_START, force=True)
    from benchmarks import contenders

    contenders.main([spec_json])


def _ceiling_child(root: str, out: str) -> None:
    from benchmarks import ceilings

    Path(out).write_text(json.dumps(ceilings.measure(Path(root))))


class ChildRunner:
    """Runs each measurement in a fresh process forked from a server that pre-imported torch etc."""

    def __init__(self, workdir: Path, timeout: float) -> None:
        self.ctx = mp.get_context("forkserver")
        self.ctx.set_forkserver_preload(PRELOAD)
        self.workdir = workdir
        self.timeout = timeout
        self.count = 0

    def _run(self, target: Any, args: tuple[Any, ...], out: Path, timeout: float) -> dict[str, Any]:
        out.unlink(missing_ok=True)
        proc = self.ctx.Process(target=target, args=args)
        proc.start()
        proc.join(timeout)
        if proc.is_alive():
            proc.kill()
            proc.join()
            return {"ok": False, "validated": False, "error": f"killed after {timeout:.0f} s"}
        if not out.exists():
            return {
                "ok": False,
                "validated": False,
                "error": f"no result (exit code {proc.exitcode})",
            }
        result: dict[str, Any] = json.loads(out.read_text())
        return result

    def run(self, spec: dict[str, Any]) -> dict[str, Any]:
        self.count += 1
        out = self.workdir / f"run-{self.count}.json"
        spec = {**spec, "out": str(out)}
        return self._run(_child, (json.dumps(spec),), out, self.timeout + spec.get("budget_s", 0))

    def ceilings(self, root: Path) -> dict[str, Any]:
        out = self.workdir / "ceilings.json"
        return self._run(_ceiling_child, (str(root), str(out)), out, self.timeout)


def build_tasks(cfg: dict[str, Any], root: Path, states: Path) -> list[dict[str, Any]]:
    base = {"root": str(root), "batch": cfg["batch"], "seed": cfg["seed"]}
    tasks: list[dict[str, Any]] = []
    for kind in KINDS:
        for nw in cfg["workers"]:
            for name in cfg["contenders"]:
                if name == "detdata-threads" and nw == 0:
                    continue  # a pool of 0 threads is the plain detdata loader
                tasks.append(
                    {
                        **base,
                        "kind_of_run": "throughput",
                        "contender": name,
                        "data": kind,
                        "workers": nw,
                        "budget_s": cfg["budget_s"],
                        "resume_at": None,
                        "warmup_batches": cfg["warmup"],
                    }
                )
        for nw in cfg["resume_workers"]:
            for name in cfg["contenders"]:
                if name == "detdata-threads":
                    continue
                points = [cfg["resume_at"], cfg["far"]] if name == "detdata" else [cfg["resume_at"]]
                for at in points:
                    tasks.append(
                        {
                            **base,
                            "kind_of_run": "resume",
                            "contender": name,
                            "data": kind,
                            "workers": nw,
                            "budget_s": 0.0,
                            "resume_at": at,
                            "state_path": str(states / f"stateful-{kind}-{nw}.pt"),
                        }
                    )
    return tasks


def prepare_states(runner: ChildRunner, tasks: list[dict[str, Any]]) -> dict[str, Any]:
    """StatefulDataLoader needs a state saved at the resume position by an earlier run."""
    done: dict[str, Any] = {}
    for task in tasks:
        if (
            task["contender"] == "stateful"
            and task["kind_of_run"] == "resume"
            and task["state_path"] not in done
        ):
            done[task["state_path"]] = runner.run({**task, "mode": "prepare"})
    return done


def optional_contenders() -> dict[str, str]:
    skipped = {}
    for name, module in OPTIONAL.items():
        if importlib.util.find_spec(module) is None:
            skipped[name] = f"skipped: module {module!r} is not importable here (not installed)"
        else:
            skipped[name] = (
                f"skipped: module {module!r} is importable but this benchmark has no "
                "adapter for it yet"
            )
    return skipped


def summarize(
    cfg: dict[str, Any], runs: list[dict[str, Any]], ceilings: dict[str, Any]
) -> list[dict[str, Any]]:
    """One row per (data, workers, contender): medians over its rounds, ratios to vanilla."""
    page_cache = ceilings.get("page_cache_read_gbs")
    rows = [
        summary_row(cfg, runs, (kind, nw, name), page_cache)
        for kind in KINDS
        for nw in cfg["workers"]
        for name in cfg["contenders"]
        if not (name == "detdata-threads" and nw == 0)
    ]
    for row in rows:
        ref = next(
            (
                r
                for r in rows
                if r["data"] == row["data"]
                and r["workers"] == row["workers"]
                and r["contender"] == "vanilla"
            ),
            None,
        )
        ok = ref is not None and ref["samples_per_s"] and row["samples_per_s"]
        row["x_vanilla"] = row["samples_per_s"] / ref["samples_per_s"] if ok and ref else None
        fresh = row["ttfb_fresh_s"]
        row["far_over_fresh"] = row["ttfb_far_s"] / fresh if row["ttfb_far_s"] and fresh else None
    return rows


def summary_row(
    cfg: dict[str, Any],
    runs: list[dict[str, Any]],
    key: tuple[str, int, str],
    page_cache: float | None,
) -> dict[str, Any]:
    """Medians over the rounds of the runs of ``key`` = (data, workers, contender)."""
    kind, nw, name = key
    mine = [
        r for r in runs if (r["task"]["data"], r["task"]["workers"], r["task"]["contender"]) == key
    ]
    tput = [r["result"] for r in mine if r["task"]["kind_of_run"] == "throughput"]
    row: dict[str, Any] = {
        "data": kind,
        "contender": name,
        "label": LABELS[name],
        "workers": nw,
        "runs": len(tput),
    }
    row["validated"] = bool(mine) and all(r["result"].get("validated") for r in mine)
    row["errors"] = sorted({r["result"]["error"] for r in mine if r["result"].get("error")})
    exact = [r["result"].get("exact_order") for r in mine]
    row["exact_order"] = (
        None if all(e is None for e in exact) else all(e is not False for e in exact)
    )
    sps = median(r.get("samples_per_s") for r in tput)
    row["samples_per_s"] = sps
    row["mb_per_s"] = sps * BYTES_PER_SAMPLE / 1e6 if sps else None
    row["frac_page_cache"] = row["mb_per_s"] / 1e3 / page_cache if sps and page_cache else None
    row["ttfb_fresh_s"] = median(r.get("ttfb_s") for r in tput)
    row["warmup_s"] = median(
        r["ttfb_s"] + r["warmup_s"] for r in tput if r.get("ttfb_s") is not None and "warmup_s" in r
    )
    for field in ("peak_rss_main_mb", "peak_rss_worker_mb", "spearman", "adjacent"):
        row[field] = median(r.get(field) for r in tput)
    for at, field in ((cfg["resume_at"], "ttfb_resume_s"), (cfg["far"], "ttfb_far_s")):
        row[field] = median(
            r["result"].get("ttfb_s")
            for r in mine
            if r["task"]["kind_of_run"] == "resume" and r["task"]["resume_at"] == at
        )
    return row


def machine() -> dict[str, Any]:
    import numpy
    import pyarrow
    import torch

    try:
        import torchdata

        td = torchdata.__version__
    except ImportError:  # pragma: no cover
        td = "not installed"
    mem = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    return {
        "cpu": cpu_description(),
        "memory_gib": round(mem, 1),
        "platform": platform.platform(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "numpy": numpy.__version__,
        "pyarrow": pyarrow.__version__,
        "torchdata": td,
        "start_method_workers": mp.get_start_method(),
    }


def run_rounds(
    runner: ChildRunner, tasks: list[dict[str, Any]], repeats: int
) -> list[dict[str, Any]]:
    """Every task ``repeats`` times, interleaved; each round starts at another task."""
    runs: list[dict[str, Any]] = []
    for rnd in range(repeats):
        shift = (rnd * len(tasks)) // max(1, repeats)
        for task in tasks[shift:] + tasks[:shift]:
            result = runner.run(task)
            runs.append({"round": rnd, "task": task, "result": result})
            print(
                f"[bench] r{rnd} {task['kind_of_run']:10s} {task['data']:7s} "
                f"{task['contender']:16s} w={task['workers']} "
                f"{_brief(task, result)}",
                flush=True,
            )
    return runs


def measure(cfg: dict[str, Any], root: Path, timeout: float) -> dict[str, Any]:
    """Ceilings before and after, the StatefulDataLoader states, and every round of runs."""
    with tempfile.TemporaryDirectory(prefix="detdata-bench-") as tmp:
        runner = ChildRunner(Path(tmp), timeout)
        ceilings = [runner.ceilings(root)]
        print(f"[bench] ceilings: {ceilings[0]}", flush=True)
        tasks = build_tasks(cfg, root, Path(tmp))
        prepared = prepare_states(runner, tasks)
        runs = run_rounds(runner, tasks, cfg["repeats"])
        ceilings.append(runner.ceilings(root))
    ceil = {k: median(c.get(k) for c in ceilings) for k in ceilings[0] if k not in ("ok", "error")}
    return {"ceilings": ceil, "ceiling_runs": ceilings, "stateful_prepare": prepared, "runs": runs}


def data_root(args: argparse.Namespace, spec: DataSpec) -> Path:
    if args.data_dir:
        return Path(args.data_dir)
    key = f"{spec.samples_per_shard}x{spec.shards}-rg{spec.row_group}"
    return Path(tempfile.gettempdir()) / "detdata-bench" / key


def write_reports(doc: dict[str, Any], out_dir: Path) -> None:
    from benchmarks import report

    (out_dir / "throughput.json").write_text(json.dumps(doc, indent=1, default=str))
    (out_dir / "throughput.md").write_text(report.markdown(doc))
    report.plot(doc, out_dir / "throughput.png")
    print(report.markdown(doc))
    print(
        f"[bench] wrote {out_dir}/throughput.{{md,json,png}} in {doc['total_s']:.0f} s", flush=True
    )


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    cfg = settings(args)
    spec: DataSpec = cfg["data"]
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    root = data_root(args, spec)
    with Stopwatch() as clock:
        print(
            f"[bench] data: {spec.num_samples} samples x {BYTES_PER_SAMPLE} B per format "
            f"under {root}",
            flush=True,
        )
        gen = generate(root, spec)
        info = {"machine": machine(), "load_before": os.getloadavg()}
        measured = measure(cfg, root, args.timeout)
        rows = summarize(cfg, measured["runs"], measured["ceilings"])
        info["load_after"] = os.getloadavg()
        settings_doc = {
            **{k: v for k, v in cfg.items() if k != "data"},
            "data": asdict(spec),
            "num_samples": spec.num_samples,
            "bytes_per_sample": BYTES_PER_SAMPLE,
            "bytes_per_format": spec.bytes_per_format,
            "disk_bytes": disk_bytes(root),
            "data_dir": str(root),
        }
        doc = {
            "settings": settings_doc,
            **info,
            "generate": gen,
            "ceilings": measured["ceilings"],
            "ceiling_runs": measured["ceiling_runs"],
            "stateful_prepare": measured["stateful_prepare"],
            "skipped": optional_contenders(),
            "summary": rows,
            "runs": measured["runs"],
            "total_s": clock.elapsed(),
        }
    write_reports(doc, out_dir)
    return 1 if any(not r["validated"] for r in rows) else 0


def _brief(task: dict[str, Any], result: dict[str, Any]) -> str:
    if not result.get("ok"):
        return f"FAILED: {result.get('error')}"
    sps = result.get("samples_per_s")
    rate = f"{sps:,.0f} samples/s" if sps else ""
    return f"ttfb {result['ttfb_s'] * 1e3:8.1f} ms {rate}"


if __name__ == "__main__":
    sys.exit(main())
