"""What a `DataLoader` delivered at a position of its run, answered with the stream and
layout in force then (`DataLoader.provenance`, `positions_seen`, `stream_at`)."""

from __future__ import annotations

import itertools
import json
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import numpy as np

from detdata.base.checks import check_count
from detdata.base.errors import ConfigError, StateError
from detdata.base.types import MAX_POSITION, IntArray
from detdata.datasets.base import Stream
from detdata.datasets.streams import OrderedStream, as_stream
from detdata.loading.cursor import STREAM_FIELDS, Cursor
from detdata.loading.state import K_SEED, K_STREAM_SEED


def _same(a: Any, b: Any) -> bool:
    return bool(json.dumps(a, sort_keys=True) == json.dumps(b, sort_keys=True))


class Lookup:
    """Provenance queries of a `DataLoader` over its run's history (never move the loader)."""

    def __init__(self, run: Cursor) -> None:
        self._run = run

    def provenance(
        self,
        step: int,
        *,
        decode: Callable[[Mapping[str, Any]], Any] | None = None,
        as_saved: bool = False,
    ) -> Any:
        """`DataLoader.provenance`."""
        from detdata.loading import provenance as prov

        step = check_count(step, "step", minimum=0)
        self._check_delivered(step)
        run = self._run
        start, end = run.plan.start_of(step), run.plan.start_of(step + 1)
        plan = run.saved_plan if as_saved and run.saved_plan is not None else run.plan
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
                micro_batch_size=run.layout.micro_batch_size,
                world_size=run.layout.world_size,
                decode=decode,
                layouts=layouts,
                first=start,
            )
        return records

    def positions_seen(self, source: str | None, sample_id: int, *, until: int) -> IntArray:
        """`DataLoader.positions_seen`."""
        from detdata.loading.provenance import positions_seen

        until = check_count(until, "until", minimum=0, maximum=MAX_POSITION)
        total = self._run.total_samples
        if total is not None and until > total:
            raise ConfigError(
                f"until={until} is past the last position this run delivers: total_samples is "
                f"{total} (last step {self._last_step()}); hint: until <= {total}"
            )
        parts = [np.zeros(0, dtype=np.int64)]
        for lo, hi in self._segments(0, until):
            found = positions_seen(self.stream_at(lo), source, sample_id, until=hi)
            parts.append(found[found >= lo])
        return np.concatenate(parts).astype(np.int64)

    def _segments(self, start: int, end: int) -> list[tuple[int, int]]:
        """``[start, end)`` cut at the positions where a change of the stream took effect."""
        changes = self._run.plan.changes_after(start, STREAM_FIELDS)
        cuts = sorted({c.position for c in changes} - {end})
        bounds = [start, *(c for c in cuts if c < end), end]
        return [(a, b) for a, b in itertools.pairwise(bounds) if a < b]

    def stream_at(self, position: int) -> Stream:
        """`DataLoader.stream_at`."""
        later = self._run.plan.changes_after(position, STREAM_FIELDS)
        if not later:
            return self._run.stream
        then = dict(self._run.definition.fields(self._run.stream))
        for change in reversed(self._run.plan.changes):
            if change.position > position:
                then[change.field] = change.old
        for candidate in self._earlier_streams(then):
            if self._delivers_as(candidate, then):
                return candidate
        raise StateError(
            f"position {position} (step {self._run.plan.step_of(position)}) was delivered before "
            + "; ".join(c.describe() for c in later)
            + ", and this loader cannot rebuild the stream of that time; hint: answer it with "
            "the data definition of that time and the state saved before the change",
            fields=tuple(dict.fromkeys(c.field for c in later)),
        )

    def _delivers_as(self, stream: Stream, then: Mapping[str, Any]) -> bool:
        """``stream`` has the fields in force ``then`` and orders with the seed of that time
        (its identity's own seed: ``stream_seed``, or ``seed`` when the loader ordered it)."""
        fields = self._run.definition.fields(stream, seed=then[K_SEED])
        if not all(_same(fields[k], then[k]) for k in STREAM_FIELDS):
            return False
        own = stream.identity().get("seed")
        expected = then[K_SEED] if then[K_STREAM_SEED] is None else then[K_STREAM_SEED]
        return own is None or _same(own, expected)

    def _earlier_streams(self, then: Mapping[str, Any]) -> Iterator[Stream]:
        """This loader's stream, then those it can build with the seeds in force ``then``
        (same data, same order)."""
        stream, definition = self._run.stream, self._run.definition
        yield stream
        seed = then[K_SEED]
        if definition.wrapped and isinstance(seed, int):  # the loader ordered it
            yield as_stream(definition.data, seed, order=definition.order)
        own = then[K_STREAM_SEED]
        if isinstance(stream, OrderedStream) and isinstance(own, int):
            yield OrderedStream(stream.dataset, own, order=stream.order_choice)

    def _last_step(self) -> str:
        total = self._run.total_samples
        if not total:
            return "none: it delivers nothing"
        return str(self._run.plan.step_of(total - 1))

    def _check_delivered(self, step: int) -> None:
        """``step`` ends by ``total_samples`` and ``2**62`` (`ConfigError` otherwise)."""
        plan, total = self._run.plan, self._run.total_samples
        end = plan.start_of(step + 1)
        if end > MAX_POSITION:
            raise ConfigError(
                f"step {step} is never delivered: it ends at position {end}, past the last "
                f"addressable position 2**62 - 1 (last step "
                f"{plan.step_of(MAX_POSITION - 1)}); hint: ask for a step the run delivers"
            )
        if total is None:
            return
        if end > total:
            raise ConfigError(
                f"step {step} is never delivered: this run stops at total_samples "
                f"{total} (last delivered step {self._last_step()}); hint: ask "
                "for a step the run delivers"
            )
