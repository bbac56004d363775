"""Comparing traces: each trace assembled per global step from its final records (`assemble`:
the timeline rules of `detdata.loading.trace`), then two traces compared step by step
(`compare`)."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any, Final

from detdata.loading.trace.digests import SUM_MODULUS
from detdata.loading.trace.read import Record


def _spans(records: Sequence[Record]) -> list[tuple[int, int]]:
    """The positions of ``records`` as sorted, merged ``[start, end)`` intervals."""
    out: list[tuple[int, int]] = []
    for start, end in sorted((first, first + n) for r in records for first, n in r.runs):
        if out and start <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], end))
        else:
            out.append((start, end))
    return out


def _text(spans: Sequence[tuple[int, int]]) -> str:
    return ", ".join(f"[{a}, {b})" for a, b in spans[:4]) + (" ..." if len(spans) > 4 else "")


def blocks(
    left: Sequence[Record], right: Sequence[Record]
) -> list[tuple[tuple[Record, ...], tuple[Record, ...]]]:
    """Connected groups of records (either side) whose positions overlap transitively, each
    compared as one unit: (left's records, right's records) per group, by first position."""
    items = [*((r, 0) for r in left), *((r, 1) for r in right)]
    parent = list(range(len(items)))

    def find(i: int) -> int:
        while parent[i] != i:
            parent[i] = parent[parent[i]]
            i = parent[i]
        return i

    spans = sorted(
        (first, first + n, i) for i, (rec, _) in enumerate(items) for first, n in rec.runs
    )
    reach, owner = -1, -1
    for start, end, i in spans:
        if start < reach:  # overlaps the group being swept
            parent[find(i)] = find(owner)
            reach = max(reach, end)
        else:
            reach, owner = end, i
    groups: dict[int, list[int]] = {}
    for i in range(len(items)):
        groups.setdefault(find(i), []).append(i)
    by_start = sorted(groups.values(), key=lambda g: min(s for i in g for s, _ in items[i][0].runs))
    return [
        (
            tuple(items[i][0] for i in g if items[i][1] == 0),
            tuple(items[i][0] for i in g if items[i][1] == 1),
        )
        for g in by_start
    ]


def _summed(records: Sequence[Record]) -> tuple[dict[str, str], dict[str, int], list[str]]:
    """(leaf descriptions, digest sums, leaves described differently by different records)."""
    cols: dict[str, str] = {}
    sums: dict[str, int] = {}
    clashes = []
    for rec in records:
        for name, meta in rec.cols.items():
            if cols.setdefault(name, meta) != meta and name not in clashes:
                clashes.append(name)
            sums[name] = (sums.get(name, 0) + rec.sums[name]) % SUM_MODULUS
    for name in cols:
        if any(name not in rec.cols for rec in records) and name not in clashes:
            clashes.append(name)
    return cols, sums, clashes


def block_difference(
    a: Sequence[Record], b: Sequence[Record], sides: tuple[str, str]
) -> str | None:
    """Why the two sides of a block differ (None when they delivered the same samples)."""
    left, right = _spans(a), _spans(b)
    if left != right:
        only = ((_minus(left, right), sides[0]), (_minus(right, left), sides[1]))
        parts = [f"positions {_text(s)} only in {side}" for s, side in only if s]
        return "positions differ: " + "; ".join(parts)
    cols_a, sums_a, clash_a = _summed(a)
    cols_b, sums_b, clash_b = _summed(b)
    if clash_a or clash_b:
        return f"leaves described differently within a step: {sorted({*clash_a, *clash_b})}"
    if cols_a != cols_b:
        return f"batch leaves differ: {sides[0]} {cols_a} vs {sides[1]} {cols_b}"
    changed = [name for name in sorted(sums_a) if sums_a[name] != sums_b[name]]
    if changed:
        batch = [n for n in changed if cols_a[n].startswith("batch:")]
        why = f"differs: batch_b3 of leaf {changed} at positions {_text(left)}"
        if batch:
            why += (
                f" (leaves {batch} are batch-level values, not per sample: they depend on the "
                "micro batch size)"
            )
        return why
    return None


def _minus(a: Sequence[tuple[int, int]], b: Sequence[tuple[int, int]]) -> list[tuple[int, int]]:
    """Positions in intervals ``a`` and not in ``b`` (both merged)."""
    out = []
    for start, end in a:
        cur = start
        for bs, be in b:
            if be <= cur or bs >= end:
                continue
            if bs > cur:
                out.append((cur, bs))
            cur = max(cur, be)
        if cur < end:
            out.append((cur, end))
    return out


@dataclass(frozen=True)
class Finding:
    """A difference: at ``step``, on ``rank``; ``records`` are (label, record) pairs to show."""

    step: int
    rank: int
    kind: str  # "conflict", "discontinuity" (a restart too), "overlap", "missing", "differs"
    reason: str
    records: tuple[tuple[str, Record], ...] = ()

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {k: getattr(self, k) for k in ("step", "rank", "kind", "reason")}
        out["records"] = [[label, r.to_json() | {"where": r.where}] for label, r in self.records]
        return out


#: the order in which findings of one step are reported (the first is the most telling)
KIND_PRIORITY: Final = {"conflict": 0, "discontinuity": 1, "overlap": 2, "missing": 3, "differs": 4}


def _conflicts(
    label: str, rank: int, generation: list[Record], final: list[Record]
) -> Iterator[Finding]:
    """Records delivered before a restore whose positions were delivered again with other bytes."""
    by_step: dict[int, tuple[list[Record], list[Record]]] = {}
    for rec in generation:
        by_step.setdefault(rec.step, ([], []))[0].append(rec)
    for rec in final:
        if rec.step in by_step:
            by_step[rec.step][1].append(rec)
    for step, (before, after) in sorted(by_step.items()):
        for first, again in blocks(before, after):
            if not first or not again or _spans(first) != _spans(again):
                continue  # not delivered again (or not comparable as one unit): nothing to check
            why = block_difference(first, again, ("before", "after"))
            if why is not None:
                shown = (
                    *((f"{label} first", r) for r in first[:2]),
                    *((f"{label} again", r) for r in again[:2]),
                )
                yield Finding(
                    step,
                    rank,
                    "conflict",
                    f"conflict in {label}: positions {_text(_spans(first))} of rank {rank} "
                    f"were delivered twice with different bytes ({why})",
                    shown,
                )


def _restore_point(timeline: Sequence[Record], at: int) -> int:
    """How many of a rank's records stand when the run is restored to ``at``: those up to the
    latest moment its cursor was at ``at`` (a checkpoint taken then), everything delivered
    after it superseded. Position 0 supersedes everything; a position the timeline never
    reached exactly keeps the records ending at or before it (a restore forward keeps all)."""
    for i in range(len(timeline) - 1, -1, -1):
        if timeline[i].next == at:
            return i + 1
    if at == 0:
        return 0
    cut = len(timeline)
    while cut > 0 and timeline[cut - 1].next > at:
        cut -= 1
    return cut


def _break_finding(label: str, prev: Record, rec: Record) -> Finding:
    """A record that does not continue its rank's previous one, without a restore."""
    expected = prev.next_step
    if rec.at == 0:
        what = (
            f"discontinuity in {label} (a restart): rank {rec.rank} started over at "
            f"samples_consumed 0 (step 0) where it should have delivered samples_consumed "
            f"{prev.next} (step {expected}): a fresh loader without load_state_dict (data "
            "cursor not restored?)"
        )
    else:
        what = (
            f"discontinuity in {label}: rank {rec.rank} delivered samples_consumed {rec.at} "
            f"(step {rec.step}) right after samples_consumed {prev.next} (step {expected}) "
            "without a restore; a loader whose state was not loaded, or two runs share the file"
        )
    shown = ((f"{label} before", prev), (f"{label} then", rec))
    return Finding(expected, rec.rank, "discontinuity", what, shown)


def assemble(
    records: Sequence[Record], label: str = "A"
) -> tuple[dict[int, list[Record]], list[Finding]]:
    """Replay a trace's records in file order into (its final records per step, its own
    inconsistencies).

    A *restore* (a record flagged ``restored``) rolls the rank's timeline back to
    `_restore_point` (the superseded records are kept to check that replayed positions carry
    the same bytes). A record that does not continue the previous one without a restore is a
    *restart* (at 0) or a *discontinuity*, reported at the step the run should have delivered
    next; nothing the rank delivered from there on (until a restore rolls back before it)
    stands for a step, so the first divergent step is the true one whatever the lengths of the
    parts."""
    timelines: dict[int, list[Record]] = {}
    jumps: dict[int, dict[int, Record]] = {}  # rank -> index in its timeline -> record before
    arrivals: dict[int, list[Record]] = {}  # each rank's records in file order
    events: dict[int, list[tuple[list[Record], int]]] = {}  # (records gone back over, arrival)
    for rec in records:
        mine = timelines.setdefault(rec.rank, [])
        breaks = jumps.setdefault(rec.rank, {})
        arrived = arrivals.setdefault(rec.rank, [])
        cut = _restore_point(mine, rec.at) if mine else 0
        if (rec.restored or rec.at != mine[-1].next) if mine else False:
            # positions delivered again (restore, or a jump back) must carry the same bytes
            events.setdefault(rec.rank, []).append((mine[cut:], len(arrived)))
        if rec.restored:
            del mine[cut:]
            for index in [k for k in breaks if k >= cut]:
                del breaks[index]
        elif mine and rec.at != mine[-1].next:
            breaks[len(mine)] = mine[-1]
        mine.append(rec)
        arrived.append(rec)
    steps: dict[int, list[Record]] = {}
    findings: list[Finding] = []
    for rank, mine in timelines.items():
        breaks = jumps[rank]
        first = min(breaks, default=len(mine))
        for rec in mine[:first]:
            steps.setdefault(rec.step, []).append(rec)
        if breaks:
            findings.append(_break_finding(label, breaks[first], mine[first]))
    for rank, happened in events.items():
        ends = [start for _, start in happened[1:]] + [len(arrivals[rank])]
        for (gone, start), end in zip(happened, ends, strict=True):
            findings.extend(_conflicts(label, rank, gone, arrivals[rank][start:end]))
    for step, recs in sorted(steps.items()):
        findings.extend(_overlaps(label, step, recs))
    return steps, findings


def _overlaps(label: str, step: int, records: list[Record]) -> Iterator[Finding]:
    """Positions delivered by two ranks in one step (each rank's own final records never
    overlap)."""
    spans = sorted(
        ((first, first + n, k) for k, rec in enumerate(records) for first, n in rec.runs)
    )
    reach, owner = -1, 0
    for start, end, k in spans:
        if start < reach:
            a, b = records[owner], records[k]
            yield Finding(
                step,
                min(a.rank, b.rank),
                "overlap",
                f"overlap in {label}: positions [{start}, {min(end, reach)}) of step {step} "
                f"were delivered twice, by rank {a.rank} and by rank {b.rank} (ranks built with "
                "different world sizes, data sharded twice, or rank files of different runs?)",
                ((f"{label} rank {a.rank}", a), (f"{label} rank {b.rank}", b)),
            )
            return
        reach, owner = end, k


def step_digests(records: Sequence[Record]) -> dict[int, dict[str, Any]]:
    """Per global step: merged positions, leaf descriptions and summed digests of the final records.

    Two runs that delivered the same samples at the same positions give equal
    values whatever their micro batch size, workers, resumes and replays.
    """
    out = {}
    for step, recs in sorted(assemble(records)[0].items()):
        cols, sums, _ = _summed(recs)
        out[step] = {
            "positions": [list(s) for s in _spans(recs)],
            "cols": cols,
            "batch_b3": {k: f"{v:064x}" for k, v in sorted(sums.items())},
        }
    return out


@dataclass(frozen=True)
class Comparison:
    """All differences between two traces (sorted: the first is the first divergence);
    ``steps``: the global steps either trace holds in the compared window, in order."""

    findings: tuple[Finding, ...]
    steps_compared: int
    steps: tuple[int, ...] = ()

    @property
    def first(self) -> Finding | None:
        return self.findings[0] if self.findings else None

    @property
    def steps_differing(self) -> int:
        return len({f.step for f in self.findings})


def _cross(step: int, a: list[Record], b: list[Record], labels: tuple[str, str]) -> Finding | None:
    la, lb = labels
    if not a or not b:
        have = a or b
        return Finding(
            step,
            min(r.rank for r in have),
            "missing",
            f"missing in {la if not a else lb}",
            tuple(((la if a else lb), r) for r in have[:2]),
        )
    for left, right in blocks(a, b):
        why = block_difference(left, right, labels)
        if why is not None:
            return Finding(
                step,
                min(r.rank for r in (*left, *right)),
                "differs",
                why,
                (*((la, r) for r in left[:2]), *((lb, r) for r in right[:2])),
            )
    return None


def compare(
    a: Sequence[Record],
    b: Sequence[Record],
    *,
    start: int = 0,
    stop: int | None = None,
    labels: tuple[str, str] = ("A", "B"),
) -> Comparison:
    """Differences between traces ``a`` and ``b`` in steps ``[start, stop)`` (each trace's own
    conflicts and discontinuities included), first divergence first; ``labels`` name the two
    runs in the reasons."""
    (steps_a, found_a), (steps_b, found_b) = assemble(a, labels[0]), assemble(b, labels[1])

    def inside(step: int) -> bool:
        return step >= start and (stop is None or step < stop)

    findings = [f for f in (*found_a, *found_b) if inside(f.step)]
    steps = sorted(s for s in set(steps_a) | set(steps_b) if inside(s))
    for step in steps:
        found = _cross(step, steps_a.get(step, []), steps_b.get(step, []), labels)
        if found is not None:
            findings.append(found)
    findings.sort(key=lambda f: (f.step, KIND_PRIORITY[f.kind], f.rank))
    return Comparison(tuple(findings), len(steps), tuple(steps))
