"""Writers of real document corpora for the tests (the writer's input is the reference).

* `write_megatron`: a Megatron-LM indexed dataset (``P.bin`` + ``P.idx``) written from
  the published layout (megatron/core/datasets/indexed_dataset.py ``_IndexWriter``):
  magic ``MMIDIDX\\x00\\x00``, u64 version 1, u8 dtype code, u64 sequence count, u64
  document-index count, int32 sizes, int64 byte pointers, int64 document index.
* `write_parquet`: one row per document in a list column (pyarrow.parquet).
* `write_hf_arrow`: a Hugging Face ``datasets.Dataset.save_to_disk`` directory (its
  ``data-*.arrow`` files are Arrow IPC streams).
* `write_arrow_stream`: pyarrow's own ``ipc.new_stream`` writer.
"""

from __future__ import annotations

import itertools
import struct
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.ipc as ipc
import pyarrow.parquet as pq

CODES = {"uint8": 1, "int8": 2, "int16": 3, "int32": 4, "int64": 5, "uint16": 8}


def random_documents(
    rng: np.random.Generator,
    count: int,
    *,
    max_len: int = 40,
    vocab: int = 60000,
    empty: bool = True,
) -> list[np.ndarray]:
    """``count`` documents of random lengths in ``[0 or 1, max_len]`` and random tokens."""
    low = 0 if empty else 1
    lengths = rng.integers(low, max_len + 1, size=count)
    return [rng.integers(0, vocab, size=int(n)).astype(np.int64) for n in lengths]


def write_megatron(
    prefix: Path,
    documents: list[np.ndarray],
    *,
    dtype: str = "uint16",
    sentences: int = 1,
    rng: np.random.Generator | None = None,
) -> None:
    """``prefix``.bin/.idx; each document cut into up to ``sentences`` sequences."""
    itemsize = np.dtype(dtype).itemsize
    sizes: list[int] = []
    doc_index = [0]
    with open(f"{prefix}.bin", "wb") as fh:
        for doc in documents:
            cuts = [0, len(doc)]
            if sentences > 1 and len(doc) > 1 and rng is not None:
                inner = rng.choice(
                    np.arange(1, len(doc)), size=min(sentences - 1, len(doc) - 1), replace=False
                )
                cuts = [0, *sorted(int(c) for c in inner), len(doc)]
            for a, b in itertools.pairwise(cuts):
                sizes.append(b - a)
                fh.write(np.asarray(doc[a:b], dtype=f"<{np.dtype(dtype).str[1:]}").tobytes())
            doc_index.append(len(sizes))
    pointers = np.concatenate([[0], np.cumsum(sizes)[:-1]]).astype(np.int64) * itemsize
    with open(f"{prefix}.idx", "wb") as fh:
        fh.write(b"MMIDIDX\x00\x00")
        fh.write(struct.pack("<Q", 1))
        fh.write(struct.pack("<B", CODES[dtype]))
        fh.write(struct.pack("<Q", len(sizes)))
        fh.write(struct.pack("<Q", len(doc_index)))
        fh.write(np.asarray(sizes, dtype="<i4").tobytes())
        fh.write(np.asarray(pointers[: len(sizes)], dtype="<i8").tobytes())
        fh.write(np.asarray(doc_index, dtype="<i8").tobytes())


def write_eod_shard(
    path: Path, documents: list[np.ndarray], eod: int, dtype: str = "uint16"
) -> None:
    """A token .npy of the documents, each followed by ``eod`` (documents hold no ``eod``)."""
    parts = [np.append(d, eod) for d in documents]
    flat = np.concatenate(parts) if parts else np.empty(0)
    np.save(path, flat.astype(dtype))


def _table(documents: list[np.ndarray], value: pa.DataType) -> pa.Table:
    tokens = pa.array([d.tolist() for d in documents], type=pa.list_(value))
    text = pa.array([f"doc{i}" for i in range(len(documents))])
    return pa.table({"text": text, "input_ids": tokens})


def write_parquet(
    path: Path,
    documents: list[np.ndarray],
    *,
    row_group_size: int = 7,
    value: pa.DataType | None = None,
) -> None:
    pq.write_table(_table(documents, value or pa.int32()), path, row_group_size=row_group_size)


def write_arrow_stream(path: Path, documents: list[np.ndarray], *, batch: int = 5) -> None:
    table = _table(documents, pa.int64())
    with pa.OSFile(str(path), "wb") as sink, ipc.new_stream(sink, table.schema) as writer:
        for b in table.to_batches(max_chunksize=batch):
            writer.write_batch(b)


def write_hf_arrow(directory: Path, documents: list[np.ndarray], *, shards: int = 2) -> None:
    import datasets

    ds = datasets.Dataset.from_dict(
        {
            "input_ids": [d.tolist() for d in documents],
            "text": [f"d{i}" for i in range(len(documents))],
        },
        features=datasets.Features(
            {
                "input_ids": datasets.Sequence(datasets.Value("int32")),
                "text": datasets.Value("string"),
            }
        ),
    )
    ds.save_to_disk(str(directory), num_shards=shards)
