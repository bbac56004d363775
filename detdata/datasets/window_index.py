"""`TokenWindows`' per-shard index: built once per job, read by every rank.

Contract: docs/design.md section 8 ("Start-up at scale").

What a `TokenWindows` needs of every shard (`WindowIndex`): the cumulative window counts
(``starts``, ``count + 1`` int64: window ids ``[starts[s], starts[s + 1])`` are shard
``s``'s), the byte offset of its tokens, its size in bytes and its dtype code. Making it
(`build_window_index`) reads the manifest's columns whole and runs the open-time checks
(every shard a token shard whose size its dtype and sample count explain; none too short
for a window unless ``allow_short_shards``): O(shards) CPU and memory, ~26 MB at 1M shards.

Built once, read by every rank. For a manifest in the mapped fast form
(`detdata.identity.columns`) with receipts on, the index is a file in the receipts folder
(``DETDATA_RECEIPTS``, per machine): ``<name>.windows``, ``name`` the blake3 of its inputs
(`window_inputs`: the manifest id, the columns file's header digest, ``seq_len``,
``labels``, ``allow_short_shards`` and this layout's version) and of the public id of the
key it is written under (`detdata.identity.local_key`: each user's files their own). A
rank that finds it maps it (`load_window_index`); otherwise one process builds and writes
it while the others wait:
under a ``torch.distributed`` group the rank that claims it first among those of the
node opening it under the same root (`detdata.identity.receipts.job_meeting`; the others
wait for it through the group's store, as for a verdict), else whichever process takes
the file's lock first (the others find the file once they hold the lock). Other
manifests, manifests of fewer than `STORE_MIN_SHARDS` shards, ``DETDATA_RECEIPTS=off``,
or no usable key: the index is built in memory in every process.

Layout (little-endian)::

    magic "DDWINDX1"  u64 header length  header (canonical JSON)  zero padding to 64
    sections: starts <i8 (count + 1)  offsets <i8  sizes <i8  codes <i2 (each 64-aligned)
    keyed blake3 of every byte above (32 bytes; the key: this user's, `local_key`)

Checked in full, once: the trailing keyed blake3 over every byte (read a MiB at a time into one
buffer), the header's inputs equal to the dataset's, its sections exactly where a header
for that many shards puts them, ``starts[0] == 0``, ``starts[-1]`` the header's window
count, the dtypes token dtypes and the codes in use among them. A file failing any of
these (damaged, truncated, stale, of other inputs) is reported with a `RuntimeWarning`
naming it and what differs, and rebuilt. It is replaced atomically, never rewritten in
place: the descriptor a rank holds keeps reading the file it checked.

Who checks it in full: the leader (or, without a group, the process holding the lock),
when it builds or opens the file. It publishes the identity of the file it checked
(``[size, mtime_ns, ctime_ns, inode, device]``, taken at its open, before any byte was
read) in the store; a rank whose open file has that identity, or the one its note keeps,
runs every check but the digest. The ``.checked`` note next to the file
(`write_checked_note`) keeps the identity of the last full check for the next job, with a
tag (`note_tag`: keyed blake3 of the file's name and that identity) that only the holder
of this user's key can make; a note without a valid tag is ignored. Neither
is written or published for a file changed less than `detdata.identity.receipts.RACY_S`
before its identity was taken, as for a receipt (a write in the same timestamp tick would
not show), except the builder's own write. While the file keeps it, the digest is not
recomputed. What that trusts is what a
receipt trusts for a shard: a write through the file system moves the change time (even
with the mtime set back), a replacement the inode; bytes changed without either (the
block device written directly, bit rot) are not seen until a full check.

Not mapped: a rank reads the sections through `detdata.storage.file_column.FileColumn`
(``pread`` of 4 KiB blocks, a binary search through every 512th start kept in memory). A
page-cache fault on a mapping maps the whole large folio around it (up to 2 MiB here): a
rank that searched and looked up a handful of shards through a mapping of a 1M-shard index
held ~20 MB of it resident after one batch.

Trust model. The file is detdata's own output, computed from the checked columns by this
user's process; the check does not recompute it from its inputs. What makes it trusted is
the key: an index's digest and a note's tag are keyed under 32 secret bytes only this user
can read (`detdata.identity.local_key`: a 0600 file of this user's, refused otherwise).
Whoever can write the receipts folder (or the index and its note) but cannot read the key
(another user of a shared folder) cannot make a file or a note that is trusted: an index
edited in place with a note for its new ``stat`` identity, or rewritten with a valid
unkeyed digest, fails the full check, is named and rebuilt. A ``stat`` alone, or the bytes
of the index, are not enough to forge a note: the tag needs the key. What is not
protected: this user (and root), who can read the key and edit detdata itself; and, as
for a receipt, bytes changed without changing the file's identity (above).
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
    """Per shard of a token manifest (in manifest order): ``starts`` (cumulative windows,
    ``count + 1``), ``offsets`` (byte offset of its tokens), ``sizes`` (bytes) and
    ``codes`` (index into ``dtypes``); ``used``: the codes some shard has. Read-only:
    arrays built in this process (``path`` None), or `FileColumn` s over the file
    ``path``."""

    starts: IntColumn
    offsets: IntColumn
    sizes: IntColumn
    codes: npt.NDArray[np.int16] | FileColumn
    dtypes: tuple[str, ...]
    used: tuple[int, ...]
    path: str | None = None

    @property
    def windows(self) -> int:
        """Windows over all shards."""
        return int(self.starts[-1])


# ------------------------------------------------------------------------ building
def build_window_index(
    manifest: Manifest, seq_len: int, labels: bool, allow_short: bool
) -> WindowIndex:
    """The index of ``manifest`` for windows of ``seq_len`` (+1 with ``labels``), from its
    columns (vectorised; an entry is built only for a culprit). `FormatError` naming the
    first shard that is not a token shard of a consistent size (`check_token_shard`), or,
    unless ``allow_short``, the first too short for one window (`short_shard_error`)."""
    dtypes, codes = _check_token_shards(manifest)
    tokens = manifest.samples_per_shard()
    counts = np.maximum(0, (tokens - int(labels)) // seq_len)
    if not allow_short:
        short = np.flatnonzero(counts == 0)
        if short.size:
            raise short_shard_error(manifest.shards[int(short[0])], seq_len, labels)
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
    return WindowIndex(*arrays, dtypes=dtypes, used=distinct_codes(codes))


def distinct_codes(code: npt.NDArray[Any]) -> tuple[int, ...]:
    """The distinct values of ``code`` (non-negative dtype codes), ascending: `np.unique`'s
    answer without its first-call import of ``numpy.ma`` (~20 ms of a small corpus's open)."""
    return tuple(np.flatnonzero(np.bincount(code)).tolist()) if code.size else ()


def _check_token_shards(manifest: Manifest) -> tuple[tuple[str, ...], npt.NDArray[Any]]:
    """``(dtypes, codes)``: the manifest's dtype names and each shard's index into them;
    `FormatError` naming the first shard that is not a token shard with a consistent size
    (`check_token_shard`). Vectorised over the manifest's columns."""
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


def short_shard_error(shard: ShardEntry, seq_len: int, labels: bool) -> FormatError:
    """The error for a shard too short for one window."""
    return FormatError(
        f"shard {shard.path}: {shard.num_samples} tokens is too short for one window of "
        f"seq_len={seq_len} (needs {seq_len + int(labels)} tokens with "
        f"labels={labels}); hint: pass allow_short_shards=True to skip "
        "such shards, or use a smaller seq_len"
    )


# ------------------------------------------------------------------ built once, mapped
def window_inputs(
    manifest: Manifest, seq_len: int, labels: bool, allow_short: bool
) -> dict[str, Any]:
    """What the index of a fast-form ``manifest`` is a function of (its file's tie)."""
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
    job where it is missing or fails its checks (see the module docstring), or built in
    memory (a manifest not in the fast form, receipts off, or no usable key:
    `detdata.identity.local_key`). ``meet=False`` (a dataset unpickled in a worker
    process, which must not use the parent's process group): no meeting through the
    group, the file's lock only."""
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
    """Write ``built`` to ``path`` and open it: ``(the index read from the file, its noted
    identity)``, or ``(None, None)`` where it cannot be stored (every process builds its
    own)."""
    try:
        atomic_write_bytes(path, encode_window_index(built, inputs, secret))
        st = os.stat(path)
    except OSError:
        return None, None
    # its own write, renamed into place: its digest is of bytes this process made, not
    # read again (as a cache fill's copy, hashed while written)
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
    """The identity the index file ``path`` had when this user's process last checked it
    in full (its ``.checked`` note, its tag made under ``secret``); None without a readable
    note or with one whose tag is not (`note_tag`: a note only the key's holder makes)."""
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
    """The tag of a note saying the index file named like ``path`` had ``identity`` when
    checked in full: a keyed blake3 under ``secret`` (hex)."""
    signed = canonical_json([KIND + "/checked", os.path.basename(path), identity])
    return keyed(secret, signed).hex()


def write_checked_note(
    index: WindowIndex, secret: bytes, *, own_write: bool = False
) -> list[int] | None:
    """Note the identity of the file ``index`` was read from (taken at its open, before
    its bytes were read and checked), tagged under ``secret``: the identity a later open
    may trust, returned for the leader to publish. None (no note, nothing published) for
    an index built in memory, or for a file changed less than
    `detdata.identity.receipts.RACY_S` before that identity was taken (a write within the
    same timestamp tick, or a server clock ahead of this one, would not show: the next
    open checks it in full, then notes it), unless ``own_write``: this process has just
    written and renamed it into place (the exposure is then a write in place within the
    same tick after that, as for a cache's fill)."""
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
    """The file of ``index`` for ``inputs``, its digest keyed under ``secret`` (the layout
    of the module docstring)."""
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
    """`load_window_index`, a file that fails its checks reported (`RuntimeWarning`; a
    problem already in ``reported`` is not reported again)."""
    try:
        return load_window_index(path, inputs, count, secret, trusted)
    except _Invalid as exc:
        if str(exc) in reported:
            return None
        reported.add(str(exc))
        warnings.warn(
            f"token windows index {path} does not match what it records (damaged, "
            f"truncated, stale or of other inputs): {exc}; rebuilding it",
            RuntimeWarning,
            stacklevel=4,
        )
        return None


def load_window_index(
    path: str,
    inputs: dict[str, Any],
    count: int,
    secret: bytes,
    trusted: Sequence[list[int] | None] = (),
) -> WindowIndex | None:
    """The index file ``path`` checked for ``inputs`` and ``count`` shards (see the module
    docstring), its sections as `FileColumn` s read with ``pread``; None where there is
    none; `_Invalid` (a message naming the check) where it fails one. Its digest (every
    byte read) is not re-checked when the open file's identity is one of ``trusted``: the
    identity it had when it was checked in full (by this job's leader, or by the last
    check on this machine)."""
    try:
        file = OpenFile(path)
    except (FileNotFoundError, NotADirectoryError):
        return None
    except OSError as exc:
        raise _Invalid(f"unreadable ({exc})") from None
    try:
        return _checked(file, inputs, count, secret, trusted)
    except OSError as exc:  # shortened while read
        file.close()
        raise _Invalid(f"unreadable ({exc})") from None
    except BaseException:
        file.close()
        raise


def _checked(
    file: OpenFile,
    inputs: dict[str, Any],
    count: int,
    secret: bytes,
    trusted: Sequence[list[int] | None],
) -> WindowIndex:
    """`load_window_index` of the open ``file``."""
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
    name = _CODES[0]
    end = data_at + layout[name][0] + layout[name][1]
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
    dtypes, used = header["dtypes"], header["used"]
    return WindowIndex(
        starts=starts,
        offsets=offsets,
        sizes=sizes,
        codes=codes,
        dtypes=tuple(dtypes),
        used=tuple(used),
        path=file.path,
    )


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
    """The keyed blake3 (under ``secret``) of the file's first ``end`` bytes, read
    `HASH_PIECE` bytes at a time into one buffer (nothing mapped, nothing kept)."""
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
