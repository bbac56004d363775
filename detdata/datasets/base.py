"""The two protocols everything composes through: a `Dataset` reads samples by id
(``read(ids) -> Batch``, one batched read, rows in the order of ``ids``); a `Stream` by
global position (``fetch(positions) -> Batch``: `OrderedStream`, `detdata.Mixture`). A
`Batch` maps column name -> numpy array, batch first; ``identity()`` is plain JSON pinning
what the data is (it enters the loader state and the resume checks).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Protocol, runtime_checkable

import numpy as np
import numpy.typing as npt

from detdata.base.errors import ConfigError, FormatError
from detdata.base.hashing import digest_bytes
from detdata.base.types import Batch, IntArray
from detdata.datasets.sample_framing import framed


@runtime_checkable
class Dataset(Protocol):
    """Samples addressed by id in ``[0, num_samples)``."""

    @property
    def num_samples(self) -> int: ...

    def read(self, ids: IntArray) -> Batch: ...

    def identity(self) -> dict[str, Any]: ...


@runtime_checkable
class Stream(Protocol):
    """Samples addressed by global position ``>= 0`` (an infinite, seeded stream)."""

    def fetch(self, positions: IntArray) -> Batch: ...

    def sample_ids(self, positions: IntArray) -> IntArray: ...

    def identity(self) -> dict[str, Any]: ...


def check_ids(ids: npt.ArrayLike, num_samples: int, what: str) -> IntArray:
    """``ids`` as a 1-D int64 array, every value in ``[0, num_samples)``."""
    arr = np.asarray(ids)
    if arr.ndim != 1 or arr.dtype.kind not in "iu":
        raise ConfigError(
            f"{what}: ids must be a 1-D integer array, got shape {arr.shape} dtype {arr.dtype}"
        )
    arr = arr.astype(np.int64, copy=False)
    if arr.size and (int(arr.min()) < 0 or int(arr.max()) >= num_samples):
        raise ConfigError(
            f"{what}: ids must be in [0, {num_samples}), found [{int(arr.min())}, {int(arr.max())}]"
        )
    return arr


class ArrayDataset:
    """An in-memory dataset of equal-length columns (tests, small examples); its identity
    includes a blake3 of every column's bytes, dtype and shape."""

    def __init__(self, columns: Mapping[str, npt.ArrayLike], *, name: str = "arrays") -> None:
        if not isinstance(columns, Mapping):
            raise ConfigError(
                f"ArrayDataset takes a mapping of column name -> array, got "
                f"{type(columns).__name__}; hint: ArrayDataset({{'x': array}})"
            )
        if not columns:
            raise ConfigError("ArrayDataset needs at least one column")
        self.columns = {k: _frozen_copy(v) for k, v in columns.items()}
        lengths = {k: len(v) for k, v in self.columns.items()}
        if len(set(lengths.values())) != 1:
            raise FormatError(f"ArrayDataset columns differ in length: {lengths}")
        self._n = next(iter(lengths.values()))
        if self._n == 0:
            raise ConfigError(f"ArrayDataset {name!r} is empty")
        self.name = name
        self._digest = digest_bytes(
            b"".join(
                framed(k.encode(), v.dtype.str.encode(), str(v.shape).encode(), _content(v))
                for k, v in sorted(self.columns.items())
            )
        )

    @property
    def num_samples(self) -> int:
        return self._n

    def __len__(self) -> int:
        return self.num_samples

    def read(self, ids: IntArray) -> Batch:
        """Fresh arrays (object columns: fresh copies of their elements too); nothing aliases the
        data."""
        idx = check_ids(ids, self._n, f"ArrayDataset {self.name!r}")
        return {k: _owned(v[idx]) for k, v in self.columns.items()}

    def identity(self) -> dict[str, Any]:
        return {"type": "arrays", "name": self.name, "digest": self._digest, "num_samples": self._n}


def _frozen_copy(values: npt.ArrayLike) -> np.ndarray:
    """A private, read-only copy in native byte order: later edits of the caller's array cannot
    change the data behind the identity digest, object elements are copied as well, and a
    big-endian input delivers its values (never its bytes reinterpreted)."""
    arr = np.array(values, copy=True, order="C")
    if arr.dtype != object and not arr.dtype.isnative:
        arr = arr.astype(arr.dtype.newbyteorder("="))
    if arr.dtype == object:
        arr = _owned(arr)
    arr.setflags(write=False)
    return arr


def _content(column: np.ndarray) -> bytes:
    """The bytes a column's digest covers: its buffer, or for object columns each element's
    type, dtype, shape and bytes (an object buffer holds pointers, which differ per process)."""
    if column.dtype != object:
        return column.tobytes()
    parts = []
    for value in column.flat:
        if isinstance(value, np.ndarray) and value.dtype != object:
            parts.append(f"nd:{value.dtype.str}{value.shape}:".encode() + value.tobytes())
        elif isinstance(value, (str, bytes, int, float, bool)) or value is None:
            parts.append(f"{type(value).__name__}:{value!r}".encode())
        else:
            raise FormatError(
                f"ArrayDataset: object column holds a {type(value).__name__}; only numeric "
                "arrays, str, bytes, numbers and None can be digested; hint: convert it"
            )
        parts.append(b"\0")
    return b"".join(parts)


def _owned(column: np.ndarray) -> np.ndarray:
    """``column`` with each ndarray element of an object column copied (numeric gathers copy
    already)."""
    if column.dtype != object:
        return column
    out = np.empty(column.shape, dtype=object)
    for i, value in enumerate(column.flat):
        out.flat[i] = value.copy() if isinstance(value, np.ndarray) else value
    return out
