"""Start-up of a small corpus (issue 33): construction to first batch, one 400 MB shard.

A short run on a small corpus pays the loader's start-up on every launch, so it is
compared here with what a user would write by hand. One ``.npy`` shard of 200M uint16
tokens (400 MB) under ``--data-dir``, its manifest built with `build_manifest` and saved
with `Manifest.save` (the fast form). Every measured run is a fresh interpreter (the
construction's caches -- imports, the OS page cache aside -- start empty, as at a launch);
it imports torch, numpy and detdata first (timed apart: ``import_cpu_s``), then times,
from the dataset's construction to the first batch in hand:

* ``floor``: ``np.load(mmap_mode='r')`` and one fancy gather of the batch's 8 windows: the
  least any loader can do (the machine's ceiling for this figure);
* ``reference``: the hand-written loader: a torch ``Dataset`` over that memmap with a
  batched ``__getitems__``, and ``torch.utils.data.DataLoader(batch_size=8,
  shuffle=True)``;
* ``detdata-restart``: ``TokenWindows(manifest_path, 2048)`` with the default
  verification (``quick``) and the receipt of an earlier start in place
  (``DETDATA_RECEIPTS``: a folder of this run), then ``detdata.DataLoader(ds,
  global_batch_size=8)`` and ``next(iter(loader))``: the usual launch;
* ``detdata-first``: the same with a fresh receipt folder at every run: the first start
  of a fresh corpus, which must verify (``quick``: size, first and last MiB);
* ``detdata-off``: the same with ``verify="off"``.

Per run: ``cpu_s`` (user + system of the whole process, every thread, from
``getrusage``), ``wall_s`` and ``rchar`` (bytes read through system calls; the memmap's
page faults show as neither). Runs of the modes are interleaved round-robin for
``--repeats`` rounds after one discarded warm-up round (it writes the ``.pyc`` files and
the receipt); each figure is the median. Reported: each detdata mode's median over the
reference's (target <= 2 in CPU seconds, the load-independent figure; wall times on a
shared machine are for information only) and over the floor, and the delivered batches:
every detdata mode must deliver the same bytes (its first batch's sha256). ``--before
PATH`` also runs detdata's modes with the checkout at PATH, interleaved in the same rounds.

    python benchmarks/small_start.py [--repeats 7] [--before /tmp/old] [--out DIR]
    python benchmarks/small_start.py --smoke   (a 4 MB shard, 2 rounds: CI)
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
SEQ = 2048
BATCH = 8
MODES = ("floor", "reference", "detdata-restart", "detdata-first", "detdata-off")

CHILD = r"""
import hashlib, json, resource, sys, time

def cpu():
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime

def rchar():
    with open("/proc/self/io") as fh:
        for line in fh:
            if line.startswith("rchar:"):
                return int(line.split()[1])
    return 0

c0, w0 = cpu(), time.perf_counter()
import numpy as np
import torch
import torch.utils.data
import detdata
from detdata import DataLoader, Storage, TokenWindows  # a script's imports: before the clock
c1, w1 = cpu(), time.perf_counter()
mode, shard, manifest = sys.argv[1:4]
seq, batch = int(sys.argv[4]), int(sys.argv[5])
r0 = rchar()
c2, w2 = cpu(), time.perf_counter()
if mode == "floor":
    tokens = np.load(shard, mmap_mode="r")
    n = (len(tokens) - 1) // seq
    ids = np.random.default_rng(0).integers(0, n, batch)
    out = tokens[(ids[:, None] * seq + np.arange(seq + 1)).ravel()].reshape(batch, seq + 1)
    first = torch.from_numpy(out.astype(np.int64))
elif mode == "reference":
    class Windows(torch.utils.data.Dataset):
        def __init__(self, path, seq):
            self.tokens = np.load(path, mmap_mode="r")
            self.seq = seq
            self.n = (len(self.tokens) - 1) // seq

        def __len__(self):
            return self.n

        def __getitems__(self, ids):
            idx = np.asarray(ids, dtype=np.int64)[:, None] * self.seq + np.arange(self.seq + 1)
            return torch.from_numpy(self.tokens[idx.ravel()].reshape(len(ids), -1).astype(np.int64))

    loader = torch.utils.data.DataLoader(
        Windows(shard, seq), batch_size=batch, shuffle=True, collate_fn=lambda b: b,
        generator=torch.Generator().manual_seed(0),
    )
    first = next(iter(loader))
else:
    verify = "off" if mode == "detdata-off" else "quick"
    ds = TokenWindows(manifest, seq, storage=Storage(verify=verify))
    loader = DataLoader(ds, global_batch_size=batch)
    first = next(iter(loader))["tokens"]
c3, w3 = cpu(), time.perf_counter()
print(json.dumps({
    "mode": mode,
    "import_cpu_s": c1 - c0,
    "import_wall_s": w1 - w0,
    "cpu_s": c3 - c2,
    "wall_s": w3 - w2,
    "rchar": rchar() - r0,
    "batch_sha256": hashlib.sha256(np.ascontiguousarray(first.numpy()).tobytes()).hexdigest(),
    "batch_shape": list(first.shape),
}))
"""


def write_corpus(folder: Path, tokens: int) -> tuple[Path, Path]:
    """One ``.npy`` shard of ``tokens`` uint16 tokens and its saved manifest (reused)."""
    import numpy as np

    import detdata

    shard, manifest = folder / "data" / "shard-00000.npy", folder / "manifest.json"
    done = folder / ".complete"
    if done.exists() and done.read_text() == str(tokens):
        return shard, manifest
    shard.parent.mkdir(parents=True, exist_ok=True)
    out = np.lib.format.open_memmap(shard, mode="w+", dtype=np.uint16, shape=(tokens,))
    step = 1 << 24
    for lo in range(0, tokens, step):
        ids = np.arange(lo, min(tokens, lo + step), dtype=np.uint64)
        out[lo : lo + ids.size] = (ids * 2654435761 % 50_000).astype(np.uint16)
    out.flush()
    del out
    detdata.build_manifest(str(folder / "data"), pattern="*.npy").save(str(manifest))
    done.write_text(str(tokens))
    return shard, manifest


def run_child(
    code: Path, mode: str, shard: Path, manifest: Path, receipts: str, work: Path
) -> dict[str, Any]:
    """One measured run of ``mode`` in a fresh interpreter."""
    script = work / "child.py"
    if not script.exists():
        script.write_text(CHILD)
    env = {k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"}
    env.update({"PYTHONPATH": str(code), "DETDATA_RECEIPTS": receipts, "OMP_NUM_THREADS": "1"})
    proc = subprocess.run(
        [sys.executable, str(script), mode, str(shard), str(manifest), str(SEQ), str(BATCH)],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    if proc.returncode != 0:
        raise SystemExit(f"{mode} failed: {proc.stderr[-3000:]}")
    result: dict[str, Any] = json.loads(proc.stdout.strip().splitlines()[-1])
    return result


def median(values: list[float]) -> float:
    ordered = sorted(values)
    mid = len(ordered) // 2
    return ordered[mid] if len(ordered) % 2 else (ordered[mid - 1] + ordered[mid]) / 2


def measure(
    codes: list[tuple[str, Path]], shard: Path, manifest: Path, repeats: int, work: Path
) -> dict[str, list[dict[str, Any]]]:
    """``repeats`` interleaved rounds of every mode (after one discarded warm-up round);
    detdata's modes once per checkout in ``codes`` (``(label, path)``; the label prefixes
    the mode's name unless it is ``after``)."""
    plan = [(m, ROOT) for m in MODES[:2]]
    plan += [(m, code) for _, code in codes for m in MODES[2:]]
    names = {(m, c): m for m, c in plan}
    for label, code in codes:
        if label != "after":
            names.update({(m, code): f"{label}/{m}" for m in MODES[2:]})
    runs: dict[str, list[dict[str, Any]]] = {names[k]: [] for k in plan}
    for round_ in range(repeats + 1):
        for mode, code in plan:
            name = names[(mode, code)]
            tag = name.replace("/", "-")
            fresh = work / f"receipts-{tag}-{round_}"  # a first start: no receipt yet
            kept = work / f"receipts-{tag}"  # the restart's: written by the warm-up round
            receipts = str(fresh if mode == "detdata-first" else kept)
            result = run_child(code, mode, shard, manifest, receipts, work)
            if round_:
                runs[name].append(result)
    return runs


def summarise(runs: dict[str, list[dict[str, Any]]]) -> dict[str, Any]:
    rows: dict[str, Any] = {}
    for mode, results in runs.items():
        rows[mode] = {
            key: median([float(r[key]) for r in results])
            for key in ("cpu_s", "wall_s", "import_cpu_s", "import_wall_s", "rchar")
        }
        rows[mode]["runs"] = len(results)
    ref, floor = rows["reference"], rows["floor"]
    for mode in runs:
        if "detdata" in mode:
            rows[mode]["cpu_over_reference"] = rows[mode]["cpu_s"] / ref["cpu_s"]
            rows[mode]["wall_over_reference"] = rows[mode]["wall_s"] / ref["wall_s"]
            rows[mode]["cpu_over_floor"] = rows[mode]["cpu_s"] / floor["cpu_s"]
    digests = {r["batch_sha256"] for m in runs if "detdata" in m for r in runs[m]}
    return {"modes": rows, "detdata_distinct_batches": len(digests)}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--tokens", type=int, default=200_000_000, help="tokens in the shard")
    ap.add_argument("--data-dir", default=os.path.join(tempfile.gettempdir(), "detdata-small"))
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results"))
    ap.add_argument("--smoke", action="store_true", help="a 4 MB shard, 2 rounds (CI)")
    ap.add_argument("--before", default=None, help="another detdata checkout to run too")
    args = ap.parse_args(argv)
    codes = [("after", ROOT)]
    if args.before:
        codes.insert(0, ("before", Path(args.before).resolve()))
    if args.smoke:
        args.tokens, args.repeats = 2_000_000, 2
    load_before = os.getloadavg()
    shard, manifest = write_corpus(Path(args.data_dir) / f"t{args.tokens}", args.tokens)
    with tempfile.TemporaryDirectory(prefix="small-start-") as tmp:
        runs = measure(codes, shard, manifest, args.repeats, Path(tmp))
    doc = {
        "benchmark": "small_start",
        "shard_bytes": shard.stat().st_size,
        "seq_len": SEQ,
        "batch": BATCH,
        "repeats": args.repeats,
        "machine": {"cpus": os.cpu_count(), "load_before": load_before[0]},
        "note": "medians of fresh processes; CPU-s is the robust figure on a shared machine, "
        "wall for information only; import time reported apart",
        **summarise(runs),
        "runs": runs,
    }
    doc["machine"]["load_after"] = os.getloadavg()[0]
    for mode, row in doc["modes"].items():
        ratio = (
            f"  x{row['cpu_over_reference']:.2f} cpu / x{row['wall_over_reference']:.2f} wall "
            "of the reference"
            if "cpu_over_reference" in row
            else ""
        )
        print(
            f"{mode:23} cpu {1e3 * row['cpu_s']:7.1f} ms  wall {1e3 * row['wall_s']:7.1f} ms  "
            f"read {row['rchar'] / 1e6:7.2f} MB  (imports {row['import_cpu_s']:.2f} cpu-s)"
            f"{ratio}",
            flush=True,
        )
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    name = "small_start_smoke.json" if args.smoke else "small_start.json"
    (out / name).write_text(json.dumps(doc, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
