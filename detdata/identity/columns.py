"""The fast form of a manifest: fixed-width columns in one memory-mapped file.

Contract: docs/design.md ("Start-up at scale: the fast manifest form, once-per-job
verification, receipts"), which says when it is written, tied to the JSON and checked.

Layout (little-endian)::

    magic "DDMCOLS1"  u64 header length  header (canonical JSON)  blake3(header) (32 bytes)
    chunk digest table (32 bytes per CHUNK bytes of data, blake3)      data sections

Sections: ``bytes``, ``num_samples``, ``sample_starts`` (cumulative, ``count + 1``),
``data_offset`` (-1: none), ``format``, ``dtype``, ``schema`` (indices into the
header's lists, -1: none), ``path_block_ends`` / ``path_blocks`` (`detdata.identity.path_blocks`;
version 1 stored ``path_ends`` / ``paths``, a plain UTF-8 blob), ``blake3`` / ``quick``
(32 raw bytes each), ``row_group_ends`` / ``row_groups`` (an end ``e < 0`` means none,
at ``-e - 1``). The file is replaced atomically, never rewritten in place.
"""

from __future__ import annotations

import json
import mmap
import os
import threading
import time
import weakref
from collections.abc import Iterator, Mapping, Sequence
from typing import Any, Final, cast, overload

import blake3
import numpy as np
import numpy.typing as npt

from detdata.base.canonical import canonical_json
from detdata.base.errors import ManifestError
from detdata.base.hashing import PREFIX
from detdata.identity.entry import ShardEntry
from detdata.identity.path_blocks import (
    MAX_BLOCK_RAW,
    PATH_BLOCK,
    decode_block,
    encode_paths,
)
from detdata.identity.verify import pread_all
from detdata.storage.fs import check_relative_path

MAGIC: Final = b"DDMCOLS1"
#: the version written (`READS`: the versions read)
VERSION: Final = 2
KIND: Final = "detdata.manifest-columns"
#: versions read: 1 stored paths plainly (``path_ends`` / ``paths``), 2 in compressed
#: blocks (``path_block_ends`` / ``path_blocks``: `detdata.identity.path_blocks`)
READS: Final = (1, 2)
#: data bytes per checked chunk (a rank hashes only the chunks it touches)
CHUNK: Final = 64 << 10
#: sections start at multiples of this
ALIGN: Final = 64
#: a header larger than this is refused (metadata and schema strings live there)
MAX_HEADER: Final = 256 << 20
SUFFIX: Final = ".columns"
#: entries kept materialised per table (a dict cleared when full)
_ENTRY_CACHE: Final = 1 << 16
_HEAD: Final = 16  # magic + header length
#: entries decoded at once when a table is iterated
_ITER_PIECE: Final = 1 << 12
#: checked chunks kept after a read that stopped inside them (1 MiB at most)
_KEPT: Final = 16


def columns_path(json_path: str) -> str:
    """Where the fast form of the manifest file ``json_path`` lives."""
    return json_path + SUFFIX


def string_codes(
    values: Sequence[str | None], dtype: type[np.integer[Any]]
) -> tuple[list[str], np.ndarray[Any, Any]]:
    """``(distinct, codes)``: the distinct non-None ``values``, sorted, and each value's
    index into them (-1: None) as a ``dtype`` array."""
    distinct = sorted({v for v in values if v is not None})
    index = {v: i for i, v in enumerate(distinct)}
    return distinct, np.fromiter(
        (-1 if v is None else index[v] for v in values), dtype, len(values)
    )


def encode_columns(
    shards: Sequence[ShardEntry], metadata: Mapping[str, Any], manifest_id: str, json_doc: bytes
) -> bytes:
    """The fast form of a manifest (its entries in canonical order, metadata and id) saved
    with the JSON document ``json_doc`` (its size and digest are recorded: the tie)."""
    if not isinstance(shards, (tuple, list)):  # a `ShardTable`: decoded once, not per column
        shards = list(shards)
    n = len(shards)
    formats, format_codes = string_codes([s.format.value for s in shards], np.uint8)
    dtypes, dtype_codes = string_codes([s.dtype for s in shards], np.int16)
    schemas, schema_codes = string_codes([s.schema for s in shards], np.int32)
    counts = np.fromiter((s.num_samples for s in shards), np.int64, n)
    blocks, block_ends, largest = encode_paths([s.path.encode("utf-8") for s in shards])
    groups = [s.row_groups for s in shards]
    group_ends = np.full(n + 1, 0, dtype=np.int64)
    at = 0
    for i, g in enumerate(groups):
        at += len(g or ())
        group_ends[i + 1] = at if g is not None else -(at + 1)  # negative: no row groups
    starts = np.zeros(n + 1, dtype=np.int64)
    np.cumsum(counts, out=starts[1:])
    sections: dict[str, np.ndarray[Any, Any]] = {
        "bytes": np.fromiter((s.bytes for s in shards), np.int64, n),
        "num_samples": counts,
        "sample_starts": starts,
        "data_offset": np.fromiter(
            (-1 if s.data_offset is None else s.data_offset for s in shards), np.int64, n
        ),
        "format": format_codes,
        "dtype": dtype_codes,
        "schema": schema_codes,
        "path_block_ends": block_ends,
        "path_blocks": np.frombuffer(blocks, dtype=np.uint8),
        "blake3": np.frombuffer(
            b"".join(bytes.fromhex(s.blake3[len(PREFIX) :]) for s in shards), dtype=np.uint8
        ),
        "quick": np.frombuffer(
            b"".join(bytes.fromhex(s.quick[len(PREFIX) :]) for s in shards), dtype=np.uint8
        ),
        "row_group_ends": group_ends,
        "row_groups": np.fromiter((x for g in groups for x in g or ()), np.int64),
    }
    layout: dict[str, list[Any]] = {}
    parts: list[bytes] = []
    offset = 0
    for name, arr in sections.items():
        raw = np.ascontiguousarray(arr).astype(arr.dtype.newbyteorder("<"), copy=False).tobytes()
        layout[name] = [offset, len(raw), arr.dtype.newbyteorder("<").str]
        pad = -len(raw) % ALIGN
        parts.append(raw + b"\0" * pad)
        offset += len(raw) + pad
    data = b"".join(parts)
    table = b"".join(
        blake3.blake3(data[i : i + CHUNK]).digest() for i in range(0, len(data), CHUNK)
    )
    header = canonical_json(
        {
            "kind": KIND,
            "version": VERSION,
            "id": manifest_id,
            "json_bytes": len(json_doc),
            "json_digest": PREFIX + blake3.blake3(json_doc).hexdigest(),
            "count": n,
            "num_samples": int(starts[-1]),
            "total_bytes": int(sections["bytes"].sum()),
            "metadata": dict(metadata),
            "formats": formats,
            "dtypes": dtypes,
            "schemas": schemas,
            "chunk": CHUNK,
            "path_block": PATH_BLOCK,
            "path_block_raw": largest,
            "data_bytes": len(data),
            "table_digest": blake3.blake3(table).hexdigest(),
            "sections": layout,
        }
    )
    return (
        MAGIC
        + len(header).to_bytes(8, "little")
        + header
        + blake3.blake3(header).digest()
        + table
        + data
    )


def parse_header(raw: bytes, error: Any) -> dict[str, Any]:
    try:
        header = json.loads(raw)
    except ValueError as exc:
        raise error(f"malformed header ({exc})") from None
    if not isinstance(header, dict):
        raise error(f"malformed header (a JSON {type(header).__name__}, not an object)")
    if header.get("kind") != KIND:
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
    if version == 1:  # the path sections
        paths = {"path_ends": ("<i8", n + 1), "paths": ("|u1", None)}
    else:
        largest = header.get("path_block_raw")
        if header.get("path_block") != PATH_BLOCK or not (
            type(largest) is int and 0 <= largest <= MAX_BLOCK_RAW
        ):
            raise error(
                f"header fields 'path_block' ({header.get('path_block')!r}, expected {PATH_BLOCK})"
                f" and 'path_block_raw' ({largest!r}, at most {MAX_BLOCK_RAW}) are wrong"
            )
        blocks = -(-n // PATH_BLOCK)
        paths = {"path_block_ends": ("<i8", blocks + 1), "path_blocks": ("|u1", None)}
    want = {
        "bytes": ("<i8", n),
        "num_samples": ("<i8", n),
        "sample_starts": ("<i8", n + 1),
        "data_offset": ("<i8", n),
        "format": ("|u1", n),
        "dtype": ("<i2", n),
        "schema": ("<i4", n),
        **paths,
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


class ColumnsFile:
    """A fast-form file; every data chunk is checked against its digest on first use.

    Reads go through ``pread`` on a descriptor held open: scattered lookups (`items`)
    cost no resident pages (a mapped fault pulls a whole folio). Only `array` (a whole
    section) maps the file, on first use."""

    def __init__(self, path: str) -> None:
        self.path = path
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
        self._fd = fd
        self._closer = weakref.finalize(self, os.close, fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_RANDOM)  # scattered chunk reads
        st = os.fstat(fd)
        #: ``[size, mtime_ns, ctime_ns, inode, device]`` of the file opened (before a read),
        #: and the wall time it was taken at
        self.identity = [st.st_size, st.st_mtime_ns, st.st_ctime_ns, st.st_ino, st.st_dev]
        self.seen_ns = time.time_ns()
        self._vouched = False
        self._map: mmap.mmap | None = None
        self._buf: memoryview | None = None
        self._arrays: dict[str, np.ndarray[Any, Any]] = {}
        self._kept: dict[int, bytes] = {}  # checked chunks read whole, by index
        self._lock = threading.Lock()
        try:
            self._open_checked(st.st_size)
        except BaseException:
            self.close()
            raise

    def _open_checked(self, size: int) -> None:
        """Read and check the header and the chunk table (O(1) in the shards)."""
        if size < _HEAD + 32:
            raise self._error(f"{size} bytes is too short for a header")
        head = self._pread(0, _HEAD)
        if head[:8] != MAGIC:
            raise self._error(f"magic {head[:8]!r}, expected {MAGIC!r}")
        hlen = int.from_bytes(head[8:16], "little")
        if hlen > MAX_HEADER or _HEAD + hlen + 32 > size:
            raise self._error(f"header length {hlen} does not fit the file ({size} bytes)")
        raw = self._pread(_HEAD, hlen + 32)
        header, stored = raw[:hlen], raw[hlen:]
        found = blake3.blake3(header).digest()
        if found != stored:
            raise self._error("the header does not match its digest (corrupted or edited)")
        self.header_digest = PREFIX + found.hex()
        self.header = parse_header(header, self._error)
        self.count: int = self.header["count"]
        chunks = -(-self.header["data_bytes"] // CHUNK)
        table_at = _HEAD + hlen + 32
        self._data_at = table_at + 32 * chunks
        if self._data_at + self.header["data_bytes"] != size:
            raise self._error(
                f"{size} bytes, the header describes "
                f"{self._data_at + self.header['data_bytes']} (truncated or appended to)"
            )
        self._table = self._pread(table_at, 32 * chunks)
        if blake3.blake3(self._table).hexdigest() != self.header["table_digest"]:
            raise self._error("the chunk digest table does not match the header")
        self._checked = bytearray(chunks)

    def _error(self, what: str) -> ManifestError:
        return ManifestError(
            f"manifest columns {self.path}: {what}; hint: delete the file (the JSON next to "
            "it is the readable form) and save the manifest again"
        )

    def _pread(self, at: int, count: int) -> bytes:
        """``count`` bytes of the file from ``at`` (a short read is a truncated file)."""
        data = pread_all(self._fd, count, at)
        if len(data) < count:
            raise self._error(f"{count} bytes at {at} are past its end (truncated in place?)")
        return data

    def vouch(self, files: Sequence[Any] | None) -> bool:
        """Trust this file's bytes without hashing them where ``files`` (what this job's
        verification checked in full: ``[header digest, columns identity, JSON identity]``,
        `detdata.identity.receipts`) names this very file; return whether it is trusted."""
        if (
            files is not None
            and len(files) == 3
            and files[0] == self.header_digest
            and files[1] == self.identity
        ):
            self._vouched = True
        return self._vouched

    def _read_checked(self, start: int, stop: int) -> bytes:
        """Data bytes ``[start, stop)``, every chunk covering them checked once (none once
        vouched for). The last `_KEPT` chunks read whole past ``stop`` are kept, so a scan
        in pieces reads each byte once."""
        if self._vouched:
            return self._pread(self._data_at + start, stop - start)
        first, last = start // CHUNK, max(start, stop - 1) // CHUNK
        parts: list[bytes] = []
        at, c = start, first
        while c <= last:
            kept = self._kept.get(c)
            if kept is not None:
                end = min(stop, (c + 1) * CHUNK)
                parts.append(kept[at - c * CHUNK : end - c * CHUNK])
                at, c = end, c + 1
                continue
            run = self._run(c, last)
            if self._checked[c]:
                end = min(stop, (run + 1) * CHUNK)
                parts.append(self._pread(self._data_at + at, end - at))
            else:
                end = self._read_unchecked(c, run, at, stop, parts)
            at, c = end, run + 1
        return parts[0] if len(parts) == 1 else b"".join(parts)

    def _run(self, c: int, last: int) -> int:
        """The last chunk of the run from ``c`` (at most ``last``) that is all checked or
        all unchecked, and not kept."""
        state = self._checked[c]
        while c < last and self._checked[c + 1] == state and c + 1 not in self._kept:
            c += 1
        return c

    def _read_unchecked(self, c: int, run: int, at: int, stop: int, parts: list[bytes]) -> int:
        """Read chunks ``c..run`` whole, check each, append the bytes ``[at, stop)`` of them
        to ``parts``; returns where they end."""
        lo = c * CHUNK
        hi: int = min((run + 1) * CHUNK, self.header["data_bytes"])
        data = self._pread(self._data_at + lo, hi - lo)
        with memoryview(data) as view:
            for k in range(c, run + 1):
                piece = view[k * CHUNK - lo : min(hi, (k + 1) * CHUNK) - lo]
                if blake3.blake3(piece).digest() != self._table[32 * k : 32 * k + 32]:
                    raise self._error(f"data chunk {k} does not match its digest (corrupted)")
                self._checked[k] = 1
        end = min(stop, hi)
        parts.append(data[at - lo : end - lo])
        if hi > stop:
            with self._lock:
                if len(self._kept) >= _KEPT:
                    del self._kept[next(iter(self._kept))]
                self._kept[run] = data[run * CHUNK - lo :]
        return end

    def array(self, name: str) -> np.ndarray[Any, Any]:
        """All of section ``name`` (every chunk of it checked): a read-only mapped view."""
        view = self._arrays.get(name)
        if view is not None:
            return view
        offset, length, dtype = self.header["sections"][name]
        if not self._vouched:
            for at in range(offset, offset + length, 1 << 24):  # checked 16 MiB at a time
                stop = min(offset + length, at + (1 << 24))
                first, last = at // CHUNK, max(at, stop - 1) // CHUNK
                if not all(self._checked[first : last + 1]):
                    self._read_checked(at, stop)
        with self._lock:  # the whole file mapped on first use (only here)
            if self._buf is None:
                self._map = mmap.mmap(self._fd, 0, access=mmap.ACCESS_READ)
                self._buf = memoryview(self._map)
        at = self._data_at + offset
        view = np.frombuffer(self._buf[at : at + length], dtype=np.dtype(dtype))
        self._arrays[name] = view
        return view

    def items(self, name: str, lo: int, hi: int) -> np.ndarray[Any, Any]:
        """Elements ``[lo, hi)`` of section ``name`` (their chunks checked): a read-only
        array of its own (read with ``pread``, not mapped)."""
        offset, length, dtype = self.header["sections"][name]
        dt = np.dtype(dtype)
        if not 0 <= lo <= hi <= length // dt.itemsize:
            raise IndexError(f"{name}[{lo}:{hi}] is out of range ({length // dt.itemsize} items)")
        if hi == lo:
            return np.empty(0, dtype=dt)
        return np.frombuffer(
            self._read_checked(offset + lo * dt.itemsize, offset + hi * dt.itemsize), dtype=dt
        )

    def close(self) -> None:
        self._arrays.clear()
        self._kept.clear()
        if self._buf is not None:
            self._buf.release()
            self._buf = None
        if self._map is not None:
            self._map.close()
            self._map = None
        self._closer()


class ShardTable(Sequence["ShardEntry"]):
    """A manifest's shards, backed by a `ColumnsFile`: entries are built (and checked as
    the JSON loader checks one) when used. Equal to any sequence of the same entries.
    Pickled as its file path and header digest (another file is refused on unpickling).
    """

    def __init__(self, columns: ColumnsFile, json_path: str | None = None) -> None:
        self.columns = columns
        #: the local JSON file the columns were saved with (checked by `check_json`)
        self.json_path = json_path
        self._cache: dict[int, ShardEntry] = {}
        self._paths: dict[int, str] = {}  # `path` of shards without a built entry
        self._block: tuple[int, list[str]] | None = None  # the last path block decoded

    def __len__(self) -> int:
        return self.columns.count

    @overload
    def __getitem__(self, index: int) -> ShardEntry: ...
    @overload
    def __getitem__(self, index: slice) -> tuple[ShardEntry, ...]: ...
    def __getitem__(self, index: int | slice) -> ShardEntry | tuple[ShardEntry, ...]:
        if isinstance(index, slice):
            return tuple(self.entry(i) for i in range(*index.indices(len(self))))
        i = int(index)
        if i < 0:
            i += len(self)
        if not 0 <= i < len(self):
            raise IndexError(f"shard index {index} out of range for {len(self)} shards")
        return self.entry(i)

    def __iter__(self) -> Iterator[ShardEntry]:
        """Every entry, decoded in bulk `_ITER_PIECE` at a time, none kept."""
        for lo in range(0, len(self), _ITER_PIECE):
            yield from self.entries_between(lo, min(len(self), lo + _ITER_PIECE))

    def entry(self, i: int) -> ShardEntry:
        """Shard ``i`` (0 <= i < len) as a checked `ShardEntry`."""
        hit = self._cache.get(i)
        if hit is not None:
            return hit
        (entry,) = self.entries_between(i, i + 1)
        if len(self._cache) >= _ENTRY_CACHE:
            self._cache.clear()
        self._cache[i] = entry
        return entry

    def path(self, i: int) -> str:
        """Shard ``i``'s relative path, checked as an entry's is, decoding only the path
        columns."""
        found = self._paths.get(i)
        if found is not None:
            return found
        hit = self._cache.get(i)
        if hit is not None:
            return hit.path
        if not 0 <= i < len(self):
            raise IndexError(f"shard index {i} out of range for {len(self)} shards")
        (path,) = self.paths_between(i, i + 1)
        check_relative_path(path, where=f"manifest columns {self.columns.path} shard #{i}")
        if len(self._paths) >= _ENTRY_CACHE:
            self._paths.clear()
        self._paths[i] = path
        return path

    def paths_between(self, lo: int, hi: int) -> list[str]:
        """The relative paths of shards ``[lo, hi)`` decoded in bulk (UTF-8 and bounds
        checked; `entries_between` also checks each as a path under the root)."""
        if not 0 <= lo <= hi <= len(self):
            raise IndexError(f"paths [{lo}, {hi}) out of range for {len(self)} shards")
        if hi == lo:
            return []
        c = self.columns
        if c.header["version"] == 1:
            return _plain_paths(c, lo, hi)
        first, last = lo // PATH_BLOCK, (hi - 1) // PATH_BLOCK
        cached = self._block
        if first == last and cached is not None and cached[0] == first:
            return cached[1][lo - first * PATH_BLOCK : hi - first * PATH_BLOCK]
        ends = c.items("path_block_ends", first, last + 2).tolist()
        size = c.header["sections"]["path_blocks"][1]
        if not (ends[0] >= 0 and ends[-1] <= size and all(map(int.__le__, ends, ends[1:]))):
            raise c._error(f"path blocks {first}..{last}: bounds {ends} are out of range")
        blob = c.items("path_blocks", ends[0], ends[-1]).tobytes()
        out: list[str] = []
        for b in range(first, last + 1):
            raw = blob[ends[b - first] - ends[0] : ends[b - first + 1] - ends[0]]
            count = min(PATH_BLOCK, len(self) - b * PATH_BLOCK)
            out += decode_block(raw, count, c.header["path_block_raw"], c._error, b)
        self._block = (last, out[(last - first) * PATH_BLOCK :])
        return out[lo - first * PATH_BLOCK : hi - first * PATH_BLOCK]

    def entries_between(self, lo: int, hi: int) -> list[ShardEntry]:
        """Shards ``[lo, hi)`` decoded in bulk from their checked chunks, each checked as
        `entry` checks one (the JSON loader's own checks)."""
        c = self.columns
        cols = {name: c.items(name, lo, hi).tolist() for name in _ROW_SECTIONS}
        paths = self.paths_between(lo, hi)
        g_ends = c.items("row_group_ends", lo, hi + 1).tolist()
        g_base, g_top = (_group_at(g_ends[0]), _group_at(g_ends[-1])) if g_ends else (0, 0)
        if not 0 <= g_base <= g_top <= c.header["sections"]["row_groups"][1] // 8:
            raise c._error(
                f"shards #{lo}..{hi - 1}: row group bounds {g_base}..{g_top} are out of range"
            )
        groups = c.items("row_groups", g_base, g_top).tolist()
        b3 = c.items("blake3", 32 * lo, 32 * hi).tobytes()
        quick = c.items("quick", 32 * lo, 32 * hi).tobytes()
        out: list[ShardEntry] = []
        for k in range(hi - lo):
            g_hi = g_ends[k + 1]
            mine: list[int] | None = None
            if g_hi >= 0:
                start = _group_at(g_ends[k])
                if not g_base <= start <= g_hi <= g_top:
                    raise c._error(
                        f"shard #{lo + k}: row group bounds {start}..{g_hi} are out of range"
                    )
                mine = groups[start - g_base : g_hi - g_base]
            out.append(
                _entry(
                    c,
                    lo + k,
                    paths[k],
                    {name: cols[name][k] for name in _ROW_SECTIONS},
                    b3[32 * k : 32 * k + 32],
                    quick[32 * k : 32 * k + 32],
                    mine,
                )
            )
        return out

    def row_group_columns(self) -> tuple[npt.NDArray[np.int64], npt.NDArray[np.int64]]:
        """``(counts, sizes)`` of `Manifest.row_groups_per_shard` from the mapped columns,
        checked as a whole as `ShardEntry.from_json` checks one; no entry built."""
        c = self.columns
        ends = c.array("row_group_ends")
        sizes = c.array("row_groups")
        at = np.where(ends < 0, -ends - 1, ends)
        steps = np.diff(at)
        if int(at[0]) != 0 or int(at[-1]) != sizes.shape[0] or bool((steps < 0).any()):
            raise c._error("the row group ends do not run from 0 to the row group count")
        if sizes.size and int(sizes.min()) < 0:
            bad = int(np.flatnonzero(sizes < 0)[0])
            shard = int(np.searchsorted(at, bad, side="right")) - 1
            raise c._error(f"shard #{shard}: a negative row group size")
        counts = steps.astype(np.int64)
        counts[ends[1:] < 0] = -1
        return counts, np.asarray(sizes, dtype=np.int64)

    def __eq__(self, other: object) -> bool:
        if isinstance(other, ShardTable) and other.columns.header_digest == (
            self.columns.header_digest
        ):
            return True
        if not isinstance(other, Sequence) or len(other) != len(self):
            return False
        return all(a == b for a, b in zip(self, other, strict=True))

    def __hash__(self) -> int:
        return hash(tuple(self))

    def __reduce__(self) -> tuple[Any, ...]:
        return (_reopen, (self.columns.path, self.columns.header_digest, self.json_path))


#: per-shard scalar sections (one value each)
_ROW_SECTIONS: Final = ("bytes", "num_samples", "data_offset", "format", "dtype", "schema")


def _plain_paths(c: ColumnsFile, lo: int, hi: int) -> list[str]:
    """Paths ``[lo, hi)`` of a version-1 file (a UTF-8 blob and each path's end)."""
    ends = c.items("path_ends", lo, hi + 1).tolist()
    base, top = ends[0], ends[-1]
    if not 0 <= base <= top <= c.header["sections"]["paths"][1]:
        raise c._error(f"shards #{lo}..{hi - 1}: path bounds {base}..{top} are out of range")
    blob = c.items("paths", base, top).tobytes()
    out: list[str] = []
    for i, start, end in zip(range(lo, hi), ends, ends[1:], strict=False):
        if not base <= start <= end <= top:
            raise c._error(f"shard #{i}: path bounds {start - base}..{end - base} are out of range")
        raw = blob[start - base : end - base]
        try:
            out.append(raw.decode("utf-8"))
        except UnicodeDecodeError:
            raise c._error(f"shard #{i}: path {raw!r} is not UTF-8") from None
    return out


def _group_at(end: int) -> int:
    """Where a ``row_group_ends`` value points (a negative end ``e``: none, at ``-e - 1``)."""
    return end if end >= 0 else -end - 1


def _entry(
    c: ColumnsFile,
    i: int,
    path: str,
    row: dict[str, int],
    b3: bytes,
    quick: bytes,
    groups: list[int] | None,
) -> ShardEntry:
    """Shard ``i`` from its decoded fields, checked by the JSON loader's own checks."""
    obj: dict[str, Any] = {
        "path": path,
        "bytes": row["bytes"],
        "num_samples": row["num_samples"],
        "blake3": PREFIX + b3.hex(),
        "quick": PREFIX + quick.hex(),
    }
    if row["data_offset"] >= 0:
        obj["data_offset"] = row["data_offset"]
    for name in ("format", "dtype", "schema"):  # an index into the header's list (format: u8)
        values, index = c.header[f"{name}s"], row[name]
        if index < 0:
            continue  # none (-1)
        if index >= len(values):
            raise c._error(f"shard #{i}: {name} index {index} out of range")
        obj[name] = values[index]
    if groups is not None:
        obj["row_groups"] = groups
    return ShardEntry.from_json(obj, f"manifest columns {c.path} shard #{i}")


def _reopen(path: str, header_digest: str, json_path: str | None) -> ShardTable:
    columns = ColumnsFile(path)
    if columns.header_digest != header_digest:
        raise ManifestError(
            f"manifest columns {path}: the file changed since this manifest was opened "
            f"(header {header_digest}, now {columns.header_digest}); hint: reopen the manifest"
        )
    return ShardTable(columns, json_path)


#: how a JSON written by `Manifest.save` introduces its shard list (sorted keys, indent=1)
_SHARDS_KEY: Final = b'\n "shards": ['
_HEAD_LIMIT: Final = 1 << 20


def read_json_head(path: str) -> dict[str, Any] | None:
    """The top-level fields before ``"shards"`` of a manifest JSON written by `save`, read
    from the file's head only; None when not laid out that way within its first MiB."""
    head = b""
    step = 1 << 10  # the fields before "shards" are a few hundred bytes unless metadata is big
    with open(path, "rb", buffering=0) as fh:  # unbuffered: no 8 KiB read-ahead per rank
        while True:  # small reads: a restart reads little beyond the columns it maps
            more = fh.read(step)
            step = 16 << 10
            head += more
            at = head.find(_SHARDS_KEY)
            if at >= 0 or not more or len(head) >= _HEAD_LIMIT:
                break
    if at < 0:
        return None
    try:
        doc = json.loads(head[:at] + b'\n "shards": []}')
    except ValueError:
        return None
    return doc if isinstance(doc, dict) else None
