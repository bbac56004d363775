"""``detdata tokenize`` (issue 45): text shards -> Megatron .bin/.idx or .npy token shards.

References are independent of the command: the windows of the written token shards (read by
`Documents`, the token path) equal the windows of the same text tokenised at read time, and
the written tokens equal the test's own encoding of every document.

Covers: detdata/cli/tokenize.py.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np
import pytest

import detdata
from detdata.base.errors import ConfigError, StateError
from detdata.datasets.documents import Documents
from detdata.datasets.packed import PackedWindows
from detdata.datasets.text import TextDocuments
from detdata.identity.tokenizer import TextTokenizer, check_manifest_tokenizer
from tests.cli.test_cli_env import _run
from tests.datasets.text_corpora import encode, make_documents, train_bpe, write_corpus
from tests.resume_checker import take


@pytest.fixture(scope="module")
def text(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path, list[str]]:
    root = tmp_path_factory.mktemp("tokenize")
    texts = make_documents(90, seed=21)
    tokenizer = train_bpe(root / "tokenizer.json", texts, vocab_size=300)
    write_corpus(root / "data", texts)
    return root / "data", tokenizer, texts


def _tokenize(data: Path, tokenizer: Path, out: Path, *extra: str) -> dict[str, object]:
    run = _run(
        "tokenize", "--root", str(data), "--tokenizer", str(tokenizer), "--out", str(out), *extra
    )
    assert run.returncode == 0, run.stderr
    summary: dict[str, object] = json.loads(run.stdout)
    return summary


@pytest.mark.parametrize("fmt", ["bin", "npy"])
def test_token_shards_equal_the_text_read_in_place(
    text: tuple[Path, Path, list[str]], tmp_path: Path, fmt: str
) -> None:
    data, tokenizer, texts = text
    summary = _tokenize(data, tokenizer, tmp_path / "out", "--eos", "<eod>", "--format", fmt)
    manifest = detdata.Manifest.load(str(tmp_path / "out" / "manifest.json"))
    assert summary["manifest"] == manifest.id
    tok = TextTokenizer(tokenizer, eos="<eod>")
    check_manifest_tokenizer(manifest.metadata, tok)  # the same identity: accepted
    eod = None if fmt == "bin" else tok.eos
    tokens = Documents(manifest, eod_token=eod)
    mine = encode(tokenizer, texts, bos=None, eos=tok.eos)
    assert [tokens.document(d).tolist() for d in range(tokens.num_documents)] == mine
    in_place = TextDocuments(detdata.build_manifest(str(data)), tok)
    a, b = PackedWindows(tokens, 23, seed=4), PackedWindows(in_place, 23, seed=4)
    ids = np.arange(a.num_samples)
    assert np.array_equal(a.read(ids)["tokens"], b.read(ids)["tokens"])


def test_a_resume_over_token_shards_checks_the_tokenizer(
    text: tuple[Path, Path, list[str]], tmp_path: Path
) -> None:
    data, tokenizer, _ = text
    _tokenize(data, tokenizer, tmp_path / "a", "--eos", "<eod>")
    _tokenize(data, tokenizer, tmp_path / "b")  # another option: no EOS
    first = detdata.Manifest.load(str(tmp_path / "a" / "manifest.json"))
    second = detdata.Manifest.load(str(tmp_path / "b" / "manifest.json"))
    dl = detdata.DataLoader(PackedWindows(Documents(first), 16), global_batch_size=4)
    list(take(dl, 2))
    state = dl.state_dict()
    other = detdata.DataLoader(PackedWindows(Documents(second), 16), global_batch_size=4)
    with pytest.raises(StateError, match="manifests"):
        other.load_state_dict(state)
    with pytest.raises(ConfigError, match=re.escape("metadata tokenizer.eos is None")):
        check_manifest_tokenizer(second.metadata, TextTokenizer(tokenizer, eos="<eod>"))


def test_npy_without_eos_and_bad_text_are_refused(
    text: tuple[Path, Path, list[str]], tmp_path: Path
) -> None:
    data, tokenizer, _ = text
    run = _run("tokenize", "--root", str(data), "--tokenizer", str(tokenizer), "--out",
               str(tmp_path / "o"), "--format", "npy")  # fmt: skip
    assert run.returncode == 2 and "--eos" in run.stderr
    (tmp_path / "bad").mkdir()
    (tmp_path / "bad" / "x.jsonl").write_bytes(b'{"text": "a"}\n{"txt": "b"}\n')
    run = _run("tokenize", "--root", str(tmp_path / "bad"), "--tokenizer", str(tokenizer),
               "--out", str(tmp_path / "o2"))  # fmt: skip
    assert run.returncode == 2 and "shard x.jsonl line 2: no field 'text'" in run.stderr
    assert not (tmp_path / "o2").exists()


def test_a_lone_surrogate_is_a_format_error_naming_the_line(
    text: tuple[Path, Path, list[str]], tmp_path: Path
) -> None:
    (tmp_path / "bad").mkdir()
    (tmp_path / "bad" / "x.jsonl").write_bytes(b'{"text": "a"}\n{"text": "bad \\ud800 x"}\n')
    run = _run("tokenize", "--root", str(tmp_path / "bad"), "--tokenizer", str(text[1]),
               "--out", str(tmp_path / "o"))  # fmt: skip
    assert run.returncode == 2, run.stderr
    assert "shard x.jsonl line 2 field 'text': a lone surrogate" in run.stderr, run.stderr
    assert "Traceback" not in run.stderr and not (tmp_path / "o").exists()


def test_manifest_build_takes_format_jsonl(
    text: tuple[Path, Path, list[str]], tmp_path: Path
) -> None:
    data, _, texts = text
    out = tmp_path / "m.json"
    run = _run("manifest", "build", str(data), "--pattern", "*.jsonl*", "--format", "jsonl",
               "-o", str(out))  # fmt: skip
    assert run.returncode == 0, run.stderr
    shards = json.loads(out.read_text(encoding="utf-8"))["shards"]
    assert [s["format"] for s in shards] == ["jsonl"] * 3
    written = np.array_split(np.arange(len(texts)), 5)[:3]  # write_corpus: a, b, c are JSONL
    assert [s["num_samples"] for s in shards] == [len(part) for part in written]
