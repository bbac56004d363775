"""Verification shared by the job's ranks (docs/design.md, "Verification once per job"):
a plan of slices (`SlicePlan`) every rank takes from (`take_slices`, `slice_check`), a
verdict the claimant settles (`settle`) and every rank raises. Verdicts cross the store as
JSON, never pickle.
"""

from __future__ import annotations

import json
import math
import os
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Final

import numpy as np
import numpy.typing as npt

from detdata.base import errors
from detdata.base.canonical import canonical_json
from detdata.base.errors import DetdataError, VerificationError
from detdata.identity.columns import ShardTable
from detdata.identity.columns_tie import check_tie_parts, tie_part
from detdata.identity.entry import ShardEntry, ShardList
from detdata.storage.fs import check_relative_path, join

#: Slices per taking rank, about: small enough to balance ranks of different speed.
SLICES_PER_RANK: Final = 4

Indices = npt.NDArray[np.int64]


#: a plan's JSON fields; `TIE` and `IDS` also name the extras a taker publishes per slice
#: (its tie part, its files' identities)
RUNS: Final = "runs"
SIZE: Final = "size"
COLUMNS: Final = "columns"
IDS: Final = "ids"
TIE: Final = "tie"

#: what a slice's taker publishes next to its verdict: ``{key}/{name}/{slice}``
Extras = dict[str, bytes]
Check = Callable[[Sequence[ShardEntry]], VerificationError | None]


@dataclass(frozen=True)
class SlicePlan:
    """The shards to check (``todo``, ascending), ``size`` of a slice, and the fast form's
    ``columns`` identity the claimant vouched for (None: none). ``ids`` / ``tie``: each
    taker also takes its slices' file identities / part of the fast form's tie
    (`slice_check`)."""

    todo: Indices
    size: int
    columns: list[Any] | None
    ids: bool = False
    tie: bool = False

    @property
    def slices(self) -> int:
        return math.ceil(self.todo.size / self.size) if self.todo.size else 0

    def slice(self, i: int) -> Indices:
        return self.todo[i * self.size : (i + 1) * self.size]

    def to_json(self) -> bytes:
        runs: list[list[int]] = []
        for p in self.todo.tolist():
            if runs and runs[-1][0] + runs[-1][1] == p:
                runs[-1][1] += 1
            else:
                runs.append([p, 1])
        doc = {RUNS: runs, SIZE: self.size, COLUMNS: self.columns, IDS: self.ids, TIE: self.tie}
        return canonical_json(doc)

    @classmethod
    def from_json(cls, raw: bytes) -> SlicePlan:
        doc = json.loads(raw)
        parts = [np.arange(a, a + n, dtype=np.int64) for a, n in doc[RUNS]]
        todo = np.concatenate(parts) if parts else np.zeros(0, dtype=np.int64)
        return cls(todo, int(doc[SIZE]), doc[COLUMNS], bool(doc[IDS]), bool(doc[TIE]))

    @classmethod
    def of(
        cls,
        todo: Indices,
        ranks: int,
        limit: int,
        columns: list[Any] | None,
        *,
        ids: bool = False,
        tie: bool = False,
    ) -> SlicePlan:
        """A plan of slices of about ``todo / (ranks * SLICES_PER_RANK)`` shards (at most
        ``limit``)."""
        size = max(1, min(limit, math.ceil(todo.size / max(1, ranks * SLICES_PER_RANK))))
        return cls(todo, size, columns, ids, tie)


#: ``check(slice, stopped)``: a slice's verdict (None: it holds) and its extras; with
#: ``stopped`` (a failure was published) only the extras the plan needs whatever the verdict
SliceCheck = Callable[[Indices, bool], tuple[Exception | None, Extras]]


def take_slices(store: Any, key: str, plan: SlicePlan, rank: int, check: SliceCheck) -> None:
    """Take slices of ``plan`` until none is left, ``check`` each and publish its extras
    and any failure (with ``rank``). Once a failure is published, later slices (after it in
    path order) are checked ``stopped``."""
    while True:
        i = int(store.add(key + "/next", 1)) - 1
        if i >= plan.slices:
            return
        found = None
        try:
            found, extras = check(plan.slice(i), store.check([key + "/stop"]))
            for name, value in extras.items():
                store.set(f"{key}/{name}/{i}", value)
        except Exception as exc:  # an I/O error, say: the verdict, for every rank
            found = exc
        if found is not None:
            store.set(f"{key}/fail/{i}", dumps_verdict(found, found_by=rank))
            store.add(key + "/fails", 1)
            store.set(key + "/stop", b"1")
        store.add(key + "/done", 1)


def gathered(store: Any, key: str, plan: SlicePlan, name: str) -> list[bytes] | None:
    """The extras ``name`` of every slice of ``plan``, in order, each taken off the store;
    None where a slice has none (its check failed)."""
    found: list[bytes] = []
    for i in range(plan.slices):
        at = f"{key}/{name}/{i}"
        if not store.check([at]):
            return None
        found.append(store.get(at))
        store.delete_key(at)
    return found


def group() -> tuple[Any, int] | None:
    """``(store, rank)`` of the initialised ``torch.distributed`` process group of more than
    one rank, else None."""
    dist = sys.modules.get("torch.distributed")  # never imported here: no import, no group
    if dist is None or not dist.is_available() or not dist.is_initialized():
        return None
    if dist.get_world_size() < 2:
        return None
    return dist.distributed_c10d._get_default_store(), int(dist.get_rank())


def dumps_verdict(
    verdict: BaseException | None,
    *,
    found_by: int | None = None,
    role: str = "one of the ranks sharing the verification",
) -> bytes:
    """A verdict for the store, as JSON: the detdata error class's name, message and
    JSON-plain fields (another exception becomes a `DetdataError`). ``found_by``: the rank
    that found it, said in the message with its ``role``."""
    if verdict is None:
        return b"null"
    if not isinstance(verdict, DetdataError) or error_class(type(verdict).__name__) is None:
        verdict = DetdataError(f"the verifying rank failed: {type(verdict).__name__}: {verdict}")
    fields = {
        k: v for k, v in vars(verdict).items() if isinstance(v, (str, int, float, bool, type(None)))
    }
    message = str(verdict.args[0]) if verdict.args else str(verdict)
    if found_by is not None:
        message += f" (found by rank {found_by}, {role})"
    return canonical_json({"type": type(verdict).__name__, "message": message, "fields": fields})


def loads_verdict(raw: bytes) -> DetdataError | None:
    """The verdict `dumps_verdict` wrote: the same detdata error class, message and fields."""
    found = json.loads(raw)
    if found is None:
        return None
    cls = error_class(str(found.get("type", ""))) or DetdataError
    error = cls(str(found.get("message", "")))
    for name, value in dict(found.get("fields", {})).items():
        setattr(error, str(name), value)
    return error


def error_class(name: str) -> type[DetdataError] | None:
    """The detdata error class of that name (`detdata.base.errors`), or None."""
    found = getattr(errors, name, None)
    if isinstance(found, type) and issubclass(found, DetdataError):
        return found
    return None


#: an identity taken this soon after the file's last change is not recorded
RACY_S: Final = 2.0
#: columns of a local identity: size, mtime_ns, ctime_ns, inode, device (-1: not recorded)
FIELDS: Final = 5
NOT_RECORDED: Final = -1
MISSING: Final = -2

LocalIds = npt.NDArray[np.int64]


def local_identities(root: str, paths: Sequence[str]) -> LocalIds:
    """``(size, mtime_ns, ctime_ns, inode, device)`` per shard file under ``root``, from
    ``stat`` (a row of -2: missing; -1: changed within `RACY_S`, not to be recorded)."""
    out = np.full((len(paths), FIELDS), MISSING, dtype=np.int64)
    racy = time.time_ns() - int(RACY_S * 1e9)
    stat = os.stat
    prefix = join(root, "")
    for i, rel in enumerate(paths):
        try:
            st = stat(prefix + rel)
        except OSError:
            continue
        if max(st.st_mtime_ns, st.st_ctime_ns) >= racy:
            out[i] = NOT_RECORDED
            continue
        out[i] = (st.st_size, st.st_mtime_ns, st.st_ctime_ns, st.st_ino, st.st_dev)
    return out


def identity_digests(ids: LocalIds) -> npt.NDArray[np.uint64]:
    """A 64-bit digest of each local identity row (splitmix64 rounds over its fields; 0:
    not recorded), what a receipt stores."""
    h = np.full(ids.shape[0], 0x9E3779B97F4A7C15, dtype=np.uint64)
    for col in range(ids.shape[1]):
        h ^= ids[:, col].view(np.uint64)
        h ^= h >> np.uint64(30)
        h *= np.uint64(0xBF58476D1CE4E5B9)
        h ^= h >> np.uint64(27)
        h *= np.uint64(0x94D049BB133111EB)
        h ^= h >> np.uint64(31)
    h[ids[:, 0] < 0] = 0
    return h


def checked_paths(shards: Sequence[ShardEntry], lo: int, hi: int, checked: bool) -> list[str]:
    """Paths of shards ``[lo, hi)``; a fast form's each checked as a path under the root
    unless ``checked`` (`check_relative_path`, as `ShardTable.path` does)."""
    if not isinstance(shards, ShardTable):  # entries: checked where parsed
        return [s.path for s in shards[lo:hi]]
    paths = shards.paths_between(lo, hi)
    if not checked:
        where = f"manifest columns {shards.columns.path}"
        for i, rel in enumerate(paths, start=lo):
            check_relative_path(rel, where=f"{where} shard #{i}")
    return paths


def entries_at(manifest: ShardList, picked: npt.NDArray[np.int64]) -> tuple[ShardEntry, ...]:
    """The entries of shards ``picked`` (ascending): a fast form's decoded in bulk from the
    range they span when they are dense in it, else one by one (none kept cached)."""
    shards = manifest.shards
    index = picked.tolist()
    if not isinstance(shards, ShardTable):
        return tuple(shards[i] for i in index)
    lo, hi = index[0], index[-1] + 1
    if len(index) * 8 > hi - lo:
        span = shards.entries_between(lo, hi)
        return tuple(span[i - lo] for i in index)
    return tuple(shards.entries_between(i, i + 1)[0] for i in index)


def slice_check(manifest: ShardList, plan: SlicePlan, root: str, check: Check) -> SliceCheck:
    """What a taker does with a slice of ``plan`` (`SliceCheck`):
    its tie part (even once stopped: the tie's verdict comes first), then, unless stopped,
    the identities of its files under ``root`` and ``check`` of its entries."""

    def one(at: npt.NDArray[np.int64], stopped: bool) -> tuple[Exception | None, Extras]:
        if stopped and not plan.tie:
            return None, {}
        entries = entries_at(manifest, at)
        extras: Extras = {}
        if plan.tie:
            extras[TIE] = tie_part(entries)
        if stopped:
            return None, extras
        if plan.ids:
            # a fast form's paths checked first where its tie is not checked yet
            paths = checked_paths(manifest.shards, int(at[0]), int(at[-1]) + 1, not plan.tie)
            extras[IDS] = local_identities(root, paths).astype("<i8").tobytes()
        try:
            return check(entries), extras
        except Exception as exc:  # an I/O error, say: the slice's verdict, its tie part kept
            return exc, extras

    return one


def settle(store: Any, key: str, plan: SlicePlan, manifest: ShardList) -> LocalIds | None:
    """The claimant's verdict once every slice of ``plan`` is done: the tie's error, then the
    first failure in path order; else the identities gathered (None: not an ``ids`` plan)."""
    pause = 0.005
    while int(store.add(key + "/done", 0)) < plan.slices:
        time.sleep(pause)
        pause = min(0.2, pause * 2)
    found: DetdataError | None = None
    if int(store.add(key + "/fails", 0)):  # a failure is set before it is counted
        first = next(i for i in range(plan.slices) if store.check([f"{key}/fail/{i}"]))
        found = loads_verdict(store.get(f"{key}/fail/{first}"))
    if plan.tie:
        parts = gathered(store, key, plan, TIE)
        if parts is not None:  # else a slice failed before its part: that failure is the verdict
            assert isinstance(manifest.shards, ShardTable)
            check_tie_parts(manifest.shards, parts)
    if found is not None:
        raise found
    if not plan.ids:
        return None
    rows = gathered(store, key, plan, IDS)
    assert rows is not None  # every slice passed, so every taker published its rows
    return np.frombuffer(b"".join(rows), dtype="<i8").astype(np.int64).reshape(-1, FIELDS)
