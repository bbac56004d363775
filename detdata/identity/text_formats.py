"""Text shards: JSONL files (plain, gzip, zstd, bzip2 or xz), one document a line.

A ``jsonl`` shard's digests are those of its bytes as stored; its ``num_samples`` is its
lines (a last line without a newline counts) and its ``schema`` its compression, read from
its first bytes, not its name. Lines are cut at ``\\n`` in the decompressed bytes; what a
line holds is checked where it is read (`detdata.datasets.text_index`). Zstd is read
through pyarrow, the others through the standard library.
"""

from __future__ import annotations

import bz2
import gzip
import io
import lzma
from typing import IO, TYPE_CHECKING, Final

from detdata.base.errors import FormatError
from detdata.base.lazy import pa

if TYPE_CHECKING:
    import fsspec

#: Decompressed bytes read per pass when counting lines (bounded memory).
_CHUNK: Final = 1 << 22
_GZIP_MAGIC: Final = b"\x1f\x8b"
_ZSTD_MAGIC: Final = b"\x28\xb5\x2f\xfd"
_BZ2_MAGIC: Final = b"BZh"
_XZ_MAGIC: Final = b"\xfd7zXZ\x00"
PLAIN, GZIP, ZSTD = "jsonl", "jsonl+gzip", "jsonl+zstd"
BZ2, XZ = "jsonl+bz2", "jsonl+xz"
#: Bytes read to tell the compression (`compression_of`).
HEAD_BYTES: Final = 6


def compression_of(head: bytes) -> str:
    """The layout (`PLAIN`, `GZIP`, `ZSTD`, `BZ2`, `XZ`) of a JSONL file from its first
    `HEAD_BYTES` bytes (a JSON line starts with none of these magics)."""
    for magic, layout in ((_GZIP_MAGIC, GZIP), (_ZSTD_MAGIC, ZSTD), (_BZ2_MAGIC, BZ2)):
        if head.startswith(magic):
            return layout
    return XZ if head.startswith(_XZ_MAGIC) else PLAIN


def decompressed(raw: IO[bytes], schema: str) -> io.BufferedIOBase | IO[bytes]:
    """A reader of the text bytes of an open JSONL file ``raw`` stored as ``schema``."""
    if schema == GZIP:
        return gzip.GzipFile(fileobj=raw, mode="rb")
    if schema == BZ2:
        return bz2.BZ2File(raw, mode="rb")
    if schema == XZ:
        return lzma.LZMAFile(raw, mode="rb")
    if schema == ZSTD:
        source = pa.PythonFile(raw, mode="r")
        return io.BufferedReader(pa.CompressedInputStream(source, "zstd"))
    return raw


def read_text_bytes(path: str, schema: str, *, rel: str) -> bytes:
    """The whole decompressed bytes of the local JSONL file ``path`` (``rel`` names it)."""
    try:
        with open(path, "rb") as fh:
            return decompressed(fh, schema).read()
    except (OSError, EOFError, ValueError, lzma.LZMAError) as exc:
        raise FormatError(
            f"shard {rel}: cannot decompress its {schema} bytes ({exc}); hint: check the file "
            "(it no longer matches its manifest entry if it changed)"
        ) from None


def inspect_jsonl(fs: fsspec.AbstractFileSystem, path: str, *, rel: str) -> tuple[int, str]:
    """``(lines, schema)`` of the JSONL file at ``path``: one streamed pass over its text."""
    with fs.open(path, "rb") as fh:
        schema = compression_of(fh.read(HEAD_BYTES))
        fh.seek(0)
        lines, last = 0, b"\n"
        try:
            reader = decompressed(fh, schema)
            while chunk := reader.read(_CHUNK):
                lines += chunk.count(b"\n")
                last = chunk[-1:]
        except (OSError, EOFError, ValueError, lzma.LZMAError) as exc:
            raise FormatError(f"shard {rel}: not valid {schema} ({exc})") from None
    return lines + (last != b"\n"), schema
