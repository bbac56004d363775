"""Verification shared by the job's ranks (docs/design.md, "Verification once per job").

The claimant (`detdata.identity.receipts.job_meeting`) publishes a *plan* of the shards to
read under the meeting's key; every rank opening the same manifest takes slices of it (one
atomic ``add`` each) until none is left, so each shard is read by one rank, while a rank
alone checks it all, waiting for nobody. A failing slice is published with the rank that
found it; the claimant raises the first failure in path order and publishes that verdict,
which every rank raises. Verdicts cross the store as JSON, never pickle.
"""

from __future__ import annotations

import json
import math
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Final

import numpy as np
import numpy.typing as npt

from detdata.base import errors
from detdata.base.canonical import canonical_json
from detdata.base.errors import DetdataError

#: Slices per taking rank, about: small enough to balance ranks of different speed.
SLICES_PER_RANK: Final = 4

Indices = npt.NDArray[np.int64]


#: a plan's JSON fields
RUNS: Final = "runs"
SIZE: Final = "size"
COLUMNS: Final = "columns"
IDS: Final = "ids"
TIE: Final = "tie"

#: what a slice's taker publishes next to its verdict: ``{key}/{name}/{slice}``
Extras = dict[str, bytes]


@dataclass(frozen=True)
class SlicePlan:
    """The shards to check (``todo``, ascending), ``size`` of a slice, and the fast form's
    ``columns`` identity the claimant vouched for (None: none). ``ids`` / ``tie``: each
    taker also takes its slices' file identities / part of the fast form's tie
    (`detdata.identity.shared_pass`)."""

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


def first_failure(store: Any, key: str, plan: SlicePlan) -> DetdataError | None:
    """Wait until every slice of ``plan`` is done; the first failure in path order, or None."""
    pause = 0.005
    while int(store.add(key + "/done", 0)) < plan.slices:
        time.sleep(pause)
        pause = min(0.2, pause * 2)
    if int(store.add(key + "/fails", 0)) == 0:
        return None
    for i in range(plan.slices):
        if store.check([f"{key}/fail/{i}"]):
            return loads_verdict(store.get(f"{key}/fail/{i}"))
    return None  # unreachable: a failure counted is set first


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
