"""Where a `DataLoader`'s micro batches are read: the `BatchSource` protocol, inline
(`InlineSource`), on threads (`ThreadSource`) or in worker processes
(`detdata.loading.torch_workers.WorkerSource`). Every source reads the same groups with the
same reader (`Reads`), so bytes and order never depend on which runs; none counts batches.
"""

from __future__ import annotations

import collections
from collections.abc import Callable, Iterator, Mapping
from typing import Any, Final, Protocol

from detdata.base.types import IntArray
from detdata.loading.arguments import WorkerMode
from detdata.loading.reading import Reads, RunSlice
from detdata.loading.threads import threaded_batches
from detdata.loading.torch_workers import WorkerSource

#: Groups of micro batches the inline loader (``num_workers=0``) hints to the stream ahead
#: of the one it reads (`InlineSource`).
GROUPS_AHEAD: Final = 2


class BatchSource(Protocol):
    """This rank's micro batches of a `RunSlice`, in order."""

    #: batches come from worker processes (a socket error may be a worker's death)
    in_processes: bool

    def batches(self, at: RunSlice) -> Iterator[Any]:
        """A generator of the micro batches of ``at``; closing it stops the readers."""

    def reset(self) -> None:
        """Forget kept readers (persistent workers): the loader moved, closed, or an
        iteration ended abnormally."""


class InlineSource:
    """``num_workers=0``: the workers' reader in this process, the next `GROUPS_AHEAD` groups
    hinted to the stream ahead (`GroupReader.read_ahead`; dropped when the loop ends)."""

    in_processes = False

    def __init__(self, reads: Reads) -> None:
        self._reads = reads

    def batches(self, at: RunSlice) -> Iterator[Any]:
        read = self._reads.reader(at.stream, in_worker=False)
        groups = iter(at.groups(self._reads.batches_ahead))
        ahead: collections.deque[list[IntArray]] = collections.deque()
        try:
            while True:
                while len(ahead) <= GROUPS_AHEAD and (group := next(groups, None)):
                    read.read_ahead(group)
                    ahead.append(group)
                if not ahead:
                    return
                result = read(ahead.popleft())
                yield from result.deliver()
        finally:
            read.read_ahead(None)

    def reset(self) -> None:
        """Nothing is kept between iterations."""


class ThreadSource:
    """Reads on ``threads`` threads of this process, in order, ``depth`` groups in flight
    (see `WorkerMode.THREAD`)."""

    in_processes = False

    def __init__(self, reads: Reads, *, threads: int, depth: int) -> None:
        self._reads = reads
        self._threads = threads
        self._depth = depth

    def batches(self, at: RunSlice) -> Iterator[Any]:
        groups = threaded_batches(
            self._reads.reader(at.stream, in_worker=False),
            iter(at.groups(self._reads.batches_ahead)),
            self._threads,
            self._depth,
        )
        try:
            for result in groups:
                yield from result.deliver()
        finally:
            # an error raised here must not leave the readers to the garbage collector
            groups.close()

    def reset(self) -> None:
        """Nothing is kept between iterations."""


def batch_source(
    reads: Reads,
    mode: WorkerMode,
    torch_kwargs: Mapping[str, Any],
    worker_init_fn: Callable[[int], None] | None,
) -> BatchSource:
    """The source of ``torch_kwargs["num_workers"]`` readers in ``mode``."""
    workers = torch_kwargs["num_workers"]
    if workers == 0:
        return InlineSource(reads)
    if mode is WorkerMode.THREAD:
        depth = workers * torch_kwargs.get("prefetch_factor", 2)
        return ThreadSource(reads, threads=workers, depth=depth)
    return WorkerSource(reads, torch_kwargs, worker_init_fn)
