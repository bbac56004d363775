"""Fuzzing the parsers of untrusted documents: manifests, loader/sampler states, registry files.

Property everywhere: whatever the input (arbitrary JSON-ish values, random bytes,
or a valid document with fields dropped, retyped or altered), the parser either
succeeds or raises the documented error, a subclass of `detdata.DetdataError`
(`ManifestError`, `StateError`, `RegistryError`, `ConfigError`). Nothing else
(``KeyError``, ``TypeError``, ``OverflowError``, ``RecursionError``...) may escape.

Where a parse succeeds on a mutated document, integrity properties are checked
too: a manifest that still carries an id has exactly that id (tampering is never
silent), a loaded state resumes exactly at its ``samples_consumed``, and a
resolved registry name points at an intact stored object.
"""

from __future__ import annotations

import copy
import json
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

import detdata
from detdata.identity.build import build_manifest
from detdata.identity.manifest import Manifest
from detdata.identity.registry import Registry
from detdata.loading.sampler import DeterministicBatchSampler
from detdata.loading.state import CHECKED_FIELDS, LoaderState

FUZZ = settings(
    max_examples=120,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)
SLOW_FUZZ = settings(FUZZ, max_examples=60)

# ------------------------------------------------------------------ strategies
SCALARS = (
    st.none()
    | st.booleans()
    | st.integers(min_value=-(2**70), max_value=2**70)
    | st.floats(allow_nan=True, allow_infinity=True)
    | st.text(max_size=12)
)
JSONISH = st.recursive(
    SCALARS,
    lambda inner: (
        st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4)
    ),
    max_leaves=16,
)
EDGE_INTS = (-1, 0, 1, 2**31, 2**62, 2**63, 2**64, -(2**63), 10**30)


def _paths(doc: Any, prefix: tuple[Any, ...] = ()) -> Iterator[tuple[Any, ...]]:
    """Every path (sequence of keys / indices) into a JSON document, root first."""
    yield prefix
    if isinstance(doc, dict):
        for key, value in doc.items():
            yield from _paths(value, (*prefix, key))
    elif isinstance(doc, list):
        for index, value in enumerate(doc):
            yield from _paths(value, (*prefix, index))


def _get(doc: Any, path: tuple[Any, ...]) -> Any:
    for key in path:
        doc = doc[key]
    return doc


def _variants(value: Any) -> list[Any]:
    """Retyped and nudged versions of ``value``: the realistic corruptions of a field."""
    out: list[Any] = [None, str(value), [value], {"v": value}, True, 0.5, -1]
    if isinstance(value, bool):
        out += [not value, int(value)]
    elif isinstance(value, int):
        out += [value + 1, value - 1, -value - 1, float(value), *EDGE_INTS]
    elif isinstance(value, str):
        out += [
            "",
            value + "x",
            value[:-1],
            value.upper(),
            value + "/../x",
            "/" + value,
            float("nan"),
        ]
    elif isinstance(value, list):
        out += [[], value[::-1], value + value[:1], value[1:]]
    elif isinstance(value, dict):
        out += [{}, {**value, "unexpected": 1}, list(value.values())]
    return out


@st.composite
def mutated(draw: st.DrawFn, original: Any) -> Any:
    """``original`` (a JSON document) with 1-3 drop / replace / retype / nudge mutations."""
    doc = copy.deepcopy(original)
    for _ in range(draw(st.integers(1, 3))):
        path = draw(st.sampled_from(list(_paths(doc))))
        op = draw(st.sampled_from(["drop", "replace", "variant", "variant"]))
        if not path:
            if op == "drop":
                continue
            doc = draw(JSONISH) if op == "replace" else draw(st.sampled_from(_variants(doc)))
            continue
        parent, key = _get(doc, path[:-1]), path[-1]
        if op == "drop":
            del parent[key]
        elif op == "replace":
            parent[key] = draw(JSONISH)
        else:
            parent[key] = draw(st.sampled_from(_variants(parent[key])))
    return doc


@st.composite
def byte_mutated(draw: st.DrawFn, data: bytes) -> bytes:
    """``data`` with 1-4 bytes flipped, inserted or deleted."""
    buf = bytearray(data)
    for _ in range(draw(st.integers(1, 4))):
        if not buf:
            break
        i = draw(st.integers(0, len(buf) - 1))
        op = draw(st.sampled_from(["flip", "insert", "delete"]))
        if op == "flip":
            buf[i] ^= draw(st.integers(1, 255))
        elif op == "insert":
            buf.insert(i, draw(st.integers(0, 255)))
        else:
            del buf[i]
    return bytes(buf)


def must_be_documented(exc: BaseException, *allowed: type[BaseException]) -> None:
    """Fail unless ``exc`` is one of the documented detdata errors."""
    expected = allowed or (detdata.DetdataError,)
    if not isinstance(exc, expected):
        raise AssertionError(
            f"undocumented exception escaped: {type(exc).__name__}: {exc}"
        ) from exc


# ------------------------------------------------------------------ fixtures
def write_token_shards(root: Path, sizes: tuple[int, ...]) -> None:
    root.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(0)
    for i, size in enumerate(sizes):
        np.save(root / f"shard-{i:03d}.npy", rng.integers(0, 50_000, size=size).astype(np.uint16))


@pytest.fixture(scope="module")
def corpus(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("fuzz") / "data"
    write_token_shards(root, (300, 200, 50))
    return root


@pytest.fixture(scope="module")
def manifest(corpus: Path) -> Manifest:
    return build_manifest(str(corpus), metadata={"tokenizer": "t", "nested": {"a": [1, 2]}})


@pytest.fixture(scope="module")
def manifest_doc(manifest: Manifest) -> dict[str, Any]:
    doc: dict[str, Any] = json.loads(json.dumps(manifest.to_json()))
    return doc


def _dataset() -> detdata.ArrayDataset:
    ids = np.arange(64, dtype=np.int64)
    return detdata.ArrayDataset({"id": ids, "x": ids * 3})


def _loader() -> detdata.DataLoader:
    return detdata.DataLoader(_dataset(), global_batch_size=8, micro_batch_size=4, seed=3)


def _mixture_loader() -> detdata.DataLoader:
    mix = detdata.Mixture(
        {"a": _dataset(), "b": detdata.ArrayDataset({"id": np.arange(40), "x": np.arange(40) * 5})},
        schedule=[(0, {"a": 1, "b": 1}), (64, {"a": 3, "b": 1})],
        seed=7,
    )
    return detdata.DataLoader(mix, global_batch_size=8, micro_batch_size=4, seed=7)


@pytest.fixture(scope="module")
def loader_state() -> dict[str, Any]:
    dl = _loader()
    it = iter(dl)
    for _ in range(3):
        next(it)
    state: dict[str, Any] = json.loads(json.dumps(dl.state_dict()))
    return state


@pytest.fixture(scope="module")
def mixture_state() -> dict[str, Any]:
    dl = _mixture_loader()
    it = iter(dl)
    for _ in range(4):
        next(it)
    state: dict[str, Any] = json.loads(json.dumps(dl.state_dict()))
    return state


# ------------------------------------------------------------------ manifests
@FUZZ
@given(doc=JSONISH)
def test_manifest_from_arbitrary_json(doc: Any) -> None:
    try:
        Manifest.from_json(doc)
    except Exception as exc:
        must_be_documented(exc, detdata.ManifestError)


@FUZZ
@given(data=st.data())
def test_manifest_mutations_fail_cleanly_or_keep_identity(
    manifest_doc: dict[str, Any], manifest: Manifest, data: st.DataObject
) -> None:
    doc = data.draw(mutated(manifest_doc))
    try:
        text = json.dumps(doc)
    except ValueError:
        return  # not representable as JSON text (cannot come from a file)
    parsers: list[Callable[[], Manifest]] = [
        lambda: Manifest.from_json(doc),
        lambda: Manifest.loads(text),
    ]
    for parse in parsers:
        try:
            parsed = parse()
        except Exception as exc:
            must_be_documented(exc, detdata.ManifestError)
            continue
        if isinstance(doc, dict) and "id" in doc:
            # a parse that kept the stored id can only be the manifest with that id
            assert parsed.id == doc["id"]
            if doc["id"] == manifest.id:
                assert parsed.body() == manifest.body()


@FUZZ
@given(raw=st.binary(max_size=300))
def test_manifest_loads_random_bytes(raw: bytes) -> None:
    try:
        Manifest.loads(raw)
    except Exception as exc:
        must_be_documented(exc, detdata.ManifestError)


@FUZZ
@given(data=st.data())
def test_manifest_byte_corruption_is_detected(manifest: Manifest, data: st.DataObject) -> None:
    original = json.dumps(manifest.to_json(), sort_keys=True, indent=1).encode()
    raw = data.draw(byte_mutated(original))
    try:
        parsed = Manifest.loads(raw)
    except Exception as exc:
        must_be_documented(exc, detdata.ManifestError)
        return
    # whitespace/formatting damage may parse; content damage must not pass as this manifest
    assert parsed.id == manifest.id and parsed.body() == manifest.body()


def test_deeply_nested_documents_are_refused_cleanly() -> None:
    deep = "[" * 100_000 + "]" * 100_000
    with pytest.raises(detdata.ManifestError, match="malformed JSON"):
        Manifest.loads(deep)
    with pytest.raises(detdata.StateError, match="not valid JSON"):
        LoaderState.from_json(deep)


# ------------------------------------------------------------------ loader state
@FUZZ
@given(doc=JSONISH | st.text(max_size=40) | st.binary(max_size=40))
def test_loader_state_from_arbitrary_input(doc: Any) -> None:
    try:
        LoaderState.from_json(doc)
    except Exception as exc:
        must_be_documented(exc, detdata.StateError)


@SLOW_FUZZ
@given(data=st.data())
def test_loader_load_state_dict_mutations(
    loader_state: dict[str, Any], data: st.DataObject
) -> None:
    state = data.draw(mutated(loader_state))
    allow = data.draw(st.sampled_from([(), CHECKED_FIELDS]))
    dl = _loader()
    try:
        dl.load_state_dict(state, allow=allow, mid_step="continue")
    except Exception as exc:
        must_be_documented(exc)
        assert dl.samples_consumed == 0, "a refused state must leave the loader untouched"
        return
    assert isinstance(state, dict)
    assert dl.samples_consumed == state["samples_consumed"]
    try:
        batch = next(iter(dl))
    except Exception as exc:  # e.g. an accepted position the data cannot serve
        must_be_documented(exc)
        return
    expected = detdata.GlobalOrder(64, 3).ids(dl.positions_of_next() - 4)
    assert batch["id"].tolist() == expected.tolist()


@SLOW_FUZZ
@given(data=st.data())
def test_mixture_loader_load_state_dict_mutations(
    mixture_state: dict[str, Any], data: st.DataObject
) -> None:
    state = data.draw(mutated(mixture_state))
    allow = data.draw(st.sampled_from([(), ("mixture",), CHECKED_FIELDS]))
    dl = _mixture_loader()
    try:
        dl.load_state_dict(state, allow=allow, mid_step="continue")
    except Exception as exc:
        must_be_documented(exc)
        return
    try:
        next(iter(dl))
    except Exception as exc:
        must_be_documented(exc)


def test_unmutated_states_resume_exactly(
    loader_state: dict[str, Any], mixture_state: dict[str, Any]
) -> None:
    """The fuzz baselines are valid: without mutation both states load and resume."""
    for make, state in ((_loader, loader_state), (_mixture_loader, mixture_state)):
        straight, resumed = make(), make()
        it = iter(straight)
        skipped = state["samples_consumed"] // 4
        for _ in range(skipped):
            next(it)
        resumed.load_state_dict(state, mid_step="continue")  # states saved mid-step
        assert next(iter(resumed))["id"].tolist() == next(it)["id"].tolist()


# ------------------------------------------------------------------ sampler state
def _sampler() -> DeterministicBatchSampler:
    return DeterministicBatchSampler(
        64, global_batch_size=8, micro_batch_size=4, seed=3, total_samples=160
    )


@FUZZ
@given(data=st.data())
def test_sampler_load_state_dict_mutations(data: st.DataObject) -> None:
    base = _sampler()
    it = iter(base)
    next(it)
    next(it)
    valid = base.state_dict()
    state: Any = data.draw(mutated(valid) | JSONISH)
    sampler = _sampler()
    try:
        sampler.load_state_dict(state)
    except Exception as exc:
        must_be_documented(exc)
        assert sampler.samples_consumed == 0
        return
    assert isinstance(state, dict)
    assert sampler.samples_consumed == state["samples_consumed"] <= 160
    rest = list(sampler)
    assert len(rest) == (160 - state["samples_consumed"]) // 4


# ------------------------------------------------------------------ registry files
@pytest.fixture(scope="module")
def registry(tmp_path_factory: pytest.TempPathFactory, manifest: Manifest) -> Registry:
    reg = Registry(str(tmp_path_factory.mktemp("fuzz-registry") / "registry"))
    reg.register("ds@v1", manifest)
    return reg


def _ref_path(registry: Registry) -> Path:
    return Path(registry.root) / "refs" / "ds" / "v1.json"


@pytest.fixture(scope="module")
def ref_doc(registry: Registry) -> dict[str, Any]:
    doc: dict[str, Any] = json.loads(_ref_path(registry).read_bytes())
    return doc


def _exercise_registry(registry: Registry, manifest: Manifest) -> None:
    """Every read path over the (possibly corrupted) reference; only RegistryError may escape."""
    for call in (
        lambda: registry.resolve("ds@v1", verify="off"),
        lambda: registry.resolve("ds", verify="off"),
        lambda: registry.history("ds@v1"),
        lambda: registry.history("ds"),
        lambda: registry.versions("ds"),
        registry.names,
        lambda: registry.register("ds@v1", manifest),
        lambda: registry.register("ds@v1", manifest, force=True),
    ):
        try:
            result = call()
        except Exception as exc:
            must_be_documented(exc, detdata.RegistryError)
            continue
        if isinstance(result, Manifest):
            assert result.id == registry.get(result.id).id
            assert result.root is None or isinstance(result.root, str)


@FUZZ
@given(data=st.data())
def test_registry_corrupted_ref(
    registry: Registry, manifest: Manifest, ref_doc: dict[str, Any], data: st.DataObject
) -> None:
    kind = data.draw(st.sampled_from(["mutated", "bytes", "arbitrary"]))
    if kind == "mutated":
        try:
            raw = json.dumps(data.draw(mutated(ref_doc))).encode()
        except ValueError:
            assume(False)
    elif kind == "bytes":
        raw = data.draw(
            byte_mutated(json.dumps(ref_doc, indent=1).encode()) | st.binary(max_size=80)
        )
    else:
        raw = json.dumps(data.draw(JSONISH)).encode()
    _ref_path(registry).write_bytes(raw)
    _exercise_registry(registry, manifest)


@FUZZ
@given(data=st.data())
def test_registry_corrupted_object(
    registry: Registry, manifest: Manifest, manifest_doc: dict[str, Any], data: st.DataObject
) -> None:
    obj = Path(registry.root) / "manifests" / f"{manifest.id[3:]}.json"
    stored = {k: v for k, v in manifest_doc.items() if k != "root"}
    raw = data.draw(
        byte_mutated(json.dumps(stored).encode())
        | st.builds(lambda d: json.dumps(d).encode(), mutated(stored))
        | st.binary(max_size=60)
    )
    obj.write_bytes(raw)
    try:
        got = registry.get(manifest.id)
    except Exception as exc:
        must_be_documented(exc, detdata.RegistryError)
    else:
        assert got.id == manifest.id and got.body() == manifest.body()
    finally:
        obj.write_bytes(json.dumps(stored).encode())
