"""The header of a fast-form manifest file, validated (`detdata.identity.columns`): every
field a reader relies on, before any data is read."""

from __future__ import annotations

import json
from typing import Any, Final, cast

import numpy as np

from detdata.identity.path_blocks import MAX_BLOCK_RAW, PATH_BLOCK, block_count

KIND: Final = "detdata.manifest-columns"
#: versions read: 1 stored paths plainly (``path_ends`` / ``paths``), 2 in compressed
#: blocks (``path_block_ends`` / ``path_blocks``: `detdata.identity.path_blocks`)
READS: Final = (1, 2)
#: data bytes per checked chunk (a rank hashes only the chunks it touches)
CHUNK: Final = 64 << 10
#: sections start at multiples of this
ALIGN: Final = 64


def _path_sections(header: dict[str, Any], n: int, error: Any) -> dict[str, tuple[str, Any]]:
    """The path sections a header of its version must describe (`_parse_header`)."""
    if header["version"] == 1:
        return {"path_ends": ("<i8", n + 1), "paths": ("|u1", None)}
    raw = header.get("path_block_raw")
    if header.get("path_block") != PATH_BLOCK or not (
        type(raw) is int and 0 <= raw <= MAX_BLOCK_RAW
    ):
        raise error(
            f"header fields 'path_block' ({header.get('path_block')!r}, expected {PATH_BLOCK})"
            f" and 'path_block_raw' ({raw!r}, at most {MAX_BLOCK_RAW}) are wrong"
        )
    return {"path_block_ends": ("<i8", block_count(n) + 1), "path_blocks": ("|u1", None)}


def parse_header(raw: bytes, error: Any) -> dict[str, Any]:
    try:
        header = json.loads(raw)
    except ValueError as exc:
        raise error(f"malformed header ({exc})") from None
    if not isinstance(header, dict) or header.get("kind") != KIND:
        raise error(f"not a manifest columns file (kind {header.get('kind')!r})")
    version = header.get("version")
    if type(version) is not int or version not in READS:
        raise error(f"version {version!r}; this detdata reads versions {list(READS)}")
    if header.get("chunk") != CHUNK:
        raise error(f"chunk size {header.get('chunk')!r}, expected {CHUNK}")
    for key in ("count", "num_samples", "total_bytes", "data_bytes", "json_bytes"):
        if not isinstance(header.get(key), int) or header[key] < 0:
            raise error(f"header field {key!r} must be a non-negative integer")
    sections = header.get("sections")
    n = header["count"]
    want = {
        "bytes": ("<i8", n),
        "num_samples": ("<i8", n),
        "sample_starts": ("<i8", n + 1),
        "data_offset": ("<i8", n),
        "format": ("|u1", n),
        "dtype": ("<i2", n),
        "schema": ("<i4", n),
        **_path_sections(header, n, error),
        "blake3": ("|u1", 32 * n),
        "quick": ("|u1", 32 * n),
        "row_group_ends": ("<i8", n + 1),
        "row_groups": ("<i8", None),
    }
    if not isinstance(sections, dict) or set(sections) != set(want):
        raise error("header field 'sections' does not list the expected sections")
    for name, (dtype, items) in want.items():
        spec = sections[name]
        ok = (
            isinstance(spec, list)
            and len(spec) == 3
            and all(isinstance(v, int) and v >= 0 for v in spec[:2])
            and spec[2] == dtype
            and spec[0] % ALIGN == 0
            and spec[0] + spec[1] <= header["data_bytes"]
            and spec[1] % np.dtype(dtype).itemsize == 0
            and (items is None or spec[1] == items * np.dtype(dtype).itemsize)
        )
        if not ok:
            raise error(f"section {name!r} is described as {spec!r}")
    for key in ("formats", "dtypes", "schemas"):
        if not isinstance(header.get(key), list) or not all(
            isinstance(v, str) for v in header[key]
        ):
            raise error(f"header field {key!r} must be a list of strings")
    if not isinstance(header.get("metadata"), dict) or not all(
        isinstance(header.get(k), str) for k in ("id", "json_digest")
    ):
        raise error("header fields 'metadata' (object), 'id' and 'json_digest' are required")
    return cast(dict[str, Any], header)
