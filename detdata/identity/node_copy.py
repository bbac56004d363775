"""One manifest read per node: docs/design.md ("One manifest read per node") says how the
ranks of a node meet, copy and check. A wrong guess costs a read, never a wrong byte; a
reader's error is raised on every rank of the node. Without a group, with one rank, or
``LOCAL_WORLD_SIZE=1``, nothing is met or copied.
"""

from __future__ import annotations

import contextlib
import json
import mmap
import os
import re
import stat
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Final

import blake3

from detdata.base.canonical import canonical_json
from detdata.base.errors import DetdataError
from detdata.base.redact import get_logger, redact_text, redact_url, strip_credentials
from detdata.identity import shared
from detdata.identity.receipts import node_key
from detdata.storage.atomic import atomic_write_bytes
from detdata.storage.cache_folder import make_layout, owned_alone, user_cache_dir
from detdata.storage.fs import is_url

#: the cache folder's sub-folder holding the node copies of manifests
FOLDER: Final = "manifests"
_HEX: Final = re.compile(r"[0-9a-f]{64}")
_ROLE: Final = "the rank that read the manifest for this node"
log: Final = get_logger("detdata.manifest")
#: loads of each path in this process: the n-th load of every rank of a node meets
_CALLS: dict[str, int] = {}
_LOGGED: set[str] = set()

#: the kinds a copy holds together, each a file: the JSON, or a fast form's columns and
#: the JSON's head (the fields before its shards)
_SHAPES: Final = ({"json"}, {"head", "columns"})
#: the kinds a rank takes as bytes (the columns are opened by path: `ColumnsFile`)
_AS_BYTES: Final = ("json", "head")
#: reads the manifest from its path: kind -> bytes
Reader = Callable[[], dict[str, bytes]]


@dataclass(frozen=True)
class NodeSource:
    """The node copy of a manifest: the ``path`` of each kind's file and the bytes of the
    small ones (``json``, ``head``), checked against the digests the reader published."""

    path: dict[str, str]
    data: dict[str, bytes]


def node_source(path: str, read: Reader) -> NodeSource | None:
    """The node copy of the manifest at ``path``: read with ``read`` and copied when this
    rank is the node's reader, else mapped from the reader's copy. None: the caller reads
    ``path`` itself (with a warning where the reader published nothing within the store's
    timeout). The reader's error is raised on every rank of the node."""
    meeting = _meeting(path)
    if meeting is None:
        return None
    store, rank, key, reader = meeting
    if reader:
        return _read_and_share(store, key, rank, read)
    bound: timedelta = store.timeout
    try:
        store.wait([key + "/verdict"], bound)
    except RuntimeError as exc:  # torch's DistStoreError: a timeout, a store gone
        warnings.warn(
            redact_text(
                f"manifest {redact_url(path)}: the rank reading it for this node published "
                f"nothing within {bound.total_seconds():g} s (the process group store's "
                f"timeout; {type(exc).__name__}); reading the manifest itself instead"
            ),
            stacklevel=3,
        )
        return None
    found = shared.loads_verdict(store.get(key + "/verdict"))
    if found is not None:
        raise found
    try:
        digests = json.loads(store.get(key + "/copy"))
    except ValueError:  # not what a reader sends: read the manifest yourself
        return None
    return _map_copy(digests, path)


def _meeting(path: str) -> tuple[Any, int, str, bool] | None:
    """``(store, rank, key, is this rank the reader)`` of this load of ``path`` on this
    node, or None (nothing to meet)."""
    group = shared.group()
    if group is None or os.environ.get("LOCAL_WORLD_SIZE", "") == "1":
        return None
    store, rank = group
    local = local_path(path)
    where: list[Any] = [strip_credentials(path)]
    if local is not None:
        where = [os.path.abspath(local)]
        with contextlib.suppress(OSError):
            st = os.stat(local)
            where += [st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns]
    digest = blake3.blake3(canonical_json([where, node_key()])).hexdigest()[:32]
    count = _CALLS[digest] = _CALLS.get(digest, 0) + 1
    key = f"detdata/manifest/{digest}/{count}"
    return store, rank, key, int(store.add(key + "/claim", 1)) == 1


def _read_and_share(store: Any, key: str, rank: int, read: Reader) -> NodeSource | None:
    """Read the manifest, copy it for the node, publish the copies' digests (or the
    error, which is raised here too)."""
    verdict: BaseException | None = DetdataError(
        "the rank reading the manifest for this node stopped before it was read "
        "(interrupted); hint: restart the job"
    )
    digests: dict[str, str] | None = None
    try:
        files = read()
        digests, paths = _write_copy(files)
        verdict = None
    except Exception as exc:  # every rank of the node waiting on this key raises it too
        verdict = exc
        raise
    finally:
        store.set(key + "/copy", canonical_json(digests))
        store.set(key + "/verdict", shared.dumps_verdict(verdict, found_by=rank, role=_ROLE))
    if digests is None:
        return None
    return NodeSource(paths, {k: v for k, v in files.items() if k in _AS_BYTES})


def _write_copy(files: dict[str, bytes]) -> tuple[dict[str, str] | None, dict[str, str]]:
    """Write the node copy's files atomically; ``(their digests, their paths)``, or
    ``(None, {})`` (logged) where they cannot be written."""
    folder = copy_folder()
    if folder is None:
        return None, {}
    digests = {kind: blake3.blake3(data).hexdigest() for kind, data in files.items()}
    paths = _copy_paths(digests, folder)
    try:
        for kind, data in sorted(files.items()):
            with contextlib.suppress(FileNotFoundError):
                mode = os.lstat(paths[kind]).st_mode
                if not stat.S_ISREG(mode) and not stat.S_ISDIR(mode):
                    os.unlink(paths[kind])  # a link or a pipe is never written through
            with contextlib.suppress(OSError, ValueError):
                if _file_digest(paths[kind])[0] == digests[kind]:
                    continue  # a copy an earlier start made holds it: it keeps its inode
            atomic_write_bytes(paths[kind], data)
    except (OSError, DetdataError) as exc:
        _log_once(folder, f"cannot write the node copy of a manifest there ({exc})")
        return None, {}
    return digests, paths


def _file_digest(path: str, keep: bool = False) -> tuple[str, bytes]:
    """blake3 of the file at ``path``, hashed through a mapping, and its bytes where
    ``keep`` (else b""); `OSError` unless a regular file, not a link (a pipe is opened
    without waiting for a writer), `ValueError` when empty."""
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise OSError(f"{path} is not a regular file")
    with os.fdopen(fd, "rb") as fh, mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ) as mm:
        return blake3.blake3(mm).hexdigest(), bytes(mm) if keep else b""


def _map_copy(digests: object, path: str) -> NodeSource | None:
    """The reader's node copy, mapped and checked against the digests it published; None
    (and a warning naming the copy, both digests and the manifest) where it is missing,
    torn or other bytes."""
    if not isinstance(digests, dict) or set(digests) not in _SHAPES:
        return None  # the reader made no copy (or sent something else): read it yourself
    if not all(isinstance(d, str) and _HEX.fullmatch(d) for d in digests.values()):
        return None
    folder = copy_folder()
    if folder is None:
        return None
    paths = _copy_paths(digests, folder)
    data: dict[str, bytes] = {}
    for kind, want in sorted(digests.items()):
        try:  # mapped, not read; the columns' bytes are not kept
            found, data[kind] = _file_digest(paths[kind], keep=kind in _AS_BYTES)
        except (OSError, ValueError) as exc:  # missing, or empty (no map of 0 bytes)
            found = f"unreadable ({type(exc).__name__}: {exc})"
        if found != want:
            warnings.warn(
                redact_text(
                    f"node copy {paths[kind]} of manifest {redact_url(path)} refused: blake3 "
                    f"{found}, but the rank that read the manifest for this node published "
                    f"{want} (a torn or changed copy, or another cache folder); reading the "
                    "manifest itself instead"
                ),
                stacklevel=3,
            )
            return None
    return NodeSource(paths, {k: v for k, v in data.items() if k in _AS_BYTES})


def copy_folder() -> str | None:
    """The folder of node copies (``manifests/`` of the default cache folder), made when
    missing; None (logged once) unless it and the cache folder are this user's alone."""
    cache = user_cache_dir()
    folder = os.path.join(cache, FOLDER)
    try:
        make_layout(cache)
        with contextlib.suppress(FileExistsError):
            os.mkdir(folder, 0o700)
        found = [os.lstat(cache), os.lstat(folder)]
    except OSError as exc:
        _log_once(cache, f"it cannot be made ({exc})")
        return None
    if all(stat.S_ISDIR(st.st_mode) and owned_alone(st) for st in found):
        return folder
    _log_once(cache, "it or its manifests/ is not a folder only this user can write")
    return None


def _copy_paths(digests: dict[str, str], folder: str) -> dict[str, str]:
    """Each kind's file of the copy in ``folder``: ``<name>.<kind>``, the name the blake3
    of every file's digest (never a path sent by a peer)."""
    name = blake3.blake3(canonical_json(digests)).hexdigest()[:40]
    return {kind: os.path.join(folder, f"{name}.{kind}") for kind in digests}


def local_path(path: str) -> str | None:
    """The local filesystem path for ``path`` / ``file://`` URLs, else None."""
    if path.startswith("file://"):
        return path[len("file://") :]
    return None if is_url(path) else path


def _log_once(folder: str, why: str) -> None:
    if folder not in _LOGGED:
        _LOGGED.add(folder)
        log.warning(
            "detdata: no node copy of manifests in the cache folder %s: %s; each rank reads "
            "the manifest itself",
            folder,
            why,
        )
