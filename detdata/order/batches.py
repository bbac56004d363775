"""Global batch schedules: the global batch of every step, and the step <-> position map
(docs/design.md, "Batch-size schedules and elastic resume").

Step ``t`` covers positions ``[c(t), c(t) + B(t))``, ``c(t) = B(0) + ... + B(t - 1)``. A
`BatchSchedule` lists its changes ``((0, B0), (a1, B1), ...)`` in one `BatchUnit`: ``STEPS``
(``B(t)`` is the batch of the last change with ``a_i <= t``) or ``SAMPLES`` (the last change
with ``a_i <= c(t)``: it takes effect at the first step that starts at or after it). A
`StepMap` joins the schedules of a run's segments. Pure functions of integers.
"""

from __future__ import annotations

import bisect
import enum
import operator
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Final

from detdata.base.checks import check_count
from detdata.base.errors import ConfigError

K_UNIT: Final = "unit"
K_CHANGES: Final = "changes"


class BatchUnit(enum.Enum):
    """What the ``at`` of a schedule change counts."""

    STEPS = "steps"
    SAMPLES = "samples"


@dataclass(frozen=True)
class Piece:
    """A run of steps of one global batch: step ``step`` starts at ``position``."""

    step: int
    position: int
    batch: int


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def _pair(item: object, i: int) -> tuple[int, int]:
    if isinstance(item, (str, bytes)) or not isinstance(item, Sequence) or len(item) != 2:
        raise ConfigError(
            f"BatchSchedule changes[{i}] must be a pair (at, global_batch), got {item!r:.80}"
        )
    at = check_count(item[0], f"BatchSchedule changes[{i}] at", minimum=0)
    batch = check_count(item[1], f"BatchSchedule changes[{i}] global batch")
    return at, batch


@dataclass(frozen=True, kw_only=True)
class BatchSchedule:
    """The global batch of every step: ``changes`` ``((0, B0), (a1, B1), ...)`` in ``unit``.

    ``changes[0]`` is at 0 (the batch the run starts with); later ``at`` values strictly
    increase and each change sets another batch than the one before (so equal schedules
    have equal changes: the identity is the list of changes). A schedule with one change
    is constant (its unit is then ``STEPS``). Build one with `constant`, `by_steps`,
    `by_samples` or `rampup`; `to_json` is its identity (an int when constant).
    """

    changes: tuple[tuple[int, int], ...]
    unit: BatchUnit = BatchUnit.STEPS

    def __post_init__(self) -> None:
        raw: object = self.changes
        if isinstance(raw, (str, bytes)) or not isinstance(raw, Iterable):
            raise ConfigError(
                f"BatchSchedule changes must be a list of (at, global_batch) pairs, got {raw!r:.80}"
            )
        changes = tuple(_pair(item, i) for i, item in enumerate(raw))
        if not changes or changes[0][0] != 0:
            raise ConfigError(
                f"BatchSchedule changes must start with (0, global_batch), the batch the run "
                f"starts with; got {list(changes)[:3]!r}"
            )
        for i in range(1, len(changes)):
            (a0, b0), (a1, b1) = changes[i - 1], changes[i]
            if a1 <= a0:
                raise ConfigError(
                    f"BatchSchedule changes[{i}] is at {a1}, not after changes[{i - 1}] at "
                    f"{a0}; hint: list the changes in increasing order, once each"
                )
            if b1 == b0:
                raise ConfigError(
                    f"BatchSchedule changes[{i}] repeats the global batch {b1} of "
                    f"changes[{i - 1}]; hint: drop it (a schedule is its list of changes)"
                )
        try:
            unit = BatchUnit(self.unit)  # a unit or its value
        except ValueError:
            raise ConfigError(
                f"BatchSchedule unit must be one of {[u.value for u in BatchUnit]}, "
                f"got {self.unit!r}"
            ) from None
        object.__setattr__(self, "changes", changes)
        object.__setattr__(self, "unit", BatchUnit.STEPS if len(changes) == 1 else unit)

    # ------------------------------------------------------------ constructors
    @classmethod
    def constant(cls, global_batch_size: int) -> BatchSchedule:
        """One global batch for every step."""
        return cls(changes=((0, check_count(global_batch_size, "global_batch_size")),))

    @classmethod
    def by_steps(cls, changes: Iterable[tuple[int, int]]) -> BatchSchedule:
        """Explicit ``(step, global_batch)`` changes, the first at step 0."""
        return cls(changes=tuple(changes), unit=BatchUnit.STEPS)

    @classmethod
    def by_samples(cls, changes: Iterable[tuple[int, int]]) -> BatchSchedule:
        """``(samples, global_batch)`` changes, the first at 0: each from the first step that
        starts at or after that many samples (a token-counted warm-up: tokens // seq_len)."""
        return cls(changes=tuple(changes), unit=BatchUnit.SAMPLES)

    @classmethod
    def rampup(
        cls, start: int, increment: int, ramp_samples: int, *, global_batch_size: int
    ) -> BatchSchedule:
        """Megatron-LM's ``--rampup-batch-size <start> <increment> <ramp_samples>`` compiled to
        ``SAMPLES`` changes of exactly its function, float division included (docs/design.md,
        "Batch-size schedules and elastic resume")."""
        gbs = check_count(global_batch_size, "global_batch_size")
        first = check_count(start, "rampup start")
        inc = check_count(increment, "rampup increment")
        ramp = check_count(ramp_samples, "rampup ramp_samples")
        diff = gbs - first
        if diff <= 0:
            raise ConfigError(
                f"rampup start {first} must be below global_batch_size {gbs} (Megatron "
                "requires start <= global and divides by their difference); hint: use "
                "BatchSchedule.constant for one global batch"
            )
        if diff % inc:
            raise ConfigError(
                f"rampup: global_batch_size {gbs} - start {first} = {diff} is not divisible "
                f"by increment {inc} (as Megatron requires); hint: pick an increment that "
                "divides the difference"
            )
        n = diff // inc
        per_increment = ramp / n

        def stage(consumed: int) -> int:
            return n if consumed > ramp else int(consumed / per_increment)

        at: dict[int, int] = {0: first}
        for k in range(1, n + 1):
            c = _ceil_div(k * ramp, n)  # the exact-rational boundary; the float one is near
            while c > 0 and stage(c - 1) >= k:
                c -= 1
            while stage(c) < k:
                c += 1
            at[c] = first + k * inc  # several stages at one position (ramp < n): the last wins
        return cls.by_samples(sorted(at.items()))

    # ---------------------------------------------------------------- identity
    @property
    def is_constant(self) -> bool:
        return len(self.changes) == 1

    def to_json(self) -> int | dict[str, Any]:
        """The identity: the global batch if constant, else ``{"unit", "changes"}``."""
        if self.is_constant:
            return self.changes[0][1]
        return {K_UNIT: self.unit.value, K_CHANGES: [[a, b] for a, b in self.changes]}

    @classmethod
    def from_json(cls, doc: object) -> BatchSchedule:
        """The schedule `to_json` wrote (`ConfigError` for anything else)."""
        if isinstance(doc, Mapping):
            if set(doc) != {K_UNIT, K_CHANGES}:
                raise ConfigError(
                    f"a batch schedule object has the keys {[K_UNIT, K_CHANGES]}, found "
                    f"{sorted(map(str, doc))}"
                )
            return cls(changes=doc[K_CHANGES], unit=doc[K_UNIT])
        return cls.constant(doc)  # type: ignore[arg-type]  # validated there

    # ------------------------------------------------------------------ mapping
    def _ats(self) -> list[int]:
        return [a for a, _ in self.changes]

    def batch_at(self, step: int, position: int) -> int:
        """The global batch of step ``step`` when it starts at ``position``."""
        key = step if self.unit is BatchUnit.STEPS else position
        return self.changes[bisect.bisect_right(self._ats(), key) - 1][1]

    def pieces(self, step: int, position: int) -> tuple[Piece, ...]:
        """The runs of equal batches from step ``step`` (starting at ``position``) on: O(changes).

        The last piece goes on forever.
        """
        ats = self._ats()
        out = [Piece(step, position, self.batch_at(step, position))]
        by_steps = self.unit is BatchUnit.STEPS
        i = bisect.bisect_right(ats, step if by_steps else position)
        while i < len(ats):
            cur = out[-1]
            count = ats[i] - cur.step if by_steps else _ceil_div(ats[i] - cur.position, cur.batch)
            s, p = cur.step + count, cur.position + count * cur.batch
            batch = self.batch_at(s, p)
            if batch != cur.batch:  # a step may cross several sample changes at once
                out.append(Piece(s, p, batch))
            i = bisect.bisect_right(ats, s if by_steps else p)
        return tuple(out)


class StepMap:
    """Step <-> position map of a run: schedule segments ``(T_i, schedule_i)``.

    Segment 0 starts at step 0, position 0; segment ``i`` is in effect from step ``T_i``,
    which starts where segments ``< i`` put it. Steps strictly increase (a later segment
    at the same step replaces the earlier). Raises `ConfigError` for anything else.
    """

    def __init__(self, segments: Sequence[tuple[int, BatchSchedule]]) -> None:
        if not segments or segments[0][0] != 0:
            raise ConfigError("a step map's first segment starts at step 0")
        #: The runs of equal global batches, in order (the last goes on forever).
        self.pieces: tuple[Piece, ...] = ()
        last = 0
        for step, schedule in segments:
            if step < last:
                raise ConfigError(
                    f"step map segments must not go back in steps: step {step} after {last}"
                )
            last = step
            start = self.start_of(step) if self.pieces else 0
            pieces: list[Piece] = list(
                self.pieces[: bisect.bisect_left(self.pieces, step, key=_STEP)]
            )
            for piece in schedule.pieces(step, start):
                if not pieces or pieces[-1].batch != piece.batch:  # else the same batch goes on
                    pieces.append(piece)
            self.pieces = tuple(pieces)

    def _piece(self, step: int) -> Piece:
        return self.pieces[bisect.bisect_right(self.pieces, step, key=_STEP) - 1]

    def start_of(self, step: int) -> int:
        """First position of step ``step``."""
        piece = self._piece(step)
        return piece.position + (step - piece.step) * piece.batch

    def step_of(self, position: int) -> int:
        """The step position ``position`` belongs to."""
        piece = self.pieces[bisect.bisect_right(self.pieces, position, key=_POSITION) - 1]
        return piece.step + (position - piece.position) // piece.batch

    def batch_of(self, step: int) -> int:
        """Global batch of step ``step``."""
        return self._piece(step).batch

    def batches_from(self, step: int) -> tuple[Piece, ...]:
        """The pieces that hold steps ``>= step`` (the first one possibly begun earlier)."""
        return self.pieces[bisect.bisect_right(self.pieces, step, key=_STEP) - 1 :]


_STEP: Final = operator.attrgetter("step")
_POSITION: Final = operator.attrgetter("position")
