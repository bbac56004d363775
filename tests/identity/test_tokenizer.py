"""`TextTokenizer` (issue 45): every option that changes a token changes the identity, by name.

The tokenizer is trained here on generated text (nothing downloaded); the reference for each
encoding is ``tokenizers`` itself, called by the test.
"""

from __future__ import annotations

import json
import pickle
from pathlib import Path

import pytest
from tokenizers import Tokenizer

from detdata.base.errors import ConfigError
from detdata.identity.tokenizer import TextTokenizer
from tests.datasets.text_corpora import make_documents, train_bpe


@pytest.fixture(scope="module")
def trained(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("tok")
    return train_bpe(root / "tokenizer.json", make_documents(200, seed=5), vocab_size=350)


def _changed(path: Path, out: Path, edit: str) -> Path:
    doc = json.loads(path.read_text(encoding="utf-8"))
    if edit == "truncation":
        doc["truncation"] = {
            "direction": "Right", "max_length": 4, "strategy": "LongestFirst", "stride": 0
        }  # fmt: skip
    elif edit == "normalizer":
        doc["normalizer"] = {"type": "Lowercase"}
    out.write_text(json.dumps(doc), encoding="utf-8")
    return out


def test_each_output_changing_option_is_its_own_identity_field(
    trained: Path, tmp_path: Path
) -> None:
    base = TextTokenizer(trained, eos="<eod>").identity()
    cases = {
        "truncation": TextTokenizer(_changed(trained, tmp_path / "t.json", "truncation"), eos=0),
        "normalizer_b3": TextTokenizer(_changed(trained, tmp_path / "n.json", "normalizer"), eos=0),
        "bos": TextTokenizer(trained, bos="<bos>", eos="<eod>"),
        "add_special_tokens": TextTokenizer(trained, eos="<eod>", add_special_tokens=True),
    }
    for field, tok in cases.items():
        other = tok.identity()
        assert other[field] != base[field], field
    assert base["version"] and base["library"] == "tokenizers"
    same = TextTokenizer(Tokenizer.from_file(str(trained)), eos="<eod>")  # an object: its JSON
    assert same.identity() == base


def test_encoding_is_the_librarys_with_bos_and_eos(trained: Path) -> None:
    tok = TextTokenizer(trained, bos="<bos>", eos="<eod>")
    lib = Tokenizer.from_file(str(trained))
    texts = make_documents(20, seed=8)
    want = [[1, *lib.encode(t, add_special_tokens=False).ids, 0] for t in texts]
    assert [t.tolist() for t in tok.encode(texts)] == want
    again = pickle.loads(pickle.dumps(tok))  # travels as its JSON to worker processes
    assert [t.tolist() for t in again.encode(texts)] == want


def test_bad_tokenizer_arguments_name_what_is_wrong(trained: Path, tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="no such token"):
        TextTokenizer(trained, eos="<nope>")
    with pytest.raises(ConfigError, match="not below the tokenizer's vocabulary size"):
        TextTokenizer(trained, eos=10**6)
    with pytest.raises(ConfigError, match="cannot read it"):
        TextTokenizer(tmp_path / "missing.json")
    with pytest.raises(ConfigError, match=r"a tokenizer\.json path or a tokenizers\.Tokenizer"):
        TextTokenizer(42)  # type: ignore[arg-type]


def test_a_tokenizer_with_padding_is_refused_naming_padding(trained: Path) -> None:
    padded = Tokenizer.from_file(str(trained))
    padded.enable_padding(pad_id=0, pad_token="<eod>")  # batch-longest: counts vary by batch
    lengths = [len(e.ids) for e in padded.encode_batch(["alpha", "alpha beta gamma delta"])]
    assert lengths[0] == lengths[1]  # the hazard: a document's tokens depend on its batch
    with pytest.raises(ConfigError, match="padding") as err:
        TextTokenizer(padded, eos="<eod>")
    assert "no_padding" in str(err.value)
    padded.no_padding()
    assert TextTokenizer(padded, eos="<eod>").identity()["padding"] is None
