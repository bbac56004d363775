"""Scale in the number of shards: same bytes cut into 100 .. 100k local shards, bounded resources.

Run: ``python benchmarks/scale.py [--smoke] [--shards 100,1000,...] [--out DIR]``.

1. Writes the same samples (``--samples`` windows of ``--seq-len`` int32 tokens, 2 KiB each
   at the default 512; token ``j`` of sample ``s`` is ``s * seq_len + j``, so every row is
   checked without a lookup table) as 100, 1k, 10k, 50k and 100k ``.npy`` shards, and
   Parquet shards (one ``list<int32>`` column, one row group per shard) at 1k and 10k
   shards; each folder gets a manifest (reused when the spec is the same).
2. For every shard count, order (``feistel-v1``; the locality-aware order when this
   checkout has one, else ``n/a``) and ``num_workers`` (0 and 2 worker processes), a
   `detdata.DataLoader` runs for ``--budget`` seconds after a warm-up: samples/s, and,
   sampled while it runs, the peak number of open descriptors and of mapped shard files
   (``/proc/<pid>/fd`` and ``/proc/<pid>/maps`` of the main process and of each worker),
   and each worker's peak RSS (``VmHWM``) and anonymous RSS.
   Then alternating slices (`paired_slices`, ``--slices``): every order at the target shard
   counts against ``feistel-v1`` at the fewest, all loaders alive, in turns seconds apart.
3. Cost of a handle miss (`reopen_rows`): one window from a mapped shard, from a shard
   that is not open (``preadv``), 8 windows from a shard that is not open (map + evict);
   one Parquet row from an open reader vs a re-opened one.
4. Optional rows of other modules (``n/a`` when a module or function is missing):
   `benchmarks.scale_identity` (``registry_rows``, ``open_rows``), and ``rows(smoke)`` of
   `benchmarks.scale_order` and `benchmarks.scale_remote`.
5. Prints a Markdown growth table with fitted exponents (the log-log slope of time per
   sample against the number of shards: 0 is flat), writes ``scale.json`` (and
   ``scale.png`` when matplotlib is installed) under ``--out``.

Throughput here is machine dependent (say whether the machine was quiet); descriptor and
mapping counts are not: they must stay under ``max_open_shards`` per process.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import inspect
import json
import math
import os
import platform
import shutil
import statistics
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np

if not __package__:  # run as ``python benchmarks/scale.py``
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.timing import Stopwatch, best_of
from detdata.datasets.handles import DEFAULT_MAX_OPEN_SHARDS

FEISTEL = "feistel-v1"
SHARDS = (100, 1_000, 10_000, 50_000, 100_000)
PARQUET_SHARDS = (1_000, 10_000)
SMOKE_SHARDS = (10, 200)
SMOKE_PARQUET = (50,)
SAMPLE_EVERY_S = 0.25
#: Parquet runs: at most this many whole warm-up epochs (the first one included).
WARM_EPOCHS_MAX = 16
#: Parquet runs: warm when the last this many epochs improve on the earlier ones by < 10%.
STEADY_EPOCHS = 3


@dataclass(frozen=True)
class TokenSpec:
    """``samples`` windows of ``seq_len`` int32 tokens in ``shards`` ``.npy`` shards."""

    samples: int
    seq_len: int
    shards: int

    def windows(self, shard: int) -> tuple[int, int]:
        """``[first, last)`` global sample ids of ``shard`` (the remainder spread evenly)."""
        return self.samples * shard // self.shards, self.samples * (shard + 1) // self.shards


@dataclass(frozen=True)
class TableSpec:
    """``rows`` rows of a ``list<int32>`` column of ``width`` tokens in ``shards`` shards."""

    rows: int
    width: int
    shards: int


# ------------------------------------------------------------------ data
def _reuse(folder: Path, spec: object) -> bool:
    marker = folder / "spec.json"
    return marker.exists() and json.loads(marker.read_text()) == asdict(spec)  # type: ignore[call-overload]


def _finish(folder: Path, spec: object, pattern: str) -> float:
    """Build and save the manifest of ``folder``; returns seconds it took."""
    import detdata

    with Stopwatch() as clock:
        detdata.build_manifest(str(folder), pattern=pattern).save(str(folder / "manifest.json"))
    (folder / "spec.json").write_text(json.dumps(asdict(spec)))  # type: ignore[call-overload]
    return clock.seconds


def write_tokens(root: Path, spec: TokenSpec) -> tuple[Path, float]:
    """The ``.npy`` shards of ``spec`` under ``root`` and their manifest; ``(folder,
    manifest build seconds or 0 when reused)``."""
    folder = root / f"tokens-{spec.shards}"
    if _reuse(folder, spec):
        return folder, 0.0
    shutil.rmtree(folder, ignore_errors=True)
    digits = len(str(spec.shards - 1))
    for shard in range(spec.shards):
        first, last = spec.windows(shard)
        sub = folder / f"{shard // 1000:03d}"  # at most 1,000 files per folder
        sub.mkdir(parents=True, exist_ok=True)
        tokens = np.arange(first * spec.seq_len, last * spec.seq_len, dtype=np.int32)
        np.save(sub / f"s{shard:0{digits}d}.npy", tokens)
    return folder, _finish(folder, spec, "**/*.npy")


def write_tables(root: Path, spec: TableSpec) -> tuple[Path, float]:
    """The Parquet shards of ``spec`` (one row group each) and their manifest."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    folder = root / f"parquet-{spec.shards}"
    if _reuse(folder, spec):
        return folder, 0.0
    shutil.rmtree(folder, ignore_errors=True)
    digits = len(str(spec.shards - 1))
    for shard in range(spec.shards):
        first = spec.rows * shard // spec.shards
        last = spec.rows * (shard + 1) // spec.shards
        flat = np.arange(first * spec.width, last * spec.width, dtype=np.int32)
        column = pa.FixedSizeListArray.from_arrays(pa.array(flat), spec.width)
        sub = folder / f"{shard // 1000:03d}"
        sub.mkdir(parents=True, exist_ok=True)
        pq.write_table(
            pa.table({"tokens": column}),
            sub / f"s{shard:0{digits}d}.parquet",
            row_group_size=max(1, last - first),
        )
    return folder, _finish(folder, spec, "**/*.parquet")


def warm_page_cache(folder: Path) -> int:
    """Read every file under ``folder`` once (not timed): this VM's kernel reclaims the
    page cache of files left cold for a few minutes (DAMON), and a run that then reads
    50k shards from disk measures the disk, not the loader (seen: 9k against 170k
    samples/s for the same configuration). Every configuration starts from a warm cache,
    the 100-shard baseline included. Returns the bytes read."""
    total = 0
    for dirpath, _, names in os.walk(folder):
        for name in names:
            with open(os.path.join(dirpath, name), "rb") as fh:
                while chunk := fh.read(1 << 20):
                    total += len(chunk)
    return total


def check_rows(tokens: np.ndarray[Any, Any], width: int) -> None:
    """Every row is one sample's tokens: starts at a multiple of ``width``, consecutive."""
    first = tokens[:, 0].astype(np.int64)
    if (first % width).any() or (tokens[:, -1].astype(np.int64) - first != width - 1).any():
        raise AssertionError("a delivered row is not one sample's tokens")
    middle = width // 2
    if (tokens[:, middle].astype(np.int64) - first != middle).any():
        raise AssertionError("a delivered row is not one sample's tokens")


# ------------------------------------------------------------------ orders
def locality_factory() -> tuple[str, Callable[[Any, int], Any]] | None:
    """``(name, make(dataset, seed) -> stream)`` for the locality-aware order, if this
    checkout has one: an ``order=`` / ``algorithm=`` parameter of `detdata.OrderedStream`
    and a registered algorithm name other than ``feistel-v1``."""
    import detdata

    params = inspect.signature(detdata.OrderedStream).parameters
    keyword = next((k for k in ("order", "algorithm") if k in params), None)
    if keyword is None:
        return None
    for name in _order_names():
        if name != FEISTEL:
            return name, lambda ds, seed, n=name, k=keyword: detdata.OrderedStream(
                ds, seed, **{k: n}
            )
    return None


def _order_names() -> list[str]:
    """Algorithm names this checkout exports (``ALGORITHMS`` / ``ORDERS`` of
    `detdata.order`, else every ``ALGORITHM`` constant of its modules but mixtures)."""
    import importlib
    import pkgutil

    import detdata.order as order

    for attr in ("ALGORITHMS", "ORDERS", "ORDER_ALGORITHMS"):
        names = getattr(order, attr, None)
        if names:
            return [str(n) for n in names]
    found = []
    for info in pkgutil.iter_modules(order.__path__):
        with contextlib.suppress(Exception):
            module = importlib.import_module(f"detdata.order.{info.name}")
            name = getattr(module, "ALGORITHM", None)
            if isinstance(name, str) and "mixture" not in name:
                found.append(name)
    return sorted(set(found))


def order_factories(wanted: str | None) -> dict[str, Callable[[Any, int], Any] | None]:
    """Order name -> stream factory (None: not in this checkout, reported ``n/a``)."""
    import detdata

    out: dict[str, Callable[[Any, int], Any] | None] = {
        FEISTEL: lambda ds, seed: detdata.OrderedStream(ds, seed)
    }
    found = locality_factory()
    if wanted:
        out[wanted] = found[1] if found and found[0] == wanted else None
    elif found:
        out[found[0]] = found[1]
    else:
        out["locality"] = None
    return out


# ------------------------------------------------------------------ resources
def _children(pid: int) -> list[int]:
    kids = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        with contextlib.suppress(OSError, IndexError, ValueError):
            stat = Path(f"/proc/{entry}/stat").read_text()
            if int(stat.rsplit(")", 1)[1].split()[1]) == pid:
                kids.append(int(entry))
    return kids


def resources(pid: int, data_dir: str) -> dict[str, int]:
    """Open descriptors, mapped shard files (distinct paths under ``data_dir``), and RSS
    fields (KiB) of process ``pid`` (zeros for a process that is gone)."""
    out = {"fds": 0, "shard_maps": 0, "rss_kib": 0, "hwm_kib": 0, "anon_kib": 0}
    with contextlib.suppress(OSError):
        out["fds"] = len(os.listdir(f"/proc/{pid}/fd"))
        mapped = set()
        with open(f"/proc/{pid}/maps") as fh:
            for line in fh:
                where = line.find(data_dir)
                if where >= 0:
                    mapped.add(line[where:].rstrip("\n"))
        out["shard_maps"] = len(mapped)
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            key, _, value = line.partition(":")
            field = {"VmRSS": "rss_kib", "VmHWM": "hwm_kib", "RssAnon": "anon_kib"}.get(key)
            if field:
                out[field] = int(value.split()[0])
    return out


class Peaks:
    """Peak resources of the main process and of its workers, sampled now and then."""

    def __init__(self, data_dir: str) -> None:
        self.data_dir = data_dir
        self.main = {"fds": 0, "shard_maps": 0}
        self.worker = {"fds": 0, "shard_maps": 0, "hwm_kib": 0, "anon_kib": 0}
        self.workers_seen = 0

    def sample(self) -> None:
        me = resources(os.getpid(), self.data_dir)
        for key in self.main:
            self.main[key] = max(self.main[key], me[key])
        kids = _children(os.getpid())
        self.workers_seen = max(self.workers_seen, len(kids))
        for pid in kids:
            got = resources(pid, self.data_dir)
            for key in self.worker:
                self.worker[key] = max(self.worker[key], got[key])


# ------------------------------------------------------------------ loader runs
@dataclass(frozen=True)
class Run:
    kind: str  # tokens | parquet
    shards: int
    order: str
    workers: int
    worker_mode: str = "process"


def _dataset(
    kind: str, folder: Path, seq_len: int, max_open: int | None, cache_row_groups: int | None = None
) -> Any:
    import detdata

    manifest = str(folder / "manifest.json")
    extra: dict[str, Any] = {} if max_open is None else {"max_open_shards": max_open}
    storage = detdata.Storage(verify="off", **extra)
    if kind == "tokens":
        return detdata.TokenWindows(manifest, seq_len, labels=False, storage=storage)
    return detdata.TableRows(
        manifest, ["tokens"], cache_row_groups=cache_row_groups, storage=storage
    )


def measure(
    run: Run,
    folder: Path,
    make_stream: Callable[[Any, int], Any],
    *,
    width: int,
    batch: int,
    budget: float,
    max_open: int | None,
) -> dict[str, Any]:
    """samples/s of a `detdata.DataLoader` over ``budget`` seconds after a warm-up, every
    row checked, with peak descriptors / shard mappings / worker RSS."""
    import detdata

    warm_page_cache(folder)
    with Stopwatch() as opening:
        ds = _dataset(run.kind, folder, width, max_open)
    stream = make_stream(ds, 7)
    loader = detdata.DataLoader(
        stream,
        global_batch_size=batch,
        num_workers=run.workers,
        options=detdata.LoaderOptions(read=detdata.ReadOptions(worker_mode=run.worker_mode)),
        seed=3,
    )
    peaks = Peaks(str(folder))
    column = "tokens"
    clock = Stopwatch()
    samples = 0
    it: Iterator[Any] = iter(loader)
    warm = time.perf_counter() + min(1.0, budget)
    with Stopwatch() as first:
        check_rows(next(it)[column].numpy(), width)
    # Parquet: the first epoch decodes every row group once (opening every shard's
    # reader); it is timed on its own. Then whole epochs run until they stop getting faster
    # (`_steady`; at most `WARM_EPOCHS_MAX`): with row-group windows a worker
    # decodes only the groups its batches touch, so its cache fills over a few epochs.
    # The measured window starts after that (the 100-shard figure is measured warm too).
    epoch_batches = -(-ds.num_samples // batch) if run.kind == "parquet" else 0
    warm_batches = 1
    began = time.perf_counter()
    epochs: list[float] = []  # seconds of each whole warm-up epoch (the first included)
    while time.perf_counter() < warm or warm_batches < epoch_batches:
        check_rows(next(it)[column].numpy(), width)
        warm_batches += 1
        if warm_batches == epoch_batches:
            epochs.append(first.seconds + time.perf_counter() - began)
    while epochs and len(epochs) < WARM_EPOCHS_MAX and not _steady(epochs):
        began = time.perf_counter()
        for _ in range(epoch_batches):
            check_rows(next(it)[column].numpy(), width)
        epochs.append(time.perf_counter() - began)
    epoch_s = epochs[0] if epochs else 0.0
    next_sample = 0.0
    cpu = 0.0  # CPU seconds of this process inside next(): the whole loader with 0 workers
    while clock.seconds < budget:
        cpu_at = time.process_time()
        with clock:
            got = next(it)[column]
        cpu += time.process_time() - cpu_at
        rows = got.numpy()
        check_rows(rows, width)
        samples += rows.shape[0]
        if clock.seconds >= next_sample:
            peaks.sample()
            next_sample = clock.seconds + SAMPLE_EVERY_S
    peaks.sample()
    del it, loader, stream, ds
    gc.collect()
    return {
        **asdict(run),
        "samples_per_s": samples / clock.seconds,
        "us_per_sample": 1e6 * clock.seconds / max(samples, 1),
        "cpu_s_main": cpu,
        "samples_per_cpu_s_main": samples / cpu if cpu > 0 else None,
        "samples": samples,
        "open_s": opening.seconds,
        "first_batch_s": first.seconds,
        "first_epoch_samples_per_s": epoch_batches * batch / epoch_s if epoch_s else None,
        "warm_epochs_s": epochs,
        "peak_fds_main": peaks.main["fds"],
        "peak_shard_maps_main": peaks.main["shard_maps"],
        "workers_seen": peaks.workers_seen,
        "peak_fds_worker": peaks.worker["fds"],
        "peak_shard_maps_worker": peaks.worker["shard_maps"],
        "peak_rss_worker_mib": peaks.worker["hwm_kib"] / 1024,
        "anon_rss_worker_mib": peaks.worker["anon_kib"] / 1024,
    }


def _steady(epochs: list[float]) -> bool:
    """Warm: the fastest of the last ``STEADY_EPOCHS`` whole epochs is no faster than 0.9x
    the fastest before them (caches stopped filling; one slow epoch, a scheduling hiccup,
    neither stops nor prolongs the warm-up)."""
    if len(epochs) < STEADY_EPOCHS + 2:
        return False
    return min(epochs[-STEADY_EPOCHS:]) >= 0.9 * min(epochs[:-STEADY_EPOCHS])


def median_row(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """The round with the median samples/s (its other fields with it), every round's
    samples/s in ``rounds_samples_per_s`` and the peaks over all rounds."""
    ranked = sorted(rows, key=lambda r: r["samples_per_s"])
    out = dict(ranked[(len(ranked) - 1) // 2])
    out["rounds_samples_per_s"] = [r["samples_per_s"] for r in rows]
    for key in (k for k in out if k.startswith("peak_")):
        out[key] = max(r[key] for r in rows)
    return out


# ------------------------------------------------------------------ paired slices
#: `paired_slices`: seconds each slice runs untimed before its timed part (the other
#: loader's in-flight groups finish, this one's queue refills).
SLICE_SETTLE_S = 0.25


@dataclass
class _Live:
    """One loader kept alive for `paired_slices`: its iterator and the timed totals."""

    label: str
    it: Iterator[Any]
    keep: tuple[Any, ...]  # the loader, stream and dataset behind ``it``
    samples: list[int]
    seconds: list[float]


def _live(label: str, kind: str, folder: Path, make: Callable[[Any, int], Any], **kw: Any) -> _Live:
    import detdata

    warm_page_cache(folder)
    ds = _dataset(kind, folder, kw["width"], kw["max_open"])
    stream = make(ds, 7)
    loader = detdata.DataLoader(
        stream, global_batch_size=kw["batch"], num_workers=kw["workers"], seed=3
    )
    live = _Live(label, iter(loader), (loader, stream, ds), [], [])
    if kind == "parquet":  # whole epochs until the workers' row-group caches stop filling
        epochs: list[float] = []
        batches = -(-ds.num_samples // kw["batch"])
        while len(epochs) < WARM_EPOCHS_MAX and not _steady(epochs):
            began = time.perf_counter()
            for _ in range(batches):
                check_rows(next(live.it)["tokens"].numpy(), kw["width"])
            epochs.append(time.perf_counter() - began)
    return live


def _slice(live: _Live, seconds: float, width: int) -> None:
    """Pull batches from ``live`` for `SLICE_SETTLE_S` untimed, then ``seconds`` timed
    (every row checked)."""
    settle = time.perf_counter() + SLICE_SETTLE_S
    while time.perf_counter() < settle:
        check_rows(next(live.it)["tokens"].numpy(), width)
    clock = Stopwatch()
    samples = 0
    while clock.seconds < seconds:
        with clock:
            got = next(live.it)["tokens"]
        rows = got.numpy()
        check_rows(rows, width)
        samples += rows.shape[0]
    live.samples.append(samples)
    live.seconds.append(clock.seconds)


def paired_slices(
    ref: tuple[Path, Callable[[Any, int], Any]],
    cands: dict[str, tuple[Path, Callable[[Any, int], Any]]],
    *,
    kind: str,
    workers: int,
    slices: int,
    seconds: float,
    **kw: Any,
) -> list[dict[str, Any]]:
    """Each candidate's samples/s as a share of the reference's, measured in alternating
    slices: every loader stays alive (its workers too) and slices of ``seconds`` run in
    turn, reference first then the candidates, the turn reversed every other pass (ABBA:
    a drift of the machine's speed within a pass hits both sides alike). This VM's speed
    changes by tens of percent from one minute to the next; full runs minutes apart
    (`measure`) mix those spells into their ratios, slices seconds apart do much less.
    Returns one row per candidate: per-pass ratios, their median, the pooled ratio
    (total samples over total seconds, each side) and the 10th-90th percentile range.
    Parquet loaders first run whole epochs until they stop getting faster, as in `measure`."""
    lives = [_live("reference", kind, ref[0], ref[1], workers=workers, **kw)]
    lives += [
        _live(label, kind, folder, make, workers=workers, **kw)
        for label, (folder, make) in cands.items()
    ]
    for live in lives:  # first pass untimed: workers started, caches warm
        _slice(live, seconds, kw["width"])
        live.samples.clear()
        live.seconds.clear()
    for i in range(slices):
        for live in lives if i % 2 == 0 else lives[::-1]:
            _slice(live, seconds, kw["width"])
    base = lives[0]
    base_rates = [s / t for s, t in zip(base.samples, base.seconds, strict=True)]
    out = []
    for live in lives[1:]:
        rates = [s / t for s, t in zip(live.samples, live.seconds, strict=True)]
        pct = [100 * a / b for a, b in zip(rates, base_rates, strict=True)]
        pooled = (sum(live.samples) / sum(live.seconds)) / (sum(base.samples) / sum(base.seconds))
        lo, hi = np.percentile(pct, [10, 90]).tolist()
        out.append(
            {
                "kind": kind,
                "candidate": live.label,
                "workers": workers,
                "slices": slices,
                "slice_s": seconds,
                "reference_samples_per_s": sum(base.samples) / sum(base.seconds),
                "samples_per_s": sum(live.samples) / sum(live.seconds),
                "pct_each": pct,
                "pct_median": statistics.median(pct),
                "pct_pooled": 100 * pooled,
                "pct_p10_p90": [lo, hi],
            }
        )
    for live in lives:
        del live.it
    lives.clear()
    gc.collect()
    return out


def slices_table(rows: list[dict[str, Any]]) -> str:
    """Markdown of `paired_slices` rows (the reference: `FEISTEL` at the fewest shards of
    each kind)."""
    if not rows:
        return ""
    lines = [
        f"\n\n**alternating slices against {FEISTEL} at the fewest shards of each kind (same "
        "run, seconds apart)**\n",
        "| kind | candidate | workers | slices x s | samples/s (reference) | % median of slices | "
        "% pooled | % 10th-90th | each slice % |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        each = ", ".join(f"{p:.0f}" for p in r["pct_each"])
        lo, hi = r["pct_p10_p90"]
        lines.append(
            f"| {r.get('kind', 'tokens')} | {r['candidate']} | {r['workers']} | "
            f"{r['slices']} x {r['slice_s']:g} | "
            f"{_fmt(r['samples_per_s'])} ({_fmt(r['reference_samples_per_s'])}) | "
            f"{r['pct_median']:.0f}% | {r['pct_pooled']:.0f}% | {lo:.0f}-{hi:.0f}% | {each} |"
        )
    return "\n".join(lines)


# ------------------------------------------------------------------ read floor
def read_floor(
    folder: Path, seq_len: int, *, passes: int = 3, limit: int = 20_000
) -> dict[str, Any]:
    """The machine's ceiling for any loader that opens each shard file once per epoch: a bare
    Python loop over (up to ``limit``) shards in a shuffled order doing what such a read
    cannot avoid, open + ``fstat`` + one ``preadv`` of the shard's windows + close, best of
    ``passes``. ``floor_samples_per_s``: samples per second if reading were all a loader
    did (every sample once per epoch)."""
    ds = _dataset("tokens", folder, seq_len, 1)
    counts = np.asarray(ds.windows_per_shard)
    offsets = np.asarray(ds._layout.offsets)
    paths = [str(folder / e.path) for e in ds.manifest.shards]
    pick = np.random.default_rng(0).permutation(len(paths))[:limit]
    nbytes = (counts[pick] * seq_len * 4).tolist()
    buf = memoryview(bytearray(max(nbytes)))
    todo = [(paths[i], int(offsets[i]), n) for i, n in zip(pick.tolist(), nbytes, strict=True)]
    best = math.inf
    for _ in range(passes):
        began = time.perf_counter()
        for path, at, n in todo:
            fd = os.open(path, os.O_RDONLY)
            try:
                os.fstat(fd)
                os.preadv(fd, [buf[:n]], at)
            finally:
                os.close(fd)
        best = min(best, time.perf_counter() - began)
    samples = int(counts[pick].sum())
    return {
        "shards": len(paths),
        "us_per_shard": 1e6 * best / len(todo),
        "floor_samples_per_s": samples / best,
    }


def parquet_floor(folder: Path, *, limit: int = 2_000) -> dict[str, Any]:
    """What a first epoch over Parquet shards cannot avoid: open each shard with pyarrow
    and decode its row group (a bare loop over up to ``limit`` shards, best of 3 rounds
    and of pyarrow's ``pre_buffer`` on and off)."""
    import pyarrow.parquet as pq

    ds = _dataset("parquet", folder, 0, 1)
    paths = [str(folder / e.path) for e in ds.manifest.shards][:limit]
    best = math.inf
    rows = 0
    for _ in range(3):
        for pre_buffer in (True, False):  # pyarrow's default, and its faster one here
            rows = 0
            began = time.perf_counter()
            for path in paths:
                reader = pq.ParquetFile(path, pre_buffer=pre_buffer)
                rows += reader.read_row_group(0, columns=["tokens"]).num_rows
            best = min(best, time.perf_counter() - began)
    return {
        "shards": len(ds.manifest.shards),
        "us_per_shard": 1e6 * best / len(paths),
        "floor_samples_per_s": rows / best,
    }


# ------------------------------------------------------------------ miss costs
def reopen_rows(tokens: Path, tables: Path | None, seq_len: int) -> list[dict[str, Any]]:
    """Seconds per read: a handle hit vs a miss (see the module docstring, item 3). The map
    + evict row needs shards of >= 3 x `MAP_MIN_ROWS` windows (read sparse: every 3rd)."""
    from detdata.datasets.shard_windows import MAP_MIN_ROWS

    rows: list[dict[str, Any]] = []
    ds = _dataset("tokens", tokens, seq_len, 1)
    starts = np.asarray(ds._layout.starts)
    counts = np.asarray(ds.windows_per_shard)
    usable = np.flatnonzero(counts >= 3 * MAP_MIN_ROWS)
    shards = (usable if usable.size else np.arange(counts.size))[:400]
    ds.read(starts[shards[:1]])
    hit = best_of(lambda: ds.read(starts[shards[:1]]), 200)

    def sweep(ids_of: Callable[[int], np.ndarray[Any, Any]]) -> float:
        with Stopwatch() as clock:
            for s in shards[1:]:
                ds.read(ids_of(int(s)))
        return clock.seconds / max(len(shards) - 1, 1)

    pread = sweep(lambda s: starts[s : s + 1])
    rows.append({"what": "tokens: 1 window, shard mapped", "us": 1e6 * hit})
    rows.append({"what": "tokens: 1 window, shard not open (preadv)", "us": 1e6 * pread})
    if usable.size > 1:
        mapped = sweep(lambda s: starts[s] + 3 * np.arange(MAP_MIN_ROWS))
        rows.append(
            {
                "what": f"tokens: {MAP_MIN_ROWS} windows, shard not open (map + evict)",
                "us": 1e6 * mapped,
            }
        )
    if tables is not None:
        for label, cap in (("open reader", None), ("re-opened reader", 1)):
            # no decoded row groups kept: every read decodes
            tr = _dataset("parquet", tables, seq_len, cap, cache_row_groups=0)
            firsts = np.asarray(tr._index.starts)[:400]
            tr.read(firsts[:1])
            with Stopwatch() as clock:
                for g in firsts[1:] if cap else np.repeat(firsts[:1], len(firsts) - 1):
                    tr.read(np.asarray([g]))
            us = 1e6 * clock.seconds / max(len(firsts) - 1, 1)
            rows.append({"what": f"parquet: 1 row decoded, {label}", "us": us})
    return rows


# ------------------------------------------------------------------ other modules
def optional_rows(smoke: bool, workdir: Path, skip_identity: bool) -> dict[str, Any]:
    """Rows from other benchmark modules, or ``"n/a"`` with the reason."""
    out: dict[str, Any] = {}
    try:
        from benchmarks import scale_identity
    except ImportError as exc:
        out["registry_rows"] = out["open_rows"] = f"n/a ({exc})"
        scale_identity = None  # type: ignore[assignment]
    if scale_identity is not None and skip_identity:
        out["registry_rows"] = out["open_rows"] = "n/a (--skip-identity)"
    elif scale_identity is not None:
        for name, kwargs in (
            ("registry_rows", {"counts": (20, 50, 100), "window": 10} if smoke else {}),
            (
                "open_rows",
                {"local_shards": (300,), "remote_shards": ()} if smoke else {},
            ),
        ):
            fn = getattr(scale_identity, name, None)
            if fn is None:
                out[name] = "n/a (not in benchmarks.scale_identity)"
                continue
            try:
                out[name] = fn(**kwargs)
            except Exception as exc:
                out[name] = f"n/a ({type(exc).__name__}: {exc})"
            except BaseException as exc:  # pytest's Skipped (no server binary): keep the run
                if isinstance(exc, (KeyboardInterrupt, SystemExit)):
                    raise
                out[name] = f"n/a ({type(exc).__name__}: {exc})"
    for module in ("scale_order", "scale_remote", "scale_reopen"):
        try:
            mod = __import__(f"benchmarks.{module}", fromlist=["rows"])
        except ImportError as exc:
            out[module] = f"n/a ({exc})"
            continue
        fn = getattr(mod, "rows", None)
        if fn is None:
            out[module] = f"n/a (benchmarks.{module} has no rows(smoke))"
            continue
        try:
            out[module] = fn(smoke)
        except Exception as exc:
            out[module] = f"n/a ({type(exc).__name__}: {exc})"
    return out


# ------------------------------------------------------------------ report
def slope(xs: Sequence[float], ys: Sequence[float]) -> float | None:
    """Least-squares slope of ``log y`` against ``log x`` (None for fewer than 2 points)."""
    pts = [(math.log(x), math.log(y)) for x, y in zip(xs, ys, strict=True) if x > 0 and y > 0]
    if len(pts) < 2:
        return None
    a = np.asarray(pts)
    return float(np.polyfit(a[:, 0], a[:, 1], 1)[0])


def _fmt(value: float | None, spec: str = ",.0f") -> str:
    return "n/a" if value is None else format(value, spec)


def _combos(results: list[dict[str, Any]], orders: Sequence[str]) -> list[tuple[str, int]]:
    """(order, workers) of the results, in the order of ``orders``, then of workers."""
    combos = sorted({(r["order"], r["workers"]) for r in results}, key=lambda c: (c[0], c[1]))
    return [c for o in orders for c in combos if c[0] == o]


def _head(title: str, columns: list[str]) -> list[str]:
    """A bold title and the header lines of a markdown table: shards, then ``columns``."""
    return [
        f"\n**{title}**\n",
        "| shards | " + " | ".join(columns) + " |",
        "|---" * (len(columns) + 1) + "|",
    ]


def growth_table(results: list[dict[str, Any]], orders: Sequence[str]) -> str:
    """Markdown: one row per (kind, shards), one samples/s column per (order, workers)."""
    combos = _combos(results, orders)
    lines = []
    for kind in ("tokens", "parquet"):
        rows = [r for r in results if r["kind"] == kind]
        if not rows:
            continue
        counts = sorted({r["shards"] for r in rows})
        head = [f"{o} w{w} samples/s (% of {FEISTEL} w{w} at {counts[0]:,})" for o, w in combos]
        lines += [
            f"\n**{kind}**\n",
            "| shards | " + " | ".join(head) + " | peak fds main/worker | "
            "peak shard maps main/worker | worker peak RSS MiB |",
            "|---" * (len(head) + 4) + "|",
        ]
        for n in counts:
            cells, measured = [], []
            for combo in combos:
                got = [r for r in rows if (r["order"], r["workers"]) == combo and r["shards"] == n]
                base = [  # the reference: feistel-v1 at the fewest shards
                    r
                    for r in rows
                    if (r["order"], r["workers"]) == (FEISTEL, combo[1])
                    and r["shards"] == counts[0]
                    and r.get("samples_per_s")
                ]
                if not got or got[0].get("samples_per_s") is None:
                    cells.append("n/a")
                    continue
                r = got[0]
                measured.append(r)
                pct = 100 * r["samples_per_s"] / base[0]["samples_per_s"] if base else None
                cells.append(f"{_fmt(r['samples_per_s'])} ({_fmt(pct, '.0f')}%)")

            def peak(key: str, of: list[dict[str, Any]] = measured) -> int:
                return max((int(r[key]) for r in of), default=0)

            rss = max((r["peak_rss_worker_mib"] for r in measured if r["workers"]), default=None)
            lines.append(
                f"| {n:,} | "
                + " | ".join(cells)
                + f" | {peak('peak_fds_main')}/{peak('peak_fds_worker')}"
                + f" | {peak('peak_shard_maps_main')}/{peak('peak_shard_maps_worker')}"
                + f" | {_fmt(rss, '.0f')} |"
            )
        exps = []
        for combo in combos:
            pts = sorted(
                (r["shards"], r["us_per_sample"])
                for r in rows
                if (r["order"], r["workers"]) == combo and r.get("us_per_sample")
            )
            exps.append(_fmt(slope([x for x, _ in pts], [y for _, y in pts]), "+.2f"))
        lines.append("| exponent (time/sample ~ shards^k) | " + " | ".join(exps) + " | | | |")
    return "\n".join(lines)


def paired_table(results: list[dict[str, Any]], orders: Sequence[str]) -> str:
    """Markdown: per (kind, shards), the median over rounds of each configuration's
    samples/s divided by the reference's (`FEISTEL` at the fewest shards, the same worker
    count) measured in the SAME round, and every round's ratio. Rounds are interleaved,
    so a slow spell of the shared machine hits a configuration and its reference alike;
    the cell tables' ratio of medians mixes spells. Empty with one round."""
    combos = _combos(results, orders)
    lines: list[str] = []
    for kind in ("tokens", "parquet"):
        rows = [r for r in results if r["kind"] == kind and r.get("rounds_samples_per_s")]
        if not rows or len(rows[0]["rounds_samples_per_s"]) < 2:
            continue
        counts = sorted({r["shards"] for r in rows})
        head = [
            f"{o} w{w}: median (rounds) % of {FEISTEL} w{w} at {counts[0]:,}" for o, w in combos
        ]
        lines += _head(f"{kind}: per-round ratios", head)
        for n in counts:
            cells = []
            for order, workers in combos:
                got = [
                    r
                    for r in rows
                    if (r["order"], r["workers"], r["shards"]) == (order, workers, n)
                ]
                ref = [
                    r
                    for r in rows
                    if (r["order"], r["workers"], r["shards"]) == (FEISTEL, workers, counts[0])
                ]
                if not got or not ref:
                    cells.append("n/a")
                    continue
                pairs = zip(
                    got[0]["rounds_samples_per_s"], ref[0]["rounds_samples_per_s"], strict=True
                )
                pct = [100 * a / b for a, b in pairs]
                each = ", ".join(f"{p:.0f}" for p in pct)
                cells.append(f"{statistics.median(pct):.0f}% ({each})")
            lines.append(f"| {n:,} | " + " | ".join(cells) + " |")
    return "\n" + "\n".join(lines) if lines else ""


def cpu_table(results: list[dict[str, Any]], orders: Sequence[str]) -> str:
    """Markdown: samples per CPU second of the main process for ``num_workers=0`` runs (the
    whole loader runs there), less sensitive than samples/s to other load on the machine."""
    rows = [r for r in results if r["workers"] == 0 and r.get("samples_per_cpu_s_main")]
    if not rows:
        return ""
    kinds = [k for k in ("tokens", "parquet") if any(r["kind"] == k for r in rows)]
    lines = []
    for kind in kinds:
        mine = [r for r in rows if r["kind"] == kind]
        counts = sorted({r["shards"] for r in mine})
        names = [o for o in orders if any(r["order"] == o for r in mine)]
        base = [r for r in mine if r["order"] == FEISTEL and r["shards"] == counts[0]]
        head = [f"{o} w0 samples/CPU-s (% of {FEISTEL} at {counts[0]:,})" for o in names]
        lines += _head(f"{kind}, CPU time of the main process (num_workers=0)", head)
        for n in counts:
            cells = []
            for o in names:
                got = [r for r in mine if r["order"] == o and r["shards"] == n]
                if not got:
                    cells.append("n/a")
                    continue
                value = got[0]["samples_per_cpu_s_main"]
                pct = 100 * value / base[0]["samples_per_cpu_s_main"] if base else None
                cells.append(f"{_fmt(value)} ({_fmt(pct, '.0f')}%)")
            lines.append(f"| {n:,} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def floor_table(floors: dict[int, dict[str, Any]], results: list[dict[str, Any]]) -> str:
    """Markdown: the bare read floor per token shard count (`read_floor`), and each
    ``num_workers=0`` loader's samples/s as a share of it."""
    if not floors:
        return ""
    names = sorted({r["order"] for r in results if r["kind"] == "tokens" and r["workers"] == 0})
    head = [f"{o} w0 (% of the floor)" for o in names]
    lines = [
        "\n\n**tokens: bare read floor (open + fstat + preadv + close per shard, once per "
        "epoch, one thread)**\n",
        "| shards | us per shard | floor samples/s | " + " | ".join(head) + " |",
        "|---" * (len(head) + 3) + "|",
    ]
    for n, f in sorted(floors.items()):
        cells = []
        for o in names:
            got = [
                r
                for r in results
                if (r["kind"], r["shards"], r["order"], r["workers"]) == ("tokens", n, o, 0)
                and r.get("samples_per_s")
            ]
            share = 100 * got[0]["samples_per_s"] / f["floor_samples_per_s"] if got else None
            cells.append(
                f"{_fmt(got[0]['samples_per_s'] if got else None)} ({_fmt(share, '.0f')}%)"
            )
        lines.append(
            f"| {n:,} | {f['us_per_shard']:.1f} | {_fmt(f['floor_samples_per_s'])} | "
            + " | ".join(cells)
            + " |"
        )
    return "\n".join(lines)


def first_epoch_table(floors: dict[int, dict[str, Any]], results: list[dict[str, Any]]) -> str:
    """Markdown: Parquet first epochs (every row group decoded once) against the bare
    pyarrow open + decode floor (`parquet_floor`)."""
    rows = [r for r in results if r["kind"] == "parquet" and r.get("first_epoch_samples_per_s")]
    if not rows or not floors:
        return ""
    combos = sorted({(r["order"], r["workers"]) for r in rows})
    head = [f"{o} w{w} first epoch samples/s (% of the floor)" for o, w in combos]
    lines = [
        "\n\n**parquet: first epoch (each shard opened and its row group decoded once) "
        "against a bare pyarrow loop doing only that**\n",
        "| shards | floor us per shard | floor samples/s | " + " | ".join(head) + " |",
        "|---" * (len(head) + 3) + "|",
    ]
    for n, f in sorted(floors.items()):
        cells = []
        for o, w in combos:
            got = [r for r in rows if (r["shards"], r["order"], r["workers"]) == (n, o, w)]
            rate = got[0]["first_epoch_samples_per_s"] if got else None
            share = 100 * rate / f["floor_samples_per_s"] if rate else None
            cells.append(f"{_fmt(rate)} ({_fmt(share, '.0f')}%)")
        lines.append(
            f"| {n:,} | {f['us_per_shard']:.0f} | {_fmt(f['floor_samples_per_s'])} | "
            + " | ".join(cells)
            + " |"
        )
    return "\n".join(lines)


def plot(results: list[dict[str, Any]], path: Path) -> bool:
    """``scale.png``: samples/s against shards (log-log), one line per (kind, order, workers);
    False when matplotlib is not installed."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for key in sorted({(r["kind"], r["order"], r["workers"]) for r in results}):
        pts = sorted(
            (r["shards"], r["samples_per_s"])
            for r in results
            if (r["kind"], r["order"], r["workers"]) == key and r.get("samples_per_s")
        )
        if pts:
            ax.plot(*zip(*pts, strict=True), marker="o", label=f"{key[0]} {key[1]} w{key[2]}")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("shards (same total bytes)")
    ax.set_ylabel("samples/s")
    ax.set_title("detdata.DataLoader throughput vs number of shards")
    ax.legend(fontsize=7)
    ax.grid(True, which="both", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


# ------------------------------------------------------------------ main
def _ints(text: str) -> tuple[int, ...]:
    return tuple(int(x) for x in text.split(",") if x.strip())


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--smoke", action="store_true", help="tiny sizes, short budget (CI)")
    p.add_argument("--shards", type=_ints, help=f"token shard counts (default {SHARDS})")
    p.add_argument("--parquet-shards", type=_ints, help=f"default {PARQUET_SHARDS}; '' skips")
    p.add_argument("--samples", type=int, help="token windows in total (default 200,000)")
    p.add_argument("--seq-len", type=int, help="tokens per window (default 512)")
    p.add_argument("--rows", type=int, help="Parquet rows in total (default 100,000)")
    p.add_argument("--width", type=int, default=128, help="tokens per Parquet row")
    p.add_argument("--workers", type=_ints, default=(0, 2), help="num_workers values")
    p.add_argument("--worker-mode", default="process", choices=("process", "thread"))
    p.add_argument("--batch", type=int, default=64, help="global batch size")
    p.add_argument("--budget", type=float, help="timed seconds per run (default 4)")
    p.add_argument("--rounds", type=int, help="interleaved runs of each config (default 3)")
    p.add_argument(
        "--slices", type=int, help="alternating slices per candidate (default 12; smoke 2; 0 skips)"
    )
    p.add_argument("--slice-s", type=float, help="timed seconds per slice (default 1.5)")
    p.add_argument(
        "--slice-shards",
        type=int,
        help="token candidates' shard count (default 50,000 or the largest)",
    )
    p.add_argument(
        "--slice-kinds",
        type=lambda t: tuple(k for k in t.split(",") if k),
        default=("tokens", "parquet"),
        help="kinds measured in alternating slices (default tokens,parquet)",
    )
    p.add_argument("--max-open-shards", type=int, help="TokenWindows/TableRows bound")
    p.add_argument("--order", help="name of the locality-aware order (default: detected)")
    p.add_argument("--data-dir", default="/tmp/detdata-scale", help="generated shards")
    p.add_argument("--out", default=str(Path(__file__).parent / "results"))
    p.add_argument("--skip-identity", action="store_true", help="no scale_identity rows")
    p.add_argument("--from-json", metavar="FILE", help="only print the table of a scale.json")
    return p.parse_args(argv)


def run_slices(
    args: argparse.Namespace,
    folders: dict[tuple[str, int], Path],
    orders: dict[str, Callable[[Any, int], Any] | None],
    *,
    seq_len: int,
    smoke: bool,
) -> list[dict[str, Any]]:
    """`paired_slices` for each kind (``--slice-kinds``) and worker count: every order at
    ``--slice-shards`` token shards (at every Parquet shard count but the fewest) against
    `FEISTEL` at the fewest shards of that kind."""
    slices = args.slices if args.slices is not None else (2 if smoke else 12)
    rows: list[dict[str, Any]] = []
    feistel = orders[FEISTEL]
    assert feistel is not None
    for kind in args.slice_kinds:
        counts = sorted(n for k, n in folders if k == kind)
        if slices <= 0 or len(counts) < 2:
            continue
        targets = counts[1:]  # Parquet: every count but the reference's
        if kind == "tokens":
            targets = [args.slice_shards or (50_000 if 50_000 in counts else counts[-1])]
        cands = {
            f"{name} at {target:,}": (folders[(kind, target)], make)
            for target in targets
            for name, make in orders.items()
            if make is not None
        }
        for workers in args.workers:
            got = paired_slices(
                (folders[(kind, counts[0])], feistel),
                cands,
                kind=kind,
                workers=workers,
                slices=slices,
                seconds=args.slice_s or (0.2 if smoke else 1.5),
                width=seq_len if kind == "tokens" else args.width,
                batch=args.batch,
                max_open=args.max_open_shards,
            )
            for row in got:
                print(
                    f"slices {kind} w{workers} {row['candidate']}: median "
                    f"{row['pct_median']:.0f}%, pooled {row['pct_pooled']:.0f}% of {FEISTEL} at "
                    f"{counts[0]:,} (each: {', '.join(f'{p:.0f}' for p in row['pct_each'])})",
                    flush=True,
                )
            rows += got
    return rows


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    if args.from_json:
        doc = json.loads(Path(args.from_json).read_text())
        names = list(dict.fromkeys(r["order"] for r in doc["results"]))
        print(growth_table(doc["results"], names))
        print(paired_table(doc["results"], names))
        print(cpu_table(doc["results"], names))
        print(slices_table(doc.get("slices", [])))
        return 0
    smoke = args.smoke
    shards = args.shards or (SMOKE_SHARDS if smoke else SHARDS)
    pq_shards = (
        args.parquet_shards
        if args.parquet_shards is not None
        else (SMOKE_PARQUET if smoke else PARQUET_SHARDS)
    )
    samples = args.samples or (4_000 if smoke else 200_000)
    seq_len = args.seq_len or (64 if smoke else 512)
    rows_total = args.rows or (2_000 if smoke else 100_000)
    budget = args.budget or (0.3 if smoke else 4.0)
    data = Path(args.data_dir) / ("smoke" if smoke else "full")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    orders = order_factories(args.order)
    print(f"orders: {', '.join(k + ('' if v else ' (n/a)') for k, v in orders.items())}")

    results: list[dict[str, Any]] = []
    builds: dict[str, float] = {}
    folders: dict[tuple[str, int], Path] = {}
    for n in shards:
        folder, secs = write_tokens(data, TokenSpec(samples, seq_len, n))
        folders[("tokens", n)] = folder
        builds[f"tokens-{n}"] = secs
    for n in pq_shards:
        folder, secs = write_tables(data, TableSpec(rows_total, args.width, n))
        folders[("parquet", n)] = folder
        builds[f"parquet-{n}"] = secs
    rounds = args.rounds or (1 if smoke else 3)
    measured: dict[tuple[str, int, str, int], list[dict[str, Any]]] = {}
    for r in range(rounds):  # interleaved: a slow spell of the machine hits every config
        for (kind, n), folder in folders.items():
            width = seq_len if kind == "tokens" else args.width
            for name, make in orders.items():
                for workers in args.workers:
                    if make is None:
                        continue
                    run = Run(kind, n, name, workers, args.worker_mode)
                    row = measure(
                        run,
                        folder,
                        make,
                        width=width,
                        batch=args.batch,
                        budget=budget,
                        max_open=args.max_open_shards,
                    )
                    measured.setdefault((kind, n, name, workers), []).append(row)
                    print(
                        f"round {r + 1}/{rounds} {kind:8s} {n:>7,} shards {name:12s} "
                        f"w{workers}: {row['samples_per_s']:>11,.0f} samples/s  fds "
                        f"{row['peak_fds_main']}/{row['peak_fds_worker']}  shard maps "
                        f"{row['peak_shard_maps_main']}/{row['peak_shard_maps_worker']}  "
                        f"worker RSS {row['peak_rss_worker_mib']:.0f} MiB  "
                        f"({_fmt(row['samples_per_cpu_s_main'])} samples/CPU-s of the main "
                        "process)",
                        flush=True,
                    )
    for (kind, n), _ in folders.items():
        for name, make in orders.items():
            for workers in args.workers:
                if make is None:
                    run = Run(kind, n, name, workers, args.worker_mode)
                    results.append({**asdict(run), "samples_per_s": None})
                    continue
                results.append(median_row(measured[(kind, n, name, workers)]))
    sliced = run_slices(args, folders, orders, seq_len=seq_len, smoke=smoke)
    floors = {
        n: read_floor(folder, seq_len) for (kind, n), folder in folders.items() if kind == "tokens"
    }
    pq_floors = {
        n: parquet_floor(folder) for (kind, n), folder in folders.items() if kind == "parquet"
    }
    for what, got in (("tokens", floors), ("parquet", pq_floors)):
        for n, f in got.items():
            print(
                f"{what} read floor {n:>7,} shards: {f['us_per_shard']:.1f} us per shard, "
                f"{f['floor_samples_per_s']:,.0f} samples/s",
                flush=True,
            )
    bound = args.max_open_shards or DEFAULT_MAX_OPEN_SHARDS
    above = [n for n in shards if n > bound] or [max(shards)]
    tables_largest = folders.get(("parquet", max(pq_shards))) if pq_shards else None
    misses = reopen_rows(folders[("tokens", min(above))], tables_largest, seq_len)
    others = optional_rows(smoke, data / "work", args.skip_identity)

    import detdata

    table = (
        growth_table(results, list(orders))
        + paired_table(results, list(orders))
        + floor_table(floors, results)
        + first_epoch_table(pq_floors, results)
        + slices_table(sliced)
    )
    cpu = cpu_table(results, list(orders))
    doc = {
        "detdata": detdata.__version__,
        "python": platform.python_version(),
        "machine": f"{platform.machine()}, {os.cpu_count()} CPUs",
        "smoke": smoke,
        "spec": {
            "samples": samples,
            "seq_len": seq_len,
            "parquet_rows": rows_total,
            "parquet_width": args.width,
            "batch": args.batch,
            "budget_s": budget,
            "max_open_shards": args.max_open_shards,
        },
        "manifest_build_s": builds,
        "rounds": rounds,
        "results": results,
        "slices": sliced,
        "read_floor": {str(n): f for n, f in floors.items()},
        "parquet_first_epoch_floor": {str(n): f for n, f in pq_floors.items()},
        "miss_costs": misses,
        "others": others,
        "table": table,
        "cpu_table": cpu,
    }
    (out / "scale.json").write_text(json.dumps(doc, indent=1, default=str))
    plotted = plot(results, out / "scale.png")
    print(f"\n# Scale (shards)\n{table}\n")
    if cpu:
        print(f"{cpu}\n")
    print("| handle miss cost | us per read |\n|---|---|")
    for row in misses:
        print(f"| {row['what']} | {row['us']:.1f} |")
    for name, value in others.items():
        print(f"\n{name}: {json.dumps(value, default=str)[:2000]}")
    print(f"\nwrote {out / 'scale.json'}" + (f" and {out / 'scale.png'}" if plotted else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
