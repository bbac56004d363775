"""One peer-benchmark run in this (child) process: build, time, validate; JSON to ``spec["out"]``.

``python -m benchmarks.peers.one SPEC_JSON``. Modes:

* ``epoch``: construct the dataset and loader, take batches until one epoch of
  ``n`` samples (``n // 64`` batches) was delivered. Timed: construction to the
  first batch (``ttfb_s``), construction to the last batch (``whole``), first to
  last batch (``steady``). In the loop, per batch: each row's first token (its id)
  and the sum of its 512 tokens are kept (one vectorised reduction, the same for
  every loader); after the loop every sample is validated from those (id in
  range, first token a multiple of 512, token sum equal to the source's, no id twice
  in the epoch), and every 32nd batch is compared token by token in the loop.
* ``resume``: a loader run to position ``resume_at`` (untimed) gives its state and
  the next batch's ids; then a new loader is constructed, restored and its first
  batch taken (timed: ``resume_s``) and compared with those ids. Where a peer can
  only replay, the replay is what is timed. ``resume_at >= 1e9`` only for loaders
  whose state can name a position without running to it.
"""

from __future__ import annotations

import gc
import json
import os
import resource
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt

SEQ = 512
SUM_OFFSET = SEQ * (SEQ - 1) // 2
FULL_CHECK_EVERY = 32


def rows_of(batch: Any) -> npt.NDArray[Any]:
    import torch

    if isinstance(batch, dict):
        batch = batch["tokens"]
    if isinstance(batch, (tuple, list)) and len(batch) == 1:
        batch = batch[0]
    if isinstance(batch, torch.Tensor):
        return batch.numpy()
    return np.asarray(batch)


def gil_transform(sample: dict[str, np.ndarray]) -> dict[str, Any]:
    """A per-sample pure-Python step that holds the GIL (a stand-in for tokenising/decoding).
    One parameter: it draws no randomness, so detdata builds no per-sample generator."""
    tokens = sample["tokens"]
    acc = 0
    for t in tokens[:48].tolist():
        acc = (acc * 31 + t) & 0xFFFFFFFF
    return {"tokens": tokens, "h": np.int64(acc)}


def _gil_rows(rows: np.ndarray) -> np.ndarray:
    """The same per-sample work for loaders without detdata's transform hook (vanilla torch)."""
    gil_transform({"tokens": rows})
    return rows


# ------------------------------------------------------------------ builders
Built = tuple[Iterator[Any], int, Callable[[], Any] | None]  # batches, samples, state getter


def _torch_map(spec: dict[str, Any], per_sample: bool, stateful: bool) -> Any:
    import torch
    import torch.utils.data as tud

    from benchmarks.bench_data import data_files
    from benchmarks.contenders import NpyBatched, NpySamples, ParquetSamples

    root = Path(spec["root"])
    if spec["format"] == "parquet":
        ds: Any = ParquetSamples(data_files(root, "parquet"))
    else:
        ds = (NpySamples if per_sample else NpyBatched)(data_files(root, "tokens"))
    if spec.get("gil"):
        ds = _GilMap(ds)
    kwargs: dict[str, Any] = {
        "batch_size": spec["batch"],
        "shuffle": True,
        "drop_last": True,
        "num_workers": spec["workers"],
        "generator": torch.Generator().manual_seed(spec["seed"]),
    }
    if not per_sample:
        kwargs["collate_fn"] = _first
    if stateful:
        from torchdata.stateful_dataloader import StatefulDataLoader

        return StatefulDataLoader(ds, **kwargs)
    return tud.DataLoader(ds, **kwargs)


def _first(batch: Any) -> Any:
    return batch


class _GilMap:
    def __init__(self, ds: Any) -> None:
        self.ds = ds

    def __len__(self) -> int:
        return len(self.ds)

    def __getitem__(self, i: int) -> Any:
        row = self.ds[i]
        gil_transform({"tokens": row})
        return row


def _detdata(spec: dict[str, Any]) -> Any:
    import detdata

    root = Path(spec["root"])
    if spec["format"] == "parquet":
        manifest = str(root / "parquet" / "manifest.json")
        kwargs: dict[str, Any] = {}
        if spec.get("cache_bytes"):  # the count stays the default: chosen from the order
            kwargs = {"row_group_cache_bytes": spec["cache_bytes"]}
        ds: Any = detdata.TableRows(manifest, ["tokens"], **kwargs)
    else:
        ds = detdata.TokenWindows(str(root / "tokens" / "manifest.json"), SEQ, labels=False)
    data: Any = ds
    if spec.get("order"):
        order = spec["order"]
        if isinstance(order, dict):
            order = detdata.LocalityOrder(**order)
        data = detdata.OrderedStream(ds, spec["seed"], order=order)
    mode = spec.get("worker_mode", "process")
    loader = detdata.DataLoader(
        data,
        global_batch_size=spec["batch"],
        seed=spec["seed"],
        options=detdata.LoaderOptions(
            # a run of the epoch's length, as a training run states its length: no read-ahead
            # past the last batch (which would decode row groups for samples never delivered)
            total_samples=spec["n"] // spec["batch"] * spec["batch"]
            if spec["mode"] == "epoch"
            else None,
            transform=gil_transform if spec.get("gil") else None,
            read=detdata.ReadOptions(worker_mode=mode if spec["workers"] else "process"),
        ),
        num_workers=spec["workers"],
    )
    if spec.get("slots") is False:  # worker processes: every group takes torch's transfer
        loader._source.slot_transfer = False
    return loader


def _litdata(spec: dict[str, Any]) -> Any:
    from litdata import StreamingDataLoader, StreamingDataset

    ds = StreamingDataset(spec["root"], shuffle=True, seed=spec["seed"])
    return StreamingDataLoader(ds, batch_size=spec["batch"], num_workers=spec["workers"])


class _Frombuffer:
    def __init__(self, source: Any, key: str | None) -> None:
        self.source, self.key = source, key

    def __len__(self) -> int:
        return len(self.source)

    def __repr__(self) -> str:  # grain checks the source in a checkpoint by its repr
        return f"Frombuffer({self.source!r}, {self.key!r})"

    def __getitem__(self, i: int) -> np.ndarray:
        item = self.source[i]
        raw = item if self.key is None else item[self.key]
        return np.frombuffer(raw, dtype=np.int32)


class _NpySource:
    """A grain random-access source over the ``.npy`` shard (memory-mapped, read per record)."""

    def __init__(self, path: str) -> None:
        self.path = path
        self.rows: np.ndarray | None = None
        self.n = int(np.load(path, mmap_mode="r").shape[0]) // SEQ

    def __len__(self) -> int:
        return self.n

    def __repr__(self) -> str:  # grain checks the source in a checkpoint by its repr
        return f"NpySource({self.path!r})"

    def __getitem__(self, i: int) -> np.ndarray:
        if self.rows is None:
            self.rows = np.load(self.path, mmap_mode="r").reshape(-1, SEQ)
        return np.array(self.rows[i])


def _grain(spec: dict[str, Any], start_state: bytes | None = None) -> Any:
    import grain.python as grain

    root = Path(spec["root"])
    if spec["format"] == "arrayrecord":
        source: Any = _Frombuffer(
            grain.ArrayRecordDataSource([str(root / "data.array_record")]), None
        )
    else:
        source = _NpySource(str(root / "tokens" / "shard-000.npy"))
    sampler = grain.IndexSampler(
        num_records=len(source),
        shard_options=grain.NoSharding(),
        shuffle=True,
        num_epochs=None,
        seed=spec["seed"],
    )
    return grain.DataLoader(
        data_source=source,
        sampler=sampler,
        operations=[grain.Batch(spec["batch"], drop_remainder=True)],
        worker_count=spec["workers"],
        # in-thread reads: grain's default pool of 16 reader threads per process thrashes
        # on 2 cores (660 samples/s here against 6,600 with reads in the calling thread)
        read_options=grain.ReadOptions(num_threads=0, prefetch_buffer_size=0),
    )


def _wds(spec: dict[str, Any]) -> Any:
    import webdataset as wds

    urls = sorted(str(p) for p in Path(spec["root"]).glob("shard-*.tar"))
    ds = (
        wds.WebDataset(urls, shardshuffle=len(urls), seed=spec["seed"], empty_check=False)
        .shuffle(1000)
        .to_tuple("tok.bin")
        .map_tuple(lambda b: np.frombuffer(b, dtype=np.int32))
        .batched(spec["batch"], partial=False)
    )
    return wds.WebLoader(ds, batch_size=None, num_workers=spec["workers"])


def _mds_loader(spec: dict[str, Any], state: Any = None) -> Any:
    from streaming import StreamingDataLoader, StreamingDataset

    class Tokens(StreamingDataset):  # type: ignore[misc]
        def __getitem__(self, i: int) -> np.ndarray:
            return np.frombuffer(super().__getitem__(i)["tokens"], dtype=np.int32)

    ds = Tokens(
        local=spec["root"], shuffle=True, shuffle_seed=spec["seed"], batch_size=spec["batch"]
    )
    loader = StreamingDataLoader(
        ds, batch_size=spec["batch"], num_workers=spec["workers"], drop_last=True
    )
    if state is not None:
        loader.load_state_dict(state)
    return loader


def build(spec: dict[str, Any]) -> Any:
    """The loader (an iterable; epochs are taken by `_epochs`)."""
    name = spec["contender"]
    if name in ("torch", "torch-batched", "torch-parquet"):
        return _torch_map(spec, per_sample=name != "torch-batched", stateful=False)
    if name == "stateful":
        return _torch_map(spec, per_sample=True, stateful=True)
    if name.startswith("detdata"):
        return _detdata(spec)
    if name == "litdata":
        return _litdata(spec)
    if name.startswith("grain"):
        return _grain(spec)
    if name == "wds":
        return _wds(spec)
    if name == "mds":
        return _mds_loader(spec)
    raise ValueError(name)


def _epochs(loader: Any, name: str) -> Iterator[Any]:
    if name.startswith("grain"):
        yield from loader  # grain: num_epochs=None, one infinite iterator (its state is its own)
        return
    while True:
        yield from loader


# ------------------------------------------------------------------ decoded bytes (Parquet)
DECODED = [0]


def count_decoded() -> None:
    """Count the bytes pyarrow decodes from Parquet in this process (row groups and tables)."""
    import pyarrow.parquet as pq

    for name in ("read_row_group", "read_row_groups", "read"):
        original = getattr(pq.ParquetFile, name)

        def counted(self: Any, *a: Any, _original: Any = original, **k: Any) -> Any:
            table = _original(self, *a, **k)
            DECODED[0] += int(table.nbytes)
            return table

        setattr(pq.ParquetFile, name, counted)
    original_read_table = pq.read_table

    def read_table(*a: Any, **k: Any) -> Any:
        table = original_read_table(*a, **k)
        DECODED[0] += int(table.nbytes)
        return table

    pq.read_table = read_table


# ------------------------------------------------------------------ epoch mode
def run_epoch(spec: dict[str, Any]) -> dict[str, Any]:
    n, batch = spec["n"], spec["batch"]
    wanted = n // batch
    firsts: list[np.ndarray] = []
    sums: list[np.ndarray] = []
    full_bad = 0
    t0 = time.perf_counter()
    loader = build(spec)
    it = _epochs(loader, spec["contender"])
    t_first = 0.0
    for k in range(wanted):
        rows = rows_of(next(it))
        if spec.get("gil") and spec["contender"].startswith("torch-batched"):
            _gil_rows(rows)
        if k == 0:
            t_first = time.perf_counter()
        firsts.append(np.array(rows[:, 0], dtype=np.int64))
        sums.append(rows.sum(axis=1, dtype=np.int64))
        if k % FULL_CHECK_EVERY == 0:
            expected = rows[:, :1].astype(np.int64) + np.arange(SEQ, dtype=np.int64)
            full_bad += int((rows.shape[1] != SEQ) or not np.array_equal(rows, expected))
    t_end = time.perf_counter()
    first = np.concatenate(firsts)
    ids = first // SEQ
    sum_ok = np.concatenate(sums) == SEQ * first + SUM_OFFSET
    valid = (first % SEQ == 0) & (ids >= 0) & (ids < spec["source_n"]) & sum_ok
    unique = np.unique(ids).size
    delivered = wanted * batch
    decoded = DECODED[0]
    del it, loader
    gc.collect()
    from benchmarks.bench_data import shuffle_scores

    return {
        "samples": delivered,
        "ttfb_s": t_first - t0,
        "whole_sps": delivered / (t_end - t0),
        "steady_sps": (delivered - batch) / (t_end - t_first) if wanted > 1 else None,
        "validated": bool(valid.all()) and full_bad == 0,
        "invalid_rows": int((~valid).sum()),
        "full_check_failures": full_bad,
        "repeats_in_epoch": delivered - unique,
        **shuffle_scores(ids),
        "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
        "peak_rss_children_mb": resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024,
        # bytes pyarrow decoded in this process per byte delivered (Parquet, in-process reads)
        "decoded_per_delivered": decoded / (delivered * SEQ * 4) if decoded else None,
    }


# ------------------------------------------------------------------ resume mode
def _ids(batch: Any) -> np.ndarray:
    return rows_of(batch)[:, 0].astype(np.int64) // SEQ


def run_resume(spec: dict[str, Any]) -> dict[str, Any]:
    name, at, batch = spec["contender"], spec["resume_at"], spec["batch"]
    far = at >= spec["n"] * 100
    expected: np.ndarray | None = None
    state: Any = None
    if far:  # warm up as the near case does (imports, page cache): one batch, untimed
        warm = build(spec)
        next(iter(warm))
        del warm
        gc.collect()
    else:  # run to the position: its state and the next batch's ids
        loader = build(spec)
        it = iter(loader) if name.startswith("grain") else _epochs(loader, name)
        for _ in range(at // batch):
            next(it)
        state = _state_of(name, loader, it)
        expected = _ids(next(it))
        del it, loader
        gc.collect()
    t0 = time.perf_counter()
    how, first = _resumed_first(spec, state, at)
    seconds = time.perf_counter() - t0
    got = _ids(first)
    rows = rows_of(first)
    content_ok = bool(
        np.array_equal(rows, rows[:, :1].astype(np.int64) + np.arange(SEQ, dtype=np.int64))
    )
    return {
        "resume_s": seconds,
        "how": how,
        "same_as_uninterrupted": None if expected is None else bool(np.array_equal(got, expected)),
        "content_ok": content_ok,
    }


def _state_of(name: str, loader: Any, it: Any) -> Any:
    if name.startswith("detdata") or name in ("stateful", "litdata", "mds"):
        return loader.state_dict()
    if name.startswith("grain"):
        return it.get_state()  # grain's state lives in its iterator
    return None


def _resumed_first(spec: dict[str, Any], state: Any, at: int) -> tuple[str, Any]:
    name, batch = spec["contender"], spec["batch"]
    if name.startswith("detdata"):
        loader = build(spec)
        saved = loader.state_dict() if state is None else state
        saved = {**saved, "samples_consumed": at}
        loader.load_state_dict(saved)
        return "load_state_dict (O(1))", next(iter(loader))
    if name in ("stateful", "litdata", "mds"):
        loader = build(spec)
        loader.load_state_dict(state)
        return "load_state_dict", next(iter(loader))
    if name.startswith("grain"):
        loader = build(spec)
        it = iter(loader)
        it.set_state(state)
        return "iterator.set_state", next(it)
    loader = build(spec)  # torch DataLoader, WebDataset: replay and discard
    it = _epochs(loader, spec["contender"])
    for _ in range(at // batch):
        next(it)
    return "replay", next(it)


def main(argv: list[str]) -> int:
    spec = json.loads(argv[0])
    import torch

    torch.set_num_threads(1)
    if spec.get("format") == "parquet":
        count_decoded()
    try:
        result = run_resume(spec) if spec["mode"] == "resume" else run_epoch(spec)
        result["ok"] = True
    except Exception as exc:  # reported, never hidden: the parent marks the run failed
        import traceback

        result = {"ok": False, "error": f"{type(exc).__name__}: {exc}"[:500]}
        result["traceback"] = traceback.format_exc()[-3000:]
    result["pid"] = os.getpid()
    Path(spec["out"]).write_text(json.dumps(result))
    sys.stdout.flush()
    os._exit(0)  # never wait for a peer's stray worker threads


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
