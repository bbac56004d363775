"""The text index of `TextDocuments`: where each document's text is and how many tokens it
has (docs/design.md, "Raw text").

One pass tokenises the whole corpus (`build_text_index`, in batches) into `ROWS` x
``N + 1`` int64, stored under ``index_dir`` (`detdata.datasets.index_files`):

====  ===============================================================================
row   meaning (document ``d``; the last column closes the table)
====  ===============================================================================
0     corpus token start (``starts``: document ``d`` is tokens ``[s[d], s[d + 1])``)
1     shard (manifest index)
2     line (JSONL, 1-based) or row (tables, 0-based) in the shard
3     JSONL: first byte of the line in the decompressed text; tables: row group
4     JSONL: end byte of the line; tables: row within the row group
====  ===============================================================================
"""

from __future__ import annotations

import itertools
import json
import mmap
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import asdict, dataclass
from typing import Any, Final

import numpy as np
import numpy.typing as npt

from detdata.base.errors import ConfigError, FormatError
from detdata.identity.formats import Format
from detdata.identity.manifest import Manifest
from detdata.identity.tokenizer import TextTokenizer

#: Rows of the text index (module docstring).
ROWS: Final = 5
STARTS, SHARD, LINE, FIRST, SECOND = range(ROWS)
#: The algorithm that cuts and counts text documents (part of the index key and identity).
ALGORITHM: Final = "text-documents-v1"
#: Documents tokenised per batch while the index is built.
BATCH: Final = 2048
EMPTY_POLICIES: Final = ("error", "skip")


@dataclass(frozen=True)
class TextPolicy:
    """How documents are cut from text: the field, the empty-document policy and the bound
    (`ConfigError` naming a bad one)."""

    field: str
    empty: str
    max_document_tokens: int | None

    def __post_init__(self) -> None:
        if not isinstance(self.field, str) or not self.field:
            raise ConfigError(f"field must be the name of the text field, got {self.field!r}")
        if self.empty not in EMPTY_POLICIES:
            raise ConfigError(f"empty must be one of {EMPTY_POLICIES}, got {self.empty!r}")
        bound = self.max_document_tokens
        if bound is not None and (
            isinstance(bound, bool) or not isinstance(bound, int) or bound < 1
        ):
            raise ConfigError(f"max_document_tokens must be a positive int or None, got {bound!r}")

    def identity(self) -> dict[str, Any]:
        """Plain JSON of the policy (part of the dataset's identity and the index key)."""
        return asdict(self)


def where_of(manifest: Manifest, shard: int, line: int) -> str:
    """``shard P line N`` (JSONL) or ``shard P row N`` (tables): how errors name a document."""
    entry = manifest.shards[shard]
    return f"shard {entry.path} {'line' if entry.format is Format.JSONL else 'row'} {line}"


def document_text(raw: bytes, field: str, where: str) -> str:
    """The text of one JSONL line ``raw`` (field ``field``); `FormatError` naming ``where``."""
    try:
        decoded = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise FormatError(
            f"{where}: invalid UTF-8 at byte {exc.start} of the line ({exc.reason}); hint: "
            "re-encode the file as UTF-8"
        ) from None
    try:
        doc = json.loads(decoded)
    except ValueError as exc:
        raise FormatError(
            f"{where}: not JSON ({exc}); hint: a JSONL shard holds one JSON object a line"
        ) from None
    if not isinstance(doc, dict):
        raise FormatError(
            f"{where}: a JSON {type(doc).__name__}, not an object with field {field!r}"
        )
    if field not in doc:
        keys = sorted(doc)[:8]
        raise FormatError(f"{where}: no field {field!r} (it has {keys}); hint: pass field=")
    text = checked_text(doc[field], field, where)
    if "\\u" in decoded:  # only a JSON escape can write a lone surrogate in UTF-8 input
        _check_surrogates(text, field, where)
    return text


def _check_surrogates(text: str, field: str, where: str) -> None:
    """`FormatError` when ``text`` holds a lone surrogate (``"\\ud800"`` in the JSON): it is no
    Unicode text, and the tokenizer cannot encode it."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise FormatError(
            f"{where} field {field!r}: a lone surrogate (U+{ord(text[exc.start]):04X}) at "
            f"character {exc.start}, not Unicode text; hint: fix the escape in the JSON (a "
            "surrogate pair encodes one character)"
        ) from None


def checked_text(value: object, field: str, where: str) -> str:
    """``value`` when it is a string; `FormatError` naming ``where`` and ``field`` otherwise."""
    if not isinstance(value, str):
        found = "null" if value is None else type(value).__name__
        raise FormatError(f"{where} field {field!r}: {found}, not a string of text")
    return value


def line_spans(data: bytes | mmap.mmap) -> tuple[npt.NDArray[np.int64], npt.NDArray[np.int64]]:
    """``(first, end)`` byte of each line of JSONL text ``data`` (cut at ``\\n``)."""
    breaks = np.flatnonzero(np.frombuffer(data, dtype=np.uint8) == 10).astype(np.int64)
    first = np.concatenate([[0], breaks + 1]).astype(np.int64)
    end = np.concatenate([breaks, [len(data)]]).astype(np.int64)
    if first[-1] == len(data):  # a final newline ends the last line; it starts none
        first, end = first[:-1], end[:-1]
    return first, end


def _counted(
    manifest: Manifest,
    tokenizer: TextTokenizer,
    policy: TextPolicy,
    shard: int,
    batch: list[tuple[int, int, int, str]],
) -> Iterator[tuple[int, int, int, int]]:
    """``(line or row, first, second, token count)`` of each document of ``batch`` that the
    index keeps, tokenised in one call; `FormatError` for a document the policy refuses."""
    encoded = tokenizer.encode([b[3] for b in batch])
    for (line, first, second, _), tokens in zip(batch, encoded, strict=True):
        where = f"{where_of(manifest, shard, line)} field {policy.field!r}"
        count = int(tokens.size)
        inner = tokenizer.inner_marker(tokens)
        if inner is not None:
            raise FormatError(
                f"{where}: the text encodes to token {inner[1]}, the {inner[0]} id, which would "
                f"cut the document there; hint: pass as {inner[0]} a token the text cannot "
                "produce (e.g. an added special token of the tokenizer.json)"
            )
        if not count:
            if policy.empty == "skip":
                continue
            raise FormatError(
                f"{where}: no tokens (the text encodes to none, e.g. whitespace under a "
                "stripping normaliser); hint: remove it, or pass empty='skip' (recorded in the "
                "identity)"
            )
        if policy.max_document_tokens is not None and count > policy.max_document_tokens:
            raise FormatError(
                f"{where}: {count} tokens, more than max_document_tokens="
                f"{policy.max_document_tokens}; hint: split the document, or raise or drop the "
                "bound (None: packing splits documents)"
            )
        yield line, first, second, count


def _non_empty(
    manifest: Manifest, policy: TextPolicy, shard: int, items: Iterable[tuple[int, int, int, str]]
) -> Iterator[tuple[int, int, int, str]]:
    """``items`` without empty texts (skipped, or a `FormatError` naming the first)."""
    for item in items:
        if item[3]:
            yield item
        elif policy.empty != "skip":
            raise FormatError(
                f"{where_of(manifest, shard, item[0])} field {policy.field!r}: an empty "
                "document; hint: remove it, or pass empty='skip' (recorded in the identity)"
            )


def index_meta(manifest: Manifest, array: npt.NDArray[np.int64]) -> dict[str, Any]:
    """The record stored with a text index: documents and tokens, and documents per shard."""
    per = np.bincount(array[SHARD, :-1], minlength=len(manifest.shards))
    return {
        "documents": int(array.shape[1]) - 1,
        "tokens": int(array[STARTS, -1]),
        "per_shard": per.tolist(),
    }


def check_text_index(
    manifest: Manifest, policy: TextPolicy, array: np.ndarray[Any, Any], meta: Mapping[str, Any]
) -> str | None:
    """What is wrong with a stored text index and its record (None: nothing), checked
    against the manifest (shape, order, every line or row in its shard) and `index_meta`."""
    if array.dtype != np.int64 or array.ndim != 2 or array.shape[0] != ROWS or array.shape[1] < 1:
        return f"array {array.dtype} of shape {array.shape}, expected int64 ({ROWS}, N + 1)"
    n = int(array.shape[1]) - 1
    starts, shard, line = array[STARTS], array[SHARD, :n], array[LINE, :n]
    if int(starts[0]) != 0 or bool((np.diff(starts) < 0).any()):
        return "token starts do not run non-decreasing from 0"
    if n and (int(shard[0]) < 0 or bool((np.diff(shard) < 0).any())):
        return "documents are not in shard order"
    lines = manifest.samples_per_shard()
    if n and int(shard[-1]) >= len(lines):
        return f"shard {int(shard[-1])} is not in the manifest"
    values, fmt = manifest.codes("format")
    jsonl = np.array([v == Format.JSONL.value for v in values], dtype=bool)
    rel = line - jsonl[fmt[shard]].astype(np.int64)  # JSONL lines count from 1, rows from 0
    if bool((rel < 0).any()) or bool((rel >= lines[shard]).any()):
        return "a line or row outside its shard"
    same = np.diff(shard) == 0
    if bool((np.diff(line)[same] <= 0).any()):
        return "lines or rows do not increase within a shard"
    if policy.empty == "error" and n != int(lines.sum()):
        return f"{n} documents, the manifest's shards have {int(lines.sum())} lines and rows"
    want = index_meta(manifest, array)
    for key in sorted(set(want) | set(meta)):
        if meta.get(key) != want.get(key):
            return f"meta.{key}: expected {want.get(key)!r}, found {meta.get(key)!r}"
    return None


def build_text_index(
    manifest: Manifest,
    tokenizer: TextTokenizer,
    policy: TextPolicy,
    shard_documents: Callable[[int], Iterable[tuple[int, int, int, str]]],
    update: Callable[[int], None],
) -> npt.NDArray[np.int64]:
    """The text index of ``manifest`` (`ROWS` x ``N + 1``): ``shard_documents(s)`` yields
    each shard's documents ``(line or row, first, second, text)`` in file order, tokenised
    `BATCH` at a time; ``update`` is told each shard's bytes."""
    columns: list[list[int]] = [[] for _ in range(ROWS)]
    tokens = 0
    sizes = manifest.bytes_per_shard()
    for shard in range(len(manifest.shards)):
        documents = _non_empty(manifest, policy, shard, shard_documents(shard))
        while batch := list(itertools.islice(documents, BATCH)):
            for line, first, second, count in _counted(manifest, tokenizer, policy, shard, batch):
                for row, value in zip(columns, (tokens, shard, line, first, second), strict=True):
                    row.append(value)
                tokens += count
        update(int(sizes[shard]))
    closing = (tokens, len(manifest.shards), 0, 0, 0)
    return np.array(
        [[*row, c] for row, c in zip(columns, closing, strict=True)], dtype=np.int64
    ).reshape(ROWS, -1)
