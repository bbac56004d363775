"""Shared, generic fixtures."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest


def write_token_shards(root: Path, sizes: tuple[int, ...] = (1000, 2500, 40),
                       dtype: str = "uint16", seed: int = 0) -> list[Path]:
    """Write ``shard-XXX.npy`` 1-D token files of the given sizes under ``root``; return their paths."""
    root.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    paths = []
    for i, size in enumerate(sizes):
        path = root / f"shard-{i:03d}.npy"
        np.save(path, rng.integers(0, 50_000, size=size).astype(dtype))
        paths.append(path)
    return paths


@pytest.fixture
def token_shards(tmp_path: Path) -> Path:
    """A directory ``tmp_path/data`` holding three small uint16 ``.npy`` token shards."""
    root = tmp_path / "data"
    write_token_shards(root)
    return root
