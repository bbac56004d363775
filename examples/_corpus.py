"""Small synthetic token shards for the examples (so each runs anywhere in seconds)."""

from __future__ import annotations

from pathlib import Path

import numpy as np


def write_token_shards(
    root: str | Path,
    *,
    shards: int = 4,
    tokens_per_shard: int = 50_000,
    vocab: int = 512,
    seed: int = 0,
) -> Path:
    """Write ``shards`` uint16 ``.npy`` token files under ``root`` (deterministic content)."""
    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    for i in range(shards):
        np.save(
            root / f"shard-{i:04d}.npy", rng.integers(0, vocab, tokens_per_shard, dtype=np.uint16)
        )
    return root
