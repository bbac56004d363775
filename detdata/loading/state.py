"""Loader state: one JSON object, versioned, compared field by field on resume.

It counts samples *delivered* to the caller (global, all ranks). Checked fields must match on
resume unless allowed by name; layout and environment are informational. The fields and
formats 1 to 5: docs/design.md section 5 and "Batch-size schedules and elastic resume".
"""

from __future__ import annotations

import dataclasses
import functools
import json
import platform
import sys
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any, Final, Protocol, runtime_checkable

from detdata.base.canonical import canonical_json
from detdata.base.errors import ConfigError, StateError
from detdata.base.hashing import digest_bytes
from detdata.base.types import MAX_POSITION
from detdata.datasets.exclusions import FIELD, split_identity
from detdata.loading.attest import Attestation
from detdata.loading.history import (
    K_HISTORY,
    K_SEAL,
    K_WEIGHTS,
    Plan,
    history_error,
    is_count,
    seal,
    upgraded_history,
)
from detdata.loading.steps import K_STEP_POSITION, MidStep, StepPosition, log, resume_position
from detdata.order.batches import BatchSchedule

STATE_VERSION: Final = 5
#: Versions this detdata reads (an older one is upgraded: `_UPGRADES`).
READABLE_VERSIONS: Final = (1, 2, 3, 4, 5)
K_VERSION: Final = "format_version"
K_KIND: Final = "kind"
KIND: Final = "detdata.loader_state"
K_CONSUMED: Final = "samples_consumed"
K_SEED: Final = "seed"
K_STREAM_SEED: Final = "stream_seed"
K_MANIFESTS: Final = "manifests"
K_DATA: Final = "data"
K_ALGORITHM: Final = "algorithm"
K_MIXTURE: Final = "mixture"
K_GLOBAL_BATCH: Final = "global_batch_size"
K_TRANSFORM: Final = "transform"
K_STREAM: Final = "stream"
K_LAYOUT: Final = "layout"
K_ENV: Final = "environment"
K_EXCLUSIONS: Final = FIELD  # "exclusions": `detdata.datasets.exclusions` raises with it
K_ATTESTATION: Final = "attestation"  # `detdata.loading.attest.Attestation` (format 5)

#: Fields that must match on resume unless named in ``allow=`` (docs/design.md section 5).
CHECKED_FIELDS: Final = (
    K_MANIFESTS,
    K_DATA,
    K_SEED,
    K_STREAM_SEED,
    K_ALGORITHM,
    K_MIXTURE,
    K_GLOBAL_BATCH,
    K_TRANSFORM,
    K_EXCLUSIONS,
)
_REQUIRED: Final = (
    K_KIND,
    K_VERSION,
    K_CONSUMED,
    *CHECKED_FIELDS,
    K_STREAM,
    K_HISTORY,
    K_SEAL,
    K_ATTESTATION,
)
#: Top-level stream identity keys checked through their own field instead of ``data``.
_TOP_LEVEL_VOLATILE: Final = ("schedule", "seed", "algorithm")


@runtime_checkable
class Stateful(Protocol):
    """Anything with resumable state (the torch.distributed.checkpoint protocol)."""

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state_dict: dict[str, Any]) -> None: ...


def _collect(obj: Any, key: str) -> Iterator[str]:
    if isinstance(obj, Mapping):
        for k, v in obj.items():
            if k == key and isinstance(v, str):
                yield v
            else:
                yield from _collect(v, key)
    elif isinstance(obj, list):
        for v in obj:
            yield from _collect(v, key)


def identity_fields(
    identity: Mapping[str, Any],
    seed: int,
    global_batch: int | Mapping[str, Any],
    *,
    stream_seed: int | None,
    transform: str | None,
) -> dict[str, Any]:
    """The checked fields derived from a stream identity and the loader's own inputs.

    Every input that can change a delivered byte lands in exactly one field, so each is
    allowed by its own name: nested parameters in ``data``, the top-level seed in ``seed``
    (loader-wrapped dataset) or ``stream_seed`` (a stream the caller built), an `Excluded`
    wrapper's rule and history in ``exclusions`` (`split_identity`). ``global_batch`` is
    the schedule's identity (`BatchSchedule.to_json`).
    """
    core, exclusions = split_identity(identity)
    data = {k: v for k, v in core.items() if k not in _TOP_LEVEL_VOLATILE}
    is_mixture = core.get("type") == "mixture"
    return {
        K_MANIFESTS: sorted({*_collect(identity, "manifest"), *_collect(identity, "digest")}),
        K_DATA: digest_bytes(canonical_json(data)),
        K_SEED: seed,
        K_STREAM_SEED: stream_seed,
        K_ALGORITHM: sorted(set(_collect(identity, "algorithm"))),
        K_MIXTURE: digest_bytes(canonical_json(core.get("schedule"))) if is_mixture else None,
        K_GLOBAL_BATCH: global_batch,
        K_TRANSFORM: transform,
        K_EXCLUSIONS: exclusions,
    }


def transform_identity(
    transform_id: str | None, transform: object, collate_fn: object
) -> str | None:
    """The checked ``transform`` field: what user code does to samples after the read.

    ``transform_id`` (a user-chosen name such as ``"tokenize-v3"``) names the
    transform when given; otherwise its `callable_name` does. ``collate_fn`` is
    always recorded by its `callable_name`. So a swapped, renamed or re-parametrised
    function (other `functools.partial` arguments, a callable object with other
    plain attributes) is refused on resume; an edited function body is not: give a
    ``transform_id`` and change it when the code changes. None when neither is set.
    """
    parts = []
    if transform_id is not None:
        parts.append(f"id:{transform_id}")
    elif transform is not None:
        parts.append(f"transform:{callable_name(transform)}")
    if collate_fn is not None:
        parts.append(f"collate_fn:{callable_name(collate_fn)}")
    return "+".join(parts) or None


def callable_name(fn: object) -> str:
    """``module.qualname`` of a function or a callable object's class, plus its parameters.

    Parameters are a `functools.partial`'s bound arguments, or a callable object's
    attributes (``vars``). Plain JSON values enter as a blake3 of their canonical
    JSON (``[b3:...]``); any other value by its type only (``<Tokenizer>``), since
    its repr may hold memory addresses that differ per process.
    """
    params: list[Any] = []
    inner = fn
    while isinstance(inner, functools.partial):
        params.append(
            {
                "args": [_plain(a) for a in inner.args],
                "keywords": {k: _plain(v) for k, v in sorted(inner.keywords.items())},
            }
        )
        inner = inner.func
    is_function = hasattr(inner, "__code__") or isinstance(inner, type)
    module = getattr(inner, "__module__", None) or type(inner).__module__
    qual = getattr(inner, "__qualname__", None) if is_function else None
    qual = qual or type(inner).__qualname__
    if not is_function and hasattr(inner, "__dict__"):
        params.append({k: _plain(v) for k, v in sorted(vars(inner).items())})
    name = f"{module}.{qual}"
    if params:
        name += f"[{digest_bytes(canonical_json(params))[:19]}]"
    return name


def _plain(value: Any) -> Any:
    """``value`` if it is plain JSON (recursively), else ``"<TypeName>"``."""
    if value is None or isinstance(value, (str, bool, int)):
        return value
    if isinstance(value, float):
        return value if value == value and abs(value) != float("inf") else repr(value)
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if isinstance(value, dict) and all(isinstance(k, str) for k in value):
        return {k: _plain(v) for k, v in value.items()}
    return f"<{type(value).__module__}.{type(value).__qualname__}>"


def environment() -> dict[str, str]:
    """Library versions and platform (informational only)."""
    import numpy
    import torch

    from detdata.base.version import VERSION

    return {
        "detdata": VERSION,
        "torch": str(torch.__version__),
        "numpy": str(numpy.__version__),
        "python": sys.version.split()[0],
        "platform": platform.platform(),
    }


@dataclass(frozen=True, kw_only=True)
class LoaderState:
    """Parsed, validated loader state."""

    samples_consumed: int
    fields: Mapping[str, Any]
    stream: Mapping[str, Any]
    layout: Mapping[str, Any]
    env: Mapping[str, Any]
    upgraded_from: int | None = None  # the format version read, when older than STATE_VERSION
    history: tuple[Mapping[str, Any], ...] = ()  # the run's batch history (`Plan.to_json`)
    history_b3: str | None = None  # the seal read (None: computed when written)
    attestation: Attestation | None = None  # the samples before the save point (`attest`)

    @property
    def plan(self) -> Plan:
        """The saved run's batch history and step map."""
        return Plan.from_json(list(self.history))

    @property
    def step_position(self) -> StepPosition:
        """Where ``samples_consumed`` lies in the saved run's global steps (the state's
        ``step_position``: a state saved inside a step says so)."""
        return StepPosition.of(self.plan, self.samples_consumed)

    def resumed(self, mid_step: MidStep, at_step: int | None = None) -> LoaderState:
        """This state as the resume continues from it: unchanged at a step boundary or with
        `MidStep.CONTINUE`; saved inside a step, by default (`MidStep.REDO`) the state at that
        step's first position, so the whole step is delivered again (`resume_position`).

        ``at_step``: the first position of that step instead (a trainer's restored optimizer
        step): the saved step, or the one before it when the state was saved at the end of
        that step (the trainer saved before its optimizer step: an exception-time checkpoint
        after the last micro batch was counted); anything else is a `StateError`.
        """
        if at_step is not None:
            position = self._start_of(at_step)
        else:
            position = resume_position(self.step_position, self.samples_consumed, mid_step)
        if position == self.samples_consumed:
            return self
        history = tuple(self.plan.rewound_to(position).to_json())
        return dataclasses.replace(self, samples_consumed=position, history=history)

    def _start_of(self, step: int) -> int:
        """The first position of the trainer's step ``step`` (logged when it re-delivers)."""
        here = self.step_position
        if not (step == here.step or (step == here.step - 1 and not here.inside)):
            raise StateError(
                f"cannot resume at step {step}: the state was saved at samples_consumed "
                f"{self.samples_consumed} ({here.delivered_in_step} samples into step "
                f"{here.step}); a resume goes back at most to the start of the step being "
                "trained when it was saved; hint: resume the trainer from the checkpoint this "
                "loader state was saved with",
                fields=(K_CONSUMED,),
            )
        position = self.plan.start_of(step)
        if position != self.samples_consumed:
            log.warning(
                "detdata: resuming at the trainer's optimizer step %d: re-delivering it whole "
                "from position %d (the state was saved at %d, %s)",
                step,
                position,
                self.samples_consumed,
                here.describe() if here.inside else "at the end of that step",
            )
        return position

    def to_json(self) -> dict[str, Any]:
        history = [dict(e) for e in self.history]
        return {
            K_KIND: KIND,
            K_VERSION: STATE_VERSION,
            K_CONSUMED: self.samples_consumed,
            **self.fields,
            K_STREAM: dict(self.stream),
            K_HISTORY: history,
            K_SEAL: seal(history),
            K_STEP_POSITION: self.step_position.to_json(),
            K_LAYOUT: dict(self.layout),
            K_ENV: dict(self.env),
            K_ATTESTATION: Attestation.json_of(self.attestation),
        }

    @classmethod
    def from_json(cls, state: object) -> LoaderState:
        if isinstance(state, (str, bytes)):
            text = state
            try:
                state = json.loads(text)
            except (ValueError, RecursionError) as exc:
                raise StateError(_not_json(text, exc)) from None
        if not isinstance(state, Mapping):
            raise StateError(f"loader state must be a JSON object, got {type(state).__name__}")
        if state.get(K_KIND) != KIND:
            raise StateError(
                f"not a detdata loader state: field 'kind' is {state.get(K_KIND)!r}, "
                f"expected {KIND!r}"
            )
        if state.get(K_VERSION) not in READABLE_VERSIONS or isinstance(state.get(K_VERSION), bool):
            raise StateError(
                f"unknown loader state format_version {state.get(K_VERSION)!r}; this "
                f"detdata reads {list(READABLE_VERSIONS)}; hint: upgrade detdata"
            )
        upgraded_from = None if state[K_VERSION] == STATE_VERSION else int(state[K_VERSION])
        for version, upgrade in _UPGRADES:
            if state[K_VERSION] == version:
                state = {**upgrade(state), K_VERSION: version + 1}
        missing = [k for k in _REQUIRED if k not in state]
        if missing:
            raise StateError(f"loader state is missing fields {missing}", fields=tuple(missing))
        consumed = state[K_CONSUMED]
        if not is_count(consumed):
            raise StateError(
                f"loader state field {K_CONSUMED!r} must be a non-negative integer, "
                f"found {consumed!r}",
                fields=(K_CONSUMED,),
            )
        if consumed >= MAX_POSITION:
            raise StateError(
                f"loader state field {K_CONSUMED!r} is {consumed}, beyond the last "
                f"addressable global position 2**62 - 1; the state was edited or "
                "corrupted",
                fields=(K_CONSUMED,),
            )
        stream = state[K_STREAM]
        if not isinstance(stream, Mapping):
            raise StateError("loader state field 'stream' must be an object", fields=(K_STREAM,))
        layout, env = state.get(K_LAYOUT, {}), state.get(K_ENV, {})
        if not isinstance(layout, Mapping) or not isinstance(env, Mapping):
            raise StateError("loader state fields 'layout' and 'environment' must be objects")
        history = state[K_HISTORY]
        if not isinstance(history, list):
            raise history_error(
                f"loader state field {K_HISTORY!r} must be a list, found {history!r:.80}"
            )
        parsed = cls(
            samples_consumed=consumed,
            fields={k: state[k] for k in CHECKED_FIELDS},
            stream=stream,
            layout=layout,
            env=env,
            upgraded_from=upgraded_from,
            history=tuple(history),
            history_b3=state[K_SEAL] if isinstance(state[K_SEAL], str) else repr(state[K_SEAL]),
            attestation=Attestation.from_json(state[K_ATTESTATION]),
        )
        parsed._check_consistent()
        parsed._check_history()
        return parsed

    def _check_history(self) -> None:
        """The history parses, ends with the saved schedule, and holds the saved position."""
        gbs = self.fields[K_GLOBAL_BATCH]
        try:
            BatchSchedule.from_json(gbs)
        except ConfigError as exc:
            raise StateError(
                f"loader state field {K_GLOBAL_BATCH!r} is not a batch schedule: {exc}",
                fields=(K_GLOBAL_BATCH,),
            ) from None
        plan = self.plan
        last = plan.entries[-1]
        if _norm(last.schedule.to_json()) != _norm(gbs):
            raise StateError(
                f"loader state is inconsistent: its history ends with the global batch "
                f"{last.schedule.to_json()!r:.80} but field {K_GLOBAL_BATCH!r} is {gbs!r:.80}; "
                "the state was edited or corrupted",
                fields=(K_HISTORY, K_GLOBAL_BATCH),
            )
        if self.samples_consumed < last.position:
            raise StateError(
                f"loader state is inconsistent: samples_consumed {self.samples_consumed} is "
                f"before the start {last.position} of its last history entry; the state was "
                "edited or corrupted",
                fields=(K_HISTORY, K_CONSUMED),
            )
        self._check_changes(plan)
        if self.history_b3 != seal([dict(e) for e in self.history]):
            raise history_error(
                f"loader state is inconsistent: its {K_HISTORY!r} does not match its seal "
                f"{K_SEAL!r} ({self.history_b3!r:.80}); the history was edited (an entry "
                "dropped, added or changed); hint: use the state exactly as "
                "DataLoader.state_dict() returned it"
            )

    def _check_changes(self, plan: Plan) -> None:
        """Each change names a checked field, lies at or before the saved position, starts from
        the value the field's previous change left, and the last leads to the saved field."""
        now: dict[str, Any] = {}
        for c in plan.changes:
            problem = None
            if c.field == K_WEIGHTS:  # made during the run: it moves the mixture field on
                now.pop(K_MIXTURE, None)
                continue
            if c.field not in CHECKED_FIELDS:
                problem = f"names {c.field!r}, not a checked field {list(CHECKED_FIELDS)}"
            elif c.position > self.samples_consumed:
                problem = f"lies after samples_consumed {self.samples_consumed}"
            elif c.field in now and _norm(now[c.field]) != _norm(c.old):
                problem = (
                    f"starts from {c.old!r:.80}, but the change before left {now[c.field]!r:.80}"
                )
            if problem is not None:
                raise history_error(
                    f"loader state history: the change {c.describe()} {problem}; the state was "
                    "edited or corrupted"
                )
            now[c.field] = c.new
        for key, value in now.items():
            if _norm(value) != _norm(self.fields.get(key)):
                raise StateError(
                    f"loader state is inconsistent: its history's last change of {key!r} leads "
                    f"to {value!r:.80}, but the field is {self.fields.get(key)!r:.80}; the "
                    "state was edited or corrupted",
                    fields=(K_HISTORY, key),
                )

    def _check_consistent(self) -> None:
        """The checked fields must be the ones derived from the saved ``stream`` identity (else
        the state was edited: a resume would continue from a history it does not describe)."""
        try:
            derived = identity_fields(
                self.stream,
                self.fields[K_SEED],
                self.fields[K_GLOBAL_BATCH],
                stream_seed=self.fields[K_STREAM_SEED],
                transform=self.fields[K_TRANSFORM],
            )
        except (TypeError, ValueError, RecursionError) as exc:
            raise StateError(
                f"loader state field 'stream' is not a plain JSON identity ({exc})",
                fields=(K_STREAM,),
            ) from None
        bad = [k for k in CHECKED_FIELDS if _norm(self.fields.get(k)) != _norm(derived.get(k))]
        bad += self._seed_mismatch()
        if bad:
            detail = "; ".join(
                f"{k}: stored {self.fields.get(k)!r:.80}, derived from 'stream' "
                f"{derived.get(k)!r:.80}"
                for k in bad
            )
            raise StateError(
                f"loader state is inconsistent: field(s) {bad} do not match its own "
                f"'stream' identity ({detail}); the state was edited or corrupted; "
                "hint: use the state exactly as DataLoader.state_dict() returned it",
                fields=tuple(bad),
            )

    def _seed_mismatch(self) -> list[str]:
        """The stream identity's own seed is ``stream_seed``, or ``seed`` when the loader wrapped
        it."""
        own, stream_seed = self.stream.get("seed"), self.fields[K_STREAM_SEED]
        expected = self.fields[K_SEED] if stream_seed is None else stream_seed
        return [] if own is None or _norm(own) == _norm(expected) else [K_STREAM_SEED]

    def differences(self, current: Mapping[str, Any]) -> list[str]:
        """Names of checked fields whose saved value differs from ``current``."""
        return [
            k
            for k in CHECKED_FIELDS
            if _norm(self.fields.get(k)) != _norm(current.get(k))
            and not self._format1_seed_equal(k, current)
        ]

    def _format1_seed_equal(self, key: str, current: Mapping[str, Any]) -> bool:
        """A format-1 state cannot say whether the caller or the loader built its stream when
        both seeds were equal (``stream_seed`` is then None): a caller-built stream with
        that same seed is the same order."""
        return (
            key == K_STREAM_SEED
            and self.upgraded_from == 1
            and self.fields.get(K_STREAM_SEED) is None
            and _norm(current.get(K_STREAM_SEED)) == _norm(self.fields.get(K_SEED))
        )


def _upgrade_v1(state: Mapping[str, Any]) -> dict[str, Any]:
    """Format 1 -> 2: ``stream_seed`` recovered from the saved stream identity (format 1
    checked only the loader's seed), no transform recorded."""
    stream = state.get(K_STREAM)
    own = stream.get("seed") if isinstance(stream, Mapping) else None
    same = own is None or _norm(own) == _norm(state.get(K_SEED))
    return {**state, K_STREAM_SEED: None if same else own, K_TRANSFORM: None}


def _upgrade_v2(state: Mapping[str, Any]) -> dict[str, Any]:
    """Format 2 -> 3: a history of one entry (from position 0, the saved layout), and the
    ``exclusions`` its stream identity holds (None: format 2 streams were never `Excluded`)."""
    stream, layout = state.get(K_STREAM), state.get(K_LAYOUT)
    return {
        **state,
        K_EXCLUSIONS: split_identity(stream)[1] if isinstance(stream, Mapping) else None,
        K_HISTORY: upgraded_history(
            state.get(K_GLOBAL_BATCH), layout if isinstance(layout, Mapping) else {}
        ),
    }


def _upgrade_v3(state: Mapping[str, Any]) -> dict[str, Any]:
    """Format 3 -> 4: its history (no change entries then) gets its seal."""
    history = state.get(K_HISTORY)
    return {**state, K_SEAL: seal(history) if isinstance(history, list) else None}


def _upgrade_v4(state: Mapping[str, Any]) -> dict[str, Any]:
    """Format 4 -> 5: no attestation (the resume is not attested: `Cursor.load_state_dict`
    logs it)."""
    return {**state, K_ATTESTATION: Attestation.json_of(None)}


#: ``(version, upgrade to version + 1)``, applied in order to a state of an older format.
_UPGRADES: Final = ((1, _upgrade_v1), (2, _upgrade_v2), (3, _upgrade_v3), (4, _upgrade_v4))


def _norm(value: Any) -> Any:
    try:
        return json.loads(json.dumps(value))
    except (TypeError, ValueError, RecursionError):
        return repr(value)


def check_allow(allow: Iterable[str]) -> frozenset[str]:
    """Validate ``allow=`` field names."""
    if isinstance(allow, (str, bytes)):
        raise StateError(
            f"allow= takes a list of field names, got the string {allow!r}; hint: allow=[{allow!r}]"
        )
    try:
        names = frozenset(allow)
    except TypeError:
        raise StateError(f"allow= takes a list of field names, got {allow!r:.80}") from None
    unknown = sorted(repr(n) if not isinstance(n, str) else n for n in names - set(CHECKED_FIELDS))
    if unknown:
        raise StateError(
            f"allow= names unknown fields {unknown}; allowed names are {list(CHECKED_FIELDS)}"
        )
    return names


def mismatch_message(diffs: list[str], saved: Mapping[str, Any], current: Mapping[str, Any]) -> str:
    lines = [f"  {k}: saved {saved.get(k)!r}, current {current.get(k)!r}" for k in diffs]
    return (
        "loader state does not match this loader; differing fields:\n"
        + "\n".join(lines)
        + f"\nhint: resume with the same data/seed/batch, or pass allow={diffs!r} to accept "
        "the change knowingly" + _stream_seed_hint(diffs, saved, current)
    )


def _stream_seed_hint(
    diffs: list[str], saved: Mapping[str, Any], current: Mapping[str, Any]
) -> str:
    """Why ``stream_seed`` differs when the saved run's loader ordered its dataset itself and
    this one is given a stream (most often: the dataset wrapped in ``Excluded`` at a resume)."""
    if K_STREAM_SEED not in diffs or saved.get(K_STREAM_SEED) is not None:
        return ""
    seed, now = saved.get(K_SEED), current.get(K_STREAM_SEED)
    same = _norm(now) == _norm(seed)
    return (
        f"\nstream_seed: the saved run's loader ordered the dataset itself with seed={seed!r}; "
        f"this loader is given a stream ordered with seed={now!r}"
        + (" (the same order)" if same else f" (another order, not seed={seed!r})")
        + ". To add exclusions at this resume, wrap the plain dataset with the loader's seed, "
        f"Excluded(dataset, [(position, exclusion_list)], seed={seed!r}), and pass "
        "allow=['exclusions']"
        + (" (or keep this stream and add allow=['stream_seed'])" if same else "")
    )


def _not_json(text: str | bytes, exc: BaseException) -> str:
    """The error text for a state string that is not JSON; a file path (a newcomer's
    ``load_state_dict("ckpt/loader.json")``) gets the line that reads the file."""
    line = text if isinstance(text, str) else text.decode("utf-8", "replace")
    if "\n" not in line and len(line) < 4096 and line.strip()[:1] not in ("{", "["):
        return (
            f"loader state {line!r} is not JSON but looks like a file path; load_state_dict "
            "takes what state_dict() returned; hint: read the file first: "
            f"loader.load_state_dict(json.load(open({line!r})))"
        )
    return (
        f"loader state is not valid JSON: {type(exc).__name__}: {exc}; "
        "hint: pass the object DataLoader.state_dict() returned, or its JSON text"
    )
