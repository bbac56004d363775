"""Resume attestation's cost (issue 43): at save, at resume, per step, and in the state.

Run: ``python -m benchmarks.attest [--smoke] [--shards N] [--json FILE]``. Prints a table and
writes ``benchmarks/results/attest.json`` (not with ``--smoke``).

A corpus of ``--shards`` (default 100,000) small ``.npy`` token shards (64 int32 tokens each)
behind one manifest is read through ``TokenWindows`` twice: from the local folder, and from a
real HTTP server on 127.0.0.1 (nginx, or Twisted's, `tests.servers.start_http`) serving the
same folder, with the shard cache. For each root and for ``ResumePolicy(attest=True)`` and
``False``:

* ``save_ms``: ``state_dict()`` after 3 delivered micro batches (median of ``--repeats``);
* ``save_rchar``: bytes this process read through system calls (``/proc/self/io``: files
  and sockets, so the HTTP responses too) during one ``state_dict()``;
* ``resume_ms``: a fresh loader's ``load_state_dict(state)`` plus its first ``next()``
  (median), and ``resume_rchar`` for one of them;
* ``step_us``: mean time per delivered micro batch over ``--steps`` batches, on a second pass
  over the same batches (caches warm; attestation adds nothing per step: the on and off rows
  must agree within noise);
* ``state_bytes``: the state's JSON size.

Numbers on a loaded 2-core machine shared with other jobs are noisy; compare the on/off
columns of one run, not runs of different days.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

if not __package__:  # run as ``python benchmarks/attest.py``: benchmarks.* from this checkout
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import detdata

RESULTS = Path(__file__).parent / "results" / "attest.json"
TOKENS, SEQ, MICRO = 64, 15, 16


def rchar() -> int:
    """Bytes this process read through system calls so far."""
    for line in Path("/proc/self/io").read_text().splitlines():
        if line.startswith("rchar:"):
            return int(line.split()[1])
    return 0


def write_corpus(folder: Path, shards: int) -> None:
    folder.mkdir(parents=True)
    rng = np.random.default_rng(43)
    for i in range(shards):
        np.save(folder / f"s{i:07d}.npy", rng.integers(0, 50_000, TOKENS).astype(np.int32))


def loader(manifest: Any, attest: bool) -> detdata.DataLoader:
    data = detdata.TokenWindows(manifest, SEQ, storage=detdata.Storage(verify="off"))
    return detdata.DataLoader(
        data,
        global_batch_size=MICRO,
        seed=1,
        options=detdata.LoaderOptions(
            resume=detdata.ResumePolicy(attest=attest),
            read=detdata.ReadOptions(steps_ahead=0),
        ),
    )


def _median_ms(fn: Callable[[], Any], repeats: int) -> float:
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times) * 1e3


def measure(manifest: Any, attest: bool, repeats: int, steps: int) -> dict[str, Any]:
    dl = loader(manifest, attest)
    it = iter(dl)
    for _ in range(3):
        next(it)
    before = rchar()
    state = dl.state_dict()
    save_rchar = rchar() - before
    save_ms = _median_ms(dl.state_dict, repeats)

    def resume() -> None:
        fresh = loader(manifest, attest)
        fresh.load_state_dict(state)
        next(iter(fresh))

    before = rchar()
    resume()
    resume_rchar = rchar() - before
    resume_ms = _median_ms(resume, repeats)
    for _pass in range(2):  # the first pass fills the shard cache and the page cache
        run = loader(manifest, attest)
        it = iter(run)
        next(it)
        t = time.perf_counter()
        for _ in range(steps):
            next(it)
        step_us = (time.perf_counter() - t) / steps * 1e6
        run.close()
    return {
        "attest": attest,
        "save_ms": round(save_ms, 3),
        "save_rchar": save_rchar,
        "resume_ms": round(resume_ms, 3),
        "resume_rchar": resume_rchar,
        "step_us": round(step_us, 1),
        "state_bytes": len(json.dumps(state)),
    }


def rows(shards: int, repeats: int, steps: int, work: Path) -> list[dict[str, Any]]:
    from tests.servers import start_http, stop_pid

    corpus = work / "corpus"
    t = time.perf_counter()
    write_corpus(corpus, shards)
    manifest = detdata.build_manifest(str(corpus), pattern="*.npy")
    print(f"corpus of {shards} shards built in {time.perf_counter() - t:.1f} s", flush=True)
    out = []
    for attest in (True, False):
        row = measure(manifest, attest, repeats, steps)
        out.append({"root": "local", "shards": shards, **row})
    server = start_http(work / "http")
    try:
        folder, url = server.new_dir()
        shutil.rmtree(folder)
        shutil.copytree(corpus, folder)
        remote = manifest.with_root(url)
        for attest in (True, False):
            row = measure(remote, attest, repeats, steps)
            out.append({"root": "http 127.0.0.1", "shards": shards, **row})
    finally:
        stop_pid(server.pid, 5.0)
    return out


def table(found: list[dict[str, Any]]) -> str:
    keys = ["root", "shards", "attest", "save_ms", "save_rchar", "resume_ms", "resume_rchar"]
    keys += ["step_us", "state_bytes"]
    lines = [" | ".join(keys), " | ".join("---" for _ in keys)]
    lines += [" | ".join(str(r[k]) for k in keys) for r in found]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--smoke", action="store_true", help="1,000 shards, 3 repeats")
    parser.add_argument("--shards", type=int, default=100_000)
    parser.add_argument("--repeats", type=int, default=9)
    parser.add_argument("--steps", type=int, default=400)
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args(argv)
    shards = 1000 if args.smoke else args.shards
    repeats = 3 if args.smoke else args.repeats
    steps = 50 if args.smoke else args.steps
    with tempfile.TemporaryDirectory(prefix="detdata-attest-") as tmp:
        os.environ["DETDATA_CACHE_DIR"] = str(Path(tmp) / "shard-cache")
        found = rows(shards, repeats, steps, Path(tmp))
    print(table(found))
    doc = {
        "machine": {"python": platform.python_version(), "platform": platform.platform()},
        "note": "loaded 2-core machine shared with other jobs: timings are noisy",
        "rows": found,
    }
    target = args.json or (None if args.smoke else RESULTS)
    if target is not None:
        target.write_text(json.dumps(doc, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
