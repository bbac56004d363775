"""Peak memory of a call, as the benchmarks measure it (tracemalloc; numpy reports to it)."""

from __future__ import annotations

import tracemalloc
from collections.abc import Callable


def peak_bytes(fn: Callable[[], object]) -> int:
    """Peak traced allocation (bytes) while ``fn`` runs; tracing is off before and after."""
    tracemalloc.start()
    try:
        fn()
        return tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
