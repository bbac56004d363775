"""A newcomer's torch habits get detdata's answer, not a raw Python error (issue 34).

* ``DataLoader(ds, batch_size=8)`` / ``DataLoader(ds, 8)`` / no batch size: a `ConfigError` naming
  ``global_batch_size`` and ``micro_batch_size``; other torch-only arguments name detdata's own;
  a misspelt keyword is Python's ``TypeError`` naming it (the signature has no ``**kwargs``,
  issue 42, so a type checker flags it too);
* every dataset has ``len()`` = ``num_samples`` (what torch's ``len(dataset)`` means);
* a bare registry name warns, naming the version it took; an unknown name gets "did you mean";
* an exclusion without a source on a mixture says how to name the source.
"""

from __future__ import annotations

import warnings
from fractions import Fraction
from pathlib import Path

import numpy as np
import pytest

import detdata
from detdata.identity.registry import BareNameWarning
from tests.conftest import write_token_shards
from tests.datasets.doc_corpora import random_documents, write_megatron


@pytest.fixture
def ds() -> detdata.ArrayDataset:
    return detdata.ArrayDataset({"x": np.arange(100, dtype=np.int64)})


@pytest.mark.parametrize(
    ("call", "named"),
    [
        (lambda d: detdata.DataLoader(d, batch_size=8), ["micro_batch_size", "global_batch_size"]),
        (lambda d: detdata.DataLoader(d, 8), ["micro_batch_size", "global_batch_size"]),
        (lambda d: detdata.DataLoader(d), ["global_batch_size", "micro_batch_size"]),
        (lambda d: detdata.DataLoader(d, global_batch_size=8, shuffle=True), ["seed="]),
        (lambda d: detdata.DataLoader(d, global_batch_size=8, drop_last=True), ["whole"]),
        (
            lambda d: detdata.DataLoader(d, global_batch_size=8, sampler=[0]),
            ["order=", "DeterministicBatchSampler"],
        ),
    ],
    ids=["batch_size", "positional", "none", "shuffle", "drop_last", "sampler"],
)
def test_torch_habits_get_a_config_error_naming_detdatas_argument(
    ds: detdata.ArrayDataset, call: object, named: list[str]
) -> None:
    with pytest.raises(detdata.ConfigError) as info:
        call(ds)  # type: ignore[operator]
    for word in named:
        assert word in str(info.value), str(info.value)


@pytest.mark.parametrize(
    "keywords", [{"global_batch_size": 8, "micro_batch": 4}, {"global_batch_sise": 8}]
)
def test_a_misspelt_keyword_is_a_type_error_naming_it(
    ds: detdata.ArrayDataset, keywords: dict[str, int]
) -> None:
    typo = next(k for k in keywords if k != "global_batch_size")
    with pytest.raises(TypeError, match=f"unexpected keyword argument '{typo}'"):
        detdata.DataLoader(ds, **keywords)  # type: ignore[arg-type]


def test_the_correct_call_still_delivers_the_samples(ds: detdata.ArrayDataset) -> None:
    loader = detdata.DataLoader(ds, global_batch_size=10, micro_batch_size=10, seed=3)
    first = next(iter(loader))["x"]
    order = detdata.GlobalOrder(100, 3)  # the documented order: feistel-v1 of (seed, position)
    assert first.tolist() == order.ids(np.arange(10)).tolist()


def test_every_dataset_has_len_equal_to_num_samples(tmp_path: Path) -> None:
    write_token_shards(tmp_path / "tok", sizes=(1000, 2500, 40))
    tokens = detdata.TokenWindows(detdata.build_manifest(tmp_path / "tok"), seq_len=15)
    # windows of 16 tokens at a stride of 15 (the last token of one is the first of the next)
    assert len(tokens) == sum((n - 1) // 15 for n in (1000, 2500, 40))
    rng = np.random.default_rng(0)
    docs = random_documents(rng, 50, max_len=30, empty=False)
    (tmp_path / "meg").mkdir()
    write_megatron(tmp_path / "meg" / "P", docs)
    packed = detdata.PackedWindows(
        detdata.Documents(detdata.build_manifest(tmp_path / "meg"), index_dir=tmp_path / "idx"),
        seq_len=7,
        seed=0,
        eos=0,
    )
    assert len(packed) == packed.num_samples > 0
    arrays = detdata.ArrayDataset({"x": np.arange(37)})
    assert len(arrays) == 37
    split = detdata.Split(arrays, fraction=Fraction(1, 4), salt="s", key=detdata.SplitKey.ID)
    assert len(split.train) + len(split.validation) == 37
    assert len(split.train) == split.train.num_samples


def test_bare_registry_name_warns_naming_the_version_it_took(tmp_path: Path) -> None:
    write_token_shards(tmp_path / "a", sizes=(100,))
    write_token_shards(tmp_path / "b", sizes=(200,), seed=1)
    reg = detdata.Registry(tmp_path / "reg")
    reg.register("wiki-en@v1", detdata.build_manifest(tmp_path / "a"))
    v2 = detdata.build_manifest(tmp_path / "b")
    reg.register("wiki-en@v2", v2)
    with pytest.warns(BareNameWarning, match=r"wiki-en@v2 .*resolve\('wiki-en@v2'\)"):
        assert reg.resolve("wiki-en").id == v2.id
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert reg.resolve("wiki-en@v2").id == v2.id  # pinned: no warning
        assert reg.resolve("wiki-en", latest=True).id == v2.id  # floating on purpose


def test_unknown_registry_name_says_did_you_mean(tmp_path: Path) -> None:
    write_token_shards(tmp_path / "a", sizes=(100,))
    reg = detdata.Registry(tmp_path / "reg")
    reg.register("wiki-en@v1", detdata.build_manifest(tmp_path / "a"))
    with pytest.raises(detdata.RegistryError, match="did you mean wiki-en"):
        reg.resolve("wiki_en@v1")
    with pytest.raises(detdata.RegistryError, match="did you mean wiki-en"):
        reg.resolve("wikien", latest=True)


def test_exclusion_without_source_on_a_mixture_says_how_to_name_it() -> None:
    web = detdata.ArrayDataset({"x": np.arange(50)})
    code = detdata.ArrayDataset({"x": np.arange(20)})
    mix = detdata.Mixture({"web": web, "code": code}, {"web": "0.7", "code": "0.3"}, seed=1)
    with pytest.raises(detdata.ConfigError, match=r"ExclusionList.of\(\[\('code', 3\)\]\)"):
        detdata.Excluded(mix, [(0, detdata.ExclusionList.of([3]))])
    ok = detdata.Excluded(mix, [(0, detdata.ExclusionList.of([("web", 3)]))])
    assert ok.identity()["type"]


def test_packed_tokens_arrive_in_a_dtype_nn_embedding_takes_with_the_values_written(
    tmp_path: Path,
) -> None:
    import torch

    rng = np.random.default_rng(5)
    docs = random_documents(rng, 40, max_len=30, vocab=60_000, empty=False)
    (tmp_path / "meg").mkdir()
    write_megatron(tmp_path / "meg" / "P", docs, dtype="uint16")
    documents = detdata.Documents(detdata.build_manifest(tmp_path / "meg"))
    packed = detdata.PackedWindows(documents, seq_len=16, seed=0, shuffle=False)
    loader = detdata.DataLoader(packed, global_batch_size=4, micro_batch_size=4, seed=0)
    batch = next(iter(loader))
    tokens = batch["tokens"]
    assert tokens.dtype == torch.int32  # uint16 on disk, widened (as TokenWindows)
    # the values are the writer's: unshuffled windows of 17 tokens at a stride of 16 over the
    # concatenated documents (packing-v1 without eos/bos)
    flat = np.concatenate(docs)
    positions = detdata.GlobalOrder(packed.num_samples, 0).ids(np.arange(4))
    want = np.stack([flat[w * 16 : w * 16 + 17] for w in positions.tolist()])
    np.testing.assert_array_equal(tokens.numpy(), want)
    embedded = torch.nn.Embedding(60_000, 4)(tokens)  # torch.uint16 would be refused
    assert embedded.shape == (4, 17, 4)
