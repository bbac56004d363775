"""Tokens delivered per source (`DataLoader.tokens_consumed`), as trainers log them.

Counted on samples that reached the callers of all ranks (``samples_consumed``): for a
`HasSources` stream (`Mixture`), each source's consumed count at that position
(`Mixture.consumed`, exact, O(phases + sources)) times its tokens per sample; for an
`OverOneDataset` stream (`OrderedStream`), one entry. A source's tokens per sample is
its ``tokens_per_sample`` (the `TokenCounting` capability: `TokenWindows`,
`PackedWindows` give the ``seq_len`` input tokens of a window, not the extra label
token); the padding of ``tail="pad"`` windows is not counted. A stream or source without
the capability it needs is a `CapabilityError` naming it
(`detdata.datasets.capabilities`).
"""

from __future__ import annotations

from detdata.base.errors import ConfigError
from detdata.datasets.base import Dataset, Stream
from detdata.datasets.capabilities import (
    HasSources,
    Named,
    OverOneDataset,
    TokenCounting,
    missing,
)
from detdata.datasets.exclusions import Excluded
from detdata.datasets.packed import PackedWindows
from detdata.loading.provenance import positions_seen


def tokens_per_sample(dataset: Dataset, name: str) -> int:
    """The fixed number of tokens one sample of ``dataset`` delivers (`TokenCounting`;
    `CapabilityError` without it, `ConfigError` if it is not a positive int)."""
    if not isinstance(dataset, TokenCounting):
        raise missing(
            TokenCounting,
            dataset,
            needed_by=f"tokens_consumed() of source {name!r} ({type(dataset).__name__})",
            hint="tokens_consumed() counts fixed-length token windows (TokenWindows, "
            "PackedWindows); give your dataset a tokens_per_sample property",
        )
    value = dataset.tokens_per_sample
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise ConfigError(
            f"source {name!r} ({type(dataset).__name__}): tokens_per_sample must be a "
            f"positive int, found {value!r:.40}"
        )
    return value


def source_name(dataset: Dataset) -> str:
    """The key of a single dataset: its ``name`` (`Named`), else (the default) its identity's
    ``type``."""
    if isinstance(dataset, Named):
        name = dataset.name
        if isinstance(name, str) and name:
            return name
    kind = dataset.identity().get("type")
    return str(kind) if kind else type(dataset).__name__


def tokens_consumed(stream: Stream, consumed: int) -> dict[str, int]:
    """Tokens of the first ``consumed`` positions of ``stream``, per source name.

    An `Excluded` stream counts as the stream it wraps: a replacement comes from the
    excluded sample's own source, so every source's count and tokens per sample stay.
    Padding is not a token: the padded windows of a `PackedWindows` with ``tail="pad"``
    are found where the stream delivered them (`positions_seen`, O(epochs)) and their
    padding subtracted."""
    delivered = stream
    while isinstance(stream, Excluded):
        stream = stream.stream
    if isinstance(stream, HasSources):
        sources = stream.sources
        return {
            n: c * tokens_per_sample(sources[n], n) - _padding(delivered, n, sources[n], consumed)
            for n, c in stream.consumed(consumed).items()
        }
    if not isinstance(stream, OverOneDataset):
        raise missing(
            OverOneDataset,
            stream,
            needed_by="tokens_consumed()",
            hint="count tokens of a Mixture (HasSources) or of a stream over one dataset "
            "(OrderedStream: give your stream a .dataset and sample_ids)",
        )
    dataset = stream.dataset
    name = source_name(dataset)
    full = consumed * tokens_per_sample(dataset, name)
    return {name: full - _padding(delivered, None, dataset, consumed)}


def _padding(stream: Stream, source: str | None, dataset: Dataset, consumed: int) -> int:
    """Padding tokens among the first ``consumed`` positions that ``dataset`` (the source
    ``source`` of ``stream``, None: its only dataset) delivered."""
    if not isinstance(dataset, PackedWindows) or consumed <= 0:
        return 0
    return sum(
        pad * int(positions_seen(stream, source, window, until=consumed).size)
        for window, pad in dataset.padding_tokens().items()
    )
