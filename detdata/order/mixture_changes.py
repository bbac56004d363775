"""Weight changes during a run as ``mixture-v1`` phases (pure functions; docs/design.md).

A weight change at global position ``p`` (the first position of a global step) is a new
phase of the `MixtureSchedule` starting at ``p`` (`change_schedule`): the phases before ``p``
keep their indices, keys and offsets, so every earlier position keeps its source and index,
and each source's stream continues from its consumed count without a repeat or a skip. The
schedule stays the one pure function of the root seed and the phases' ``(start,
proportions)``: an uninterrupted run and a run resumed any number of times that apply the
same changes at the same positions deliver the same samples.

`change_schedule` builds the schedule after a change incrementally: the phases the change
leaves as they were are reused, only the phases from the change on are built
(O(sources) each), so a run with ``n`` changes costs O(n) phase builds in all, not O(n²).
A position -> source lookup bisects the phase starts: O(log phases) (`MixtureSchedule`).
"""

from __future__ import annotations

import bisect
from collections.abc import Sequence

from detdata.base.checks import check_count
from detdata.base.errors import ConfigError
from detdata.base.types import MAX_POSITION
from detdata.order.mixing import MixtureSchedule, next_phase


def change_schedule(
    schedule: MixtureSchedule, seed: int, changes: Sequence[tuple[int, Sequence[int]]]
) -> MixtureSchedule:
    """``schedule`` (built under root ``seed``) after each of ``changes`` in turn: integer
    ``weights`` (from `detdata.order.mixing.normalize_weights`, sorted-name order) in force
    from global ``position`` on, for each ``(position, weights)``.

    One change keeps the phases starting before its position as they are (same index, key
    and offsets); a phase starting exactly there (an earlier change not yet in effect, or
    a planned phase) is replaced; the phases starting after it (a planned curriculum)
    follow it again: the latest event wins. When the phase in force just before the
    position already has those weights, no phase is added (that phase continues). The
    result equals `MixtureSchedule.build` of the resulting phases; a change costs O(log
    phases) to find its place plus O(sources) per phase built from there on (the phases
    after it: none without a planned schedule), whatever the number of changes before it.
    """
    phases = list(schedule.phases)
    starts = [ph.start for ph in phases]
    for position, weights in changes:
        p = check_count(position, "position", minimum=0, maximum=MAX_POSITION - 1)
        w = tuple(int(v) for v in weights)
        if len(w) != len(phases[0].weights):
            raise ConfigError(
                f"weights change at position {p}: {len(w)} weights for "
                f"{len(phases[0].weights)} sources"
            )
        kept = bisect.bisect_left(starts, p)
        tail = [(ph.start, ph.weights) for ph in phases[kept:] if ph.start > p]
        if kept == 0 or phases[kept - 1].weights != w:
            tail.insert(0, (p, w))
        if kept + len(tail) == len(phases) and all(
            (ph.start, ph.weights) == t for ph, t in zip(phases[kept:], tail, strict=True)
        ):
            continue  # nothing changes
        del phases[kept:], starts[kept:]
        for start, tail_weights in tail:
            phases.append(next_phase(phases, seed, start, tail_weights))
            starts.append(start)
    if len(phases) == len(schedule.phases) and all(
        a is b for a, b in zip(phases, schedule.phases, strict=True)
    ):
        return schedule
    return MixtureSchedule(tuple(phases))
