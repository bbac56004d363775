"""What a trace record holds about a micro batch: its format version, the per-leaf digest sums
of its samples and its positions as runs (the format: `detdata.loading.trace`)."""

from __future__ import annotations

import sys
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Final, TypeGuard

import blake3
import numpy as np
import numpy.typing as npt

from detdata.base.errors import ConfigError

TRACE_VERSION: Final = 3
#: Trace format versions this detdata reads (format 2: `detdata.loading.trace.read`).
READABLE_VERSIONS: Final = (2, 3)
#: Digest sums are taken modulo this (one blake3 digest per sample, added).
SUM_MODULUS: Final = 1 << 256
#: Hex digits of a digest sum in a record.
HEX_DIGITS: Final = 64
_TAG: Final = b"detdata-trace-v2\0"
_HEX: Final = frozenset("0123456789abcdef")
_SCALARS: Final = (str, bytes, bool, int, float, type(None))


def is_hex_digest(value: object) -> TypeGuard[str]:
    """``value`` is `HEX_DIGITS` lowercase hex digits: a digest sum of a trace record, a sample
    digest of an attestation."""
    return isinstance(value, str) and len(value) == HEX_DIGITS and _HEX.issuperset(value)


@dataclass(frozen=True)
class _Leaf:
    """One leaf of a batch: per-sample ``rows`` (n byte strings) or one batch-level ``blob``."""

    name: str
    meta: str
    rows: Sequence[Any] | np.ndarray | None = None
    blob: bytes = b""


def _scalar_bytes(value: Any) -> bytes:
    if isinstance(value, str):
        return b"s" + value.encode("utf-8", "surrogatepass")
    if isinstance(value, bytes):
        return b"b" + value
    return b"r" + repr(value).encode()  # bool, int, float, None: repr is exact


def _tensor_array(tensor: Any, name: str) -> tuple[np.ndarray, str, tuple[int, ...]]:
    """A torch tensor as (contiguous numpy array, dtype text, shape); raw bytes if numpy lacks the
    dtype."""
    import torch

    t = tensor.detach()
    if t.layout != torch.strided:
        raise ConfigError(
            f"trace: batch leaf {name!r} is a {t.layout} tensor; only dense tensors can be "
            "digested; hint: return dense tensors from collate_fn, or trace=None"
        )
    try:
        t = t.cpu().resolve_conj().resolve_neg().contiguous()
    except (RuntimeError, NotImplementedError) as exc:
        raise ConfigError(
            f"trace: cannot copy batch leaf {name!r} ({t.dtype} on {t.device}) to the "
            f"host to digest it: {exc}"
        ) from None
    shape = tuple(t.shape)
    try:
        arr = t.numpy()
        return arr, arr.dtype.str, shape
    except (TypeError, RuntimeError):
        pass  # bfloat16, float8, ...: numpy has no such dtype; hash the raw bytes
    try:
        raw = t.reshape(-1).view(torch.uint8).numpy()
    except (TypeError, RuntimeError) as exc:
        raise ConfigError(
            f"trace: cannot read the bytes of batch leaf {name!r} ({t.dtype}): {exc}; "
            "hint: convert it in collate_fn, or trace=None"
        ) from None
    return raw, str(t.dtype), shape


def _is_array(value: Any) -> bool:
    torch = sys.modules.get("torch")
    return isinstance(value, np.ndarray) or (torch is not None and isinstance(value, torch.Tensor))


def _sample_array_bytes(value: Any, name: str) -> bytes:
    """One sample's array as bytes that include its dtype and shape (so [1, 2] != [[1], [2]])."""
    if isinstance(value, np.ndarray):
        if value.dtype.hasobject:
            raise ConfigError(
                f"trace: batch leaf {name!r} is a numpy object array; hint: return "
                "numeric arrays, or trace=None"
            )
        arr, dtype, shape = np.ascontiguousarray(value), value.dtype.str, value.shape
    else:
        arr, dtype, shape = _tensor_array(value, name)
    return f"{dtype}{list(shape)}:".encode() + arr.tobytes()


def _array_leaf(name: str, arr: np.ndarray, dtype: str, shape: tuple[int, ...], n: int) -> _Leaf:
    """Per-sample rows when the first axis has one entry per position, else one batch-level blob."""
    if arr.dtype.hasobject:
        raise ConfigError(
            f"trace: batch leaf {name!r} is a numpy object array; its bytes are pointers, "
            "not data; hint: return numeric or string arrays, or trace=None"
        )
    arr = np.ascontiguousarray(arr)
    if shape and shape[0] == n:
        return _Leaf(name, f"{dtype}{list(shape[1:])}", rows=arr.reshape(n, -1).view(np.uint8))
    return _Leaf(name, f"batch:{dtype}{list(shape)}", blob=arr.tobytes())


def _leaves(batch: Any, n: int, name: str = "") -> Iterator[_Leaf]:
    """Flatten a delivered batch (tensors/arrays/scalars in dicts, lists, tuples) into leaves."""
    torch = sys.modules.get("torch")
    label = name or "_"
    if torch is not None and isinstance(batch, torch.Tensor):
        yield _array_leaf(label, *_tensor_array(batch, label), n)
    elif isinstance(batch, np.ndarray):
        yield _array_leaf(label, batch, batch.dtype.str, batch.shape, n)
    elif isinstance(batch, Mapping):
        for key in sorted(batch, key=str):
            yield from _leaves(batch[key], n, f"{name}.{key}" if name else str(key))
    elif isinstance(batch, (list, tuple)):
        if len(batch) == n and n > 0 and all(isinstance(v, _SCALARS) for v in batch):
            yield _Leaf(label, "list", rows=[_scalar_bytes(v) for v in batch])
        elif len(batch) == n and n > 0 and all(_is_array(v) for v in batch):
            # one array per sample (ragged rows): per-sample digests, so steps stay micro-batch
            # invariant
            yield _Leaf(
                label,
                "list:arrays",
                rows=[_sample_array_bytes(v, f"{label}[{i}]") for i, v in enumerate(batch)],
            )
        else:
            for i, item in enumerate(batch):
                yield from _leaves(item, n, f"{name}[{i}]")
    elif isinstance(batch, _SCALARS):
        yield _Leaf(label, "batch:scalar", blob=_scalar_bytes(batch))
    else:
        raise ConfigError(
            f"trace: cannot digest batch leaf {label!r} of type {type(batch).__name__}; "
            "traces digest tensors, numpy arrays, str/bytes/numbers and dicts, lists "
            "and tuples of them; hint: return those from collate_fn, or trace=None"
        )


def _leaf_digest(leaf: _Leaf, positions: npt.NDArray[np.int64]) -> int:
    """The digest sum of one leaf over a micro batch (see `detdata.loading.trace`)."""
    prefix = _TAG + leaf.name.encode() + b"\0" + leaf.meta.encode() + b"\0"
    if leaf.rows is None:
        return int.from_bytes(
            blake3.blake3(prefix + positions.astype("<i8").tobytes() + leaf.blob).digest(),
            "little",
        )
    total = 0
    for pos, row in zip(positions.tolist(), leaf.rows, strict=True):
        hasher = blake3.blake3(prefix + pos.to_bytes(8, "little", signed=True))
        hasher.update(row)
        total += int.from_bytes(hasher.digest(), "little")
    return total % SUM_MODULUS


def batch_digests(
    positions: npt.NDArray[np.int64], batch: Any
) -> tuple[dict[str, str], dict[str, int]]:
    """(leaf name -> description, leaf name -> digest sum) of one delivered micro batch."""
    cols: dict[str, str] = {}
    sums: dict[str, int] = {}
    for leaf in _leaves(batch, len(positions)):
        if leaf.name in cols:
            raise ConfigError(
                f"trace: two batch leaves are both named {leaf.name!r} (keys that print "
                "alike); hint: use distinct string keys"
            )
        cols[leaf.name] = leaf.meta
        sums[leaf.name] = _leaf_digest(leaf, positions)
    return cols, sums


def position_runs(positions: npt.NDArray[np.int64]) -> list[list[int]]:
    """``[first, count]`` runs of consecutive ascending positions, in order."""
    runs: list[list[int]] = []
    for p in positions.tolist():
        if runs and runs[-1][0] + runs[-1][1] == p:
            runs[-1][1] += 1
        else:
            runs.append([p, 1])
    return runs


def position_digests(positions: npt.NDArray[np.int64], batch: Any) -> tuple[list[str], str | None]:
    """(one blake3 hex per position, one over the batch-level leaves or None when there are
    none) of a delivered batch read for ``positions``: a position's digest covers every
    per-sample leaf's name, description and that sample's bytes, so it is the same in any
    micro batch the sample is delivered in (resume attestation: `detdata.loading.attest`).
    A leaf that cannot be digested is the `ConfigError` of `batch_digests`."""
    n = len(positions)
    hashers = [blake3.blake3(_TAG) for _ in range(n)]
    group: blake3.blake3 | None = None
    for leaf in _leaves(batch, n):
        head = leaf.name.encode() + b"\0" + leaf.meta.encode() + b"\0"
        if leaf.rows is None:
            group = group or blake3.blake3(_TAG)
            group.update(head + len(leaf.blob).to_bytes(8, "little") + leaf.blob)
            continue
        for hasher, row in zip(hashers, leaf.rows, strict=True):
            data = bytes(row)
            hasher.update(head + len(data).to_bytes(8, "little") + data)
    return [h.hexdigest() for h in hashers], None if group is None else group.hexdigest()
