"""The features of the exactness matrix (`benchmarks.matrix`): each a `Setup` over real files.

Every feature's data has an epoch of exactly `EPOCH` samples (448, a step boundary of every
run) so that the "epoch boundary" resume point is the end of the data's first epoch:

* ``tokens``: `TokenWindows` (16 tokens + 1 label) over 4 local ``.npy`` shards;
* ``mixture + schedule``: a `Mixture` of two `TokenWindows` (224 windows each) whose weights
  change at position 300 (inside a step);
* ``packing``: `PackedWindows` over the `Documents` of a token shard (eod 0);
* ``exclusions``: an `Excluded` stream with one list from position 0 and one from 300;
* ``batch ramp``: `BatchSchedule.by_steps([(0, 112), (2, 224)])`;
* ``transform RNG``: a transform drawing noise from each sample's generator;
* ``remote HTTP``: `TokenWindows` over a real HTTP server on 127.0.0.1 (``tests/servers.py``),
  default reads through a shard cache in the work folder.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

import detdata

SEQ = 16
EPOCH = 448
RAMP = ((0, 112), (2, 224))
#: the global batch of every feature but the ramp
BATCH = 112
SEED = 1234


@dataclass(frozen=True)
class Setup:
    """A feature's data and loader arguments (the same for every layout)."""

    name: str
    data: Any
    schedule: int | detdata.BatchSchedule = BATCH
    transform: Callable[..., Any] | None = None
    seed: int = SEED

    def batch_of(self, step: int) -> int:
        """The global batch of ``step``."""
        if isinstance(self.schedule, int):
            return self.schedule
        return next(b for at, b in reversed(self.schedule.changes) if at <= step)


def noisy(sample: dict[str, np.ndarray], rng: np.random.Generator) -> dict[str, np.ndarray]:
    """The transform of ``transform RNG``: tokens plus noise from the sample's generator."""
    tokens = sample["tokens"].astype(np.int64)
    return {"tokens": tokens + rng.integers(0, 1000, size=tokens.shape), "draw": rng.random(2)}


def write_token_shards(folder: Path, windows: list[int], seed: int) -> detdata.Manifest:
    """``.npy`` uint16 shards holding ``windows[i]`` windows each; their manifest."""
    folder.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    for i, w in enumerate(windows):
        np.save(folder / f"s{i:02d}.npy", rng.integers(1, 60_000, w * SEQ + 1).astype(np.uint16))
    return detdata.build_manifest(str(folder), pattern="*.npy")


def tokens(manifest: detdata.Manifest | str, **kwargs: Any) -> detdata.TokenWindows:
    ds = detdata.TokenWindows(manifest, SEQ, **kwargs)
    if ds.num_samples not in (EPOCH, EPOCH // 2):
        raise ValueError(f"{ds.num_samples} windows, expected {EPOCH} or {EPOCH // 2}")
    return ds


def packed(folder: Path) -> detdata.PackedWindows:
    """Documents of 1..40 tokens (eod 0) packed into exactly `EPOCH` windows."""
    folder.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(7)
    lengths = rng.integers(1, 40, 2 * EPOCH * SEQ // 20)
    parts = [np.append(rng.integers(1, 60_000, n), 0) for n in lengths]
    stream = np.concatenate(parts).astype(np.uint16)
    size = EPOCH * SEQ + 1
    while True:
        np.save(folder / "docs.npy", stream[:size])
        docs = detdata.Documents(detdata.build_manifest(str(folder), pattern="*.npy"), eod_token=0)
        ds = detdata.PackedWindows(docs, SEQ, seed=3, index_dir=None)
        if ds.num_samples == EPOCH:
            return ds
        if ds.num_samples > EPOCH or size >= len(stream):
            raise ValueError(f"cannot size the packed corpus to {EPOCH} windows")
        size += SEQ // 2


def build(work: Path, http_url: tuple[Path, str] | None) -> dict[str, Setup]:
    """Every feature's `Setup`, its files under ``work``; ``http_url`` = (a folder an HTTP server
    on 127.0.0.1 serves, its URL), or None to leave out ``remote HTTP``."""
    base = write_token_shards(work / "tokens", [112] * 4, seed=1)
    plain = tokens(base)
    setups = {
        "tokens": Setup("tokens", plain),
        "mixture + schedule": Setup(
            "mixture + schedule",
            detdata.Mixture(
                {
                    "a": tokens(write_token_shards(work / "a", [112, 112], seed=2)),
                    "b": tokens(write_token_shards(work / "b", [112, 112], seed=3)),
                },
                schedule=[(0, {"a": 1, "b": 1}), (300, {"a": 1, "b": 3})],
                seed=5,
            ),
        ),
        "packing": Setup("packing", packed(work / "packed")),
        "exclusions": Setup(
            "exclusions",
            detdata.Excluded(
                plain,
                [
                    (0, detdata.ExclusionList.of([3, 17, 40])),
                    (300, detdata.ExclusionList.of([5, 99])),
                ],
                seed=9,
            ),
        ),
        "batch ramp": Setup("batch ramp", plain, schedule=detdata.BatchSchedule.by_steps(RAMP)),
        "transform RNG": Setup("transform RNG", plain, transform=noisy),
    }
    if http_url is not None:
        folder, url = http_url
        manifest = write_token_shards(folder, [112] * 4, seed=1)
        storage = detdata.Storage(cache_dir=work / "cache")
        setups["remote HTTP"] = Setup(
            "remote HTTP", tokens(manifest.with_root(url), storage=storage)
        )
    return setups


FEATURES: tuple[str, ...] = (
    "tokens",
    "mixture + schedule",
    "packing",
    "exclusions",
    "batch ramp",
    "transform RNG",
    "remote HTTP",
)
