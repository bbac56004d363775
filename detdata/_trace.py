"""Per-step evidence: digests of positions and batch bytes, written as JSONL.

A record covers one global step of one rank: ``step``, ``rank``,
``first_position``, ``count``, ``positions_b3`` (blake3 of the int64 LE
positions in order) and ``batch_b3`` (per column, blake3 of the column bytes in
position order; combined with names, dtypes and trailing shapes). Because the
digests are incremental over micro batches, a single-rank trace does not depend
on the micro batch size or the number of workers.
"""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import IO, Any, Final

import blake3
import numpy as np

TRACE_VERSION: Final = 1


def _columns(batch: Any, prefix: str = "") -> Iterator[tuple[str, np.ndarray]]:
    """Flatten a delivered batch (tensors/arrays in dicts, lists, tuples) into named arrays."""
    torch = sys.modules.get("torch")
    if torch is not None and isinstance(batch, torch.Tensor):
        yield prefix or "_", batch.detach().cpu().contiguous().numpy()
    elif isinstance(batch, np.ndarray):
        yield prefix or "_", np.ascontiguousarray(batch)
    elif isinstance(batch, Mapping):
        for key in sorted(batch):
            yield from _columns(batch[key], f"{prefix}.{key}" if prefix else str(key))
    elif isinstance(batch, (list, tuple)):
        for i, item in enumerate(batch):
            yield from _columns(item, f"{prefix}[{i}]")
    else:
        yield prefix or "_", np.frombuffer(repr(batch).encode(), dtype=np.uint8)


@dataclass
class StepDigest:
    """Incremental digests of one step's positions and batch bytes."""

    step: int
    first_position: int
    count: int = 0
    positions: Any = field(default_factory=blake3.blake3)
    cols: dict[str, Any] = field(default_factory=dict)
    meta: dict[str, str] = field(default_factory=dict)

    def update(self, positions: np.ndarray, batch: Any) -> None:
        self.count += len(positions)
        self.positions.update(np.ascontiguousarray(positions, dtype="<i8").tobytes())
        for name, arr in _columns(batch):
            self.cols.setdefault(name, blake3.blake3()).update(arr.tobytes())
            self.meta[name] = f"{arr.dtype.str}{list(arr.shape[1:])}"

    def record(self, rank: int) -> dict[str, Any]:
        combined = blake3.blake3()
        for name in sorted(self.cols):
            combined.update(f"{name}:{self.meta[name]}:{self.cols[name].hexdigest()};".encode())
        return {"v": TRACE_VERSION, "step": self.step, "rank": rank, "first_position": self.first_position,
                "count": self.count, "positions_b3": self.positions.hexdigest(),
                "batch_b3": combined.hexdigest()}


class TraceWriter:
    """Appends step records to a JSONL file (one per rank: ``{path}`` gets ``.rank{r}`` when r > 0)."""

    def __init__(self, path: str | os.PathLike[str], rank: int) -> None:
        p = os.fspath(path)
        self.path = p if rank == 0 else f"{p}.rank{rank}"
        self.rank = rank
        self._fh: IO[str] | None = None
        self._current: StepDigest | None = None

    def add(self, step: int, positions: np.ndarray, batch: Any, step_done: bool) -> None:
        if self._current is None or self._current.step != step:
            self._current = StepDigest(step=step, first_position=int(positions[0]))
        self._current.update(positions, batch)
        if step_done:
            self._write(self._current.record(self.rank))
            self._current = None

    def _write(self, record: dict[str, Any]) -> None:
        if self._fh is None:
            os.makedirs(os.path.dirname(os.path.abspath(self.path)), exist_ok=True)
            self._fh = open(self.path, "a", encoding="utf-8")  # noqa: SIM115 (kept open across steps)
        self._fh.write(json.dumps(record, sort_keys=True) + "\n")
        self._fh.flush()

    def close(self) -> None:
        if self._fh is not None:
            self._fh.close()
            self._fh = None


def read_trace(path: str | os.PathLike[str]) -> list[dict[str, Any]]:
    """Records of a trace file, in file order."""
    with open(path, encoding="utf-8") as fh:
        return [json.loads(line) for line in fh if line.strip()]


def first_difference(a: list[dict[str, Any]], b: list[dict[str, Any]]) -> dict[str, Any] | None:
    """The first step (by step number) whose digests differ, or that only one trace has.

    Steps present in both are compared; a run that stopped early is reported
    at the first step the other has beyond it. Returns None when identical.
    """
    by_a = {(r["step"], r["rank"]): r for r in a}
    by_b = {(r["step"], r["rank"]): r for r in b}
    keys = ("first_position", "count", "positions_b3", "batch_b3")
    for key in sorted(set(by_a) | set(by_b)):
        ra, rb = by_a.get(key), by_b.get(key)
        if ra is None or rb is None:
            return {"step": key[0], "rank": key[1], "reason": "missing in " + ("A" if ra is None else "B")}
        diff = [k for k in keys if ra[k] != rb[k]]
        if diff:
            return {"step": key[0], "rank": key[1], "reason": "differs: " + ", ".join(diff), "a": ra, "b": rb}
    return None
