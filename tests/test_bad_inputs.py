"""Bad inputs, one place: every refusal with its error type and a message naming the culprit.

| case (its test below)                              | error                   |
|----------------------------------------------------|-------------------------|
| one byte flipped mid-shard (verify full)           | VerificationError       |
|   test_damaged_shard[corrupt-byte]                 |                         |
| truncated shard                                    | VerificationError       |
|   test_damaged_shard[truncated]                    |                         |
| missing shard                                      | VerificationError       |
|   test_damaged_shard[missing]                      |                         |
| renamed shard                                      | VerificationError       |
|   test_damaged_shard[renamed]                      |                         |
| extra file next to the shards                      | none: ignored (decided) |
|   test_extra_file_is_not_part_of_the_dataset       |                         |
| shard path with ``..`` / absolute path             | ManifestError           |
|   test_bad_manifest_file[dotdot / absolute]        |                         |
| tampered manifest (id mismatch)                    | ManifestError           |
|   test_bad_manifest_file[tampered]                 |                         |
| malformed JSON / unknown format_version            | ManifestError           |
|   test_bad_manifest_file[malformed / version-2]    |                         |
| Parquet shards with different schemas              | FormatError             |
|   test_parquet_schemas_differ                      |                         |
| .bin size not a multiple of the item size          | FormatError             |
|   test_bin_dtype[size-not-multiple]                |                         |
| .bin declared with a non-token dtype               | ConfigError             |
|   test_bin_dtype[float-dtype]                      |                         |
| manifest declaring a non-token dtype               | ManifestError           |
|   test_manifest_declares_wrong_dtype               |                         |
| manifest dtype inconsistent with the bytes         | FormatError             |
|   test_manifest_declares_wrong_dtype               |                         |
| empty dataset (dir, manifest, windows, ...)        | ConfigError             |
|   test_empty_dataset[*]                            |                         |
| seq_len larger than a shard                        | FormatError             |
|   test_seq_len_larger_than_a_shard                 |                         |
| global batch not divisible by world size           | ConfigError             |
|   test_batch_not_divisible[*]                      |                         |
| state from another dataset / seed                  | StateError (fields)     |
|   test_state_from_elsewhere[dataset / seed]        |                         |
| state of another format / algorithm version        | StateError              |
|   test_state_from_elsewhere[format-version / alg.] |                         |
| state edited inconsistently                        | StateError              |
|   test_state_from_elsewhere[edited-stream]         |                         |
| state from another mixture (weights)               | StateError ('mixture')  |
|   test_state_from_another_mixture                  |                         |
| negative position                                  | StateError              |
|   test_bad_position[negative]                      |                         |
| position past total_samples (mixture too)          | StateError              |
|   test_bad_position[past-total*]                   |                         |
| position past the addressable 2**62                | StateError              |
|   test_bad_position[past-2**62]                    |                         |
| sampler state negative / past total_samples        | StateError              |
|   test_sampler_state_position                      |                         |
| worker os._exit / raise / hang                     | RuntimeError / original |
|   test_worker_failures_reach_the_main_process      |                         |

Decision on extra files: a manifest is the list of its shards. Verification
checks exactly those (presence, size, digests) and ignores anything else in the
directory (the manifest JSON itself often lives there); loaders never read an
unlisted file, so an extra file cannot change the data. It shows up only when a
manifest is *rebuilt* from the directory, as a different id.

Related single-case tests elsewhere: tests/identity/test_manifest.py (unsafe paths,
field-by-field refusals), tests/loading/test_loader.py::test_mismatched_state_refused_naming_fields,
tests/datasets/test_tables.py::test_mismatched_schemas_name_both_shards_and_field.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

import detdata
from detdata import (
    ConfigError,
    DataLoader,
    FormatError,
    Manifest,
    ManifestError,
    StateError,
    Storage,
    TokenWindows,
    VerificationError,
    build_manifest,
)
from detdata.loading.sampler import DeterministicBatchSampler

REPO = Path(__file__).resolve().parent.parent
# uint16 tokens: 2.4 MB, so the middle byte is outside the quick digest's head/tail MiB
BIG = 1_200_000


def write_tokens(root: Path, sizes: tuple[int, ...], *, seed: int = 0) -> None:
    root.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    for i, size in enumerate(sizes):
        np.save(root / f"shard-{i:03d}.npy", rng.integers(0, 50_000, size=size).astype(np.uint16))


@pytest.fixture
def saved(tmp_path: Path) -> tuple[Path, Path, Manifest]:
    """Shards under ``tmp/data`` (one big) and their manifest saved at ``tmp/m.json``."""
    root = tmp_path / "data"
    write_tokens(root, (1000, BIG, 300))
    manifest = build_manifest(str(root))
    manifest.save(str(tmp_path / "m.json"))
    return root, tmp_path / "m.json", manifest


# ------------------------------------------------------------------ shard bytes
def _flip_middle(root: Path) -> None:
    path = root / "shard-001.npy"
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x01
    path.write_bytes(bytes(data))


def _truncate(root: Path) -> None:
    path = root / "shard-002.npy"
    path.write_bytes(path.read_bytes()[:-6])


def _delete(root: Path) -> None:
    (root / "shard-000.npy").unlink()


def _rename(root: Path) -> None:
    (root / "shard-000.npy").rename(root / "shard-000.npy.old")


DAMAGE: list[tuple[str, Callable[[Path], None], str, str, str]] = [
    # id, damage, culprit shard, VerificationError.field, verify mode that catches it
    ("corrupt-byte", _flip_middle, "shard-001.npy", "blake3", "full"),
    ("truncated", _truncate, "shard-002.npy", "bytes", "quick"),
    ("missing", _delete, "shard-000.npy", "exists", "quick"),
    ("renamed", _rename, "shard-000.npy", "exists", "quick"),
]


@pytest.mark.parametrize(
    ("damage", "culprit", "field", "mode"), [d[1:] for d in DAMAGE], ids=[d[0] for d in DAMAGE]
)
def test_damaged_shard(
    saved: tuple[Path, Path, Manifest],
    damage: Callable[[Path], None],
    culprit: str,
    field: str,
    mode: str,
) -> None:
    root, path, manifest = saved
    entry = next(s for s in manifest.shards if s.path == culprit)
    damage(root)
    if mode == "full":  # head and tail intact: the cheap check cannot see it, the full one must
        assert Manifest.load(str(path), verify="quick").id == manifest.id
    with pytest.raises(VerificationError) as info:
        Manifest.load(str(path), verify=mode)
    err = info.value
    assert (err.shard, err.field) == (culprit, field)
    message = str(err)
    assert culprit in message and str(root) in message
    if field == "exists":
        assert "missing" in message and "renamed" in message  # the hint names the likely cause
        assert f"expected {entry.bytes} bytes" in message
    elif field == "bytes":
        assert err.expected == entry.bytes and err.found == entry.bytes - 6
        assert f"expected {entry.bytes} bytes, found {entry.bytes - 6}" in message
    else:
        assert err.expected == entry.blake3 and err.found != entry.blake3
        assert f"expected {entry.blake3}, found {err.found}" in message
    # the same refusal reaches a dataset opened from the manifest file
    with pytest.raises(VerificationError, match=culprit.replace(".", r"\.")):
        TokenWindows(str(path), 16, storage=Storage(verify=mode))


def test_extra_file_is_not_part_of_the_dataset(saved: tuple[Path, Path, Manifest]) -> None:
    root, path, manifest = saved
    windows = TokenWindows(str(path), 16).num_samples
    np.save(root / "shard-003.npy", np.arange(5000, dtype=np.uint16))  # a valid extra shard
    (root / "notes.txt").write_text("not a shard")
    loaded = Manifest.load(str(path), verify="full")  # decided: extra files are ignored
    assert loaded.id == manifest.id and [s.path for s in loaded.shards] == [
        "shard-000.npy",
        "shard-001.npy",
        "shard-002.npy",
    ]
    assert TokenWindows(str(path), 16).num_samples == windows  # never read
    rebuilt = build_manifest(str(root))  # ...but a rebuild sees it: a new id
    assert rebuilt.id != manifest.id and "shard-003.npy" in [s.path for s in rebuilt.shards]


# ------------------------------------------------------------------ manifest documents
def _set_path(value: str) -> Callable[[dict[str, Any]], str]:
    def edit(doc: dict[str, Any]) -> str:
        doc["shards"][0]["path"] = value
        del doc["id"]
        return json.dumps(doc)

    return edit


def _tamper(doc: dict[str, Any]) -> str:
    doc["shards"][2]["num_samples"] += 1  # id left as it was
    return json.dumps(doc)


def _version(doc: dict[str, Any]) -> str:
    doc["format_version"] = 2
    return json.dumps(doc)


def _truncated_json(doc: dict[str, Any]) -> str:
    return json.dumps(doc)[:-40]


DOCS: list[tuple[str, Callable[[dict[str, Any]], str], str]] = [
    (
        "dotdot",
        _set_path("../outside.npy"),
        r"shard #0: shard path '\.\./outside\.npy' is not a "
        r"normalised relative path",
    ),
    ("nested-dotdot", _set_path("a/../../x.npy"), r"shard #0: shard path 'a/\.\./\.\./x\.npy'"),
    ("absolute", _set_path("/etc/passwd"), r"shard #0: shard path '/etc/passwd' is absolute"),
    (
        "url",
        _set_path("s3://bucket/x.npy"),
        r"shard path 's3://bucket/x\.npy' is absolute or a URL",
    ),
    (
        "tampered",
        _tamper,
        r"id mismatch: the file says b3:[0-9a-f]{64} but its content hashes to "
        r"b3:[0-9a-f]{64}",
    ),
    ("version-2", _version, r"unknown format_version 2; this detdata reads version 1"),
    ("malformed", _truncated_json, r"malformed JSON"),
]


@pytest.mark.parametrize(("edit", "pattern"), [d[1:] for d in DOCS], ids=[d[0] for d in DOCS])
def test_bad_manifest_file(
    saved: tuple[Path, Path, Manifest], edit: Callable[[dict[str, Any]], str], pattern: str
) -> None:
    _, path, manifest = saved
    path.write_text(edit(json.loads(path.read_text())))
    with pytest.raises(ManifestError, match=pattern) as info:
        Manifest.load(str(path), verify="off")  # refused before any byte is read
    assert f"manifest {path}" in str(info.value)  # names the file
    if "mismatch" in pattern:
        assert manifest.id in str(info.value)


# ------------------------------------------------------------------ formats
def test_parquet_schemas_differ(tmp_path: Path) -> None:
    pq.write_table(pa.table({"text": ["a", "b"], "n": [1, 2]}), tmp_path / "part-0.parquet")
    pq.write_table(pa.table({"text": ["c"], "n": [3], "score": [0.5]}), tmp_path / "part-1.parquet")
    manifest = build_manifest(str(tmp_path))
    assert manifest.shards[0].schema != manifest.shards[1].schema
    with pytest.raises(
        FormatError,
        match=r"part-0\.parquet and part-1\.parquet have different "
        r"schemas.*'score' only in the second",
    ):
        detdata.TableRows(manifest)


@pytest.mark.parametrize(
    ("nbytes", "dtype", "error", "pattern"),
    [
        (
            1001,
            "uint16",
            FormatError,
            r"shard t\.bin: 1001 bytes is not a multiple of the uint16 item size 2",
        ),
        (
            1002,
            "uint32",
            FormatError,
            r"shard t\.bin: 1002 bytes is not a multiple of the uint32 item size 4",
        ),
        (1000, "float32", ConfigError, r"t\.bin: dtype float32 is not a token dtype"),
        (1000, "int8", ConfigError, r"t\.bin: dtype int8 is not a token dtype"),
        (1000, "not-a-dtype", ConfigError, r"t\.bin: unknown dtype 'not-a-dtype'"),
    ],
    ids=[
        "size-not-multiple",
        "size-not-multiple-u32",
        "float-dtype",
        "int8-dtype",
        "unknown-dtype",
    ],
)
def test_bin_dtype(
    tmp_path: Path, nbytes: int, dtype: str, error: type[Exception], pattern: str
) -> None:
    (tmp_path / "t.bin").write_bytes(bytes(range(256)) * (nbytes // 256) + bytes(nbytes % 256))
    with pytest.raises(error, match=pattern):
        build_manifest(str(tmp_path), dtype=dtype)


def test_manifest_declares_wrong_dtype(tmp_path: Path) -> None:
    root = tmp_path / "data"
    root.mkdir()
    (root / "t.bin").write_bytes(np.arange(1001, dtype=np.uint16).tobytes())  # odd count of uint16
    doc = build_manifest(str(root), dtype="uint16").to_json()
    del doc["id"]
    doc["shards"][0]["dtype"] = "float32"
    with pytest.raises(ManifestError, match=r"shard #0 \(t\.bin\): field 'dtype' must be one of"):
        Manifest.from_json(doc)
    doc["shards"][0]["dtype"] = "uint32"  # a token dtype, but not what the bytes hold
    edited = Manifest.from_json(doc)
    with pytest.raises(
        FormatError,
        match=r"shard t\.bin: manifest says 1001 x uint32 .* but 2002 "
        r"bytes",
    ):
        TokenWindows(edited, 8)


# ------------------------------------------------------------------ empty / too small
class _NoSamples:
    num_samples = 0

    def read(self, ids: np.ndarray) -> dict[str, np.ndarray]:
        return {"x": ids}

    def identity(self) -> dict[str, Any]:
        return {"type": "no_samples"}


def _empty_dir(tmp: Path) -> Any:
    (tmp / "empty").mkdir()
    return build_manifest(str(tmp / "empty"))


def _all_short(tmp: Path) -> Any:
    write_tokens(tmp / "short", (10, 20))
    return TokenWindows(build_manifest(str(tmp / "short")), 64, allow_short_shards=True)


def _no_shards(tmp: Path) -> Any:
    doc = {"kind": "detdata.manifest", "format_version": 1, "shards": [], "metadata": {}}
    return TokenWindows(Manifest.from_json(doc).with_root(str(tmp)), 8)


EMPTY: list[tuple[str, Callable[[Path], Any], str]] = [
    ("empty-directory", _empty_dir, r"no shards found under '.*empty'"),
    (
        "all-shards-too-short",
        _all_short,
        r"no windows of seq_len=64 .* in 2 shard\(s\); the dataset is empty",
    ),
    ("manifest-without-shards", _no_shards, r"manifest b3:[0-9a-f]{64} has no shards"),
    (
        "empty-arrays",
        lambda _: detdata.ArrayDataset({"x": np.zeros(0)}, name="tiny"),
        r"ArrayDataset 'tiny' is empty",
    ),
    (
        "empty-custom-dataset",
        lambda _: DataLoader(_NoSamples(), global_batch_size=8),
        r"dataset _NoSamples is empty \(num_samples == 0\)",
    ),
    (
        "mixture-with-empty-source",
        lambda _: detdata.Mixture({"a": _NoSamples()}, {"a": 1}, seed=0),
        r"Mixture source 'a' is empty",
    ),
]


@pytest.mark.parametrize(("make", "pattern"), [e[1:] for e in EMPTY], ids=[e[0] for e in EMPTY])
def test_empty_dataset(tmp_path: Path, make: Callable[[Path], Any], pattern: str) -> None:
    with pytest.raises(ConfigError, match=pattern):
        make(tmp_path)


def test_seq_len_larger_than_a_shard(tmp_path: Path) -> None:
    write_tokens(tmp_path, (1000, 40, 500))
    manifest = build_manifest(str(tmp_path))
    with pytest.raises(
        FormatError,
        match=r"shard shard-001\.npy: 40 tokens is too short for one "
        r"window of seq_len=64 \(needs 65 tokens",
    ):
        TokenWindows(manifest, 64)
    with pytest.raises(FormatError, match=r"shard-001\.npy: 40 tokens"):  # labels=False: 64 needed
        TokenWindows(manifest, 64, labels=False)
    assert TokenWindows(manifest, 64, allow_short_shards=True).windows_per_shard == (15, 0, 7)


@pytest.mark.parametrize(
    ("kwargs", "pattern"),
    [
        (
            {"global_batch_size": 10, "world_size": 4, "rank": 0},
            r"global_batch_size 10 is not divisible by world_size 4",
        ),
        (
            {"global_batch_size": 12, "micro_batch_size": 2, "world_size": 4, "rank": 3},
            r"global_batch_size 12 is not divisible by micro_batch_size 2 x world_size 4 = 8",
        ),
        (
            {"global_batch_size": 8, "micro_batch_size": 3},
            r"global_batch_size 8 is not divisible by micro_batch_size 3 x world_size 1 = 3",
        ),
    ],
    ids=["world", "micro-x-world", "micro"],
)
def test_batch_not_divisible(kwargs: dict[str, Any], pattern: str) -> None:
    data = detdata.ArrayDataset({"x": np.arange(100)})
    placement = {k: kwargs.pop(k) for k in ("rank", "world_size") if k in kwargs}
    with pytest.raises(ConfigError, match=pattern):
        DataLoader(data, **kwargs, options=detdata.LoaderOptions(**placement))
    with pytest.raises(ConfigError, match=pattern):
        DeterministicBatchSampler(100, **kwargs, **placement)


# ------------------------------------------------------------------ states
@pytest.fixture
def two_corpora(tmp_path: Path) -> tuple[Manifest, Manifest]:
    write_tokens(tmp_path / "a", (2000, 1000), seed=1)
    write_tokens(tmp_path / "b", (2000, 1000), seed=2)
    return build_manifest(str(tmp_path / "a")), build_manifest(str(tmp_path / "b"))


def _token_loader(manifest: Manifest, seed: int = 1, **kw: Any) -> DataLoader:
    return DataLoader(
        TokenWindows(manifest, 32), global_batch_size=8, micro_batch_size=4, seed=seed, **kw
    )


def _state_after(loader: DataLoader, micro_batches: int) -> dict[str, Any]:
    it = iter(loader)
    for _ in range(micro_batches):
        next(it)
    state: dict[str, Any] = json.loads(json.dumps(loader.state_dict()))
    return state


def _algorithm_v2(state: dict[str, Any]) -> dict[str, Any]:
    state["stream"]["algorithm"] = "feistel-v2"  # as if saved by a future order algorithm
    state["algorithm"] = ["feistel-v2"]
    return state


def _edit_stream(state: dict[str, Any]) -> dict[str, Any]:
    state["stream"]["dataset"]["seq_len"] = 64  # the checked fields no longer match the stream
    return state


STATES: list[tuple[str, str, Callable[[dict[str, Any]], dict[str, Any]], tuple[str, ...], str]] = [
    # id, loader to load into ("other-data" / "other-seed" / "same"), state edit, fields, message
    ("dataset", "other-data", lambda s: s, ("manifests", "data"), r"manifests: saved \['b3:"),
    ("seed", "other-seed", lambda s: s, ("seed",), r"seed: saved 1, current 2"),
    (
        "format-version",
        "same",
        lambda s: {**s, "format_version": 99},
        (),
        r"unknown loader state format_version 99; this detdata reads \[1, 2, 3, 4, 5\]",
    ),
    (
        "algorithm-version",
        "same",
        _algorithm_v2,
        ("algorithm",),
        r"algorithm: saved \['feistel-v2'\], current \['feistel-v1'\]",
    ),
    (
        "edited-stream",
        "same",
        _edit_stream,
        ("data",),
        r"loader state is inconsistent: field\(s\) \['data'\] do not match its own 'stream'",
    ),
    (
        "not-a-state",
        "same",
        lambda s: {"kind": "detdata.sampler_state"},
        (),
        r"not a detdata loader state: field 'kind' is 'detdata.sampler_state'",
    ),
]


@pytest.mark.parametrize(
    ("target", "edit", "fields", "pattern"), [s[1:] for s in STATES], ids=[s[0] for s in STATES]
)
def test_state_from_elsewhere(
    two_corpora: tuple[Manifest, Manifest],
    target: str,
    edit: Callable[[dict[str, Any]], dict[str, Any]],
    fields: tuple[str, ...],
    pattern: str,
) -> None:
    a, b = two_corpora
    state = edit(_state_after(_token_loader(a), 3))
    loader = {
        "other-data": lambda: _token_loader(b),
        "other-seed": lambda: _token_loader(a, seed=2),
        "same": lambda: _token_loader(a),
    }[target]()
    with pytest.raises(StateError, match=pattern) as info:
        loader.load_state_dict(state, mid_step="continue")
    assert set(fields) <= set(info.value.fields)
    assert loader.samples_consumed == 0  # refused states leave the loader untouched
    if target == "other-data":
        assert a.id in str(info.value) and b.id in str(info.value)


def _mixture_loader(total: int | None) -> DataLoader:
    sources = {
        "a": detdata.ArrayDataset({"x": np.arange(50)}, name="a"),
        "b": detdata.ArrayDataset({"x": np.arange(100, 130)}, name="b"),
    }
    mix = detdata.Mixture(sources, schedule=[(0, {"a": 1, "b": 1}), (32, {"a": 3, "b": 1})], seed=4)
    return DataLoader(
        mix, global_batch_size=8, seed=4, options=detdata.LoaderOptions(total_samples=total)
    )


@pytest.mark.parametrize(
    ("make", "position", "pattern"),
    [
        (
            lambda: _mixture_loader(None),
            -8,
            r"'samples_consumed' must be a non-negative integer, found -8",
        ),
        (
            lambda: DataLoader(
                detdata.ArrayDataset({"x": np.arange(10)}),
                global_batch_size=8,
                options=detdata.LoaderOptions(total_samples=64),
            ),
            72,
            r"saved samples_consumed 72 is beyond this loader's total_samples 64",
        ),
        (
            lambda: _mixture_loader(64),
            80,
            r"saved samples_consumed 80 is beyond this loader's total_samples 64",
        ),
        (
            lambda: _mixture_loader(None),
            2**62,
            r"'samples_consumed' is 4611686018427387904, beyond the "
            r"last addressable global position 2\*\*62 - 1",
        ),
        (lambda: _mixture_loader(None), 2**70, r"beyond the last addressable global position"),
    ],
    ids=["negative", "past-total", "past-total-mixture", "past-2**62", "past-2**70"],
)
def test_bad_position(make: Callable[[], DataLoader], position: int, pattern: str) -> None:
    loader = make()
    state = loader.state_dict()
    state["samples_consumed"] = position
    with pytest.raises(StateError, match=pattern) as info:
        loader.load_state_dict(state, mid_step="continue")
    assert "samples_consumed" in info.value.fields or "total_samples" in str(info.value)
    # the boundary itself is accepted: a finished run resumes into an empty iteration
    if loader.total_samples is not None:
        state["samples_consumed"] = loader.total_samples
        loader.load_state_dict(state, mid_step="continue")
        assert list(loader) == []


def test_state_from_another_mixture() -> None:
    """Other weights are refused naming 'mixture'; allowed by name, every source continues
    exactly."""
    saved_loader = _mixture_loader(None)
    state = _state_after(saved_loader, 5)  # 40 positions: inside the second phase
    sources = saved_loader.stream.sources  # type: ignore[attr-defined]
    reweighted = DataLoader(
        detdata.Mixture(sources, {"a": 1, "b": 4}, seed=4), global_batch_size=8, seed=4
    )
    with pytest.raises(StateError, match=r"mixture: saved 'b3:[0-9a-f]{64}', current 'b3:") as info:
        reweighted.load_state_dict(state, mid_step="continue")
    assert info.value.fields == ("mixture",)
    reweighted.load_state_dict(state, allow=["mixture"], mid_step="continue")
    old = _mixture_loader(None).stream
    new = reweighted.stream
    assert isinstance(old, detdata.Mixture) and isinstance(new, detdata.Mixture)
    before = old.consumed(40)
    src, index, _ = new.locate(np.arange(40, 400))
    for s, name in enumerate(new.source_names):  # no sample index repeated or skipped
        mine = index[src == s]
        assert np.array_equal(mine, np.arange(before[name], before[name] + mine.size))
    assert np.array_equal(new.locate(np.arange(40))[0], old.locate(np.arange(40))[0])


def test_mixture_schedule_resumes_past_its_last_phase_start() -> None:
    """The last phase of a schedule extends to infinity: a far position is valid, not 'beyond'."""
    loader = _mixture_loader(None)
    state = loader.state_dict()
    state["samples_consumed"] = 8 * 10**9
    loader.load_state_dict(state, mid_step="continue")
    batch = next(iter(loader))
    mix = loader.stream
    assert isinstance(mix, detdata.Mixture)
    src, _, ids = mix.locate(np.arange(8 * 10**9, 8 * 10**9 + 8))
    expected = [int(i) if s == 0 else 100 + int(i) for s, i in zip(src, ids, strict=True)]
    assert batch["x"].tolist() == expected


def test_sampler_state_position() -> None:
    sampler = DeterministicBatchSampler(100, global_batch_size=8, total_samples=64)
    state = sampler.state_dict()
    for bad, pattern in (
        (-8, r"'samples_consumed' must be an integer in \[0, 2\*\*62\), found -8"),
        (72, r"samples_consumed 72 is beyond this sampler's total_samples 64"),
        (2**64, r"must be an integer in \[0, 2\*\*62\)"),
    ):
        with pytest.raises(StateError, match=pattern) as info:
            sampler.load_state_dict({**state, "samples_consumed": bad})
        assert info.value.fields == ("samples_consumed",)
    sampler.load_state_dict({**state, "samples_consumed": 64})
    assert list(sampler) == []


# ------------------------------------------------------------------ worker failures
_CHILD = textwrap.dedent("""
    import json, os, sys, time
    import numpy as np
    import detdata

    SEED, N = 1, 64
    TRIGGER = int(detdata.GlobalOrder(N, SEED).ids(np.array([20]))[0])  # position 20: micro batch 5

    class Fragile:
        num_samples = N
        def __init__(self, mode):
            self.mode = mode
        def read(self, ids):
            if TRIGGER in ids.tolist():
                if self.mode == "exit":
                    os._exit(3)
                if self.mode == "hang":
                    time.sleep(600)
                raise detdata.FormatError(f"shard bad-shard.npy: cannot decode sample {TRIGGER}")
            return {"x": np.asarray(ids)}
        def identity(self):
            return {"type": "fragile"}

    mode, workers = sys.argv[1], int(sys.argv[2])
    dl = detdata.DataLoader(Fragile(mode), global_batch_size=8, micro_batch_size=4, seed=SEED,
                            num_workers=workers, timeout=2 if workers else 0,
                            options=detdata.LoaderOptions(read=detdata.ReadOptions(batches_ahead=4)))
    delivered, start = 0, time.monotonic()
    try:
        for _ in dl:
            delivered += 1
        outcome = {"type": None}
    except Exception as exc:
        outcome = {"type": type(exc).__name__, "message": str(exc),
                   "notes": list(getattr(exc, "__notes__", []))}
    outcome.update(delivered=delivered, consumed=dl.state_dict()["samples_consumed"],
                   seconds=time.monotonic() - start)
    print(json.dumps(outcome))
    sys.stdout.flush()
    os._exit(0)  # do not wait for a hung worker at interpreter exit
""")


@pytest.mark.slow
@pytest.mark.multiproc
@pytest.mark.parametrize(
    ("mode", "workers"), [("raise", 0), ("raise", 2), ("exit", 2), ("hang", 2)]
)
def test_worker_failures_reach_the_main_process(tmp_path: Path, mode: str, workers: int) -> None:
    """A sample read that raises, kills its worker or hangs surfaces as an error: never a hang.

    Runs in a child process with a hard timeout so that a regression fails the
    test instead of hanging the suite.
    """
    script = tmp_path / "child.py"
    script.write_text(_CHILD)
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    proc = subprocess.run(
        [sys.executable, str(script), mode, str(workers)],
        capture_output=True,
        text=True,
        env=env,
        timeout=90,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["seconds"] < 60
    # the state never counts the batch that failed, whatever the failure
    assert out["consumed"] == 4 * out["delivered"] and out["delivered"] <= 5
    if mode == "raise":
        assert out["type"] == "FormatError"  # the original detdata error type, re-raised
        assert "bad-shard.npy" in out["message"]
        if workers:  # the worker's traceback travels as a note
            assert any(
                "in DataLoader worker process" in n and "Traceback" in n for n in out["notes"]
            )
        assert out["delivered"] == 5
        assert any("global positions [20, 23] of step 2" in n for n in out["notes"]), out["notes"]
    elif mode == "exit":
        # torch's own report (naming the pid), or, when the worker dies mid hand-over and
        # the transfer socket fails first, detdata's (naming the failed transfer)
        assert out["type"] == "RuntimeError"
        assert "exited unexpectedly" in out["message"]
        assert "pid" in out["message"] or "handing over a batch" in out["message"]
    else:
        # a worker process reads groups of batches_ahead=4 micro batches: the group holding micro
        # batch 5 (4..7) is the one that times out, so micro batch 4 is the next undelivered one
        assert out["type"] == "RuntimeError" and "timed out after 2 seconds" in out["message"]
        assert out["delivered"] == 4
        assert any(
            "global positions [16, 19]" in n and "groups of 4 micro batches" in n
            for n in out["notes"]
        ), out["notes"]


def test_array_dataset_given_a_bare_array_names_the_mapping_it_takes() -> None:
    with pytest.raises(ConfigError, match=r"mapping of column name -> array, got ndarray.*hint"):
        detdata.ArrayDataset(np.arange(8))  # type: ignore[arg-type]
