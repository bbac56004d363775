"""The exactness matrix: every layout change x every feature x every resume point, each cell
compared byte for byte with an uninterrupted run.

Run: ``python -m benchmarks.matrix [--smoke] [--cells K --sample-seed S] [--no-docs]``. Writes
``benchmarks/results/matrix.{json,png}`` and the generated table of ``docs/benchmarks.md``
(between its ``matrix`` markers; `benchmarks.matrix_report`).

A cell (layout A -> layout B, feature, resume point):

1. the **uninterrupted run**: every rank of layout A delivers every micro batch of steps
   ``0 .. TOTAL_STEPS``; each delivered row is recorded under its global position;
2. the **interrupted run**: every rank of layout A delivers up to the resume point (a step
   boundary, one micro step inside a step, or the step boundary at the end of the data's first
   epoch), rank 0's ``state_dict()`` is taken (a JSON round trip: what a checkpoint holds), and
   every rank of layout B is built fresh, loads it (the default resume: a state inside a step
   re-delivers that step whole) and delivers to the end;
3. the cell is **exact** when every position ``0 .. end`` was delivered by the interrupted run
   and every delivered row (every column: dtype, shape and bytes) equals the uninterrupted run's
   row at that position; also a position delivered twice (a re-delivered step) must match.

Ranks are simulated in process (``LoaderOptions(rank=r, world_size=W)``, one loader per rank,
as the loading tests do); each rank reads with its own ``num_workers`` and worker mode, so the
process / thread cells really fork workers or start threads. The positions each rank must
deliver are computed here from docs/design.md section 4 (``step start + micro_step x micro x
world + rank x micro + row``), not read from the loader; the loader's ``positions_of_next()``
must agree with them.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import logging
import os
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

import detdata
from benchmarks import matrix_report
from benchmarks.matrix_data import FEATURES, Setup, build

RESULTS = Path(__file__).parent / "results"

#: the global batch every layout below divides (lcm of their world x micro)
UNIT = 112
#: steps of every run; the schedule feature ramps, so its steps are read from its `Setup`
TOTAL_POSITIONS = 6 * UNIT
#: the step boundary and the step a mid-step resume stops inside (positions 224 .. 336)
STEP_POSITION = 2 * UNIT
#: the data's epoch (every feature's first epoch ends at a step boundary there)
EPOCH_POSITION = 4 * UNIT


@dataclass(frozen=True)
class Layout:
    """One data-parallel layout: ranks, micro batch, readers per rank and their kind."""

    world: int
    micro: int
    workers: int = 0
    mode: str = "process"

    def label(self) -> str:
        readers = "" if self.workers == 0 else f", {self.workers} {self.mode}es"
        if self.workers and self.mode == "thread":
            readers = f", {self.workers} threads"
        accumulation = UNIT // (self.world * self.micro)
        return f"DP {self.world} x micro {self.micro} (acc {accumulation}{readers})"


@dataclass(frozen=True)
class Change:
    """A layout change at a resume: ``before`` -> ``after``."""

    name: str
    before: Layout
    after: Layout


CHANGES: tuple[Change, ...] = (
    Change("DP 1 -> 8", Layout(1, 2), Layout(8, 2)),
    Change("DP 8 -> 7", Layout(8, 2), Layout(7, 2)),
    Change("DP 7 -> 4", Layout(7, 2), Layout(4, 2)),
    Change("DP 4 -> 1", Layout(4, 2), Layout(1, 2)),
    Change("micro 4 -> 1 (acc 14 -> 56)", Layout(2, 4), Layout(2, 1)),
    Change("DP 4 -> 2, micro 2 -> 4 (acc kept)", Layout(4, 2), Layout(2, 4)),
    Change("workers 0 -> 2 processes", Layout(2, 4), Layout(2, 4, 2, "process")),
    Change("2 processes -> 2 threads", Layout(2, 4, 2, "process"), Layout(2, 4, 2, "thread")),
    Change("2 threads -> 0, DP 2 -> 4", Layout(2, 4, 2, "thread"), Layout(4, 2)),
)

#: resume points: (name, where the interrupted run stops as (position of a step boundary,
#: micro steps delivered inside the step that starts there))
POINTS: tuple[tuple[str, int, int], ...] = (
    ("step boundary", STEP_POSITION, 0),
    ("inside a step", STEP_POSITION, 1),
    ("epoch boundary", EPOCH_POSITION, 0),
)


def row_digest(batch: dict[str, Any], row: int) -> str:
    """sha256 of one delivered row: every column's name, dtype, row shape and bytes."""
    h = hashlib.sha256()
    for key in sorted(batch):
        value = batch[key]
        array = value.numpy() if isinstance(value, torch.Tensor) else np.asarray(value)
        cell = np.ascontiguousarray(array[row])
        h.update(f"{key}|{cell.dtype}|{cell.shape}|".encode())
        h.update(cell.tobytes())
    return h.hexdigest()


def step_starts(setup: Setup, end: int) -> list[int]:
    """First position of every step up to ``end`` (itself included when a step starts there)."""
    starts, position, step = [], 0, 0
    while position <= end:
        starts.append(position)
        position += setup.batch_of(step)
        step += 1
    return starts


def rank_positions(
    setup: Setup, layout: Layout, rank: int, start: int, end: int, extra: int = 0
) -> Iterator[np.ndarray]:
    """Positions of each micro batch ``rank`` delivers from the step starting at ``start`` to
    the step boundary ``end``, then ``extra`` micro steps of the step starting at ``end``
    (docs/design.md section 4: step start + micro_step x micro x world + rank x micro + row)."""
    starts = step_starts(setup, end)
    if start not in starts or end not in starts:
        raise ValueError(f"{start} or {end} is not a step boundary of {setup.name}")
    width = layout.micro * layout.world
    for s in starts:
        if s < start:
            continue
        batch = setup.batch_of(starts.index(s))
        if batch % width:
            raise ValueError(f"{layout.label()} does not divide the global batch {batch}")
        steps = batch // width if s < end else extra
        for m in range(steps):
            yield s + m * width + rank * layout.micro + np.arange(layout.micro)
        if s == end:
            return


def make_loader(setup: Setup, layout: Layout, rank: int) -> Any:
    """Rank ``rank``'s loader of ``setup`` under ``layout``."""
    options = detdata.LoaderOptions(
        rank=rank,
        world_size=layout.world,
        transform=setup.transform,
        read=detdata.ReadOptions(worker_mode=layout.mode),
    )
    return detdata.DataLoader(
        setup.data,
        global_batch_size=setup.schedule,
        micro_batch_size=layout.micro,
        seed=setup.seed,
        num_workers=layout.workers,
        options=options,
    )


@dataclass
class Delivery:
    """What the ranks of one run delivered: position -> row digests (in delivery order)."""

    rows: dict[int, list[str]]
    state: dict[str, Any] | None = None
    micro_batches: int = 0
    wrong_positions: int = 0


def deliver(
    setup: Setup,
    layout: Layout,
    start: int,
    end: int,
    *,
    extra: int = 0,
    state: dict[str, Any] | None = None,
) -> Delivery:
    """Every rank of ``layout`` (each a fresh loader, resumed from ``state`` if given) delivers
    its micro batches from ``start`` to ``end`` (+ ``extra`` micro steps); rank 0's state after."""
    out = Delivery(rows={})
    for rank in range(layout.world):
        loader = make_loader(setup, layout, rank)
        if state is not None:
            loader.load_state_dict(state)
        with contextlib.closing(loader):
            it = iter(loader)
            for positions in rank_positions(setup, layout, rank, start, end, extra):
                if not np.array_equal(loader.positions_of_next(), positions):
                    out.wrong_positions += 1
                batch = next(it)
                out.micro_batches += 1
                for row, position in enumerate(positions.tolist()):
                    out.rows.setdefault(position, []).append(row_digest(batch, row))
            if rank == 0:
                out.state = json.loads(json.dumps(loader.state_dict()))
    return out


@dataclass
class Cell:
    """One cell's verdict and what it compared."""

    change: str
    feature: str
    point: str
    exact: bool
    positions: int
    rows_compared: int
    mismatched: int
    missing: int
    first_bad: int | None
    seconds: float
    error: str | None = None

    def to_json(self) -> dict[str, Any]:
        return dict(self.__dict__)


def compare(reference: Delivery, first: Delivery, second: Delivery, end: int) -> dict[str, Any]:
    """Every position 0 .. end delivered, every delivered row equal to the reference's."""
    truth = {p: rows[0] for p, rows in reference.rows.items()}
    bad: list[int] = []
    compared = 0
    for run in (first, second):
        for position, rows in run.rows.items():
            compared += len(rows)
            if any(r != truth.get(position) for r in rows):
                bad.append(position)
    seen = set(first.rows) | set(second.rows)
    missing = [p for p in range(end) if p not in seen]
    wrong = first.wrong_positions + second.wrong_positions + reference.wrong_positions
    return {
        "rows_compared": compared,
        "mismatched": len(set(bad)) + wrong,
        "missing": len(missing),
        "first_bad": min(bad + missing) if bad or missing else None,
        "complete": len(truth) == end,
    }


class Matrix:
    """Runs cells; uninterrupted runs are cached per (feature, layout)."""

    def __init__(self, setups: dict[str, Setup]) -> None:
        self.setups = setups
        self._references: dict[tuple[str, Layout], Delivery] = {}

    def reference(self, feature: str, layout: Layout) -> Delivery:
        key = (feature, layout)
        if key not in self._references:
            self._references[key] = deliver(self.setups[feature], layout, 0, TOTAL_POSITIONS)
        return self._references[key]

    def run(self, change: Change, feature: str, point: str) -> Cell:
        """One cell; an exception (a refused resume, a failed read) is its verdict."""
        logger = logging.getLogger("detdata")
        level = logger.level
        logger.setLevel(logging.ERROR)  # the mid-step resumes log their re-delivery each time
        try:
            return self._run(change, feature, point)
        finally:
            logger.setLevel(level)

    def _run(self, change: Change, feature: str, point: str) -> Cell:
        setup = self.setups[feature]
        stop, extra = next((p, e) for n, p, e in POINTS if n == point)
        t = time.perf_counter()
        base = dict(change=change.name, feature=feature, point=point, positions=TOTAL_POSITIONS)
        try:
            reference = self.reference(feature, change.before)
            first = deliver(setup, change.before, 0, stop, extra=extra)
            assert first.state is not None
            second = deliver(setup, change.after, stop, TOTAL_POSITIONS, state=first.state)
            verdict = compare(reference, first, second, TOTAL_POSITIONS)
        except Exception as exc:  # a refused or failing cell is reported, not hidden
            return Cell(
                **base,
                exact=False,
                rows_compared=0,
                mismatched=0,
                missing=TOTAL_POSITIONS,
                first_bad=None,
                seconds=time.perf_counter() - t,
                error=f"{type(exc).__name__}: {exc}"[:500],
            )
        complete = verdict.pop("complete")
        exact = complete and verdict["mismatched"] == 0 and verdict["missing"] == 0
        return Cell(**base, exact=exact, seconds=time.perf_counter() - t, **verdict)


def all_cells(features: Sequence[str]) -> list[tuple[Change, str, str]]:
    """Every (change, feature, point) of the matrix, in table order."""
    return [(c, f, p) for c in CHANGES for f in features for p, _, _ in POINTS]


def sample_cells(features: Sequence[str], count: int, seed: int) -> list[tuple[Change, str, str]]:
    """``count`` distinct cells drawn with ``seed`` (all of them when ``count`` is larger)."""
    cells = all_cells(features)
    rng = np.random.default_rng(seed)
    picked = sorted(rng.permutation(len(cells))[: min(count, len(cells))].tolist())
    return [cells[i] for i in picked]


@contextlib.contextmanager
def http_folder(work: Path) -> Iterator[tuple[Path, str] | None]:
    """A folder served by a real HTTP server on 127.0.0.1 (``tests/servers.py``: nginx, else
    Twisted) and its URL; None (the remote column not run) when neither can start."""
    from tests.servers import start_http, stop_pid

    try:
        server = start_http(work / "http")
    except Exception as exc:  # the reason is printed and recorded
        print(f"remote HTTP not run: {type(exc).__name__}: {exc}")
        yield None
        return
    try:
        yield server.new_dir()
    finally:
        stop_pid(server.pid, 5.0)


def run_matrix(
    cells: list[tuple[Change, str, str]], setups: dict[str, Setup], progress: bool = False
) -> list[Cell]:
    """Each cell in turn (those whose feature is missing from ``setups`` are left out)."""
    matrix = Matrix(setups)
    out = []
    for change, feature, point in cells:
        if feature not in setups:
            continue
        cell = matrix.run(change, feature, point)
        out.append(cell)
        if progress:
            verdict = "exact" if cell.exact else f"NOT EXACT {cell.error or ''}"
            print(f"{change.name:40} {feature:20} {point:15} {verdict} ({cell.seconds:.2f} s)")
    return out


def main(argv: list[str] | None = None) -> int:
    """``python -m benchmarks.matrix``: every cell (or a sample), the JSON, figure and docs."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cells", type=int, default=0, help="a random sample of K cells")
    parser.add_argument("--sample-seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=RESULTS)
    parser.add_argument("--no-docs", action="store_true", help="leave docs/benchmarks.md")
    args = parser.parse_args(argv)
    command = "python -m benchmarks.matrix" + (" " + " ".join(argv or sys.argv[1:])).rstrip()
    prov = matrix_report.provenance(command.strip())
    t = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="detdata-matrix-") as tmp:
        work = Path(tmp)
        with http_folder(work) as served:
            setups = build(work, served)
            chosen = (
                sample_cells(FEATURES, args.cells, args.sample_seed)
                if args.cells
                else all_cells(FEATURES)
            )
            cells = run_matrix(chosen, setups, progress=True)
    prov["load_after"] = round(os.getloadavg()[0], 1)
    doc = {
        "provenance": prov,
        "seconds": time.perf_counter() - t,
        "features": [f for f in FEATURES if f in setups],
        "skipped": "" if "remote HTTP" in setups else "remote HTTP (no HTTP server could start)",
        "changes": [
            {"name": c.name, "before": c.before.label(), "after": c.after.label()} for c in CHANGES
        ],
        "points": {n: p for n, p, _ in POINTS},
        "positions": TOTAL_POSITIONS,
        "cells": [c.to_json() for c in cells],
    }
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "matrix.json").write_text(json.dumps(doc, indent=1) + "\n")
    matrix_report.figure(doc, args.out / "matrix.png")
    section = matrix_report.markdown(doc)
    if not args.no_docs:
        matrix_report.write_doc(section)
    exact = sum(c.exact for c in cells)
    print(f"{exact} of {len(cells)} cells exact; {args.out / 'matrix.json'}")
    return 0 if exact == len(cells) else 1


if __name__ == "__main__":
    sys.exit(main())
