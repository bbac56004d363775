"""`DataLoader.tokens_consumed()`: tokens per source of what reached the callers (issue 14).

Two token corpora whose token values do not overlap (source ``web`` < 1000 <= ``code``),
so the source of every delivered window is read back from its tokens; the reference is a
count over the batches every rank delivered.

Covers: detdata/loading/token_counts.py.
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
        DataLoader(
            mixture,
            global_batch_size=gbs,
            micro_batch_size=2,
            seed=1,
            options=detdata.LoaderOptions(rank=r, world_size=2),
        )
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


@pytest.fixture(scope="module")
def padded(tmp_path_factory: pytest.TempPathFactory) -> detdata.PackedWindows:
    """Documents packed into 16-token windows with ``tail="pad"``: the last window of each
    epoch holds padding (doc_index -1)."""
    root = tmp_path_factory.mktemp("padded")
    rng = np.random.default_rng(29)
    tokens = rng.integers(1, 500, size=203).astype(np.uint16)
    tokens[rng.choice(203, size=20, replace=False)] = 0  # eod
    np.save(root / "s.npy", tokens)
    documents = detdata.Documents(detdata.build_manifest(str(root)), eod_token=0)
    packed = detdata.PackedWindows(documents, 16, seed=3, tail="pad", pad_id=0)
    assert packed.padding_tokens(), "the corpus must leave a padded tail"
    return packed


def real_inputs(batches: list[dict[str, object]], seq_len: int) -> int:
    """Input tokens that are not padding, read from the delivered ``doc_index`` column."""
    return sum(int((np.asarray(b["doc_index"])[:, :seq_len] >= 0).sum()) for b in batches)


def test_tokens_consumed_does_not_count_padding(padded: detdata.PackedWindows) -> None:
    dl = DataLoader(padded, global_batch_size=4, micro_batch_size=2, seed=7)
    seen: list[dict[str, object]] = []
    for batch in zip(range(3 * padded.num_samples // 2 + 3), dl, strict=False):
        seen.append(batch[1])
        assert dl.tokens_consumed() == {"packed_windows": real_inputs(seen, 16)}, len(seen)
    assert dl.samples_consumed >= 3 * padded.num_samples  # three epochs: the pad window thrice


def test_tokens_consumed_of_a_mixture_of_padded_sources(padded: detdata.PackedWindows) -> None:
    width = 8  # one max_segments for both sources (their columns must agree)
    a, b = (
        detdata.PackedWindows(
            padded.documents, 16, seed=s, tail="pad", pad_id=0, max_segments=width
        )
        for s in (3, 4)
    )
    mixture = detdata.Mixture({"a": a, "b": b}, {"a": "1/2", "b": "1/2"}, seed=1)
    dl = DataLoader(mixture, global_batch_size=4, micro_batch_size=4, seed=7)
    seen = [b for _, b in zip(range(20), dl, strict=False)]
    assert sum(dl.tokens_consumed().values()) == real_inputs(seen, 16)
