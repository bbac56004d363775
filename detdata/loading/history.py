"""A run's batch history: which schedule and layout held from which step (the loader state's
``history``), the checked fields changed at resumes (`Change`), and its seal (`seal`).

Entries only ever append, so the steps and positions of everything before a change stay as
they were; the step <-> position map (`Plan.step_map`) follows the schedules. The rules:
docs/design.md, "Batch-size schedules and elastic resume".
"""

from __future__ import annotations

import bisect
import dataclasses
import functools
import numbers
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Final, TypeGuard

from detdata.base.canonical import canonical_json
from detdata.base.errors import ConfigError, StateError
from detdata.base.hashing import digest_bytes
from detdata.loading.layout import Layout
from detdata.order.batches import BatchSchedule, StepMap

K_HISTORY: Final = "history"
K_POSITION: Final = "position"
K_STEP: Final = "step"
K_BATCH: Final = "global_batch_size"
K_WORLD: Final = "world_size"
K_MICRO: Final = "micro_batch_size"
K_FIELD: Final = "field"
K_OLD: Final = "old"
K_NEW: Final = "new"
K_SEAL: Final = "history_b3"
#: The field of a weight change made during the run (`Plan.with_weights`), not at a resume.
K_WEIGHTS: Final = "mixture_weights"
_KEYS: Final = (K_POSITION, K_STEP, K_BATCH, K_WORLD, K_MICRO)
_CHANGE_KEYS: Final = (K_FIELD, K_POSITION, K_STEP, K_OLD, K_NEW)


def is_count(value: object, minimum: int = 0) -> TypeGuard[int]:
    """``value`` is a JSON-plain int ``>= minimum`` (a bool is not): the one check of the int
    fields of the documents detdata reads back (state, history, attestation, trace)."""
    return isinstance(value, int) and not isinstance(value, bool) and value >= minimum


def _checked_int(doc: Mapping[str, Any], key: str, where: str, minimum: int = 0) -> int:
    """``doc[key]``, an int ``>= minimum`` (`StateError` naming ``where.key`` otherwise)."""
    value = doc[key]
    if not is_count(value, minimum):
        kind = "positive" if minimum else "non-negative"
        raise history_error(f"{where}.{key} must be a {kind} integer, found {value!r}")
    return value


def history_error(message: str) -> StateError:
    """The `StateError` of a loader state's ``history`` (its ``fields`` name it)."""
    return StateError(message, fields=(K_HISTORY,))


def seal(history: object) -> str:
    """``b3:<hex>`` of a history's canonical JSON: the state's ``history_b3``."""
    return digest_bytes(canonical_json(history))


@dataclass(frozen=True, kw_only=True)
class Change:
    """A checked field changed by name at a resume: at ``position`` (the saved position, in
    step ``step``), from ``old`` to ``new`` (the field's JSON values)."""

    field: str
    position: int
    step: int
    old: Any
    new: Any

    def to_json(self) -> dict[str, Any]:
        return {key: getattr(self, key) for key in _CHANGE_KEYS}  # the keys name the fields

    @classmethod
    def from_json(cls, doc: Mapping[str, Any], i: int) -> Change:
        where = f"loader state history[{i}]"
        if set(doc) != set(_CHANGE_KEYS) or not isinstance(doc[K_FIELD], str):
            raise history_error(
                f"{where} (a change) must be an object with the keys {list(_CHANGE_KEYS)} and "
                f"a field name, found {doc!r:.120}"
            )
        return cls(
            field=doc[K_FIELD],
            position=_checked_int(doc, K_POSITION, where),
            step=_checked_int(doc, K_STEP, where),
            old=doc[K_OLD],
            new=doc[K_NEW],
        )

    def describe(self) -> str:
        return (
            f"{self.field!r} changed at position {self.position} (step {self.step}) from "
            f"{self.old!r:.80} to {self.new!r:.80}"
        )


@dataclass(frozen=True, kw_only=True)
class Entry:
    """From ``position`` on, ``schedule`` (in effect from step ``step``'s start) and a layout."""

    position: int
    step: int
    schedule: BatchSchedule
    world_size: int | None
    micro_batch_size: int | None

    def to_json(self) -> dict[str, Any]:
        return {
            K_POSITION: self.position,
            K_STEP: self.step,
            K_BATCH: self.schedule.to_json(),
            K_WORLD: self.world_size,
            K_MICRO: self.micro_batch_size,
        }

    @classmethod
    def from_json(cls, doc: object, i: int) -> Entry:
        where = f"loader state history[{i}]"
        if not isinstance(doc, Mapping) or set(doc) != set(_KEYS):
            raise history_error(
                f"{where} must be an object with the keys {list(_KEYS)}, found {doc!r:.120}"
            )
        position, step = _checked_int(doc, K_POSITION, where), _checked_int(doc, K_STEP, where)
        world, micro = (
            None if doc[k] is None else _checked_int(doc, k, where, 1) for k in (K_WORLD, K_MICRO)
        )
        try:
            schedule = BatchSchedule.from_json(doc[K_BATCH])
        except ConfigError as exc:
            raise history_error(f"{where}.{K_BATCH}: {exc}") from None
        return cls(
            position=position,
            step=step,
            schedule=schedule,
            world_size=world,
            micro_batch_size=micro,
        )


def _segments(entries: Sequence[Entry]) -> list[tuple[int, BatchSchedule]]:
    """Schedule segments: an entry starts one where its schedule differs from the one before."""
    out: list[tuple[int, BatchSchedule]] = []
    for entry in entries:
        if not out or entry.schedule != out[-1][1]:
            out.append((entry.step, entry.schedule))
    return out


@dataclass(frozen=True)
class Plan:
    """A run's entries (the last is in effect now), the step map they define, and the checked
    fields changed at resumes (``changes``, in the order they happened)."""

    entries: tuple[Entry, ...]
    changes: tuple[Change, ...] = ()

    @classmethod
    def fresh(cls, schedule: BatchSchedule, layout: Layout) -> Plan:
        """A run that starts with ``schedule`` and ``layout``."""
        return cls((_entry(0, 0, schedule, layout),))

    @functools.cached_property
    def step_map(self) -> StepMap:
        return StepMap(_segments(self.entries))

    @property
    def schedule(self) -> BatchSchedule:
        """The schedule in effect now."""
        return self.entries[-1].schedule

    def step_of(self, position: int) -> int:
        return self.step_map.step_of(position)

    def start_of(self, step: int) -> int:
        return self.step_map.start_of(step)

    def batch_of(self, step: int) -> int:
        return self.step_map.batch_of(step)

    @property
    def single_constant(self) -> bool:
        """One constant global batch for the whole run."""
        return len(_segments(self.entries)) == 1 and self.schedule.is_constant

    def with_layout(self, position: int, layout: Layout) -> Plan:
        """The same schedule with ``layout`` from ``position`` on."""
        last = self.entries[-1]
        if (last.world_size, last.micro_batch_size) == (layout.world_size, layout.micro_batch_size):
            return self
        # at the last entry's position nothing was delivered with its layout: it is replaced
        step = last.step if position == last.position else self.step_of(position)
        return self._with_entry(_entry(position, step, last.schedule, layout))

    def _with_entry(self, entry: Entry) -> Plan:
        """``entry`` appended, or in place of the last entry when it starts where that one does."""
        last = self.entries[-1]
        same = (entry.position, entry.step) == (last.position, last.step)
        kept = self.entries[:-1] if same else self.entries
        return Plan((*kept, entry), self.changes)

    def with_change(self, field: str, position: int, old: Any, new: Any) -> Plan:
        """``field`` changed from ``old`` to ``new`` at the resume position ``position``."""
        step = self.step_of(position)
        change = Change(field=field, position=position, step=step, old=old, new=new)
        changes = list(self.changes)  # after any at or before it: a weight change may be pending
        bisect.insort(changes, change, key=lambda c: c.position)  # changes ascend by position
        return Plan(self.entries, tuple(changes))

    def with_weights(self, position: int, old: Any, new: Any) -> Plan:
        """Mixture weights changed during the run: ``new`` (``{name: "p/q"}``) in force from
        ``position`` (the first position of a step) on, ``old`` before. A change not yet in
        effect at the same position (asked again before its step started) is replaced."""
        changes = self.changes
        if changes and changes[-1].field == K_WEIGHTS and changes[-1].position == position:
            changes = changes[:-1]
        change = Change(
            field=K_WEIGHTS, position=position, step=self.step_of(position), old=old, new=new
        )
        return Plan(self.entries, (*changes, change))

    def weight_changes(self) -> list[Change]:
        """The mixture weight changes made during the run, in order (`with_weights`)."""
        return [c for c in self.changes if c.field == K_WEIGHTS]

    def changes_after(self, position: int, fields: Sequence[str]) -> list[Change]:
        """The changes of ``fields`` made at a position after ``position``, in order."""
        return [c for c in self.changes if c.field in fields and c.position > position]

    def with_schedule(self, position: int, schedule: BatchSchedule, layout: Layout) -> Plan:
        """``schedule`` from the start of the step ``position`` falls in, ``layout`` from
        ``position`` on (a deliberate global-batch change at a resume).

        The step being accumulated at ``position`` keeps its first position and is completed
        by the new batch; `StateError` when more than that batch was delivered in it already.
        """
        step = self.step_of(position)
        start = self.start_of(step)
        batch = schedule.batch_at(step, start)
        if position - start > batch:
            raise StateError(
                f"cannot change the global batch at samples_consumed={position}: "
                f"{position - start} samples of step {step} (which starts at {start}) were "
                f"delivered already, more than the new global batch {batch} of that step; "
                "hint: save the state at a step boundary before changing the global batch",
                fields=(K_BATCH,),
            )
        return self._with_entry(_entry(position, step, schedule, layout))

    def rewound_to(self, position: int) -> Plan:
        """The history as a run that stopped at ``position`` (the first position of the step
        the last entry's position falls in, or earlier in that step) would have written it.

        Entries that began after ``position`` lie inside that same step (a layout or
        global-batch change at a mid-step resume); the last of them is kept, moved to
        ``position``: its schedule is in effect from the step's start either way, and its
        layout is replaced by the resuming loader's. A change of a checked field recorded
        inside the step (`Change`) cannot be moved: `StateError`.
        """
        # a weight change lies at a step's first position: it is never inside a step
        inside = [c for c in self.changes if c.position > position and c.field != K_WEIGHTS]
        if inside:
            raise history_error(
                f"cannot re-deliver the step from position {position}: the history records "
                f"{inside[0].describe()}, inside that step; hint: load_state_dict(state, "
                "mid_step='continue') resumes where the state was saved"
            )
        keep = tuple(e for e in self.entries if e.position <= position)
        later = [e for e in self.entries if e.position > position]
        if not later:
            return self
        moved = dataclasses.replace(later[-1], position=position)
        if keep and keep[-1].position == position and keep[-1].step == moved.step:
            keep = keep[:-1]
        return Plan((*keep, moved), self.changes)

    def check_continues(self, layout: Layout, position: int) -> None:
        """``layout`` can continue at ``position``: a micro-step boundary of its step
        (`StateError`), and every global batch from there on divides into its micro steps
        (`ConfigError`, `check_fits`)."""
        layout.check_resume_position(position, self.start_of(self.step_of(position)))
        self.check_fits(layout, position)

    def check_fits(self, layout: Layout, position: int) -> None:
        """Every global batch from the step of ``position`` on divides into ``layout``'s
        micro steps (`ConfigError` naming the first that does not)."""
        per = layout.samples_per_micro_step
        pieces = self.step_map.batches_from(self.step_of(position))
        for piece in pieces:
            if piece.batch % per:
                batches = sorted({p.batch for p in pieces})
                raise ConfigError(
                    f"global batch {piece.batch} (steps from {piece.step}, position "
                    f"{piece.position}, of the batch schedule) is not divisible by "
                    f"micro_batch_size {layout.micro_batch_size} x world_size "
                    f"{layout.world_size} = {per}; hint: choose a micro batch whose product "
                    f"with the world size divides every global batch of the schedule "
                    f"({batches})"
                )

    def check_settles(self, layout: Layout) -> None:
        """The global batch the run settles on (its last, open-ended run of equal batches)
        divides into ``layout``'s micro steps: every run with ``layout`` reaches it, fresh or
        resumed. Earlier batches are checked from the position a loader starts at
        (`check_fits`): a resume past a ramp-up need not fit the ramp's batches."""
        self.check_fits(layout, self.step_map.pieces[-1].position)

    def check_step_end(self, total: int) -> None:
        """``total`` samples end a step (`ConfigError`: the last step would be partial)."""
        step = self.step_of(total)
        start = self.start_of(step)
        if start != total:
            raise ConfigError(
                f"total_samples {total} is not a step boundary: it falls inside step {step} "
                f"(positions [{start}, {start + self.batch_of(step)}), global_batch_size "
                f"{self.batch_of(step)}); the last step would be partial; hint: "
                f"total_samples={start} or {start + self.batch_of(step)}"
            )

    def to_json(self) -> list[dict[str, Any]]:
        """Layout entries and changes in one list, by position (a change after the layout
        entries at its position)."""
        out: list[dict[str, Any]] = []
        changes = list(self.changes)
        for e in self.entries:
            while changes and changes[0].position < e.position:
                out.append(changes.pop(0).to_json())
            out.append(e.to_json())
        out.extend(c.to_json() for c in changes)
        return out

    @classmethod
    def from_json(cls, doc: object) -> Plan:
        """Parse and check a state's history (`StateError` naming ``history``)."""
        if not isinstance(doc, list) or not doc:
            raise history_error(
                f"loader state field {K_HISTORY!r} must be a non-empty list, found {doc!r:.80}"
            )
        parsed = [
            Change.from_json(d, i)
            if isinstance(d, Mapping) and K_FIELD in d
            else Entry.from_json(d, i)
            for i, d in enumerate(doc)
        ]
        _check_ascending(parsed)
        entries = tuple(e for e in parsed if isinstance(e, Entry))
        changes = tuple(c for c in parsed if isinstance(c, Change))
        if not entries:
            raise history_error("loader state history holds changes but no batch entry")
        if (entries[0].position, entries[0].step) != (0, 0):
            raise history_error("loader state history[0] must start at position 0, step 0")
        for i in range(1, len(entries)):
            a, b = entries[i - 1], entries[i]
            if b.position < a.position or b.step < a.step:
                raise history_error(
                    f"loader state history[{i}] (position {b.position}, step {b.step}) goes "
                    f"back from history[{i - 1}] (position {a.position}, step {a.step})"
                )
        try:
            plan = cls(entries, changes)
            plan.step_map  # noqa: B018  # compiled now: a bad history fails here
        except ConfigError as exc:
            raise history_error(f"loader state history: {exc}") from None
        for i, e in enumerate(entries):
            start, end = plan.start_of(e.step), plan.start_of(e.step + 1)
            if not start <= e.position <= end:
                raise history_error(
                    f"loader state history[{i}]: position {e.position} is not in step "
                    f"{e.step} (positions [{start}, {end})) of the schedules the history "
                    "gives; the state was edited or corrupted"
                )
        for c in changes:
            if plan.step_of(c.position) != c.step:
                raise history_error(
                    f"loader state history: the change {c.describe()} names step {c.step}, but "
                    f"position {c.position} is in step {plan.step_of(c.position)}; the state "
                    "was edited or corrupted"
                )
        return plan


def _check_ascending(parsed: Sequence[Entry | Change]) -> None:
    """A change never lies before what is listed ahead of it, nor an entry before a change."""
    for i in range(1, len(parsed)):
        a, b = parsed[i - 1], parsed[i]
        if (isinstance(a, Change) or isinstance(b, Change)) and b.position < a.position:
            raise history_error(
                f"loader state history[{i}] (position {b.position}) goes back from "
                f"history[{i - 1}] (position {a.position})"
            )


def _entry(position: int, step: int, schedule: BatchSchedule, layout: Layout) -> Entry:
    return Entry(
        position=position,
        step=step,
        schedule=schedule,
        world_size=layout.world_size,
        micro_batch_size=layout.micro_batch_size,
    )


def upgraded_history(global_batch: object, layout: Mapping[str, Any]) -> list[dict[str, Any]]:
    """The history of a state written before histories existed: one entry from position 0
    (a layout value that is not a positive int is None)."""
    sizes = {
        k: v if is_count(v, 1) else None
        for k, v in ((K_WORLD, layout.get(K_WORLD)), (K_MICRO, layout.get(K_MICRO)))
    }
    return [{K_POSITION: 0, K_STEP: 0, K_BATCH: global_batch, **sizes}]


def as_schedule(value: object) -> BatchSchedule:
    """``global_batch_size=``: an int (one global batch) or a `BatchSchedule`."""
    if isinstance(value, BatchSchedule):
        return value
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise ConfigError(
            f"global_batch_size must be a positive integer or a detdata.BatchSchedule, got "
            f"{value!r:.80} ({type(value).__name__})"
        )
    return BatchSchedule.constant(int(value))
