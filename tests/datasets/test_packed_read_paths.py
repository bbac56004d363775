"""Every way `Documents.copy_ranges` copies document pieces, and bounded handles.

`PackedWindows.read` copies whole document pieces (`Documents.copy_ranges`): raw byte
copies when a token file's dtype is the delivered one, numpy slice copies when it is
cast, one fancy-index gather per shard for many short pieces, and per row group for
tables. Each is checked window by window, every column, against the independent
brute-force packer over the writer's input; the handles stay within ``max_open_shards``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest

import detdata
from detdata import Storage
from detdata.datasets.documents import Documents
from detdata.datasets.packed import PackedWindows
from tests.datasets.doc_corpora import (
    random_documents,
    write_hf_arrow,
    write_megatron,
    write_parquet,
)
from tests.order.packing_reference import brute_windows


def _check_all_windows(packed: PackedWindows, docs: list[np.ndarray], **opt: Any) -> None:
    expected = brute_windows([d.tolist() for d in docs], **opt)
    assert packed.num_samples == len(expected)
    ids = np.random.default_rng(2).permutation(packed.num_samples)
    ids = np.concatenate([ids, ids[:5]])  # repeats too
    for a in range(0, ids.size, 7):  # batches of 7 windows, shuffled
        batch = ids[a : a + 7]
        got = packed.read(batch)
        for row, w in enumerate(batch.tolist()):
            ref = expected[w]
            n = int(got["num_segments"][row])
            assert got["tokens"][row].tolist() == ref["tokens"], w
            assert got["doc_index"][row].tolist() == ref["doc_index"], w
            assert got["position_ids"][row].tolist() == ref["position_ids"], w
            assert got["cu_seqlens"][row, : n + 1].tolist() == ref["cu"], w
            assert (got["cu_seqlens"][row, n + 1 :] == opt["seq_len"]).all()


OPT = dict(seed=4, shuffle=True, seq_len=96, labels=True, bos=None, eos=None, tail="drop")
OPT_WRAPPED = dict(seed=6, shuffle=True, seq_len=80, labels=False, bos=1, eos=2, tail="pad")


def _packed(documents: Documents, opt: dict[str, Any]) -> PackedWindows:
    pad = {"pad_id": 0} if opt["tail"] == "pad" else {}
    return PackedWindows(documents, **opt, **pad)


def _opt(opt: dict[str, Any]) -> dict[str, Any]:
    return {**opt, "pad_id": 0 if opt["tail"] == "pad" else None}


@pytest.mark.parametrize("opt", [OPT, OPT_WRAPPED])
@pytest.mark.parametrize(
    ("max_len", "dtype", "out_dtype"),
    [
        (400, "uint16", None),  # long pieces, the delivered dtype: raw byte copies
        (400, "int32", None),  # long pieces, uint16 shards cast to int32: numpy slices
        (400, "uint16", "int64"),  # every shard cast: numpy slices
        (6, "uint16", None),  # many short pieces: one fancy-index gather per shard
    ],
)
def test_megatron_read_paths_equal_the_brute_force_packer(
    tmp_path: Path, opt: dict[str, Any], max_len: int, dtype: str, out_dtype: str | None
) -> None:
    rng = np.random.default_rng(max_len)
    docs = random_documents(rng, 240, max_len=max_len, vocab=50000)
    write_megatron(tmp_path / "a", docs[:100], sentences=2, rng=rng)
    write_megatron(tmp_path / "b", docs[100:170])
    write_megatron(tmp_path / "c", docs[170:], dtype=dtype)
    kw = {} if out_dtype is None else {"out_dtype": out_dtype}
    documents = Documents(detdata.build_manifest(str(tmp_path)), **kw)
    _check_all_windows(_packed(documents, opt), docs, **_opt(opt))


@pytest.mark.parametrize("kind", ["parquet", "hf_arrow_stream"])
@pytest.mark.parametrize("max_len", [300, 5])
def test_table_read_paths_equal_the_brute_force_packer(
    tmp_path: Path, kind: str, max_len: int
) -> None:
    """Pieces in several row groups / record batches, long (slices) and short (gathers)."""
    rng = np.random.default_rng(7 + max_len)
    docs = random_documents(rng, 150, max_len=max_len, vocab=30000)
    if kind == "parquet":
        write_parquet(tmp_path / "a.parquet", docs[:80], row_group_size=9)
        write_parquet(tmp_path / "b.parquet", docs[80:], row_group_size=13)
        manifest = detdata.build_manifest(str(tmp_path))
    else:
        write_hf_arrow(tmp_path, docs, shards=3)
        manifest = detdata.build_manifest(str(tmp_path), format="arrow_stream")
    documents = Documents(manifest, column="input_ids")
    for opt in (OPT, OPT_WRAPPED):
        _check_all_windows(_packed(documents, opt), docs, **_opt(opt))


def test_copy_ranges_equals_slices_of_the_writers_input(tmp_path: Path) -> None:
    rng = np.random.default_rng(11)
    docs = random_documents(rng, 90, max_len=200, vocab=60000, empty=False)
    write_megatron(tmp_path / "a", docs[:40])
    write_megatron(tmp_path / "b", docs[40:], dtype="int32")
    documents = Documents(detdata.build_manifest(str(tmp_path)))
    flat = np.concatenate(docs)
    starts = documents.starts
    for short in (False, True):
        d = rng.integers(0, len(docs), size=60)
        length = starts[d + 1] - starts[d]
        lo = rng.integers(0, length)
        count = np.minimum(rng.integers(1, 8 if short else 200, size=d.size), length - lo)
        source = starts[d] + lo
        target = np.concatenate([[0], np.cumsum(count)[:-1]]) + np.arange(d.size) * 3
        out = np.full(int(target[-1] + count[-1]) + 3, -1, dtype=documents.out_dtype)
        documents.copy_ranges(source, count, target, out)
        expected = np.full_like(out, -1)
        for s, n, t in zip(source.tolist(), count.tolist(), target.tolist(), strict=True):
            expected[t : t + n] = flat[s : s + n]
        assert out.tolist() == expected.tolist()


def test_open_handles_stay_within_max_open_shards(tmp_path: Path) -> None:
    rng = np.random.default_rng(5)
    docs = random_documents(rng, 180, max_len=120, vocab=40000)
    for i in range(6):
        write_megatron(tmp_path / f"p{i}", docs[i * 30 : (i + 1) * 30])
    documents = Documents(detdata.build_manifest(str(tmp_path)), storage=Storage(max_open_shards=2))
    packed = _packed(documents, OPT)
    _check_all_windows(packed, docs, **_opt(OPT))
    assert 1 <= len(documents.files.open_shards()) <= 2
    assert documents.files.local().handles.evictions > 0  # more shards read than handles held
    everything = documents.gather(np.arange(documents.num_tokens, dtype=np.int64))
    assert everything.tolist() == np.concatenate(docs).tolist()
    assert len(documents.files.open_shards()) <= 2
