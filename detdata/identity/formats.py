"""Shard formats: detection, sample counts and schema fingerprints.

A manifest-level sample is one token (``npy`` / ``bin`` token files), one row
(``parquet``, ``arrow`` IPC files, ``arrow_stream`` IPC streams such as Hugging Face
``datasets`` cache files; ``row_groups`` holds the rows of each row group / batch),
one line (``jsonl``, ``schema`` its compression: `detdata.identity.text_formats`) or
one document (``megatron_idx``).

A Megatron ``.bin`` + ``.idx`` pair is two linked manifest entries: ``P.bin`` a
``bin`` token shard (its ``dtype`` read from ``P.idx`` when not declared) and
``P.idx`` a ``megatron_idx`` shard (``num_samples``: its documents; ``data_offset``:
where its arrays start), each verified as any shard; `detdata.datasets.documents`
pairs them. The ``.idx`` layout (Megatron-LM's ``indexed_dataset.py``), little-endian:
magic ``b"MMIDIDX\\x00\\x00"``, ``u64`` version (1), ``u8`` dtype code
(`MEGATRON_DTYPES`), ``u64`` sequence count ``S``, ``u64`` document-index count
``D``, ``int32 sizes[S]``, ``int64 pointers[S]``, ``int64 document_index[D]``
(``D - 1`` documents). Multimodal indexes are refused.
"""

from __future__ import annotations

import contextlib
import enum
import io
import json
import struct
import sys
import threading
from dataclasses import dataclass
from typing import Any, Final

import fsspec
import numpy as np

from detdata.base.errors import ConfigError, FormatError
from detdata.base.hashing import digest_bytes
from detdata.base.lazy import ipc, pa, pq
from detdata.identity.text_formats import MAGICS, PLAIN, inspect_jsonl
from detdata.storage.fs import is_local_fs


class Format(str, enum.Enum):
    """Shard formats detdata understands."""

    NPY = "npy"
    BIN = "bin"
    PARQUET = "parquet"
    ARROW = "arrow"
    ARROW_STREAM = "arrow_stream"
    MEGATRON_IDX = "megatron_idx"
    JSONL = "jsonl"


TOKEN_DTYPES: Final = ("uint16", "uint32", "int32", "int64")
#: The ``schema`` of a ``jsonl`` shard: how its bytes are compressed (from its first bytes).
JSONL_LAYOUTS: Final = (PLAIN, *MAGICS.values())
TABLE_FORMATS: Final = (Format.PARQUET, Format.ARROW, Format.ARROW_STREAM)
_SUFFIXES: Final = {
    **dict.fromkeys((".jsonl", ".jsonl.gz", ".jsonl.zst", ".jsonl.bz2", ".jsonl.xz"), Format.JSONL),
    ".npy": Format.NPY,
    ".bin": Format.BIN,
    ".parquet": Format.PARQUET,
    ".arrow": Format.ARROW,
    ".feather": Format.ARROW,
    ".ipc": Format.ARROW,
    ".idx": Format.MEGATRON_IDX,
}
#: The magic bytes a Megatron ``.idx`` file starts with.
MEGATRON_MAGIC: Final = b"MMIDIDX\x00\x00"
#: Bytes of the ``.idx`` header: magic (9), version (8), dtype code (1), two counts (8 + 8).
MEGATRON_HEADER_BYTES: Final = 34
#: Megatron's dtype codes (``DType`` in indexed_dataset.py) -> numpy names.
MEGATRON_DTYPES: Final = {
    1: "uint8",
    2: "int8",
    3: "int16",
    4: "int32",
    5: "int64",
    6: "float64",
    7: "float32",
    8: "uint16",
}


@dataclass(frozen=True, kw_only=True)
class MegatronHeader:
    """The fixed header of a Megatron ``.idx`` file (module docstring)."""

    dtype: str
    sequences: int
    document_index: int

    @property
    def nbytes(self) -> int:
        """The size of a (text, not multimodal) ``.idx`` with this header."""
        return MEGATRON_HEADER_BYTES + 12 * self.sequences + 8 * self.document_index


def parse_megatron_header(head: bytes, *, rel: str) -> MegatronHeader:
    """`MegatronHeader` from the first 34 bytes of an ``.idx``; `FormatError` naming ``rel``."""
    if len(head) < MEGATRON_HEADER_BYTES or head[:9] != MEGATRON_MAGIC:
        raise FormatError(
            f"shard {rel}: not a Megatron index (it does not start with the magic "
            f"{MEGATRON_MAGIC!r}); hint: .idx files are read as Megatron indexed-dataset "
            "indexes; pass format= for other files"
        )
    version, code, sequences, document_index = struct.unpack("<QBQQ", head[9:34])
    if version != 1:
        raise FormatError(f"shard {rel}: Megatron index version {version}; detdata reads version 1")
    name = MEGATRON_DTYPES.get(code)
    if name is None or name not in TOKEN_DTYPES:
        raise FormatError(
            f"shard {rel}: Megatron dtype code {code} ({name or 'unknown'}) is not a token "
            f"dtype; detdata reads {TOKEN_DTYPES} (codes 8, 4, 5); hint: re-export the "
            "corpus with uint16 or int32 tokens"
        )
    return MegatronHeader(dtype=name, sequences=sequences, document_index=document_index)


def _inspect_megatron(fs: fsspec.AbstractFileSystem, path: str, size: int, rel: str) -> ShardLayout:
    with fs.open(path, "rb") as fh:
        header = parse_megatron_header(fh.read(MEGATRON_HEADER_BYTES), rel=rel)
    if size != header.nbytes:
        multimodal = size == header.nbytes + header.sequences
        raise FormatError(
            f"shard {rel}: Megatron index of {header.sequences} sequences and "
            f"{header.document_index} document-index entries should have {header.nbytes} "
            f"bytes, the file has {size}"
            + (
                " (a multimodal index, one mode byte per sequence: not supported)"
                if multimodal
                else "; hint: the index is truncated or not a Megatron index"
            )
        )
    documents = max(0, header.document_index - 1)  # the document index starts with a 0
    return ShardLayout(num_samples=documents, dtype=header.dtype, data_offset=MEGATRON_HEADER_BYTES)


def megatron_index_path(bin_path: str) -> str:
    """The ``.idx`` path paired with a ``.bin`` path (``P.bin`` -> ``P.idx``)."""
    return bin_path[: -len(".bin")] + ".idx" if bin_path.endswith(".bin") else bin_path + ".idx"


def _bin_dtype(fs: fsspec.AbstractFileSystem, path: str, dtype: str | None, rel: str) -> str | None:
    """The dtype of a ``bin`` shard: declared, or read from its Megatron ``.idx`` sibling
    (a `FormatError` where they contradict)."""
    if not path.endswith(".bin"):
        return dtype
    idx = megatron_index_path(path)
    try:
        if not fs.exists(idx):
            return dtype
        with fs.open(idx, "rb") as fh:
            head = fh.read(MEGATRON_HEADER_BYTES)
    except OSError:
        return dtype
    if head[:9] != MEGATRON_MAGIC:
        return dtype
    found = parse_megatron_header(head, rel=megatron_index_path(rel)).dtype
    if dtype is not None and check_token_dtype(dtype, where=rel) != found:
        raise FormatError(
            f"shard {rel}: declared dtype {dtype!r} but its Megatron index "
            f"{megatron_index_path(rel)} says {found!r}; hint: leave dtype= out for "
            "Megatron .bin/.idx pairs (it is read from the .idx)"
        )
    return found


@dataclass(frozen=True, kw_only=True)
class ShardLayout:
    """What a format inspection finds in a shard (everything except its digests)."""

    num_samples: int
    dtype: str | None = None
    data_offset: int | None = None
    schema: str | None = None
    row_groups: tuple[int, ...] | None = None


def parse_format(value: str | Format) -> Format:
    """``Format`` from a name, with a clear error for unknown names."""
    try:
        return Format(value)
    except ValueError:
        names = ", ".join(f.value for f in Format)
        raise ConfigError(f"unknown shard format {value!r}; expected one of: {names}") from None


def suffix_format(path: str) -> Format | None:
    """The format a file suffix names, or None when the suffix is not a known one."""
    return next((fmt for suffix, fmt in _SUFFIXES.items() if path.endswith(suffix)), None)


def detect_format(path: str) -> Format:
    """Format from a file suffix; raises `FormatError` naming the file when unknown."""
    fmt = suffix_format(path)
    if fmt is not None:
        return fmt
    raise FormatError(
        f"{path}: cannot tell the format from the suffix; pass format= "
        f"(one of {', '.join(f.value for f in Format)})"
    )


#: The first bytes of an Arrow IPC *stream* message (the continuation marker).
_ARROW_STREAM_MARK: Final = b"\xff\xff\xff\xff"


def sniff_format(fs: fsspec.AbstractFileSystem, path: str, fmt: Format) -> Format:
    """``fmt`` detected from a suffix, refined by the file's first bytes: a ``.arrow``
    file that starts with the IPC stream's continuation marker is ``arrow_stream``."""
    if fmt is not Format.ARROW:
        return fmt
    with fs.open(path, "rb") as fh:
        head = fh.read(len(_ARROW_MAGIC))
    if head[:4] == _ARROW_STREAM_MARK and head != _ARROW_MAGIC:
        return Format.ARROW_STREAM
    return fmt


def check_token_dtype(dtype: str | None, *, where: str) -> str:
    """Canonical numpy dtype name for token shards (a plain name meaning little-endian:
    a big-endian declaration is refused, never recorded and read swapped)."""
    if dtype is None:
        raise ConfigError(f"{where}: raw .bin shards need a declared dtype, e.g. dtype='uint16'")
    try:
        parsed = np.dtype(dtype)
    except TypeError:
        raise ConfigError(
            f"{where}: unknown dtype {dtype!r}; expected one of {TOKEN_DTYPES}"
        ) from None
    name = parsed.name
    if name not in TOKEN_DTYPES:
        raise ConfigError(
            f"{where}: dtype {name} is not a token dtype; expected one of {TOKEN_DTYPES}"
        )
    # a byte-order mark declared (a plain name, no mark, means little-endian)
    mark = dtype.strip()[:1] if isinstance(dtype, str) else parsed.str[0]
    if mark in (">", "!") or (mark == "=" and sys.byteorder == "big"):
        raise ConfigError(
            f"{where}: dtype {dtype!r} is big-endian; detdata token shards are "
            f"little-endian (a manifest records only {name!r}, which would read "
            "these bytes swapped); hint: convert the file, e.g. "
            f"np.fromfile(path, {parsed.str!r}).astype({parsed.newbyteorder('<').str!r})"
            ".tofile(new_path), or declare the little-endian dtype if the bytes "
            "are little-endian"
        )
    return name


def disk_dtype(name: str) -> np.dtype[Any]:
    """The numpy dtype of token bytes on disk for manifest dtype ``name``: little-endian."""
    return np.dtype(name).newbyteorder("<")


def schema_fingerprint(schema: pa.Schema) -> str:
    """``b3:`` digest of the schema's field names, types and nullability (metadata ignored)."""
    fields = [[f.name, str(f.type), f.nullable] for f in schema]
    return digest_bytes(json.dumps(fields, separators=(",", ":")).encode())


def inspect_shard(
    fs: fsspec.AbstractFileSystem,
    path: str,
    size: int,
    fmt: Format,
    dtype: str | None = None,
    *,
    rel: str,
) -> ShardLayout:
    """Read a shard's header/footer and return its layout; errors name ``rel``."""
    if fmt is Format.NPY:
        return _inspect_npy(fs, path, size, rel)
    if fmt is Format.MEGATRON_IDX:
        return _inspect_megatron(fs, path, size, rel)
    if fmt is Format.JSONL:  # text: one document a line (detdata.identity.text_formats)
        lines, schema = inspect_jsonl(fs, path, rel=rel)
        return ShardLayout(num_samples=lines, schema=schema)
    if fmt is Format.BIN:
        name = check_token_dtype(_bin_dtype(fs, path, dtype, rel), where=rel)
        _refuse_container(fs, path, size, rel)
        itemsize = np.dtype(name).itemsize
        if size % itemsize:
            raise FormatError(
                f"shard {rel}: {size} bytes is not a multiple of the {name} item "
                f"size {itemsize}; hint: check the declared dtype"
            )
        return ShardLayout(num_samples=size // itemsize, dtype=name, data_offset=0)
    if fmt is Format.PARQUET:
        with fs.open(path, "rb") as fh:
            try:
                meta = pq.ParquetFile(fh).metadata
            except (pa.ArrowInvalid, OSError) as exc:
                raise FormatError(
                    f"shard {rel}: not a valid Parquet file ({exc}); hint: check "
                    "the file or the declared format"
                ) from None
            groups = tuple(meta.row_group(i).num_rows for i in range(meta.num_row_groups))
            return ShardLayout(
                num_samples=meta.num_rows,
                schema=schema_fingerprint(meta.schema.to_arrow_schema()),
                row_groups=groups,
            )
    if fmt is Format.ARROW_STREAM:
        return _inspect_arrow_stream(fs, path, rel)
    with fs.open(path, "rb") as fh:
        try:
            reader = ipc.open_file(fh)
        except pa.ArrowInvalid as exc:
            stream = fh.seek(0) == 0 and fh.read(4) == _ARROW_STREAM_MARK
            raise FormatError(
                f"shard {rel}: not an Arrow IPC file ({exc})"
                + (
                    "; it is an Arrow IPC *stream* (the format of Hugging Face datasets' "
                    "cache files data-*.arrow); hint: pass format='arrow_stream'"
                    if stream
                    else "; hint: write it with pyarrow.ipc.new_file / feather v2"
                )
            ) from None
        groups = tuple(reader.get_batch(i).num_rows for i in range(reader.num_record_batches))
        return ShardLayout(
            num_samples=sum(groups), schema=schema_fingerprint(reader.schema), row_groups=groups
        )


def _inspect_arrow_stream(fs: fsspec.AbstractFileSystem, path: str, rel: str) -> ShardLayout:
    """Layout of an Arrow IPC stream: schema and the rows of each record batch (read once)."""
    source: Any = pa.memory_map(path) if is_local_fs(fs) else fs.open(path, "rb")
    with source:
        try:
            reader = ipc.open_stream(source)
            groups = tuple(batch.num_rows for batch in reader)
        except pa.ArrowInvalid as exc:
            raise FormatError(
                f"shard {rel}: not an Arrow IPC stream ({exc}); hint: Arrow IPC *files* "
                "(with a footer, pyarrow.ipc.new_file) are format='arrow'"
            ) from None
        return ShardLayout(
            num_samples=sum(groups), schema=schema_fingerprint(reader.schema), row_groups=groups
        )


# numpy parses .npy headers with ast.literal_eval, which is not thread-safe on CPython 3.11
# (python/cpython#106905: "AST constructor recursion depth mismatch"): the parse is serialised.
_NPY_PARSE_LOCK: Final = threading.Lock()
_NPY_MAX_HEADER: Final = 1 << 20


def _read_npy_header(fh: Any) -> tuple[tuple[Any, ...], int]:
    """``(shape, fortran_order, dtype)`` and the data offset of the .npy file open in ``fh``."""
    prefix = fh.read(8)  # magic (6) + version (2)
    if len(prefix) < 8 or prefix[:6] != b"\x93NUMPY":
        raise ValueError("the magic string is not 'x93NUMPY'")
    width = 2 if prefix[6] == 1 else 4
    size_bytes = fh.read(width)
    size = int.from_bytes(size_bytes, "little") if len(size_bytes) == width else -1
    if not 0 <= size <= _NPY_MAX_HEADER:
        raise ValueError(f"header length {size} is not in [0, {_NPY_MAX_HEADER}]")
    body = fh.read(size)
    if len(body) != size:
        raise ValueError(f"the header is truncated ({len(body)} of {size} bytes)")
    raw = io.BytesIO(prefix + size_bytes + body)
    with _NPY_PARSE_LOCK:
        version = np.lib.format.read_magic(raw)
        if version == (1, 0):
            header: tuple[Any, ...] = np.lib.format.read_array_header_1_0(raw)
        else:
            header = np.lib.format.read_array_header_2_0(raw)
    return header, raw.tell()


def _inspect_npy(fs: fsspec.AbstractFileSystem, path: str, size: int, rel: str) -> ShardLayout:
    with fs.open(path, "rb") as fh:
        try:
            header, offset = _read_npy_header(fh)
        except ValueError as exc:
            raise FormatError(f"shard {rel}: not a valid .npy file ({exc})") from None
    shape, _, dtype = header
    if len(shape) != 1:
        raise FormatError(
            f"shard {rel}: token .npy files must be 1-D, found shape {shape}; "
            "hint: save tokens with np.save(path, tokens.reshape(-1))"
        )
    if dtype.str[0] == ">" or dtype.name not in TOKEN_DTYPES:
        raise FormatError(
            f"shard {rel}: dtype {dtype.str} is not a little-endian token dtype "
            f"({', '.join(TOKEN_DTYPES)}); hint: save little-endian tokens, e.g. "
            "np.save(path, tokens.astype('<u2'))"
        )
    expected = offset + shape[0] * dtype.itemsize
    if expected != size:
        raise FormatError(
            f"shard {rel}: header says {shape[0]} x {dtype.name} "
            f"({expected} bytes) but the file has {size} bytes"
        )
    return ShardLayout(num_samples=int(shape[0]), dtype=dtype.name, data_offset=offset)


_PARQUET_MAGIC: Final = b"PAR1"
_ARROW_MAGIC: Final = b"ARROW1"


def _refuse_container(fs: fsspec.AbstractFileSystem, path: str, size: int, rel: str) -> None:
    """`FormatError` when a shard declared raw ``bin`` is really a .npy, Megatron, Parquet
    or Arrow file: its start *and* structure say so (raw tokens that happen to spell a
    magic string are not refused)."""
    with fs.open(path, "rb") as fh:
        head = fh.read(8)
        kind = what = None
        if head[:6] == b"\x93NUMPY":
            fh.seek(0)
            with contextlib.suppress(ValueError):
                _read_npy_header(fh)
                kind, what = "npy", "a .npy"
        elif head[:8] == MEGATRON_MAGIC[:8]:
            fh.seek(0)
            with contextlib.suppress(FormatError):
                parse_megatron_header(fh.read(MEGATRON_HEADER_BYTES), rel=rel)
                kind, what = "megatron_idx", "a Megatron index (.idx)"
        elif size >= 12 and head[:6] == _ARROW_MAGIC:
            fh.seek(size - 6)
            if fh.read(6) == _ARROW_MAGIC:
                kind, what = "arrow", "an Arrow IPC"
        elif size >= 8 and head[:4] == _PARQUET_MAGIC:
            fh.seek(size - 4)
            if fh.read(4) == _PARQUET_MAGIC:
                kind, what = "parquet", "a Parquet"
    if kind is not None:
        raise FormatError(
            f"shard {rel}: declared format 'bin' (raw tokens) but it is {what} "
            f"file (it starts with {head[:6]!r}); read as raw tokens its header "
            f"would become tokens; hint: pass format='{kind}', or leave format= "
            "out to detect the format from the file suffix"
        )
