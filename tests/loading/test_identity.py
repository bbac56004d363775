"""Identity: every input that changes a delivered byte is a checked field of the loader state.

One table lists every constructor parameter of the public datasets, streams and
the loader. For a parameter that changes bytes, a state saved with the base value
must be refused by a loader built with the changed value, naming the field; allowed
by that name, the loader resumes at the saved position and then delivers what a
fresh run of the changed configuration delivers there (the independent reference),
which differs from what the base run delivers (so the table entry is real). For a
parameter that does not change bytes, the resume is accepted silently and continues
exactly the uninterrupted base run.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

import detdata
from tests.resume_checker import batch_bytes, take

GBS, MICRO = 8, 4
SAVE_AFTER = 4  # micro batches (2 global steps), then compare the next 2 global steps
COMPARE = 4


def add_one(sample: dict[str, np.ndarray], rng: np.random.Generator) -> dict[str, np.ndarray]:
    return {k: v + 1 for k, v in sample.items()}


def add_two(sample: dict[str, np.ndarray], rng: np.random.Generator) -> dict[str, np.ndarray]:
    return {k: v + 2 for k, v in sample.items()}


def doubling_collate(batch: dict[str, np.ndarray]) -> dict[str, torch.Tensor]:
    return {k: torch.from_numpy(np.ascontiguousarray(v)) * 2 for k, v in batch.items()}


@dataclass(frozen=True)
class Corpus:
    tokens_a: str  # manifest paths
    tokens_b: str
    table: str


@pytest.fixture(scope="module")
def corpus(tmp_path_factory: pytest.TempPathFactory) -> Corpus:
    root = tmp_path_factory.mktemp("identity")
    paths = []
    for name, offset in (("a", 0), ("b", 7)):
        d = root / name
        d.mkdir()
        for s in range(2):
            np.save(d / f"s{s}.npy", (np.arange(400, dtype=np.int32) * (s + 3) + offset) % 50_000)
        m = detdata.build_manifest(str(d), pattern="*.npy")
        m.save(str(root / f"{name}.json"))
        paths.append(str(root / f"{name}.json"))
    t = root / "t"
    t.mkdir()
    n = 120
    table = pa.table(
        {
            "x": np.arange(n, dtype=np.int64),
            "y": np.arange(n, dtype=np.float32) / 2,
            "z": [list(range(i % 5 + 1)) for i in range(n)],
        }
    )
    pq.write_table(table, t / "t.parquet", row_group_size=30)
    mt = detdata.build_manifest(str(t), pattern="*.parquet")
    mt.save(str(root / "t.json"))
    return Corpus(paths[0], paths[1], str(root / "t.json"))


@dataclass(frozen=True)
class Config:
    """Every knob of the data pipeline; `build` turns one into a loader."""

    kind: str = "tokens"  # tokens | ordered | mixture | table | arrays
    manifest: str = "a"
    seq_len: int = 7
    labels: bool = True
    out_dtype: str | None = None
    columns: tuple[str, ...] = ("x", "y")
    ragged: tuple[str, ...] = ()
    cache_row_groups: int = 8
    max_open_shards: int | None = None
    verify: str = "quick"
    stream_seed: int = 11
    weights: Mapping[str, str] = field(default_factory=lambda: {"web": "0.75", "code": "0.25"})
    source_names: tuple[str, str] = ("web", "code")
    array_values: int = 0
    array_name: str = "arrays"
    seed: int = 5
    global_batch_size: int = GBS
    micro_batch_size: int = MICRO
    num_workers: int = 0
    worker_mode: str = "process"
    read_ahead: int = 16
    transform: Callable[..., Any] | None = None
    transform_id: str | None = None
    collate_fn: Callable[..., Any] | None = None
    lookahead: int = 0
    order: Any = None  # DataLoader order= (None: not passed)
    attest: bool = True  # ResumePolicy.attest


def _tokens(c: Config, corpus: Corpus) -> detdata.TokenWindows:
    path = corpus.tokens_a if c.manifest == "a" else corpus.tokens_b
    return detdata.TokenWindows(
        path,
        c.seq_len,
        labels=c.labels,
        out_dtype=c.out_dtype,
        storage=detdata.Storage(verify=c.verify, max_open_shards=c.max_open_shards),
    )


def _data(c: Config, corpus: Corpus) -> Any:
    if c.kind == "tokens":
        return _tokens(c, corpus)
    if c.kind == "ordered":
        return detdata.OrderedStream(_tokens(c, corpus), seed=c.stream_seed)
    if c.kind == "table":
        return detdata.TableRows(
            corpus.table,
            list(c.columns),
            ragged=list(c.ragged),
            cache_row_groups=c.cache_row_groups,
            storage=detdata.Storage(max_open_shards=c.max_open_shards),
        )
    if c.kind == "arrays":
        ids = np.arange(300, dtype=np.int64)
        return detdata.ArrayDataset({"x": ids * 3 + c.array_values}, name=c.array_name)
    web = detdata.TokenWindows(corpus.tokens_a, c.seq_len, labels=c.labels)
    code = detdata.TokenWindows(corpus.tokens_b, c.seq_len, labels=c.labels)
    names = c.source_names
    return detdata.Mixture(
        {names[0]: web, names[1]: code},
        {names[0]: c.weights["web"], names[1]: c.weights["code"]},
        seed=c.stream_seed,
    )


def build(c: Config, corpus: Corpus) -> detdata.DataLoader:
    extra: dict[str, Any] = {}
    if c.order is not None:
        extra["order"] = c.order
    return detdata.DataLoader(
        _data(c, corpus),
        global_batch_size=c.global_batch_size,
        micro_batch_size=c.micro_batch_size,
        seed=c.seed,
        num_workers=c.num_workers,
        options=detdata.LoaderOptions(
            transform=c.transform,
            transform_id=c.transform_id,
            read=detdata.ReadOptions(
                worker_mode=c.worker_mode,
                batches_ahead=c.read_ahead,
                steps_ahead=c.lookahead or None,
            ),
            resume=detdata.ResumePolicy(attest=c.attest),
        ),
        collate_fn=c.collate_fn,
        **extra,
    )


def steps_bytes(loader: detdata.DataLoader, micro_batches: int) -> list[bytes]:
    """Bytes of each global step among the next ``micro_batches`` (columns concatenated)."""
    batches = list(take(loader, micro_batches))
    per_step = loader.global_batch_size // loader.layout.micro_batch_size
    out = []
    for s in range(0, len(batches), per_step):
        group = batches[s : s + per_step]
        out.append(b"".join(_column_bytes(k, [b[k] for b in group]) for k in sorted(group[0])))
    return out


def _column_bytes(key: str, parts: list[Any]) -> bytes:
    if all(isinstance(p, torch.Tensor) for p in parts):
        return batch_bytes({key: torch.cat(parts)})
    rows = [row for p in parts for row in p]  # per-row values (ragged / strings)
    return key.encode() + b"".join(
        batch_bytes(r) if isinstance(r, torch.Tensor) else repr(r).encode() for r in rows
    )


def saved_state(c: Config, corpus: Corpus) -> tuple[dict[str, Any], list[bytes]]:
    """State after SAVE_AFTER micro batches of ``c``, and the bytes of the steps that follow."""
    loader = build(c, corpus)
    list(take(loader, SAVE_AFTER))
    state = json.loads(json.dumps(loader.state_dict()))
    return state, steps_bytes(loader, COMPARE)


def fresh_suffix(c: Config, corpus: Corpus) -> list[bytes]:
    """What an uninterrupted run of ``c`` delivers at the steps after the save point."""
    loader = build(c, corpus)
    skip = SAVE_AFTER * MICRO // c.micro_batch_size
    list(take(loader, skip))
    return steps_bytes(loader, COMPARE * MICRO // c.micro_batch_size)


BASE = {
    "tokens": Config(),
    "ordered": Config(kind="ordered"),
    "mixture": Config(kind="mixture"),
    "table": Config(kind="table"),
    "arrays": Config(kind="arrays"),
}

# (case id, base config, changes, fields the resume must name)
CHANGES_BYTES: list[tuple[str, str, dict[str, Any], set[str]]] = [
    ("TokenWindows.manifest", "tokens", {"manifest": "b"}, {"manifests", "data"}),
    ("TokenWindows.seq_len", "tokens", {"seq_len": 9}, {"data"}),
    ("TokenWindows.labels", "tokens", {"labels": False}, {"data"}),
    ("TokenWindows.out_dtype", "tokens", {"out_dtype": "int64"}, {"data"}),
    ("OrderedStream.seed", "ordered", {"stream_seed": 12}, {"stream_seed"}),
    ("OrderedStream.dataset", "ordered", {"seq_len": 9}, {"data"}),
    ("Mixture.seed", "mixture", {"stream_seed": 12}, {"stream_seed"}),
    ("Mixture.weights", "mixture", {"weights": {"web": "0.5", "code": "0.5"}}, {"mixture"}),
    ("Mixture.source_names", "mixture", {"source_names": ("web", "math")}, {"data", "mixture"}),
    ("Mixture.source_param", "mixture", {"seq_len": 9}, {"data"}),
    ("TableRows.columns", "table", {"columns": ("x",)}, {"data"}),
    ("TableRows.ragged", "table", {"columns": ("x", "z"), "ragged": ("z",)}, {"data"}),
    ("ArrayDataset.columns", "arrays", {"array_values": 1}, {"manifests", "data"}),
    ("DataLoader.seed", "tokens", {"seed": 6}, {"seed"}),
    (
        "DataLoader.seed (stream given)",
        "ordered",
        {"seed": 6, "transform": add_one, "transform_id": "plus-one"},
        {"seed"},
    ),
    ("DataLoader.transform", "tokens", {"transform": add_one}, {"transform"}),
    ("DataLoader.transform swapped", "tokens", {"transform": add_two}, {"transform"}),
    (
        "DataLoader.transform_id",
        "tokens",
        {"transform": add_two, "transform_id": "v2"},
        {"transform"},
    ),
    ("DataLoader.collate_fn", "tokens", {"collate_fn": doubling_collate}, {"transform"}),
    (
        "DataLoader.order",
        "tokens",
        {"order": detdata.LocalityOrder(window_shards=1)},
        {"algorithm"},
    ),
    (
        "LocalityOrder.window_shards",
        "tokens",
        {"order": detdata.LocalityOrder(window_shards=2)},
        {"algorithm"},
    ),
]

# the "seed (stream given)" base must carry the transform too: the seed then only changes the rng
_BASE_OVERRIDES = {
    "DataLoader.seed (stream given)": {"transform": add_one, "transform_id": "plus-one"},
    "DataLoader.transform swapped": {"transform": add_one},
    "DataLoader.transform_id": {"transform": add_one, "transform_id": "v1"},
    "LocalityOrder.window_shards": {"order": detdata.LocalityOrder(window_shards=1)},
}


def _randomized(sample: dict[str, np.ndarray], rng: np.random.Generator) -> dict[str, np.ndarray]:
    return {k: v + rng.integers(0, 1000, size=v.shape, dtype=v.dtype) for k, v in sample.items()}


def _case_configs(case: str, base: str, change: dict[str, Any]) -> tuple[Config, Config]:
    from dataclasses import replace

    over = dict(_BASE_OVERRIDES.get(case, {}))
    if case == "DataLoader.seed (stream given)":  # a seed-dependent transform, so bytes change
        over, change = (
            {"transform": _randomized, "transform_id": "rand"},
            {"seed": 6, "transform": _randomized, "transform_id": "rand"},
        )
    a = replace(BASE[base], **over)
    return a, replace(a, **change)


@pytest.mark.parametrize(
    ("case", "base", "change", "fields"), CHANGES_BYTES, ids=[c[0] for c in CHANGES_BYTES]
)
def test_byte_changing_parameter_is_refused_naming_its_field(
    corpus: Corpus, case: str, base: str, change: dict[str, Any], fields: set[str]
) -> None:
    a, b = _case_configs(case, base, change)
    state, base_next = saved_state(a, corpus)
    changed_fresh = fresh_suffix(b, corpus)
    assert changed_fresh != base_next, (
        f"{case}: the change does not change bytes; the table is wrong"
    )
    loader = build(b, corpus)
    with pytest.raises(detdata.StateError) as info:
        loader.load_state_dict(state)
    assert set(info.value.fields) == fields, info.value
    for name in fields:
        assert name in str(info.value)
    assert loader.samples_consumed == 0  # a refused state leaves the loader untouched
    if fields == {"data", "mixture"}:  # other sources: a weight continuation cannot apply
        with pytest.raises(detdata.StateError, match=r"sources removed: .'code'.; sources added"):
            loader.load_state_dict(state, allow=sorted(fields))
        assert loader.samples_consumed == 0
        return
    loader.load_state_dict(state, allow=sorted(fields))
    assert loader.samples_consumed == state["samples_consumed"]
    resumed = steps_bytes(loader, COMPARE)
    assert resumed != base_next
    if fields != {"mixture"}:  # an allowed weight change continues each source (test_mixture.py)
        assert resumed == changed_fresh, f"{case}: allowed resume is not the changed configuration"


# identity inputs that the user declares (or that name the data) are refused even where the
# bytes happen to be equal: detdata cannot tell, so it never guesses in the unsafe direction
IDENTITY_ONLY: list[tuple[str, str, dict[str, Any], dict[str, Any], set[str]]] = [
    ("ArrayDataset.name", "arrays", {}, {"array_name": "other"}, {"data"}),
    (
        "DataLoader.transform_id",
        "tokens",
        {"transform": add_one, "transform_id": "v1"},
        {"transform": add_one, "transform_id": "v2"},
        {"transform"},
    ),
]


@pytest.mark.parametrize(
    ("case", "base", "over", "change", "fields"), IDENTITY_ONLY, ids=[c[0] for c in IDENTITY_ONLY]
)
def test_declared_identity_change_is_refused_even_with_equal_bytes(
    corpus: Corpus,
    case: str,
    base: str,
    over: dict[str, Any],
    change: dict[str, Any],
    fields: set[str],
) -> None:
    from dataclasses import replace

    a = replace(BASE[base], **over)
    b = replace(a, **change)
    state, base_next = saved_state(a, corpus)
    loader = build(b, corpus)
    with pytest.raises(detdata.StateError) as info:
        loader.load_state_dict(state)
    assert set(info.value.fields) == fields
    loader.load_state_dict(state, allow=sorted(fields))
    assert steps_bytes(loader, COMPARE) == base_next


# parameters that never change a delivered byte: resume is accepted and continues the base run
NEUTRAL: list[tuple[str, str, dict[str, Any]]] = [
    ("DataLoader.micro_batch_size", "tokens", {"micro_batch_size": 2}),
    ("DataLoader.num_workers(thread)", "tokens", {"num_workers": 2, "worker_mode": "thread"}),
    ("DataLoader.num_workers(process)", "mixture", {"num_workers": 2}),
    ("DataLoader.read_ahead", "table", {"read_ahead": 1}),
    ("TokenWindows.verify", "tokens", {"verify": "full"}),
    ("TableRows.cache_row_groups", "table", {"cache_row_groups": 1}),
    ("TokenWindows.max_open_shards", "tokens", {"max_open_shards": 1}),
    ("TableRows.max_open_shards", "table", {"max_open_shards": 1}),
    ("DataLoader.lookahead", "mixture", {"lookahead": 32}),
    ("DataLoader.transform_id keeps", "tokens", {"transform": add_two, "transform_id": "same"}),
]


@pytest.mark.parametrize(("case", "base", "change"), NEUTRAL, ids=[c[0] for c in NEUTRAL])
def test_parameter_that_keeps_bytes_resumes_silently(
    corpus: Corpus, case: str, base: str, change: dict[str, Any]
) -> None:
    from dataclasses import replace

    a = BASE[base]
    if case == "DataLoader.transform_id keeps":
        # documented: a transform_id names the transform's version; the function is not checked
        a = replace(a, transform=add_one, transform_id="same")
    b = replace(a, **change)
    state, base_next = saved_state(a, corpus)
    if case == "DataLoader.transform_id keeps":
        # the checked fields believe the id; the resume attestation sees the other bytes
        refused = build(b, corpus)
        refused.load_state_dict(state)
        with pytest.raises(detdata.StateError, match="resume attestation failed at step"):
            next(iter(refused))
        b = replace(b, attest=False)  # without attestation, detdata believes the id (documented)
    loader = build(b, corpus)
    loader.load_state_dict(state)
    got = steps_bytes(loader, COMPARE * MICRO // b.micro_batch_size)
    if case == "DataLoader.transform_id keeps":
        assert got != base_next
        assert got == fresh_suffix(b, corpus)
    else:
        assert got == base_next


def test_state_is_json_plain_and_names_transform_without_id(corpus: Corpus) -> None:
    from dataclasses import replace

    loader = build(replace(BASE["tokens"], transform=add_one, collate_fn=doubling_collate), corpus)
    state = loader.state_dict()
    assert state["transform"] == (
        "transform:tests.loading.test_identity.add_one"
        "+collate_fn:tests.loading.test_identity.doubling_collate"
    )
    assert state["stream_seed"] is None  # the loader ordered the dataset itself, with `seed`
    assert json.loads(json.dumps(state)) == state


def test_issue_example_mixture_seed_no_longer_resumes_silently(corpus: Corpus) -> None:
    """Mixture(seed=1) state into a Mixture(seed=2) loader: refused; allowed, the epoch stays
    exact."""
    from dataclasses import replace

    a, b = replace(BASE["mixture"], stream_seed=1), replace(BASE["mixture"], stream_seed=2)
    state, _ = saved_state(a, corpus)
    with pytest.raises(detdata.StateError, match=r"stream_seed: saved 1, current 2"):
        build(b, corpus).load_state_dict(state)


def test_format_1_state_is_upgraded_with_its_stream_seed(corpus: Corpus) -> None:
    """A state written by the previous format (no stream_seed) still catches a stream seed
    change."""
    state, _ = saved_state(BASE["mixture"], corpus)
    old = {k: v for k, v in state.items() if k not in ("stream_seed", "transform")}
    old["format_version"] = 1
    same = build(BASE["mixture"], corpus)
    same.load_state_dict(old)
    assert same.samples_consumed == state["samples_consumed"]
    from dataclasses import replace

    with pytest.raises(detdata.StateError) as info:
        build(replace(BASE["mixture"], stream_seed=99), corpus).load_state_dict(old)
    assert info.value.fields == ("stream_seed",)


def test_edited_stream_seed_is_inconsistent(corpus: Corpus) -> None:
    state, _ = saved_state(BASE["ordered"], corpus)
    state["stream"]["seed"] = 12  # the seed field says 11: edited or corrupted
    with pytest.raises(detdata.StateError, match="inconsistent"):
        build(BASE["ordered"], corpus).load_state_dict(state)


def test_transform_id_must_be_a_non_empty_string(corpus: Corpus) -> None:
    from dataclasses import replace

    for bad in ("", 3):
        with pytest.raises(detdata.ConfigError, match="transform_id"):
            build(replace(BASE["tokens"], transform=add_one, transform_id=bad), corpus)  # type: ignore[arg-type]


def test_state_leaves_are_json_plain_and_load_with_weights_only(
    corpus: Corpus, tmp_path: Any
) -> None:
    """Every leaf is str/int/float/bool/None (no str subclasses such as torch's TorchVersion)."""
    from dataclasses import replace

    loader = build(replace(BASE["mixture"], transform=add_one), corpus)
    list(take(loader, 2))
    state = loader.state_dict()

    def walk(node: Any, where: str) -> None:
        if isinstance(node, dict):
            for k, v in node.items():
                assert type(k) is str, f"{where}: key {k!r}"
                walk(v, f"{where}.{k}")
        elif isinstance(node, list):
            for i, v in enumerate(node):
                walk(v, f"{where}[{i}]")
        else:
            assert type(node) in (str, int, float, bool, type(None)), (
                f"{where}: {type(node).__name__}"
            )

    walk(state, "state")
    torch.save({"loader": state}, tmp_path / "ckpt.pt")
    assert torch.load(tmp_path / "ckpt.pt", weights_only=True)["loader"] == state


def scale(
    sample: dict[str, np.ndarray], rng: np.random.Generator, *, k: int
) -> dict[str, np.ndarray]:
    return {key: v * k for key, v in sample.items()}


class Scale:
    def __init__(self, k: int) -> None:
        self.k = k

    def __call__(
        self, sample: dict[str, np.ndarray], rng: np.random.Generator
    ) -> dict[str, np.ndarray]:
        return {key: v * self.k for key, v in sample.items()}


def collate_times(k: int) -> Callable[[dict[str, np.ndarray]], dict[str, torch.Tensor]]:
    return functools.partial(_collate_times, k=k)


def _collate_times(batch: dict[str, np.ndarray], *, k: int) -> dict[str, torch.Tensor]:
    return {key: torch.from_numpy(np.ascontiguousarray(v)) * k for key, v in batch.items()}


PARAMETRISED = [
    (
        "partial arguments",
        {"transform": functools.partial(scale, k=1)},
        {"transform": functools.partial(scale, k=1000)},
    ),
    ("callable object attributes", {"transform": Scale(1)}, {"transform": Scale(7)}),
    (
        "collate swapped under one transform_id",
        {"transform": add_one, "transform_id": "tok-v1", "collate_fn": collate_times(1)},
        {"transform": add_one, "transform_id": "tok-v1", "collate_fn": collate_times(100)},
    ),
]


@pytest.mark.parametrize(("case", "over", "change"), PARAMETRISED, ids=[p[0] for p in PARAMETRISED])
def test_reparametrised_transform_or_collate_is_refused(
    corpus: Corpus, case: str, over: dict[str, Any], change: dict[str, Any]
) -> None:
    """Same function, other bound parameters: other bytes, so the `transform` field differs."""
    from dataclasses import replace

    a = replace(BASE["tokens"], **over)
    b = replace(BASE["tokens"], **change)
    state, base_next = saved_state(a, corpus)
    assert fresh_suffix(b, corpus) != base_next
    with pytest.raises(detdata.StateError) as info:
        build(b, corpus).load_state_dict(state)
    assert info.value.fields == ("transform",)
    same = build(replace(BASE["tokens"], **over), corpus)  # equal parameters: accepted
    same.load_state_dict(state)
    assert steps_bytes(same, COMPARE) == base_next


@pytest.mark.parametrize("kind", ["mixture", "ordered"])
def test_format_1_state_with_equal_seeds_resumes_the_same_loader(corpus: Corpus, kind: str) -> None:
    """The common setup (stream seed == loader seed) saved in format 1 resumes the same loader."""
    from dataclasses import replace

    config = replace(BASE[kind], stream_seed=5, seed=5)
    state, base_next = saved_state(config, corpus)
    old = {k: v for k, v in state.items() if k not in ("stream_seed", "transform")}
    old["format_version"] = 1
    loader = build(config, corpus)
    loader.load_state_dict(old)
    assert steps_bytes(loader, COMPARE) == base_next
    with pytest.raises(detdata.StateError, match="stream_seed"):
        build(replace(config, stream_seed=6), corpus).load_state_dict(old)


def test_array_dataset_identity_is_unambiguous() -> None:
    """Column names, dtypes, shapes and bytes are framed: other columns never share a digest."""
    a = detdata.ArrayDataset({"k": np.array([1], np.int8), "z": np.array([2], np.int8)})
    b = detdata.ArrayDataset({"kint8(1,)\x01z": np.array([2], np.int8)})
    c = detdata.ArrayDataset({"k": np.array([1, 2], np.int8)})
    d = detdata.ArrayDataset({"k": np.array([[1, 2]], np.int8)})
    digests = {x.identity()["digest"] for x in (a, b, c, d)}
    assert len(digests) == 4
