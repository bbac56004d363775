"""`TextTokenizer`: a Hugging Face ``tokenizers`` tokenizer pinned by its content.

A document's tokens are ``[bos] + encode(text).ids + [eos]`` from a ``tokenizer.json``
(nothing is downloaded). Its identity (docs/design.md "Raw text": in the loader state's
checked ``data`` field) is plain JSON of ``whole_b3``, one digest per section
(`SECTIONS`; the whole sorts after them, so a refused resume names the section) and every
option that changes a token.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any, Final

import numpy as np

from detdata.base.canonical import canonical_json
from detdata.base.errors import ConfigError
from detdata.base.hashing import digest_bytes
from detdata.base.lazy import require

if TYPE_CHECKING:
    from tokenizers import Tokenizer

#: The sections of a tokenizer.json each pinned by its own digest in the identity.
SECTIONS: Final = ("model", "normalizer", "pre_tokenizer", "post_processor", "added_tokens")
#: The ``pip install`` that provides the library (the ``detdata[text]`` extra).
INSTALL: Final = "detdata[text] (tokenizers)"


def _library() -> Any:
    return require("tokenizers", install=INSTALL, purpose="to tokenise text")


class TextTokenizer:
    """A ``tokenizers`` tokenizer and the options a document is encoded with (module doc).

    ``source``: a ``tokenizer.json`` path, or a ``tokenizers.Tokenizer`` (its JSON taken
    now). ``bos`` / ``eos``: a token id or token string put before / after each document.
    ``add_special_tokens``: apply the post-processor's templates. Pickles as its JSON.
    """

    def __init__(
        self,
        source: str | os.PathLike[str] | Tokenizer,
        *,
        bos: int | str | None = None,
        eos: int | str | None = None,
        add_special_tokens: bool = False,
    ) -> None:
        self.json = _tokenizer_json(source)
        try:
            self.document = json.loads(self.json)
        except ValueError as exc:
            raise ConfigError(f"tokenizer: not a tokenizer.json ({exc})") from None
        self._tokenizer: Tokenizer | None = None
        if isinstance(self.document, Mapping) and self.document.get("padding") is not None:
            raise ConfigError(
                f"tokenizer: padding is enabled ({self.document['padding']!r}); a document's "
                "tokens would depend on the batch it is encoded in; hint: call "
                'tokenizer.no_padding() (or set "padding": null in the tokenizer.json): '
                "packing needs no padding"
            )
        if not isinstance(add_special_tokens, bool):
            raise ConfigError(
                f"add_special_tokens must be True or False, got {add_special_tokens!r}"
            )
        self.add_special_tokens = add_special_tokens
        self.vocab_size = int(self.tokenizer.get_vocab_size(with_added_tokens=True))
        self.bos = self._token_id(bos, "bos")
        self.eos = self._token_id(eos, "eos")

    @property
    def tokenizer(self) -> Tokenizer:
        """The ``tokenizers.Tokenizer`` (made from the JSON once per process)."""
        if self._tokenizer is None:
            made = _library().Tokenizer.from_str(self.json)
            made.encode_special_tokens = True  # special tokens in the text are plain text
            self._tokenizer = made
        return self._tokenizer

    def _token_id(self, value: int | str | None, name: str) -> int | None:
        if value is None:
            return None
        if isinstance(value, str):
            found = self.tokenizer.token_to_id(value)
            if found is None:
                raise ConfigError(
                    f"{name}={value!r}: no such token in the tokenizer's vocabulary; hint: pass "
                    "the token id, or a token the tokenizer.json defines (e.g. its added tokens)"
                )
            return int(found)
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise ConfigError(f"{name} must be a token id (int >= 0) or a token, got {value!r}")
        if value >= self.vocab_size:
            raise ConfigError(
                f"{name}={value} is not below the tokenizer's vocabulary size {self.vocab_size}"
            )
        return value

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        state["_tokenizer"] = None  # made again from the JSON in each process
        return state

    @property
    def token_dtype(self) -> np.dtype[Any]:
        """The narrowest unsigned dtype every token id of this tokenizer fits."""
        return np.dtype(np.uint16 if self.vocab_size <= 1 << 16 else np.uint32)

    def identity(self) -> dict[str, Any]:
        """Plain JSON pinning the tokenizer and every option that changes a token (module doc)."""
        sections = {
            f"{section}_b3": digest_bytes(canonical_json(self.document.get(section)))
            for section in SECTIONS
        }
        return {
            "type": "hf_tokenizers",
            "library": "tokenizers",
            "version": str(_library().__version__),
            "whole_b3": digest_bytes(canonical_json(self.document)),
            **sections,
            "truncation": self.document.get("truncation"),
            "padding": self.document.get("padding"),
            "add_special_tokens": self.add_special_tokens,
            "bos": self.bos,
            "eos": self.eos,
            "encode_special_tokens": True,
        }

    def encode(self, texts: Sequence[str]) -> list[np.ndarray[Any, Any]]:
        """The tokens of each text (``bos``, the text's ids, ``eos``), as int64 arrays."""
        if not texts:
            return []
        found = self.tokenizer.encode_batch_fast(
            list(texts), add_special_tokens=self.add_special_tokens
        )
        head = [] if self.bos is None else [self.bos]
        tail = [] if self.eos is None else [self.eos]
        return [np.array(head + e.ids + tail, dtype=np.int64) for e in found]

    def inner_marker(self, tokens: np.ndarray[Any, Any]) -> tuple[str, int] | None:
        """``("bos" | "eos", id)`` when that id is among the text tokens of ``tokens`` (an
        `encode` output), None otherwise or with ``add_special_tokens``."""
        if self.add_special_tokens:
            return None
        body = tokens[(self.bos is not None) : tokens.size - (self.eos is not None)]
        for name, marker in (("bos", self.bos), ("eos", self.eos)):
            if marker is not None and bool((body == marker).any()):
                return name, marker
        return None


def _tokenizer_json(source: object) -> str:
    """The JSON text of a tokenizer given as a path or a ``tokenizers.Tokenizer``."""
    if isinstance(source, (str, os.PathLike)):
        path = os.fspath(source)
        try:
            with open(path, encoding="utf-8") as fh:
                return fh.read()
        except OSError as exc:
            raise ConfigError(
                f"tokenizer {path}: cannot read it ({exc.strerror or exc}); hint: pass the "
                "path of a tokenizer.json (nothing is downloaded)"
            ) from None
    if isinstance(source, _library().Tokenizer):
        return str(source.to_str())
    raise ConfigError(
        f"tokenizer must be a tokenizer.json path or a tokenizers.Tokenizer, got "
        f"{type(source).__name__}"
    )


#: The manifest metadata key holding the identity of the tokenizer that wrote token shards.
MANIFEST_KEY: Final = "tokenizer"


def check_manifest_tokenizer(metadata: Mapping[str, Any], tokenizer: TextTokenizer) -> None:
    """`ConfigError` naming the first differing field unless ``tokenizer`` is the one the
    manifest metadata records (`MANIFEST_KEY`, written by ``detdata tokenize``)."""
    recorded = metadata.get(MANIFEST_KEY)
    if not isinstance(recorded, Mapping):
        raise ConfigError(
            "the manifest records no tokenizer (metadata 'tokenizer'); hint: token shards "
            "written by `detdata tokenize` record it"
        )
    want = tokenizer.identity()
    for key in sorted(set(recorded) | set(want)):
        if recorded.get(key) != want.get(key):
            raise ConfigError(
                f"the token shards were written by another tokenizer: metadata tokenizer.{key} "
                f"is {recorded.get(key)!r}, this tokenizer's is {want.get(key)!r}; hint: use "
                "the tokenizer.json and options the shards were tokenised with"
            )
