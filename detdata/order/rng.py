"""Counter-based randomness derived by hashing (docs/design.md section 4): the same global
position gets the same random stream on any rank, worker or resume.
"""

from __future__ import annotations

import numpy as np

from detdata.base.keys import derive, derive_u64


def sample_rng(seed: int, position: int) -> np.random.Generator:
    """Generator for the sample at global ``position`` under ``seed``: ``Philox`` keyed by
    blake3(``"detdata:sample-rng-v1"``, seed, position)."""
    key = int.from_bytes(derive(b"detdata:sample-rng-v1", seed, position, length=16), "little")
    return np.random.Generator(np.random.Philox(key=key))


def worker_seed(seed: int, rank: int, worker: int) -> int:
    """64-bit seed for the global generators (python, numpy, torch) of worker ``worker`` of
    rank ``rank``."""
    return derive_u64(b"detdata:worker-seed-v1", seed, rank, worker)
