"""litData and Grain as contenders of the data-wait benchmark (`benchmarks.data_wait`).

Both read the same samples as detdata and torch's loaders (the ``.npy`` token shards of
`benchmarks.bench_data`), each the way its documentation shows for a shuffled read:

* ``litdata``: ``litdata.optimize`` writes the shards' samples once into litData's chunk
  format (a folder beside the shards, reused while the data's spec is the same), then
  ``StreamingDataset(shuffle=True, seed)`` + ``StreamingDataLoader(batch_size, num_workers)``;
* ``grain``: a random-access source over the same ``.npy`` shards (memory-mapped, one record
  a sample), ``grain.MapDataset.source(...).shuffle(seed).repeat().batch(...)``, then
  ``to_iter_dataset`` and, with workers, ``mp_prefetch(MultiprocessingOptions(num_workers))``
  (reads in the calling thread, as in ``benchmarks/peers``: grain's default 16 reader
  threads a process thrash on 2 cores).

They are installed in ``benchmarks/peers/.venv`` only (``benchmarks/peers/install.sh``), never
in the project's ``.venv``: where one cannot be imported it is not run, with the reason.
"""

from __future__ import annotations

import hashlib
import importlib
import multiprocessing
import os
import shutil
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Protocol

import numpy as np
import numpy.typing as npt

from benchmarks.bench_data import SEQ, SPEC_FILE, data_files

PEERS = ("litdata", "grain")
#: the module each peer is imported from
MODULES = {"litdata": "litdata", "grain": "grain.python"}
LITDATA_INDEX = "index.json"  # written by ``litdata.optimize`` last: the folder is whole


class BatchSource(Protocol):
    """What the trainer needs of a contender: its batches, its sample count, a close."""

    num_samples: int

    def batches(self, resume_at: int | None) -> Iterator[Any]:
        """Batches for ever (epochs continue); ``resume_at`` is unused here (None)."""
        ...

    def close(self) -> None:
        """Stop the contender's workers and release its files."""
        ...


def unavailable(peer: str) -> str | None:
    """Why ``peer`` cannot run here (its import failed), or None when it can."""
    try:
        importlib.import_module(MODULES[peer])
    except Exception as exc:  # an ImportError, or a broken install that fails on import
        return f"not installed in this environment ({type(exc).__name__}: {exc})"
    return None


def _shard_samples(path: str) -> Iterator[npt.NDArray[np.int32]]:
    """Every sample of one ``.npy`` shard, in file order (litData's ``optimize`` function)."""
    rows = np.load(path, mmap_mode="r").reshape(-1, SEQ)
    for row in rows:
        yield np.array(row, dtype=np.int32)


def litdata_folder(root: Path) -> Path:
    """litData's copy of the shards under ``root``, written once per data spec."""
    import litdata

    spec = (root / SPEC_FILE).read_bytes()
    folder = root / f"litdata-{hashlib.blake2b(spec, digest_size=6).hexdigest()}"
    if (folder / LITDATA_INDEX).exists():
        return folder
    partial = root / f"litdata-partial-{uuid.uuid4().hex[:8]}"
    litdata.optimize(
        fn=_shard_samples,
        inputs=[str(p) for p in data_files(root, "tokens")],
        output_dir=str(partial),
        chunk_bytes="64MB",
        num_workers=1,
        # litData sets the process-wide start method (spawn by default): keep the one every
        # other contender's workers start with
        start_method=multiprocessing.get_start_method(),
    )
    shutil.rmtree(folder, ignore_errors=True)
    os.rename(partial, folder)
    return folder


class _NpyShards:
    """A grain random-access source: sample ``i`` of the ``.npy`` shards (memory-mapped)."""

    def __init__(self, paths: list[str]) -> None:
        self.paths = paths
        sizes = [int(np.load(p, mmap_mode="r").shape[0]) // SEQ for p in paths]
        self.starts = np.cumsum([0, *sizes])
        self.rows: list[npt.NDArray[np.int32]] | None = None  # opened in the reading process

    def __len__(self) -> int:
        return int(self.starts[-1])

    def __repr__(self) -> str:  # grain names a source in its state by its repr
        return f"NpyShards({self.paths!r})"

    def __getitem__(self, i: int) -> npt.NDArray[np.int32]:
        if self.rows is None:
            self.rows = [np.load(p, mmap_mode="r").reshape(-1, SEQ) for p in self.paths]
        shard = int(np.searchsorted(self.starts, i, side="right")) - 1
        return np.array(self.rows[shard][i - int(self.starts[shard])])


class PeerRunner:
    """litData or Grain over the token shards of ``spec["root"]``, as a `BatchSource`."""

    def __init__(self, spec: dict[str, Any]) -> None:
        self.name: str = spec["contender"]
        self.root = Path(spec["root"])
        self.workers: int = spec["workers"]
        self.batch: int = spec["batch"]
        self.seed: int = spec["seed"]
        self.num_samples = 0
        self._open: list[Any] = []  # iterators to close

    def batches(self, resume_at: int | None) -> Iterator[Any]:
        if resume_at:
            raise ValueError("the data-wait benchmark does not resume")
        if self.name == "litdata":
            return self._litdata()
        return self._grain()

    def _litdata(self) -> Iterator[Any]:
        from litdata import StreamingDataLoader, StreamingDataset

        ds = StreamingDataset(str(litdata_folder(self.root)), shuffle=True, seed=self.seed)
        self.num_samples = len(ds)
        loader = StreamingDataLoader(ds, batch_size=self.batch, num_workers=self.workers)
        epochs = _epochs(loader)
        self._open.append(epochs)  # closing it ends the epoch's iterator and its workers
        return epochs

    def _grain(self) -> Iterator[Any]:
        import grain.python as grain

        source = _NpyShards([str(p) for p in data_files(self.root, "tokens")])
        self.num_samples = len(source)
        ds = grain.MapDataset.source(source).shuffle(seed=self.seed).repeat(None)
        batched = ds.batch(self.batch, drop_remainder=True).to_iter_dataset(
            grain.ReadOptions(num_threads=0, prefetch_buffer_size=0)
        )
        if self.workers:
            batched = batched.mp_prefetch(grain.MultiprocessingOptions(num_workers=self.workers))
        iterator: Iterator[Any] = iter(batched)  # repeat(None): one iterator for ever
        self._open.append(iterator)
        return iterator

    def close(self) -> None:
        for it in self._open:
            it.close()  # grain: stops its worker processes; litData: ends the epoch's workers
        self._open.clear()


def _epochs(loader: Any) -> Iterator[Any]:
    while True:
        yield from loader
