"""Which stream and which samples a `DataLoader` delivered at a position of its run.

`Lookup.provenance` answers every sample of a step, `Lookup.positions_seen` every position
of a sample, each with the configuration in force when that position was delivered: the
stream of the seed, data and order of that time (`Lookup.stream_at`, rebuilt when a change
allowed at a resume replaced it) and the layout of the run's history.
"""

from __future__ import annotations

import itertools
import json
from collections.abc import Callable, Iterator, Mapping
from typing import Any, Final

import numpy as np

from detdata.base.checks import check_count
from detdata.base.errors import ConfigError, StateError
from detdata.base.types import MAX_POSITION, IntArray
from detdata.datasets.base import Stream
from detdata.datasets.streams import OrderedStream, as_stream
from detdata.loading.loader_base import LoaderBase
from detdata.loading.state import (
    K_ALGORITHM,
    K_DATA,
    K_MANIFESTS,
    K_SEED,
    K_STREAM_SEED,
    identity_fields,
)

#: Checked fields whose change at a resume gives earlier positions another stream.
STREAM_FIELDS: Final = (K_SEED, K_STREAM_SEED, K_MANIFESTS, K_DATA, K_ALGORITHM)


def _same(a: Any, b: Any) -> bool:
    return bool(json.dumps(a, sort_keys=True) == json.dumps(b, sort_keys=True))


class Lookup(LoaderBase):
    """Provenance queries of a `DataLoader` over its run's history (never move the loader)."""

    def provenance(
        self,
        step: int,
        *,
        decode: Callable[[Mapping[str, Any]], Any] | None = None,
        as_saved: bool = False,
    ) -> Any:
        """Every sample of global ``step`` (all ranks): a list of
        `detdata.loading.provenance.SampleRecord` (position, rank, micro step, source, sample id,
        shard path and row/token/byte range, blake3 of the sample as the stream delivers it).
        Reads that step's samples once; never moves ``samples_consumed``.

        Each position is answered with the configuration in force when it was delivered: the
        stream of the seed, data and order of that time (`stream_at`: a `StateError` when this
        loader cannot rebuild it), the layout of the run's history. ``as_saved``: positions
        after the loaded state's are placed with the layout that state was saved with, not
        this process's (a diagnostic tool, whose own process is not one of the run's ranks).
        A step past ``total_samples`` is never delivered: `ConfigError` naming the last."""
        from detdata.loading import provenance as prov

        step = check_count(step, "step", minimum=0)
        self._check_delivered(step)
        start, end = self.position_of_step(step), self.position_of_step(step + 1)
        plan = self._saved_plan if as_saved and self._saved_plan is not None else self._plan
        layouts = [  # the layout each position was delivered with (history)
            (e.position, e.micro_batch_size, e.world_size)
            for e in plan.entries
            if e.micro_batch_size is not None and e.world_size is not None
        ]
        records: list[Any] = []
        for lo, hi in self._segments(start, end):
            records += prov.provenance(
                self.stream_at(lo),
                np.arange(lo, hi),
                step=step,
                micro_batch_size=self.layout.micro_batch_size,
                world_size=self.layout.world_size,
                decode=decode,
                layouts=layouts,
                first=start,
            )
        return records

    def positions_seen(self, source: str | None, sample_id: int, *, until: int) -> IntArray:
        """Every global position ``< until`` at which this run delivered (or, past its
        position, delivers) sample ``sample_id`` of ``source``, each range of positions
        inverted with the stream in force there (`stream_at`); ``until`` past
        ``total_samples`` is a `ConfigError`."""
        from detdata.loading.provenance import positions_seen

        until = check_count(until, "until", minimum=0, maximum=MAX_POSITION)
        if self.total_samples is not None and until > self.total_samples:
            raise ConfigError(
                f"until={until} is past the last position this run delivers: total_samples is "
                f"{self.total_samples} (last step {self._last_step()}); hint: until <= "
                f"{self.total_samples}"
            )
        parts = [np.zeros(0, dtype=np.int64)]
        for lo, hi in self._segments(0, until):
            found = positions_seen(self.stream_at(lo), source, sample_id, until=hi)
            parts.append(found[found >= lo])
        return np.concatenate(parts).astype(np.int64)

    def _segments(self, start: int, end: int) -> list[tuple[int, int]]:
        """``[start, end)`` cut at the positions where a change of the stream took effect."""
        cuts = sorted({c.position for c in self._plan.changes_after(start, STREAM_FIELDS)} - {end})
        bounds = [start, *(c for c in cuts if c < end), end]
        return [(a, b) for a, b in itertools.pairwise(bounds) if a < b]

    def stream_at(self, position: int) -> Stream:
        """The stream that delivered (or delivers) ``position``: this loader's, or, before a
        change of ``seed``, ``stream_seed``, ``manifests``, ``data`` or ``algorithm`` allowed
        at a resume (the state's history), the stream of that time when this loader can
        rebuild it (another seed over the same dataset and order, checked against the
        fields in force then); otherwise a `StateError` naming the change."""
        later = self._plan.changes_after(position, STREAM_FIELDS)
        if not later:
            return self._stream
        then = dict(self._fields())
        for change in reversed(self._plan.changes):
            if change.position > position:
                then[change.field] = change.old
        for candidate in self._earlier_streams(then):
            if self._delivers_as(candidate, then):
                return candidate
        raise StateError(
            f"position {position} (step {self.step_of_position(position)}) was delivered before "
            + "; ".join(c.describe() for c in later)
            + ", and this loader cannot rebuild the stream of that time; hint: answer it with "
            "the data definition of that time and the state saved before the change",
            fields=tuple(dict.fromkeys(c.field for c in later)),
        )

    def _delivers_as(self, stream: Stream, then: Mapping[str, Any]) -> bool:
        """``stream`` has the fields in force ``then`` and orders with the seed of that time
        (its identity's own seed: ``stream_seed``, or ``seed`` when the loader ordered it)."""
        fields = self._fields_of(stream, then)
        if not all(_same(fields[k], then[k]) for k in STREAM_FIELDS):
            return False
        own = stream.identity().get("seed")
        expected = then[K_SEED] if then[K_STREAM_SEED] is None else then[K_STREAM_SEED]
        return own is None or _same(own, expected)

    def _earlier_streams(self, then: Mapping[str, Any]) -> Iterator[Stream]:
        """This loader's stream (a change of the loader's own seed leaves a stream the caller
        built as it was), then the streams it can build with the seeds in force ``then``
        (same data, same order)."""
        yield self._stream
        seed = then[K_SEED]
        if self._wrapped and isinstance(seed, int):  # the loader ordered it
            yield as_stream(self._data, seed, order=self._order)
        own = then[K_STREAM_SEED]
        if isinstance(self._stream, OrderedStream) and isinstance(own, int):
            yield OrderedStream(self._stream.dataset, own, order=self._stream.order_choice)

    def _fields_of(self, stream: Stream, then: Mapping[str, Any]) -> dict[str, Any]:
        identity = stream.identity()
        return identity_fields(  # as `_fields` derives them (a continued mixture included)
            identity,
            then[K_SEED],
            self._schedule.to_json(),
            stream_seed=None if self._wrapped else identity.get("seed"),
            transform=self._transform_name,
        )

    def _last_step(self) -> str:
        total = self.total_samples
        if not total:
            return "none: it delivers nothing"
        return str(self._plan.step_of(total - 1))

    def _check_delivered(self, step: int) -> None:
        """``step`` ends at or before ``total_samples`` and the last addressable position
        ``2**62`` (`ConfigError` naming the last step delivered)."""
        end = self._plan.start_of(step + 1)
        if end > MAX_POSITION:
            raise ConfigError(
                f"step {step} is never delivered: it ends at position {end}, past the last "
                f"addressable position 2**62 - 1 (last step "
                f"{self._plan.step_of(MAX_POSITION - 1)}); hint: ask for a step the run delivers"
            )
        if self.total_samples is None:
            return
        if end > self.total_samples:
            raise ConfigError(
                f"step {step} is never delivered: this run stops at total_samples "
                f"{self.total_samples} (last delivered step {self._last_step()}); hint: ask "
                "for a step the run delivers"
            )
