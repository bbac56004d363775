"""Text corpora and tokenizers for the raw-text tests, made by the tests themselves.

`train_bpe` trains a small BPE with ``tokenizers`` on text the test generates (nothing
is downloaded); `write_corpus` writes the same documents as JSONL (plain, gzip, zstd) and
Parquet / Arrow shards; `reference_windows` is the tests' own packer: each document
encoded by the tokenizer itself, concatenated in the packing order, cut into windows.
"""

from __future__ import annotations

import gzip
import json
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.ipc as ipc
import pyarrow.parquet as pq
from tokenizers import Tokenizer, models, pre_tokenizers, trainers

WORDS = ("alpha", "beta", "gamma", "delta", "río", "naïve", "数据", "token", "x", "zeta")


def make_documents(count: int, seed: int) -> list[str]:
    """``count`` generated documents of 1 to 60 words (never empty)."""
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(count):
        n = int(rng.integers(1, 60))
        out.append(" ".join(WORDS[int(i)] for i in rng.integers(0, len(WORDS), n)))
    return out


def train_bpe(path: Path, texts: list[str], vocab_size: int = 400) -> Path:
    """A byte-level BPE trained on ``texts`` with ``<eod>`` / ``<bos>`` added, saved at ``path``."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=["<eod>", "<bos>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer)
    tok.save(str(path))
    return path


def write_jsonl(path: Path, texts: list[str], *, field: str = "text") -> Path:
    """``texts`` as JSONL (compressed by the suffix: ``.gz`` gzip, ``.zst`` zstd)."""
    body = "".join(json.dumps({field: t, "id": i}) + "\n" for i, t in enumerate(texts)).encode()
    if path.suffix == ".gz":
        path.write_bytes(gzip.compress(body))
    elif path.suffix == ".zst":
        with pa.CompressedOutputStream(str(path), "zstd") as out:
            out.write(body)
    else:
        path.write_bytes(body)
    return path


def write_table(path: Path, texts: list[str], *, field: str = "text", group: int = 7) -> Path:
    """``texts`` as a Parquet (``.parquet``) or Arrow IPC file (``.arrow``), ``group`` rows a
    row group / record batch."""
    table = pa.table({field: pa.array(texts, pa.string()), "n": list(range(len(texts)))})
    if path.suffix == ".parquet":
        pq.write_table(table, path, row_group_size=group)
    else:
        with ipc.new_file(str(path), table.schema) as writer:
            for batch in table.to_batches(max_chunksize=group):
                writer.write_batch(batch)
    return path


def write_corpus(root: Path, texts: list[str]) -> list[tuple[str, list[str]]]:
    """``texts`` split over five shards of every kind, in path order; ``(name, texts)`` each."""
    root.mkdir(parents=True, exist_ok=True)
    cut = np.array_split(np.arange(len(texts)), 5)
    names = ("a.jsonl", "b.jsonl.gz", "c.jsonl.zst", "d.parquet", "e.arrow")
    out = []
    for name, part in zip(names, cut, strict=True):
        mine = [texts[int(i)] for i in part]
        path = root / name
        if "jsonl" in name:
            write_jsonl(path, mine)
        else:
            write_table(path, mine)
        out.append((name, mine))
    return out


def encode(
    tokenizer: Path, texts: list[str], *, bos: int | None, eos: int | None
) -> list[list[int]]:
    """Each text's tokens as the test computes them: ``[bos] + ids + [eos]``."""
    tok = Tokenizer.from_file(str(tokenizer))
    head = [] if bos is None else [bos]
    tail = [] if eos is None else [eos]
    return [head + tok.encode(t, add_special_tokens=False).ids + tail for t in texts]


def reference_windows(
    docs: list[list[int]], order: list[int], seq_len: int, labels: bool
) -> np.ndarray:
    """The windows of the documents concatenated in ``order``, cut every ``seq_len`` tokens,
    each ``seq_len + labels`` wide (the last partial window dropped)."""
    stream = np.array([t for d in order for t in docs[d]], dtype=np.int64)
    width = seq_len + int(labels)
    count = (stream.size - int(labels)) // seq_len
    return np.stack([stream[w * seq_len : w * seq_len + width] for w in range(count)])
