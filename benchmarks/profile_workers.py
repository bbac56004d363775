"""Why process workers lose on small batches: time the transfer alone, profile the main process.

``python -m benchmarks.profile_workers [--batches N] [--kb 128]`` prints, per
batch of ``--kb`` KiB (default 128 KiB = 64 samples x 2 KiB):

* ``produce``: making the batch in-process (a copy of a preallocated buffer);
* ``workers=0``: the torch DataLoader around the same map-style "dataset";
* ``workers=2``: the same through two worker processes (pickle, a shared
  memory segment per tensor, a file descriptor passed over a socket, queues);
* the same with a numpy array instead of a tensor (pickled by value), and with
  torch's ``file_system`` sharing strategy (no file descriptor passing);
* ``threads=2``: `detdata.loading.threads.threaded_batches` doing the same work;

and the top functions of a cProfile of the main process for ``workers=2``.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import torch
import torch.utils.data as tud

from benchmarks.timing import mean_of, profile


class Copies(tud.Dataset[Any]):
    """Index -> a fresh copy of a ``nbytes`` buffer (as a tensor or an ndarray)."""

    def __init__(self, nbytes: int, as_tensor: bool) -> None:
        self.src = np.arange(nbytes // 4, dtype=np.int32).reshape(64, -1)
        self.as_tensor = as_tensor

    def __len__(self) -> int:
        return 1 << 30

    def __getitem__(self, index: int) -> Any:
        out = self.src.copy()
        return torch.from_numpy(out) if self.as_tensor else out


def _identity(batch: Any) -> Any:
    return batch


def per_batch_us(it: Iterator[Any], batches: int) -> float:
    """Mean microseconds per ``next(it)`` over ``batches`` batches (the first one, startup,
    excluded)."""
    return mean_of(lambda: next(it), batches, warmup=1) * 1e6


def loader(nbytes: int, workers: int, as_tensor: bool) -> Iterator[Any]:
    dl = tud.DataLoader(
        Copies(nbytes, as_tensor),
        batch_size=None,
        num_workers=workers,
        collate_fn=_identity,
        prefetch_factor=4 if workers else None,
    )
    return iter(dl)


def threads(nbytes: int, n: int) -> Iterator[Any]:
    from detdata.loading.threads import threaded_batches

    ds = Copies(nbytes, True)
    fetch: Callable[[np.ndarray], Any] = lambda pos: ds[int(pos[0])]  # noqa: E731
    positions = (np.arange(k, k + 1) for k in range(1 << 30))
    return threaded_batches(fetch, positions, num_threads=n, ahead=2 * n)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--batches", type=int, default=2000)
    p.add_argument("--kb", type=int, default=128)
    args = p.parse_args(argv)
    nbytes, n = args.kb * 1024, args.batches
    torch.set_num_threads(1)
    ds = Copies(nbytes, True)
    rows = {"produce (in-process copy)": mean_of(lambda: ds[0], n, warmup=0) * 1e6}
    rows["torch DataLoader workers=0"] = per_batch_us(loader(nbytes, 0, True), n)
    rows["torch DataLoader workers=2, tensor"] = per_batch_us(loader(nbytes, 2, True), n)
    rows["torch DataLoader workers=2, ndarray"] = per_batch_us(loader(nbytes, 2, False), n)
    torch.multiprocessing.set_sharing_strategy("file_system")  # type: ignore[no-untyped-call]
    rows["workers=2, tensor, sharing 'file_system'"] = per_batch_us(loader(nbytes, 2, True), n)
    torch.multiprocessing.set_sharing_strategy("file_descriptor")  # type: ignore[no-untyped-call]
    rows["threaded_batches threads=2"] = per_batch_us(threads(nbytes, 2), n)
    print(f"per batch of {args.kb} KiB, {n} batches:")
    for name, us in rows.items():
        print(f"  {name:40s} {us:8.1f} us  ({nbytes / us:7.0f} MB/s)")
    it = loader(nbytes, 2, True)
    next(it)
    text = profile(lambda: next(it), n, top=12)
    print("main process, workers=2 (tottime):")
    print(text[:4000])
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
