"""Writing a trace: `TraceWriter` appends one record per delivered micro batch (the format:
`detdata.loading.trace`)."""

from __future__ import annotations

import contextlib
import json
import os
from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt

from detdata.base.errors import ConfigError, StorageError
from detdata.loading.trace.digests import batch_digests, position_runs
from detdata.loading.trace.read import Record


def _open_append(path: str) -> int:
    """Open (creating parent folders) a trace file for appending; ConfigError naming it."""
    if "://" in path:
        raise ConfigError(
            f"trace path {path!r} is a URL; traces are written to local files; hint: "
            "write the trace locally and upload it"
        )
    try:
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        return os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    except IsADirectoryError:
        raise ConfigError(
            f"trace path {path!r} is a directory; hint: pass a file name such as "
            f"{os.path.join(path, 'trace.jsonl')!r}"
        ) from None
    except OSError as exc:
        raise ConfigError(
            f"cannot open trace file {path!r} for appending: {exc.strerror or exc}; "
            "hint: pass a writable file path"
        ) from None


@dataclass(frozen=True)
class StepSpan:
    """Where a micro batch lies in the run's steps: its global ``step``, that step's first
    position ``start`` and global batch ``size``, and ``next`` (``samples_consumed`` after
    the batch is counted). The loader derives it from its step <-> position map."""

    step: int
    start: int
    size: int
    next: int


class TraceWriter:
    """Appends one record per delivered micro batch to a JSONL file (format:
    `detdata.loading.trace`); rank ``r > 0`` writes ``{path}.rank{r}``. Opening (when made)
    raises `ConfigError` naming the path when it cannot (a directory, an unwritable place, a URL).

    The loader calls ``add`` for each micro batch *before* it is counted and delivered (if it
    raises, nothing was written: the batch must not be delivered), ``restore`` after a state
    was loaded and ``close`` at the end.
    """

    def __init__(self, path: str | os.PathLike[str], rank: int) -> None:
        p = os.fspath(path)
        self.path = p if rank == 0 else f"{p}.rank{rank}"
        self.rank = rank
        self._restored = False
        self._fd: int | None = _open_append(self.path)

    def restore(self, samples_consumed: int) -> None:
        """The run continues at ``samples_consumed`` (a loaded state): flags the next record."""
        del samples_consumed  # the next record's ``at`` says where; the flag says it was on purpose
        self._restored = True

    def add(
        self,
        samples_consumed: int,
        positions: npt.NDArray[np.int64],
        batch: Any,
        *,
        span: StepSpan,
    ) -> None:
        """Record the micro batch about to be delivered (``samples_consumed`` before counting
        it; ``span`` where it lies in the run's steps); a batch outside its step or without
        positions is a `ConfigError` (never a trace that misstates the run)."""
        if self._fd is None:
            raise ConfigError(
                f"trace file {self.path!r} was closed; hint: a closed DataLoader cannot "
                "deliver more batches with its trace"
            )
        at = int(samples_consumed)
        if not span.start <= at < span.next <= span.start + span.size:
            raise ConfigError(
                f"trace {self.path!r}: micro batch [{at}, {span.next}) is not inside its step "
                f"{span.step} [{span.start}, {span.start + span.size})"
            )
        positions = np.asarray(positions, dtype=np.int64).reshape(-1)
        if not len(positions):
            raise ConfigError(
                f"trace {self.path!r}: a micro batch without positions cannot be recorded"
            )
        cols, sums = batch_digests(positions, batch)
        record = Record(
            where=self.path,
            rank=self.rank,
            step=span.step,
            at=at,
            next=span.next,
            gbs=span.size,
            runs=tuple((first, n) for first, n in position_runs(positions)),
            cols=cols,
            sums=sums,
            restored=self._restored,
            step_at=span.start,
            micro=(at - span.start) // (span.next - at),
        )
        self._append((json.dumps(record.to_json(), sort_keys=True) + "\n").encode())
        self._restored = False

    def _append(self, line: bytes) -> None:
        assert self._fd is not None
        start = os.fstat(self._fd).st_size
        try:
            view = memoryview(line)
            while view:
                view = view[os.write(self._fd, view) :]
        except OSError as exc:
            with contextlib.suppress(OSError):  # leave no partial line behind
                os.ftruncate(self._fd, start)
            raise StorageError(
                f"cannot append to trace file {self.path!r}: {exc.strerror or exc}; the "
                "batch was not delivered; hint: free disk space or move the trace"
            ) from None

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None

    def __del__(self) -> None:
        fd = getattr(self, "_fd", None)
        if fd is not None:
            # no module globals here: at interpreter shutdown they may already be None
            try:
                os.close(fd)
            except Exception:  # a finaliser must never raise
                return


class RankTrace:
    """A loader's trace: ``writer``, the `TraceWriter` of the rank it reads as now (``path``
    None: no trace). Opened when made (a path that cannot be written is a `ConfigError` then)."""

    def __init__(self, path: str | os.PathLike[str] | None, rank: int) -> None:
        self._path = path
        self.writer = None if path is None else TraceWriter(path, rank)

    def follow(self, rank: int) -> None:
        """The loader reads as ``rank`` now: a rank of its own writes its own file."""
        if self.writer is not None and self.writer.rank != rank:
            assert self._path is not None
            self.writer.close()
            self.writer = TraceWriter(self._path, rank)

    def restore(self, samples_consumed: int) -> None:
        """A state was loaded: the next record is flagged ``restored``."""
        if self.writer is not None:
            self.writer.restore(samples_consumed)

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()
