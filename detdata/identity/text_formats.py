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
PLAIN, GZIP, ZSTD = "jsonl", "jsonl+gzip", "jsonl+zstd"
BZ2, XZ = "jsonl+bz2", "jsonl+xz"
#: The first bytes of each compressed layout (a JSON line starts with none of them).
MAGICS: Final = {b"\x1f\x8b": GZIP, b"\x28\xb5\x2f\xfd": ZSTD, b"BZh": BZ2, b"\xfd7zXZ\x00": XZ}


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
        head = fh.read(max(map(len, MAGICS)))
        schema = next((layout for magic, layout in MAGICS.items() if head.startswith(magic)), PLAIN)
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
