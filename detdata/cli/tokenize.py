"""``detdata tokenize``: raw text shards -> token shards, the tokenizer pinned in the manifest.

``detdata tokenize --manifest M | --root DIR --tokenizer tokenizer.json --out OUT
[--field text] [--bos TOKEN] [--eos TOKEN] [--empty error|skip] [--format bin|npy]``
reads the text shards (``jsonl`` / ``.jsonl.gz`` / ``.jsonl.zst``, Parquet / Arrow string
columns) as `detdata.TextDocuments` does, and writes under ``OUT`` one token
shard per text shard (its name with the text suffix replaced):

* ``--format bin`` (default): a Megatron indexed dataset ``NAME.bin`` + ``NAME.idx`` (one
  sequence per document; uint16 tokens when the vocabulary fits, else int32), read by
  `Documents` without ``eod_token``;
* ``--format npy``: ``NAME.npy``, the documents' tokens concatenated; documents are cut
  at ``--eos`` (required), read by ``Documents(..., eod_token=EOS)``.

Then ``OUT/manifest.json``, whose metadata holds ``tokenizer`` (the tokenizer's identity,
`TextTokenizer.identity`), ``text`` (field and policy) and ``text_manifest`` (the id of
the text manifest): the manifest id, checked at every resume, changes with the tokenizer,
and `check_manifest_tokenizer` (in the tokenizer module) names the differing field. Prints
a JSON summary. Exit 0, or 2 (bad arguments or input: the error names shard, line, field).
"""

from __future__ import annotations

import argparse
import json
import os
import struct
from typing import Any

import numpy as np

from detdata.base.errors import ConfigError
from detdata.identity.formats import MEGATRON_DTYPES, MEGATRON_MAGIC

_TEXT_SUFFIXES = (
    ".jsonl.gz",
    ".jsonl.zst",
    ".jsonl.bz2",
    ".jsonl.xz",
    ".jsonl",
    ".parquet",
    ".arrow",
    ".feather",
    ".ipc",
)


def register(sub: Any) -> None:
    p = sub.add_parser(
        "tokenize",
        help="tokenise text shards (jsonl, parquet, arrow) into Megatron .bin/.idx or .npy",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--manifest", help="manifest of the text shards (file or URL)")
    src.add_argument("--root", help="folder of text shards (a manifest is built)")
    p.add_argument("--tokenizer", required=True, help="a tokenizer.json (nothing is downloaded)")
    p.add_argument("--field", help="the text field / column (default: recorded, else 'text')")
    p.add_argument("--bos", help="token (or id) put before each document")
    p.add_argument("--eos", help="token (or id) put after each document")
    p.add_argument(
        "--empty",
        choices=("error", "skip"),
        default="error",
        help="an empty document: an error naming it (default), or skipped (recorded)",
    )
    p.add_argument(
        "--format",
        choices=("bin", "npy"),
        default="bin",
        dest="out_format",
        help="Megatron .bin/.idx pairs (default) or .npy token files (needs --eos)",
    )
    p.add_argument("--out", required=True, help="output folder (token shards + manifest.json)")
    p.set_defaults(func=run_tokenize)


def _token(value: str | None) -> int | str | None:
    return int(value) if value is not None and value.isdigit() else value


def run_tokenize(args: argparse.Namespace) -> int:
    from detdata.datasets.text import TextDocuments
    from detdata.identity.build import build_manifest
    from detdata.identity.manifest import Manifest
    from detdata.identity.tokenizer import MANIFEST_KEY, TextTokenizer

    if args.out_format == "npy" and args.eos is None:
        raise ConfigError(
            "--format npy cuts documents at the end-of-document token; hint: pass --eos TOKEN "
            "(or use --format bin: Megatron .idx files record document boundaries)"
        )
    source = Manifest.load(args.manifest) if args.manifest else build_manifest(args.root)
    tokenizer = TextTokenizer(args.tokenizer, bos=_token(args.bos), eos=_token(args.eos))
    docs = TextDocuments(source, tokenizer, field=args.field, empty=args.empty)
    if os.path.exists(args.out) and not os.path.isdir(args.out):
        raise ConfigError(f"--out {args.out} is a file; hint: give a folder")
    os.makedirs(args.out, exist_ok=True)
    dtype = np.dtype(np.uint16 if tokenizer.vocab_size <= 1 << 16 else np.int32)
    shard_of = docs.document_shards()
    names = _output_names([s.path for s in source.shards])
    written: list[str] = []
    for s, name in enumerate(names):
        tokens = docs.tokens(np.flatnonzero(shard_of == s).tolist())
        path = os.path.join(args.out, name)
        os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
        if args.out_format == "npy":
            flat = np.concatenate(tokens) if tokens else np.empty(0, np.int64)
            np.save(path + ".npy", flat.astype(dtype))
            written.append(name + ".npy")
        else:
            write_megatron(path, tokens, dtype)
            written.extend((name + ".bin", name + ".idx"))
    metadata = {
        MANIFEST_KEY: tokenizer.identity(),
        "text": docs.policy.identity(),
        "text_manifest": source.id,
    }
    out = build_manifest(args.out, paths=written, metadata=metadata)
    out.save(os.path.join(args.out, "manifest.json"))
    summary = {
        "manifest": out.id,
        "text_manifest": source.id,
        "documents": docs.num_documents,
        "tokens": docs.num_tokens,
        "shards": len(out.shards),
        "format": args.out_format,
    }
    print(json.dumps(summary, sort_keys=True, indent=1))
    return 0


def _output_names(paths: list[str]) -> list[str]:
    """Each text shard's output stem (its text suffix dropped); `ConfigError` on a clash."""
    seen: dict[str, str] = {}  # stem -> its shard
    for p in paths:
        suffix = next((x for x in _TEXT_SUFFIXES if p.endswith(x)), "")
        stem = p[: len(p) - len(suffix)]
        if stem in seen:
            raise ConfigError(
                f"shards {seen[stem]} and {p} would both be written as {stem}; hint: rename one"
            )
        seen[stem] = p
    return list(seen)


def write_megatron(stem: str, documents: list[np.ndarray[Any, Any]], dtype: np.dtype[Any]) -> None:
    """``stem.bin`` + ``stem.idx``: a Megatron indexed dataset of one sequence per document
    (the layout `detdata.identity.formats` documents)."""
    sizes = np.array([d.size for d in documents], dtype=np.int64)
    pointers = np.zeros(sizes.size, dtype=np.int64)
    np.cumsum(sizes[:-1] * dtype.itemsize, out=pointers[1:])
    with open(stem + ".bin", "wb") as fh:
        for d in documents:
            fh.write(d.astype(dtype.newbyteorder("<")).tobytes())
    code = next(c for c, name in MEGATRON_DTYPES.items() if name == dtype.name)
    header = MEGATRON_MAGIC + struct.pack("<QBQQ", 1, code, sizes.size, sizes.size + 1)
    with open(stem + ".idx", "wb") as fh:
        fh.write(header)
        fh.write(sizes.astype("<i4").tobytes())
        fh.write(pointers.astype("<i8").tobytes())
        fh.write(np.arange(sizes.size + 1, dtype="<i8").tobytes())
