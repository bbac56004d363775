"""The local read paths of `TokenWindows`, one by one: CPU time per batch, before and after.

Each case drives one path of ``TokenWindows.read`` (see `detdata.datasets.window_reads`):

* ``one-shard``: 64 ids of one mapped shard (one fancy gather from its window view);
* ``mapped``: 256 shuffled ids over 64 shards, all mapped (the per-shard gather loop);
* ``scattered``: 2 distant windows of each of 63 large shards, ``max_open_shards=1``
  (one ``preadv`` per window, no map);
* ``batched``: 256 shuffled ids over 4,000 small shards, ``max_open_shards=1`` (the batched
  file loop straight into the rows; native where built);
* ``batched-python``: the same with the native loop switched off (its Python twin);
* ``batched-uint16``: the same over uint16 shards (staged, widened to int32);
* ``hinted``: ``batched`` with each read hinted one batch ahead (``read_ahead``;
  ``prefetch`` in a checkout before issue 42).

Every measured run is a fresh interpreter that builds the dataset, reads one warm-up pass
of its batches, then reads ``--batches`` batches; reported: CPU seconds of the process
(user + system, every thread: load-independent) and wall seconds per batch (noisy on a
shared machine), medians over ``--rounds`` rounds. ``--before PATH`` runs every case with
the checkout at PATH too, interleaved in the same rounds, and checks that both deliver the
same bytes (the sha256 of every batch read).

    python benchmarks/read_paths.py [--rounds 5] [--before /tmp/old] [--out FILE]
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
CASES = (
    "one-shard",
    "mapped",
    "scattered",
    "batched",
    "batched-python",
    "batched-uint16",
    "hinted",
)

CHILD = r"""
import hashlib, json, sys, time
import numpy as np
import detdata
case, data, batches = sys.argv[1], sys.argv[2], int(sys.argv[3])
if case == "batched-python":  # the native loop off: its Python twin reads
    try:
        import detdata.storage.reads as where
    except ImportError:
        import detdata.datasets.tokens as where
    where.NATIVE = False
rng = np.random.default_rng(7)
if case in ("one-shard", "mapped", "scattered"):
    bound = 1 if case == "scattered" else None
    ds = detdata.TokenWindows(data + "/large/manifest.json", 256,
                              storage=detdata.Storage(max_open_shards=bound))
    per = ds.windows_per_shard[0]
    if case == "one-shard":
        ids = [rng.integers(0, per, 64) for _ in range(batches)]
    elif case == "mapped":
        ids = [rng.permutation(ds.num_samples)[:256] for _ in range(batches)]
    else:
        base = np.arange(1, 64) * per
        ids = [rng.permutation(np.concatenate([base + 3, base + per // 2])) for _ in range(batches)]
        ds.read(np.asarray([0]))  # the only handle: shard 0
else:
    folder = "small16" if case == "batched-uint16" else "small"
    ds = detdata.TokenWindows(data + "/" + folder + "/manifest.json", 128,
                              storage=detdata.Storage(max_open_shards=1))
    ds.read(np.asarray([0]))
    ids = [rng.permutation(ds.num_samples)[:256] for _ in range(batches)]
# the hint's name in the checkout under test (``prefetch`` before issue 42's one vocabulary)
hint = ds.read_ahead if hasattr(ds, "read_ahead") else ds.prefetch
def run(kept):
    for k, b in enumerate(ids):
        if case == "hinted" and k + 1 < len(ids):
            hint(ids[k + 1])
        got = ds.read(b)["tokens"]
        if kept is not None:
            kept.append(got)
run(None)  # warm-up: page cache, first opens, handles
kept = []
c0, w0 = time.process_time(), time.perf_counter()
run(kept)
c1, w1 = time.process_time(), time.perf_counter()
digest = hashlib.sha256()  # hashed after the clock: only the reads are timed
for got in kept:
    digest.update(np.ascontiguousarray(got).tobytes())
print(json.dumps({"cpu_s": (c1 - c0) / batches, "wall_s": (w1 - w0) / batches,
                  "sha256": digest.hexdigest()}))
"""


def write_data(folder: Path) -> None:
    """The corpora (reused): 64 large int32 shards of 1,024 windows of 256 tokens (+1), and
    4,000 small shards of 4 windows of 128 tokens (+1), int32 and uint16."""
    import numpy as np

    import detdata

    done = folder / ".complete"
    if done.exists():
        return
    for name, shards, tokens, dtype in (
        ("large", 64, 1024 * 256 + 1, "int32"),
        ("small", 4000, 4 * 128 + 1, "int32"),
        ("small16", 4000, 4 * 128 + 1, "uint16"),
    ):
        sub = folder / name / "data"
        sub.mkdir(parents=True, exist_ok=True)
        for s in range(shards):
            values = (np.arange(tokens, dtype=np.int64) + 7919 * s) % 60_000
            np.save(sub / f"s{s:05d}.npy", values.astype(dtype))
        detdata.build_manifest(str(sub), pattern="*.npy", progress=False).save(
            str(folder / name / "manifest.json")
        )
    done.write_text("ok")


def run_child(code: Path, case: str, data: Path, batches: int, work: Path) -> dict[str, Any]:
    script = work / "child.py"
    if not script.exists():
        script.write_text(CHILD)
    env = {**os.environ, "PYTHONPATH": str(code), "OMP_NUM_THREADS": "1", "DETDATA_PROGRESS": "0"}
    proc = subprocess.run(
        [sys.executable, str(script), case, str(data), str(batches)],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    if proc.returncode != 0:
        raise SystemExit(f"{case} ({code}) failed: {proc.stderr[-3000:]}")
    result: dict[str, Any] = json.loads(proc.stdout.strip().splitlines()[-1])
    return result


def median(values: list[float]) -> float:
    ordered = sorted(values)
    mid = len(ordered) // 2
    return ordered[mid] if len(ordered) % 2 else (ordered[mid - 1] + ordered[mid]) / 2


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--batches", type=int, default=200)
    ap.add_argument("--cases", default=",".join(CASES))
    ap.add_argument("--data-dir", default=os.path.join(tempfile.gettempdir(), "detdata-reads"))
    ap.add_argument("--before", default=None, help="another detdata checkout to run too")
    ap.add_argument("--out", default=None, help="a JSON file for the runs and medians")
    args = ap.parse_args(argv)
    codes = [("after", ROOT)]
    if args.before:
        codes.insert(0, ("before", Path(args.before).resolve()))
    cases = args.cases.split(",")
    data = Path(args.data_dir)
    write_data(data)
    load_before = os.getloadavg()[0]
    runs: dict[str, dict[str, list[dict[str, Any]]]] = {
        c: {lab: [] for lab, _ in codes} for c in cases
    }
    with tempfile.TemporaryDirectory(prefix="read-paths-") as tmp:
        for _ in range(args.rounds):
            for case in cases:
                for label, code in codes:
                    runs[case][label].append(run_child(code, case, data, args.batches, Path(tmp)))
    print(
        f"load average {load_before:.1f} -> {os.getloadavg()[0]:.1f} (2 shared cores: wall "
        "times are noisy, CPU times are the figure)"
    )
    print(
        "| case | "
        + " | ".join(f"{lab} CPU us/batch | {lab} wall us/batch" for lab, _ in codes)
        + (" | after/before CPU | same bytes |" if args.before else " |")
    )
    summary: dict[str, Any] = {}
    for case in cases:
        row = {
            lab: {k: median([r[k] for r in runs[case][lab]]) for k in ("cpu_s", "wall_s")}
            for lab, _ in codes
        }
        digests = {r["sha256"] for lab, _ in codes for r in runs[case][lab]}
        cells = " | ".join(
            f"{1e6 * row[lab]['cpu_s']:.0f} | {1e6 * row[lab]['wall_s']:.0f}" for lab, _ in codes
        )
        extra = ""
        if args.before:
            ratio = row["after"]["cpu_s"] / row["before"]["cpu_s"]
            extra = f" | {ratio:.2f} | {'yes' if len(digests) == 1 else 'NO'}"
        print(f"| {case} | {cells}{extra} |", flush=True)
        summary[case] = {**row, "same_bytes": len(digests) == 1}
    if args.out:
        Path(args.out).write_text(json.dumps({"medians": summary, "runs": runs}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
