"""PackedWindows over real corpora: brute-force equality, masks, loader resume and placement."""

from __future__ import annotations

import itertools
import pickle
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pytest
import torch

import detdata
from detdata.base.errors import ConfigError
from detdata.datasets.documents import Documents
from detdata.datasets.packed import PackedWindows
from tests.datasets.doc_corpora import random_documents, write_megatron, write_parquet
from tests.order.packing_reference import brute_windows
from tests.resume_checker import batch_bytes, check_resume_everywhere, run_digests, take


@pytest.fixture(scope="module")
def corpus(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[np.ndarray]]:
    """Three Megatron pairs of 400 documents of random lengths (some empty, some long)."""
    root = tmp_path_factory.mktemp("megatron")
    rng = np.random.default_rng(21)
    docs = random_documents(rng, 400, max_len=90, vocab=50000)
    docs[5] = rng.integers(0, 50000, size=700)  # longer than several windows
    write_megatron(root / "a", docs[:150], sentences=3, rng=rng)
    write_megatron(root / "b", docs[150:300])
    write_megatron(root / "c", docs[300:], dtype="uint16")
    return root, docs


def documents_of(corpus: tuple[Path, list[np.ndarray]], **kw: Any) -> Documents:
    return Documents(detdata.build_manifest(str(corpus[0])), **kw)


OPTIONS = [
    dict(
        seed=0, shuffle=True, seq_len=64, labels=True, bos=None, eos=None, tail="drop", pad_id=None
    ),
    dict(seed=3, shuffle=True, seq_len=50, labels=False, bos=None, eos=1, tail="pad", pad_id=0),
    dict(seed=7, shuffle=False, seq_len=128, labels=True, bos=2, eos=3, tail="pad", pad_id=0),
]


@pytest.mark.parametrize("opt", OPTIONS)
def test_windows_equal_an_independent_brute_force_packer_over_the_writers_input(
    corpus: tuple[Path, list[np.ndarray]], opt: dict[str, Any]
) -> None:
    packed = PackedWindows(documents_of(corpus), **opt)
    expected = brute_windows([d.tolist() for d in corpus[1]], **opt)
    assert packed.num_samples == len(expected)
    got = packed.read(np.arange(packed.num_samples))
    for w, ref in enumerate(expected):
        n = int(got["num_segments"][w])
        assert got["tokens"][w].tolist() == ref["tokens"], w
        assert got["doc_index"][w].tolist() == ref["doc_index"], w
        assert got["position_ids"][w].tolist() == ref["position_ids"], w
        assert got["cu_seqlens"][w, : n + 1].tolist() == ref["cu"], w
        assert (got["cu_seqlens"][w, n + 1 :] == opt["seq_len"]).all()
    shuffled = np.random.default_rng(0).permutation(packed.num_samples)[:40]
    again = packed.read(shuffled)
    for key, column in got.items():
        assert np.array_equal(again[key], column[shuffled]), key


def test_schema_identity_and_argument_checks(corpus: tuple[Path, list[np.ndarray]]) -> None:
    docs = documents_of(corpus)
    packed = PackedWindows(docs, 32, seed=1)
    batch = packed.read(np.array([0, 1]))
    from detdata.datasets.batch_columns import describe_column

    assert {k: describe_column(v) for k, v in batch.items()} == packed.schema()
    ident = packed.identity()
    assert ident["algorithm"] == "packing-v1" and ident["documents"]["manifest"] == docs.manifest.id
    assert PackedWindows(docs, 32, seed=2).identity() != ident
    with pytest.raises(ConfigError, match="pad_id"):
        PackedWindows(docs, 32, tail="pad")
    with pytest.raises(ConfigError, match="pad_id"):
        PackedWindows(docs, 32, pad_id=0)
    with pytest.raises(ConfigError, match="max_segments=1 is below"):
        PackedWindows(docs, 32, max_segments=1)
    with pytest.raises(ConfigError, match="bos"):
        PackedWindows(docs, 32, bos=70000)  # not a uint16 token
    with pytest.raises(ConfigError, match="no windows"):
        PackedWindows(docs, 10**7)


def _attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor
) -> torch.Tensor:
    scores = (q @ k.transpose(-1, -2)) / q.shape[-1] ** 0.5
    return torch.softmax(scores.masked_fill(~mask, float("-inf")), dim=-1) @ v


def test_cu_seqlens_block_attention_equals_the_dense_doc_index_mask(
    corpus: tuple[Path, list[np.ndarray]],
) -> None:
    """A tiny causal attention layer run per cu_seqlens segment (what a varlen kernel does)
    gives the outputs of one dense pass under the mask built from doc_index."""
    packed = PackedWindows(documents_of(corpus), 96, seed=4, tail="pad", pad_id=0)
    batch = packed.read(np.arange(packed.num_samples))
    gen = torch.Generator().manual_seed(0)
    embed = torch.randn(50000, 16, generator=gen)
    wq, wk, wv = (torch.randn(16, 16, generator=gen) for _ in range(3))
    L = packed.seq_len
    multi = 0
    for w in range(packed.num_samples):
        x = embed[torch.from_numpy(batch["tokens"][w, :L].astype(np.int64))]
        q, k, v = x @ wq, x @ wk, x @ wv
        doc = torch.from_numpy(batch["doc_index"][w, :L])
        causal = torch.ones(L, L, dtype=torch.bool).tril()
        dense = _attention(q, k, v, (doc[:, None] == doc[None, :]) & causal)
        n = int(batch["num_segments"][w])
        cu = batch["cu_seqlens"][w, : n + 1].tolist()
        multi += n > 1
        blocks = [
            _attention(q[a:b], k[a:b], v[a:b], torch.ones(b - a, b - a, dtype=torch.bool).tril())
            for a, b in itertools.pairwise(cu)
        ]
        torch.testing.assert_close(torch.cat(blocks), dense, rtol=1e-5, atol=1e-5)
        positions = batch["position_ids"][w, :L].tolist()
        assert positions == [t - cu[max(i for i in range(n) if cu[i] <= t)] for t in range(L)]
    assert multi > packed.num_samples // 2  # most windows really hold several documents


# ------------------------------------------------------------------ through the loader
def loader(packed: PackedWindows, **kw: Any) -> detdata.DataLoader:
    args: dict[str, Any] = dict(global_batch_size=8, micro_batch_size=4, seed=5)
    args.update(kw)
    return detdata.DataLoader(packed, **args)


def test_resume_at_every_step(corpus: tuple[Path, list[np.ndarray]]) -> None:
    packed = PackedWindows(documents_of(corpus), 48, seed=2, eos=1)
    reference = check_resume_everywhere(lambda: loader(packed), 60)
    assert len(set(reference)) == len(reference)


def _global_steps(
    packed: PackedWindows, world: int, micro: int, steps: int, **kw: Any
) -> list[bytes]:
    per_rank = []
    for rank in range(world):
        dl = loader(
            packed,
            global_batch_size=8,
            micro_batch_size=micro,
            options=detdata.LoaderOptions(rank=rank, world_size=world),
            **kw,
        )
        per_rank.append(list(take(dl, steps * 8 // (micro * world))))
    per_step = 8 // (micro * world)
    out = []
    for s in range(steps):
        cols: dict[str, list[torch.Tensor]] = {}
        for i in range(s * per_step, (s + 1) * per_step):
            for rank in range(world):
                for key, value in per_rank[rank][i].items():
                    cols.setdefault(key, []).append(value)
        out.append(batch_bytes({k: torch.cat(v) for k, v in cols.items()}))
    return out


def test_reshard_matrix_dp_1_2_4_by_micro_batch(corpus: tuple[Path, list[np.ndarray]]) -> None:
    packed = PackedWindows(documents_of(corpus), 40, seed=8, bos=2)
    reference = _global_steps(packed, 1, 8, 5)
    for world in (1, 2, 4):
        for micro in sorted({1, 2, 8 // world}):
            assert _global_steps(packed, world, micro, 5) == reference, (world, micro)


@pytest.mark.parametrize("mode", ["thread", "process"])
def test_workers_deliver_the_same_bytes_and_resume(
    corpus: tuple[Path, list[np.ndarray]], tmp_path: Path, mode: str
) -> None:
    docs = documents_of(corpus, index_dir=tmp_path / "ix")  # workers re-open the index files
    packed = PackedWindows(docs, 40, seed=8, eos=1)
    straight = run_digests(loader(packed), 12)
    states: list[dict[str, Any]] = []
    options = detdata.LoaderOptions(read=detdata.ReadOptions(worker_mode=mode))
    with_workers = run_digests(loader(packed, num_workers=2, options=options), 12, states)
    assert with_workers == straight
    resumed = loader(packed, num_workers=2, options=options)
    resumed.load_state_dict(states[4], mid_step="continue")
    assert run_digests(resumed, 7) == straight[5:]


def test_a_mixture_of_packed_sources_mixes_by_windows(
    corpus: tuple[Path, list[np.ndarray]], tmp_path: Path
) -> None:
    other = tmp_path / "pq"
    other.mkdir()
    docs = random_documents(np.random.default_rng(9), 200, max_len=60, vocab=50000)
    write_parquet(other / "t.parquet", docs, value=pa.uint16())
    web = PackedWindows(documents_of(corpus), 32, seed=1, max_segments=40)
    books = PackedWindows(
        Documents(detdata.build_manifest(str(other)), column="input_ids"),
        32,
        seed=2,
        max_segments=40,
    )
    mix = detdata.Mixture({"web": web, "books": books}, {"web": 3, "books": 1}, seed=4)
    batch = mix.fetch(np.arange(64))
    assert batch["tokens"].shape == (64, 33) and batch["cu_seqlens"].shape == (64, 41)
    source, _, ids = mix.locate(np.arange(64))
    for name, ds in (("web", web), ("books", books)):
        rows = np.flatnonzero(source == mix.source_names.index(name))
        assert rows.size > 0
        for key, column in ds.read(ids[rows]).items():
            assert np.array_equal(batch[key][rows], column), (name, key)
    reference = check_resume_everywhere(lambda: loader(mix), 16)  # type: ignore[arg-type]
    assert len(reference) == 16
    with pytest.raises(detdata.FormatError):
        detdata.Mixture(
            {"web": web, "other": PackedWindows(documents_of(corpus), 32, seed=1)},
            {"web": 1, "other": 1},
            seed=0,
        )


def test_packing_index_is_content_addressed_and_pickles_small(
    corpus: tuple[Path, list[np.ndarray]], tmp_path: Path
) -> None:
    index = tmp_path / "ix"
    docs = documents_of(corpus, index_dir=index)
    a = PackedWindows(docs, 32, seed=1)
    names = {p.name for p in index.iterdir()}
    assert sum(n.startswith("packing-") for n in names) == 2
    b = PackedWindows(docs, 32, seed=1)  # loaded, not rebuilt
    assert {p.name for p in index.iterdir()} == names
    assert np.array_equal(a.read(np.arange(10))["tokens"], b.read(np.arange(10))["tokens"])
    PackedWindows(docs, 32, seed=2)
    assert sum(p.name.startswith("packing-") for p in index.iterdir()) == 4
    blob = pickle.dumps(a)
    assert len(blob) < 20_000  # the index travels as a file name, not 8 bytes a document
    copy = pickle.loads(blob)
    assert np.array_equal(copy.read(np.arange(10))["tokens"], a.read(np.arange(10))["tokens"])
