"""Resume attestation (docs/design.md section 5, "Attested resumes").

A saved state carries an `Attestation`: the digests of the samples at the ``ATTESTED`` global
positions just before the save point, as the caller receives them, keyed by global position so
that any layout re-derives them. A resume reads those positions again before its first batch
(`Attestor.verify`): a difference is a `StateError` naming the step, the position, both digests
and the checked fields that were equal. It catches what the checked fields cannot name: an
edited transform body, a changed tokenizer table, bytes edited under a kept receipt.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Final

import numpy as np

from detdata.base.errors import StateError
from detdata.base.redact import get_logger
from detdata.base.types import MAX_POSITION, IntArray
from detdata.datasets.base import Stream
from detdata.loading.history import is_count
from detdata.loading.reading import Reads
from detdata.loading.trace.digests import is_hex_digest, position_digests

log = get_logger("detdata.loader")

#: Samples attested per state: the last ones delivered before the save point.
ATTESTED: Final = 4
K_FIRST: Final = "first"  # global position of the first attested sample
K_SAMPLES: Final = "samples"  # one blake3 hex per attested position, in order
K_GROUP: Final = "group"  # blake3 hex of the batch-level leaves of the group, or None
#: The ``attestation`` field of a state that attests nothing: the same keys as one that does,
#: so that a fresh loader's state is a template of a saved one (torch.distributed.checkpoint
#: loads into the template's keys).
NONE: Final[dict[str, Any]] = {K_FIRST: None, K_SAMPLES: [], K_GROUP: None}


@dataclass(frozen=True)
class Attestation:
    """Digests of the samples at positions ``first, first + 1, ...`` (one per entry of
    ``samples``) and of the batch-level leaves of their group (``group``, None: none)."""

    first: int
    samples: tuple[str, ...]
    group: str | None

    @property
    def positions(self) -> IntArray:
        return np.arange(self.first, self.first + len(self.samples), dtype=np.int64)

    @staticmethod
    def json_of(attestation: Attestation | None) -> dict[str, Any]:
        """The ``attestation`` field of a state (`NONE` for None)."""
        return dict(NONE) if attestation is None else attestation.to_json()

    def to_json(self) -> dict[str, Any]:
        return {K_FIRST: self.first, K_SAMPLES: list(self.samples), K_GROUP: self.group}

    @classmethod
    def from_json(cls, value: object) -> Attestation | None:
        """Parse a state's ``attestation`` field (`NONE`: None); `StateError` naming it when
        malformed."""
        if value == NONE:
            return None
        problem = _problem(value)
        if problem:
            raise StateError(
                f"loader state field 'attestation' {problem} (found {value!r:.120}); the "
                "state was edited or corrupted; hint: use the state exactly as "
                "DataLoader.state_dict() returned it",
                fields=("attestation",),
            )
        assert isinstance(value, Mapping)
        return cls(int(value[K_FIRST]), tuple(value[K_SAMPLES]), value[K_GROUP])


def _problem(value: object) -> str:
    """What is wrong with a saved attestation ("" when nothing)."""
    if not isinstance(value, Mapping) or set(value) != {K_FIRST, K_SAMPLES, K_GROUP}:
        return f"must be an object with keys {[K_FIRST, K_SAMPLES, K_GROUP]}"
    first, samples, group = value[K_FIRST], value[K_SAMPLES], value[K_GROUP]
    if not is_count(first):
        return f"{K_FIRST!r} must be a non-negative integer"
    if not isinstance(samples, list) or not 0 < len(samples) <= ATTESTED:
        return f"{K_SAMPLES!r} must list 1 to {ATTESTED} digests"
    if not all(is_hex_digest(s) for s in samples) or not (group is None or is_hex_digest(group)):
        return "holds a digest that is not 64 lowercase hex digits"
    if first + len(samples) > MAX_POSITION:
        return "attests positions past the last addressable one, 2**62 - 1"
    return ""  # past ``consumed`` is no error: a state saved again before a resume's
    # first batch (at a step's start) carries the saved attestation still to be passed


@dataclass(frozen=True)
class Pending:
    """An attestation a resume must pass before its first batch: the saved ``attestation``,
    the position and step the resume continues at, and the checked fields that were equal."""

    attestation: Attestation
    position: int
    step: int
    equal: tuple[str, ...]


class Attestor:
    """Derives and compares attestations with the loader's reads (`Reads`: its transform,
    seed and ``collate_fn``), in the calling process."""

    def __init__(self, reads: Reads) -> None:
        self._reads = reads

    def derive(self, stream: Stream, positions: IntArray) -> Attestation:
        """The attestation of ``positions`` (consecutive) of ``stream``: read, transformed and
        collated as one group. Raises what the read raises."""
        reader = self._reads.reader(stream, in_worker=False)
        delivered = reader([positions])
        if delivered.error is not None:
            raise delivered.error
        batch = delivered.batches[0]
        samples, group = position_digests(positions, batch)
        return Attestation(int(positions[0]), tuple(samples), group)

    def record(self, stream: Stream, consumed: int) -> Attestation | None:
        """The attestation of a state saved at ``consumed`` (None: nothing delivered,
        or the samples cannot be read or digested now: said in a warning). The span may hold
        other ranks' positions, which this rank never read: a failure reading them (the
        dataset's, the transform's, the collate's; an interrupt is not caught) leaves the
        state unattested, never the save failed."""
        first = max(0, consumed - ATTESTED)
        if first == consumed:
            return None
        try:
            return self.derive(stream, np.arange(first, consumed, dtype=np.int64))
        except Exception as exc:  # any failure of user code too: saving must not fail
            log.warning(
                "detdata: this state is saved without resume attestation: the samples at "
                "positions [%d, %d) could not be read or digested again (%s: %s)",
                first,
                consumed,
                type(exc).__name__,
                exc,
            )
            return None

    def verify(self, stream: Stream, pending: Pending) -> None:
        """Re-derive ``pending``'s positions of ``stream``; a `StateError` at the first that
        differs (`mismatch`)."""
        saved = pending.attestation
        now = self.derive(stream, saved.positions)
        for i, (was, found) in enumerate(zip(saved.samples, now.samples, strict=True)):
            if was != found:
                raise mismatch(pending, saved.first + i, was, found)
        if saved.group != now.group:
            raise mismatch(pending, saved.first, str(saved.group), str(now.group), group=True)


def mismatch(
    pending: Pending, position: int, saved: str, found: str, *, group: bool = False
) -> StateError:
    """The error of a failed attestation."""
    what = (
        f"the batch-level values of the samples at positions [{position}, "
        f"{position + len(pending.attestation.samples)})"
        if group
        else f"the sample at global position {position}"
    )
    equal = ", ".join(pending.equal) or "none"
    return StateError(
        f"resume attestation failed at step {pending.step} (resuming at samples_consumed "
        f"{pending.position}): {what} digested as {saved} in the run that saved this state, "
        f"but as {found} now (blake3 of what the caller receives, after transform and "
        f"collate). The checked identity fields were equal ({equal}), so what changed lies "
        "outside them: the transform's or collate_fn's code or internal tables, a global or "
        "file they read, a library version (a random stream), or shard bytes changed under "
        "a kept receipt; hint: resume with the code, environment and data of the saved run; "
        "if the change is intended, give the transform a new transform_id and "
        "allow=['transform'], or turn the check off with "
        "LoaderOptions(resume=ResumePolicy(attest=False))",
        fields=("attestation",),
    )
