"""Content-addressed index files (a document table, a packing index): arrays that are a pure
function of their inputs, built once and stored under ``index_dir`` as ``NAME-<key>.npy`` +
``NAME-<key>.json`` (``key``: blake3 of the inputs' canonical JSON; the record holds the
inputs, small metadata and the ``.npy``'s blake3, written last, atomically). Nothing stored
is trusted (`load_index`; docs/design.md "Documents and packing"). Loaded arrays are
read-only memory maps.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import tempfile
import warnings
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any, Final

import blake3
import numpy as np

from detdata.base.canonical import canonical_json
from detdata.base.errors import StorageError, VerificationError
from detdata.base.hashing import digest_bytes
from detdata.storage.atomic import atomic_write_bytes
from detdata.storage.digest import full_digest_path
from detdata.storage.locks import file_lock

#: Version of the index-file layout (``.npy`` + ``.json``).
LAYOUT: Final = "detdata.index-v1"


def _paths(index_dir: str, name: str, inputs: Mapping[str, Any]) -> tuple[str, str]:
    """The index files of ``inputs``, named by the hex blake3 of their canonical JSON."""
    key = blake3.blake3(canonical_json(dict(inputs))).hexdigest()
    stem = os.path.join(os.fspath(index_dir), f"{name}-{key}")
    return stem + ".npy", stem + ".json"


#: The keys of an index record, exactly (any other key is an edit: the record is rebuilt).
RECORD_KEYS: Final = frozenset({"layout", "inputs", "digest", "meta"})

#: ``check(array, meta)``: a description of the first field that is not what the owner
#: recomputes from its independent inputs (``"meta.windows: expected 12, found 9"``), or
#: None when the array and every metadata field are right.
Check = Callable[[np.ndarray[Any, Any], Mapping[str, Any]], "str | None"]


@dataclass(frozen=True)
class StoredIndex:
    """A loaded (or just written) index: the read-only array, its metadata and file digest."""

    array: np.ndarray[Any, Any]
    meta: dict[str, Any]
    digest: str | None  # None: built without an ``index_dir``


@contextlib.contextmanager
def _building(index_dir: str | None) -> Iterator[None]:
    """Hold the build lock of ``index_dir`` (a ``flock`` of the folder itself; one per folder).
    It only saves work: loads are checked in full. No lock without ``index_dir`` or where the
    folder cannot be made."""
    if index_dir is not None:
        with contextlib.suppress(OSError):
            os.makedirs(index_dir, exist_ok=True)
    if index_dir is None or not os.path.isdir(index_dir):
        yield
        return
    with file_lock(index_dir):
        yield


def load_or_build(
    index_dir: str | None,
    name: str,
    inputs: Mapping[str, Any],
    check: Check,
    build: Callable[[], tuple[np.ndarray[Any, Any], Mapping[str, Any]]],
) -> StoredIndex:
    """The stored index of ``inputs`` (`load_index`), else ``build()``'s ``(array, meta)``,
    saved by one process of those opening it at once: each loads again under the folder's
    build lock first (``digest`` None without ``index_dir``)."""
    stored = load_index(index_dir, name, inputs, check)
    if stored is not None:
        return stored
    with _building(index_dir):
        stored = load_index(index_dir, name, inputs, check)
        if stored is None:
            array, meta = build()
            digest = save_index(index_dir, name, inputs, array, meta)
            stored = StoredIndex(array, dict(meta), digest)
    return stored


def load_index(
    index_dir: str | None,
    name: str,
    inputs: Mapping[str, Any],
    check: Check,
    *,
    digest: str | None = None,
) -> StoredIndex | None:
    """The stored index of ``inputs``, or None: absent, or (with a `RuntimeWarning` naming
    the file and field) not valid: the record must have exactly `RECORD_KEYS`, this layout
    and these inputs, the ``.npy`` hash to its digest (and to ``digest`` if given: a worker
    re-loading what its parent checked), and ``check`` must pass."""
    if index_dir is None:
        return None
    npy, meta_path = _paths(index_dir, name, inputs)
    try:
        with open(meta_path, "rb") as fh:
            doc = json.loads(fh.read())
    except (FileNotFoundError, NotADirectoryError):
        return None
    except (OSError, ValueError) as exc:
        _invalid(meta_path, f"unreadable ({exc})")
        return None
    found = _checked(doc, npy, json.loads(canonical_json(dict(inputs))), check, digest)
    if isinstance(found, str):
        _invalid(meta_path, found)
        return None
    return found


def _checked(
    doc: object, npy: str, inputs: object, check: Check, digest: str | None
) -> StoredIndex | str:
    """The index of record ``doc`` (its array memory-mapped), or what is wrong with it."""
    if not isinstance(doc, dict) or set(doc) != RECORD_KEYS:
        keys = sorted(doc) if isinstance(doc, dict) else type(doc).__name__
        return f"record keys {keys}, expected {sorted(RECORD_KEYS)}"
    if doc["layout"] != LAYOUT:
        return f"layout {doc['layout']!r}, expected {LAYOUT!r}"
    if doc["inputs"] != inputs:
        return "inputs are not the ones its name is the key of"
    if not isinstance(doc["meta"], dict):
        return f"meta is a {type(doc['meta']).__name__}, expected an object"
    try:
        found = full_digest_path(npy)
    except OSError as exc:
        return f"{npy} unreadable ({exc})"
    want = doc["digest"] if digest is None else digest
    if found != want or found != doc["digest"]:
        return f"{npy} hashes to {found}, expected {want}"
    try:
        array = np.load(npy, mmap_mode="r", allow_pickle=False)
    except (OSError, ValueError) as exc:
        return f"{npy} is not a valid .npy file ({exc})"
    problem = check(array, doc["meta"])
    return StoredIndex(array, dict(doc["meta"]), found) if problem is None else problem


def _invalid(meta_path: str, problem: str) -> None:
    warnings.warn(
        f"index file {meta_path} does not match what it records (edited, truncated or from "
        f"other inputs): {problem}; rebuilding it",
        RuntimeWarning,
        stacklevel=4,
    )


def save_index(
    index_dir: str | None,
    name: str,
    inputs: Mapping[str, Any],
    array: np.ndarray[Any, Any],
    meta: Mapping[str, Any],
) -> str | None:
    """Store ``array`` (and JSON ``meta``) as the index of ``inputs``; the ``.npy``'s digest
    (None without a dir). An unwritable folder is a `StorageError` naming it, no partial
    file left behind."""
    if index_dir is None:
        return None
    npy, meta_path = _paths(index_dir, name, inputs)
    try:
        os.makedirs(os.path.dirname(npy), exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=".tmp-", suffix=".npy", dir=os.path.dirname(npy))
    except OSError as exc:
        raise _unwritable(index_dir, name, exc) from exc
    try:
        with os.fdopen(fd, "wb") as fh:
            np.save(fh, np.ascontiguousarray(array), allow_pickle=False)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, npy)
        digest = full_digest_path(npy)
        record = {
            "layout": LAYOUT,
            "inputs": json.loads(canonical_json(dict(inputs))),
            "digest": digest,
            "meta": dict(meta),
        }
        atomic_write_bytes(meta_path, canonical_json(record) + b"\n")
    except BaseException as exc:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        if isinstance(exc, OSError):
            raise _unwritable(index_dir, name, exc) from exc
        raise
    return digest


def _unwritable(index_dir: str, name: str, exc: OSError) -> StorageError:
    return StorageError(
        f"cannot write the {name} index to index_dir {index_dir}: "
        f"{exc.strerror or exc}; hint: make the folder writable (or free space), or pass "
        "index_dir=None to build the index in memory at each construction"
    )


def reload_index(
    index_dir: str | None,
    name: str,
    inputs: Mapping[str, Any],
    digest: str,
    rebuild: Callable[[], np.ndarray[Any, Any]],
) -> np.ndarray[Any, Any]:
    """In a worker: the index array the parent checked (``digest``), from ``index_dir``;
    where it is gone or changed, rebuilt with a warning, and it must hash to ``digest``
    (else a `VerificationError` naming the folder)."""
    stored = load_index(index_dir, name, inputs, lambda _a, _m: None, digest=digest)
    if stored is not None:
        return stored.array
    warnings.warn(
        f"the {name} index checked by the parent process is no longer in index_dir "
        f"{index_dir} as it was; rebuilding it in process {os.getpid()}",
        RuntimeWarning,
        stacklevel=3,
    )
    array = rebuild()
    buffer = io.BytesIO()  # hashed as `save_index` records it: its .npy serialisation
    np.save(buffer, np.ascontiguousarray(array), allow_pickle=False)
    if digest_bytes(buffer.getbuffer()) != digest:
        raise VerificationError(
            f"the {name} index rebuilt in process {os.getpid()} differs from the one the "
            f"parent process checked in index_dir {index_dir}: the inputs changed under "
            "the run; hint: keep the shards and index directory unchanged while it runs"
        )
    return array
