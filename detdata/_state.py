"""Loader state: one JSON object, versioned, compared field by field on resume.

The state counts samples *delivered* to the caller (global, all ranks), never
what was prefetched. Checked fields must match on resume unless allowed by name;
layout and environment are informational.
"""

from __future__ import annotations

import json
import platform
import sys
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any, Final, Protocol, runtime_checkable

from detdata._errors import StateError
from detdata._hashing import digest_bytes
from detdata._manifest import canonical_json

STATE_VERSION: Final = 1
MAX_POSITION: Final = 1 << 62  # exclusive: orders and mixtures address positions below 2**62
K_VERSION: Final = "format_version"
K_KIND: Final = "kind"
KIND: Final = "detdata.loader_state"
K_CONSUMED: Final = "samples_consumed"
K_SEED: Final = "seed"
K_MANIFESTS: Final = "manifests"
K_DATA: Final = "data"
K_ALGORITHM: Final = "algorithm"
K_MIXTURE: Final = "mixture"
K_GLOBAL_BATCH: Final = "global_batch_size"
K_STREAM: Final = "stream"
K_LAYOUT: Final = "layout"
K_ENV: Final = "environment"

#: Fields that must match on resume unless named in ``allow=``.
CHECKED_FIELDS: Final = (K_MANIFESTS, K_DATA, K_SEED, K_ALGORITHM, K_MIXTURE, K_GLOBAL_BATCH)
_REQUIRED: Final = (K_KIND, K_VERSION, K_CONSUMED, *CHECKED_FIELDS, K_STREAM)
_TOP_LEVEL_VOLATILE: Final = ("schedule", "seed", "algorithm")


@runtime_checkable
class Stateful(Protocol):
    """Anything with resumable state (the torch.distributed.checkpoint protocol)."""

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state_dict: dict[str, Any]) -> None: ...


def _collect(obj: Any, key: str) -> list[str]:
    found: list[str] = []
    if isinstance(obj, Mapping):
        for k, v in obj.items():
            if k == key and isinstance(v, str):
                found.append(v)
            else:
                found.extend(_collect(v, key))
    elif isinstance(obj, list):
        for v in obj:
            found.extend(_collect(v, key))
    return found


def identity_fields(identity: Mapping[str, Any], seed: int, global_batch: int) -> dict[str, Any]:
    """The checked fields derived from a stream identity."""
    data = {k: v for k, v in identity.items() if k not in _TOP_LEVEL_VOLATILE}
    is_mixture = identity.get("type") == "mixture"
    return {
        K_MANIFESTS: sorted(set(_collect(identity, "manifest") + _collect(identity, "digest"))),
        K_DATA: digest_bytes(canonical_json(data)),
        K_SEED: seed,
        K_ALGORITHM: sorted(set(_collect(identity, "algorithm"))),
        K_MIXTURE: digest_bytes(canonical_json(identity.get("schedule"))) if is_mixture else None,
        K_GLOBAL_BATCH: global_batch,
    }


def environment() -> dict[str, str]:
    """Library versions and platform (informational only)."""
    import numpy
    import torch

    from detdata import __version__
    return {"detdata": __version__, "torch": torch.__version__, "numpy": numpy.__version__,
            "python": sys.version.split()[0], "platform": platform.platform()}


@dataclass(frozen=True, kw_only=True)
class LoaderState:
    """Parsed, validated loader state."""

    samples_consumed: int
    fields: Mapping[str, Any]
    stream: Mapping[str, Any]
    layout: Mapping[str, Any]
    env: Mapping[str, Any]

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {K_KIND: KIND, K_VERSION: STATE_VERSION, K_CONSUMED: self.samples_consumed}
        out.update(self.fields)
        out[K_STREAM] = dict(self.stream)
        out[K_LAYOUT] = dict(self.layout)
        out[K_ENV] = dict(self.env)
        return out

    @classmethod
    def from_json(cls, state: object) -> LoaderState:
        if isinstance(state, (str, bytes)):
            try:
                state = json.loads(state)
            except (ValueError, RecursionError) as exc:
                raise StateError(f"loader state is not valid JSON: {type(exc).__name__}: {exc}; "
                                 "hint: pass the object DataLoader.state_dict() returned, or "
                                 "its JSON text") from None
        if not isinstance(state, Mapping):
            raise StateError(f"loader state must be a JSON object, got {type(state).__name__}")
        if state.get(K_KIND) != KIND:
            raise StateError(f"not a detdata loader state: field 'kind' is {state.get(K_KIND)!r}, "
                             f"expected {KIND!r}")
        if state.get(K_VERSION) != STATE_VERSION:
            raise StateError(f"unknown loader state format_version {state.get(K_VERSION)!r}; this "
                             f"detdata reads {STATE_VERSION}; hint: upgrade detdata")
        missing = [k for k in _REQUIRED if k not in state]
        if missing:
            raise StateError(f"loader state is missing fields {missing}", fields=tuple(missing))
        consumed = state[K_CONSUMED]
        if isinstance(consumed, bool) or not isinstance(consumed, int) or consumed < 0:
            raise StateError(f"loader state field {K_CONSUMED!r} must be a non-negative integer, "
                             f"found {consumed!r}", fields=(K_CONSUMED,))
        if consumed >= MAX_POSITION:
            raise StateError(f"loader state field {K_CONSUMED!r} is {consumed}, beyond the last "
                             f"addressable global position 2**62 - 1; the state was edited or "
                             "corrupted", fields=(K_CONSUMED,))
        stream = state[K_STREAM]
        if not isinstance(stream, Mapping):
            raise StateError("loader state field 'stream' must be an object", fields=(K_STREAM,))
        layout, env = state.get(K_LAYOUT, {}), state.get(K_ENV, {})
        if not isinstance(layout, Mapping) or not isinstance(env, Mapping):
            raise StateError("loader state fields 'layout' and 'environment' must be objects")
        parsed = cls(samples_consumed=consumed, fields={k: state[k] for k in CHECKED_FIELDS},
                     stream=stream, layout=layout, env=env)
        parsed._check_consistent()
        return parsed

    def _check_consistent(self) -> None:
        """The checked fields must be the ones derived from the saved ``stream`` identity.

        A state whose fields disagree with its own stream was edited by hand or
        corrupted; resuming from it (in particular continuing a mixture from
        the saved schedule) would silently use the wrong history.
        """
        try:
            derived = identity_fields(self.stream, self.fields[K_SEED], self.fields[K_GLOBAL_BATCH])
        except (TypeError, ValueError, RecursionError) as exc:
            raise StateError(f"loader state field 'stream' is not a plain JSON identity ({exc})",
                             fields=(K_STREAM,)) from None
        bad = [k for k in CHECKED_FIELDS if _norm(self.fields.get(k)) != _norm(derived.get(k))]
        if bad:
            detail = "; ".join(f"{k}: stored {self.fields.get(k)!r:.80}, derived from 'stream' "
                               f"{derived.get(k)!r:.80}" for k in bad)
            raise StateError(f"loader state is inconsistent: field(s) {bad} do not match its own "
                             f"'stream' identity ({detail}); the state was edited or corrupted; "
                             "hint: use the state exactly as DataLoader.state_dict() returned it",
                             fields=tuple(bad))

    def differences(self, current: Mapping[str, Any]) -> list[str]:
        """Names of checked fields whose saved value differs from ``current``."""
        return [k for k in CHECKED_FIELDS if _norm(self.fields.get(k)) != _norm(current.get(k))]


def _norm(value: Any) -> Any:
    try:
        return json.loads(json.dumps(value))
    except (TypeError, ValueError, RecursionError):
        return repr(value)


def check_allow(allow: Iterable[str]) -> frozenset[str]:
    """Validate ``allow=`` field names."""
    if isinstance(allow, (str, bytes)):
        raise StateError(f"allow= takes a list of field names, got the string {allow!r}; "
                         f"hint: allow=[{allow!r}]")
    try:
        names = frozenset(allow)
    except TypeError:
        raise StateError(f"allow= takes a list of field names, got {allow!r:.80}") from None
    unknown = sorted(repr(n) if not isinstance(n, str) else n for n in names - set(CHECKED_FIELDS))
    if unknown:
        raise StateError(f"allow= names unknown fields {unknown}; allowed names are {list(CHECKED_FIELDS)}")
    return names


def mismatch_message(diffs: list[str], saved: Mapping[str, Any], current: Mapping[str, Any]) -> str:
    lines = [f"  {k}: saved {saved.get(k)!r}, current {current.get(k)!r}" for k in diffs]
    return ("loader state does not match this loader; differing fields:\n" + "\n".join(lines)
            + f"\nhint: resume with the same data/seed/batch, or pass allow={diffs!r} to accept "
            "the change knowingly")
