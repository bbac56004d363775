"""Column kinds of a read batch (a dict of column -> numpy array, rows on the first axis):
how they are described (`describe_column`), restacked from a transform's outputs
(`restack`) and turned into torch objects by the default collate (`to_torch`); the kinds
and what the collate makes of each: docs/guarantees.md, "Column kinds and the default
collate". torch is imported only when `to_torch` runs.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np
import numpy.typing as npt

from detdata.base.errors import ConfigError

if TYPE_CHECKING:
    import torch

Array = np.ndarray[Any, Any]
_NUMERIC = "biufc"
_TEMPORAL = "Mm"


def describe_dtype(dtype: np.dtype[Any], shape: Sequence[int] = ()) -> str:
    """``'int32'``, ``'float32 (3,)'``, ``'datetime64[ms]'``: a numpy dtype name and trailing
    shape; a non-native byte order is part of it (``'int32 [>]'``)."""
    name = dtype.name if dtype.isnative else f"{dtype.name} [{dtype.byteorder}]"
    return name if not len(shape) else f"{name} {tuple(int(s) for s in shape)}"


def _element_kind(value: object) -> str:
    if isinstance(value, str):
        return "str"
    if isinstance(value, bytes):
        return "bytes"
    if isinstance(value, np.ndarray):
        return f"list<{value.dtype.name}>" if value.ndim == 1 else f"array<{value.dtype.name}>"
    return type(value).__name__


def describe_column(column: npt.ArrayLike) -> str:
    """What one batch column holds, comparable across sources: `describe_dtype`, or for
    object arrays their elements' kind (None skipped): ``'str'``, ``'bytes'``,
    ``'list<int32>'``, a type name (``'time'``), ``'object'`` (all None) or ``'mixed<...>'``."""
    arr = np.asarray(column)
    if arr.dtype != object:
        return describe_dtype(arr.dtype, arr.shape[1:])
    kinds = sorted({_element_kind(v) for v in arr.reshape(-1).tolist() if v is not None})
    kind = "object" if not kinds else kinds[0] if len(kinds) == 1 else f"mixed<{'|'.join(kinds)}>"
    return kind if arr.ndim <= 1 else f"{kind} {tuple(arr.shape[1:])}"


def holds_objects(description: str) -> bool:
    """Does a `describe_column` description name an object column (str, bytes, ragged...)?"""
    head = description.split(" ")[0]
    if head in ("str", "bytes", "object"):
        return True
    try:
        np.dtype(head)
    except TypeError:
        return True  # 'list<int32>', 'time', 'mixed<...>'
    return False


def same_kind(a: str, b: str) -> bool:
    """Do two descriptions agree? ``'object'`` (every value None) agrees with any object kind."""
    return a == b or (a == "object" and holds_objects(b)) or (b == "object" and holds_objects(a))


def is_ragged(column: object) -> bool:
    """Is ``column`` an object array whose rows are 1-D arrays (a ragged column)?"""
    if not isinstance(column, np.ndarray) or column.dtype != object or column.ndim != 1:
        return False
    rows = [v for v in column.tolist() if v is not None]
    return bool(rows) and all(isinstance(v, np.ndarray) and v.ndim == 1 for v in rows)


def _position(positions: Sequence[int] | npt.NDArray[np.int64], i: int) -> str:
    return f"position {int(positions[i])}" if i < len(positions) else f"sample {i} of the batch"


def restack(
    values: Sequence[Any],
    column: str,
    positions: Sequence[int] | npt.NDArray[np.int64],
    *,
    ragged: bool = False,
) -> Array:
    """One batch column from the per-sample values a transform returned for ``column``:
    an object array for str / bytes / None values (bytes keep trailing NULs), or when
    ``ragged`` (the input column was) and every value is 1-D; else the arrays stacked.
    `ConfigError` naming ``column`` and the position when values mix strings and arrays
    or differ in dtype (numpy would upcast silently) or shape."""
    texts = [v is None or isinstance(v, (str, bytes)) for v in values]
    if all(texts):
        return object_array(values)
    if any(texts):
        i = texts.index(not texts[0])
        raise ConfigError(
            f"transform output {column!r}: {_position(positions, i)} gives "
            f"{_element_kind(values[i])}, {_position(positions, 0)} gives "
            f"{_element_kind(values[0])}; hint: return one kind of value per key"
        )
    arrays = [np.asarray(v) for v in values]
    first = arrays[0]
    for i, arr in enumerate(arrays):
        if arr.dtype != first.dtype:
            raise ConfigError(
                f"transform output {column!r}: {_position(positions, i)} gives "
                f"{arr.dtype}, {_position(positions, 0)} gives {first.dtype}; hint: "
                "cast in the transform, e.g. np.asarray(value, dtype=np.int64)"
            )
    if ragged and all(a.ndim == 1 for a in arrays):
        return object_array(arrays)
    for i, arr in enumerate(arrays):
        if arr.shape != first.shape:
            raise ConfigError(
                f"transform output {column!r}: {_position(positions, i)} has shape "
                f"{arr.shape}, {_position(positions, 0)} has {first.shape}; only a "
                "column that is ragged in the dataset (TableRows ragged=) stays "
                "ragged; hint: pad or cut to one shape in the transform"
            )
    return np.stack(arrays)


def object_array(values: Sequence[Any]) -> Array:
    """A 1-D object array of ``values``, filled element by element."""
    out = np.empty(len(values), dtype=object)
    for i, v in enumerate(values):  # element by element: numpy would broadcast equal-length arrays
        out[i] = v
    return out


def to_torch(value: Any, name: str = "") -> Any:
    """The default collate: a read batch (dict of numpy columns) into torch objects, per
    column as the module docstring's reference says (a numeric tensor shares memory with
    its array only if the array is writable); other kinds raise `ConfigError` naming the
    column (``name``: where ``value`` is in the batch). Mappings are converted per value;
    anything else is returned unchanged."""
    if isinstance(value, Mapping):
        return {k: to_torch(v, f"{name}.{k}" if name else str(k)) for k, v in value.items()}
    if not isinstance(value, np.ndarray):
        return value
    kind = value.dtype.kind
    if kind in _NUMERIC or kind in _TEMPORAL:
        return _tensor(value)
    if kind in "US":
        return value.tolist()
    if kind == "O":
        return _object_column(value, name)
    raise _refuse(name, describe_dtype(value.dtype, value.shape[1:]))


def _refuse(name: str, found: str) -> ConfigError:
    column = f"column {name!r}" if name else "the batch"
    return ConfigError(
        f"{column}: the default collate turns numbers, bools, fixed-width lists, "
        "ragged lists (into lists of tensors), strings, binary and timestamps into "
        f"torch objects, not {found} values; hint: pass collate_fn= to build the "
        "batch yourself (or drop the column via TableRows columns=)"
    )


def _tensor(arr: Array) -> torch.Tensor:
    """A tensor of ``arr`` (temporal: its int64 counts); shares memory only with writable arrays."""
    import torch

    if arr.dtype.kind in _TEMPORAL:
        arr = arr.view(np.int64)
    if not arr.dtype.isnative:
        arr = arr.astype(arr.dtype.newbyteorder("="))
    if not arr.flags.writeable or not arr.flags.aligned or any(s < 0 for s in arr.strides):
        arr = arr.copy()
    return torch.from_numpy(arr)


def _object_column(arr: Array, name: str) -> list[Any]:
    found = describe_column(arr)
    if arr.ndim != 1:
        raise _refuse(name, found)
    items: list[Any] = arr.tolist()
    if found in ("str", "bytes", "object"):  # "object": every value is None
        return items
    if not found.startswith("list<"):
        raise _refuse(name, found)
    if any(v is None for v in items):
        raise _refuse(name, "None (null list)")
    dtype = items[0].dtype  # not empty: an empty column is "object"
    if dtype.kind not in _NUMERIC and dtype.kind not in _TEMPORAL:
        raise _refuse(name, found)
    import torch

    flat = _tensor(np.concatenate(items))  # one new buffer: rows never alias the read's arrays
    return list(torch.split(flat, [len(v) for v in items]))
