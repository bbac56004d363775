"""`TokenWindows`' per-shard index (`WindowIndex`): built once per job, read by every rank.

Per shard: cumulative window counts (``starts``, ``count + 1``), the byte offset of its
tokens, its size and its dtype code. For a fast-form manifest with receipts on it is stored
as ``<name>.windows`` in the receipts folder, checked in full once (keyed blake3 under this
user's `detdata.identity.local_key`), then trusted by file identity (its ``.checked`` note);
a file failing a check is named in a `RuntimeWarning` and rebuilt. Sections are read with
``pread`` (`FileColumn`), never mapped (a mapping's page faults keep whole folios
resident). Contract and trust model: docs/design.md "Start-up at scale: the fast manifest
form, once-per-job verification, receipts".

Layout (little-endian)::

    magic "DDWINDX1"  u64 header length  header (canonical JSON)  zero padding to 64
    sections: starts <i8 (count + 1)  offsets <i8  sizes <i8  codes <i2 (each 64-aligned)
    keyed blake3 of every byte above (32 bytes; the key: this user's, `local_key`)
"""

from __future__ import annotations

import contextlib
import functools
import hmac
import json
import os
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Final

import blake3
import numpy as np
import numpy.typing as npt

from detdata.base.canonical import canonical_json
from detdata.base.errors import FormatError
from detdata.identity.columns import ShardTable
from detdata.identity.entry import ShardEntry
from detdata.identity.formats import TOKEN_DTYPES, Format
from detdata.identity.local_key import key_id, keyed, local_key
from detdata.identity.manifest import Manifest
from detdata.identity.receipts import RACY_S, job_meeting, receipt_dir
from detdata.storage.atomic import atomic_write_bytes
from detdata.storage.file_column import FileColumn, IntColumn, OpenFile
from detdata.storage.locks import file_lock

MAGIC: Final = b"DDWINDX1"
KIND: Final = "detdata.token-windows-index"
VERSION: Final = 2
SUFFIX: Final = ".windows"
#: next to an index file: its identity when last checked in full (`write_checked_note`)
CHECKED: Final = ".checked"
#: a note's keys: the identity noted, and its tag (`note_tag`)
NOTE_IDENTITY: Final = "identity"
NOTE_TAG: Final = "tag"
#: manifests of fewer shards build the index in memory (a ms or two: less than a stored
#: file's write, fsync and check would cost a small corpus's first start)
STORE_MIN_SHARDS: Final = 1 << 12
#: bytes hashed (then dropped from the resident set) at a time when a file is checked
HASH_PIECE: Final = 1 << 20
#: a header larger than this is refused (it holds the inputs and a few dtype names)
MAX_HEADER: Final = 1 << 20
_HEAD: Final = 16  # magic + header length
_ALIGN: Final = 64
_DIGEST: Final = 32
#: each section: (name, dtype, elements for ``count`` shards)
_SECTIONS: Final = (("starts", "<i8", 1), ("offsets", "<i8", 0), ("sizes", "<i8", 0))
_CODES: Final = ("codes", "<i2", 0)


@dataclass(frozen=True, eq=False)
class WindowIndex:
    """Per shard, in manifest order; ``codes`` index ``dtypes``, ``used``: the codes some
    shard has. Read-only arrays (``path`` None) or `FileColumn` s of ``path``."""

    starts: IntColumn
    offsets: IntColumn
    sizes: IntColumn
    codes: npt.NDArray[np.int16] | FileColumn
    dtypes: tuple[str, ...]
    used: tuple[int, ...]
    path: str | None = None

    @property
    def windows(self) -> int:
        return int(self.starts[-1])


# ------------------------------------------------------------------------ building
def build_window_index(
    manifest: Manifest, seq_len: int, labels: bool, allow_short: bool
) -> WindowIndex:
    """The index of ``manifest`` for windows of ``seq_len`` (+1 with ``labels``). `FormatError`
    naming the first shard that is not a token shard of a consistent size, or, unless
    ``allow_short``, the first too short for one window."""
    dtypes, codes = _check_token_shards(manifest)
    tokens = manifest.samples_per_shard()
    counts = np.maximum(0, (tokens - int(labels)) // seq_len)
    if not allow_short:
        short = np.flatnonzero(counts == 0)
        if short.size:
            shard = manifest.shards[int(short[0])]
            raise FormatError(
                f"shard {shard.path}: {shard.num_samples} tokens is too short for one window "
                f"of seq_len={seq_len} (needs {seq_len + int(labels)} tokens with "
                f"labels={labels}); hint: pass allow_short_shards=True to skip "
                "such shards, or use a smaller seq_len"
            )
    starts = np.zeros(counts.size + 1, dtype=np.int64)
    np.cumsum(counts, out=starts[1:])
    arrays = (
        starts,
        np.maximum(manifest.data_offsets(), 0),
        np.array(manifest.bytes_per_shard(), dtype=np.int64),
        codes.astype(np.int16),
    )
    for arr in arrays:
        arr.flags.writeable = False
    # the distinct codes, ascending: `np.unique`'s answer without its first-call import of
    # ``numpy.ma`` (~20 ms of a small corpus's open)
    used = tuple(np.flatnonzero(np.bincount(codes)).tolist()) if codes.size else ()
    return WindowIndex(*arrays, dtypes=dtypes, used=used)


def _check_token_shards(manifest: Manifest) -> tuple[tuple[str, ...], npt.NDArray[Any]]:
    """``(dtypes, codes)``: the manifest's dtype names and each shard's index into them;
    `check_token_shard`'s error for the first bad shard."""
    formats, fcode = manifest.codes("format")
    dtypes, dcode = manifest.codes("dtype")
    token_fmt = np.array([Format(f) in (Format.NPY, Format.BIN) for f in formats] + [False])
    token_dt = np.array([d in TOKEN_DTYPES for d in dtypes] + [False])
    bad = ~token_fmt[fcode] | ~token_dt[dcode]  # code -1 picks the trailing False
    sizes = np.array([np.dtype(d).itemsize if d in TOKEN_DTYPES else 0 for d in dtypes] + [0])
    expected = np.maximum(manifest.data_offsets(), 0) + (
        manifest.samples_per_shard() * sizes[dcode]
    )
    bad |= expected != manifest.bytes_per_shard()  # a size the dtype does not explain
    if bad.any():
        check_token_shard(manifest.shards[int(np.flatnonzero(bad)[0])])
    return dtypes, dcode


def check_token_shard(shard: ShardEntry) -> str:
    """The shard's token dtype; `FormatError` if it is not a 1-D token shard with a
    consistent size."""
    if shard.format is Format.JSONL:
        raise FormatError(
            f"shard {shard.path}: format 'jsonl' is text, not tokens (npy, bin); hint: read it "
            "with TextDocuments(manifest, tokenizer) and pack it with PackedWindows"
        )
    if shard.format not in (Format.NPY, Format.BIN):
        raise FormatError(
            f"shard {shard.path}: format {shard.format.value!r} is not a token format "
            "(npy, bin); hint: use TableRows for parquet/arrow shards"
        )
    if shard.dtype not in TOKEN_DTYPES:
        raise FormatError(
            f"shard {shard.path}: dtype {shard.dtype!r} is not a token dtype "
            f"({', '.join(TOKEN_DTYPES)})"
        )
    offset = shard.data_offset or 0
    expected = offset + shard.num_samples * np.dtype(shard.dtype).itemsize
    if expected != shard.bytes:
        raise FormatError(
            f"shard {shard.path}: manifest says {shard.num_samples} x {shard.dtype} "
            f"after a {offset}-byte header ({expected} bytes) but {shard.bytes} bytes; "
            "hint: rebuild the manifest"
        )
    return shard.dtype


# ------------------------------------------------------------------ built once, mapped
def window_inputs(
    manifest: Manifest, seq_len: int, labels: bool, allow_short: bool
) -> dict[str, Any]:
    """What the index of a fast-form ``manifest`` is a function of."""
    assert isinstance(manifest.shards, ShardTable)
    return {
        "kind": KIND,
        "version": VERSION,
        "manifest": manifest.id,
        "columns": manifest.shards.columns.header_digest,
        "seq_len": seq_len,
        "labels": labels,
        "allow_short_shards": allow_short,
    }


def window_index_path(folder: str, inputs: dict[str, Any], secret: bytes) -> str:
    """Where the index of ``inputs`` written under the key ``secret`` is kept in the
    receipts ``folder`` (each key's files under names of their own)."""
    name = blake3.blake3(canonical_json([inputs, key_id(secret)])).hexdigest()[:40]
    return os.path.join(folder, name + SUFFIX)


def open_window_index(
    manifest: Manifest, seq_len: int, labels: bool, allow_short: bool, *, meet: bool = True
) -> WindowIndex:
    """The index of ``manifest`` for these windows: read from its file, built once per
    job where it is missing or fails its checks, or built in memory (not the fast form,
    receipts off, or no usable key). ``meet=False`` (unpickled in a worker): the file's
    lock only, no meeting through the parent's process group."""
    if not isinstance(manifest.shards, ShardTable) or len(manifest.shards) < STORE_MIN_SHARDS:
        return build_window_index(manifest, seq_len, labels, allow_short)
    inputs = window_inputs(manifest, seq_len, labels, allow_short)
    folder = receipt_dir()
    secret = None if folder is None else local_key(folder)
    if folder is None or secret is None:
        return build_window_index(manifest, seq_len, labels, allow_short)
    path = window_index_path(folder, inputs, secret)
    reported: set[str] = set()  # each problem of the file is reported once
    load = functools.partial(_load_warning, path, inputs, len(manifest.shards), secret, reported)
    store, leader, key = (
        job_meeting(manifest, f"windows/{os.path.basename(path)}") if meet else (None, True, "")
    )
    if store is not None and not leader:
        store.wait([key + "/done"], timedelta(days=7))  # blocked in the store, no polling
        found = load([_vouched(store, key), read_checked_note(path, secret)])
        if found is not None:
            return found
    try:
        with file_lock(path + ".lock"):
            found = load([read_checked_note(path, secret)])
            if found is not None:
                identity = write_checked_note(found, secret)
            else:
                built = build_window_index(manifest, seq_len, labels, allow_short)
                found, identity = _store(built, path, inputs, secret, load)
                if found is None:
                    return built
            if store is not None and leader and identity is not None:
                store.set(key + "/checked", canonical_json(identity))
            return found
    finally:
        if store is not None and leader:
            store.set(key + "/done", b"1")


def _store(
    built: WindowIndex,
    path: str,
    inputs: dict[str, Any],
    secret: bytes,
    load: Callable[[Sequence[list[int] | None]], WindowIndex | None],
) -> tuple[WindowIndex | None, list[int] | None]:
    """Write ``built`` to ``path`` and open it: ``(index, noted identity)``, or ``(None,
    None)`` where it cannot be stored (every process builds its own)."""
    try:
        atomic_write_bytes(path, encode_window_index(built, inputs, secret))
        st = os.stat(path)
    except OSError:
        return None, None
    # its own write: the digest is of bytes this process made, not read again
    own = [st.st_size, st.st_mtime_ns, st.st_ctime_ns, st.st_ino, st.st_dev]
    found = load([own])
    if found is None:
        return None, None
    return found, write_checked_note(found, secret, own_write=True)


def _vouched(store: Any, key: str) -> list[int] | None:
    """The identity of the file the leader checked in full (None: it published none)."""
    if not store.check([key + "/checked"]):
        return None
    found = json.loads(store.get(key + "/checked"))
    return found if isinstance(found, list) else None


# --------------------------------------------------------------- checked once, noted
def read_checked_note(path: str, secret: bytes) -> list[int] | None:
    """The identity the index file ``path`` had at its last full check (its ``.checked``
    note); None without a readable note or with one whose `note_tag` under ``secret`` is
    wrong."""
    try:
        with open(path + CHECKED, "rb") as fh:
            found = json.loads(fh.read(1 << 12))
    except (OSError, ValueError):
        return None
    if not isinstance(found, dict) or set(found) != {NOTE_IDENTITY, NOTE_TAG}:
        return None
    identity: list[int] = found[NOTE_IDENTITY]
    tag = found[NOTE_TAG]
    ok = isinstance(identity, list) and len(identity) == 5
    if not ok or not all(type(v) is int for v in identity):
        return None
    if not isinstance(tag, str) or not hmac.compare_digest(tag, note_tag(path, identity, secret)):
        return None
    return identity


def note_tag(path: str, identity: list[int], secret: bytes) -> str:
    """The hex keyed blake3 tagging a note that the index file ``path`` had ``identity``."""
    signed = canonical_json([KIND + "/checked", os.path.basename(path), identity])
    return keyed(secret, signed).hex()


def write_checked_note(
    index: WindowIndex, secret: bytes, *, own_write: bool = False
) -> list[int] | None:
    """Note the identity of the file ``index`` was read from (taken at its open, before
    its bytes were checked), tagged under ``secret``, and return it for the leader to
    publish. None for an index built in memory, or for a file changed less than `RACY_S`
    before that identity was taken, unless ``own_write`` (this process just wrote it)."""
    if not isinstance(index.starts, FileColumn):
        return None
    file = index.starts.file
    _, mtime, ctime, _, _ = file.identity
    settled = own_write or file.seen_ns - max(mtime, ctime) >= int(RACY_S * 1e9)
    if not settled:
        return None  # not noted, and not published: each process checks it in full
    if read_checked_note(file.path, secret) != file.identity:
        note = {NOTE_IDENTITY: file.identity, NOTE_TAG: note_tag(file.path, file.identity, secret)}
        with contextlib.suppress(OSError):  # no note: the next open checks in full again
            atomic_write_bytes(file.path + CHECKED, canonical_json(note))
    return file.identity


def encode_window_index(index: WindowIndex, inputs: dict[str, Any], secret: bytes) -> bytes:
    """The file of ``index`` for ``inputs`` (module docstring), keyed under ``secret``."""
    count = index.codes.size
    header = canonical_json(
        {
            "kind": KIND,
            "version": VERSION,
            "inputs": inputs,
            "count": count,
            "windows": index.windows,
            "dtypes": list(index.dtypes),
            "used": list(index.used),
            "sections": _layout(count),
        }
    )
    head = MAGIC + len(header).to_bytes(8, "little") + header
    parts = [head + b"\0" * (-len(head) % _ALIGN)]
    for (_, dtype, _), arr in zip(
        (*_SECTIONS, _CODES), (index.starts, index.offsets, index.sizes, index.codes), strict=True
    ):
        raw = np.ascontiguousarray(arr, dtype=np.dtype(dtype)).tobytes()
        parts.append(raw + b"\0" * (-len(raw) % _ALIGN))
    body = b"".join(parts)
    return body + keyed(secret, body)


def _layout(count: int) -> dict[str, list[Any]]:
    """Each section's ``[offset from the data start, bytes, dtype]`` for ``count`` shards."""
    out: dict[str, list[Any]] = {}
    at = 0
    for name, dtype, extra in (*_SECTIONS, _CODES):
        size = (count + extra) * np.dtype(dtype).itemsize
        out[name] = [at, size, dtype]
        at += size + (-size % _ALIGN)
    return out


class _Invalid(Exception):
    """An index file that fails a check (the message says which)."""


def _load_warning(
    path: str,
    inputs: dict[str, Any],
    count: int,
    secret: bytes,
    reported: set[str],
    trusted: Sequence[list[int] | None] = (),
) -> WindowIndex | None:
    """The index file ``path`` checked for ``inputs`` and ``count`` shards; None where there
    is none or it fails a check (each failure reported once, a `RuntimeWarning`). The digest
    is not re-checked when the open file's identity is one of ``trusted``."""
    try:
        file = OpenFile(path)
    except (FileNotFoundError, NotADirectoryError):
        return None
    except OSError as exc:
        problem = f"unreadable ({exc})"
    else:
        try:
            return _checked(file, inputs, count, secret, trusted)
        except BaseException as exc:
            file.close()
            if isinstance(exc, _Invalid):
                problem = str(exc)
            elif isinstance(exc, OSError):  # shortened while read
                problem = f"unreadable ({exc})"
            else:
                raise
    if problem not in reported:
        reported.add(problem)
        warnings.warn(
            f"token windows index {path} does not match what it records (damaged, "
            f"truncated, stale or of other inputs): {problem}; rebuilding it",
            RuntimeWarning,
            stacklevel=4,
        )
    return None


def _checked(
    file: OpenFile,
    inputs: dict[str, Any],
    count: int,
    secret: bytes,
    trusted: Sequence[list[int] | None],
) -> WindowIndex:
    """`_load_warning` of the open ``file``: `_Invalid` naming the failed check."""
    size = os.fstat(file.fd).st_size
    if size < _HEAD + _DIGEST:
        raise _Invalid(f"{size} bytes is too short for a header")
    head = file.pread(0, _HEAD)
    if head[:8] != MAGIC:
        raise _Invalid(f"magic {head[:8]!r}, expected {MAGIC!r}")
    hlen = int.from_bytes(head[8:_HEAD], "little")
    if hlen > MAX_HEADER or _HEAD + hlen + _DIGEST > size:
        raise _Invalid(f"header length {hlen} does not fit the file ({size} bytes)")
    header = _header(file.pread(_HEAD, hlen))
    if header.get("inputs") != inputs:
        raise _Invalid(f"made for {header.get('inputs')}, not {inputs}")
    if header["count"] != count:
        raise _Invalid(f"{header['count']} shards, the manifest has {count}")
    layout = _layout(count)
    if header.get("sections") != layout:
        raise _Invalid(f"sections {header.get('sections')}, expected {layout}")
    data_at = _HEAD + hlen + (-(_HEAD + hlen) % _ALIGN)
    end = data_at + layout["codes"][0] + layout["codes"][1]
    end += -end % _ALIGN
    if size != end + _DIGEST:
        raise _Invalid(f"{size} bytes, the header describes {end + _DIGEST} (truncated?)")
    if file.identity not in trusted and not hmac.compare_digest(
        _digest(file, end, secret), file.pread(end, _DIGEST)
    ):
        raise _Invalid("its bytes do not match its digest (damaged)")
    starts, offsets, sizes, codes = (
        FileColumn(file, data_at + layout[nm][0], layout[nm][1] // np.dtype(dt).itemsize, dt)
        for nm, dt, _ in (*_SECTIONS, _CODES)
    )
    if int(starts[0]) != 0 or int(starts[-1]) != header["windows"]:
        raise _Invalid(
            f"window starts run from {int(starts[0])} to {int(starts[-1])}, the header says "
            f"0 to {header['windows']}"
        )
    dtypes, used = tuple(header["dtypes"]), tuple(header["used"])
    return WindowIndex(starts, offsets, sizes, codes, dtypes, used, path=file.path)


def _header(raw: bytes) -> dict[str, Any]:
    """The parsed header, its fields' types checked; `_Invalid` otherwise."""
    try:
        header = json.loads(raw)
    except ValueError as exc:
        raise _Invalid(f"malformed header ({exc})") from None
    if not isinstance(header, dict) or header.get("kind") != KIND:
        raise _Invalid("not a token windows index")
    if header.get("version") != VERSION:
        raise _Invalid(f"version {header.get('version')!r}, this detdata writes {VERSION}")
    for key in ("count", "windows"):
        if not isinstance(header.get(key), int) or header[key] < 0:
            raise _Invalid(f"header field {key!r} must be a non-negative integer")
    dtypes, used = header.get("dtypes"), header.get("used")
    if not isinstance(dtypes, list) or not all(d in TOKEN_DTYPES for d in dtypes):
        raise _Invalid(f"dtypes {dtypes!r} are not token dtypes")
    if (
        not isinstance(used, list)
        or not used
        or not all(isinstance(c, int) and 0 <= c < len(dtypes) for c in used)
        or used != sorted(set(used))
    ):
        raise _Invalid(f"dtype codes in use {used!r} are not distinct codes of {dtypes!r}")
    return header


def _digest(file: OpenFile, end: int, secret: bytes) -> bytes:
    """The keyed blake3 of the file's first ``end`` bytes, read `HASH_PIECE` at a time."""
    hasher = blake3.blake3(key=secret)
    buf = bytearray(HASH_PIECE)
    with memoryview(buf) as view:
        at = 0
        while at < end:
            got = os.preadv(file.fd, [view[: min(HASH_PIECE, end - at)]], at)
            if not got:
                raise _Invalid(f"ends at byte {at}, before {end} (truncated while read)")
            hasher.update(view[:got])
            at += got
    return hasher.digest()
