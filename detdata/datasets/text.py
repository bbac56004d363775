"""`TextDocuments`: raw text shards, tokenised when read (docs/design.md, "Raw text"): the
documents of ``jsonl`` shards (the text in field ``field`` of one JSON object a line) or of the
string column ``field`` of table shards (one row, one document). A read tokenises the
documents it touches in one batch, with a per-process cache, and checks each token count
against the text index (`detdata.datasets.text_index`; a `FormatError` names a difference).
"""

from __future__ import annotations

import dataclasses
import functools
import mmap
import os
import threading
from collections import OrderedDict
from typing import TYPE_CHECKING, Any, ClassVar, Final, Never

import numpy as np
import numpy.typing as npt

from detdata.base.checks import check_count
from detdata.base.errors import ConfigError, FormatError
from detdata.base.lazy import pa
from detdata.base.progress import progress
from detdata.base.types import IntArray
from detdata.datasets.documents import CorpusBase, Held, open_table
from detdata.datasets.process_local import PerProcess
from detdata.datasets.shard_storage import Storage, checked_storage
from detdata.datasets.text_index import (
    ALGORITHM,
    FIRST,
    LINE,
    SECOND,
    SHARD,
    STARTS,
    TextPolicy,
    build_text_index,
    check_text_index,
    checked_text,
    document_text,
    index_meta,
    line_spans,
    where_of,
)
from detdata.identity.entry import Verify
from detdata.identity.formats import TABLE_FORMATS, Format
from detdata.identity.manifest import Manifest
from detdata.identity.text_formats import PLAIN, read_text_bytes
from detdata.identity.tokenizer import TextTokenizer
from detdata.order.memo import LruCache

if TYPE_CHECKING:
    from collections.abc import Iterator

    from tokenizers import Tokenizer

#: The manifest metadata key that records the text field (`text_metadata`).
TEXT_FIELD: Final = "text_field"
#: Decoded table row groups kept per process.
_GROUPS: Final = 8
#: Arrow IPC stream shards whose record batches a process holds (`_read_group`).
_STREAMS: Final = 4
#: Tokens of recently tokenised documents kept per process.
_CACHED_TOKENS: Final = 1 << 22


def text_metadata(field: str) -> dict[str, str]:
    """Manifest metadata recording the text field: ``build_manifest(root, metadata=
    text_metadata("text"))``; a `TextDocuments` over it reads that field (and refuses
    another)."""
    return {TEXT_FIELD: field}


class _Local:
    """A `TextDocuments`' side of one process: decoded row groups and tokenised documents."""

    __slots__ = ("groups", "held", "lock", "streams", "tokens")

    def __init__(self) -> None:
        self.groups: LruCache[tuple[int, int], list[Any]] = LruCache(_GROUPS)
        #: the record batches of Arrow IPC stream shards (over their memory maps)
        self.streams: LruCache[int, list[Any]] = LruCache(_STREAMS)
        self.tokens: OrderedDict[int, npt.NDArray[np.int64]] = OrderedDict()
        self.held = 0
        self.lock = threading.Lock()


class TextDocuments(CorpusBase):
    """The documents of a manifest of text shards, tokenised when read (module docstring).

    ``tokenizer``: a `TextTokenizer`, a ``tokenizer.json`` path or a ``tokenizers.Tokenizer``
    (then with default options). ``field``: the text field / column (default: the one the
    manifest records, `text_metadata`, else ``"text"``). ``empty``: ``"error"`` (an empty
    text is a `FormatError` naming it) or ``"skip"`` (no document). ``max_document_tokens``:
    a longer document is a `FormatError` (None: no bound). ``index_dir``: where the text
    index is stored (None: built at each construction). ``storage``: as `Documents`', but
    ``verify="quick"`` (the default) is raised to ``"full"``; ``"off"`` stays off.
    """

    _TYPE: ClassVar[str] = "text_documents"
    _KIND: ClassVar[str] = "text"
    _DERIVED: ClassVar[tuple[str, ...]] = ("_starts",)

    def __init__(
        self,
        manifest: Manifest | str,
        tokenizer: TextTokenizer | str | os.PathLike[str] | Tokenizer,
        *,
        field: str | None = None,
        empty: str = "error",
        max_document_tokens: int | None = None,
        index_dir: str | os.PathLike[str] | None = None,
        progress: bool | None = None,
        storage: Storage | None = None,
        **refused: Never,
    ) -> None:
        storage = checked_storage("TextDocuments", storage, refused)
        if storage.verify is Verify.QUICK:  # raised to "full" (why: docs/design.md, "Raw text")
            storage = dataclasses.replace(storage, verify=Verify.FULL)
        self._open("TextDocuments", manifest, storage, index_dir, progress)
        self._local: PerProcess[_Local] = PerProcess()
        if not isinstance(tokenizer, TextTokenizer):
            tokenizer = TextTokenizer(tokenizer)
        self.tokenizer = tokenizer
        self.policy = TextPolicy(_field(self.manifest, field), empty, max_document_tokens)
        _check_formats(self.manifest)
        #: what a token id fits (`PackedWindows` checks bos / pad ids against it)
        self.stored_dtype = tokenizer.token_dtype
        self.out_dtype = np.dtype(np.int32 if tokenizer.vocab_size < 2**31 else np.int64)
        self._load(functools.partial(check_text_index, self.manifest, self.policy))

    def _inputs(self) -> dict[str, Any]:
        return {
            "algorithm": ALGORITHM,
            "manifest": self.manifest.id,
            "text": self.policy.identity(),
            "tokenizer": self.tokenizer.identity(),
        }

    def _build(self) -> tuple[npt.NDArray[np.int64], dict[str, Any]]:
        """The text index, tokenising every document, and its record (`index_meta`)."""
        total = int(self.manifest.bytes_per_shard().sum())
        with progress(total, "text index", unit="B", enabled=self.progress) as update:
            array = build_text_index(
                self.manifest, self.tokenizer, self.policy, self._shard_documents, update
            )
        return array, index_meta(self.manifest, array)

    def _derive(self) -> None:
        self._starts = self._index[STARTS]

    def _shard_documents(self, shard: int) -> Iterator[tuple[int, int, int, str]]:
        """Each document of ``shard`` as ``(line or row, first, second, text)`` (text_index)."""
        entry = self.manifest.shards[shard]
        field = self.policy.field
        if entry.format is Format.JSONL:
            data = self._jsonl(shard)
            first, end = line_spans(data)
            if first.size != entry.num_samples:
                raise FormatError(
                    f"shard {entry.path}: {first.size} lines, its manifest entry says "
                    f"{entry.num_samples}; hint: rebuild the manifest"
                )
            skip_blank = self.policy.empty == "skip"
            for i, (a, b) in enumerate(zip(first.tolist(), end.tolist(), strict=True)):
                raw = bytes(data[a:b])
                if skip_blank and not raw.strip():
                    yield i + 1, a, b, ""  # a blank line: an empty document, skipped
                    continue
                yield i + 1, a, b, document_text(raw, field, where_of(self.manifest, shard, i + 1))
            return
        row = 0
        for g in range(len(entry.row_groups or ())):
            for r, value in enumerate(self._group(shard, g)):
                yield row, g, r, checked_text(value, field, where_of(self.manifest, shard, row))
                row += 1

    def document_shards(self) -> npt.NDArray[np.int64]:
        """The manifest shard of each document (read-only)."""
        view: npt.NDArray[np.int64] = self._index[SHARD, :-1].view()
        view.flags.writeable = False
        return view

    def location(self, d: int) -> dict[str, Any]:
        """Where document ``d`` is: ``shard`` (manifest path) and ``line`` (JSONL, 1-based)
        or ``row`` (tables, 0-based)."""
        d = check_count(d, "document", minimum=0, maximum=self.num_documents - 1)
        entry = self.manifest.shards[int(self._index[SHARD, d])]
        key = "line" if entry.format is Format.JSONL else "row"
        return {"shard": entry.path, key: int(self._index[LINE, d])}

    def text(self, d: int) -> str:
        """The text of document ``d``, as read from its shard."""
        d = check_count(d, "document", minimum=0, maximum=self.num_documents - 1)
        return self._texts([d])[0]

    def tokens(self, docs: list[int]) -> list[npt.NDArray[np.int64]]:
        """The tokens of documents ``docs`` (int64, read-only), tokenised in one batch."""
        found = self._tokens(sorted(set(docs)))
        return [found[d] for d in docs]

    def copy_ranges(
        self, source: IntArray, count: IntArray, target: IntArray, out: np.ndarray[Any, Any]
    ) -> None:
        """`CorpusBase.copy_ranges`; the documents touched are tokenised in one batch."""
        if not count.size:
            return
        doc = np.searchsorted(self._starts, source, side="right").astype(np.int64) - 1
        tokens = self._tokens(np.unique(doc).tolist())
        local = source - self._starts[doc]
        for d, s, n, t in zip(
            doc.tolist(), local.tolist(), count.tolist(), target.tolist(), strict=True
        ):
            out[t : t + n] = tokens[d][s : s + n]

    def _tokens(self, docs: list[int]) -> dict[int, npt.NDArray[np.int64]]:
        """The tokens of ``docs`` (cached per process; the missing ones in one batch)."""
        local = self._local.get(_Local)
        found: dict[int, npt.NDArray[np.int64]] = {}
        with local.lock:
            for d in docs:
                hit = local.tokens.get(d)
                if hit is not None:
                    local.tokens.move_to_end(d)
                    found[d] = hit
        missing = [d for d in docs if d not in found]
        encoded = self.tokenizer.encode(self._texts(missing))
        for d, tokens in zip(missing, encoded, strict=True):
            want = int(self._starts[d + 1] - self._starts[d])
            if tokens.size != want:
                where = where_of(
                    self.manifest, int(self._index[SHARD, d]), int(self._index[LINE, d])
                )
                raise FormatError(
                    f"{where}: tokenised to {tokens.size} tokens, the text index says {want}; "
                    "the text or the tokenizer changed under the index; hint: rebuild the "
                    "manifest and the index"
                )
            tokens.flags.writeable = False
            found[d] = tokens
        with local.lock:
            for d in missing:
                local.tokens[d] = found[d]
                local.held += int(found[d].size)
            while local.held > _CACHED_TOKENS and len(local.tokens) > 1:
                local.held -= int(local.tokens.popitem(last=False)[1].size)
        return found

    def _texts(self, docs: list[int]) -> list[str]:
        """The texts of ``docs``, read from their shards (checked as when indexed)."""
        out: list[str] = []
        field = self.policy.field
        for d in docs:
            shard, line = int(self._index[SHARD, d]), int(self._index[LINE, d])
            a, b = int(self._index[FIRST, d]), int(self._index[SECOND, d])
            where = where_of(self.manifest, shard, line)
            if self.manifest.shards[shard].format is Format.JSONL:
                out.append(document_text(bytes(self._jsonl(shard)[a:b]), field, where))
            else:
                out.append(checked_text(self._group(shard, a)[b], field, where))
        return out

    def _jsonl(self, shard: int) -> mmap.mmap | bytes:
        """The text bytes of JSONL ``shard`` (a memory map, or the decompressed bytes; held open
        per process, checked on open)."""
        files = self.files
        held: Held[mmap.mmap | bytes] | None = files.local().handles.get(shard)
        if held is not None:
            files.check_file(shard, held.path)
            return held.data
        entry = self.manifest.shards[shard]
        path = self._path(shard)
        data: mmap.mmap | bytes
        with open(path, "rb") as fh:
            files.check_opened(shard, fh.fileno(), path)
            if entry.schema == PLAIN:
                data = mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ) if entry.bytes else b""
            else:
                data = read_text_bytes(path, str(entry.schema), rel=entry.path)
        files.keep(shard, Held(data, path))
        return data

    def _group(self, shard: int, group: int) -> list[Any]:
        """The values of the text column in row group / record batch ``group`` of ``shard``."""
        return self._local.get(_Local).groups.get((shard, group), self._read_group)

    def _read_group(self, key: tuple[int, int]) -> list[Any]:
        shard, group = key
        entry = self.manifest.shards[shard]
        path = self._path(shard)
        with open(path, "rb") as fh:
            self.files.check_opened(shard, fh.fileno(), path)
        field = self.policy.field
        reader = open_table(entry.format, path)
        schema = reader.schema_arrow if entry.format is Format.PARQUET else reader.schema
        if field not in schema.names:
            raise FormatError(f"shard {entry.path}: no column {field!r}; it has {schema.names}")
        kind = schema.field(field).type
        if not (pa.types.is_string(kind) or pa.types.is_large_string(kind)):
            raise FormatError(
                f"shard {entry.path} column {field!r}: type {kind}, not a string column of text"
            )
        if entry.format is Format.PARQUET:
            column = reader.read_row_group(group, columns=[field]).column(field)
        elif entry.format is Format.ARROW_STREAM:  # no footer: batch g is read after all before
            batches = self._local.get(_Local).streams.get(shard, lambda _: list(reader))
            column = batches[group].column(field)
        else:
            column = reader.get_batch(group).column(field)
        values: list[Any] = column.to_pylist()
        return values


def _field(manifest: Manifest, field: str | None) -> str:
    """The text field: ``field``, else the manifest's recorded one, else ``"text"``; a
    ``field`` that contradicts the manifest's record is a `ConfigError`."""
    recorded = manifest.metadata.get(TEXT_FIELD)
    if field is not None and recorded is not None and field != recorded:
        raise ConfigError(
            f"field={field!r} but manifest {manifest.id} records text field {recorded!r}; "
            "hint: leave field= out, or build another manifest"
        )
    chosen = field if field is not None else recorded if recorded is not None else "text"
    return str(chosen)


def _check_formats(manifest: Manifest) -> None:
    """Every shard is a text shard (``jsonl``) or a table; `ConfigError` naming the first
    that is not."""
    for entry in manifest.shards:
        if entry.format is not Format.JSONL and entry.format not in TABLE_FORMATS:
            raise ConfigError(
                f"shard {entry.path}: a {entry.format.value} token shard, not text; hint: read "
                "token shards with Documents (TextDocuments reads jsonl / parquet / arrow text)"
            )
