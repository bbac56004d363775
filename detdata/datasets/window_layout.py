"""`WindowLayout`: where each window of a `detdata.TokenWindows` is, as arithmetic over its
window index (`detdata.datasets.window_index`); no file is touched here.

Window ``w`` of shard ``s`` is ``window`` tokens at token ``w * seq_len`` of the shard's
data, which starts at byte ``offsets[s]``; shard ``s`` holds ids ``[starts[s], starts[s +
1])``. Values that depend only on a shard's dtype are looked up through its dtype code
(`ByCode`, `ArrayByCode`): O(dtypes) to build, not O(shards).
"""

from __future__ import annotations

from typing import Any, Generic, TypeVar

import numpy as np
import numpy.typing as npt

from detdata.base.types import IntArray
from detdata.datasets.window_index import WindowIndex
from detdata.identity.formats import disk_dtype
from detdata.storage.file_column import FileColumn, IntColumn

T = TypeVar("T")


class ByCode(Generic[T]):
    """A per-shard value: ``self[shard]`` is ``values[codes[shard]]``."""

    __slots__ = ("codes", "values")

    def __init__(
        self, codes: npt.NDArray[np.integer[Any]] | FileColumn, values: tuple[T, ...]
    ) -> None:
        self.codes = codes
        self.values = values

    def __getitem__(self, shard: int | np.integer[Any]) -> T:
        return self.values[int(self.codes[shard])]


class ArrayByCode:
    """A per-shard int64 value, for one shard or an array of them: ``self[shards]`` is
    ``values[codes[shards]]``."""

    __slots__ = ("codes", "values")

    def __init__(
        self, codes: npt.NDArray[np.integer[Any]] | FileColumn, values: npt.ArrayLike
    ) -> None:
        self.codes = codes
        self.values = np.asarray(values, dtype=np.int64)

    def __getitem__(self, shard: Any) -> Any:
        return self.values[self.codes[shard]]


class WindowLayout:
    """The windows of ``index`` for ``seq_len`` (+1 with ``labels``) in ``out_dtype``.
    ``batch_covers``: every shard in use has one disk dtype that ``out_dtype`` does not
    narrow (one staging buffer per batch); ``direct``: besides, that dtype is ``out_dtype``
    (read straight into the result)."""

    def __init__(
        self, index: WindowIndex, seq_len: int, labels: bool, out_dtype: np.dtype[Any]
    ) -> None:
        self.seq_len = seq_len
        self.labels = labels
        self.window = seq_len + int(labels)
        self.out_dtype = out_dtype
        self.num = index.windows
        self.bounds: IntColumn = index.starts  # count + 1: shard s holds windows [s], [s + 1]
        self.starts: IntColumn = index.starts[:-1]  # each shard's first window id
        self.offsets: IntColumn = index.offsets  # each shard's first token byte
        code, names = index.codes, index.dtypes
        self.itemsize = ArrayByCode(code, np.asarray([np.dtype(d).itemsize for d in names]))
        self.disk = ByCode(code, tuple(disk_dtype(d) for d in names))
        # per shard: does a cast to out_dtype narrow (values must be range-checked)?
        narrowing = tuple(not np.can_cast(d, out_dtype, casting="safe") for d in names)
        self.narrowing = ByCode(code, narrowing)
        disks = {self.disk.values[c] for c in index.used}
        self.batch_covers = len(disks) == 1 and not any(narrowing[c] for c in index.used)
        self.direct = self.batch_covers and self.disk[0] == out_dtype

    def shard_of(self, ids: IntArray) -> IntArray:
        """The shard of each (checked) window id of ``ids``."""
        shard: IntArray = self.starts.searchsorted(ids, side="right").astype(np.int64) - 1
        return shard

    def first_shard(self, window: int) -> int:
        """The shard of window ``window``."""
        return int(self.starts.searchsorted(window, "right")) - 1

    def windows_in(self, shard: int) -> int:
        """Windows of ``shard``."""
        return int(self.bounds[shard + 1] - self.bounds[shard])

    def byte_offsets(self, shard: IntArray, local: IntArray) -> list[int]:
        """File offset of window ``local[i]`` of shard ``shard[i]``, for the batch at once."""
        offsets: list[int] = (
            self.offsets[shard] + local * self.seq_len * self.itemsize[shard]
        ).tolist()
        return offsets
