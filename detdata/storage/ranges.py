"""Range coalescing: the byte ranges one read needs, in as few requests as the waste bound allows.

Per file, ranges are sorted and overlapping or touching ones merged; then the gaps between
runs are bridged smallest first (ties: leftmost) while the bridged bytes stay ``<= waste *
needed``. So bytes fetched are at most ``(1 + waste)`` x bytes needed, with no fewer requests
possible in that budget (docs/design.md, "Remote reads"). The plan is a pure function of the
ranges: delivered bytes never depend on it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Final

import fsspec
import numpy as np
import numpy.typing as npt

from detdata.base.errors import ConfigError
from detdata.storage.fs import read_ranges_upto
from detdata.storage.retry import RetryPolicy

#: Default waste bound: bytes fetched per file <= (1 + WASTE) x bytes needed.
WASTE: Final = 0.2

I64 = npt.NDArray[np.int64]


@dataclass(frozen=True, kw_only=True)
class Coalesced:
    """Runs covering the ranges of one file, and where each range sits in them.

    ``run_starts`` / ``run_ends``: the requests, sorted, disjoint. ``run_of[i]`` is the run
    holding range ``i`` (input order) and ``offset[i]`` its first byte inside that run.
    ``needed``: the bytes of the ranges' union.
    """

    run_starts: I64
    run_ends: I64
    run_of: I64
    offset: I64
    needed: int = 0


def coalesce(starts: npt.ArrayLike, ends: npt.ArrayLike, *, waste: float = WASTE) -> Coalesced:
    """The requests for byte ranges ``[starts[i], ends[i])`` of ONE file (see the module rule)."""
    if isinstance(waste, bool) or not isinstance(waste, (int, float)) or not waste >= 0:
        raise ConfigError(f"range coalescing waste must be a number >= 0, got {waste!r}")
    a = np.asarray(starts, dtype=np.int64).reshape(-1)
    b = np.asarray(ends, dtype=np.int64).reshape(-1)
    if a.shape != b.shape or (a.size and (int(a.min()) < 0 or bool((b < a).any()))):
        raise ConfigError("coalesce: ranges need 0 <= start <= end and as many starts as ends")
    if a.size == 0:
        empty = np.empty(0, dtype=np.int64)
        return Coalesced(run_starts=empty, run_ends=empty, run_of=empty, offset=empty)
    order = np.argsort(a, kind="stable")
    sa, sb = a[order], b[order]
    reach = np.maximum.accumulate(sb)  # the end of the union so far
    # a new merged run starts where a range begins after everything before it has ended
    new = np.concatenate(([True], sa[1:] > reach[:-1]))
    firsts = np.flatnonzero(new)
    m_starts = sa[firsts]
    m_ends = np.append(reach[firsts[1:] - 1], reach[-1])
    needed = int((m_ends - m_starts).sum())
    gaps = m_starts[1:] - m_ends[:-1]  # > 0 by construction
    bridge = np.zeros(gaps.size, dtype=bool)
    if gaps.size:
        by_size = np.argsort(gaps, kind="stable")  # smallest first, leftmost on ties
        fits = np.cumsum(gaps[by_size]) <= waste * needed
        bridge[by_size[fits]] = True
    keep = np.concatenate(([True], ~bridge))  # merged run j opens a request unless bridged
    run_first = np.flatnonzero(keep)
    run_starts = m_starts[run_first]
    run_ends = np.append(m_ends[run_first[1:] - 1], m_ends[-1])
    merged_run = np.cumsum(new) - 1  # sorted range -> merged run
    request = np.cumsum(keep) - 1  # merged run -> request
    run_sorted = request[merged_run]
    run_of = np.empty_like(run_sorted)
    run_of[order] = run_sorted
    return Coalesced(
        run_starts=run_starts,
        run_ends=run_ends,
        run_of=run_of,
        offset=a - run_starts[run_of],
        needed=needed,
    )


@dataclass(frozen=True)
class FetchStats:
    """What one `read_coalesced` call asked for: ranges, requests and bytes."""

    ranges: int
    requests: int
    bytes_needed: int
    bytes_fetched: int


def read_coalesced(
    fs: fsspec.AbstractFileSystem,
    paths: Sequence[str],
    starts: Sequence[int],
    ends: Sequence[int],
    *,
    policy: RetryPolicy,
    shards: Sequence[str],
    urls: Sequence[str],
    what: str = "range read",
) -> tuple[list[memoryview], FetchStats]:
    """Bytes ``[starts[i], ends[i])`` of ``paths[i]`` for every ``i`` (zero-copy views, input
    order), coalesced per path and fetched with one strict `read_ranges_upto`; and the counts."""
    n = len(paths)
    if not (len(starts) == len(ends) == len(shards) == len(urls) == n):
        raise ConfigError("read_coalesced: paths, starts, ends, shards and urls differ in length")
    a = np.asarray(starts, dtype=np.int64)
    b = np.asarray(ends, dtype=np.int64)
    by_path: dict[str, list[int]] = {}
    for i, p in enumerate(paths):
        by_path.setdefault(p, []).append(i)
    r_paths: list[str] = []
    r_starts: list[int] = []
    r_ends: list[int] = []
    r_shards: list[str] = []
    r_urls: list[str] = []
    where_run = np.empty(n, dtype=np.int64)
    where_off = np.empty(n, dtype=np.int64)
    needed = 0
    for path, members in by_path.items():
        idx = np.asarray(members, dtype=np.int64)
        plan = coalesce(a[idx], b[idx])
        first = len(r_paths)
        k = plan.run_starts.size
        r_paths += [path] * k
        r_starts += plan.run_starts.tolist()
        r_ends += plan.run_ends.tolist()
        r_shards += [shards[members[0]]] * k
        r_urls += [urls[members[0]]] * k
        where_run[idx] = plan.run_of + first
        where_off[idx] = plan.offset
        needed += plan.needed
    blobs = read_ranges_upto(
        fs,
        r_paths,
        r_starts,
        r_ends,
        policy=policy,
        shards=r_shards,
        urls=r_urls,
        what=what,
        upto=False,
    )
    views = [memoryview(blob) for blob in blobs if isinstance(blob, bytes)]  # all, or raised
    lengths = (b - a).tolist()
    out = [
        views[r][o : o + length]
        for r, o, length in zip(where_run.tolist(), where_off.tolist(), lengths, strict=True)
    ]
    fetched = sum(e - s for s, e in zip(r_starts, r_ends, strict=True))
    return out, FetchStats(
        ranges=n, requests=len(r_paths), bytes_needed=needed, bytes_fetched=fetched
    )
