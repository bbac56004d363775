"""Benchmark: raw text tokenised at read time vs pre-tokenised vs HF datasets + torch, one run.

The same generated JSONL corpus, the same byte-level BPE (trained here on the corpus, no
download), the same ``seq_len`` windows, 2 loader workers each, side by side in one run:

* **text at read**: `TextDocuments` + `PackedWindows` through `detdata.DataLoader`
  (``num_workers=2``, process workers): documents tokenised when a window is read;
* **pre-tokenised**: the same tokens written as Megatron ``.bin``/``.idx`` shards (what
  ``detdata tokenize`` writes), `Documents` + `PackedWindows`, same loader;
* **HF + torch**: ``datasets.load_dataset("json")`` + ``map(tokenize, batched=True,
  num_proc=2)`` + ``map(group_texts)`` (concatenate, cut ``seq_len + 1`` blocks: the
  ``run_clm`` recipe) + ``torch.utils.data.DataLoader(num_workers=2)``.

Reported per pipeline: delivered tokens/s while iterating (after the first batch), the first
batch latency (from building the loader; the index or the ``map`` preprocessing excluded
and reported apart: ``prepare_s``), and end-to-end tokens/s including the preparation.
Also: the text index build time per GB of JSONL (it tokenises every document once), and
the tokenizer alone (``encode_batch_fast`` over 500 documents in one process): the ceiling
of any tokenise-at-read pipeline on this machine.
Times are wall-clock on a shared, loaded machine: noisy, compare within one run only.

Run: ``python -m benchmarks.text`` (``--smoke`` for a seconds-long run). Prints a table
and writes ``benchmarks/results/text.json`` (or ``--out DIR``).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

import detdata
from detdata.cli.tokenize import write_megatron
from detdata.datasets.documents import Documents
from detdata.datasets.packed import PackedWindows
from detdata.datasets.text import TextDocuments
from detdata.identity.tokenizer import TextTokenizer

RESULTS = Path(__file__).parent / "results"


def write_corpus(root: Path, docs: int, rng: np.random.Generator) -> list[Path]:
    """Four JSONL shards of ``docs`` documents of generated words (50 to 1500 words each)."""
    syll = ["ka", "lo", "mi", "ne", "su", "ta", "ri", "po", "an", "el", "or", "ul"]
    words = ["".join(rng.choice(syll, size=int(rng.integers(1, 4)))) for _ in range(3000)]
    root.mkdir(parents=True, exist_ok=True)
    paths = []
    for s, part in enumerate(np.array_split(np.arange(docs), 4)):
        path = root / f"part-{s}.jsonl"
        with open(path, "w", encoding="utf-8") as fh:
            for d in part.tolist():
                n = int(rng.integers(50, 1500))
                text = " ".join(words[int(i)] for i in rng.zipf(1.3, n) % len(words))
                fh.write(json.dumps({"id": d, "text": text}) + "\n")
        paths.append(path)
    return paths


def train_tokenizer(paths: list[Path], out: Path) -> Path:
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    trainer = trainers.BpeTrainer(
        vocab_size=8000,
        special_tokens=["<eod>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    sample = [json.loads(line)["text"] for line in paths[0].read_text().splitlines()[:500]]
    tok.train_from_iterator(sample, trainer)
    tok.save(str(out))
    return out


def iterate(loader: Any, batches: int, seq_len: int) -> dict[str, float]:
    """First batch latency and tokens/s of the next ``batches`` batches."""
    start = time.perf_counter()
    it = iter(loader)
    first = next(it)
    latency = time.perf_counter() - start
    rows = 0
    t0 = time.perf_counter()
    for _ in range(batches):
        batch = next(it)
        tokens = batch["tokens"] if "tokens" in batch else batch["input_ids"]
        rows += int(tokens.shape[0])
    seconds = time.perf_counter() - t0
    del first
    return {"first_batch_s": latency, "tokens_per_s": rows * seq_len / seconds, "iter_s": seconds}


def detdata_loader(packed: PackedWindows, batch: int, ahead: int = 16) -> detdata.DataLoader:
    read = detdata.ReadOptions(worker_mode="process", batches_ahead=ahead)
    options = detdata.LoaderOptions(read=read)
    return detdata.DataLoader(
        packed, global_batch_size=batch, seed=1, num_workers=2, options=options
    )


def hf_pipeline(paths: list[Path], tokenizer: Path, seq_len: int, cache: Path) -> tuple[Any, float]:
    """The HF ``datasets`` recipe (module docstring) and its preparation time."""
    import datasets
    from tokenizers import Tokenizer

    datasets.disable_progress_bars()
    tok = Tokenizer.from_file(str(tokenizer))
    eod = tok.token_to_id("<eod>")
    t0 = time.perf_counter()
    raw = datasets.load_dataset(
        "json", data_files=[str(p) for p in paths], split="train", cache_dir=str(cache)
    )

    def tokenize(batch: dict[str, list[str]]) -> dict[str, list[list[int]]]:
        enc = Tokenizer.from_file(str(tokenizer)).encode_batch_fast(batch["text"])
        return {"input_ids": [[*e.ids, eod] for e in enc]}

    def group(batch: dict[str, list[list[int]]]) -> dict[str, list[list[int]]]:
        flat = [t for ids in batch["input_ids"] for t in ids]
        n = (len(flat) - 1) // seq_len
        return {"input_ids": [flat[i * seq_len : i * seq_len + seq_len + 1] for i in range(n)]}

    ids = raw.map(tokenize, batched=True, num_proc=2, remove_columns=raw.column_names)
    blocks = ids.map(group, batched=True, num_proc=2)
    blocks.set_format("torch")
    return blocks, time.perf_counter() - t0


def run(docs: int, seq_len: int, batch: int, batches: int, work: Path) -> dict[str, Any]:
    import torch

    rng = np.random.default_rng(0)
    paths = write_corpus(work / "text", docs, rng)
    text_bytes = sum(p.stat().st_size for p in paths)
    tokenizer = train_tokenizer(paths, work / "tokenizer.json")
    tok = TextTokenizer(tokenizer, eos="<eod>")
    manifest = detdata.build_manifest(str(work / "text"))
    t0 = time.perf_counter()
    text_docs = TextDocuments(manifest, tok, index_dir=work / "ix")
    build_s = time.perf_counter() - t0
    sample = [text_docs.text(d) for d in range(min(500, text_docs.num_documents))]
    t0 = time.perf_counter()
    encoded = sum(t.size for t in tok.encode(sample))
    ceiling = encoded / (time.perf_counter() - t0)  # the tokenizer alone, one process
    shard_of = text_docs.document_shards()
    (work / "tok").mkdir(exist_ok=True)
    for s in range(len(manifest.shards)):
        write_megatron(
            str(work / "tok" / f"part-{s}"),
            text_docs.tokens(np.flatnonzero(shard_of == s).tolist()),
            np.dtype(np.uint16),
        )
    token_docs = Documents(detdata.build_manifest(str(work / "tok")), index_dir=work / "ix")
    rows: list[dict[str, Any]] = []
    fresh = TextDocuments(manifest, tok, index_dir=work / "ix")  # loaded: no build
    for name, corpus, prepare, ahead in (
        ("text at read", fresh, build_s, 16),
        ("text at read, batches_ahead=1", fresh, build_s, 1),
        ("pre-tokenised", token_docs, 0.0, 16),
    ):
        packed = PackedWindows(corpus, seq_len, seed=3)
        got = iterate(detdata_loader(packed, batch, ahead), batches, seq_len)
        rows.append({"pipeline": name, "prepare_s": prepare, **got})
    blocks, prepare = hf_pipeline(paths, tokenizer, seq_len, work / "hf")
    hf = torch.utils.data.DataLoader(blocks, batch_size=batch, shuffle=True, num_workers=2)
    rows.append(
        {"pipeline": "HF datasets + torch", "prepare_s": prepare, **iterate(hf, batches, seq_len)}
    )
    tokens = batches * batch * seq_len
    for row in rows:
        row["end_to_end_tokens_per_s"] = tokens / (
            row["prepare_s"] + row["first_batch_s"] + row["iter_s"]
        )
    return {
        "machine": {"platform": platform.platform(), "cpus": os.cpu_count(), "loaded": True},
        "corpus": {"documents": docs, "bytes": text_bytes, "tokens": text_docs.num_tokens},
        "seq_len": seq_len,
        "batch": batch,
        "batches": batches,
        "index_build_s": build_s,
        "index_build_s_per_gb": build_s / text_bytes * 1e9,
        "tokenizer_alone_tokens_per_s": ceiling,
        "rows": rows,
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--smoke", action="store_true", help="tiny sizes: seconds, for the tests")
    ap.add_argument("--out", type=Path, default=RESULTS, help="folder of text.json")
    ap.add_argument("--work", type=Path, help="scratch folder (default: a temporary one)")
    args = ap.parse_args(argv)
    sizes = (400, 256, 8, 10) if args.smoke else (8000, 2048, 16, 60)
    with tempfile.TemporaryDirectory() as tmp:
        work = args.work or Path(tmp)
        work.mkdir(parents=True, exist_ok=True)
        doc = run(*sizes, work=work)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "text.json").write_text(json.dumps(doc, indent=1) + "\n")
    print(f"corpus: {doc['corpus']}; 2 workers each; shared loaded machine: noisy")
    print(
        f"text index build: {doc['index_build_s']:.2f} s = {doc['index_build_s_per_gb']:.0f} "
        f"s/GB; the tokenizer alone: {doc['tokenizer_alone_tokens_per_s']:.0f} tokens/s"
    )
    print(
        f"{'pipeline':<32}{'tokens/s':>12}{'first batch s':>15}{'prepare s':>11}{'end-to-end':>12}"
    )
    for r in doc["rows"]:
        print(
            f"{r['pipeline']:<32}{r['tokens_per_s']:>12.0f}{r['first_batch_s']:>15.2f}"
            f"{r['prepare_s']:>11.2f}{r['end_to_end_tokens_per_s']:>12.0f}"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
