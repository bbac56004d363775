"""Where a stream's positions come from: source, dataset and sample id of each position.

`origins(stream, positions)` answers for `OrderedStream` (one unnamed source),
`Mixture` (its named sources) and any stream with an ``origins(positions)``
method returning `Origins` (`detdata.datasets.exclusions.Excluded` does), so
provenance and exclusions never reach into a stream's internals.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt

from detdata.base.errors import ConfigError
from detdata.base.types import IntArray
from detdata.datasets.base import Dataset
from detdata.datasets.mixture import Mixture
from detdata.datasets.streams import OrderedStream


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


def origins(stream: Any, positions: npt.ArrayLike) -> Origins:
    """`Origins` of the 1-D ``positions`` of ``stream``."""
    pos = np.asarray(positions, dtype=np.int64).reshape(-1)
    own = getattr(stream, "origins", None)
    if callable(own):
        result = own(pos)
        if not isinstance(result, Origins):
            raise ConfigError(
                f"{type(stream).__name__}.origins returned {type(result).__name__}, "
                "expected detdata.datasets.origins.Origins"
            )
        return result
    if isinstance(stream, Mixture):
        src, _, ids = stream.locate(pos)
        names: Sequence[str | None] = stream.source_names
        return Origins(
            names=tuple(names),
            datasets=tuple(stream.sources[n] for n in stream.source_names),
            source=src.astype(np.int64),
            ids=ids.astype(np.int64),
            notes=(None,) * pos.size,
        )
    if isinstance(stream, OrderedStream):
        return Origins(
            names=(None,),
            datasets=(stream.dataset,),
            source=np.zeros(pos.size, dtype=np.int64),
            ids=np.asarray(stream.sample_ids(pos), dtype=np.int64).reshape(-1),
            notes=(None,) * pos.size,
        )
    raise ConfigError(
        f"cannot tell where the samples of a {type(stream).__name__} come from; hint: use an "
        "OrderedStream or Mixture, or give the stream an origins(positions) -> Origins method"
    )
