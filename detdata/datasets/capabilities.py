"""What a stream or dataset declares it can do, beyond the `Stream` / `Dataset` protocols
(docs/architecture.md "Adding a stream").

Each of the five *capabilities* is a small `typing.Protocol` checked with ``isinstance``
(never an attribute probe). A call that needs one (or a member without a default) raises
`CapabilityError` naming it, its members, the type that lacks it and a hint (`missing`).

=================  ===========================================  ==========================
capability         provided by                                  without it
=================  ===========================================  ==========================
`HasOrigins`       `OrderedStream`, `Mixture`, `Excluded`       no provenance, exclusions,
                                                                ``tokens_consumed`` or
                                                                shard-cache prefetch
`ContinuesFrom`    `Mixture`, `Excluded`                        no ``mixture`` /
                                                                ``exclusions`` change
`Reweights`        `Mixture`, `Excluded`                        no weight change
`ReadsAhead`       `OrderedStream`, `TokenWindows`              no read-ahead hint
`DatasetInfo`      `TokenWindows`, `TableRows`, `PackedWindows` each member's default
=================  ===========================================  ==========================

``tests/datasets/test_capabilities.py`` pins what each built-in type declares.
"""

from __future__ import annotations

from abc import ABC
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from fractions import Fraction
from typing import Any, Final, Protocol, runtime_checkable

from detdata.base.errors import CapabilityError
from detdata.base.types import IntArray
from detdata.datasets.base import Dataset, Stream
from detdata.order.choice import OrderChoice


# ------------------------------------------------------------------ what origins answer
@dataclass(frozen=True, kw_only=True)
class Origins:
    """Per position: ``source[j]`` indexes ``names``/``datasets``, ``ids[j]`` is the sample id
    in that dataset; ``notes[j]`` is extra plain JSON (e.g. an exclusion's replacement) or None.

    ``names`` is ``(None,)`` for a single-dataset stream, else the mixture's source names.
    """

    names: tuple[str | None, ...]
    datasets: tuple[Dataset, ...]
    source: IntArray
    ids: IntArray
    notes: tuple[dict[str, Any] | None, ...]


# ------------------------------------------------------------------ streams
@runtime_checkable
class HasOrigins(Protocol):
    """Says what it draws from and where each position's sample comes from, without reading
    it: ``origins(positions) -> Origins`` (its sources' names and datasets, and per position
    the source and sample id; ``origins([])`` lists the datasets alone)."""

    def origins(self, positions: IntArray) -> Origins: ...


@runtime_checkable
class ContinuesFrom(Protocol):
    """Continues a saved stream of another configuration at a position, after a resume that
    allows a change: ``continue_from(saved_identity, position) -> Stream``, else
    `ConfigError` / `StateError` naming why it cannot."""

    def continue_from(self, saved_identity: Mapping[str, Any], position: int) -> Stream: ...


@runtime_checkable
class Reweights(Protocol):
    """Can change its mixture weights from a position on (`Mixture`, an `Excluded` over one):
    ``with_mixture_weights(position, weights)``, ``with_weight_changes(changes)`` (each in
    turn), ``mixture_weights_at(position)``. ``mixes``: whether it does mix sources (an
    `Excluded` mixes only over a mixture); use `reweights`, not an isinstance check."""

    @property
    def mixes(self) -> bool: ...

    def with_mixture_weights(self, position: int, weights: Mapping[str, Any]) -> Stream: ...

    def with_weight_changes(self, changes: Sequence[tuple[int, Mapping[str, Any]]]) -> Stream: ...

    def mixture_weights_at(self, position: int) -> dict[str, Fraction]: ...


def reweights(stream: object) -> Reweights | None:
    """``stream`` as a `Reweights` that mixes sources, else None."""
    return stream if isinstance(stream, Reweights) and stream.mixes else None


# ------------------------------------------------------------------ streams and datasets
@runtime_checkable
class ReadsAhead(Protocol):
    """Takes a hint of its next read: ``read_ahead(x)``, ``x`` what the next ``fetch`` /
    ``read`` will be given (None: drop what is pending). Never changes a fetched byte and
    never raises for what the read itself would report."""

    def read_ahead(self, positions: IntArray | None) -> None: ...


def hint_read_ahead(target: object, positions: IntArray | None) -> None:
    """Pass a read-ahead hint to ``target`` if it is `ReadsAhead`; otherwise nothing happens
    (the default: the read is done when it is asked for, with the same bytes)."""
    if isinstance(target, ReadsAhead):
        target.read_ahead(positions)


# ------------------------------------------------------------------ datasets
class DatasetInfo(ABC):  # noqa: B024 (a base of defaults: no member is abstract)
    """What a dataset may say about itself beyond `Dataset`, each member with its default
    (None: "not known"). Declared by subclassing (nominal: a dataset that defines these
    names without subclassing gets the defaults, `info`)."""

    @property
    def tokens_per_sample(self) -> int | None:
        """Tokens every sample delivers (`TokenWindows`, `PackedWindows`: the ``seq_len``
        input tokens of a window, not the extra label token); needed by
        ``tokens_consumed``."""
        return None

    @property
    def shard_sizes(self) -> Sequence[int] | None:
        """Samples per shard in id order (ids laid out shard after shard); needed by
        ``LocalityOrder(window_shards=k)``."""
        return None

    @property
    def row_group_sizes(self) -> Sequence[int] | None:
        """Samples per row group in id order (`TableRows`); needed by
        ``LocalityOrder(window_row_groups=k)``."""
        return None

    def schema(self) -> Mapping[str, str] | None:
        """Column -> `describe_column` text of what `read` delivers, without reading (None:
        a `Mixture` reads sample 0 to learn it)."""
        return None

    def provenance(self, ids: IntArray) -> Sequence[Mapping[str, Any]] | None:
        """Where each sample's bytes live: one plain-JSON dict per id (None: provenance
        records carry no shard or range)."""
        del ids
        return None

    def use_order(self, choice: OrderChoice) -> None:
        """Told the order it is read in, to size caches (never to change a byte); the
        default does nothing."""
        del choice


_DEFAULTS: Final = DatasetInfo()  # every default, for a dataset that does not declare it


def info(dataset: object) -> DatasetInfo:
    """``dataset`` if it declares `DatasetInfo`, else the defaults of every member."""
    return dataset if isinstance(dataset, DatasetInfo) else _DEFAULTS


#: The members of each capability, as error messages show them.
MEMBERS: Final[Mapping[type, str]] = {
    HasOrigins: "origins(positions) -> Origins",
    ContinuesFrom: "continue_from(saved_identity, position)",
    Reweights: ".mixes, with_mixture_weights(position, weights), with_weight_changes(changes) "
    "and mixture_weights_at(position)",
    ReadsAhead: "read_ahead(positions)",
    DatasetInfo: ".tokens_per_sample, .shard_sizes, .row_group_sizes, schema(), "
    "provenance(ids) and use_order(choice), each with a default",
}


def missing(
    capability: type, found: object, *, needed_by: str, hint: str, member: str | None = None
) -> CapabilityError:
    """The error for a call (``needed_by``) that needs ``capability`` of ``found`` (or its
    ``member``, which has no default), which lacks it: names the capability, its members
    (the one needed), the type of ``found`` and ``hint``."""
    kind = type(found).__name__
    what = member or MEMBERS.get(capability, "?")
    lacks = f"{kind} does not provide {member}" if member else f"{kind} does not declare it"
    return CapabilityError(
        f"{needed_by} needs the capability {capability.__name__} ({what}), and {lacks}; "
        f"hint: {hint}",
        capability=capability.__name__,
        kind=kind,
    )
