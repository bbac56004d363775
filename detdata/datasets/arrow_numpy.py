"""Arrow columns as numpy arrays: what `TableRows` delivers (the kinds: docs/guarantees.md,
"Column kinds and the default collate"). `check_column_type` refuses at construction the
types `to_numpy` cannot convert; `arrow_kind` says from the Arrow type what a column becomes.
"""

from __future__ import annotations

import itertools
from typing import Any

import numpy as np

from detdata.base.errors import FormatError
from detdata.base.lazy import pa
from detdata.datasets.batch_columns import describe_dtype, object_array


def one_chunk(column: pa.ChunkedArray) -> pa.Array:
    """The column as one array (no copy when it already is a single chunk)."""
    return column.chunk(0) if column.num_chunks == 1 else column.combine_chunks()


def to_numpy(array: pa.Array, where: str, *, ragged: bool = False) -> np.ndarray[Any, Any]:
    """One column as numpy: 1-D for scalars, 2-D for equal-length lists, object if ``ragged``.

    Numeric columns and list values must have no nulls (`FormatError` naming
    ``where``). Lists of varying length are a `FormatError` unless ``ragged``.
    """
    kind = array.type
    if _is_list(kind):
        return _list_to_numpy(array, where, ragged)
    if _is_text(kind):
        return np.asarray(array.to_numpy(zero_copy_only=False), dtype=object)
    if array.null_count:
        raise FormatError(
            f"{where}: {array.null_count} null value(s) in a {kind} column; hint: "
            "fill nulls when writing the shards"
        )
    return numbers(array)


#: Arrow's fixed-width number types by name, as numpy dtypes (`numbers`)
_NUMBERS = {
    **{f"{s}int{b}": np.dtype(f"{s}int{b}") for s in ("", "u") for b in (8, 16, 32, 64)},
    "halffloat": np.dtype(np.float16),
    "float": np.dtype(np.float32),
    "double": np.dtype(np.float64),
}


def numbers(array: pa.Array) -> np.ndarray[Any, Any]:
    """``array`` (no nulls) as numpy: a read-only view of its data buffer for integer and
    floating types (pyarrow's ``to_numpy`` would import pandas, ~0.3 s), else
    ``array.to_numpy(zero_copy_only=False)``."""
    dtype = _NUMBERS.get(str(array.type))
    if dtype is not None and len(array) == 0:
        return np.empty(0, dtype=dtype)
    buffers = array.buffers()
    if dtype is None or len(buffers) != 2 or buffers[1] is None:
        return np.asarray(array.to_numpy(zero_copy_only=False))
    view = np.frombuffer(
        buffers[1], dtype=dtype, count=len(array), offset=array.offset * dtype.itemsize
    )
    view.flags.writeable = False
    return view


def _list_to_numpy(array: pa.Array, where: str, ragged: bool) -> np.ndarray[Any, Any]:
    if array.null_count:
        raise FormatError(
            f"{where}: {array.null_count} null list(s); hint: write empty lists "
            "or pad instead of nulls"
        )
    rows = len(array)
    size = int(array.type.list_size) if pa.types.is_fixed_size_list(array.type) else None
    if size is not None:  # one length by type
        offsets = (np.arange(rows + 1, dtype=np.int64) + array.offset) * size
    else:
        offsets = np.asarray(numbers(array.offsets), dtype=np.int64)
    lengths = np.diff(offsets)
    values = array.values.slice(int(offsets[0]), int(offsets[-1] - offsets[0]))
    if values.null_count:
        raise FormatError(f"{where}: {values.null_count} null value(s) inside lists")
    flat = numbers(values)
    if ragged:  # read-only views: these rows are cached; `TableRows.read` delivers copies
        flat.flags.writeable = False
        ends = (offsets - offsets[0]).tolist()
        return object_array([flat[a:b] for a, b in itertools.pairwise(ends)])
    if size is not None:  # nothing to compare
        return flat.reshape(rows, size)
    if rows and int(lengths.min()) != int(lengths.max()):
        raise FormatError(
            f"{where}: list lengths vary from {int(lengths.min())} to "
            f"{int(lengths.max())}; only equal-length lists become 2-D arrays; hint: "
            "token documents of varying length are read with Documents(manifest, "
            f"column={_column(where)!r}) and packed into fixed windows with "
            "PackedWindows(documents, seq_len=...); else pad to one length, store a "
            "fixed_size_list, or name the column in ragged= to get an object array"
        )
    return flat.reshape(rows, int(lengths[0]) if rows else 0)


def _column(where: str) -> str:
    """The column name a ``where`` text (``shard S row group G column 'NAME'``) ends with."""
    _, sep, tail = where.rpartition("column ")
    return tail.strip("'\"") if sep and tail else "tokens"


def arrow_kind(kind: pa.DataType, ragged: bool) -> str | None:
    """`describe_column` of what `to_numpy` makes of an Arrow type (None: a list width
    that only the data knows)."""
    if pa.types.is_string(kind) or pa.types.is_large_string(kind):
        return "str"
    if pa.types.is_binary(kind) or pa.types.is_large_binary(kind):
        return "bytes"
    if pa.types.is_time(kind):
        return "time"
    if pa.types.is_fixed_size_list(kind):
        return describe_dtype(_numpy_dtype(kind.value_type), (kind.list_size,))
    if pa.types.is_list(kind) or pa.types.is_large_list(kind):
        return f"list<{_numpy_dtype(kind.value_type).name}>" if ragged else None
    return describe_dtype(_numpy_dtype(kind))


def _numpy_dtype(kind: pa.DataType) -> np.dtype[Any]:
    """The dtype `to_numpy` gives a column of Arrow type ``kind`` (converted the same way)."""
    known = _NUMBERS.get(str(kind))  # without building an array: pa.array imports pandas
    if known is not None:
        return known
    return np.asarray(pa.array([], type=kind).to_numpy(zero_copy_only=False)).dtype


def _is_list(kind: pa.DataType) -> bool:
    return bool(
        pa.types.is_fixed_size_list(kind) or pa.types.is_list(kind) or pa.types.is_large_list(kind)
    )


def _is_text(kind: pa.DataType) -> bool:
    """A string or binary type (read as an object array of str / bytes)."""
    return bool(
        pa.types.is_string(kind)
        or pa.types.is_large_string(kind)
        or pa.types.is_binary(kind)
        or pa.types.is_large_binary(kind)
    )


def _is_number(kind: pa.DataType) -> bool:
    return bool(
        pa.types.is_integer(kind) or pa.types.is_floating(kind) or pa.types.is_boolean(kind)
    )


def check_column_type(field: pa.Field, shard: str) -> None:
    kind = field.type
    if _is_list(kind):
        kind = kind.value_type
        if not _is_number(kind):
            raise FormatError(
                f"shard {shard} column {field.name!r}: lists of {kind} are not "
                "supported (only lists of numbers/booleans); hint: drop it via columns="
            )
        return
    if pa.types.is_interval(kind):  # pyarrow's to_numpy crashes the process on intervals
        raise FormatError(
            f"shard {shard} column {field.name!r}: interval type {kind} is not "
            "supported; hint: store it as integer columns (months, days, nanoseconds) "
            "or drop it via columns="
        )
    if not (_is_number(kind) or pa.types.is_temporal(kind) or _is_text(kind)):
        raise FormatError(
            f"shard {shard} column {field.name!r}: type {kind} is not supported; "
            "hint: select other columns via columns="
        )
