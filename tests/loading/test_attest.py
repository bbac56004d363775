"""Resume attestation (issue 43): what the checked identity fields cannot see is refused at the
resume's first batch, naming the position; nothing else is.

Each refusal case changes something outside the checked fields between the saving run and the
resume (an edited transform body under the same name and ``transform_id``, a tokenizer-like
object's internal table, a global the transform reads, a shard edited under a receipt
rewritten to vouch for it). The reference that the change is real is an uninterrupted run of
each side, compared sample by sample; the refusal must come before the first batch of the
resume and name an attested position (one of the last samples delivered before the save).
Before the fix each of these resumes delivered the changed samples silently.

The no-false-alarm soak resumes random states on other layouts (data parallel, micro batch,
workers in threads and processes, mixtures, packing, exclusions, batch schedules): every
resumed rank's first batch must be the uninterrupted run's.
"""

from __future__ import annotations

import importlib
import json
import logging
import os
import random
import re
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import detdata
from detdata.base.errors import StateError
from detdata.datasets.documents import Documents
from detdata.identity import receipts
from detdata.identity.manifest import Manifest
from detdata.loading.attest import ATTESTED, Attestation
from detdata.loading.loader import DataLoader
from detdata.order.batches import BatchSchedule
from tests import soak
from tests.datasets.doc_corpora import random_documents, write_megatron
from tests.resume_checker import batch_bytes, take

GBS, MICRO = 8, 2
SAVE_AFTER = 8  # micro batches before the save (world 1): 16 samples, the end of step 1
N = 200


def _arrays() -> detdata.ArrayDataset:
    ids = np.arange(N, dtype=np.int64)
    return detdata.ArrayDataset({"id": ids, "x": (ids * 7 % 31).astype(np.int32)})


def _loader(data: Any, transform: Any = None, **kw: Any) -> DataLoader:
    return DataLoader(
        data,
        global_batch_size=GBS,
        micro_batch_size=MICRO,
        seed=3,
        options=detdata.LoaderOptions(transform=transform, transform_id="tok-v1", **kw),
    )


def _save(make: Callable[[], DataLoader]) -> dict[str, Any]:
    loader = make()
    list(take(loader, SAVE_AFTER))
    return json.loads(json.dumps(loader.state_dict()))


def _sample_bytes(make: Callable[[], DataLoader], position: int) -> bytes:
    """The bytes an uninterrupted run delivers at ``position`` (world 1: rows in order)."""
    loader = make()
    per = MICRO
    batch = list(take(loader, position // per + 1))[-1]
    row = position % per
    return batch_bytes({k: v[row] for k, v in batch.items()})


def _refused(make: Callable[[], DataLoader], state: dict[str, Any]) -> int:
    """Resume ``state`` into ``make()``: the checked fields pass, the first batch is refused
    naming an attested position and its saved digest; returns that position."""
    loader = make()
    loader.load_state_dict(state)  # every checked field is equal
    with pytest.raises(StateError) as info:
        next(iter(loader))
    text = str(info.value)
    found = re.search(
        r"at global position (\d+) digested as ([0-9a-f]{64}) .* as ([0-9a-f]{64})", text
    )
    assert found, text
    position = int(found.group(1))
    consumed = state["samples_consumed"]
    assert consumed - ATTESTED <= position < consumed
    saved = state["attestation"]
    assert found.group(2) == saved["samples"][position - saved["first"]]
    assert found.group(3) != found.group(2)
    assert "step 2 " in text and "transform, exclusions" in text  # the equal fields, listed
    assert loader.samples_consumed == consumed  # nothing was delivered
    return position


def _changed_at(make_a: Callable[[], DataLoader], make_b: Callable[[], DataLoader], p: int) -> None:
    """The reference: uninterrupted runs of both sides deliver other bytes at ``p``."""
    assert _sample_bytes(make_a, p) != _sample_bytes(make_b, p)


def _attested_bytes(make: Callable[[], DataLoader], state: dict[str, Any]) -> dict[int, bytes]:
    """What an uninterrupted run delivers at each position ``state`` attests."""
    consumed = state["samples_consumed"]
    return {q: _sample_bytes(make, q) for q in range(consumed - ATTESTED, consumed)}


def test_an_edited_transform_body_under_the_same_name_and_id_is_refused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(sys, "dont_write_bytecode", True)
    monkeypatch.syspath_prepend(str(tmp_path))
    source = tmp_path / "attest_tf_mod.py"
    source.write_text("def tokenize(sample):\n    return {'x': sample['x'] * 2}\n")
    module = importlib.import_module("attest_tf_mod")
    try:
        make = lambda: _loader(_arrays(), module.tokenize)  # noqa: E731 (looked up per call)
        state = _save(make)
        before = _attested_bytes(make, state)
        source.write_text("def tokenize(sample):\n    return {'x': sample['x'] * 2 + 1}\n")
        importlib.reload(module)
        assert make().state_dict()["transform"] == state["transform"] == "id:tok-v1"
        p = _refused(make, state)
        assert _sample_bytes(make, p) != before[p]  # the reference: the edit is real there
    finally:
        sys.modules.pop("attest_tf_mod", None)


class Tokenizer:
    """A tokenizer-like callable: its vocabulary is an internal table (a numpy array, which
    the checked ``transform`` field records by type only)."""

    def __init__(self, table: np.ndarray) -> None:
        self.table = table

    def __call__(self, sample: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        return {"ids": self.table[sample["x"] % len(self.table)]}


def test_a_tokenizer_object_whose_internal_table_changed_is_refused() -> None:
    old = Tokenizer(np.arange(31, dtype=np.int64) * 10)
    new = Tokenizer(np.arange(31, dtype=np.int64)[::-1] * 10)  # another vocabulary, same type
    a = lambda: _loader(_arrays(), old)  # noqa: E731
    b = lambda: _loader(_arrays(), new)  # noqa: E731
    state = _save(a)
    assert b().state_dict()["transform"] == state["transform"]
    _changed_at(a, b, _refused(b, state))


SCALE = 1


def _scaled(sample: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    return {"x": sample["x"] * SCALE}


def test_a_transform_reading_a_global_changed_between_runs_is_refused(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    make = lambda: _loader(_arrays(), _scaled)  # noqa: E731
    state = _save(make)
    before = _attested_bytes(make, state)
    monkeypatch.setattr(sys.modules[__name__], "SCALE", 3)
    p = _refused(make, state)
    assert _sample_bytes(make, p) != before[p]


def _rewrite_receipt(manifest: Manifest) -> None:
    """Record the shards' identities as they are now in this user's receipt (what a receipt
    rewritten after an edit says: these bytes were checked)."""
    path = receipts.receipt_path(manifest)
    assert path is not None and os.path.exists(path)
    assert manifest.root is not None
    ids = receipts.local_identities(manifest.root, [s.path for s in manifest.shards])
    assert (ids[:, 0] >= 0).all()  # settled (older than RACY_S)
    receipts.write_receipt(path, manifest, detdata.Verify.QUICK, None, ids)


def test_a_shard_edited_under_a_rewritten_receipt_is_refused(tmp_path: Path) -> None:
    root = tmp_path / "tok"
    root.mkdir()
    for s in range(3):
        np.save(root / f"s{s}.npy", (np.arange(400, dtype=np.int32) * (s + 3)) % 5000)
    manifest_path = str(tmp_path / "m.json")
    detdata.build_manifest(str(root), pattern="*.npy").save(manifest_path)

    def make() -> DataLoader:
        return _loader(detdata.TokenWindows(manifest_path, 7, storage=detdata.Storage()))

    state = _save(make)
    before = _attested_bytes(make, state)
    first = state["samples_consumed"] - ATTESTED  # the first sample the state attests
    loader = make()
    loader.load_state_dict(state)
    record = [r for r in loader.provenance(loader.step_of_position(first)) if r.position == first]
    shard = root / os.path.basename(str(record[0].location["shard"]))
    arr = np.load(shard)
    np.save(shard, (arr + 1) % 5000)  # same size, other tokens
    time.sleep(receipts.RACY_S + 0.2)
    _rewrite_receipt(Manifest.load(manifest_path, verify="off"))
    make()  # the start-up verification trusts the receipt: the edit is not found there
    p = _refused(make, state)
    assert _sample_bytes(make, p) != before[p]


def test_the_switch_turns_attestation_off_and_an_unchanged_resume_passes() -> None:
    make = lambda: _loader(_arrays(), Tokenizer(np.arange(31) * 2))  # noqa: E731
    state = _save(make)
    found = Attestation.from_json(state["attestation"])
    assert found is not None and found.first == 12
    resumed = make()
    resumed.load_state_dict(state)
    straight = make()
    list(take(straight, SAVE_AFTER))
    assert batch_bytes(next(iter(resumed))) == batch_bytes(next(iter(straight)))
    off = DataLoader(
        _arrays(),
        global_batch_size=GBS,
        micro_batch_size=MICRO,
        seed=3,
        options=detdata.LoaderOptions(
            transform=Tokenizer(np.arange(31) * 5),
            transform_id="tok-v1",
            resume=detdata.ResumePolicy(attest=False),
        ),
    )
    list(take(off, SAVE_AFTER))
    assert off.state_dict()["attestation"] == {"first": None, "samples": [], "group": None}
    off.load_state_dict(state)
    next(iter(off))  # another table, attestation off: resumed without a check


def test_a_format_4_state_resumes_without_attestation_said_in_the_log(
    caplog: pytest.LogCaptureFixture,
) -> None:
    make = lambda: _loader(_arrays(), Tokenizer(np.arange(31) * 2))  # noqa: E731
    state = _save(make)
    old = {k: v for k, v in state.items() if k != "attestation"}  # as format 4 wrote it
    old["format_version"] = 4
    loader = make()
    with caplog.at_level(logging.WARNING, logger="detdata"):
        loader.load_state_dict(old)
    said = [r for r in caplog.records if "not attested" in r.getMessage()]
    assert len(said) == 1 and "format 4" in said[0].getMessage()
    straight = make()
    list(take(straight, SAVE_AFTER))
    assert batch_bytes(next(iter(loader))) == batch_bytes(next(iter(straight)))


@pytest.mark.parametrize(
    "bad",
    [
        {"first": 12, "samples": ["0" * 64] * 5, "group": None},
        {"first": -1, "samples": ["0" * 64] * 4, "group": None},
        {"first": 12, "samples": ["x" * 64] * 4, "group": None},
        {"first": 12, "samples": ["0" * 64] * 4},
    ],
)
def test_a_malformed_attestation_is_refused_naming_the_field(bad: dict[str, Any]) -> None:
    state = _save(lambda: _loader(_arrays()))
    state["attestation"] = bad
    with pytest.raises(StateError, match="field 'attestation'") as info:
        _loader(_arrays()).load_state_dict(state)
    assert info.value.fields == ("attestation",)


def test_a_state_dict_before_the_first_resumed_batch_keeps_the_saved_attestation() -> None:
    """A state saved again before the resume's first batch carries the attestation still to be
    passed (not one derived from the changed pipeline): it is refused at the next resume too."""
    a = lambda: _loader(_arrays(), Tokenizer(np.arange(31) * 2))  # noqa: E731
    b = lambda: _loader(_arrays(), Tokenizer(np.arange(31) * 3))  # noqa: E731
    state = _save(a)
    loader = b()
    loader.load_state_dict(state)
    again = json.loads(json.dumps(loader.state_dict()))
    assert again["attestation"] == state["attestation"]
    _refused(b, again)


def test_a_mid_step_state_saved_again_before_its_first_batch_resumes_again() -> None:
    """A state saved inside a step resumes at the step's start (before the attested samples);
    saved again before its first batch (a trainer's checkpoint right after restoring), the
    new state carries the attestation still to be passed, and it resumes (before the fix:
    refused as "attests positions past samples_consumed")."""
    make = lambda: _loader(_arrays(), Tokenizer(np.arange(31) * 2))  # noqa: E731
    loader = make()
    list(take(loader, 7))  # 14 samples: 6 into step 1
    state = json.loads(json.dumps(loader.state_dict()))
    resumed = make()
    resumed.load_state_dict(state)  # redo: back to position 8
    again = json.loads(json.dumps(resumed.state_dict()))
    assert again["samples_consumed"] == 8 and again["attestation"] == state["attestation"]
    final = make()
    final.load_state_dict(again)
    straight = make()
    list(take(straight, 4))
    assert batch_bytes(next(iter(final))) == batch_bytes(next(iter(straight)))


# ------------------------------------------------------------------ no false alarm (soak)
@pytest.fixture(scope="module")
def docs(tmp_path_factory: pytest.TempPathFactory) -> Documents:
    root = tmp_path_factory.mktemp("attest-docs")
    rng = np.random.default_rng(5)
    write_megatron(root / "a", random_documents(rng, 120, max_len=40, empty=False))
    return Documents(detdata.build_manifest(str(root)))


def _noisy(sample: dict[str, np.ndarray], rng: np.random.Generator) -> dict[str, np.ndarray]:
    key = next(iter(sample))
    return {key: sample[key] + rng.integers(0, 1000, size=np.shape(sample[key]))}


def _data(kind: str, docs: Documents) -> Any:
    if kind == "arrays":
        return _arrays()
    if kind == "mixture":
        other = detdata.ArrayDataset({"id": np.arange(1000, 1037, dtype=np.int64)}, name="b")
        a = detdata.ArrayDataset({"id": np.arange(N, dtype=np.int64)}, name="a")
        return detdata.Mixture({"a": a, "b": other}, {"a": "0.75", "b": "0.25"}, seed=4)
    if kind == "packing":
        return detdata.PackedWindows(docs, 16, index_dir=None)
    base = detdata.OrderedStream(_arrays(), 9)
    ids = base.sample_ids(np.arange(40)).tolist()
    return detdata.Excluded(base, [(0, detdata.ExclusionList.of([ids[3], ids[10]]))])


def _layouts(rng: random.Random, gbs: int) -> tuple[int, int]:
    """A (world, micro) whose product divides ``gbs``."""
    options = [(w, m) for w in (1, 2, 3, 4, 7, 8) for m in (1, 2, 4) if gbs % (w * m) == 0]
    return rng.choice(options)


def _soak_loader(
    data: Any, batch: Any, world: int, micro: int, rank: int, extra: dict[str, Any]
) -> DataLoader:
    mode = extra.get("mode", "thread")
    return DataLoader(
        data,
        global_batch_size=batch,
        micro_batch_size=micro,
        seed=7,
        num_workers=extra.get("workers", 0),
        options=detdata.LoaderOptions(
            rank=rank,
            world_size=world,
            transform=extra.get("transform"),
            read=detdata.ReadOptions(worker_mode=mode, batches_ahead=extra.get("batches_ahead", 2)),
        ),
    )


@pytest.mark.slow
def test_random_resumes_on_other_layouts_raise_no_false_alarm(docs: Documents) -> None:
    rng = random.Random(43)
    rounds = soak.rounds(200, 8)
    kinds = ["arrays", "mixture", "packing", "excluded"]
    for i in range(rounds):
        kind = kinds[i % len(kinds)]
        data = _data(kind, docs)
        schedule = rng.random() < 0.3
        batch: Any = BatchSchedule.by_steps([(0, 8), (2, 56)]) if schedule else 56
        world_a, micro_a = _layouts(rng, 8 if schedule else 56)
        world_b, micro_b = _layouts(rng, 8 if schedule else 56)
        if schedule:  # a micro batch is fixed in a schedule; 56 is a multiple of 8
            micro_a, micro_b = 1, rng.choice((1, 2))
            world_b = rng.choice([w for w in (1, 2, 4) if 8 % (w * micro_b) == 0])
        steps = rng.randint(1, 3)
        extra_a = {"transform": _noisy if rng.random() < 0.5 else None}
        extra_b = dict(extra_a)
        workers = rng.choice((0, 0, 2))
        if workers:
            extra_b.update(workers=workers, mode=rng.choice(("thread", "process")))
        saver = _soak_loader(data, batch, world_a, micro_a, 0, extra_a)
        end = saver.position_of_step(steps)
        it = iter(saver)
        while saver.samples_consumed < end:
            next(it)
        state = json.loads(json.dumps(saver.state_dict()))
        assert len(state["attestation"]["samples"]) == 4
        for rank in range(world_b):
            resumed = _soak_loader(data, batch, world_b, micro_b, rank, extra_b)
            resumed.load_state_dict(state)
            got = next(iter(resumed))  # attested here: no StateError
            straight = _soak_loader(data, batch, world_b, micro_b, rank, {**extra_a})
            sit = iter(straight)
            while straight.samples_consumed < end:
                next(sit)
            want = next(sit)
            assert batch_bytes(got) == batch_bytes(want), (i, kind, rank)
            resumed.close()
