"""Pictures where people look: a trace diff, a mixture's shares, a batch-size schedule.

Each picture draws a data series computed by a pure function here (`diff_runs`,
`mixture_shares`, `schedule_curve`: what the tests compare with a brute-force reference).
matplotlib (``pip install 'detdata[plots]'``) is imported only when a picture is drawn
(else `DependencyError` naming the install line); figures are built without pyplot and
written atomically, as ``-o`` writes.
"""

from __future__ import annotations

import io
import itertools
import os
from collections.abc import Sequence
from dataclasses import dataclass
from fractions import Fraction
from typing import TYPE_CHECKING, Any, Final

import numpy as np

from detdata.base.checks import check_count
from detdata.base.errors import ConfigError
from detdata.base.lazy import require
from detdata.datasets.mixture import Mixture
from detdata.loading.trace import KIND_PRIORITY, Comparison
from detdata.order.batches import BatchSchedule, StepMap

if TYPE_CHECKING:
    from matplotlib.axes import Axes
    from matplotlib.figure import Figure

INSTALL: Final = "detdata[plots]"
SAME: Final = "same"
#: (colour, hatch) of each step status in the diff picture (finding kinds of
#: `detdata.loading.trace`): Okabe-Ito colours, told apart with red-green colour blindness,
#: and a hatch per kind so the picture reads in greyscale too (`SAME` plain)
DIFF_STYLES: Final = {
    SAME: ("#0072b2", ""),
    "differs": ("#d55e00", "xxxx"),
    "missing": ("#999999", "...."),
    "overlap": ("#e69f00", "////"),
    "discontinuity": ("#cc79a7", "\\\\\\\\"),
    "conflict": ("#000000", "++++"),
}
#: marker of each source's lines in the mixture picture (told apart without colour)
SOURCE_MARKERS: Final = ("o", "s", "^", "D", "v", "P", "X", "*")
_DPI: Final = 110

PathLike = str | os.PathLike[str]


# ------------------------------------------------------------------ drawing
def _figure(rows: int, height: float) -> Figure:
    """A new pyplot-free figure with ``rows`` stacked axes (`DependencyError` without
    matplotlib)."""
    figure_module = require("matplotlib.figure", install=INSTALL, purpose="to draw plots")
    fig: Figure = figure_module.Figure(figsize=(10, height), layout="constrained")
    fig.subplots(rows, 1, squeeze=False)
    return fig


def _save(fig: Figure, path: PathLike) -> None:
    """Render ``fig`` as PNG in memory, then publish it with `atomic_write_bytes` (the writer
    of ``-o``, with its contract: never a torn file, a folder refused, a full disk a
    `StorageError` naming ``path``)."""
    from detdata.storage.atomic import atomic_write_bytes

    buffer = io.BytesIO()
    fig.savefig(buffer, format="png", dpi=_DPI)
    atomic_write_bytes(os.fspath(path), buffer.getvalue())


# ------------------------------------------------------------------ trace diff
@dataclass(frozen=True, kw_only=True)
class DiffRun:
    """Global steps ``[start, stop)`` that all have one ``status``: `SAME` or the kind of the
    difference found there (``differs``, ``missing``, ``overlap``, ``discontinuity``,
    ``conflict``)."""

    start: int
    stop: int
    status: str


def diff_runs(comparison: Comparison) -> tuple[DiffRun, ...]:
    """Each step of ``comparison`` (those compared and those with a finding) with its status,
    `SAME` or the kind of its most telling finding (the order `detdata diff` reports them
    in), as runs of consecutive steps with one status (a step neither trace holds ends a
    run): O(steps), whatever the run's length."""
    statuses = dict.fromkeys(comparison.steps, SAME)
    for finding in sorted(comparison.findings, key=lambda f: KIND_PRIORITY[f.kind], reverse=True):
        statuses[finding.step] = finding.kind
    runs: list[DiffRun] = []
    for step, status in sorted(statuses.items()):
        last = runs[-1] if runs else None
        if last is not None and last.stop == step and last.status == status:
            runs[-1] = DiffRun(start=last.start, stop=step + 1, status=status)
        else:
            runs.append(DiffRun(start=step, stop=step + 1, status=status))
    return tuple(runs)


def plot_diff(comparison: Comparison, path: PathLike, *, title: str = "A vs B") -> None:
    """PNG at ``path``: the steps where two traces match and part (`diff_runs`: one band, each
    status its `DIFF_STYLES`; the legend beside the band, not over it), and the count of
    differing steps against the step; both x axes labelled."""
    runs = diff_runs(comparison)
    if not runs:
        raise ConfigError("nothing to plot: the comparison holds no step")
    fig = _figure(2, 5.0)
    band, count = fig.axes
    _diff_band(band, runs, comparison, title)
    _diff_count(count, runs)
    for ax in fig.axes:
        ax.set_xlim(runs[0].start, runs[-1].stop)
        ax.set_xlabel("global step")
    _save(fig, path)


def _diff_band(ax: Axes, runs: Sequence[DiffRun], comparison: Comparison, title: str) -> None:
    for status in dict.fromkeys(r.status for r in runs):
        spans = [(r.start, r.stop - r.start) for r in runs if r.status == status]
        colour, hatch = DIFF_STYLES.get(status, ("#56b4e9", "oo"))
        ax.broken_barh(
            spans,
            (0, 1),
            facecolor=colour,
            edgecolor="white",
            linewidth=0,
            hatch=hatch,
            label=status,
        )
    first = comparison.first
    if first is not None:
        ax.axvline(
            first.step, color="black", linewidth=1.5, linestyle="--", label="first difference"
        )
    total = sum(r.stop - r.start for r in runs)
    same = sum(r.stop - r.start for r in runs if r.status == SAME)
    where = "" if first is None else f"; first difference at step {first.step} ({first.kind})"
    ax.set_yticks([])
    ax.set_title(f"{title}: {same:,} of {total:,} steps match{where}", loc="left", fontsize=10)
    ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=8, borderaxespad=0.0)


def _diff_count(ax: Axes, runs: Sequence[DiffRun]) -> None:
    xs = [runs[0].start, *(r.stop for r in runs)]
    ys = [0, *itertools.accumulate(r.stop - r.start if r.status != SAME else 0 for r in runs)]
    ax.plot(xs, ys, color=DIFF_STYLES["differs"][0])
    ax.set_ylabel("steps that differ\n(cumulative)")


# ------------------------------------------------------------------ mixture shares
@dataclass(frozen=True, kw_only=True)
class MixtureShares:
    """Positions ``[start, start + n)`` of a mixture at ``n`` in ``lengths``: ``counts[s][k]``
    samples of source ``names[s]`` among the first ``lengths[k]`` positions, ``targets[s][k]``
    the exact number its proportions ask for there (sum of ``p_s`` over those positions).
    ``phases``: each phase of the schedule that overlaps those positions, as
    ``(first, stop, proportions)`` (positions ``[first, stop)``, one proportion per source)."""

    names: tuple[str, ...]
    start: int
    lengths: tuple[int, ...]
    counts: tuple[tuple[int, ...], ...]
    targets: tuple[tuple[Fraction, ...], ...]
    phases: tuple[tuple[int, int, tuple[Fraction, ...]], ...] = ()


def sample_lengths(count: int, points: int) -> tuple[int, ...]:
    """Up to ``points`` lengths in ``[1, count]``, evenly spaced on a log scale, ``count``
    last (a long run stays cheap; the start, where shares move most, is seen)."""
    raw = np.geomspace(1, count, num=min(points, count))
    return tuple(sorted({*np.rint(raw).astype(np.int64).tolist(), count}))


def mixture_shares(
    mixture: Mixture, *, start: int = 0, count: int, points: int = 400
) -> MixtureShares:
    """A mixture's cumulative counts per source against its target over positions
    ``[start, start + count)``, at `sample_lengths` (O(points x sources + phases), from
    `Mixture.consumed`)."""
    count = check_count(count, "count")
    lengths = sample_lengths(count, check_count(points, "points"))
    before = mixture.consumed(start)
    after = [mixture.consumed(start + n) for n in lengths]
    names = mixture.source_names
    phases = _phases(mixture, start, start + count)
    return MixtureShares(
        names=names,
        start=start,
        lengths=lengths,
        counts=tuple(tuple(c[s] - before[s] for c in after) for s in names),
        targets=_targets(phases, start, lengths),
        phases=phases,
    )


def _phases(
    mixture: Mixture, start: int, end: int
) -> tuple[tuple[int, int, tuple[Fraction, ...]], ...]:
    """The schedule's phases over positions ``[start, end)``, each cut to them, with their
    proportions (`Mixture.source_names` order)."""
    ends = [p.start for p in mixture.phases[1:]] + [end]
    out = []
    for phase, phase_end in zip(mixture.phases, ends, strict=True):
        lo, hi = max(start, phase.start), min(end, phase_end)
        if hi > lo:
            out.append((lo, hi, phase.fractions()))
    return tuple(out)


def _targets(
    phases: Sequence[tuple[int, int, tuple[Fraction, ...]]], start: int, lengths: Sequence[int]
) -> tuple[tuple[Fraction, ...], ...]:
    """Per source, the sum of its exact proportion over positions ``[start, start + n)`` for
    each of the ascending ``lengths``, in one sweep over ``phases`` (`_phases` of those
    positions; weights changed during a run are phases too): O(points + phases)."""
    acc = [Fraction(0)] * len(phases[0][2])
    out: list[list[Fraction]] = [[] for _ in acc]
    k, pos = 0, start
    for n in lengths:
        while pos < start + n:
            _, stop, fractions = phases[k]
            hi = min(start + n, stop)
            for s, f in enumerate(fractions):
                acc[s] += f * (hi - pos)
            pos = hi
            if hi == stop:
                k += 1
        for s, total in enumerate(acc):
            out[s].append(total)
    return tuple(tuple(v) for v in out)


def plot_mixture_shares(shares: MixtureShares, path: PathLike) -> None:
    """PNG at ``path``: each source's cumulative share (solid) against its cumulative target
    (dashed) and each phase's own proportion (dotted, one segment per phase) over positions
    (log scale), and the count minus the target in samples; each source its colour and
    marker (readable in greyscale), the legend beside the axes."""
    fig = _figure(2, 6.0)
    share_ax, gap_ax = fig.axes
    xs = [shares.start + n for n in shares.lengths]
    every = max(1, len(xs) // 12)
    rows = zip(shares.names, shares.counts, shares.targets, strict=True)
    for s, (name, counts, targets) in enumerate(rows):
        marks: dict[str, Any] = {
            "marker": SOURCE_MARKERS[s % len(SOURCE_MARKERS)],
            "markevery": every,
            "markersize": 4,
        }
        line = share_ax.plot(
            xs,
            [c / n for c, n in zip(counts, shares.lengths, strict=True)],
            label=f"{name} ({counts[-1] / shares.lengths[-1]:.4f})",
            **marks,
        )
        colour = line[0].get_color()
        share_ax.plot(
            xs,
            [float(t) / n for t, n in zip(targets, shares.lengths, strict=True)],
            linestyle="--",
            color=colour,
        )
        for first, stop, weights in shares.phases:  # from position 1 on the log axis
            share_ax.plot(
                [max(first, xs[0]), stop],
                [float(weights[s])] * 2,
                linestyle=":",
                linewidth=2,
                color=colour,
            )
        gaps = [c - float(t) for c, t in zip(counts, targets, strict=True)]
        gap_ax.plot(xs, gaps, color=colour, **marks)
    share_ax.set_ylabel(f"cumulative share since position {shares.start:,}")
    share_ax.set_title(
        "mixture: share per source (solid), its cumulative target (dashed) and each "
        "phase's target (dotted)",
        loc="left",
        fontsize=10,
    )
    share_ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0), borderaxespad=0.0)
    gap_ax.set_ylabel("samples - target")
    for ax in (share_ax, gap_ax):
        ax.set_xscale("log")
        ax.set_xlabel("global position")
    _save(fig, path)


# ------------------------------------------------------------------ batch schedule
@dataclass(frozen=True, kw_only=True)
class ScheduleCurve:
    """Steps ``[0, steps)`` of a batch schedule: step ``step_starts[i]`` starts at sample
    ``positions[i]`` with global batch ``batches[i]``, which holds until the next entry; the
    last entry is the end (``steps``, samples consumed by then, the last batch)."""

    step_starts: tuple[int, ...]
    positions: tuple[int, ...]
    batches: tuple[int, ...]


def schedule_curve(schedule: BatchSchedule | StepMap, *, steps: int) -> ScheduleCurve:
    """The batch and the samples consumed at each change of ``schedule`` (a `BatchSchedule`,
    or a run's `StepMap` with the changes made at resumes) up to step ``steps``: O(changes)."""
    steps = check_count(steps, "steps")
    step_map = schedule if isinstance(schedule, StepMap) else StepMap([(0, schedule)])
    pieces = [p for p in step_map.pieces if p.step < steps]
    return ScheduleCurve(
        step_starts=(*(p.step for p in pieces), steps),
        positions=(*(p.position for p in pieces), step_map.start_of(steps)),
        batches=(*(p.batch for p in pieces), pieces[-1].batch),
    )


def plot_batch_schedule(
    schedule: BatchSchedule | StepMap, path: PathLike, *, steps: int, title: str = ""
) -> None:
    """PNG at ``path``: the global batch (samples) against the step, and the samples consumed
    against the step, over steps ``[0, steps)`` (`schedule_curve`)."""
    curve = schedule_curve(schedule, steps=steps)
    fig = _figure(2, 6.0)
    batch_ax, samples_ax = fig.axes
    batch_ax.step(curve.step_starts, curve.batches, where="post")
    batch_ax.set_ylabel("global batch (samples)")
    batch_ax.set_title(title or f"batch-size schedule, {steps:,} steps", loc="left")
    samples_ax.plot(curve.step_starts, curve.positions)
    samples_ax.set_ylabel("samples consumed")
    samples_ax.set_xlabel("step")
    _save(fig, path)
