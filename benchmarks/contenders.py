"""One benchmark run in this (child) process: build a loader, time it, validate what it delivers.

Run by `benchmarks.throughput` as ``python -m benchmarks.contenders SPEC_JSON``;
writes one JSON result to ``spec["out"]``. Contenders:

* ``vanilla``: ``torch.utils.data.DataLoader(shuffle=True)`` over a map-style
  dataset whose ``__getitem__`` reads ONE sample (a row of an ``np.load(mmap_mode="r")``
  shard, or one row of a pyarrow table read from Parquet), default collate.
* ``vanilla-batched``: the same DataLoader, the dataset has a hand-written
  batched ``__getitems__`` (one numpy gather / one ``take`` per shard).
* ``stateful``: torchdata ``StatefulDataLoader`` over the per-sample dataset.
* ``detdata``: ``detdata.DataLoader`` over ``TokenWindows`` / ``TableRows``.
* ``detdata-threads``: ``detdata.DataLoader`` with ``ReadOptions(worker_mode="thread")``: a
  thread pool in the main process instead of worker processes.

Timing excludes imports; the timed loop only copies each row's first token (full checks run
after it, untimed, on the warm-up and 64 validation batches).
"""

from __future__ import annotations

import bisect
import gc
import itertools
import json
import os
import resource
import sys
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt
import torch
import torch.utils.data as tud

from benchmarks.bench_data import SEQ, check_epochs, check_rows, data_files, shuffle_scores
from benchmarks.timing import Stopwatch

CONTENDERS = ("vanilla", "vanilla-batched", "stateful", "detdata", "detdata-threads")
MIN_BATCHES = 16  # a throughput run measures at least this many batches after the first
VALIDATE_BATCHES = 64  # batches checked token by token after the timed loop (untimed)

warnings.filterwarnings("ignore", message="The given NumPy array is not writable")


# ----------------------------------------------------------------- vanilla datasets
class NpySamples(tud.Dataset[Any]):
    """One window per ``__getitem__`` from ``np.load(mmap_mode="r")`` shards (opened lazily)."""

    def __init__(self, paths: list[Path]) -> None:
        self.paths = [str(p) for p in paths]
        counts = [int(np.load(p, mmap_mode="r").shape[0]) // SEQ for p in self.paths]
        self.starts = list(itertools.accumulate([0, *counts[:-1]]))
        self.n = sum(counts)
        self.arrays: list[np.ndarray[Any, Any]] | None = None

    def _open(self) -> list[np.ndarray[Any, Any]]:
        if self.arrays is None:
            self.arrays = [np.load(p, mmap_mode="r").reshape(-1, SEQ) for p in self.paths]
        return self.arrays

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, index: int) -> np.ndarray[Any, Any]:
        arrays = self._open()
        shard = bisect.bisect_right(self.starts, index) - 1
        return np.array(arrays[shard][index - self.starts[shard]])


class NpyBatched(NpySamples):
    """`NpySamples` plus a hand-written ``__getitems__``: one fancy-index gather per shard."""

    def __getitems__(self, indices: list[int]) -> torch.Tensor:
        arrays = self._open()
        idx = np.asarray(indices, dtype=np.int64)
        shard = np.searchsorted(np.asarray(self.starts), idx, side="right") - 1
        out = np.empty((idx.size, SEQ), dtype=np.int32)
        for s in np.unique(shard):
            mask = shard == s
            out[mask] = arrays[int(s)][idx[mask] - self.starts[int(s)]]
        return torch.from_numpy(out)


class ParquetSamples(tud.Dataset[Any]):
    """One row per ``__getitem__`` from pyarrow tables read (memory-mapped) from the shards.

    The Arrow-table-per-shard approach (as in HF datasets): tables are read once
    per process, then each sample is one ``ListScalar`` -> numpy conversion.
    """

    def __init__(self, paths: list[Path]) -> None:
        import pyarrow.parquet as pq

        self.paths = [str(p) for p in paths]
        counts = [int(pq.ParquetFile(p).metadata.num_rows) for p in self.paths]
        self.starts = list(itertools.accumulate([0, *counts[:-1]]))
        self.n = sum(counts)
        self.columns: list[Any] | None = None

    def _open(self) -> list[Any]:
        if self.columns is None:
            import pyarrow.parquet as pq

            self.columns = [
                pq.read_table(p, columns=["tokens"], memory_map=True).column("tokens")
                for p in self.paths
            ]
        return self.columns

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, index: int) -> np.ndarray[Any, Any]:
        columns = self._open()
        shard = bisect.bisect_right(self.starts, index) - 1
        return np.array(columns[shard][index - self.starts[shard]].values.to_numpy())


class ParquetBatched(ParquetSamples):
    """`ParquetSamples` plus a hand-written ``__getitems__``: one ``take`` per shard.

    Each shard's column is combined into one chunk when opened (``take`` on a
    many-chunk column would concatenate the chunks on every call).
    """

    def _open(self) -> list[Any]:
        if self.columns is None:
            self.columns = [c.combine_chunks() for c in super()._open()]
        return self.columns

    def __getitems__(self, indices: list[int]) -> torch.Tensor:
        import pyarrow as pa

        columns = self._open()
        idx = np.asarray(indices, dtype=np.int64)
        shard = np.searchsorted(np.asarray(self.starts), idx, side="right") - 1
        out = np.empty((idx.size, SEQ), dtype=np.int32)
        for s in np.unique(shard):
            mask = shard == s
            taken = columns[int(s)].take(pa.array(idx[mask] - self.starts[int(s)]))
            out[mask] = taken.flatten().to_numpy().reshape(-1, SEQ)
        return torch.from_numpy(out)


def _identity(batch: Any) -> Any:
    return batch


# ---------------------------------------------------------------------- run helpers
def rows_of(batch: Any) -> npt.NDArray[Any]:
    if isinstance(batch, dict):
        batch = batch["tokens"]
    if isinstance(batch, torch.Tensor):
        return batch.numpy()
    return np.asarray(batch)


class Runner:
    """Builds one contender from a spec and yields its batches (epochs continue)."""

    def __init__(self, spec: dict[str, Any]) -> None:
        self.spec = spec
        self.name: str = spec["contender"]
        self.kind: str = spec["data"]
        self.root = Path(spec["root"])
        self.workers: int = spec["workers"]
        self.batch: int = spec["batch"]
        self.seed: int = spec["seed"]
        self.expected_first: npt.NDArray[np.int64] | None = None  # ids the first batch must have
        # detdata only: batch k -> its positions, and positions -> the ids its order defines
        self.positions: Callable[[int], npt.NDArray[np.int64]] | None = None
        self.order_ids: Callable[[npt.NDArray[np.int64]], npt.NDArray[np.int64]] | None = None
        self.num_samples = 0
        self._cleanup: list[Any] = []

    # vanilla / stateful -------------------------------------------------------
    def _map_dataset(self, batched: bool) -> tud.Dataset[Any]:
        files = data_files(self.root, self.kind)
        if self.kind == "tokens":
            return NpyBatched(files) if batched else NpySamples(files)
        return ParquetBatched(files) if batched else ParquetSamples(files)

    def _torch_loader(self, batched: bool, stateful: bool) -> Any:
        ds = self._map_dataset(batched)
        self.num_samples = len(ds)  # type: ignore[arg-type]
        kwargs: dict[str, Any] = {
            "batch_size": self.batch,
            "shuffle": True,
            "drop_last": True,
            "num_workers": self.workers,
            "generator": torch.Generator().manual_seed(self.seed),
        }
        if self.workers:
            kwargs["persistent_workers"] = True
        if batched:
            kwargs["collate_fn"] = _identity
        if stateful:
            from torchdata.stateful_dataloader import StatefulDataLoader

            return StatefulDataLoader(ds, **kwargs)
        return tud.DataLoader(ds, **kwargs)

    def _epochs(self, loader: Any) -> Iterator[Any]:
        while True:
            yield from loader

    def batches(self, resume_at: int | None) -> Iterator[Any]:
        name = self.name
        if name in ("vanilla", "vanilla-batched"):
            loader = self._torch_loader(name == "vanilla-batched", stateful=False)
            self._cleanup.append(loader)
            it = self._epochs(loader)
            if resume_at:
                for _ in range(resume_at // self.batch):  # the vanilla way: replay and discard
                    next(it)
            return it
        if name == "stateful":
            loader = self._torch_loader(False, stateful=True)
            self._cleanup.append(loader)
            if resume_at:
                saved = torch.load(self.spec["state_path"], weights_only=False)
                loader.load_state_dict(saved["state"])
                self.expected_first = np.asarray(saved["next_ids"], dtype=np.int64)
            return self._epochs(loader)
        return self._detdata(resume_at)

    def _detdata_dataset(self) -> Any:
        import detdata

        manifest = str(self.root / self.kind / "manifest.json")
        if self.kind == "tokens":
            return detdata.TokenWindows(manifest, SEQ, labels=False)
        shards = detdata.Manifest.load(manifest, verify="off").shards
        groups = sum(len(s.row_groups or ()) for s in shards)
        # cache every row group (the vanilla Parquet loaders hold whole tables in memory too)
        return detdata.TableRows(
            manifest, ["tokens"], cache_row_groups=groups, row_group_cache_bytes=8 << 30
        )

    def _detdata(self, resume_at: int | None) -> Iterator[Any]:
        import detdata

        ds = self._detdata_dataset()
        self.num_samples = ds.num_samples
        stream = detdata.OrderedStream(ds, self.seed)
        start = resume_at or 0
        self.positions = lambda k: np.arange(
            start + k * self.batch, start + (k + 1) * self.batch, dtype=np.int64
        )
        self.order_ids = stream.sample_ids
        mode = "thread" if self.name == "detdata-threads" else "process"
        loader = detdata.DataLoader(
            ds,
            global_batch_size=self.batch,
            seed=self.seed,
            num_workers=self.workers,
            persistent_workers=self.workers > 0 and mode == "process",
            options=detdata.LoaderOptions(read=detdata.ReadOptions(worker_mode=mode)),
        )
        self._cleanup.append(loader)
        if resume_at:
            state = loader.state_dict()
            state["samples_consumed"] = resume_at
            loader.load_state_dict(state)
        return iter(loader)

    def close(self) -> None:
        for obj in self._cleanup:
            if hasattr(obj, "close"):
                obj.close()
        self._cleanup.clear()
        gc.collect()


class Delivered:
    """Ids of every checked batch, in delivery order, and whether detdata's exact order held."""

    def __init__(self, runner: Runner) -> None:
        self.runner = runner
        self.ids: list[npt.NDArray[np.int64]] = []
        self.exact: bool | None = None  # None: not a contender with an exact order

    def add(self, ids: npt.NDArray[np.int64], check_order: bool = True) -> None:
        """Record batch number ``len(self.ids)``; for detdata, compare it with its positions."""
        k = len(self.ids)
        self.ids.append(ids)
        runner = self.runner
        if check_order and runner.positions is not None and runner.order_ids is not None:
            ok = bool(np.array_equal(ids, runner.order_ids(runner.positions(k))))
            self.exact = ok if self.exact is None else (self.exact and ok)

    def check_next(self, it: Iterator[Any], batches: int) -> None:
        """Take ``batches`` batches from ``it``, each checked token by token."""
        for _ in range(batches):
            self.add(check_rows(rows_of(next(it)), self.runner.num_samples))


def timed_loop(
    it: Iterator[Any], batch: int, budget: float, max_samples: int
) -> tuple[list[npt.NDArray[np.int64]], float]:
    """The throughput window: each batch's first tokens, and the seconds it took.

    Nothing but delivery and a copy of each row's first token (the sample's id is
    first // SEQ), for at least `MIN_BATCHES` batches and ``budget`` seconds, at most
    ``max_samples`` samples. No time is subtracted: with reader threads or worker
    processes the producers keep working while the consumer checks, so subtracting
    check time would flatter concurrent loaders. The rows are checked afterwards.
    """
    firsts: list[npt.NDArray[np.int64]] = []
    with Stopwatch() as clock:
        while budget > 0 and len(firsts) * batch < max_samples:
            firsts.append(np.array(rows_of(next(it))[:, 0], dtype=np.int64))
            if len(firsts) >= MIN_BATCHES and clock.elapsed() >= budget:
                break
    return firsts, clock.seconds


def run(spec: dict[str, Any]) -> dict[str, Any]:
    resume_at: int | None = spec.get("resume_at")
    runner = Runner(spec)
    if spec.get("mode", "run") == "prepare":  # StatefulDataLoader: state at resume_at, next ids
        return prepare_stateful(runner, resume_at or 0)
    with Stopwatch() as first_batch:
        it = runner.batches(resume_at)
        first = next(it)
    n = runner.num_samples
    seen = Delivered(runner)
    seen.add(check_rows(rows_of(first), n))
    if runner.expected_first is not None and seen.exact is None:
        seen.exact = bool(np.array_equal(seen.ids[0], runner.expected_first))
    result: dict[str, Any] = {"ttfb_s": first_batch.seconds, "num_samples": n}
    budget: float = spec["budget_s"]
    # warm-up (not in the throughput): lazily filled caches, e.g. detdata's Parquet row groups,
    # which the vanilla Parquet loaders fill before their first batch instead
    warmup = int(spec.get("warmup_batches", 0)) if budget > 0 else 0
    with Stopwatch() as warm:
        seen.check_next(it, warmup)
    result["warmup_s"] = warm.seconds
    result["warmup_batches"] = warmup
    firsts, elapsed = timed_loop(it, runner.batch, budget, int(spec.get("max_epochs", 8) * n))
    for i, first_tokens in enumerate(firsts):  # every timed row by its first token
        seen.add(ids_from_first_tokens(first_tokens, n), check_order=i % 16 == 0)
    with Stopwatch() as check:  # untimed, full content checks
        seen.check_next(it, VALIDATE_BATCHES if budget > 0 else 0)
    del it
    runner.close()
    ids_all = np.concatenate(seen.ids)
    check_epochs(ids_all, resume_at or 0, n)
    delivered = len(firsts) * runner.batch
    result.update(
        {
            "samples": delivered,
            "seconds": elapsed,
            "check_s": check.seconds,
            "samples_per_s": delivered / elapsed if delivered else None,
            "validated": True,
            "exact_order": seen.exact,
            "peak_rss_main_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
            "peak_rss_worker_mb": resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024,
        }
    )
    if ids_all.size >= 256:
        result.update(shuffle_scores(ids_all))
    return result


def ids_from_first_tokens(first: npt.NDArray[np.int64], num_samples: int) -> npt.NDArray[np.int64]:
    """Sample ids from each row's first token (``SEQ * id``); raises unless each starts one."""
    ids = first // SEQ
    bad = (first % SEQ != 0) | (ids < 0) | (ids >= num_samples)
    if bad.any():
        raise AssertionError(
            f"row {int(np.flatnonzero(bad)[0])} does not start a sample "
            f"(first token {int(first[np.flatnonzero(bad)[0]])})"
        )
    return ids


def prepare_stateful(runner: Runner, resume_at: int) -> dict[str, Any]:
    loader = runner._torch_loader(False, stateful=True)
    it = iter(loader)
    for _ in range(resume_at // runner.batch):
        next(it)
    state = loader.state_dict()
    next_ids = check_rows(rows_of(next(it)), runner.num_samples)
    torch.save({"state": state, "next_ids": next_ids.tolist()}, runner.spec["state_path"])
    del it, loader
    return {"prepared": True}


def main(argv: list[str]) -> int:
    spec = json.loads(argv[0])
    torch.set_num_threads(1)
    try:
        result = run(spec)
        result["ok"] = True
    except Exception as exc:  # reported, never hidden: the parent marks the run failed
        import traceback

        result = {
            "ok": False,
            "validated": False,
            "error": f"{type(exc).__name__}: {exc}",
            "traceback": traceback.format_exc(),
        }
    result["pid"] = os.getpid()
    Path(spec["out"]).write_text(json.dumps(result))
    return 0 if result["ok"] else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
