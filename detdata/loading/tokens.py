"""Tokens delivered per source (`DataLoader.tokens_consumed`), as trainers log them.

Counted on samples that reached the callers of all ranks (``samples_consumed``): for a
`Mixture`, each source's consumed count at that position (`Mixture.consumed`, exact,
O(phases + sources)) times its tokens per sample; for a stream over one dataset, one entry.
A source's tokens per sample is its ``tokens_per_sample`` attribute, else its ``seq_len``
(`TokenWindows`, `PackedWindows`: the ``seq_len`` input tokens of a window, not the extra
label token); the padding of ``tail="pad"`` windows is not counted.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from detdata.base.errors import ConfigError


def tokens_per_sample(dataset: Any, name: str) -> int:
    """The fixed number of tokens one sample of ``dataset`` delivers (`ConfigError` if none)."""
    for attr in ("tokens_per_sample", "seq_len"):
        value = getattr(dataset, attr, None)
        if isinstance(value, int) and not isinstance(value, bool) and value > 0:
            return value
    raise ConfigError(
        f"source {name!r} ({type(dataset).__name__}) has no fixed number of tokens per sample "
        "(no positive int attribute tokens_per_sample or seq_len); hint: tokens_consumed() "
        "counts fixed-length token windows (TokenWindows, PackedWindows); give your dataset "
        "a tokens_per_sample attribute"
    )


def source_name(dataset: Any) -> str:
    """The key of a single dataset: its ``name`` attribute, else its identity's ``type``."""
    name = getattr(dataset, "name", None)
    if isinstance(name, str) and name:
        return name
    kind = dataset.identity().get("type")
    return str(kind) if kind else type(dataset).__name__


def tokens_consumed(stream: Any, consumed: int) -> dict[str, int]:
    """Tokens of the first ``consumed`` positions of ``stream``, per source name.

    An `Excluded` stream counts as the stream it wraps: a replacement comes from the
    excluded sample's own source, so every source's count and tokens per sample stay.
    Padding is not a token: the padded windows of a `PackedWindows` with ``tail="pad"``
    are found where the stream delivered them (`positions_seen`, O(epochs)) and their
    padding subtracted."""
    from detdata.datasets.exclusions import Excluded

    delivered = stream
    while isinstance(stream, Excluded):
        stream = stream.stream
    counts = getattr(stream, "consumed", None)
    sources = getattr(stream, "sources", None)
    if callable(counts) and isinstance(sources, Mapping):
        per_source: Mapping[str, int] = counts(consumed)
        return {
            n: c * tokens_per_sample(sources[n], n) - _padding(delivered, n, sources[n], consumed)
            for n, c in per_source.items()
        }
    dataset = getattr(stream, "dataset", None)
    if dataset is None:
        raise ConfigError(
            f"tokens_consumed() needs a Mixture or a stream over one dataset (with "
            f".dataset); got {type(stream).__name__}"
        )
    name = source_name(dataset)
    full = consumed * tokens_per_sample(dataset, name)
    return {name: full - _padding(delivered, None, dataset, consumed)}


def _padding(stream: Any, source: str | None, dataset: Any, consumed: int) -> int:
    """Padding tokens among the first ``consumed`` positions that ``dataset`` (the source
    ``source`` of ``stream``, None: its only dataset) delivered."""
    from detdata.datasets.packed import PackedWindows
    from detdata.loading.provenance import positions_seen

    if not isinstance(dataset, PackedWindows) or consumed <= 0:
        return 0
    return sum(
        pad * int(positions_seen(stream, source, window, until=consumed).size)
        for window, pad in dataset.padding_tokens().items()
    )
