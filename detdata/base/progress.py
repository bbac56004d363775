"""Progress of long work (hashing, verifying, index builds, splits): one home for every caller.

``enabled`` None (the default): a tqdm bar when stderr is a terminal, else a plain line on
stderr every `LOG_EVERY_S` seconds (``detdata: hashing shards: 1,200/10,000 (12%), 45.3
shard/s, ETA 3m14s``) and a closing line where lines were shown (also for short work with
``enabled=True``); False: nothing. ``DETDATA_PROGRESS=0`` silences it
everywhere, ``=1`` acts as ``enabled=True``. Progress never changes a result.
"""

from __future__ import annotations

import contextlib
import math
import os
import sys
import time
from collections.abc import Callable, Iterator
from typing import Final, TextIO

#: Seconds between two log lines when stderr is not a terminal.
LOG_EVERY_S: Final = 30.0
ENV: Final = "DETDATA_PROGRESS"
_ON: Final = {"1", "true", "yes", "on"}


def _switch() -> str:
    return os.environ.get(ENV, "").strip().lower()


def wanted(enabled: bool | None) -> bool:
    """Whether progress is shown: ``DETDATA_PROGRESS`` (0 / 1) decides first, then ``enabled``
    (None: always, as a bar on a terminal or as log lines elsewhere)."""
    switch = _switch()
    if switch in {"0", "false", "no", "off"}:
        return False
    return True if switch in _ON or enabled is None else bool(enabled)


def _duration(seconds: float) -> str:
    if not math.isfinite(seconds):
        return "?"
    s = int(seconds)
    return f"{s // 3600}h{s % 3600 // 60:02d}m" if s >= 3600 else f"{s // 60}m{s % 60:02d}s"


class LogLines:
    """Plain progress lines on ``stream`` at most every `LOG_EVERY_S` seconds, and a closing
    one where lines were shown (or ``closing``). ``total`` None: work of unknown size."""

    def __init__(
        self, total: int | None, desc: str, unit: str, *, stream: TextIO, closing: bool
    ) -> None:
        self.total, self.desc, self.unit = total, desc, unit
        self.stream = stream
        self.done = 0
        self.start = self.last = time.monotonic()
        self.lines = 0
        self.closing = closing

    def update(self, n: int) -> None:
        self.done += n
        now = time.monotonic()
        if now - self.last >= LOG_EVERY_S:
            self.last = now
            self._line(now)

    def close(self) -> None:
        if self.lines or self.closing:
            self._line(time.monotonic(), final=True)

    def _line(self, now: float, *, final: bool = False) -> None:
        elapsed = max(now - self.start, 1e-9)
        rate = self.done / elapsed
        if self.total is None:
            text = f"{self.done:,} {self.unit} so far, {rate:,.1f} {self.unit}/s"
            if final:
                text = f"{self.done:,} {self.unit} in {_duration(elapsed)}"
        else:
            eta = (self.total - self.done) / rate if rate > 0 else math.inf
            pct = 100.0 * self.done / self.total if self.total else 100.0
            tail = f"done in {_duration(elapsed)}" if final else f"ETA {_duration(eta)}"
            text = f"{self.done:,}/{self.total:,} ({pct:.0f}%), {rate:,.1f} {self.unit}/s, {tail}"
        print(f"detdata: {self.desc}: {text}", file=self.stream, flush=True)
        self.lines += 1


@contextlib.contextmanager
def progress(
    total: int | None,
    desc: str,
    *,
    unit: str = "it",
    enabled: bool | None = None,
) -> Iterator[Callable[[int], None]]:
    """A callback ``update(n)`` (n more units done) for ``total`` units (see the module)."""
    if (total is not None and total <= 0) or not wanted(enabled):
        yield lambda _n: None
        return
    if sys.stderr.isatty():
        from tqdm import tqdm

        bar = tqdm(total=total, desc=desc, unit=unit, unit_scale=True, file=sys.stderr)
        try:
            yield bar.update
        finally:
            bar.close()
        return
    forced = enabled is True or _switch() in _ON  # a closing line even for short work
    lines = LogLines(total, desc, unit, stream=sys.stderr, closing=forced)
    try:
        yield lines.update
    finally:
        lines.close()
