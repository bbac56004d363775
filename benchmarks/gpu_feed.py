"""Feeding an accelerator: detdata's device path vs raw pinned copies and torch's DataLoader.

Run: ``python benchmarks/gpu_feed.py [--device cuda|cpu] [--smoke] [--out FILE]``.
``--device cpu`` (the default without CUDA) runs a small smoke version of the
same code: staging buffers are unpinned and "device copies" are plain clones, so
its numbers say the code runs, not how a GPU is fed.

(a) Bandwidth. The same bytes (``--sizes-mib`` per batch) moved to the device by
    * ``detdata``: `device_batches` over pageable CPU batches (host memcpy into
      the reused pinned buffers + ``non_blocking`` copy on the copy stream),
    * ``raw_pinned``: ``t.to(device, non_blocking=True)`` of an already-pinned
      tensor (pure DMA: the upper bound),
    * ``pageable``: ``t.to(device)`` of the pageable CPU batch (the naive way).
(b) Training feed. A synthetic step (embedding lookup of the batch's tokens,
    then ``--matmul-iters`` [d x d] matmuls; synchronised every ``--sync-every``
    steps, like logging ``loss.item()``) fed by
    * ``vanilla``: ``torch.utils.data.DataLoader`` over per-sample windows of the
      same ``.npy`` shards, shuffled, ``pin_memory=True`` (on CUDA), then
      ``.to(device, non_blocking=True)``,
    * ``detdata_pin``: `detdata.DataLoader` with ``pin_memory=True`` and the same
      manual ``.to``,
    * ``detdata_device``: `detdata.DataLoader` with ``DeviceFeed(device=..., copies_ahead=...)``.
    ``wait_frac`` = 1 - (time of the same steps on a batch already on the device)
    / (time with the loader): the fraction of step time spent waiting for data.
    ``host_next_frac`` = host time inside ``next()`` / total time (hidden when
    the GPU queue is deep, so ``wait_frac`` is the one that matters).

Prints a table and writes JSON (default ``benchmarks/results/gpu_feed.json``).
"""

from __future__ import annotations

import argparse
import itertools
import json
import platform
import sys
import tempfile
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.utils.data as tud

if not __package__:  # run as ``python benchmarks/gpu_feed.py``: benchmarks.* from this checkout
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import detdata
from benchmarks.timing import Stopwatch, best_of, middle
from detdata.loading.device import PinnedBufferPool, check_device, device_batches

DEFAULT_OUT = Path(__file__).resolve().parent / "results" / "gpu_feed.json"


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


# ------------------------------------------------------------- (a) bandwidth
def drain(items: Iterable[object]) -> None:
    for _ in items:
        pass


def best_on(device: torch.device, fn: Callable[[], object]) -> float:
    """Shortest wall time of 3 calls of ``fn``, device work included."""
    return best_of(fn, 3, sync=lambda: sync(device))


def bandwidth(device: torch.device, size_mib: int, total_mib: int, depth: int) -> dict[str, Any]:
    """GB/s of the three ways to move ``total_mib`` in batches of ``size_mib`` to ``device``."""
    count = max(4, total_mib // size_mib)
    numel = size_mib * 2**20 // 8
    sources = [torch.arange(numel, dtype=torch.int64) * (i + 1) for i in range(4)]  # pageable

    def batches() -> Iterator[dict[str, torch.Tensor]]:
        return ({"tokens": sources[i % 4]} for i in range(count))

    nbytes = count * numel * 8

    pool = PinnedBufferPool(depth + 1, pin=device.type == "cuda")
    last: Any = None
    for b in device_batches(batches(), device, depth, pool=pool):  # warm-up: allocates the pool
        last = b
    t_detdata = best_on(device, lambda: drain(device_batches(batches(), device, depth, pool=pool)))
    if not torch.equal(last["tokens"].cpu(), sources[(count - 1) % 4]):
        raise RuntimeError("detdata device path delivered wrong bytes in the bandwidth test")

    cuda = device.type == "cuda"
    pinned = sources[0].pin_memory() if cuda else sources[0].clone()

    def move(t: torch.Tensor) -> torch.Tensor:  # the raw path: one async copy of pinned bytes
        return t.to(device, non_blocking=True) if cuda else t.clone()

    def plain(t: torch.Tensor) -> torch.Tensor:  # the naive path: a blocking pageable copy
        return t.to(device) if cuda else t.clone()

    move(pinned)
    t_raw = best_on(device, lambda: drain(move(pinned) for _ in range(count)))
    t_pageable = best_on(device, lambda: drain(plain(sources[i % 4]) for i in range(count)))
    return {
        "batch_mib": size_mib,
        "batches": count,
        "bytes": nbytes,
        "detdata_gbps": nbytes / t_detdata / 1e9,
        "raw_pinned_gbps": nbytes / t_raw / 1e9,
        "pageable_gbps": nbytes / t_pageable / 1e9,
        "detdata_over_raw": t_raw / t_detdata,
        "pool_allocations": pool.allocations,
    }


# --------------------------------------------------------------- (b) feeding
def write_shards(root: Path, shards: int, tokens: int) -> list[Path]:
    rng = np.random.default_rng(0)
    root.mkdir(parents=True, exist_ok=True)
    paths = []
    for i in range(shards):
        path = root / f"shard-{i:03d}.npy"
        np.save(path, rng.integers(0, 50_000, size=tokens, dtype=np.uint16))
        paths.append(path)
    return paths


def detdata_dataset(root: Path, seq_len: int) -> detdata.TokenWindows:
    """`TokenWindows` (``seq_len`` + 1 tokens per sample) over the shards in ``root``."""
    return detdata.TokenWindows(detdata.build_manifest(str(root), progress=False), seq_len)


class VanillaWindows(tud.Dataset[torch.Tensor]):
    """Per-sample windows (seq_len + 1 tokens) from memory-mapped ``.npy`` shards."""

    def __init__(self, paths: list[Path], seq_len: int) -> None:
        self.paths, self.seq_len = paths, seq_len
        lengths = [len(np.load(p, mmap_mode="r")) for p in paths]
        self.counts = np.array([(n - 1) // seq_len for n in lengths])
        self.starts = np.concatenate([[0], np.cumsum(self.counts)])
        self._arrays: list[np.ndarray] | None = None

    def __len__(self) -> int:
        return int(self.starts[-1])

    def __getitem__(self, i: int) -> torch.Tensor:
        if self._arrays is None:
            self._arrays = [np.load(p, mmap_mode="r") for p in self.paths]
        shard = int(np.searchsorted(self.starts, i, side="right") - 1)
        off = (i - int(self.starts[shard])) * self.seq_len
        return torch.from_numpy(self._arrays[shard][off : off + self.seq_len + 1].astype(np.int32))


class Step:
    """Embedding lookup + ``iters`` matmuls of ``d x d``: compute of tunable cost per batch."""

    def __init__(self, device: torch.device, vocab: int, d: int, iters: int) -> None:
        dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
        g = torch.Generator(device="cpu").manual_seed(0)
        self.emb = (torch.randn(vocab, d, generator=g) * 0.02).to(device, dtype)
        self.w = (torch.randn(d, d, generator=g) / d**0.5).to(device, dtype)
        self.iters = iters

    def __call__(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.emb[tokens[:, :-1].long()]
        for _ in range(self.iters):
            h = torch.tanh(h @ self.w)
        return h.float().mean()


def timed(
    batches: Iterator[torch.Tensor], step: Step, steps: int, sync_every: int, device: torch.device
) -> dict[str, float]:
    """Wall time of ``steps`` steps fed by ``batches``, and the host time spent in ``next()``."""
    total, waited = Stopwatch(), Stopwatch()
    sync(device)
    with total:
        for i in range(steps):
            with waited:
                tokens = next(batches)
            loss = step(tokens)
            if (i + 1) % sync_every == 0:
                loss.item()
        sync(device)
    return {
        "total_s": total.seconds,
        "step_ms": 1e3 * total.seconds / steps,
        "host_next_frac": waited.seconds / total.seconds,
    }


Makers = dict[str, Callable[[], Iterator[torch.Tensor]]]


def loaders(
    args: argparse.Namespace, device: torch.device, paths: list[Path], data: detdata.TokenWindows
) -> Makers:
    """Name -> a fresh iterator of device batches, for each loader compared."""
    pin = device.type == "cuda"
    workers = args.workers
    common = {
        "global_batch_size": args.batch,
        "seed": 1,
        "num_workers": workers,
        "persistent_workers": workers > 0,
    }

    def to_dev(it: Any) -> Iterator[torch.Tensor]:
        for b in it:
            t = b["tokens"] if isinstance(b, dict) else b
            yield t.to(device, non_blocking=pin)

    def vanilla() -> Iterator[torch.Tensor]:
        ds = VanillaWindows(paths, args.seq_len)
        sampler = tud.RandomSampler(
            ds, replacement=True, num_samples=10**9, generator=torch.Generator().manual_seed(1)
        )
        loader = tud.DataLoader(
            ds,
            batch_size=args.batch,
            sampler=sampler,
            num_workers=workers,
            pin_memory=pin,
            persistent_workers=workers > 0,
        )
        return to_dev(loader)

    def detdata_pin() -> Iterator[torch.Tensor]:
        return to_dev(detdata.DataLoader(data, pin_memory=pin, **common))

    def detdata_device() -> Iterator[torch.Tensor]:
        dl = detdata.DataLoader(
            data,
            options=detdata.LoaderOptions(
                device=detdata.DeviceFeed(device=device, copies_ahead=args.depth)
            ),
            **common,
        )
        return (b["tokens"] for b in dl)

    return {"vanilla": vanilla, "detdata_pin": detdata_pin, "detdata_device": detdata_device}


def rounds(
    iterators: dict[str, Iterator[torch.Tensor]],
    step: Step,
    args: argparse.Namespace,
    device: torch.device,
) -> dict[str, list[dict[str, float]]]:
    """Warm every iterator up (untimed), then time ``args.rounds`` interleaved rounds of each."""
    for it in iterators.values():  # worker start-up, pool allocation, kernels: untimed
        for _ in range(args.warmup):
            step(next(it))
    sync(device)
    runs: dict[str, list[dict[str, float]]] = {name: [] for name in iterators}
    names = list(iterators)
    for rnd in range(args.rounds):  # interleaved rounds, rotating order: fair under noise
        for name in names[rnd % len(names) :] + names[: rnd % len(names)]:
            runs[name].append(timed(iterators[name], step, args.steps, args.sync_every, device))
    for it in iterators.values():
        close = getattr(it, "close", None)
        if close is not None:
            close()
    return runs


def feed_row(
    iters: int, runs: dict[str, list[dict[str, float]]], names: Iterable[str]
) -> dict[str, Any]:
    """The median round of each loader (by total time) and its wait fraction against ideal."""
    med = {name: middle(rs, key=lambda r: r["total_s"]) for name, rs in runs.items()}
    row: dict[str, Any] = {"matmul_iters": iters, "ideal_step_ms": med["ideal"]["step_ms"]}
    for name in names:
        r: dict[str, Any] = dict(med[name])
        r["wait_frac"] = max(0.0, 1.0 - med["ideal"]["total_s"] / r["total_s"])
        r["all_step_ms"] = [x["step_ms"] for x in runs[name]]
        row[name] = r
    row["detdata_device_speedup_vs_vanilla"] = (
        med["vanilla"]["total_s"] / med["detdata_device"]["total_s"]
    )
    return row


def feed(args: argparse.Namespace, device: torch.device, root: Path) -> dict[str, Any]:
    paths = write_shards(root, args.shards, args.shard_tokens)
    data = detdata_dataset(root, args.seq_len)
    makers = loaders(args, device, paths, data)
    resident = torch.from_numpy(np.ascontiguousarray(data.read(np.arange(args.batch))["tokens"]))
    resident = resident.to(device)
    results: list[dict[str, Any]] = []
    for iters in args.matmul_iters:
        step = Step(device, 50_000, args.d_model, iters)
        iterators: dict[str, Iterator[torch.Tensor]] = {"ideal": itertools.repeat(resident)}
        iterators.update((name, make()) for name, make in makers.items())
        results.append(feed_row(iters, rounds(iterators, step, args, device), makers))
    return {"dataset": "TokenWindows", "rows": results}


# ------------------------------------------------------------------- main
SMALL = {
    "sizes_mib": [1, 8],
    "total_mib": 64,
    "matmul_iters": [1, 8],
    "d_model": 128,
    "seq_len": 128,
    "batch": 4,
    "steps": 40,
    "warmup": 5,
    "workers": 0,
    "shards": 2,
    "shard_tokens": 200_000,
}
FULL = {
    "sizes_mib": [4, 64],
    "total_mib": 2048,
    "matmul_iters": [2, 16],
    "d_model": 2048,
    "seq_len": 2048,
    "batch": 8,
    "steps": 200,
    "warmup": 20,
    "workers": 4,
    "shards": 8,
    "shard_tokens": 4_000_000,
}


def parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--smoke", action="store_true", help="small sizes (implied by --device cpu)")
    p.add_argument("--out", type=Path, default=DEFAULT_OUT)
    p.add_argument("--depth", type=int, default=2, help="device_prefetch")
    p.add_argument("--sizes-mib", type=int, nargs="+")
    p.add_argument("--total-mib", type=int)
    p.add_argument("--matmul-iters", type=int, nargs="+")
    p.add_argument("--d-model", type=int)
    p.add_argument("--seq-len", type=int)
    p.add_argument("--batch", type=int)
    p.add_argument("--steps", type=int)
    p.add_argument("--warmup", type=int)
    p.add_argument("--workers", type=int)
    p.add_argument("--sync-every", type=int, default=10)
    p.add_argument(
        "--rounds", type=int, default=3, help="interleaved timing rounds (median reported)"
    )
    p.add_argument("--shards", type=int)
    p.add_argument("--shard-tokens", type=int)
    args = p.parse_args(argv)
    args.smoke = args.smoke or torch.device(args.device).type == "cpu"
    for key, value in (SMALL if args.smoke else FULL).items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    return args


def environment(device: torch.device, smoke: bool) -> dict[str, Any]:
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor()
    return {
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "python": platform.python_version(),
        "platform": platform.platform(),
        "device": str(device),
        "device_name": name,
        "smoke": smoke,
    }


def print_bandwidth(bw: list[dict[str, Any]]) -> None:
    print("\n(a) host-to-device bandwidth, GB/s")
    print(
        f"{'batch MiB':>10} {'detdata':>9} {'raw pinned':>11} {'pageable':>9} "
        f"{'detdata/raw':>12} {'pool allocs':>12}"
    )
    for r in bw:
        print(
            f"{r['batch_mib']:>10} {r['detdata_gbps']:>9.2f} {r['raw_pinned_gbps']:>11.2f} "
            f"{r['pageable_gbps']:>9.2f} {r['detdata_over_raw']:>12.2f} "
            f"{r['pool_allocations']:>12}"
        )


def print_feed(fd: dict[str, Any], args: argparse.Namespace) -> None:
    print(
        f"\n(b) training feed ({fd['dataset']}, batch {args.batch} x {args.seq_len + 1} tokens, "
        f"d={args.d_model}, {args.steps} steps, workers={args.workers}, "
        f"sync every {args.sync_every})"
    )
    print(
        f"{'matmuls':>8} {'ideal ms':>9} {'loader':>15} {'step ms':>8} {'wait frac':>10} "
        f"{'host next':>10}"
    )
    for row in fd["rows"]:
        for name in ("vanilla", "detdata_pin", "detdata_device"):
            r = row[name]
            print(
                f"{row['matmul_iters']:>8} {row['ideal_step_ms']:>9.3f} {name:>15} "
                f"{r['step_ms']:>8.3f} {r['wait_frac']:>10.3f} {r['host_next_frac']:>10.3f}"
            )
        speedup = row["detdata_device_speedup_vs_vanilla"]
        print(f"{'':>8} detdata_device speedup vs vanilla: {speedup:.2f}x")


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse(argv)
    device = check_device(args.device)
    env = environment(device, args.smoke)
    print(
        f"# gpu_feed on {env['device_name'] or device} (torch {torch.__version__}, "
        f"smoke={args.smoke})"
    )
    bw = [bandwidth(device, size, args.total_mib, args.depth) for size in args.sizes_mib]
    print_bandwidth(bw)
    with tempfile.TemporaryDirectory(prefix="gpu_feed_") as tmp:
        fd = feed(args, device, Path(tmp) / "data")
    print_feed(fd, args)
    plain_args = {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()}
    result = {"env": env, "args": plain_args, "bandwidth": bw, "feed": fd}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"\nwrote {args.out}")
    return result


if __name__ == "__main__":
    main()
