"""The range-copy read path of packing-v1 (`copy_plan` + `packed_columns`), against the
independent brute-force packer and the per-token formulation, byte for byte."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from detdata.order.packing import (
    build_offsets,
    copy_plan,
    covered_tokens,
    locate,
    packed_columns,
    parse_tail,
    segments_bound,
    window_count,
)
from tests.order.packing_per_token import token_layout, window_columns
from tests.order.packing_reference import brute_windows
from tests.order.test_packing import CASES, corpus_of


def pack_by_ranges(
    lengths: list[int], ids: list[int] | None = None, **opt: Any
) -> tuple[list[dict[str, Any]], dict[str, np.ndarray], dict[str, np.ndarray]]:
    """Windows ``ids`` (default: all) through `copy_plan` + `packed_columns`, as plain lists;
    also the fast and the per-token column arrays themselves."""
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
    seq_len, width = opt["seq_len"], opt["seq_len"] + int(opt["labels"])
    count = window_count(int(offsets[-1]), seq_len, opt["labels"], parse_tail(opt["tail"]))
    windows = np.arange(count, dtype=np.int64) if ids is None else np.asarray(ids, dtype=np.int64)
    bound = segments_bound(offsets, count, seq_len) if count else 1
    pieces = locate(offsets, windows, seq_len=seq_len, width=width)
    covered = covered_tokens(offsets, windows, seq_len=seq_len, width=width)
    plan = copy_plan(pieces, packing[1], width=width, bos=bos is not None, eos=eos is not None)
    assert (plan.count > 0).all()
    tokens = np.full(windows.size * width, -7, dtype=np.int64)  # -7: never written
    for s, n, t in zip(
        plan.source.tolist(), plan.count.tolist(), plan.target.tolist(), strict=True
    ):
        tokens[t : t + n] = flat[s : s + n]  # a plain slice copy per range (the reference)
    tokens[plan.bos_at] = bos if bos is not None else -7
    tokens[plan.eos_at] = eos if eos is not None else -7
    pad = np.arange(width)[None, :] >= covered[:, None]
    assert (tokens.reshape(-1, width)[~pad] != -7).all()  # every covered position written
    tokens.reshape(-1, width)[pad] = opt["pad_id"] if opt["pad_id"] is not None else -7
    fast = packed_columns(pieces, covered, width=width, seq_len=seq_len, max_segments=bound)
    slow = window_columns(
        pieces,
        token_layout(pieces, width),
        rows=windows.size,
        width=width,
        seq_len=seq_len,
        max_segments=bound,
    )
    out = []
    for r in range(windows.size):
        n = int(fast["num_segments"][r])
        out.append(
            {
                "tokens": tokens.reshape(-1, width)[r].tolist(),
                "doc_index": fast["doc_index"][r].tolist(),
                "position_ids": fast["position_ids"][r].tolist(),
                "cu": fast["cu_seqlens"][r, : n + 1].tolist(),
                "num_segments": n,
            }
        )
    return out, fast, slow


def _same_arrays(fast: dict[str, np.ndarray], slow: dict[str, np.ndarray]) -> None:
    assert fast.keys() == slow.keys()
    for key in fast:
        assert fast[key].dtype == slow[key].dtype and fast[key].shape == slow[key].shape, key
        assert fast[key].tobytes() == slow[key].tobytes(), key


@pytest.mark.parametrize("opt", CASES)
def test_range_copies_equal_the_brute_force_packer(opt: dict[str, Any]) -> None:
    rng = np.random.default_rng(opt["seed"] + 200)
    lengths = rng.integers(0, 30, size=57).tolist()
    _, docs = corpus_of(lengths)
    got, fast, slow = pack_by_ranges(lengths, **opt)
    assert got == brute_windows(docs, **opt)
    _same_arrays(fast, slow)


@settings(max_examples=80, deadline=None)
@given(
    lengths=st.lists(st.integers(0, 40), min_size=1, max_size=30),
    seq_len=st.integers(1, 33),
    labels=st.booleans(),
    shuffle=st.booleans(),
    bos=st.sampled_from([None, 1]),
    eos=st.sampled_from([None, 2]),
    tail=st.sampled_from(["drop", "pad"]),
    seed=st.integers(0, 2**64 - 1),
    data=st.data(),
)
def test_property_range_copies_equal_brute_force_in_any_id_order(
    lengths: list[int],
    seq_len: int,
    labels: bool,
    shuffle: bool,
    bos: int | None,
    eos: int | None,
    tail: str,
    seed: int,
    data: st.DataObject,
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
    expected = brute_windows(docs, **opt)
    if not expected:
        return
    ids = data.draw(st.lists(st.integers(0, len(expected) - 1), min_size=1, max_size=12))
    got, fast, slow = pack_by_ranges(lengths, ids, **opt)  # any order, repeats included
    assert got == [expected[i] for i in ids]
    _same_arrays(fast, slow)
