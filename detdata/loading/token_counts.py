"""Tokens delivered per source (`DataLoader.tokens_consumed`), as trainers log them
(docs/design.md, "Batch-size schedules and elastic resume").

Counted on ``samples_consumed`` (all ranks): a `Mixture` per source from `Mixture.consumed`
(exact, O(phases + sources)), another stream over several sources from its origins
(O(position)). A stream or source without what it needs is a `CapabilityError` naming it.
"""

from __future__ import annotations

from typing import Final

import numpy as np

from detdata.base.errors import ConfigError
from detdata.datasets.base import Dataset, Stream
from detdata.datasets.capabilities import DatasetInfo, HasOrigins, Origins, info, missing
from detdata.datasets.exclusions import Excluded
from detdata.datasets.mixture import Mixture
from detdata.datasets.packed import PackedWindows
from detdata.loading.history import is_count
from detdata.loading.provenance import positions_seen

_CHUNK: Final = 1 << 20  # positions whose origins are counted at once


def tokens_per_sample(dataset: Dataset, name: str) -> int:
    """The fixed number of tokens one sample of ``dataset`` delivers (`DatasetInfo`;
    `CapabilityError` without it, `ConfigError` if it is not a positive int)."""
    value = info(dataset).tokens_per_sample
    if value is None:
        raise missing(
            DatasetInfo,
            dataset,
            member=".tokens_per_sample",
            needed_by=f"tokens_consumed() of source {name!r} ({type(dataset).__name__})",
            hint="tokens_consumed() counts fixed-length token windows (TokenWindows, "
            "PackedWindows); subclass DatasetInfo and give your dataset a tokens_per_sample "
            "property",
        )
    if not is_count(value, 1):
        raise ConfigError(
            f"source {name!r} ({type(dataset).__name__}): tokens_per_sample must be a "
            f"positive int, found {value!r:.40}"
        )
    return value


def source_name(dataset: Dataset) -> str:
    """The key of a single dataset: its identity's ``name`` (`ArrayDataset`), else (the
    default) its identity's ``type``."""
    identity = dataset.identity()
    for key in ("name", "type"):
        if isinstance(identity.get(key), str) and identity[key]:
            return str(identity[key])
    return type(dataset).__name__


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
    if not isinstance(stream, HasOrigins):
        raise missing(
            HasOrigins,
            stream,
            needed_by="tokens_consumed()",
            hint="count tokens of a Mixture or an OrderedStream, or give your stream "
            "origins(positions) (what it draws from)",
        )
    found = stream.origins(np.empty(0, dtype=np.int64))
    out: dict[str, int] = {}
    for name, dataset, count in zip(
        found.names, found.datasets, _counts(stream, found, consumed), strict=True
    ):
        key = source_name(dataset) if name is None else name
        full = count * tokens_per_sample(dataset, key)
        out[key] = full - _padding(delivered, name, dataset, consumed)
    return out


def _counts(stream: HasOrigins, found: Origins, consumed: int) -> list[int]:
    """Samples of each source of ``found`` among positions ``[0, consumed)``."""
    if len(found.datasets) == 1:
        return [consumed]
    if isinstance(stream, Mixture):
        counts = stream.consumed(consumed)
        return [counts[str(n)] for n in found.names]
    total = np.zeros(len(found.datasets), dtype=np.int64)
    for lo in range(0, consumed, _CHUNK):
        src = stream.origins(np.arange(lo, min(consumed, lo + _CHUNK), dtype=np.int64)).source
        total += np.bincount(src, minlength=len(found.datasets))
    return [int(c) for c in total]


def _padding(stream: Stream, source: str | None, dataset: Dataset, consumed: int) -> int:
    """Padding tokens among the first ``consumed`` positions that ``dataset`` (the source
    ``source`` of ``stream``, None: its only dataset) delivered."""
    if not isinstance(dataset, PackedWindows) or consumed <= 0:
        return 0
    return sum(
        pad * int(positions_seen(stream, source, window, until=consumed).size)
        for window, pad in dataset.padding_tokens().items()
    )
