"""locality-v1 through `OrderedStream` and `DataLoader`: what is delivered, resume at every
step, elastic resume, worker processes, and the checked ``algorithm`` field.

Expected samples come from the independent reference of ``tests/order/test_locality.py``
(`ref_epoch`), read from the real ``.npy`` / Parquet shards by the datasets themselves.
"""

from __future__ import annotations

import json

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

import detdata
from detdata import LocalityOrder, Order
from detdata.base.errors import ConfigError, StateError
from tests.order.test_locality import ref_epoch
from tests.resume_checker import check_resume_everywhere, take

SEQ = 4
SEED = 21
TOKENS_PER_SHARD = (41, 3, 90, 17, 60, 2, 33, 25)  # windows: 10, 0, 22, 4, 14, 0, 8, 6


@pytest.fixture(scope="module")
def tokens(tmp_path_factory: pytest.TempPathFactory) -> detdata.TokenWindows:
    root = tmp_path_factory.mktemp("locality-tokens")
    for s, size in enumerate(TOKENS_PER_SHARD):
        np.save(root / f"s{s:02d}.npy", (np.arange(size, dtype=np.int32) + 1000 * s))
    manifest = detdata.build_manifest(str(root), pattern="*.npy")
    return detdata.TokenWindows(manifest, SEQ, allow_short_shards=True)


@pytest.fixture(scope="module")
def table(tmp_path_factory: pytest.TempPathFactory) -> detdata.TableRows:
    root = tmp_path_factory.mktemp("locality-table")
    for s, rows in enumerate((30, 7, 0, 45, 12)):
        x = np.arange(rows, dtype=np.int64) + 100 * s
        pq.write_table(pa.table({"x": x}), root / f"t{s}.parquet", row_group_size=10)
    manifest = detdata.build_manifest(str(root), pattern="*.parquet")
    return detdata.TableRows(manifest, ["x"])


def loader(ds: detdata.Dataset, k: int = 2, **kw: object) -> detdata.DataLoader:
    args: dict[str, object] = {"global_batch_size": 8, "micro_batch_size": 4, "seed": SEED}
    args.update(kw)
    return detdata.DataLoader(ds, order=LocalityOrder(window_shards=k), **args)  # type: ignore[arg-type]


def expected_ids(ds: detdata.Dataset, k: int, count: int) -> list[int]:
    sizes = list(ds.shard_sizes)  # type: ignore[attr-defined]
    n = sum(sizes)
    out: list[int] = []
    epoch = 0
    while len(out) < count:
        out += ref_epoch(sizes, k, SEED, epoch)
        epoch += 1
    assert n == ds.num_samples
    return out[:count]


def test_shard_sizes_of_the_datasets(
    tokens: detdata.TokenWindows, table: detdata.TableRows
) -> None:
    assert tokens.shard_sizes == tuple(max(0, (t - 1) // SEQ) for t in TOKENS_PER_SHARD)
    assert table.shard_sizes == (30, 7, 0, 45, 12)


@pytest.mark.parametrize("k", [1, 3, 100])
def test_delivers_the_reference_order(tokens: detdata.TokenWindows, k: int) -> None:
    """Three epochs (64 windows each): every batch is the reference's ids, read from disk."""
    steps = 3 * tokens.num_samples // 8
    got = torch.cat([b["tokens"] for b in take(loader(tokens, k), 2 * steps)])
    ids = np.array(expected_ids(tokens, k, 8 * steps))
    np.testing.assert_array_equal(got.numpy(), tokens.read(ids)["tokens"])


def test_table_rows_in_the_reference_order(table: detdata.TableRows) -> None:
    got = torch.cat([b["x"] for b in take(loader(table, 2), 30)])
    ids = np.array(expected_ids(table, 2, 120))
    np.testing.assert_array_equal(got.numpy(), table.read(ids)["x"])


def test_resume_at_every_step(tokens: detdata.TokenWindows) -> None:
    check_resume_everywhere(lambda: loader(tokens, 2), 40)


def test_elastic_resume_into_two_ranks(tokens: detdata.TokenWindows) -> None:
    """Saved at one rank, resumed at two ranks with another micro batch: the two ranks'
    micro batches, interleaved, are the one-rank run's next steps."""
    one = loader(tokens, 3)
    list(take(one, 6))
    state = json.loads(json.dumps(one.state_dict()))
    straight = torch.cat([b["tokens"] for b in take(one, 8)])
    ranks = []
    for r in range(2):
        part = loader(
            tokens, 3, micro_batch_size=2, options=detdata.LoaderOptions(rank=r, world_size=2)
        )
        part.load_state_dict(state)
        ranks.append([b["tokens"] for b in take(part, 8)])
    interleaved = torch.cat([ranks[r][i] for i in range(8) for r in range(2)])
    assert torch.equal(interleaved, straight)


def test_worker_processes_deliver_the_same(tokens: detdata.TokenWindows) -> None:
    plain = [b["tokens"] for b in take(loader(tokens, 2), 12)]
    workers = [
        b["tokens"]
        for b in take(
            loader(
                tokens,
                2,
                num_workers=2,
                options=detdata.LoaderOptions(read=detdata.ReadOptions(batches_ahead=2)),
            ),
            12,
        )
    ]
    assert all(torch.equal(a, b) for a, b in zip(plain, workers, strict=True))


def test_identity_names_the_order_and_its_window(tokens: detdata.TokenWindows) -> None:
    state = loader(tokens, 2).state_dict()
    assert state["algorithm"] == ["locality-v1(window_shards=2)"]
    assert detdata.DataLoader(tokens, global_batch_size=8).state_dict()["algorithm"] == [
        "feistel-v1"
    ]
    stream = detdata.OrderedStream(tokens, 5, order=Order.LOCALITY_V1)
    assert stream.identity()["algorithm"] == "locality-v1(window_shards=8)"


@pytest.mark.parametrize(
    "other", [LocalityOrder(window_shards=3), Order.FEISTEL_V1, "feistel-v1", None]
)
def test_resume_with_another_order_is_refused(tokens: detdata.TokenWindows, other: object) -> None:
    saved = loader(tokens, 2)
    list(take(saved, 3))
    state = saved.state_dict()
    kw = {} if other is None else {"order": other}
    fresh = detdata.DataLoader(tokens, global_batch_size=8, micro_batch_size=4, seed=SEED, **kw)  # type: ignore[arg-type]
    with pytest.raises(StateError, match="algorithm") as info:
        fresh.load_state_dict(state)
    assert set(info.value.fields) == {"algorithm"}
    assert fresh.samples_consumed == 0


def test_order_needs_a_sharded_dataset() -> None:
    arrays = detdata.ArrayDataset({"x": np.arange(10)})
    with pytest.raises(ConfigError, match="shard_sizes"):
        detdata.DataLoader(arrays, global_batch_size=2, order=LocalityOrder())
    detdata.DataLoader(arrays, global_batch_size=2, order=Order.FEISTEL_V1)  # fine


def test_order_with_a_stream_is_refused(tokens: detdata.TokenWindows) -> None:
    stream = detdata.OrderedStream(tokens, 1)
    with pytest.raises(ConfigError, match="stream with its own order"):
        detdata.DataLoader(stream, global_batch_size=8, order=LocalityOrder())
    with pytest.raises(ConfigError, match="order must be one of"):
        detdata.DataLoader(tokens, global_batch_size=8, order="random")


def test_provenance_inverts_a_locality_stream(tokens: detdata.TokenWindows) -> None:
    """Where a sample was seen (`positions_seen`) finds the order's own inverse."""
    provenance = pytest.importorskip("detdata.loading.provenance")
    stream = detdata.OrderedStream(tokens, SEED, order=LocalityOrder(window_shards=3))
    n = tokens.num_samples
    ids = np.asarray(expected_ids(tokens, 3, 3 * n))
    for sample in (0, 7, n - 1):
        seen = provenance.positions_seen(stream, None, sample, until=3 * n)
        np.testing.assert_array_equal(seen, np.flatnonzero(ids == sample))
