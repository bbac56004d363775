"""What a stream or dataset declares it can do, beyond the `Stream` / `Dataset` protocols.

`Stream` (``fetch``, ``sample_ids``, ``identity``) and `Dataset` (``num_samples``, ``read``,
``identity``) are all the loader needs to deliver batches. Everything else a caller may
use is one of five *capabilities*: a small `typing.Protocol` below, checked with
``isinstance`` (never by probing an attribute name), so a type that lacks one is told so by
name instead of silently losing a feature. A call that needs a capability (or a member
without a default) raises `CapabilityError` naming it, its members, the type that lacks it
and a hint (`missing`); where a default exists it applies, stated below and at the call.

=================  ==========================  ===========================================
capability         provided by                 without it
=================  ==========================  ===========================================
`HasOrigins`       `OrderedStream`, `Mixture`, needed by provenance, exclusions and
                   `Excluded`                  ``tokens_consumed``; the shard-cache
                                               prefetch sees no dataset (none is prefetched)
`ContinuesFrom`    `Mixture`, `Excluded`       needed by a resume that allows a
                                               ``mixture`` or ``exclusions`` change
`Reweights`        `Mixture`, `Excluded`       needed by a weight change (`reweights`)
`ReadsAhead`       `OrderedStream`,            optional: no read-ahead hint
                   `TokenWindows`              (`hint_read_ahead`)
`DatasetInfo`      `TokenWindows`,             each member has its default (`info`):
                   `TableRows`,                ``tokens_per_sample`` None (needed by
                   `PackedWindows`             ``tokens_consumed``), ``shard_sizes`` /
                                               ``row_group_sizes`` None (needed by
                                               ``LocalityOrder``), ``schema()`` None (a
                                               `Mixture` reads sample 0 to learn columns),
                                               ``provenance(ids)`` None (records carry no
                                               shard or range), ``use_order`` does nothing
=================  ==========================  ===========================================

`HasOrigins` answers "what datasets does the stream draw from, and which sample is at each
position" in one call (`Origins`; a single-dataset stream is the one-source case with
``names == (None,)``). `DatasetInfo` is a Protocol with a default for every member: a
dataset subclasses it and overrides what it knows (a dataset that does not subclass it gets
every default). A single dataset's key in ``tokens_consumed`` is its identity's ``name``,
else its identity's ``type``.

``tests/datasets/test_capabilities.py`` holds the list of what each built-in type must
declare and checks it, and that a stream with only the three `Stream` methods loads.
"""

from __future__ import annotations

from abc import ABC
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from fractions import Fraction
from typing import Any, Final, Protocol, runtime_checkable

from detdata.base.errors import CapabilityError, ConfigError
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

    def source_index(self, name: str | None) -> int:
        """The index of source ``name`` (`ConfigError` naming the sources if unknown)."""
        if name not in self.names:
            shown = [n for n in self.names if n is not None] or ["(one unnamed source)"]
            raise ConfigError(f"unknown source {name!r}; this stream's sources are {shown}")
        return self.names.index(name)


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
    allows a change: ``continue_from(saved_identity, position) -> Stream`` (`Mixture`: new
    weights from there on; `Excluded`: checks that only lists in force from there on were
    appended, and returns itself). It raises `ConfigError` / `StateError` naming why it
    cannot."""

    def continue_from(self, saved_identity: Mapping[str, Any], position: int) -> Stream: ...


@runtime_checkable
class Reweights(Protocol):
    """Can change its mixture weights from a position on (`Mixture`, an `Excluded` over one):
    ``with_mixture_weights(position, weights)`` is the stream with ``weights`` in force from
    global ``position`` on (every earlier position unchanged, each source continuing its
    stream), ``with_weight_changes(changes)`` the same for each ``(position, weights)`` in
    turn, ``mixture_weights_at(position)`` the exact proportions in force there. ``mixes``:
    whether it does mix sources (an `Excluded` has the methods over any stream, and mixes only
    over a mixture); use `reweights` rather than an isinstance check."""

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
    """Takes a hint of its next read: ``read_ahead(x)`` where ``x`` is what the next call will be
    given (positions for a stream's ``fetch``, ids for a dataset's ``read``; None: drop what
    is pending). It may start that read's file reads in the background; it never changes a
    fetched byte and never raises for what the read itself would report. Optional."""

    def read_ahead(self, positions: IntArray | None) -> None: ...


def hint_read_ahead(target: object, positions: IntArray | None) -> None:
    """Pass a read-ahead hint to ``target`` if it is `ReadsAhead`; otherwise nothing happens
    (the default: the read is done when it is asked for, with the same bytes)."""
    if isinstance(target, ReadsAhead):
        target.read_ahead(positions)


# ------------------------------------------------------------------ datasets
class DatasetInfo(ABC):  # noqa: B024 (a base of defaults: no member is abstract)
    """What a dataset may say about itself beyond `Dataset`, each member with its default: a
    dataset subclasses this class and overrides what it knows (`TokenWindows`, `TableRows`,
    `PackedWindows`); `info` gives any other dataset the defaults. None means "not known":
    the call that needs the member raises `missing` naming it. Declared by subclassing (a
    nominal check: ``isinstance`` never evaluates a member, and a dataset that defines some
    of these names without subclassing gets the defaults)."""

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


class _Defaults(DatasetInfo):
    """Every `DatasetInfo` default, for a dataset that does not declare it."""


_DEFAULTS: Final = _Defaults()


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
