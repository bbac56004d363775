"""The job's verification shared by its ranks, against one verifier (issue 43; docs/design.md 8).

R rank processes start at once (`benchmarks.startup`: gloo process group, each opening
``TokenWindows(manifest, 64)`` with the default ``quick`` verification over N 2 KiB ``.npy``
shards and reading its first micro batch), at a first start (a fresh receipt folder: every
shard is read). Per rank, measured by the rank itself (``/proc/self``, ``getrusage``): the
wall time from the process group being ready to its first batch, the CPU seconds of its own
threads (``open_own_cpu_s``: torch's process-group threads, busy while a rank waits, apart)
and the bytes it read through system calls (``rchar``). ``--before PATH`` runs the rows of
``--before-ranks`` ranks with the checkout at PATH too (a worktree of e4f99f0, the code before
the verification was shared: the first rank to claim it verifies every shard alone, the
others wait), interleaved, on the same corpus.

On this 2-core machine R ranks cannot verify R times faster; what the rows show is that the
work is split: each rank's bytes read and CPU fall as 1/R while the job's total stays that
of one verifier. `model` then scales the measured costs to R ranks x N shards of S bytes
under the ``quick`` check (first and last MiB hashed), with the slicing of
`detdata.identity.shared` (``SLICES_PER_RANK`` slices per rank, at most ``VERIFY_PIECE``
shards each, three store round trips per slice).

    python -m benchmarks.shared_verify --rows 100000x1,100000x2,100000x4,100000x8,1000000x8 \
        --before /tmp/old --data-dir /tmp/bench1m
    python -m benchmarks.shared_verify --smoke
"""

from __future__ import annotations

import argparse
import json
import math
import os
import resource
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from benchmarks import startup

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
MIB = 1 << 20
#: the model's target: ranks x shards of bytes (the issue's 10,000 ranks x 1M shards of 64 MB)
TARGET = {"ranks": 10_000, "shards": 1_000_000, "shard_bytes": 64 * 10**6}
#: the link a rank reads its shards through in the model (the remote benchmark's emulated
#: link of issue 46: 200 MB/s, 20 ms), and the verification's reads in flight per rank
LINK = {"mb_per_s": 200.0, "latency_s": 0.020, "reads_in_flight": 8}
#: store round trips a rank makes outside its slices: claim, plan wait + get, verdict
#: wait + get, columns get (`detdata.identity.receipts.verify_job`)
STORE_OPS_PER_RANK = 6
#: store round trips per slice (`detdata.identity.shared.take_slices`): the ``add`` that
#: takes it, the ``check`` of the stop key, the ``add`` that marks it done
STORE_OPS_PER_SLICE = 3


def cpu() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def quick_bytes_cost(shard_bytes: int, repeats: int = 40) -> dict[str, float]:
    """CPU seconds to read a shard's first and last MiB from the page cache and hash them
    as the ``quick`` check does (`detdata.base.hashing.quick_digest_parts`), measured on a
    file of ``shard_bytes`` (sparse beyond the two MiB read, so nothing else is written)."""
    from detdata.base.hashing import quick_digest_parts

    with tempfile.TemporaryDirectory(prefix="shared-verify-") as tmp:
        path = Path(tmp) / "shard.bin"
        with open(path, "wb") as fh:
            fh.write(os.urandom(MIB))
            fh.seek(shard_bytes - MIB)
            fh.write(os.urandom(MIB))
        fd = os.open(path, os.O_RDONLY)
        try:
            os.pread(fd, MIB, 0)
            c0, w0 = cpu(), time.perf_counter()
            for _ in range(repeats):
                quick_digest_parts(
                    shard_bytes, os.pread(fd, MIB, 0), os.pread(fd, MIB, shard_bytes - MIB)
                )
            c1, w1 = cpu(), time.perf_counter()
        finally:
            os.close(fd)
    return {"cpu_s": (c1 - c0) / repeats, "wall_s": (w1 - w0) / repeats, "bytes": 2 * MIB}


def store_op_cost(ops: int = 2000) -> dict[str, float]:
    """Seconds per round trip of an ``add`` on a torch TCPStore served on 127.0.0.1 (one
    client; the same store class as the process group's)."""
    from datetime import timedelta

    import torch.distributed as dist

    server = dist.TCPStore("127.0.0.1", 0, 1, True, timedelta(seconds=30), wait_for_workers=False)
    client = dist.TCPStore("127.0.0.1", server.port, 1, False, timedelta(seconds=30))
    client.add("warm", 1)
    w0 = time.perf_counter()
    for _ in range(ops):
        client.add("k", 1)
    return {"wall_s": (time.perf_counter() - w0) / ops, "ops": ops}


def measure(
    code: Path, manifest: Path, shards: int, ranks: int, label: str, work: Path
) -> dict[str, Any]:
    """One first start of ``ranks`` ranks with the detdata at ``code``; per rank figures."""
    load0 = os.getloadavg()
    saved = startup.save_with(code, manifest, work)
    job = startup.run_job(code, saved, ranks, str(work / "receipts"), work)
    corpus = shards * (startup.TOKENS * 2 + 128)
    per = sorted(job["ranks"], key=lambda r: int(r["rank"]))
    own = [float(r["open_own_cpu_s"]) for r in per]
    rchar = [int(r["rchar"]) for r in per]
    return {
        "code": label,
        "shards": shards,
        "ranks": ranks,
        "corpus_bytes": corpus,
        "wall_to_first_batch_s": max(float(r["open_wall_s"]) for r in per),
        "job_wall_s": job["job_wall_s"],
        "own_cpu_s": own,
        "own_cpu_s_total": sum(own),
        "own_cpu_s_max": max(own),
        "rchar": rchar,
        "rchar_max_over_corpus": max(rchar) / corpus,
        "rchar_total_over_corpus": sum(rchar) / corpus,
        "distinct_batches": job["distinct_batches"],
        "loadavg_before": load0,
        "loadavg_after": os.getloadavg(),
    }


def model(rows: list[dict[str, Any]], quick: dict[str, float], store_s: float) -> dict[str, Any]:
    """The target (`TARGET`) from measured costs; see the module docstring and the docs.

    Measured (this machine, the largest shared row): ``leader_serial_cpu_s``, what the
    claimant does before sharing (the shards' ``stat``, the fast form's JSON tie and id:
    O(shards), done once) taken as the largest own CPU (the claimant's) minus the median of
    the others'; ``per_shard_cpu_s``, the rest of the job's own CPU per shard (2 KiB
    shards: per-file overhead, the rank's open and first batch included); ``quick``
    (`quick_bytes_cost`) and ``store_s`` (`store_op_cost`).
    Modelled: everything at the target's size."""
    from detdata.identity.receipts import VERIFY_PIECE
    from detdata.identity.shared import SLICES_PER_RANK

    big = max(
        (r for r in rows if r["code"] == "after" and r["ranks"] > 1),
        key=lambda r: (r["shards"], r["ranks"]),
    )
    own = sorted(big["own_cpu_s"])  # the claimant (whichever rank claimed first): the most
    leader_serial = max(0.0, own[-1] - own[:-1][len(own[:-1]) // 2])
    per_shard = (sum(own) - leader_serial) / big["shards"]
    n, r, size = TARGET["shards"], TARGET["ranks"], TARGET["shard_bytes"]
    slice_size = max(1, min(VERIFY_PIECE, math.ceil(n / (r * SLICES_PER_RANK))))
    slices = math.ceil(n / slice_size)
    quick_read = min(size, 2 * MIB)
    shard_cpu = per_shard + quick["cpu_s"] * quick_read / quick["bytes"]

    def io_s(shards: float) -> float:
        reads = shards * (2 if size > MIB else 1)
        return shards * quick_read / (LINK["mb_per_s"] * 1e6) + reads * LINK["latency_s"] / float(
            LINK["reads_in_flight"]
        )

    per_rank = n / r
    store_ops = slices * STORE_OPS_PER_SLICE + r * STORE_OPS_PER_RANK
    shared = {
        "slice_shards": slice_size,
        "slices": slices,
        "per_rank_shards": per_rank,
        "per_rank_bytes": per_rank * quick_read,
        "per_rank_cpu_s": per_rank * shard_cpu,
        "per_rank_io_s": io_s(per_rank),
        "store_ops": store_ops,
        "store_s_if_serial": store_ops * store_s,
        "leader_serial_cpu_s": leader_serial,
    }
    shared["wall_s"] = (
        leader_serial
        + max(shared["per_rank_cpu_s"], shared["per_rank_io_s"])
        + shared["store_s_if_serial"]
    )
    alone = {
        "per_rank_shards": float(n),
        "per_rank_bytes": float(n * quick_read),
        "per_rank_cpu_s": n * shard_cpu + leader_serial,
        "per_rank_io_s": io_s(n),
    }
    alone["wall_s"] = leader_serial + max(n * shard_cpu, alone["per_rank_io_s"])
    return {
        "target": TARGET,
        "link": LINK,
        "measured": {
            "from_row": {"shards": big["shards"], "ranks": big["ranks"]},
            "leader_serial_cpu_s": leader_serial,
            "per_shard_cpu_s": per_shard,
            "quick_bytes": quick,
            "store_op_s": store_s,
        },
        "shared": shared,
        "one_verifier": alone,
    }


def parse_rows(text: str) -> list[tuple[int, int]]:
    """``"100000x1,100000x8"`` -> ``[(100000, 1), (100000, 8)]`` (shards x ranks)."""
    out = []
    for item in text.split(","):
        shards, ranks = item.lower().split("x")
        out.append((int(shards), int(ranks)))
    return out


def main(argv: list[str] | None = None) -> int:
    """Run the rows, the model, write the JSON and print the tables."""
    from benchmarks import matrix_report

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", default="100000x1,100000x2,100000x4,100000x8,1000000x8")
    ap.add_argument("--before", type=Path, default=None, help="the one-verifier checkout")
    ap.add_argument("--before-ranks", type=int, default=8, help="rows run with --before too")
    ap.add_argument("--code", type=Path, default=ROOT, help="the checkout measured as 'after'")
    ap.add_argument("--data-dir", type=Path, default=Path(tempfile.gettempdir()) / "detdata-sv")
    ap.add_argument("--out", type=Path, default=RESULTS)
    ap.add_argument("--smoke", action="store_true", help="2,000 shards, 1 and 2 ranks (CI)")
    ap.add_argument(
        "--keep",
        action="store_true",
        help="keep the results file's rows of (code, shards, ranks) this run does not measure",
    )
    ap.add_argument(
        "--merge",
        type=Path,
        action="append",
        default=[],
        help="add the rows of another results file (a run made at the same time); with "
        "--rows '' nothing is measured, the model and tables are made again",
    )
    args = ap.parse_args(argv)
    if args.smoke:
        args.rows = "2000x1,2000x2"
    prov = matrix_report.provenance(
        "python -m benchmarks.shared_verify " + " ".join(sys.argv[1:] if argv is None else argv)
    )
    name = "shared_verify_smoke.json" if args.smoke else "shared_verify.json"
    rows: list[dict[str, Any]] = []
    planned = parse_rows(args.rows) if args.rows else []
    kept, earlier = kept_rows(args.out / name, planned, args.keep)
    for other in args.merge:
        more = json.loads(other.read_text())
        kept += more["rows"]
        earlier += [*more.get("earlier", []), more["provenance"]]
    if not planned and earlier:  # only merged: the latest run measured stands for the file
        prov = earlier.pop()
    for shards, ranks in planned:
        manifest = startup.write_corpus(args.data_dir / f"n{shards}", shards)
        codes = [("after", args.code.resolve())]
        if args.before is not None and ranks == args.before_ranks:
            codes.insert(0, ("before", args.before.resolve()))
        for label, code in codes:
            with tempfile.TemporaryDirectory(prefix="shared-verify-") as tmp:
                row = measure(code, manifest, shards, ranks, label, Path(tmp))
            rows.append(row | {"run": prov["date_utc"]})
            print(line(row), flush=True)
            write(args.out / name, {"provenance": prov, "earlier": earlier, "rows": kept + rows})
    rows = kept + rows
    doc: dict[str, Any] = {"provenance": prov, "earlier": earlier, "rows": rows}
    doc["model"] = model(rows, quick_bytes_cost(TARGET["shard_bytes"]), store_op_cost()["wall_s"])
    if planned:
        prov["load_after"] = round(os.getloadavg()[0], 1)
    write(args.out / name, doc)
    print(tables(doc))
    return 0 if all(r["distinct_batches"] == r["ranks"] for r in rows) else 1


def kept_rows(
    path: Path, run: list[tuple[int, int]], keep: bool
) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """With ``keep``: the rows of the results file at ``path`` whose (shards, ranks) this
    run does not measure, and the provenance of the runs that measured them."""
    if not keep or not path.exists():
        return [], []
    old = json.loads(path.read_text())
    rows = [r for r in old["rows"] if (r["shards"], r["ranks"]) not in set(run)]
    earlier = [*old.get("earlier", []), old["provenance"]]
    used = {r.get("run") for r in rows}
    return rows, [p for p in earlier if p["date_utc"] in used]


def write(path: Path, doc: dict[str, Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(doc, indent=1) + "\n")


def line(row: dict[str, Any]) -> str:
    return (
        f"{row['code']:6} shards={row['shards']:>7} ranks={row['ranks']} "
        f"wall {row['wall_to_first_batch_s']:.1f}s own cpu max {row['own_cpu_s_max']:.2f}s "
        f"total {row['own_cpu_s_total']:.2f}s rchar max {row['rchar_max_over_corpus']:.3f}x "
        f"total {row['rchar_total_over_corpus']:.3f}x"
    )


def tables(doc: dict[str, Any]) -> str:
    """Markdown: the measured rows, then the model."""
    out = [
        f"`{p['command'].strip()}`: {p['date_utc']}, commit `{p['commit']}`, {p['machine']}; "
        f"load average {p['load_before']} before, {p.get('load_after', '?')} after."
        for p in [*doc.get("earlier", []), doc["provenance"]]
    ]
    out += [
        "",
        "| shards | ranks | code | run | wall to first batch s | claimant own CPU-s | "
        "other ranks own CPU-s (median; min-max) | job own CPU-s | claimant bytes / corpus | "
        "other ranks bytes / corpus (median; min-max) | job bytes / corpus | load avg |",
        "|---:|---:|---|---|---:|---:|---:|---:|---:|---:|---:|---|",
    ]
    for r in doc["rows"]:
        lead, others = split_claimant(r)
        out.append(
            f"| {r['shards']:,} | {r['ranks']} | {r['code']} | {r.get('run', '')} | "
            f"{r['wall_to_first_batch_s']:.1f} | {lead[0]:.2f} | {spread(others[0], '.2f')} | "
            f"{r['own_cpu_s_total']:.1f} | {lead[1]:.3f} | {spread(others[1], '.3f')} | "
            f"{r['rchar_total_over_corpus']:.3f} | "
            f"{r['loadavg_before'][0]:.1f}-{r['loadavg_after'][0]:.1f} |"
        )
    m = doc.get("model")
    if m:
        out += ["", model_table(m)]
    return "\n".join(out)


def split_claimant(
    row: dict[str, Any],
) -> tuple[tuple[float, float], tuple[list[float], list[float]]]:
    """(claimant's own CPU-s, bytes / corpus) and the other ranks' lists: the claimant is
    the rank of the most own CPU (it does the serial part, or, before, everything)."""
    per = sorted(
        zip(row["own_cpu_s"], [b / row["corpus_bytes"] for b in row["rchar"]], strict=True)
    )
    lead = per[-1]
    return lead, ([c for c, _ in per[:-1]], [b for _, b in per[:-1]])


def spread(values: list[float], fmt: str) -> str:
    """``median; min-max`` of ``values`` (``-`` for none)."""
    if not values:
        return "-"
    v = sorted(values)
    return f"{v[len(v) // 2]:{fmt}}; {v[0]:{fmt}}-{v[-1]:{fmt}}"


def model_table(m: dict[str, Any]) -> str:
    """The model's figures, measured inputs first."""
    t, meas, s, a = m["target"], m["measured"], m["shared"], m["one_verifier"]
    gib = 1 << 30
    return "\n".join(
        [
            f"Model: {t['ranks']:,} ranks x {t['shards']:,} shards of {t['shard_bytes'] / 1e6:.0f}"
            f" MB, `quick` check; link per rank {m['link']['mb_per_s']:.0f} MB/s, "
            f"{m['link']['latency_s'] * 1e3:.0f} ms, {m['link']['reads_in_flight']} reads in "
            "flight. Measured here (from the "
            f"{meas['from_row']['shards']:,} x {meas['from_row']['ranks']} row): claimant's "
            f"serial part {meas['leader_serial_cpu_s']:.1f} CPU-s, "
            f"{meas['per_shard_cpu_s'] * 1e6:.0f} CPU-us per shard, "
            f"{meas['quick_bytes']['cpu_s'] * 1e3:.2f} CPU-ms to read + hash 2 MiB, "
            f"{meas['store_op_s'] * 1e6:.0f} us per store round trip.",
            "",
            "| | shards per rank | bytes read per rank | CPU-s per rank | I/O s per rank | "
            "store round trips | wall s (modelled) |",
            "|---|---:|---:|---:|---:|---:|---:|",
            f"| shared ({s['slices']:,} slices of {s['slice_shards']}) | "
            f"{s['per_rank_shards']:,.0f} | {s['per_rank_bytes'] / gib:.2f} GiB | "
            f"{s['per_rank_cpu_s']:.1f} | {s['per_rank_io_s']:.1f} | {s['store_ops']:,} "
            f"({s['store_s_if_serial']:.1f} s serial) | {s['wall_s']:.0f} |",
            f"| one verifier | {a['per_rank_shards']:,.0f} | {a['per_rank_bytes'] / gib:,.0f} "
            f"GiB | {a['per_rank_cpu_s']:,.0f} | {a['per_rank_io_s']:,.0f} | - | "
            f"{a['wall_s']:,.0f} |",
        ]
    )


if __name__ == "__main__":
    sys.exit(main())
