"""``detdata split --manifest M --fraction F --salt S --out DIR``: materialise a split.

Builds a `detdata.Split` over the manifest's dataset (`TokenWindows` with
``--seq-len`` for token shards, `TableRows` for table shards) and writes, under ``DIR``:

* ``train_ids.npy`` and ``validation_ids.npy``: the sample ids of each side (int64, sorted);
* ``split.json``: ``{"kind": "detdata.split", "format_version": 1, "rule", "assignment",
  "validation_keys", "dataset", "num_samples", "train": {"count", "file", "blake3"},
  "validation": {...}}``, also printed on stdout. ``assignment`` is the digest of the
  assignment (the one ``Split.assignment`` holds in Python); ``blake3`` of each file lets
  a reader check the id lists. Exit 0, or 2 (bad arguments, manifest), 1 (shards fail the
  manifest's quick check).
"""

from __future__ import annotations

import argparse
import io
import json
import os
from typing import Any

import numpy as np

from detdata.base.errors import ConfigError
from detdata.base.hashing import digest_bytes

SPLIT_KIND = "detdata.split"


def register(sub: Any) -> None:
    p = sub.add_parser(
        "split",
        help="a deterministic train/validation split of a manifest's samples",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--manifest", required=True, help="manifest file or URL")
    p.add_argument("--root", help="where the shards are (default: the manifest's root)")
    p.add_argument("--fraction", required=True, help="validation fraction, e.g. 0.01 or 1/100")
    p.add_argument("--salt", required=True, help="the split's salt (any string)")
    p.add_argument(
        "--key",
        choices=("content", "id"),
        default="content",
        help="what decides a sample's side: its content's blake3 (default; survives "
        "re-sharding and moves) or its sample id (cheaper)",
    )
    p.add_argument("--seq-len", type=int, help="token shards: window length (TokenWindows)")
    p.add_argument("--no-labels", action="store_true", help="token windows without label token")
    p.add_argument("--columns", nargs="+", help="table shards: columns to key on (default: all)")
    p.add_argument("--out", required=True, help="output folder")
    p.set_defaults(func=run_split)


def dataset_for(manifest_path: str, args: argparse.Namespace) -> Any:
    from detdata.datasets.tables import TableRows
    from detdata.datasets.tokens import TokenWindows
    from detdata.identity.formats import TABLE_FORMATS
    from detdata.identity.manifest import Manifest

    manifest = Manifest.load(manifest_path, root=args.root)
    if manifest.shards and all(s.format in TABLE_FORMATS for s in manifest.shards):
        return TableRows(manifest, args.columns)
    if args.seq_len is None:
        raise ConfigError(
            f"manifest {manifest_path} holds token shards; hint: pass --seq-len N (the window "
            "length the run uses)"
        )
    return TokenWindows(manifest, args.seq_len, labels=not args.no_labels)


def run_split(args: argparse.Namespace) -> int:
    from detdata.datasets.split import Split
    from detdata.storage.atomic import atomic_write_bytes

    if os.path.exists(args.out) and not os.path.isdir(args.out):
        raise ConfigError(f"--out {args.out} is a file; hint: give a folder")
    dataset = dataset_for(args.manifest, args)
    split = Split(dataset, fraction=args.fraction, salt=args.salt, key=args.key)
    ident = split.identity()
    doc: dict[str, Any] = {
        "kind": SPLIT_KIND,
        "format_version": 1,
        "rule": ident["rule"],
        "assignment": split.assignment,
        "validation_keys": split.validation_keys,
        "dataset": ident["dataset"],
        "num_samples": dataset.num_samples,
    }
    os.makedirs(args.out, exist_ok=True)
    for part in (split.train, split.validation):
        name, buffer = f"{part.part}_ids.npy", io.BytesIO()
        np.save(buffer, part.ids.astype("<i8"), allow_pickle=False)
        data = buffer.getvalue()
        atomic_write_bytes(os.path.join(args.out, name), data)
        doc[part.part] = {"count": part.num_samples, "file": name, "blake3": digest_bytes(data)}
    text = json.dumps(doc, sort_keys=True, indent=1)
    atomic_write_bytes(os.path.join(args.out, "split.json"), (text + "\n").encode())
    print(text)
    return 0
