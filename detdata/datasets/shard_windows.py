"""`ShardWindows`: one shard's windows for `detdata.TokenWindows` (a part it holds): through
the shard's memory map (kept in the handle LRU) or, without one (the LRU full, and fewer
than `MAP_MIN_ROWS` windows or `ShardWindows.covered` ones), by single-file ``preadv`` s.
"""

from __future__ import annotations

import mmap
import os
from typing import Any, Final

import numpy as np

from detdata.base.errors import FormatError
from detdata.datasets.shard_files import ShardFiles
from detdata.datasets.window_layout import WindowLayout
from detdata.storage.mapped import Mapped, map_checked, record_view
from detdata.storage.reads import OpenChecks, opened, pread_exact

#: A shard that is not mapped while the handle LRU is full is mapped (and kept) when a read
#: needs at least this many of its windows (and they are not `covered`); fewer are read
#: with ``preadv`` (a map, its page faults and its unmap cost ~10 window reads).
MAP_MIN_ROWS: Final = 8
#: Windows of one shard whose covering range holds at most this many times as many windows
#: (and at most `COVER_MAX_BYTES`) are read with one ``preadv`` of that range.
DENSE_SPAN: Final = 2
#: The largest covering range read with one ``preadv`` (larger: mapped, or one per window).
COVER_MAX_BYTES: Final = 64 << 10


class ShardWindows:
    """Reads of one shard's windows of ``layout`` from the files of ``files``."""

    def __init__(self, layout: WindowLayout, files: ShardFiles) -> None:
        self.layout = layout
        self.files = files

    # memory maps -------------------------------------------------------------------
    def _map_cached(self, shard: int) -> tuple[mmap.mmap, str]:
        """Mapping of the cached copy of ``shard`` and its path (`ShardFiles.open_copy`)."""
        checks = self.files.checks()

        def open_path(path: str) -> tuple[mmap.mmap, int]:
            with open(path, "rb") as fh:
                fd = fh.fileno()
                return map_checked(fd, shard, path, checks), os.fstat(fd).st_ino

        return self.files.open_copy(shard, open_path)

    def mapped_view(
        self, shard: int, rows: int, cover: bool, *, cached: bool
    ) -> np.ndarray[Any, Any] | None:
        """The (size-checked) window view of ``shard`` for a read of ``rows`` windows
        (``cover``: they are `covered`): its mapping, or a new one for a cached copy, an LRU
        with room, or `MAP_MIN_ROWS` windows not covered; None: read them with `pread_rows`."""
        handles = self.files.local().handles
        handle: Mapped | None = handles.get(shard)
        if handle is not None:
            self.files.check_size(shard, handle.mapping.size(), handle.path)
            return handle.view
        if cached or not handles.full or (rows >= MAP_MIN_ROWS and not cover):
            return self.view(shard)
        return None

    def view(self, shard: int) -> np.ndarray[Any, Any]:
        """Map ``shard`` (size-checked), keep it in the handle LRU, return its window view
        (its path decoded alone: no manifest entry built)."""
        files, layout = self.files, self.layout
        if files.uses_shard_cache():
            mapping, path = self._map_cached(shard)
        else:
            path = files.path(shard)
            try:
                fh = open(path, "rb")  # noqa: SIM115 (closed below, the map outlives it)
            except FileNotFoundError:
                raise files.missing(shard, path) from None
            with fh:
                mapping = map_checked(fh.fileno(), shard, path, files.checks())
        dtype = layout.disk[shard]
        offset = int(layout.offsets[shard])
        view = record_view(
            mapping,
            dtype,
            offset=offset,
            count=(int(files.sizes[shard]) - offset) // dtype.itemsize,  # its num_samples
            rows=layout.windows_in(shard),
            step=layout.seq_len,
            width=layout.window,
        )
        files.keep(shard, Mapped(view, mapping, path))
        return view

    def covered(self, shard: int, rows: int, extent: int) -> bool:
        """Are ``rows`` windows of ``shard`` spread over ``extent`` windows (max - min + 1)
        read with one ``preadv`` of their covering range (dense, and small)?"""
        return (
            rows > 1
            and extent <= DENSE_SPAN * rows
            and extent * self.layout.seq_len * self.layout.disk[shard].itemsize <= COVER_MAX_BYTES
        )

    def pread_rows(
        self,
        shard: int,
        prefix: str,
        rows: list[int],
        offsets: list[int],
        out: np.ndarray[Any, Any],
        cover: bool,
        checks: OpenChecks,
    ) -> None:
        """Read without mapping the window of ``shard`` (file ``prefix + path``) at each of
        ``offsets`` into row ``rows[i]`` of ``out``: one checked open, then one ``preadv`` of
        the covering range when ``cover``, else one per window."""
        dtype = self.layout.disk[shard]
        path = prefix + self.files.manifest.shard_path(shard)
        with opened(path, shard, checks) as fd:
            if cover:
                self._pread_covering(fd, shard, path, rows, offsets, out, checks)
            elif dtype == self.layout.out_dtype:
                for row, offset in zip(rows, offsets, strict=True):
                    pread_exact(fd, out[row], offset, shard, path, checks)
            else:
                block = np.empty((len(rows), self.layout.window), dtype=dtype)
                for i, offset in enumerate(offsets):
                    pread_exact(fd, block[i], offset, shard, path, checks)
                self.check_range(block, shard)
                out[rows] = block

    def _pread_covering(
        self,
        fd: int,
        shard: int,
        path: str,
        rows: list[int],
        offsets: list[int],
        out: np.ndarray[Any, Any],
        checks: OpenChecks,
    ) -> None:
        """One ``preadv`` covering the windows at ``offsets``, each copied into its row."""
        dtype = self.layout.disk[shard]
        item, width = dtype.itemsize, self.layout.window
        lo = min(offsets)
        buf = np.empty((max(offsets) - lo) // item + width, dtype=dtype)
        pread_exact(fd, buf, lo, shard, path, checks)
        starts = [(offset - lo) // item for offset in offsets]
        if self.layout.narrowing[shard]:  # check exactly the delivered values
            block = np.stack([buf[a : a + width] for a in starts])
            self.check_range(block, shard)
            out[rows] = block
            return
        for row, a in zip(rows, starts, strict=True):
            out[row] = buf[a : a + width]

    def check_range(self, block: np.ndarray[Any, Any], shard: int) -> None:
        """Refuse values that a narrowing ``out_dtype`` cast would wrap (vectorised)."""
        if not self.layout.narrowing[shard] or block.size == 0:
            return
        out_dtype = self.layout.out_dtype
        info = np.iinfo(out_dtype)
        lo, hi = int(block.min()), int(block.max())
        if lo < info.min or hi > info.max:
            raise FormatError(
                f"shard {self.files.manifest.shards[shard].path}: token values in "
                f"[{lo}, {hi}] do not fit out_dtype {out_dtype.name} "
                f"[{info.min}, {info.max}]; hint: use a wider out_dtype (e.g. int64)"
            )
