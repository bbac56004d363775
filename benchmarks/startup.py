"""Start-up at scale (issue 33, DESIGN.md 8): R ranks started at once open one corpus.

Each rank is a separate process (``torch.distributed`` over gloo, as torchrun starts
them) that imports torch and detdata, joins the process group, then opens
``TokenWindows(MANIFEST, 64)`` with the default verification and reads its first micro
batch (8 windows at its positions of a `GlobalOrder`). Per rank it reports, from its own
``/proc/self`` and ``getrusage`` (measured outside detdata):

* ``open_cpu_s`` / ``open_rss_mb`` / ``open_peak_mb``: CPU seconds (user + system), RSS
  growth and peak RSS growth (``VmHWM`` reset through ``/proc/self/clear_refs`` just
  before) from the process group being ready to the first batch: manifest + dataset +
  verification (its share) + first batch;
* ``open_own_cpu_s`` / ``open_pg_threads_cpu_s``: ``open_cpu_s`` split by thread. The
  second is the CPU of the threads that were already running when the open began (torch's
  process group and store threads: ~0.05 CPU-s per 20 s idle here), which accrues for as
  long as a rank waits for the job's verifier (minutes at 1M shards on 2 cores) and which
  any idle torch job spends alike; the first is the rest: the main thread and every
  thread started during the open (detdata's work);
* ``total_cpu_s``: from interpreter start to the first batch, and ``torch_cpu_s`` (the
  torch import, reported apart);
* ``manifest_opens``: opens of the manifest's own files (the JSON and its fast form, at
  their path: CPython's ``open`` audit event) by the rank; with one manifest read per
  node, one rank of the node opens them to load the manifest and the others map its node
  copy; the job's verifier (any rank) opens the JSON too when it checks it against the
  columns (a first start, or files changed within 2 s of their receipt)
  (``ranks_opening_manifest`` in the summary);
* ``rchar`` / ``read_bytes``: bytes the rank read through system calls / from the block
  device during the open (``/proc/self/io``). ``rchar`` misses what a process reads
  through a memory map (a page fault is no system call): code that maps its metadata looks
  cheaper there than code that reads it. ``read_bytes`` with ``--cold`` (the page cache
  emptied before each job) counts both, each byte once per node: what the job read from
  storage.

A job is run twice over the same corpus: ``first`` (no receipt: a fresh receipt folder)
and ``restart`` (the receipts of the first). ``--before PATH`` also runs every row with
the detdata checkout at PATH (e.g. a worktree of an older commit), interleaved with this
one, so that both columns come from one run on one machine.

The corpus: N shards of 2 KiB (``.npy``, 960 uint16 tokens each), written once under
``--data-dir``; its manifest is built from the files' own bytes (blake3 and quick digests
computed here, entries as `build_manifest` writes them: the first verification re-reads
every shard against them). Each detdata measured saves that manifest again (its own
`Manifest.save`, so its own fast form) in the job's folder before the first start.

CPU seconds and RSS are what to compare on a shared, noisy machine; wall times are
reported for information only.

    python benchmarks/startup.py --shards 10000,100000 --ranks 8 [--before /tmp/old]
    python benchmarks/startup.py --shards 10000,1000000 --ranks 8,32 --before /tmp/old \
        --before-max-shards 10000 --keep
    python benchmarks/startup.py --smoke
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
TOKENS = 960
SEQ = 64
MICRO = 8

CHILD = r"""
import json, os, resource, sys, time
T0 = time.monotonic()

def cpu():
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime

def status(key):
    with open("/proc/self/status") as fh:
        for line in fh:
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024
    return 0

def thread_cpu():  # CPU seconds of each live thread of this process, by thread id
    out = {}
    tick = os.sysconf("SC_CLK_TCK")
    for tid in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{tid}/stat") as fh:
                fields = fh.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        out[int(tid)] = (int(fields[11]) + int(fields[12])) / tick
    return out

def io():
    out = {}
    with open("/proc/self/io") as fh:
        for line in fh:
            k, v = line.split(":")
            out[k] = int(v)
    return out

c0 = cpu()
import torch
import torch.distributed as dist
torch_cpu = cpu() - c0
import numpy as np
import detdata
from detdata import GlobalOrder, TokenWindows

manifest, out = sys.argv[1], sys.argv[2]
for name in ("detdata.identity.verify", "detdata.identity.receipts", "detdata.datasets.tokens",
             "detdata.datasets.window_index", "detdata.identity.manifest_id",
             "fsspec.implementations.local", "fsspec.implementations.chained", "numpy.ma"):
    try:  # modules a first open imports (their files are bytes read too): not the corpus's
        __import__(name)
    except ImportError:  # an older checkout without receipts
        pass
MANIFEST_FILES = {os.path.abspath(manifest), os.path.abspath(manifest) + ".columns"}
OPENS = []
sys.addaudithook(  # opens of the manifest's own files (JSON, fast form) by this rank
    lambda event, args: event == "open" and isinstance(args[0], str)
    and os.path.abspath(args[0]) in MANIFEST_FILES and OPENS.append(args[0])
)
dist.init_process_group("gloo")
rank = dist.get_rank()
dist.barrier()
with open("/proc/self/clear_refs", "w") as fh:
    fh.write("5")  # reset VmHWM: the peak below is the open's
rss0, cpu0, io0, w0 = status("VmRSS"), cpu(), io(), time.monotonic()
threads0 = thread_cpu()  # torch's own threads (the process group's), live before the open
ds = TokenWindows(manifest, SEQ)
ids = GlobalOrder(ds.num_samples, 0).ids(np.arange(rank * MICRO, (rank + 1) * MICRO))
batch = ds.read(ids)["tokens"]
cpu1, io1, w1 = cpu(), io(), time.monotonic()
threads1 = thread_cpu()
background = sum(threads1[t] - c for t, c in threads0.items()
                 if t != os.getpid() and t in threads1)
result = {
    "rank": rank,
    "open_cpu_s": cpu1 - cpu0,
    "open_pg_threads_cpu_s": background,
    "open_own_cpu_s": cpu1 - cpu0 - background,
    "open_rss_mb": (status("VmRSS") - rss0) / 2**20,
    "open_peak_mb": (status("VmHWM") - rss0) / 2**20,
    "open_wall_s": w1 - w0,
    "total_cpu_s": cpu1,
    "torch_cpu_s": torch_cpu,
    "rchar": io1["rchar"] - io0["rchar"],
    "manifest_opens": len(OPENS),
    "read_bytes": io1["read_bytes"] - io0["read_bytes"],
    "batch_digest": __import__("hashlib").sha256(batch.tobytes()).hexdigest(),
    "first_ids": ids.tolist(),
}
with open(out, "w") as fh:
    json.dump(result, fh)
dist.barrier()
dist.destroy_process_group()
""".replace("SEQ", str(SEQ)).replace("MICRO", str(MICRO))


def write_corpus(folder: Path, shards: int) -> Path:
    """N 2 KiB shards and their saved manifest (reused when already complete)."""
    import blake3
    import numpy as np

    from detdata import Manifest, ShardEntry
    from detdata.base.hashing import PREFIX, quick_digest_parts
    from detdata.identity.formats import Format

    path = folder / "manifest.json"
    done = folder / ".complete"
    if done.exists() and done.read_text() == str(shards):
        return path
    folder.mkdir(parents=True, exist_ok=True)
    entries = []
    base = np.arange(TOKENS, dtype=np.uint32)
    header = None
    for i in range(shards):
        name = f"{i // 1000:04d}/s{i:07d}.npy"
        tokens = ((base * 7 + i * 13) % 60_000).astype(np.uint16)
        file = folder / name
        file.parent.mkdir(exist_ok=True)
        if header is None:
            np.save(file, tokens)
            raw = file.read_bytes()
            header = raw[: len(raw) - tokens.nbytes]
        data = header + tokens.tobytes()
        file.write_bytes(data)
        entries.append(
            ShardEntry(
                path=name,
                bytes=len(data),
                blake3=PREFIX + blake3.blake3(data).hexdigest(),
                quick=quick_digest_parts(len(data), data[: 1 << 20], data[-(1 << 20) :]),
                num_samples=TOKENS,
                format=Format.NPY,
                dtype="uint16",
                data_offset=len(header),
            )
        )
    Manifest(
        shards=tuple(entries), metadata={"corpus": f"startup-{shards}"}, root=str(folder)
    ).save(str(path))
    done.write_text(str(shards))
    return path


def save_with(code: Path, manifest: Path, work: Path) -> Path:
    """The corpus's manifest saved again by the detdata at ``code`` (its own fast form: each
    version is measured on the files it writes), under ``work``, its root the corpus's;
    then `RACY_S` waited out, as for a manifest saved a while before a job."""
    saved = work / "manifest" / "manifest.json"
    saved.parent.mkdir(parents=True, exist_ok=True)
    program = (
        "import sys; from detdata import Manifest; "
        "m = Manifest.load(sys.argv[1], verify='off', root=sys.argv[3]); m.save(sys.argv[2])"
    )
    subprocess.run(
        [sys.executable, "-c", program, str(manifest), str(saved), str(manifest.parent)],
        env={**os.environ, "PYTHONPATH": str(code)},
        check=True,
    )
    time.sleep(2.5)
    return saved


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def drop_caches() -> bool:
    """Empty the page cache (root only), so that ``read_bytes`` counts what the job reads
    from the disk: each byte once per node, whichever rank reads it first. False if not
    allowed here."""
    try:
        os.sync()
        with open("/proc/sys/vm/drop_caches", "w") as fh:
            fh.write("1")
    except OSError:
        return False
    return True


def run_job(
    code: Path, manifest: Path, ranks: int, receipts: str, work: Path, cold: bool = False
) -> dict[str, Any]:
    """R rank processes started at once; their reports and the job's totals. ``cold``:
    the page cache is emptied first (`drop_caches`; ``cold_cache`` says if it was)."""
    script = work / "child.py"
    script.write_text(CHILD)
    dropped = drop_caches() if cold else False
    port = _port()
    procs = []
    start = time.monotonic()
    for r in range(ranks):
        env = {
            **os.environ,
            "PYTHONPATH": str(code),
            "OMP_NUM_THREADS": "1",
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(port),
            "RANK": str(r),
            "WORLD_SIZE": str(ranks),
            "LOCAL_RANK": str(r),
            "LOCAL_WORLD_SIZE": str(ranks),
            "DETDATA_RECEIPTS": receipts,
            "DETDATA_CACHE_DIR": str(work / "cache"),  # node copies of the manifest
        }
        out = work / f"rank{r}.json"
        out.unlink(missing_ok=True)
        procs.append(
            (
                out,
                subprocess.Popen(
                    [sys.executable, str(script), str(manifest), str(out)],
                    env=env,
                    stdout=subprocess.PIPE,
                    stderr=subprocess.PIPE,
                    text=True,
                ),
            )
        )
    reports = []
    for out, proc in procs:
        _, err = proc.communicate(timeout=3600)
        if proc.returncode != 0:
            raise SystemExit(f"rank failed ({code}): {err[-3000:]}")
        reports.append(json.loads(out.read_text()))
    wall = time.monotonic() - start
    digests = {r["batch_digest"] for r in reports}
    return {
        "ranks": reports,
        "job_wall_s": wall,
        "job_rchar": sum(r["rchar"] for r in reports),
        "distinct_batches": len(digests),
        "cold_cache": dropped,
    }


def summary(job: dict[str, Any], corpus_bytes: int) -> dict[str, Any]:
    ranks = job["ranks"]

    def stat(key: str) -> dict[str, float]:
        vals = sorted(float(r[key]) for r in ranks)
        return {"median": vals[len(vals) // 2], "max": vals[-1]}

    others = [r for r in ranks if r["rank"] != 0] or ranks
    return {
        "open_cpu_s": stat("open_cpu_s"),
        "open_rss_mb": stat("open_rss_mb"),
        "open_peak_mb": stat("open_peak_mb"),
        "total_cpu_s": stat("total_cpu_s"),
        "torch_cpu_s": stat("torch_cpu_s"),
        "open_cpu_s_ranks_1_up_max": max(r["open_cpu_s"] for r in others),
        "open_own_cpu_s_ranks_1_up_max": max(r["open_own_cpu_s"] for r in others),
        "open_pg_threads_cpu_s_ranks_1_up_max": max(r["open_pg_threads_cpu_s"] for r in others),
        "open_peak_mb_ranks_1_up_max": max(r["open_peak_mb"] for r in others),
        "open_rss_mb_ranks_1_up_max": max(r["open_rss_mb"] for r in others),
        "rank0_open_cpu_s": next(r["open_cpu_s"] for r in ranks if r["rank"] == 0),
        "rank0_open_peak_mb": next(r["open_peak_mb"] for r in ranks if r["rank"] == 0),
        "job_rchar": job["job_rchar"],
        "job_read_bytes": sum(r["read_bytes"] for r in ranks),
        "job_read_bytes_over_corpus": sum(r["read_bytes"] for r in ranks) / corpus_bytes,
        "cold_cache": job["cold_cache"],
        "job_rchar_over_corpus": job["job_rchar"] / corpus_bytes,
        "job_wall_s": job["job_wall_s"],
        "ranks_opening_manifest": sum(1 for r in ranks if r.get("manifest_opens")),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--shards", default="10000,100000")
    ap.add_argument("--ranks", default="8")
    ap.add_argument("--before", default=None, help="another detdata checkout to run too")
    ap.add_argument(
        "--before-max-shards",
        type=int,
        default=None,
        help="run --before only up to this many shards (the old code parses the whole JSON "
        "manifest in every rank: ~1.5 GB a rank at 1M shards)",
    )
    ap.add_argument(
        "--keep",
        action="store_true",
        help="keep the rows of the existing results file for (code, shards, ranks) not run",
    )
    ap.add_argument("--data-dir", default=os.path.join(tempfile.gettempdir(), "detdata-startup"))
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results"))
    ap.add_argument("--smoke", action="store_true", help="2,000 shards, 2 ranks (CI)")
    ap.add_argument(
        "--cold",
        action="store_true",
        help="empty the page cache before each job (root): job_read_bytes is then what the "
        "node read from its disk, each byte once",
    )
    ap.add_argument(
        "--name",
        default=None,
        help="results file name under --out (default startup.json, startup_smoke.json)",
    )
    args = ap.parse_args()
    if args.smoke:
        args.shards, args.ranks = "2000", "2"
    codes = [("after", ROOT)]
    if args.before:
        codes.insert(0, ("before", Path(args.before).resolve()))
    rows = []
    for shards in [int(s) for s in args.shards.split(",")]:
        manifest = write_corpus(Path(args.data_dir) / f"n{shards}", shards)
        corpus = shards * (TOKENS * 2 + 128)
        for ranks in [int(r) for r in args.ranks.split(",")]:
            for label, code in codes:
                if label == "before" and shards > (args.before_max_shards or shards):
                    continue
                with tempfile.TemporaryDirectory(prefix="startup-") as tmp:
                    work = Path(tmp)
                    receipts = str(work / "receipts")
                    saved = save_with(code, manifest, work)
                    for start in ("first", "restart"):
                        job = run_job(code, saved, ranks, receipts, work, args.cold)
                        row = {
                            "code": label,
                            "shards": shards,
                            "ranks": ranks,
                            "start": start,
                            "corpus_bytes": corpus,
                            **summary(job, corpus),
                            "distinct_batches": job["distinct_batches"],
                            "loadavg": os.getloadavg(),
                            "per_rank": job["ranks"],
                        }
                        rows.append(row)
                        print(
                            f"{label:6} shards={shards:>7} ranks={ranks:>2} {start:7} "
                            f"ranks 1+ cpu max {row['open_cpu_s_ranks_1_up_max']:.3f} s "
                            f"(own {row['open_own_cpu_s_ranks_1_up_max']:.3f} s, process "
                            f"group threads {row['open_pg_threads_cpu_s_ranks_1_up_max']:.3f} s) "
                            f"rss max {row['open_rss_mb_ranks_1_up_max']:.1f} MB peak max "
                            f"{row['open_peak_mb_ranks_1_up_max']:.1f} MB; rank0 cpu "
                            f"{row['rank0_open_cpu_s']:.2f} s peak "
                            f"{row['rank0_open_peak_mb']:.0f} MB; job read "
                            f"{row['job_rchar_over_corpus']:.4f}x corpus (from disk "
                            f"{row['job_read_bytes_over_corpus']:.4f}x"
                            f"{', cold' if row['cold_cache'] else ''}); manifest files "
                            f"opened by {row['ranks_opening_manifest']}/{ranks} ranks "
                            "(loading it, or verifying its JSON)  "
                            f"wall {row['job_wall_s']:.1f}s",
                            flush=True,
                        )
                        save(args, rows)
    save(args, rows)


def save(args: argparse.Namespace, rows: list[dict[str, Any]]) -> None:
    """Write the results file (after every row: a run cut short keeps what it measured)."""
    Path(args.out).mkdir(parents=True, exist_ok=True)
    name = args.name or ("startup_smoke.json" if args.smoke else "startup.json")
    if args.keep and (Path(args.out) / name).exists():
        ran = {(r["code"], r["shards"], r["ranks"]) for r in rows}
        old = json.loads((Path(args.out) / name).read_text())["rows"]
        rows = [r for r in old if (r["code"], r["shards"], r["ranks"]) not in ran] + rows
    doc = {
        "benchmark": "startup",
        "machine": {"cpus": os.cpu_count(), "platform": sys.platform},
        "note": "CPU-s and RSS are the robust figures on a shared machine; wall for info only",
        "loadavg_at_end": os.getloadavg(),
        "rows": rows,
    }
    (Path(args.out) / name).write_text(json.dumps(doc, indent=1))


if __name__ == "__main__":
    main()
