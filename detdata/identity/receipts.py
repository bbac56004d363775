"""Verification once per job, and receipts that let a restart skip unchanged shards.

Contract: docs/design.md ("Verification once per job"; "Receipts: what they prove, and
what they do not"). `verify_job` is what `Manifest.verify` runs. A receipt (under
``DETDATA_RECEIPTS``, ``off`` disables them), tagged under this user's key
(`detdata.identity.local_key`), records each shard's identity: a restart reads only the
shards whose identity changed; a missing, stale or forged receipt means every shard is read.
"""

from __future__ import annotations

import contextlib
import email.utils
import functools
import hmac
import json
import os
import socket
import sys
import time
from collections.abc import Callable, Sequence
from datetime import timedelta
from typing import Any, Final, cast

import blake3
import numpy as np
import numpy.typing as npt

from detdata.base.canonical import canonical_json
from detdata.base.errors import ConfigError, DetdataError, VerificationError
from detdata.base.redact import strip_credentials
from detdata.identity import shared
from detdata.identity.columns import ShardTable
from detdata.identity.columns_tie import check_json, verify_columns_id
from detdata.identity.entry import STRENGTH, ShardEntry, ShardList, Verify
from detdata.identity.local_key import key_id, keyed, local_key
from detdata.identity.parallel import map_in_threads
from detdata.identity.shared import (
    FIELDS,
    Check,
    LocalIds,
    checked_paths,
    entries_at,
    settle,
    slice_check,
)
from detdata.identity.shared import RACY_S as RACY_S
from detdata.identity.shared import identity_digests as identity_digests
from detdata.identity.shared import local_identities as local_identities
from detdata.identity.verify import verify_manifest
from detdata.storage.atomic import atomic_write_bytes
from detdata.storage.boot import boot_id
from detdata.storage.fs import filesystem, is_local_fs, join
from detdata.storage.locks import file_lock
from detdata.storage.retry import RetryPolicy

ENV_DIR: Final = "DETDATA_RECEIPTS"
ENV_SCOPE: Final = "DETDATA_VERIFY_SCOPE"
KIND: Final = "detdata.receipt"
VERSION: Final = 2
TAG: Final = "tag"
#: shards verified per call of `verify_manifest` (their entries are in memory at once)
VERIFY_PIECE: Final = 1 << 16


def receipt_dir() -> str | None:
    """Where receipts live (None: disabled with ``DETDATA_RECEIPTS=off``)."""
    found = os.environ.get(ENV_DIR, "")
    if found.lower() == "off":
        return None
    return found or os.path.join(os.path.expanduser("~"), ".cache", "detdata", "receipts")


def receipt_path(manifest: ShardList) -> str | None:
    """The receipt file of ``manifest`` under its root, named for this user's key (None
    when receipts are disabled or there is no usable key: `detdata.identity.local_key`)."""
    folder = receipt_dir()
    if folder is None or manifest.root is None:
        return None
    secret = local_key(folder)
    if secret is None:
        return None
    name = canonical_json([manifest.id, strip_credentials(manifest.root), key_id(secret)])
    return os.path.join(folder, blake3.blake3(name).hexdigest()[:40] + ".receipt")


#: calls per (manifest, root, level) in this process: the n-th call of every rank meets
_CALLS: dict[str, int] = {}


def verify_job(
    manifest: ShardList,
    level: Verify,
    *,
    threads: int,
    progress: bool | None,
    retry: RetryPolicy | None,
    storage_options: dict[str, Any],
    use_receipt: bool = True,
) -> None:
    """Verify ``manifest`` at ``level`` once per job; raises the verifier's error in every
    rank. ``use_receipt=False``: every shard is read (a new receipt is still written).

    Ranks meet through the group's key-value store, never a collective: a rank opening
    what the others do not claims it and does it alone; a rank that finds the work
    claimed waits for the claimant's verdict however long it takes."""

    check: Check = functools.partial(
        verify_manifest,
        manifest,
        level,
        threads=threads,
        progress=progress,
        retry=retry,
        **storage_options,
    )
    args = (manifest, level, check, threads, storage_options, use_receipt)
    store, leader, key = job_meeting(manifest, level.value, counted=True)
    if store is None:
        _vouch(manifest, verify_with_receipt(*args))
        return
    dist = sys.modules["torch.distributed"]
    rank, ranks = int(dist.get_rank()), int(dist.get_world_size())
    if leader:
        verdict: BaseException | None = DetdataError(
            "the verifying rank stopped before a verdict (interrupted); hint: restart the job"
        )

        def split(plan: shared.SlicePlan, root: str) -> LocalIds | None:
            store.set(key + "/plan", plan.to_json())
            shared.take_slices(store, key, plan, rank, slice_check(manifest, plan, root, check))
            return settle(store, key, plan, manifest)

        try:
            checked = verify_with_receipt(*args, split=split, ranks=ranks)
            store.set(key + "/columns", canonical_json(checked))
            verdict = None
        except Exception as exc:  # every rank waiting on this key raises it too
            verdict = exc
            raise
        finally:
            if not store.check([key + "/plan"]):  # nothing shared: the others only wait
                store.set(key + "/plan", shared.SlicePlan(np.zeros(0, np.int64), 1, None).to_json())
            store.set(key + "/verdict", shared.dumps_verdict(verdict))
        _vouch(manifest, checked)
        return
    store.wait([key + "/plan"], timedelta(days=7))
    plan = shared.SlicePlan.from_json(store.get(key + "/plan"))
    if plan.slices:  # take slices of the claimant's plan with it
        if not plan.tie:  # else vouched for once the tie holds (the verdict's columns)
            _vouch(manifest, plan.columns)
        root = filesystem(manifest.root or "", **storage_options)[1] if plan.ids else ""
        shared.take_slices(store, key, plan, rank, slice_check(manifest, plan, root, check))
    store.wait([key + "/verdict"], timedelta(days=7))
    found = shared.loads_verdict(store.get(key + "/verdict"))
    if found is not None:
        raise found
    _vouch(manifest, json.loads(store.get(key + "/columns")))


def _vouch(manifest: ShardList, checked: list[Any] | None) -> None:
    """`detdata.identity.columns.ColumnsFile.vouch` of a fast-form manifest's columns."""
    if isinstance(manifest.shards, ShardTable):
        manifest.shards.columns.vouch(checked)


def job_meeting(manifest: ShardList, tag: str, *, counted: bool = False) -> tuple[Any, bool, str]:
    """``(store, is this rank the one that does it, key)`` for work ``tag`` on ``manifest``
    under its root, done once per job (a URL root, or ``DETDATA_VERIFY_SCOPE=job``) or once
    per node (a local root) under a process group of more than one rank; ``(None, True,
    "")`` otherwise. The first rank to claim the key (an atomic ``add``) does it; the others
    wait for what it publishes. ``counted``: the key is the n-th of this process for the
    same work; otherwise one key per job."""
    found = shared.group()
    if found is None:
        return None, True, ""
    store = found[0]
    scope = os.environ.get(ENV_SCOPE, "")
    if scope not in ("", "job", "node"):
        raise ConfigError(f"{ENV_SCOPE} must be 'job' or 'node', got {scope!r}")
    root = manifest.root or ""
    local = not ("://" in root and not root.startswith("file://"))
    where = "job" if scope == "job" or (scope == "" and not local) else node_key()
    keyed_root: list[Any] = [strip_credentials(root)]
    if local:  # and its folder's device and inode where they can be taken
        with contextlib.suppress(OSError):
            st = os.stat(root.removeprefix("file://") or ".")
            keyed_root += [st.st_dev, st.st_ino]
    base = canonical_json([manifest.id, keyed_root, tag, where])
    digest = blake3.blake3(base).hexdigest()[:32]
    if counted:
        count = _CALLS[digest] = _CALLS.get(digest, 0) + 1
        key = f"detdata/verify/{digest}/{count}"
    else:
        key = f"detdata/once/{digest}"
    return store, int(store.add(key + "/claim", 1)) == 1, key


def node_key() -> str:
    """This node, as the once-per-node work is keyed: its host name and boot id."""
    return f"{socket.gethostname()}/{boot_id() or ''}"


def verify_with_receipt(
    manifest: ShardList,
    level: Verify,
    check: Check,
    threads: int,
    storage_options: dict[str, Any],
    use_receipt: bool = True,
    split: Split | None = None,
    ranks: int = 1,
) -> list[Any] | None:
    """``check`` the shards whose identity changed since the receipt (all without one, or
    without ``use_receipt``), check a fast form's tie unless recorded, then write the new
    receipt. Returns `_columns_identity` (taken before the check). ``split``: checks the
    plan's shards shared with the job's ``ranks`` (`detdata.identity.shared`)."""
    if manifest.root is None:
        raise ConfigError("cannot verify a manifest without a root")
    path = receipt_path(manifest)
    # processes of one machine verify one after another (the later ones find the receipt)
    with file_lock(path + ".lock") if path is not None else contextlib.nullcontext():
        old = read_receipt(path, manifest) if path is not None and use_receipt else None
        fs, root = filesystem(manifest.root, **storage_options)
        columns = _columns_identity(manifest)
        # the id from the columns (the JSON, the readable form, is checked where parsed)
        tie = isinstance(manifest.shards, ShardTable) and (
            old is None or columns is None or old.get("columns") != columns
        )
        if not tie:  # the very file the receipt's full check read: read without its chunks
            _vouch(manifest, columns)
        else:  # the JSON's tie first: a few bytes a shard, and names the edited field
            check_json(cast(ShardTable, manifest.shards))
        now: LocalIds | list[str | None] | None = None
        local = path is None or is_local_fs(fs)
        if split is not None and local and _reads_all(old, level) and len(manifest.shards):
            todo = np.arange(len(manifest.shards), dtype=np.int64)
            ids = path is not None
            plan = shared.SlicePlan.of(todo, ranks, VERIFY_PIECE, columns, ids=ids, tie=tie)
            now = split(plan, root)  # every shard checked by the job's ranks in one pass
            if tie:
                _vouch(manifest, columns)
        else:
            if path is None:  # receipts disabled: no identities to take, every shard is read
                todo = np.arange(len(manifest.shards), dtype=np.int64)
            else:
                if is_local_fs(fs):
                    now = _local_identities_of(manifest, root, checked=not tie)
                else:
                    paths = checked_paths(manifest.shards, 0, len(manifest.shards), not tie)
                    now = remote_identities(fs, root, paths, threads)
                todo = _changed(old, now, level)
            if split is not None and todo.size:  # shared with the job's ranks
                if tie:
                    verify_columns_id(cast(ShardTable, manifest.shards))
                    _vouch(manifest, columns)
                split(shared.SlicePlan.of(todo, ranks, VERIFY_PIECE, columns), root)
            elif tie:
                _tie_and_verify(manifest, todo, check)
            else:  # `VERIFY_PIECE` at a time; the first failure in path order, at the end
                pieces = range(0, todo.size, VERIFY_PIECE)
                _raise_first(
                    [check(entries_at(manifest, todo[lo : lo + VERIFY_PIECE])) for lo in pieces]
                )
        if path is None or now is None:
            return columns
        # nothing read again: the recorded level still holds for every shard
        if old is not None and not todo.size and old.get("columns") == columns:
            return columns  # the receipt on disk already says this: a restart writes nothing
        kept = level if todo.size or old is None else Verify(old["level"])
        write_receipt(path, manifest, kept, columns, now)
        return columns


Split = Callable[[shared.SlicePlan, str], "LocalIds | None"]


def _reads_all(old: dict[str, Any] | None, level: Verify) -> bool:
    """Whether every shard is read whatever the files' identities (`_changed`)."""
    return old is None or STRENGTH[Verify(old["level"])] < STRENGTH[level]


def _tie_and_verify(manifest: ShardList, todo: npt.NDArray[np.int64], check: Check) -> None:
    """A fast form's full tie (`verify_columns_id`) and the check of the shards ``todo``
    in one pass over the columns (each entry decoded once). A failed tie is the error;
    else the first shard failure in path order."""
    wanted = np.zeros(len(manifest.shards), dtype=bool)
    wanted[todo] = True
    batch: list[ShardEntry] = []
    found: list[VerificationError | None] = []
    failed: list[Exception] = []  # not a verdict on a shard (an I/O error): the first, kept

    def flush() -> None:
        if not failed:  # after a failure, no more shards are read
            try:
                found.append(check(batch))
            except Exception as exc:  # raised only once the tie holds (else the tie's error)
                failed.append(exc)
        batch.clear()

    def piece(lo: int, entries: Sequence[ShardEntry]) -> None:
        batch.extend(e for e, w in zip(entries, wanted[lo : lo + len(entries)], strict=True) if w)
        if len(batch) >= VERIFY_PIECE:
            flush()

    assert isinstance(manifest.shards, ShardTable)
    verify_columns_id(manifest.shards, each=piece)
    if batch:
        flush()
    if failed:
        raise failed[0]
    _raise_first(found)


def _raise_first(found: Sequence[VerificationError | None]) -> None:
    first = next((exc for exc in found if exc is not None), None)
    if first is not None:
        raise first


def _local_identities_of(manifest: ShardList, root: str, *, checked: bool) -> LocalIds:
    """`local_identities` of every shard, the paths decoded `VERIFY_PIECE` at a time.
    ``checked``: the fast form's paths were checked in full before (else each is checked
    here: the tie comes after)."""
    shards = manifest.shards
    out = np.empty((len(shards), FIELDS), dtype=np.int64)
    for lo in range(0, len(shards), VERIFY_PIECE):
        hi = min(len(shards), lo + VERIFY_PIECE)
        out[lo:hi] = local_identities(root, checked_paths(shards, lo, hi, checked))
    return out


def _changed(
    old: dict[str, Any] | None, now: LocalIds | list[str | None], level: Verify
) -> npt.NDArray[np.int64]:
    """Indices of the shards to read: all where `_reads_all`, else those whose identity
    now differs from the recorded one or is not recorded."""
    count = len(now)
    if old is None or _reads_all(old, level):
        return np.arange(count, dtype=np.int64)
    before = old["identities"]
    if isinstance(now, np.ndarray):
        if not isinstance(before, np.ndarray) or before.shape != (count,):
            return np.arange(count, dtype=np.int64)
        same = (before == identity_digests(now)) & (before != 0)
        return np.flatnonzero(~same).astype(np.int64)
    if not isinstance(before, list) or len(before) != count:
        return np.arange(count, dtype=np.int64)
    return np.array(
        [i for i, (a, b) in enumerate(zip(before, now, strict=True)) if a is None or a != b],
        dtype=np.int64,
    )


def remote_identities(fs: Any, root: str, paths: Sequence[str], threads: int) -> list[str | None]:
    """Per shard, the store's identity of the object (ETag / generation / version id; for
    HTTP the ETag with Last-Modified), or None where there is none to record."""
    found: dict[str, dict[str, Any]] = {}
    protocol = fs.protocol if isinstance(fs.protocol, str) else fs.protocol[0]
    if protocol in ("s3", "s3a", "gs", "gcs"):
        with contextlib.suppress(Exception):  # no listing: asked object by object below
            fs.invalidate_cache(root)
            listed = fs.find(root, detail=True)
            found = {str(k).rstrip("/"): v for k, v in listed.items()}

    def one(rel: str) -> str | None:
        key = join(root, rel)
        info = found.get(key.split("://", 1)[-1]) or found.get(key)
        if info is None:
            try:
                info = fs.info(key)
            except Exception:
                return None  # missing or unreachable: read (and reported) by the check
        return _remote_identity(info)

    return map_in_threads(one, paths, threads=threads, progress=False)


def _remote_identity(info: dict[str, Any]) -> str | None:
    lowered = {str(k).lower(): v for k, v in info.items()}
    size = lowered.get("size")
    for key in ("generation", "versionid", "version_id"):
        if lowered.get(key):
            return f"{key}={lowered[key]};size={size}"
    etag = lowered.get("etag")
    if not etag or str(etag).startswith("W/"):
        return None
    modified = lowered.get("last-modified")
    if isinstance(modified, str):  # HTTP: a validator only once the second it names is old
        try:
            when = email.utils.parsedate_to_datetime(modified).timestamp()
        except (TypeError, ValueError):
            return None
        if when >= time.time() - RACY_S - 1.0:
            return None
        return f"etag={etag};modified={modified};size={size}"
    return f"etag={etag};size={size}"


def _columns_identity(manifest: ShardList) -> list[Any] | None:
    """What a fast-form manifest's full check covers: its header digest, the identity of
    the columns file it has open (``fstat`` at its open) and the JSON's (None: not a fast
    form, or changed within `RACY_S` of the identity being taken)."""
    shards = manifest.shards
    if not isinstance(shards, ShardTable):
        return None
    racy_ns = int(RACY_S * 1e9)
    columns = shards.columns
    _, mtime, ctime, _, _ = columns.identity
    if columns.seen_ns - max(mtime, ctime) < racy_ns:
        return None
    files: list[Any] = [columns.header_digest, list(columns.identity)]
    if shards.json_path is None:
        return [*files, None]
    st = os.stat(shards.json_path)
    if time.time_ns() - max(st.st_mtime_ns, st.st_ctime_ns) < racy_ns:
        return None
    return [*files, [st.st_size, st.st_mtime_ns, st.st_ctime_ns, st.st_ino, st.st_dev]]


def read_receipt(path: str, manifest: ShardList) -> dict[str, Any] | None:
    """The receipt at ``path`` for ``manifest`` (same id, root, shard count, and a tag made
    under this user's key), else None (every shard is read)."""
    secret = local_key(os.path.dirname(path))
    try:
        with open(path, "rb") as fh:
            raw = fh.read()
        head, _, body = raw.partition(b"\n")
        doc = json.loads(head)
        if not isinstance(doc, dict) or not isinstance(doc.get(TAG), str) or secret is None:
            return None
        tag = doc.pop(TAG)
        if (
            not hmac.compare_digest(tag, _tag(secret, doc, body))
            or doc.get("kind") != KIND
            or doc.get("version") != VERSION
            or doc.get("manifest") != manifest.id
            or doc.get("root") != strip_credentials(manifest.root or "")
            or doc.get("count") != len(manifest.shards)
            or doc.get("level") not in ("quick", "full")
        ):
            return None
        if doc.get("local"):
            doc["identities"] = np.frombuffer(body, dtype="<u8").astype(np.uint64)
        else:
            doc["identities"] = json.loads(body)
        return cast(dict[str, Any], doc)
    except (OSError, ValueError):
        return None


def _tag(secret: bytes, head: dict[str, Any], body: bytes) -> str:
    """A receipt's tag: keyed blake3 of its head without the tag, and its body (hex)."""
    return keyed(secret, canonical_json(head) + b"\n" + body).hex()


def write_receipt(
    path: str,
    manifest: ShardList,
    level: Verify,
    columns: list[Any] | None,
    identities: LocalIds | list[str | None],
) -> None:
    """Write the receipt (atomically), tagged under this user's key; left out where it
    cannot be written."""
    secret = local_key(os.path.dirname(path))
    if secret is None:
        return
    local = isinstance(identities, np.ndarray)
    if isinstance(identities, np.ndarray):
        body = identity_digests(identities).astype("<u8").tobytes()
    else:
        body = canonical_json(identities)
    head: dict[str, Any] = {
        "kind": KIND,
        "version": VERSION,
        "manifest": manifest.id,
        "root": strip_credentials(manifest.root or ""),
        "count": len(manifest.shards),
        "level": level.value,
        "columns": columns,
        "local": local,
    }
    head[TAG] = _tag(secret, head, body)
    with contextlib.suppress(OSError):
        atomic_write_bytes(path, canonical_json(head) + b"\n" + body)
