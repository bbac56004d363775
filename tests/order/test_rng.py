"""Counter-based randomness (`detdata.order.rng`) against its documented derivation: the Philox
key of a sample is blake3(``detdata:sample-rng-v1``, u64le seed, u64le position) (16 bytes,
little endian), a worker's seed blake3(``detdata:worker-seed-v1``, seed, rank, worker) (8
bytes); computed here with blake3 and numpy directly."""

from __future__ import annotations

import struct

import blake3
import numpy as np
from hypothesis import given
from hypothesis import strategies as st

from detdata.order.rng import sample_rng, worker_seed

U64 = st.integers(0, (1 << 64) - 1)


def reference_rng(seed: int, position: int) -> np.random.Generator:
    material = b"detdata:sample-rng-v1" + struct.pack("<2Q", seed, position)
    key = int.from_bytes(blake3.blake3(material).digest(length=16), "little")
    return np.random.Generator(np.random.Philox(key=key))


@given(seed=U64, position=st.integers(0, (1 << 62) - 1))
def test_a_sample_stream_is_the_documented_philox_stream(seed: int, position: int) -> None:
    got, want = sample_rng(seed, position), reference_rng(seed, position)
    assert got.integers(0, 1 << 62, 8).tolist() == want.integers(0, 1 << 62, 8).tolist()
    assert got.random() == want.random()


def test_each_call_starts_the_stream_anew_and_positions_do_not_share_it() -> None:
    first = sample_rng(5, 17).integers(0, 1 << 62, 4).tolist()
    assert sample_rng(5, 17).integers(0, 1 << 62, 4).tolist() == first  # on any rank or resume
    others = {tuple(sample_rng(s, p).integers(0, 1 << 62, 4).tolist()) for s, p in
              [(5, 16), (5, 18), (6, 17), (17, 5)]}  # fmt: skip
    assert tuple(first) not in others and len(others) == 4


@given(seed=U64, rank=st.integers(0, 4096), worker=st.integers(0, 1024))
def test_a_worker_seed_is_the_documented_hash(seed: int, rank: int, worker: int) -> None:
    material = b"detdata:worker-seed-v1" + struct.pack("<3Q", seed, rank, worker)
    want = int.from_bytes(blake3.blake3(material).digest(length=8), "little")
    assert worker_seed(seed, rank, worker) == want
