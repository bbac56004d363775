"""packing-v1 as pure functions: an independent brute-force packer, golden vectors, exactness."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from detdata.base.errors import ConfigError
from detdata.order.packing import (
    ALGORITHM,
    Tail,
    build_offsets,
    covered_tokens,
    locate,
    packed_columns,
    parse_tail,
    segments_bound,
    shuffled_documents,
    window_count,
)
from tests.order.packing_per_token import raw_tokens, token_layout, window_columns
from tests.order.packing_reference import brute_windows, ref_order

GOLDEN = Path(__file__).resolve().parents[1] / "golden" / "packing_v1.json"
OPTIONS = ("seed", "shuffle", "seq_len", "labels", "bos", "eos", "tail", "pad_id")


def corpus_of(lengths: list[int]) -> tuple[np.ndarray, list[list[int]]]:
    """Document starts and the documents: token ``i`` of document ``d`` is ``d * 1000 + i``."""
    docs = [[d * 1000 + i for i in range(n)] for d, n in enumerate(lengths)]
    starts = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
    return starts, docs


def pack(lengths: list[int], ids: list[int] | None = None, **opt: Any) -> list[dict[str, Any]]:
    """The windows ``ids`` (default: all) by the library's pure functions, as plain lists."""
    starts, docs = corpus_of(lengths)
    flat = np.asarray([t for d in docs for t in d], dtype=np.int64)
    bos, eos = opt["bos"], opt["eos"]
    packing = build_offsets(
        starts,
        seed=opt["seed"],
        shuffle=opt["shuffle"],
        extra=(bos is not None) + (eos is not None),
    )
    offsets = packing[0]
    tail = parse_tail(opt["tail"])
    seq_len, width = opt["seq_len"], opt["seq_len"] + int(opt["labels"])
    count = window_count(int(offsets[-1]), seq_len, opt["labels"], tail)
    windows = np.arange(count, dtype=np.int64) if ids is None else np.asarray(ids, dtype=np.int64)
    bound = segments_bound(offsets, count, seq_len) if count else 1
    pieces = locate(offsets, windows, seq_len=seq_len, width=width)
    layout = token_layout(pieces, width)
    documents = shuffled_documents(pieces.position, len(lengths), opt["seed"], opt["shuffle"])
    assert packing[1][pieces.position].tolist() == starts[documents].tolist()
    index, is_bos, is_eos = raw_tokens(
        pieces, layout, packing[1], bos=bos is not None, eos=eos is not None
    )
    values = np.where(index >= 0, flat[np.maximum(index, 0)] if flat.size else 0, 0)
    values[is_bos] = bos if bos is not None else 0
    values[is_eos] = eos if eos is not None else 0
    tokens = np.full(windows.size * width, opt["pad_id"] or 0, dtype=np.int64)
    tokens[layout.flat] = values
    cols = window_columns(
        pieces, layout, rows=windows.size, width=width, seq_len=seq_len, max_segments=bound
    )
    out = []
    for r in range(windows.size):
        n = int(cols["num_segments"][r])
        cu = cols["cu_seqlens"][r].tolist()
        assert cu[n + 1 :] == [seq_len] * (len(cu) - n - 1)  # the documented sentinel
        out.append(
            {
                "tokens": tokens.reshape(-1, width)[r].tolist(),
                "doc_index": cols["doc_index"][r].tolist(),
                "position_ids": cols["position_ids"][r].tolist(),
                "cu": cu[: n + 1],
                "num_segments": n,
            }
        )
    return out


CASES = [
    dict(
        seed=0, shuffle=True, seq_len=8, labels=True, bos=None, eos=None, tail="drop", pad_id=None
    ),
    dict(seed=5, shuffle=True, seq_len=5, labels=False, bos=None, eos=7, tail="drop", pad_id=None),
    dict(seed=9, shuffle=False, seq_len=16, labels=True, bos=1, eos=2, tail="pad", pad_id=3),
    dict(seed=2, shuffle=True, seq_len=3, labels=False, bos=1, eos=None, tail="pad", pad_id=0),
    dict(seed=1, shuffle=True, seq_len=64, labels=True, bos=None, eos=None, tail="pad", pad_id=9),
]


@pytest.mark.parametrize("opt", CASES)
def test_every_window_equals_the_brute_force_packer(opt: dict[str, Any]) -> None:
    rng = np.random.default_rng(opt["seed"] + 100)
    lengths = rng.integers(0, 30, size=57).tolist()
    _, docs = corpus_of(lengths)
    assert pack(lengths, **opt) == brute_windows(docs, **opt)


@settings(max_examples=60, deadline=None)
@given(
    lengths=st.lists(st.integers(0, 40), min_size=1, max_size=30),
    seq_len=st.integers(1, 33),
    labels=st.booleans(),
    shuffle=st.booleans(),
    bos=st.sampled_from([None, 1]),
    eos=st.sampled_from([None, 2]),
    tail=st.sampled_from(["drop", "pad"]),
    seed=st.integers(0, 2**64 - 1),
)
def test_property_brute_force_agreement(
    lengths: list[int],
    seq_len: int,
    labels: bool,
    shuffle: bool,
    bos: int | None,
    eos: int | None,
    tail: str,
    seed: int,
) -> None:
    opt = dict(
        seed=seed,
        shuffle=shuffle,
        seq_len=seq_len,
        labels=labels,
        bos=bos,
        eos=eos,
        tail=tail,
        pad_id=5 if tail == "pad" else None,
    )
    _, docs = corpus_of(lengths)
    assert pack(lengths, **opt) == brute_windows(docs, **opt)


@pytest.mark.parametrize("tail", ["drop", "pad"])
@pytest.mark.parametrize("labels", [True, False])
def test_every_token_of_every_document_once_per_epoch(tail: str, labels: bool) -> None:
    """Inputs of all windows = the shuffled stream, each token once; ``drop`` loses exactly the
    stream tokens past the last full window (with labels, token W*L only as a label)."""
    rng = np.random.default_rng(4)
    lengths = rng.integers(0, 200, size=300).tolist()
    seq_len = 37
    opt = dict(
        seed=3,
        shuffle=True,
        seq_len=seq_len,
        labels=labels,
        bos=None,
        eos=None,
        tail=tail,
        pad_id=0 if tail == "pad" else None,
    )
    windows = pack(lengths, **opt)
    _, docs = corpus_of(lengths)
    stream = [t for d in ref_order(len(docs), 3, True) for t in docs[d]]
    inputs = [t for w in windows for t in w["tokens"][:seq_len]]
    total = len(stream)
    if tail == "drop":
        count = (total - int(labels)) // seq_len
        assert len(windows) == count
        assert inputs == stream[: count * seq_len]
        dropped = stream[count * seq_len :]
        assert len(dropped) == total - count * seq_len < seq_len + int(labels)
        if labels:
            assert windows[-1]["tokens"][-1] == stream[count * seq_len]
    else:
        assert len(windows) == -(-total // seq_len)
        real = inputs[:total]
        assert real == stream and all(
            w >= 0 for w in windows[-1]["doc_index"][: total % seq_len or seq_len]
        )
    assert sorted(inputs[: len(stream)]) == sorted(stream[: len(inputs)])  # nothing twice


def test_random_access_equals_sequential_and_repeats() -> None:
    lengths = np.random.default_rng(8).integers(0, 50, size=200).tolist()
    opt = CASES[0]
    everything = pack(lengths, **opt)
    ids = [len(everything) - 1, 0, 17, 17, 3]
    assert pack(lengths, ids, **opt) == [everything[i] for i in ids]


def test_documents_split_across_windows_and_positions_restart() -> None:
    opt = dict(
        seed=0, shuffle=False, seq_len=4, labels=False, bos=None, eos=None, tail="drop", pad_id=None
    )
    windows = pack([10, 2], **opt)
    assert [w["tokens"] for w in windows] == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9, 1000, 1001]]
    assert windows[2]["doc_index"] == [0, 0, 1, 1] and windows[2]["cu"] == [0, 2, 4]
    assert windows[1]["position_ids"] == [0, 1, 2, 3]  # restart in each window


def test_shuffle_is_a_keyed_permutation_of_the_documents() -> None:
    n = 1000
    a = shuffled_documents(np.arange(n), n, seed=1, shuffle=True)
    b = shuffled_documents(np.arange(n), n, seed=2, shuffle=True)
    assert sorted(a.tolist()) == list(range(n)) and a.tolist() != b.tolist()
    assert a.tolist() == ref_order(n, 1, True)
    assert shuffled_documents(np.arange(5), 5, seed=1, shuffle=False).tolist() == list(range(5))


def test_segments_bound_covers_every_window() -> None:
    lengths = np.random.default_rng(1).integers(0, 6, size=500).tolist()
    opt = dict(
        seed=1, shuffle=True, seq_len=16, labels=True, bos=None, eos=None, tail="pad", pad_id=0
    )
    starts, _ = corpus_of(lengths)
    offsets = build_offsets(starts, seed=1, shuffle=True, extra=0)[0]
    bound = segments_bound(offsets, window_count(int(offsets[-1]), 16, True, Tail.PAD), 16)
    assert max(w["num_segments"] for w in pack(lengths, **opt)) <= bound


def test_too_small_max_segments_and_bad_tail_are_config_errors() -> None:
    starts, _ = corpus_of([1, 1, 1, 1])
    offsets = build_offsets(starts, seed=0, shuffle=False, extra=0)[0]
    pieces = locate(offsets, np.array([0]), seq_len=4, width=4)
    with pytest.raises(ConfigError, match="max_segments=2"):
        window_columns(pieces, token_layout(pieces, 4), rows=1, width=4, seq_len=4, max_segments=2)
    with pytest.raises(ConfigError, match="tail must be"):
        parse_tail("keep")


@pytest.mark.parametrize(("window", "fits"), [(0, 3), (1, 2)])
def test_packed_columns_refuse_more_segments_than_max_segments(window: int, fits: int) -> None:
    """Window 0 holds three one-token documents; window 1 the fourth and a padded tail (a
    segment too): each needs ``fits`` segments, and one fewer is a `ConfigError`."""
    starts, _ = corpus_of([1, 1, 1, 1])
    offsets = build_offsets(starts, seed=0, shuffle=False, extra=0)[0]
    windows = np.array([window])
    pieces = locate(offsets, windows, seq_len=3, width=3)
    covered = covered_tokens(offsets, windows, seq_len=3, width=3)
    columns = packed_columns(pieces, covered, width=3, seq_len=3, max_segments=fits)
    assert columns["num_segments"].tolist() == [fits]
    with pytest.raises(ConfigError, match=f"more than max_segments={fits - 1}; hint"):
        packed_columns(pieces, covered, width=3, seq_len=3, max_segments=fits - 1)


# ------------------------------------------------------------------ golden vectors
def golden() -> dict[str, Any]:
    doc: dict[str, Any] = json.loads(GOLDEN.read_text())
    return doc


def test_golden_file_header() -> None:
    doc = golden()
    assert doc["algorithm"] == ALGORITHM == "packing-v1"
    assert len(doc["cases"]) >= 4


@pytest.mark.parametrize("name", sorted(json.loads(GOLDEN.read_text())["cases"]))
def test_golden_vectors_library_and_brute_force(name: str) -> None:
    case = golden()["cases"][name]
    opt = {k: case[k] for k in OPTIONS}
    _, docs = corpus_of(case["lengths"])
    assert ref_order(len(docs), opt["seed"], opt["shuffle"]) == case["order"]
    starts, _ = corpus_of(case["lengths"])
    extra = (opt["bos"] is not None) + (opt["eos"] is not None)
    offsets = build_offsets(starts, seed=opt["seed"], shuffle=opt["shuffle"], extra=extra)[0]
    assert offsets.tolist() == case["offsets"]
    assert pack(case["lengths"], **opt) == case["windows"]
    assert brute_windows(docs, **opt) == case["windows"]


def _generate() -> None:  # pragma: no cover - run once to write the golden file
    rng = np.random.default_rng(20240601)
    cases = {}
    for i, opt in enumerate(CASES):
        lengths = rng.integers(0, 25, size=12 + 4 * i).tolist()
        starts, _ = corpus_of(lengths)
        extra = (opt["bos"] is not None) + (opt["eos"] is not None)
        offsets = build_offsets(starts, seed=opt["seed"], shuffle=opt["shuffle"], extra=extra)[0]
        cases[f"case{i}"] = {
            **opt,
            "lengths": lengths,
            "order": shuffled_documents(
                np.arange(len(lengths)), len(lengths), opt["seed"], opt["shuffle"]
            ).tolist(),
            "offsets": offsets.tolist(),
            "windows": pack(lengths, **opt),
        }
    doc = {
        "algorithm": ALGORITHM,
        "note": "token i of document d is d * 1000 + i; see detdata/order/packing.py",
        "cases": cases,
    }
    GOLDEN.write_text(json.dumps(doc, indent=1, sort_keys=True) + "\n")


if __name__ == "__main__":  # pragma: no cover
    _generate()
