"""Column kinds of a read batch: how they are described, restacked and turned into torch.

A `Batch` is a dict of column name -> numpy array whose first axis is the row.
The kinds a detdata dataset delivers, and what the default collate (`to_torch`,
used by `detdata.DataLoader` when ``collate_fn`` is None) makes of each:

==========================  ==============================  ===============================
column                      numpy (``read`` / ``fetch``)    default collate
==========================  ==============================  ===============================
integer / float / bool      ``(rows,)``                     tensor ``(rows,)``
fixed-size or equal lists   ``(rows, width)``               tensor ``(rows, width)``
ragged lists                object array of 1-D arrays      list of 1-D tensors (one a row)
strings / binary            object array of str / bytes     list of str / list of bytes
timestamps, dates,          ``datetime64[unit]`` /          int64 tensor of the raw counts
durations                   ``timedelta64[unit]``           (unit as in the numpy dtype)
==========================  ==============================  ===============================

Ragged columns stay a list of tensors (no padding: a pad value and side are the
model's choice, e.g. ``torch.nn.utils.rnn.pad_sequence(batch[name],
batch_first=True)`` in a ``collate_fn``). Timestamps count units since
1970-01-01 UTC (time-zone-aware Arrow timestamps are stored in UTC); the unit
is the column's `TableRows.schema` entry (``datetime64[ms]``: milliseconds).
Anything else (e.g. time-of-day columns, which read as ``datetime.time``
objects) is a `ConfigError` naming the column: pass ``collate_fn=``.

Memory: a numeric tensor shares the memory of the array it comes from only when
that array is writable (a fresh array a read made for this batch); a read-only
array (a memory map, a cache) is copied first, so no delivered tensor can write
into a dataset's storage. Ragged rows are copied into one new buffer per column.

This module imports torch only when `to_torch` runs (the CLI and manifest tools
stay fast).
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


# ------------------------------------------------------------------ describing columns
def describe_dtype(dtype: np.dtype[Any], shape: Sequence[int] = ()) -> str:
    """``'int32'``, ``'float32 (3,)'``, ``'datetime64[ms]'``: a numpy dtype name and trailing shape.

    A non-native byte order is part of the description (``'int32 [>]'``), so two sources
    that store the same values in other byte orders never pass as the same column type.
    """
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
    """What one batch column holds, in a form two sources can be compared by.

    Non-object arrays: `describe_dtype` of their dtype and trailing shape. Object
    arrays by their elements (``None`` skipped): ``'str'``, ``'bytes'``,
    ``'list<int32>'`` (ragged rows), another type's name (``'time'``), ``'object'``
    when every element is None, ``'mixed<bytes|str>'`` when they differ.
    """
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


# ------------------------------------------------------------------ restacking transform outputs
def _position(positions: Sequence[int] | npt.NDArray[np.int64], i: int) -> str:
    return f"position {int(positions[i])}" if i < len(positions) else f"sample {i} of the batch"


def restack(
    values: Sequence[Any],
    column: str,
    positions: Sequence[int] | npt.NDArray[np.int64],
    *,
    ragged: bool = False,
) -> Array:
    """One batch column from the per-sample values a transform returned for ``column``.

    * str / bytes (or None) values: an object array of them (bytes keep trailing
      NUL bytes, which numpy's fixed-width ``S`` dtype would drop);
    * ``ragged`` (the input column of that name was ragged) and every value 1-D:
      an object array of the 1-D arrays, whatever their lengths (so a ragged
      column never turns 2-D in the batches where its lengths happen to agree);
    * otherwise arrays of one dtype and shape, stacked.

    `ConfigError` naming ``column`` and the sample's position when values mix
    strings and arrays, or differ in dtype (numpy would silently upcast, so one
    batch's dtype would depend on which samples it holds) or in shape.
    """
    texts = [v is None or isinstance(v, (str, bytes)) for v in values]
    if all(texts):
        return _objects(values)
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
        return _objects(arrays)
    for i, arr in enumerate(arrays):
        if arr.shape != first.shape:
            raise ConfigError(
                f"transform output {column!r}: {_position(positions, i)} has shape "
                f"{arr.shape}, {_position(positions, 0)} has {first.shape}; only a "
                "column that is ragged in the dataset (TableRows ragged=) stays "
                "ragged; hint: pad or cut to one shape in the transform"
            )
    return np.stack(arrays)


def _objects(values: Sequence[Any]) -> Array:
    out = np.empty(len(values), dtype=object)
    for i, v in enumerate(values):  # element by element: numpy would broadcast equal-length arrays
        out[i] = v
    return out


# ------------------------------------------------------------------ the default collate
def to_torch(batch: Any) -> Any:
    """The default collate: a read batch (dict of numpy columns) into torch objects.

    Per column (the table in the module docstring): numeric, bool and fixed-width
    list columns become tensors; ragged columns a list of 1-D tensors (one per
    row, each in one new buffer per column); strings and binary a list of str /
    bytes (None kept); ``datetime64`` / ``timedelta64`` an int64 tensor of the raw
    counts in the column's unit. A numeric tensor shares memory with its array
    only if the array is writable; read-only arrays are copied. Other columns
    raise `ConfigError` naming the column (hint: ``collate_fn=``). Mappings are
    converted per value; anything else is returned unchanged.
    """
    if isinstance(batch, Mapping):
        return {k: _convert(v, str(k)) for k, v in batch.items()}
    return _convert(batch, "") if isinstance(batch, np.ndarray) else batch


def _convert(value: Any, name: str) -> Any:
    if isinstance(value, Mapping):
        return {k: _convert(v, f"{name}.{k}") for k, v in value.items()}
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
    dtype = items[0].dtype if items else np.dtype(np.int64)
    if dtype.kind not in _NUMERIC and dtype.kind not in _TEMPORAL:
        raise _refuse(name, found)
    lengths = [len(v) for v in items]
    if not items:
        return []
    import torch

    flat = _tensor(np.concatenate(items))  # one new buffer: rows never alias the read's arrays
    return list(torch.split(flat, lengths))
