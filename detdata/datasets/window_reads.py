"""`WindowReads`, the read path of `detdata.TokenWindows` (a part it holds): window ids ->
(shard, byte range, result row). Arithmetic only: `detdata.storage` moves the bytes.

Ids of one shard: ONE fancy-index gather from a strided view of its memory map. Ids of
several: grouped by shard (`_Groups`); mapped shards gathered from their views, the others
(with the handle LRU full) read without keeping anything open, as a value: a
`detdata.storage.reads.ReadPlan` that storage executes (`read_ahead` starts it early) and
an `Assembly` that makes the rows. Remote roots: coalesced ranges in one ``cat_ranges``
call, or whole shards copied into a verified `ShardCache`. Every read and open is checked
as `detdata.datasets.shard_files` says.
"""

from __future__ import annotations

import os
from typing import Any, Final, NamedTuple

import fsspec
import numpy as np
import numpy.typing as npt

from detdata.base.errors import StorageError
from detdata.base.groupby import stable_groups
from detdata.base.types import IntArray
from detdata.datasets.base import check_ids
from detdata.datasets.process_local import PerProcess
from detdata.datasets.shard_files import ShardFiles
from detdata.datasets.shard_windows import COVER_MAX_BYTES, DENSE_SPAN, MAP_MIN_ROWS, ShardWindows
from detdata.datasets.window_layout import WindowLayout
from detdata.storage.fileread import FileReads
from detdata.storage.fs import join
from detdata.storage.mapped import Mapped
from detdata.storage.ranges import read_coalesced
from detdata.storage.reads import OpenChecks, ReadAhead, ReadPlan, execute

#: At most this many windows (one buffer each) in one ``preadv`` straight into the result
#: (well under the usual ``IOV_MAX`` of 1,024).
_IOV_ROWS: Final = 256
#: Native threads reading one `WindowReads.read_ahead` in the background.
PREFETCH_THREADS: Final = 2
#: Reads a dataset keeps planned by `WindowReads.read_ahead` (an older one is dropped; each
#: holds its result buffer).
PREFETCH_DEPTH: Final = 4

Array = np.ndarray[Any, Any]


class Assembly(NamedTuple):
    """How the result rows come out of a read `ReadPlan`'s buffers: ``out`` (rows already
    written; None: the staged windows are the whole result); ``labels``: ``(rows, next)``,
    each row's label token is row ``next``'s first; ``staged``: ``(sliding, starts,
    dest)``, rows ``dest`` are ``sliding[starts]`` (all rows, in order, without ``out``)."""

    out: Array | None
    labels: tuple[IntArray, IntArray] | None
    staged: tuple[Array, IntArray, IntArray] | None


class _Groups(NamedTuple):
    """A read's ids sorted and grouped by shard: per sorted id its ``shard``, ``local``
    window and result row (``order``); per group (touched shard) ``gshard``, its first
    sorted row ``begin``, ``counts`` and ``extent`` (max - min + 1 windows)."""

    shard: IntArray
    local: IntArray
    order: IntArray
    gshard: IntArray
    begin: IntArray
    counts: IntArray
    extent: IntArray


def _sorted_rows(begin: IntArray, count: IntArray) -> IntArray:
    """The concatenated ranges ``[begin[i], begin[i] + count[i])`` (sorted rows of groups)."""
    return np.repeat(begin - (np.cumsum(count) - count), count) + np.arange(
        int(count.sum()), dtype=np.int64
    )


def _new_read_ahead() -> ReadAhead:
    return ReadAhead(PREFETCH_DEPTH, PREFETCH_THREADS)


class WindowReads:
    """The windows of ``layout`` from the files of ``files`` (module docstring); one
    shard's reads are `ShardWindows`' (``shards``)."""

    def __init__(self, layout: WindowLayout, files: ShardFiles) -> None:
        self.layout = layout
        self.files = files
        self.shards = ShardWindows(layout, files)
        self._ahead: PerProcess[ReadAhead] = PerProcess()

    @property
    def ahead(self) -> ReadAhead:
        """This process's reads planned ahead (`read_ahead`)."""
        return self._ahead.get(_new_read_ahead)

    # local reads ---------------------------------------------------------------------
    def gather_local(self, ids: IntArray, lo: int, hi: int, *, cached: bool = False) -> Array:
        """The windows ``ids`` (all in ``[lo, hi]``) in ``out_dtype`` (module docstring)."""
        layout = self.layout
        first, last = layout.first_shard(lo), layout.first_shard(hi)
        if first == last:
            return self._gather_one(first, ids, cached)
        ahead = self.ahead
        planned = ahead.take(ids) if len(ahead) and not cached else None
        if planned is not None:
            return self.assemble(planned.finish())
        plan, assembly = self.plan(ids, cached)
        execute(plan)
        return self.assemble(assembly)

    def _gather_one(self, shard: int, ids: IntArray, cached: bool) -> Array:
        """`gather_local` of ids all in ``shard``."""
        layout, one = self.layout, self.shards
        if cached:
            self.files.refresh_copies((shard,))
        start = int(layout.starts[shard])
        local = ids - start if start else ids
        extent = int(local.max()) - int(local.min()) + 1
        cover = one.covered(shard, int(ids.size), extent)
        view = one.mapped_view(shard, int(ids.size), cover, cached=cached)
        if view is None:
            out = np.empty((ids.size, layout.window), dtype=layout.out_dtype)
            where = layout.byte_offsets(np.full(ids.size, shard, dtype=np.int64), local)
            prefix = join(self.files.filesystem()[1], "")
            one.pread_rows(
                shard, prefix, list(range(ids.size)), where, out, cover, self.files.checks()
            )
            return out
        block = view[local]
        if block.dtype == layout.out_dtype:
            return block
        if layout.narrowing[shard]:
            one.check_range(block, shard)
        return block.astype(layout.out_dtype)

    def read_ahead(self, ids: npt.ArrayLike | None) -> None:
        """`detdata.TokenWindows.read_ahead`. Only reads of several local shards through the
        batched file loop are planned (others have nothing to overlap)."""
        ahead = self.ahead
        if ids is None:
            ahead.clear()
            return
        if not ahead.enabled:
            return
        try:
            if not (self.layout.batch_covers and self.files.local().handles.full):
                return
            # a copy (the caller may reuse its array); bad ids raise, as the read would
            arr = check_ids(np.array(ids, copy=True), self.layout.num, "read_ahead")
            if not arr.size:
                return
            lo, hi = int(arr.min()), int(arr.max())
            first, last = self.layout.first_shard(lo), self.layout.first_shard(hi)
            if self.files.is_local() and first != last:
                plan, assembly = self.plan(arr, False)
                ahead.start(arr, plan, assembly)
        except Exception:  # a hint: the read raises the error itself
            return

    def plan(self, ids: IntArray, cached: bool) -> tuple[ReadPlan, Assembly]:
        """The read of ids of several shards: what storage reads (`ReadPlan`) and how the
        rows come out of it (`Assembly`); mapped shards and scattered windows are read now.
        With the handle LRU full, unmapped shards whose windows are covered go to
        `_read_staged` / `_read_direct` (no per-shard Python); the rest to `_gather_loop`."""
        layout, files = self.layout, self.files
        n = ids.size
        order = ids.argsort(kind="stable")
        sorted_ids = ids[order]
        shard = layout.starts.searchsorted(sorted_ids, "right") - 1
        local = sorted_ids - layout.starts[shard]
        cuts = np.flatnonzero(shard[1:] != shard[:-1]) + 1
        begin = np.concatenate((np.zeros(1, dtype=np.int64), cuts))
        end = np.concatenate((cuts, np.full(1, n, dtype=np.int64)))
        gshard = shard[begin]
        count = end - begin
        extent = local[end - 1] - local[begin] + 1
        groups = _Groups(shard, local, order, gshard, begin, count, extent)
        if cached:
            files.refresh_copies(gshard.tolist())
        handles = files.local().handles
        staged_ok = layout.batch_covers and not cached
        covers = (count == 1) | (
            (extent <= DENSE_SPAN * count)
            & (extent * (layout.seq_len * layout.itemsize[gshard]) <= COVER_MAX_BYTES)
        )
        staged: list[int] | IntArray = []
        if staged_ok and handles.full:
            fast = covers.copy()
            open_now = np.sort(np.asarray(handles.keys(), dtype=np.int64))
            if open_now.size:  # ~10x cheaper than np.isin for a few hundred shards
                at = open_now.searchsorted(gshard).clip(max=open_now.size - 1)
                fast &= open_now[at] != gshard
            staged = np.flatnonzero(fast)
            loop: list[int] = np.flatnonzero(~fast).tolist()
        else:
            loop = list(range(gshard.size))
        checks, first = files.checks(), files.local().first
        if len(staged) == gshard.size and not layout.direct:  # one gather builds the result
            whole = self._read_staged(np.asarray(staged), groups, whole=True)
            return ReadPlan((whole[0],), checks, first), Assembly(None, None, whole[1])
        out = np.empty((n, layout.window), dtype=layout.out_dtype)
        more = self._gather_loop(loop, cached, staged_ok, covers, groups, out)
        chosen = np.concatenate((np.asarray(staged, dtype=np.int64), more))
        planned: list[FileReads] = []
        labels = None
        if chosen.size and layout.direct:  # runs of distinct windows: into `out` itself
            fresh = np.ones(n, dtype=np.int64)  # 0 where a sorted id repeats the one before
            fresh[1:] = local[1:] != local[:-1]
            fresh[begin] = 1
            distinct = np.add.reduceat(fresh, begin)[chosen]  # windows of each shard, once
            whole_run = (
                (distinct == count[chosen])
                & (extent[chosen] == count[chosen])
                & (count[chosen] <= _IOV_ROWS)
            )
            if whole_run.any():
                direct, labels = self._read_direct(chosen[whole_run], groups, out)
                planned.append(direct)
                chosen = chosen[~whole_run]
        staging: tuple[Array, IntArray, IntArray] | None = None
        if chosen.size:
            reads, staging = self._read_staged(chosen, groups, whole=False)
            planned.append(reads)
        return ReadPlan(tuple(planned), checks, first), Assembly(out, labels, staging)

    def assemble(self, assembly: Assembly) -> Array:
        """The result rows of a read whose `ReadPlan` storage has read (see `Assembly`)."""
        out, labels, staged = assembly
        if out is None:  # the staged windows are the whole result, in order
            assert staged is not None
            got = staged[0][staged[1]]
            dtype = self.layout.out_dtype
            return got if got.dtype == dtype else got.astype(dtype)
        if labels is not None:  # row i's label token is row i+1's first token (same run)
            rows, following = labels
            out[rows, self.layout.seq_len] = out[following, 0]
        if staged is not None:
            sliding, starts, dest = staged
            out[dest] = sliding[starts]
        return out

    def _gather_loop(
        self,
        loop: list[int],
        cached: bool,
        staged_ok: bool,
        covers: npt.NDArray[np.bool_],
        groups: _Groups,
        out: Array,
    ) -> IntArray:
        """`plan`'s per-shard loop over the groups ``loop``: gathers from window views, reads
        scattered windows (`ShardWindows.pread_rows`); returns the groups left for
        `_read_staged`."""
        if not loop:
            return np.zeros(0, dtype=np.int64)
        files, one, layout = self.files, self.shards, self.layout
        handles, sizes, narrowing = files.local().handles, files.sizes, layout.narrowing
        shard, local, order = groups.shard, groups.local, groups.order
        shards, begins = groups.gshard.tolist(), groups.begin.tolist()
        counts, cover = groups.counts.tolist(), covers.tolist()
        rows: list[int] | None = None
        windows: list[int] | None = None
        offsets: list[int] | None = None  # byte offsets of the sorted ids, when first needed
        prefix = ""
        checks: OpenChecks | None = None
        more: list[int] = []
        for g in loop:
            s, a = shards[g], begins[g]
            b = a + counts[g]
            handle: Mapped | None = handles.get(s)
            if handle is None:
                k = b - a
                mapit = cached or not handles.full
                if not (mapit or (k >= MAP_MIN_ROWS and not (k > 1 and cover[g]))):
                    if staged_ok and cover[g]:
                        more.append(g)
                        continue
                    if offsets is None or rows is None or checks is None:
                        offsets = layout.byte_offsets(shard, local)
                        rows = order.tolist()
                        prefix = join(files.filesystem()[1], "")
                        checks = files.checks()
                    one.pread_rows(
                        s, prefix, rows[a:b], offsets[a:b], out, k > 1 and cover[g], checks
                    )
                    continue
                view = one.view(s)  # size-checked when mapped
            else:
                found = handle.mapping.size()
                if found < sizes[s]:
                    files.check_size(s, found, handle.path)
                view = handle.view
            if b - a == 1 and not narrowing[s]:
                if rows is None or windows is None:
                    rows, windows = order.tolist(), local.tolist()
                out[rows[a]] = view[windows[a]]  # basic indexing: ~3x cheaper for one row
                continue
            block = view[local[a:b]]
            if narrowing[s]:
                one.check_range(block, s)
            out[order[a:b]] = block  # casts to out_dtype (range checked above when narrowing)
        return np.asarray(more, dtype=np.int64)

    def _read_direct(
        self, picked: IntArray, groups: _Groups, out: Array
    ) -> tuple[FileReads, tuple[IntArray, IntArray] | None]:
        """The reads of groups ``picked`` (each ``counts[g]`` distinct consecutive windows):
        ONE ``preadv`` per shard straight into its rows of ``out`` (`WindowLayout.direct`),
        and the label copies (`Assembly.labels`: with ``labels`` a row but a run's last
        reads ``seq_len`` tokens and takes its label token from the next row)."""
        layout, local, order = self.layout, groups.local, groups.order
        item = out.itemsize
        nbytes, step = layout.window * item, layout.seq_len * item  # a row; file bytes a window
        starts, cnt = groups.begin[picked], groups.counts[picked]
        sel = _sorted_rows(starts, cnt)
        if layout.labels:  # a run's last row is read whole, the others without the label
            size = np.full(sel.size, step, dtype=np.int64)
            size[np.cumsum(cnt) - 1] = nbytes
        else:
            size = np.full(sel.size, nbytes, dtype=np.int64)
        s = groups.gshard[picked]
        file_at = layout.offsets[s] + local[starts] * step
        wants = cnt * step + (nbytes - step)  # a run's last label token
        flat = out.view(np.uint8).reshape(-1)
        reads = self._file_reads(s, file_at, wants, flat, order[sel] * nbytes, size, cnt)
        if not layout.labels:
            return reads, None
        inner = sel[np.repeat(starts + cnt - 1, cnt) != sel]  # not a run's last
        return reads, (order[inner], order[inner + 1])

    def _read_staged(
        self, picked: IntArray, groups: _Groups, *, whole: bool
    ) -> tuple[FileReads, tuple[Array, IntArray, IntArray]]:
        """The reads of the covering range of each of groups ``picked``: ONE ``preadv`` per
        shard into one staging buffer (`WindowLayout.batch_covers`), and ``(sliding, starts,
        dest)``: once read, ``sliding[starts]`` are result rows ``dest`` (``whole``: every
        group, ``starts`` in result-row order, ``dest`` empty)."""
        layout, local, order = self.layout, groups.local, groups.order
        s = groups.gshard[picked]
        dtype = layout.disk[int(s[0])]
        item, width, seq = dtype.itemsize, layout.window, layout.seq_len
        cnt = groups.counts[picked]
        first = local[groups.begin[picked]]
        tokens = (groups.extent[picked] - 1) * seq + width  # tokens of each covering range
        pos = np.zeros(s.size + 1, dtype=np.int64)
        np.cumsum(tokens, out=pos[1:])
        base = np.repeat(pos[:-1] - first * seq, cnt)  # staging position of window 0
        if whole:
            starts = np.empty(order.size, dtype=np.int64)
            starts[order] = base + local * seq  # result row order
            dest = np.zeros(0, dtype=np.int64)
        else:
            sel = _sorted_rows(groups.begin[picked], cnt)
            starts = base + local[sel] * seq
            dest = order[sel]
        staging = np.empty(int(pos[-1]), dtype=dtype)
        file_at = layout.offsets[s] + first * (seq * item)
        lengths = np.diff(pos) * item
        flat = staging.view(np.uint8)
        reads = self._file_reads(
            s, file_at, lengths, flat, pos[:-1] * item, lengths, np.ones_like(s)
        )
        sliding = np.lib.stride_tricks.as_strided(
            staging,
            shape=(staging.size - width + 1, width),
            strides=(item, item),
            writeable=False,
        )
        return reads, (sliding, starts, dest)

    def _file_reads(
        self,
        shards: IntArray,
        file_at: IntArray,
        wants: IntArray,
        flat: npt.NDArray[np.uint8],
        iov_off: IntArray,
        iov_len: IntArray,
        iov_count: IntArray,
    ) -> FileReads:
        """For each shard ``shards[i]`` (each at most once): ``wants[i]`` bytes at
        ``file_at[i]`` into its ``iov_count[i]`` buffers (the next ``flat[iov_off[j]:]
        [:iov_len[j]]``), for `detdata.storage.reads.execute`."""
        files = self.files
        return FileReads(
            os.fsencode(join(files.filesystem()[1], "")),
            files.encoded_names(shards),
            shards,
            file_at,
            wants,
            flat,
            iov_off,
            iov_len,
            iov_count,
            None if files.uses_shard_cache() else files.local().first,
        )

    # remote reads ----------------------------------------------------------------------
    def gather_remote(self, fs: fsspec.AbstractFileSystem, ids: IntArray, out: Array) -> None:
        """The windows ``ids`` of a remote root into ``out`` (coalesced ranges, one
        ``cat_ranges`` call, retried under ``retry``)."""
        layout, files = self.layout, self.files
        manifest = files.manifest
        uniq, inverse = np.unique(ids, return_inverse=True)
        shard_of = layout.starts.searchsorted(uniq, "right") - 1
        _, shard_of, spans = stable_groups(shard_of)  # uniq is sorted: order = identity
        local = uniq - layout.starts[shard_of]
        size = layout.itemsize[shard_of]
        starts = layout.offsets[shard_of] + local * layout.seq_len * size
        ends = starts + layout.window * size
        root_path = files.filesystem()[1]
        shards = manifest.shards
        paths = np.asarray([join(root_path, s.path) for s in shards], dtype=object)
        names = np.asarray([s.path for s in shards], dtype=object)
        urls = np.asarray([manifest.url(s) for s in shards], dtype=object)
        blobs, _ = read_coalesced(
            fs,
            paths[shard_of].tolist(),
            starts.tolist(),
            ends.tolist(),
            policy=files.storage.retry,
            shards=names[shard_of].tolist(),
            urls=urls[shard_of].tolist(),
            what="token range read",
        )
        rows = np.empty((uniq.size, layout.window), dtype=layout.out_dtype)
        for shard, a, b in spans:
            data = b"".join(blobs[a:b])
            expected = (b - a) * layout.window * int(layout.itemsize[shard])
            if len(data) != expected:
                raise StorageError(
                    f"shard {manifest.shards[shard].path}: expected {expected} "
                    f"bytes for {b - a} windows, got {len(data)}; the file is "
                    "shorter than the manifest says (rewritten?)"
                )
            block = np.frombuffer(data, dtype=layout.disk[shard]).reshape(b - a, layout.window)
            self.shards.check_range(block, shard)
            rows[a:b] = block
        out[...] = rows[inverse.reshape(-1)]
