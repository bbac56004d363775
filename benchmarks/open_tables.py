"""Open cost of `TableRows` and `Documents` over many Parquet shards (issue 33), one process.

    python benchmarks/open_tables.py --write /tmp/pq10000 --shards 10000   # the corpus, once
    python benchmarks/open_tables.py table /tmp/pq10000/manifest.json
    python benchmarks/open_tables.py docs /tmp/pq10000/manifest.json /tmp/pq-index

Shard ``i`` holds 8 rows (an ``idx`` int64 column and an ``input_ids`` list<int32> column of
10-59 tokens) in row groups of 4. Prints CPU seconds (user + system) and RSS growth of the
dataset's construction plus a first read of 64 rows / tokens spread over the corpus, with
``verify="off"`` (verification is measured by ``benchmarks/startup.py``); pyarrow and pandas
are imported before (pyarrow's ``to_numpy`` imports pandas in any process converting a
column). Run it with ``PYTHONPATH`` at the checkout to measure.
"""

from __future__ import annotations

import argparse
import os
import resource
import sys

from detdata import Storage


def cpu() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def rss_mb() -> float:
    with open("/proc/self/status") as fh:
        for line in fh:
            if line.startswith("VmRSS"):
                return int(line.split()[1]) / 1024
    return 0.0


def write(root: str, shards: int) -> None:
    import numpy as np
    import pyarrow as pa
    import pyarrow.parquet as pq

    from detdata import build_manifest

    for i in range(shards):
        folder = f"{root}/{i // 1000:04d}"
        os.makedirs(folder, exist_ok=True)
        lengths = (np.arange(8) * 7 + i) % 50 + 10
        tokens = [
            ((np.arange(n) * 31 + i * 7 + j) % 30000).astype(np.int32)
            for j, n in enumerate(lengths)
        ]
        table = pa.table(
            {
                "input_ids": pa.array(tokens, type=pa.list_(pa.int32())),
                "idx": pa.array(np.arange(8) + 8 * i),
            }
        )
        pq.write_table(table, f"{folder}/p{i:07d}.parquet", row_group_size=4)
    build_manifest(root, threads=4).save(root + "/manifest.json")


def measure(kind: str, manifest: str, index_dir: str | None) -> None:
    import numpy as np
    import pandas  # noqa: F401  (imported by pyarrow's to_numpy: an import, not the open)
    import pyarrow.parquet  # noqa: F401

    from detdata import Documents, TableRows

    c0, r0 = cpu(), rss_mb()
    if kind == "table":
        ds = TableRows(manifest, ["idx"], storage=Storage(verify="off"))
        ds.read(np.arange(0, 64 * 997, 997) % ds.num_samples)
    else:
        docs = Documents(
            manifest,
            column="input_ids",
            storage=Storage(verify="off"),
            index_dir=index_dir,
            progress=False,
        )
        docs.gather(np.arange(0, 64 * 997, 997) % docs.num_tokens)
    print(f"{kind}: cpu {cpu() - c0:.3f} s, rss +{rss_mb() - r0:.1f} MB", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("args", nargs="*")
    ap.add_argument("--write", default=None, help="write the corpus here")
    ap.add_argument("--shards", type=int, default=10000)
    args = ap.parse_args()
    if args.write:
        write(args.write, args.shards)
        return
    if len(args.args) < 2 or args.args[0] not in ("table", "docs"):
        sys.exit("usage: open_tables.py table|docs MANIFEST [INDEX_DIR]")
    measure(args.args[0], args.args[1], args.args[2] if len(args.args) > 2 else None)


if __name__ == "__main__":
    main()
