"""`DataLoader.tokens_consumed()`: tokens per source of what reached the callers (issue 14).

Two token corpora whose token values do not overlap (source ``web`` < 1000 <= ``code``),
so the source of every delivered window is read back from its tokens; the reference is a
count over the batches every rank delivered.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

import detdata
from detdata.base.errors import ConfigError
from detdata.loading.loader import DataLoader
from detdata.order.batches import BatchSchedule

SEQ = 8


def corpus(root: Path, name: str, low: int, high: int, seed: int) -> detdata.TokenWindows:
    d = root / name
    d.mkdir()
    rng = np.random.default_rng(seed)
    for s in range(2):
        np.save(d / f"s{s}.npy", rng.integers(low, high, size=300 + 50 * s).astype(np.uint16))
    return detdata.TokenWindows(detdata.build_manifest(str(d), pattern="*.npy"), SEQ)


@pytest.fixture(scope="module")
def sources(tmp_path_factory: pytest.TempPathFactory) -> dict[str, detdata.TokenWindows]:
    root = tmp_path_factory.mktemp("tokens")
    return {"web": corpus(root, "web", 0, 1000, 1), "code": corpus(root, "code", 1000, 2000, 2)}


def count(batches: list[dict[str, object]]) -> dict[str, int]:
    """Input tokens (``seq_len`` per window: the label token is not a training token) per
    source, told apart by the token values."""
    out = {"web": 0, "code": 0}
    for batch in batches:
        tokens = np.asarray(batch["tokens"])
        for row in tokens:
            out["web" if int(row.max()) < 1000 else "code"] += len(row) - 1
    return out


@pytest.mark.parametrize("gbs", [8, BatchSchedule.by_steps([(0, 4), (3, 8)])])
def test_tokens_consumed_per_source_counts_the_delivered_batches(
    sources: dict[str, detdata.TokenWindows], gbs: int | BatchSchedule
) -> None:
    mixture = detdata.Mixture(sources, {"web": "3/4", "code": "1/4"}, seed=5)
    loaders = [
        DataLoader(mixture, global_batch_size=gbs, micro_batch_size=2, seed=1, rank=r, world_size=2)
        for r in range(2)
    ]
    iters = [iter(dl) for dl in loaders]
    seen: list[dict[str, object]] = []
    for n in range(1, 16):
        for it in iters:  # every rank delivers its micro batch of the micro step
            seen.append(next(it))
        expected = count(seen)
        for dl in loaders:  # each rank counts the samples delivered on all ranks
            assert dl.tokens_consumed() == expected, n
    assert sum(expected.values()) == loaders[0].samples_consumed * SEQ


def test_tokens_consumed_of_one_dataset_and_across_a_resume(
    sources: dict[str, detdata.TokenWindows],
) -> None:
    dl = DataLoader(sources["code"], global_batch_size=6, micro_batch_size=3, seed=2)
    batches = [b for _, b in zip(range(5), dl, strict=False)]
    assert dl.tokens_consumed() == {"token_windows": count(batches)["code"]}
    again = DataLoader(sources["code"], global_batch_size=6, micro_batch_size=3, seed=2)
    again.load_state_dict(dl.state_dict(), mid_step="continue")
    assert again.tokens_consumed() == dl.tokens_consumed()


def test_tokens_consumed_needs_fixed_length_samples() -> None:
    rows = detdata.ArrayDataset({"x": np.arange(10)}, name="rows")
    with pytest.raises(ConfigError, match=r"source 'rows' \(ArrayDataset\).*tokens_per_sample"):
        DataLoader(rows, global_batch_size=2).tokens_consumed()
