"""What a stream or dataset declares it can do, beyond the `Stream` / `Dataset` protocols.

`Stream` (``fetch``, ``sample_ids``, ``identity``) and `Dataset` (``num_samples``, ``read``,
``identity``) are all the loader needs to deliver batches. Everything else a caller may
use is a *capability*: a small `typing.Protocol` below, checked with ``isinstance`` (never
by probing an attribute name), so a stream type that lacks one is told so by name instead
of silently losing a feature. Each capability is either

* **needed** by a call: without it the call raises `CapabilityError` naming the
  capability, the type that lacks it and a hint (`missing`); or
* **optional**: without it the documented default applies, stated below and at the call.

============================  ==============================  ==========================
capability                    provided by                     without it
============================  ==============================  ==========================
`ReadsAhead`                 `OrderedStream`, `TokenWindows`  optional: no read-ahead
                                                              hint (`hint_read_ahead`)
`OverOneDataset`              `OrderedStream`                 needed by ``tokens_consumed``
                                                              (or `HasSources`); lookahead
                                                              and ``len(loader)`` treat the
                                                              stream as opaque
`HasSources`                  `Mixture`                       as `OverOneDataset`
`HasOrigins`                  `OrderedStream`, `Mixture`,     needed by provenance,
                              `Excluded`                      exclusions (`origins`)
`ContinuesFrom`               `Mixture`                       needed by a resume that
                                                              allows a mixture change
`ChecksContinuation`          `Excluded`                      needed by a resume that
                                                              allows an exclusions change
`OrdersDataset`               `Excluded`                      optional: the stream is not
                                                              counted as loader-ordered
`TokenCounting`               `TokenWindows`,                 needed by ``tokens_consumed``
                              `PackedWindows`
`Named`                       `ArrayDataset`                  optional: the identity's
                                                              ``type`` names the source
`HasSchema`                   `TokenWindows`, `TableRows`,    optional: a `Mixture` reads
                              `PackedWindows`                 sample 0 to learn columns
`TakesOrder`                  `TokenWindows`, `TableRows`     optional: the dataset is not
                                                              told its order
`ShardSized`                  `TokenWindows`, `TableRows`     needed by
                                                              ``LocalityOrder(window_shards)``
`RowGroupSized`               `TableRows`                     needed by ``LocalityOrder(
                                                              window_row_groups)``
`HasProvenance`               any dataset (`TokenWindows` and optional: provenance records
                              `TableRows` are located          carry no shard or range
                              directly)
`InvertibleOrder`             `WindowedOrder`                 needed by ``positions_seen``
                                                              (`GlobalOrder` is inverted
                                                              directly)
============================  ==============================  ==========================

``tests/datasets/test_capabilities.py`` holds the list of what each built-in type must
declare and checks it, and that a stream with only the three `Stream` methods loads.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from fractions import Fraction
from typing import Any, Final, Protocol, runtime_checkable

import numpy.typing as npt

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
class ReadsAhead(Protocol):
    """Takes a hint of its next read: ``read_ahead(x)`` where ``x`` is what the next call will be
    given (positions for a stream's ``fetch``, ids for a dataset's ``read``; None: drop what
    is pending). It may start that read's file reads in the background; it never changes a
    fetched byte and never raises for what the read itself would report. Optional."""

    def read_ahead(self, positions: IntArray | None) -> None: ...


@runtime_checkable
class OverOneDataset(Protocol):
    """A stream that reads one dataset: position ``g`` delivers ``dataset.read(sample_ids(g))``
    (`OrderedStream`)."""

    @property
    def dataset(self) -> Dataset: ...

    def sample_ids(self, positions: IntArray) -> IntArray: ...


@runtime_checkable
class HasSources(Protocol):
    """A stream over several named datasets (`Mixture`): ``sources`` in ``source_names`` order,
    ``locate(positions) -> (source index, index in source, sample id)`` and ``consumed(p)``,
    the samples of each source among positions ``[0, p)``."""

    @property
    def sources(self) -> Mapping[str, Dataset]: ...

    @property
    def source_names(self) -> tuple[str, ...]: ...

    def locate(self, positions: npt.ArrayLike) -> tuple[IntArray, IntArray, IntArray]: ...

    def consumed(self, position: int) -> dict[str, int]: ...


@runtime_checkable
class HasOrigins(Protocol):
    """Says where each position's sample comes from: its source, dataset and sample id
    (`Origins`), without reading it."""

    def origins(self, positions: IntArray) -> Origins: ...


@runtime_checkable
class ContinuesFrom(Protocol):
    """Can continue a saved stream of another configuration at a position (`Mixture`: new
    weights from there on): ``continue_from(saved_identity, position) -> Stream``."""

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


@runtime_checkable
class ChecksContinuation(Protocol):
    """Can tell whether it continues a saved stream at a position (`Excluded`: only lists
    appended from there on): ``check_continues`` raises `StateError` otherwise."""

    def check_continues(self, saved_identity: Mapping[str, Any], position: int) -> None: ...


@runtime_checkable
class OrdersDataset(Protocol):
    """A wrapper that ordered a plain dataset itself with ``seed`` (``orders_dataset`` True),
    as a `DataLoader` would (`Excluded`): with the loader's own seed the run counts as
    loader-ordered."""

    @property
    def orders_dataset(self) -> bool: ...

    @property
    def seed(self) -> int: ...


# ------------------------------------------------------------------ datasets
@runtime_checkable
class TokenCounting(Protocol):
    """Every sample delivers ``tokens_per_sample`` tokens (`TokenWindows`, `PackedWindows`: the
    ``seq_len`` input tokens of a window, not the extra label token)."""

    @property
    def tokens_per_sample(self) -> int: ...


@runtime_checkable
class Named(Protocol):
    """Has a ``name`` (`ArrayDataset`): the key a single dataset's counts are reported under."""

    @property
    def name(self) -> str: ...


@runtime_checkable
class HasSchema(Protocol):
    """Says what `read` delivers without reading: column -> `describe_column` text."""

    def schema(self) -> Mapping[str, str]: ...


@runtime_checkable
class TakesOrder(Protocol):
    """Wants to know the order it is read in (to size caches, never to change a byte)."""

    def use_order(self, choice: OrderChoice) -> None: ...


@runtime_checkable
class ShardSized(Protocol):
    """Samples per shard in id order (ids laid out shard after shard)."""

    @property
    def shard_sizes(self) -> Sequence[int]: ...


@runtime_checkable
class RowGroupSized(Protocol):
    """Samples per row group in id order (`TableRows`)."""

    @property
    def row_group_sizes(self) -> Sequence[int]: ...


@runtime_checkable
class HasProvenance(Protocol):
    """Says where each sample's bytes live: one plain-JSON dict per id (shard, url, range)."""

    def provenance(self, ids: IntArray) -> Sequence[Mapping[str, Any]]: ...


# ------------------------------------------------------------------ orders
@runtime_checkable
class InvertibleOrder(Protocol):
    """An order that lists the positions ``< until`` holding a sample id, ascending."""

    def positions_of(self, sample_id: int, *, until: int) -> IntArray: ...


#: The members of each capability, as error messages show them.
MEMBERS: Final[Mapping[type, str]] = {
    ReadsAhead: "read_ahead(positions)",
    OverOneDataset: ".dataset and sample_ids(positions)",
    HasSources: ".sources, .source_names, locate(positions) and consumed(position)",
    HasOrigins: "origins(positions) -> Origins",
    ContinuesFrom: "continue_from(saved_identity, position)",
    ChecksContinuation: "check_continues(saved_identity, position)",
    Reweights: ".mixes, with_mixture_weights(position, weights), with_weight_changes(changes) "
    "and mixture_weights_at(position)",
    OrdersDataset: ".orders_dataset and .seed",
    TokenCounting: ".tokens_per_sample",
    Named: ".name",
    HasSchema: "schema()",
    TakesOrder: "use_order(choice)",
    ShardSized: ".shard_sizes",
    RowGroupSized: ".row_group_sizes",
    HasProvenance: "provenance(ids)",
    InvertibleOrder: "positions_of(sample_id, until=...)",
}


def missing(capability: type, found: object, *, needed_by: str, hint: str) -> CapabilityError:
    """The error for a call (``needed_by``) that needs ``capability`` of ``found``, which lacks
    it: names the capability, its members, the type of ``found`` and ``hint``."""
    kind = type(found).__name__
    return CapabilityError(
        f"{needed_by} needs the capability {capability.__name__} "
        f"({MEMBERS.get(capability, '?')}), and {kind} does not declare it; hint: {hint}",
        capability=capability.__name__,
        kind=kind,
    )


def hint_read_ahead(target: object, positions: IntArray | None) -> None:
    """Pass a read-ahead hint to ``target`` if it is `ReadsAhead`; otherwise nothing happens
    (the default: the read is done when it is asked for, with the same bytes)."""
    if isinstance(target, ReadsAhead):
        target.read_ahead(positions)
