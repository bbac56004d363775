"""Hash a directory (or bucket URL) of shards and register the manifest under a name.

    python examples/register_shards.py ROOT NAME@VERSION [--registry DIR] [--pattern '**/*.npy']

ROOT may be a local path or any fsspec URL (s3://bucket/prefix, http://host/dir
with a manifest of known paths, gs://...). Without ROOT, a small local corpus is
created first.
"""

from __future__ import annotations

import argparse
import json
import tempfile

from _corpus import write_token_shards

import detdata


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("root", nargs="?")
    ap.add_argument("name", nargs="?", default="example-corpus@v1")
    ap.add_argument(
        "--registry", default=None, help="registry dir/URL (default: $DETDATA_REGISTRY or cache)"
    )
    ap.add_argument("--pattern", default="**/*.npy")
    args = ap.parse_args()
    root = args.root or str(write_token_shards(tempfile.mkdtemp(prefix="detdata-shards-")))
    manifest = detdata.build_manifest(
        root,
        pattern=args.pattern,
        metadata={"tokenizer": "synthetic-512", "description": "example"},
    )
    registry = detdata.Registry(args.registry)
    manifest_id = registry.register(args.name, manifest)
    resolved = registry.resolve(args.name)  # verifies sizes + quick digests under the recorded root
    print(
        json.dumps(
            {
                "name": args.name,
                "id": manifest_id,
                "root": resolved.root,
                "shards": len(resolved.shards),
                "tokens": resolved.num_samples,
            }
        )
    )


if __name__ == "__main__":
    main()
