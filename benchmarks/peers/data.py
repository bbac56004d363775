"""The same samples in every peer's own format (run in the peers' environment).

Sample ``s`` is ``SEQ`` int32 tokens ``s * SEQ + j`` (`benchmarks.bench_data`), so every
delivered row names its id and can be checked without the source. Formats, each
under ``root/<format>-<n>/`` (reused when its ``done`` marker matches):

* ``tokens`` / ``parquet``: `benchmarks.bench_data.generate` (one ``.npy`` shard, one
  Parquet shard with row groups of 1,000 rows) and detdata manifests;
* ``mds``: Mosaic Streaming ``MDSWriter``, one ``bytes`` column, no compression;
* ``wds``: WebDataset tar shards of 10,000 samples (``tok.bin`` = the raw int32 bytes);
* ``litdata``: litData ``BinaryWriter`` chunks (numpy arrays), 64 MB chunks;
* ``arrayrecord``: one ArrayRecord file (``group_size:1``: random access per record).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import numpy as np

from benchmarks.bench_data import SEQ, DataSpec, generate


def sample(i: int) -> np.ndarray:
    return np.arange(i * SEQ, (i + 1) * SEQ, dtype=np.int32)


def _once(folder: Path, n: int, write: Callable[[Path, int], None]) -> Path:
    marker = folder / "done.json"
    if marker.exists() and json.loads(marker.read_text()) == {"n": n}:
        return folder
    folder.mkdir(parents=True, exist_ok=True)
    for old in sorted(folder.rglob("*"), reverse=True):
        if old.is_file():
            old.unlink()
        elif old.is_dir():
            old.rmdir()
    write(folder, n)
    marker.write_text(json.dumps({"n": n}))
    return folder


def npy_and_parquet(root: Path, n: int) -> Path:
    folder = root / f"npy-{n}"
    generate(folder, DataSpec(samples_per_shard=n, shards=1, row_group=1000))
    return folder


def _mds(folder: Path, n: int) -> None:
    from streaming import MDSWriter

    with MDSWriter(out=str(folder), columns={"tokens": "bytes"}, size_limit=1 << 26) as out:
        for i in range(n):
            out.write({"tokens": sample(i).tobytes()})


def _wds(folder: Path, n: int) -> None:
    import webdataset as wds

    per = 10_000
    for shard in range(-(-n // per)):
        with wds.TarWriter(str(folder / f"shard-{shard:04d}.tar")) as out:
            for i in range(shard * per, min(n, (shard + 1) * per)):
                out.write({"__key__": f"{i:09d}", "tok.bin": sample(i).tobytes()})


def _litdata(folder: Path, n: int) -> None:
    from litdata.streaming.writer import BinaryWriter

    writer = BinaryWriter(str(folder), chunk_bytes="64MB")
    for i in range(n):
        writer[i] = sample(i)
    writer.done()
    writer.merge()


def _arrayrecord(folder: Path, n: int) -> None:
    from array_record.python.array_record_module import ArrayRecordWriter

    out = ArrayRecordWriter(str(folder / "data.array_record"), "group_size:1")
    for i in range(n):
        out.write(sample(i).tobytes())
    out.close()


WRITERS = {"mds": _mds, "wds": _wds, "litdata": _litdata, "arrayrecord": _arrayrecord}


def prepare(root: Path, fmt: str, n: int) -> Path:
    """The folder holding ``n`` samples in format ``fmt`` (written once)."""
    if fmt in ("tokens", "parquet"):
        return npy_and_parquet(root, n)
    return _once(root / f"{fmt}-{n}", n, WRITERS[fmt])
