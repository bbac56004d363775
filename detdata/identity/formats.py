"""Shard formats: detection, sample counts and schema fingerprints.

A "sample" at the manifest level is one token (1-D token files) or one row
(tables). Datasets build larger samples (token windows) on top.
"""

from __future__ import annotations

import enum
import io
import json
import sys
import threading
from dataclasses import dataclass
from typing import Any, Final

import fsspec
import numpy as np
import pyarrow as pa
import pyarrow.ipc as ipc
import pyarrow.parquet as pq

from detdata.base.errors import ConfigError, FormatError
from detdata.base.hashing import digest_bytes


class Format(str, enum.Enum):
    """Shard formats detdata understands."""

    NPY = "npy"
    BIN = "bin"
    PARQUET = "parquet"
    ARROW = "arrow"


TOKEN_DTYPES: Final = ("uint16", "uint32", "int32", "int64")
TABLE_FORMATS: Final = (Format.PARQUET, Format.ARROW)
_SUFFIXES: Final = {
    ".npy": Format.NPY,
    ".bin": Format.BIN,
    ".parquet": Format.PARQUET,
    ".arrow": Format.ARROW,
    ".feather": Format.ARROW,
    ".ipc": Format.ARROW,
}


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
    for suffix, fmt in _SUFFIXES.items():
        if path.endswith(suffix):
            return fmt
    return None


def detect_format(path: str) -> Format:
    """Format from a file suffix; raises `FormatError` naming the file when unknown."""
    fmt = suffix_format(path)
    if fmt is not None:
        return fmt
    raise FormatError(
        f"{path}: cannot tell the format from the suffix; pass format= "
        f"(one of {', '.join(f.value for f in Format)})"
    )


def check_token_dtype(dtype: str | None, *, where: str) -> str:
    """Canonical numpy dtype name for token shards; token bytes are little-endian on disk.

    A manifest's ``dtype`` is a plain name (``uint16``...) meaning little-endian,
    so a big-endian declaration (``">u2"``) is refused here rather than recorded
    as ``uint16`` and read with its bytes swapped.
    """
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
    if _declares_big_endian(dtype, parsed):
        raise ConfigError(
            f"{where}: dtype {dtype!r} is big-endian; detdata token shards are "
            f"little-endian (a manifest records only {name!r}, which would read "
            "these bytes swapped); hint: convert the file, e.g. "
            f"np.fromfile(path, {parsed.str!r}).astype({parsed.newbyteorder('<').str!r})"
            ".tofile(new_path), or declare the little-endian dtype if the bytes "
            "are little-endian"
        )
    return name


def _declares_big_endian(declared: object, parsed: np.dtype[Any]) -> bool:
    """Whether a declared token dtype asks for big-endian bytes (plain names mean little)."""
    if isinstance(declared, str):
        mark = declared.strip()[:1]
        return mark in (">", "!") or (mark == "=" and sys.byteorder == "big")
    return is_big_endian(parsed)


def is_big_endian(dtype: np.dtype[Any]) -> bool:
    """True when multi-byte ``dtype`` stores its most significant byte first (on any host)."""
    return dtype.itemsize > 1 and dtype.str[0] == ">"


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
    if fmt is Format.BIN:
        name = check_token_dtype(dtype, where=rel)
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
    with fs.open(path, "rb") as fh:
        try:
            reader = ipc.open_file(fh)
        except pa.ArrowInvalid as exc:
            raise FormatError(
                f"shard {rel}: not an Arrow IPC file ({exc}); hint: write it with "
                "pyarrow.ipc.new_file / feather v2"
            ) from None
        groups = tuple(reader.get_batch(i).num_rows for i in range(reader.num_record_batches))
        return ShardLayout(
            num_samples=sum(groups), schema=schema_fingerprint(reader.schema), row_groups=groups
        )


# numpy parses .npy headers with ast.literal_eval, and CPython 3.11's AST builder keeps its
# recursion depth in interpreter-wide state: two threads parsing at once can fail with
# "SystemError: AST constructor recursion depth mismatch" (python/cpython#106905; seen here
# when manifests hashed shards in parallel threads). Header bytes are read without the lock;
# only the parse is serialised.
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
    shape, fortran, dtype = header
    if len(shape) != 1:
        raise FormatError(
            f"shard {rel}: token .npy files must be 1-D, found shape {shape}; "
            "hint: save tokens with np.save(path, tokens.reshape(-1))"
        )
    if is_big_endian(dtype) or dtype.name not in TOKEN_DTYPES:
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
    del fortran
    return ShardLayout(num_samples=int(shape[0]), dtype=dtype.name, data_offset=offset)


_PARQUET_MAGIC: Final = b"PAR1"
_ARROW_MAGIC: Final = b"ARROW1"


def _refuse_container(fs: fsspec.AbstractFileSystem, path: str, size: int, rel: str) -> None:
    """`FormatError` when a shard declared raw ``bin`` is really a .npy, Parquet or Arrow file.

    Read as raw tokens, such a file would deliver its header bytes as tokens. A
    file counts as one only if its start *and* structure say so (a .npy header
    that parses; Parquet / Arrow magic at both ends), so raw token files whose
    first tokens happen to spell a magic string are not refused.
    """
    with fs.open(path, "rb") as fh:
        head = fh.read(8)
        kind = None
        if head[:6] == b"\x93NUMPY":
            fh.seek(0)
            try:
                _read_npy_header(fh)
                kind = "npy"
            except ValueError:
                kind = None
        elif size >= 12 and head[:6] == _ARROW_MAGIC:
            fh.seek(size - 6)
            kind = "arrow" if fh.read(6) == _ARROW_MAGIC else None
        elif size >= 8 and head[:4] == _PARQUET_MAGIC:
            fh.seek(size - 4)
            kind = "parquet" if fh.read(4) == _PARQUET_MAGIC else None
    if kind is not None:
        what = {"npy": "a .npy", "arrow": "an Arrow IPC", "parquet": "a Parquet"}[kind]
        raise FormatError(
            f"shard {rel}: declared format 'bin' (raw tokens) but it is {what} "
            f"file (it starts with {head[:6]!r}); read as raw tokens its header "
            f"would become tokens; hint: pass format='{kind}', or leave format= "
            "out to detect the format from the file suffix"
        )
