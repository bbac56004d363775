"""The loader's batch sources alone (`detdata.loading.sources`, issue 42): each reads the
micro batches of a `RunSlice` in order, the ids the documented order gives (an independent
reference: `GlobalOrder` of the position, docs/design.md section 4), without a `DataLoader`;
kept worker processes serve only the stream, layout and bound they were started for."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

import detdata
from detdata.loading.arguments import WorkerMode
from detdata.loading.layout import Layout
from detdata.loading.reading import Reads, RunSlice
from detdata.loading.sources import batch_source
from detdata.loading.torch_workers import WorkerSource

N, SEED = 300, 3
MODES = {"inline": (0, WorkerMode.PROCESS), "threads": (2, WorkerMode.THREAD)}
MODES["processes"] = (2, WorkerMode.PROCESS)


def stream() -> detdata.OrderedStream:
    ids = np.arange(N, dtype=np.int64)
    return detdata.OrderedStream(detdata.ArrayDataset({"id": ids, "x": ids * 3}), SEED)


def expected(layout: Layout, start: int, stop: int) -> list[list[int]]:
    """The ids of the rank's micro steps from ``start`` before ``stop``, placed by hand."""
    order, per, out = detdata.GlobalOrder(N, SEED), layout.micro_batch_size * 2, []
    for j in range(start // per, -(-stop // per)):
        first = j * per + layout.rank * layout.micro_batch_size
        out.append(order.ids(np.arange(first, first + layout.micro_batch_size)).tolist())
    return out


def source(mode: str, **torch_kwargs: Any) -> Any:
    workers, worker_mode = MODES[mode]
    reads = Reads(transform=None, seed=SEED, collate_fn=None, pin_memory=False, batches_ahead=3)
    kwargs = {"num_workers": workers, "pin_memory": False, "timeout": 0, **torch_kwargs}
    kwargs.setdefault("persistent_workers", False)
    return batch_source(reads, worker_mode, kwargs, worker_init_fn=None)


@pytest.mark.parametrize("mode", list(MODES))
def test_each_source_reads_the_slice_in_the_documented_order(mode: str) -> None:
    layout = Layout(micro_batch_size=4, world_size=2, rank=1)
    s = source(mode)
    got = [b["id"].tolist() for b in s.batches(RunSlice(stream(), layout, 16, 80))]
    assert got == expected(layout, 16, 80)
    assert [b["x"].tolist() for b in s.batches(RunSlice(stream(), layout, 16, 80))] == [
        [3 * i for i in ids] for ids in got
    ]
    assert s.in_processes is (mode == "processes")


def test_kept_workers_serve_only_the_layout_they_were_started_for() -> None:
    data, first = stream(), Layout(micro_batch_size=4, world_size=2, rank=1)
    s = source("processes", persistent_workers=True)
    assert isinstance(s, WorkerSource)

    def ids(layout: Layout, start: int) -> list[list[int]]:
        return [b["id"].tolist() for b in s.batches(RunSlice(data, layout, start, 72))]

    assert ids(first, 0) == expected(first, 0, 72)
    kept = s.transport
    assert ids(first, 24) == expected(first, 24, 72)  # an iteration from another position
    assert s.transport is kept and kept is not None  # by the same workers
    other = Layout(micro_batch_size=4, world_size=2, rank=0)  # e.g. the rank re-read at iter()
    assert ids(other, 48) == expected(other, 48, 72)
    assert s.transport is not kept  # by new workers, started for the new layout
    s.reset()
    assert s.transport is None
