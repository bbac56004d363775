"""Counter-based randomness derived by hashing (docs/design.md section 4): the same global
position gets the same random stream on any rank, worker or resume.
"""

from __future__ import annotations

from typing import Final

import numpy as np

from detdata.base.keys import derive

SAMPLE_RNG: Final = "sample-rng-v1"


def _hash_u64s(tag: str, *values: int, length: int = 8) -> bytes:
    return derive(f"detdata:{tag}".encode(), *values, length=length)


def sample_rng(seed: int, position: int) -> np.random.Generator:
    """Generator for the sample at global ``position`` under ``seed``: ``Philox`` keyed by
    blake3(``"detdata:sample-rng-v1"``, seed, position)."""
    key = int.from_bytes(_hash_u64s(SAMPLE_RNG, seed, position, length=16), "little")
    return np.random.Generator(np.random.Philox(key=key))


def worker_seed(seed: int, rank: int, worker: int) -> int:
    """64-bit seed for the global generators (python, numpy, torch) of worker ``worker`` of
    rank ``rank``."""
    return int.from_bytes(_hash_u64s("worker-seed-v1", seed, rank, worker), "little")
