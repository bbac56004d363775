"""Weight changes during a run as ``mixture-v1`` phases (docs/design.md section 3, "Weights
changed during a run"): a change at global position ``p`` is a new phase starting at ``p``;
the phases before it keep their indices, keys and offsets, so every earlier position keeps its
source and index and each source's stream continues without a repeat or a skip.
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

    A phase starting exactly at the position is replaced, later (planned) phases follow it
    again, and weights equal to those in force add no phase. The result equals
    `MixtureSchedule.build` of the resulting phases; a change costs O(log phases) plus
    O(sources) per phase built from it on, whatever the number of changes before it.
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
