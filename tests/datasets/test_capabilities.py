"""Declared capabilities (`detdata.datasets.capabilities`): every built-in type declares what
this file's own list says it provides; a stream with only the three `Stream` methods loads,
resumes and traces; a call that needs a capability such a stream lacks raises
`CapabilityError` naming the capability (and the member) and the type; a custom stream that
declares a capability gets the feature, whatever its class, and a custom dataset that
subclasses `DatasetInfo` gets the features of the members it overrides (defaults otherwise).

References: the list below (written from the types' documented contracts, not computed from
the code), an uninterrupted run for the resume, and counts computed here by hand.

Covers: detdata/datasets/origins.py.
"""

from __future__ import annotations

import pickle
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

import detdata
from detdata.base.errors import CapabilityError, ConfigError, DetdataError
from detdata.datasets import capabilities as caps
from detdata.datasets.capabilities import Origins
from detdata.datasets.documents import Documents
from detdata.datasets.exclusions import Excluded, ExclusionList
from detdata.datasets.packed import PackedWindows
from detdata.datasets.split import Split, SplitKey
from detdata.datasets.streams import OrderedStream
from detdata.loading.token_counts import tokens_consumed
from detdata.order.choice import LocalityOrder
from detdata.order.feistel import GlobalOrder
from detdata.order.locality import WindowedOrder
from tests.datasets.doc_corpora import random_documents, write_megatron

ALL = (caps.HasOrigins, caps.ContinuesFrom, caps.Reweights, caps.ReadsAhead, caps.DatasetInfo)

#: What each built-in type provides (from their documented contracts; the one list).
EXPECTED: dict[str, set[str]] = {
    "ArrayDataset": set(),
    "TokenWindows": {"ReadsAhead", "DatasetInfo"},
    "TableRows": {"DatasetInfo"},
    "Documents": set(),
    "PackedWindows": {"DatasetInfo"},
    "SplitPart": set(),
    "OrderedStream": {"ReadsAhead", "HasOrigins"},
    "Mixture": {"HasOrigins", "ContinuesFrom", "Reweights"},
    "Excluded": {"HasOrigins", "ContinuesFrom", "Reweights"},
    "GlobalOrder": set(),
    "WindowedOrder": set(),
}

#: The `DatasetInfo` members each dataset answers (not None / overridden): the rest default.
INFO: dict[str, set[str]] = {
    "ArrayDataset": set(),
    "TokenWindows": {"tokens_per_sample", "shard_sizes", "schema", "use_order"},
    "TableRows": {"shard_sizes", "row_group_sizes", "schema", "use_order"},
    "Documents": set(),
    "PackedWindows": {"tokens_per_sample", "schema", "provenance"},
    "SplitPart": set(),
}


class Minimal:
    """A stream with only the three `Stream` methods: position ``g`` delivers ``[g, g*g]``."""

    def fetch(self, positions: Any) -> dict[str, np.ndarray]:
        p = np.asarray(positions, dtype=np.int64).reshape(-1)
        return {"x": np.stack([p, p * p], axis=1)}

    def sample_ids(self, positions: Any) -> np.ndarray:
        return np.asarray(positions, dtype=np.int64)

    def identity(self) -> dict[str, Any]:
        return {"type": "minimal"}


def _expected_x(positions: range) -> list[list[int]]:
    return [[g, g * g] for g in positions]


@pytest.fixture(scope="module")
def built(tmp_path_factory: pytest.TempPathFactory) -> dict[str, object]:
    """One instance of every built-in type, over real files."""
    root = tmp_path_factory.mktemp("caps")
    (root / "tok").mkdir()
    for s in range(3):
        np.save(root / "tok" / f"s{s}.npy", np.arange(50, dtype=np.int32) + 100 * s)
    (root / "tab").mkdir()
    pq.write_table(
        pa.table({"v": pa.array(range(20))}), root / "tab" / "a.parquet", row_group_size=5
    )
    (root / "doc").mkdir()
    rng = np.random.default_rng(3)
    write_megatron(root / "doc" / "a", random_documents(rng, 40, max_len=30, empty=False))
    arrays = detdata.ArrayDataset({"x": np.arange(10)}, name="arrays")
    tokens = detdata.TokenWindows(
        detdata.build_manifest(str(root / "tok")), 8, storage=detdata.Storage(cache_dir=None)
    )
    table = detdata.TableRows(detdata.build_manifest(str(root / "tab")))
    docs = Documents(detdata.build_manifest(str(root / "doc")))
    packed = PackedWindows(docs, 16, index_dir=None)
    split = Split(arrays, fraction="1/2", salt="s", key=SplitKey.ID)
    mixture = detdata.Mixture(
        {"a": arrays, "t": detdata.ArrayDataset({"x": np.arange(7)})}, {"a": 1, "t": 1}, seed=1
    )
    return {
        "ArrayDataset": arrays,
        "TokenWindows": tokens,
        "TableRows": table,
        "Documents": docs,
        "PackedWindows": packed,
        "SplitPart": split.train,
        "OrderedStream": OrderedStream(arrays, 3),
        "Mixture": mixture,
        "Excluded": Excluded(arrays, ExclusionList.of([1]), seed=3),
        "GlobalOrder": GlobalOrder(10, 3),
        "WindowedOrder": WindowedOrder([4, 6], 3, window_shards=1),
    }


def test_every_builtin_type_declares_the_capabilities_of_the_list(
    built: dict[str, object],
) -> None:
    assert set(built) == set(EXPECTED)
    for name, obj in built.items():
        assert type(obj).__name__ == name
        found = {p.__name__ for p in ALL if isinstance(obj, p)}
        assert found == EXPECTED[name], name


def test_every_capability_is_named_in_the_error_table() -> None:
    assert set(caps.MEMBERS) == set(ALL)


def _answers(obj: object) -> set[str]:
    """The `DatasetInfo` members ``obj`` answers, through `caps.info` (defaults otherwise)."""
    facts = caps.info(obj)
    found = {
        m
        for m in ("tokens_per_sample", "shard_sizes", "row_group_sizes")
        if getattr(facts, m) is not None
    }
    found |= {"schema"} if facts.schema() is not None else set()
    found |= {"provenance"} if facts.provenance(np.zeros(1, dtype=np.int64)) is not None else set()
    overridden = type(facts).use_order is not caps.DatasetInfo.use_order
    return found | ({"use_order"} if overridden else set())


def test_every_builtin_dataset_answers_the_members_of_the_list(built: dict[str, object]) -> None:
    for name, members in INFO.items():
        assert _answers(built[name]) == members, name


def _loader(stream: object, **kw: Any) -> Any:
    return detdata.DataLoader(stream, global_batch_size=4, micro_batch_size=2, **kw)


def test_a_stream_of_only_the_three_methods_loads_resumes_and_traces(tmp_path: Path) -> None:
    full = _loader(Minimal(), options=detdata.LoaderOptions(trace=str(tmp_path / "t.jsonl")))
    it = iter(full)
    batches = [next(it)["x"].tolist() for _ in range(6)]
    assert [r for b in batches for r in b] == _expected_x(range(12))  # world 1: in order
    half = _loader(Minimal())
    it = iter(half)
    for _ in range(4):  # two whole steps of two micro batches
        next(it)
    state = half.state_dict()
    resumed = _loader(Minimal())
    resumed.load_state_dict(state)
    it = iter(resumed)
    assert [next(it)["x"].tolist() for _ in range(2)] == batches[4:]
    full.close()
    assert len((tmp_path / "t.jsonl").read_text().splitlines()) == 6


def _assert_names(err: CapabilityError, capability: str, kind: str) -> None:
    assert err.capability == capability and err.kind == kind
    assert capability in str(err) and kind in str(err) and "hint:" in str(err)
    assert isinstance(err, ConfigError) and isinstance(err, TypeError)
    assert isinstance(err, DetdataError)
    again = pickle.loads(pickle.dumps(err))
    assert type(again) is CapabilityError and again.capability == capability


def test_calls_that_need_a_capability_the_stream_lacks_name_it() -> None:
    loader = _loader(Minimal())
    with pytest.raises(CapabilityError) as err:
        loader.tokens_consumed()
    _assert_names(err.value, "HasOrigins", "Minimal")
    with pytest.raises(CapabilityError) as err:
        loader.provenance(0)
    _assert_names(err.value, "HasOrigins", "Minimal")
    with pytest.raises(CapabilityError) as err:
        Excluded(Minimal(), ExclusionList.of([1]))
    _assert_names(err.value, "HasOrigins", "Minimal")
    with pytest.raises(CapabilityError) as err:
        loader.positions_seen(None, 0, until=8)
    assert err.value.kind == "Minimal" and "Minimal" in str(err.value)


def test_calls_that_need_a_dataset_capability_name_it() -> None:
    arrays = detdata.ArrayDataset({"x": np.arange(10)})
    with pytest.raises(CapabilityError) as err:
        OrderedStream(arrays, 0, order=LocalityOrder(window_shards=2))
    _assert_names(err.value, "DatasetInfo", "ArrayDataset")
    assert ".shard_sizes" in str(err.value)
    with pytest.raises(CapabilityError) as err:
        OrderedStream(arrays, 0, order=LocalityOrder(window_row_groups=2))
    _assert_names(err.value, "DatasetInfo", "ArrayDataset")
    assert ".row_group_sizes" in str(err.value)
    with pytest.raises(CapabilityError) as err:
        _loader(arrays).tokens_consumed()
    _assert_names(err.value, "DatasetInfo", "ArrayDataset")
    assert ".tokens_per_sample" in str(err.value)


def test_a_member_a_declaring_dataset_leaves_at_its_default_is_named(
    built: dict[str, object],
) -> None:
    """`TokenWindows` declares `DatasetInfo` but has no row groups: the order that needs
    them names the member and the type."""
    with pytest.raises(CapabilityError) as err:
        OrderedStream(built["TokenWindows"], 0, order=LocalityOrder(window_row_groups=2))  # type: ignore[arg-type]
    _assert_names(err.value, "DatasetInfo", "TokenWindows")
    assert "TokenWindows does not provide .row_group_sizes" in str(err.value)


class Windows(caps.DatasetInfo):
    """A custom dataset (only the `DatasetInfo` base with its defaults): sample ``i`` is 3
    tokens; it says where. Its identity's ``name`` keys its token count."""

    @property
    def tokens_per_sample(self) -> int:
        return 3

    @property
    def num_samples(self) -> int:
        return 9

    def read(self, ids: Any) -> dict[str, np.ndarray]:
        i = np.asarray(ids, dtype=np.int64).reshape(-1)
        return {"t": np.stack([i, i + 1, i + 2], axis=1)}

    def identity(self) -> dict[str, Any]:
        return {"type": "windows", "name": "custom"}

    def provenance(self, ids: Any) -> list[Mapping[str, Any]]:
        return [{"where": f"row {int(i)}"} for i in np.asarray(ids).reshape(-1)]


class Custom:
    """A custom stream (no detdata base class) over `Windows`, reversed: it declares
    `HasOrigins`."""

    def __init__(self) -> None:
        self.dataset = Windows()

    def sample_ids(self, positions: Any) -> np.ndarray:
        return 8 - np.asarray(positions, dtype=np.int64) % 9

    def fetch(self, positions: Any) -> dict[str, np.ndarray]:
        return self.dataset.read(self.sample_ids(positions).reshape(-1))

    def identity(self) -> dict[str, Any]:
        return {"type": "custom", "dataset": self.dataset.identity()}

    def origins(self, positions: Any) -> Origins:
        pos = np.asarray(positions, dtype=np.int64).reshape(-1)
        return Origins(
            names=(None,),
            datasets=(self.dataset,),
            source=np.zeros(pos.size, dtype=np.int64),
            ids=self.sample_ids(pos),
            notes=(None,) * pos.size,
        )


def test_a_custom_stream_that_declares_capabilities_gets_the_features() -> None:
    loader = _loader(Custom())
    it = iter(loader)
    for _ in range(3):
        next(it)
    assert loader.tokens_consumed() == {"custom": 6 * 3}  # 6 samples of 3 tokens
    records = loader.provenance(1)  # positions 4..7: ids 4, 3, 2, 1
    assert [r.sample_id for r in records] == [4, 3, 2, 1]
    assert [r.location for r in records] == [{"where": f"row {i}"} for i in (4, 3, 2, 1)]
    excluded = Excluded(Custom(), ExclusionList.of([3]), seed=0)
    ids = excluded.sample_ids(np.arange(9))
    assert 3 not in ids.tolist()
    assert [int(i) for j, i in enumerate(ids) if j != 5] == [8 - j for j in range(9) if j != 5]


def test_optional_capabilities_fall_back_to_their_documented_default() -> None:
    calls: list[object] = []

    class Hinted(Minimal):
        def read_ahead(self, positions: Any) -> None:
            calls.append(positions)

    caps.hint_read_ahead(Minimal(), np.arange(3))  # no hint taken: nothing happens
    caps.hint_read_ahead(Hinted(), np.arange(3))
    assert len(calls) == 1 and calls[0].tolist() == [0, 1, 2]  # type: ignore[attr-defined]
    plain = detdata.ArrayDataset({"x": np.arange(6)})
    records = _loader(plain).provenance(0)
    assert [dict(r.location) for r in records] == [{}] * 4  # provenance() None: no location


class Longer(Windows):
    """`Windows` whose samples count 5 tokens."""

    @property
    def tokens_per_sample(self) -> int:
        return 5


class TwoSources:
    """A custom stream over two named datasets (no `Mixture`): position ``g`` reads source
    ``"short"`` when ``g % 3 == 0``, else ``"long"``; it declares `HasOrigins` only."""

    def __init__(self) -> None:
        self.short, self.long = Windows(), Longer()

    def sample_ids(self, positions: Any) -> np.ndarray:
        return np.asarray(positions, dtype=np.int64) % 9

    def fetch(self, positions: Any) -> dict[str, np.ndarray]:
        return self.short.read(self.sample_ids(positions).reshape(-1))

    def identity(self) -> dict[str, Any]:
        return {"type": "two-sources"}

    def origins(self, positions: Any) -> Origins:
        pos = np.asarray(positions, dtype=np.int64).reshape(-1)
        return Origins(
            names=("short", "long"),
            datasets=(self.short, self.long),
            source=(pos % 3 != 0).astype(np.int64),
            ids=self.sample_ids(pos),
            notes=(None,) * pos.size,
        )


def test_a_custom_stream_over_several_sources_counts_tokens_from_its_origins() -> None:
    """No `Mixture.consumed` to ask: the positions are counted from ``origins`` in chunks
    (more than one here); the reference is counted by hand (every third position short)."""
    stream = TwoSources()
    for consumed in (0, 1, 7, 2_500_001):
        short = (consumed + 2) // 3  # positions 0, 3, 6, ... below consumed
        assert tokens_consumed(stream, consumed) == {
            "short": 3 * short,
            "long": 5 * (consumed - short),
        }
