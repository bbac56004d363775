"""Benchmark: documents and packing (`Documents`, `PackedWindows`), side by side in one run.

* **Read throughput**: windows per second of `PackedWindows` (tokens + intra-document
  mask columns) vs `TokenWindows` over *the same tokens* (the ``.bin`` files of the same
  Megatron corpus), same ``seq_len``, shuffled ids in batches of ``--batch``: through
  ``Dataset.read`` (median time per call, the two datasets' calls interleaved, so load
  changes on a shared machine hit both alike) and through
  `detdata.DataLoader` (``num_workers=0``).
* **Index build time** per 1e6 documents: the document table from the Megatron ``.idx``
  (`Documents`), the packing index (`PackedWindows`: shuffled offsets + segments bound),
  and loading both back from ``index_dir``; extrapolated linearly to 1e8 documents (the
  build is O(documents) in fixed-size chunks; the largest size measured is reported).
* **Resume at position 1e9**: time from constructing a `DataLoader` to its first batch,
  fresh (position 0) vs after ``load_state_dict`` at 1e9 samples; the ratio must stay
  below 2 (resume is O(1): nothing is replayed).

Every packed batch read is validated against an independent recomputation of the
window from the documents (`_expected_window`).

Run: ``python -m benchmarks.packing`` (``--smoke`` for a seconds-long run). Prints a
table and writes ``benchmarks/results/packing.json`` (or ``--out DIR``).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import struct
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

import detdata
from benchmarks.timing import best_of
from detdata import Storage
from detdata.datasets.documents import Documents
from detdata.datasets.packed import PackedWindows

RESULTS = Path(__file__).parent / "results"
RESUME_AT = 10**9


def write_megatron(prefix: Path, lengths: np.ndarray, rng: np.random.Generator) -> None:
    """A Megatron ``.bin``/``.idx`` pair (one sequence per document), vectorised."""
    total = int(lengths.sum())
    rng.integers(1, 50_000, size=total, dtype=np.uint16).tofile(f"{prefix}.bin")
    pointers = np.zeros(lengths.size, dtype=np.int64)
    np.cumsum(lengths[:-1] * 2, out=pointers[1:])
    doc_index = np.arange(lengths.size + 1, dtype=np.int64)
    with open(f"{prefix}.idx", "wb") as fh:
        fh.write(b"MMIDIDX\x00\x00" + struct.pack("<QBQQ", 1, 8, lengths.size, doc_index.size))
        fh.write(lengths.astype("<i4").tobytes())
        fh.write(pointers.astype("<i8").tobytes())
        fh.write(doc_index.astype("<i8").tobytes())


def corpus(root: Path, documents: int, mean_len: int, shards: int, seed: int) -> Path:
    root.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    lengths = rng.integers(1, 2 * mean_len, size=documents).astype(np.int64)
    for s, part in enumerate(np.array_split(lengths, shards)):
        write_megatron(root / f"part-{s:03d}", part, rng)
    return root


def _expected_window(docs: Documents, packed: PackedWindows, w: int) -> np.ndarray:
    """Window ``w`` recomputed from the documents: walk the shuffled documents to it."""
    offsets = packed.offsets
    a = w * packed.seq_len
    k = int(np.searchsorted(offsets, a, side="right")) - 1
    out: list[np.ndarray] = []
    need = packed.window
    at = a - int(offsets[k])
    while need > 0:
        d = int(packed.document_at(np.array([k]))[0])
        doc = docs.document(d)
        piece = doc[at : at + need]
        out.append(piece)
        need -= piece.size
        k, at = k + 1, 0
    return np.concatenate(out)


def bench_read(root: Path, seq_len: int, batch: int, budget: float) -> list[dict[str, Any]]:
    pairs = detdata.build_manifest(str(root))
    bins = detdata.build_manifest(
        str(root), paths=[s.path for s in pairs.shards if s.path.endswith(".bin")]
    )
    docs = Documents(pairs)
    packed = PackedWindows(docs, seq_len, seed=1)
    plain = detdata.TokenWindows(bins, seq_len)
    rows = []
    pair = (("TokenWindows", plain), ("PackedWindows", packed))
    read_s, round_ratios = _interleaved_reads(pair, batch, budget)
    for name, ds in pair:
        loader = detdata.DataLoader(ds, global_batch_size=batch, seed=3)
        it = iter(loader)
        next(it)
        count, t0 = 0, time.perf_counter()
        while time.perf_counter() - t0 < budget or count < 16:
            next(it)
            count += 1
        loader_s = (time.perf_counter() - t0) / count
        rows.append(
            {
                "dataset": name,
                "windows": ds.num_samples,
                "seq_len": seq_len,
                "batch": batch,
                "read_windows_per_s": batch / read_s[name],
                "loader_windows_per_s": batch / loader_s,
            }
        )
    rows[1]["read_slowdown"] = read_s["PackedWindows"] / read_s["TokenWindows"]
    rows[1]["read_slowdown_rounds"] = [min(round_ratios), max(round_ratios)]
    for w in np.random.default_rng(5).integers(0, packed.num_samples, size=8).tolist():
        got = packed.read(np.array([w]))["tokens"][0]
        if not np.array_equal(got, _expected_window(docs, packed, w)):
            raise SystemExit(f"packed window {w} does not match its recomputation")
    same_tokens = (
        plain.read(np.array([0]))["tokens"].size == packed.read(np.array([0]))["tokens"].size
    )
    for row in rows:
        row["validated"] = bool(same_tokens)
    return rows


def _interleaved_reads(
    pair: tuple[tuple[str, Any], ...], batch: int, budget: float
) -> tuple[dict[str, float], list[float]]:
    """Median seconds per ``read`` of ``batch`` shuffled ids for each dataset, and each
    round's ratio of the two medians.

    Each call is timed on its own, the two datasets alternating call by call, in rounds
    of 64 batches each (for ``2 * budget`` seconds, at least 5 rounds): on a shared
    machine a pre-emption lands on a few calls of either dataset, not on a whole pass
    of one, and the median ignores it.
    """
    batches = {}
    for name, ds in pair:
        rng = np.random.default_rng(0)
        batches[name] = [rng.integers(0, ds.num_samples, size=batch) for _ in range(64)]
        for b in batches[name]:  # warm: map the pages, fill the caches
            ds.read(b)
    times: dict[str, list[float]] = {name: [] for name, _ in pair}
    ratios: list[float] = []
    deadline = time.perf_counter() + 2 * budget
    while len(ratios) < 5 or time.perf_counter() < deadline:
        this: dict[str, list[float]] = {name: [] for name, _ in pair}
        for i in range(64):
            for name, ds in pair:
                t0 = time.perf_counter()
                ds.read(batches[name][i])
                this[name].append(time.perf_counter() - t0)
        for name, _ in pair:
            times[name] += this[name]
        ratios.append(float(np.median(this[pair[1][0]]) / np.median(this[pair[0][0]])))
    return {name: float(np.median(t)) for name, t in times.items()}, ratios


def bench_build(work: Path, sizes: list[int]) -> list[dict[str, Any]]:
    rows = []
    for n in sizes:
        root = corpus(work / f"build-{n}", n, mean_len=6, shards=4, seed=n)
        manifest = detdata.build_manifest(str(root))
        index = work / f"index-{n}"
        t0 = time.perf_counter()
        docs = Documents(manifest, index_dir=index, storage=Storage(verify="off"))
        t1 = time.perf_counter()
        packed = PackedWindows(docs, 2048, seed=1)
        t2 = time.perf_counter()
        again = PackedWindows(
            Documents(manifest, index_dir=index, storage=Storage(verify="off")), 2048, seed=1
        )
        t3 = time.perf_counter()
        assert again.num_samples == packed.num_samples
        rows.append(
            {
                "documents": n,
                "document_table_s": t1 - t0,
                "packing_index_s": t2 - t1,
                "load_both_from_index_dir_s": t3 - t2,
                "build_s_per_1e6_docs": (t2 - t0) * 1e6 / n,
                "build_s_per_1e8_docs_extrapolated": (t2 - t0) * 1e8 / n,
                "index_bytes_per_doc": (2 * packed.offsets.nbytes + docs.starts.nbytes) / n,
            }
        )
        del docs, packed, again
    return rows


def bench_resume(root: Path, seq_len: int, batch: int, repeats: int) -> dict[str, Any]:
    packed = PackedWindows(Documents(detdata.build_manifest(str(root))), seq_len, seed=1)

    def make() -> detdata.DataLoader:
        # one global batch per read: the first batch measures positioning, not read-ahead
        return detdata.DataLoader(
            packed,
            global_batch_size=batch,
            seed=3,
            options=detdata.LoaderOptions(read=detdata.ReadOptions(batches_ahead=1)),
        )

    def fresh() -> None:
        next(iter(make()))

    saved = make().state_dict()
    saved["samples_consumed"] = RESUME_AT - RESUME_AT % batch  # a state saved at 1e9

    def resumed() -> None:
        loader = make()
        loader.load_state_dict(saved)
        next(iter(loader))

    fresh_s = best_of(fresh, repeats)
    resumed_s = best_of(resumed, repeats)
    return {
        "position": RESUME_AT - RESUME_AT % batch,
        "windows_per_epoch": packed.num_samples,
        "fresh_first_batch_s": fresh_s,
        "resume_first_batch_s": resumed_s,
        "ratio": resumed_s / fresh_s,
        "within_2x": resumed_s <= 2 * fresh_s,
    }


def table(doc: dict[str, Any]) -> str:
    lines = [
        "| dataset | seq_len | batch | read windows/s | loader windows/s |",
        "|---|---|---|---|---|",
    ]
    for r in doc["read"]:
        lines.append(
            f"| {r['dataset']} | {r['seq_len']} | {r['batch']} | {r['read_windows_per_s']:,.0f} "
            f"| {r['loader_windows_per_s']:,.0f} |"
        )
    packed = doc["read"][1]
    low, high = packed["read_slowdown_rounds"]
    lines.append(
        f"\nPackedWindows.read / TokenWindows.read time per call (medians, calls "
        f"interleaved): {packed['read_slowdown']:.2f}x (rounds: {low:.2f}x to {high:.2f}x)"
    )
    lines += [
        "",
        "| documents | document table s | packing index s | load both s | s per 1e6 docs "
        "| s per 1e8 docs (extrapolated) | index bytes/doc |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in doc["build"]:
        lines.append(
            f"| {r['documents']:,} | {r['document_table_s']:.3f} | {r['packing_index_s']:.3f} | "
            f"{r['load_both_from_index_dir_s']:.3f} | {r['build_s_per_1e6_docs']:.3f} | "
            f"{r['build_s_per_1e8_docs_extrapolated']:.1f} | {r['index_bytes_per_doc']:.0f} |"
        )
    r = doc["resume"]
    lines += [
        "",
        f"resume at position {r['position']:,}: first batch "
        f"{r['resume_first_batch_s'] * 1e3:.1f} ms "
        f"vs fresh start {r['fresh_first_batch_s'] * 1e3:.1f} ms (ratio {r['ratio']:.2f}, "
        f"within 2x: {r['within_2x']})",
    ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--smoke", action="store_true", help="tiny sizes: seconds, for the tests")
    ap.add_argument("--out", type=Path, default=RESULTS)
    ap.add_argument("--work", type=Path, default=None, help="scratch directory for corpora")
    ap.add_argument("--build-sizes", type=str, default=None, help="e.g. 1000000,10000000")
    args = ap.parse_args(argv)
    smoke = args.smoke
    work = args.work or Path(tempfile.mkdtemp(prefix="detdata-packing-bench-"))
    read_docs, mean_len, seq_len = (2_000, 300, 256) if smoke else (200_000, 500, 2048)
    sizes = (
        [int(s) for s in args.build_sizes.split(",")]
        if args.build_sizes
        else ([20_000] if smoke else [1_000_000, 10_000_000])
    )
    root = corpus(work / "read", read_docs, mean_len, shards=4, seed=0)
    doc = {
        "benchmark": "packing",
        "smoke": smoke,
        "machine": {"platform": platform.platform(), "cpus": os.cpu_count()},
        "read": bench_read(root, seq_len, batch=8 if smoke else 16, budget=0.2 if smoke else 2.0),
        "build": bench_build(work, sizes),
        "resume": bench_resume(root, seq_len, batch=8 if smoke else 512, repeats=3 if smoke else 7),
    }
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "packing.json").write_text(json.dumps(doc, indent=1) + "\n")
    print(table(doc))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
