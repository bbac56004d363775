"""A deterministic train/validation split (``split-v1``), keyed by the blake3 of each sample's
framed bytes (`SplitKey.CONTENT`, `content_key`) or by its id (`SplitKey.ID`: reads nothing).
The rule, the identities and the trade-offs: docs/design.md, "Run record and split".
"""

from __future__ import annotations

import enum
import json
import os
from fractions import Fraction
from pathlib import Path
from typing import Any, Final

import blake3
import numpy as np
import numpy.typing as npt

from detdata.base.canonical import canonical_json
from detdata.base.errors import ConfigError, FormatError
from detdata.base.hashing import digest_bytes
from detdata.base.keys import derive_u64
from detdata.base.progress import progress as base_progress
from detdata.base.types import Batch, IntArray
from detdata.datasets.base import Dataset, check_ids
from detdata.datasets.sample_framing import framed, framed_sample

ALGORITHM: Final = "split-v1"
SPLIT_TAG: Final = b"detdata:split-v1"
CONTENT_TAG: Final = b"detdata:split-content-v1"
READ_CHUNK: Final = 4096
"""Samples read per ``read`` call while building a content assignment."""
CACHE_KIND: Final = "detdata.split_assignment"
K_RULE, K_KEY, K_FRACTION, K_SALT = "rule", "key", "fraction", "salt"
K_ASSIGNMENT: Final = "assignment"
K_VALIDATION_KEYS: Final = "validation_keys"
K_PART: Final = "part"
K_DATASET: Final = "dataset"
TRAIN, VALIDATION = "train", "validation"


class SplitKey(str, enum.Enum):
    """What a sample's side is derived from."""

    CONTENT = "content"
    ID = "id"


def check_fraction(fraction: object) -> Fraction:
    """``fraction`` as an exact `Fraction` in (0, 1); a float goes through its shortest repr
    (``0.01`` -> ``1/100``), a string through `Fraction` (``"1/100"``, ``"0.01"``)."""
    if isinstance(fraction, bool):
        raise ConfigError(f"fraction must be a number in (0, 1), got {fraction!r}")
    try:
        if isinstance(fraction, float):
            value = Fraction(repr(fraction))
        elif isinstance(fraction, (Fraction, int, str)):
            value = Fraction(fraction)
        else:
            raise TypeError
    except (TypeError, ValueError, ZeroDivisionError):
        raise ConfigError(
            f"fraction must be a number in (0, 1) such as Fraction(1, 100) or '1/100', "
            f"got {fraction!r}"
        ) from None
    if not 0 < value < 1:
        raise ConfigError(
            f"fraction must be in (0, 1) (both sides non-empty in expectation), got {value}"
        )
    return value


def _value_bytes(value: Any) -> bytes:
    if isinstance(value, np.ndarray) and value.dtype != object:
        arr = value if value.flags.c_contiguous else value.copy(order="C")  # keeps 0-d shape
        return framed(b"nd", arr.dtype.str.encode(), str(arr.shape).encode(), arr.tobytes())
    if isinstance(value, np.generic):
        return _value_bytes(np.asarray(value))
    if isinstance(value, str):
        return framed(b"str", value.encode("utf-8"))
    if isinstance(value, bytes):
        return framed(b"bytes", value)
    if value is None:
        return framed(b"none")
    if isinstance(value, (bool, int, float)):
        return framed(type(value).__name__.encode(), repr(value).encode())
    raise FormatError(
        f"cannot key a sample column holding {type(value).__name__} by content; hint: numeric "
        "arrays, str, bytes and numbers are keyed (or use key=SplitKey.ID)"
    )


def content_key(sample: dict[str, Any]) -> bytes:
    """The 32-byte blake3 of one sample (column name -> value), framed (``split-content-v1``)."""
    return blake3.blake3(framed_sample(CONTENT_TAG, sample, _value_bytes)).digest()


def assignment_digest(mask: npt.NDArray[np.bool_]) -> str:
    """``b3:`` of ``u64le(len(mask))`` then the packed bits (big-endian bit order per byte)."""
    return digest_bytes(len(mask).to_bytes(8, "little") + np.packbits(mask).tobytes())


class Split:
    """The two sides of ``dataset``: ``train`` and ``validation``, datasets over the ids of
    each in increasing order. ``cache_dir``: where content assignments are stored (checked
    against their digest when read back); ``progress``: of the content hashing.
    """

    def __init__(
        self,
        dataset: Dataset,
        *,
        fraction: Fraction | str | float,
        salt: str,
        key: SplitKey | str = SplitKey.CONTENT,
        cache_dir: str | os.PathLike[str] | None = None,
        progress: bool | None = None,
    ) -> None:
        self.progress = progress
        if not isinstance(dataset, Dataset):
            raise ConfigError(f"Split needs a Dataset, got {type(dataset).__name__}")
        if not isinstance(salt, str):
            raise ConfigError(f"salt must be a str, got {type(salt).__name__}")
        try:
            self.key = SplitKey(key)
        except ValueError:
            raise ConfigError(
                f"key must be one of {[k.value for k in SplitKey]}, got {key!r}"
            ) from None
        self.dataset = dataset
        self.fraction = check_fraction(fraction)
        self.salt = salt
        self.rule: dict[str, Any] = {
            "algorithm": ALGORITHM,
            K_KEY: self.key.value,
            K_FRACTION: str(self.fraction),
            K_SALT: salt,
        }
        self.mask, self.validation_keys = self._assign(
            None if cache_dir is None else Path(cache_dir)
        )
        self.mask.setflags(write=False)
        self.assignment = assignment_digest(self.mask)
        self.validation = SplitPart(self, VALIDATION, np.flatnonzero(self.mask))
        self.train = SplitPart(self, TRAIN, np.flatnonzero(~self.mask))

    def _assign(self, cache: Path | None) -> tuple[npt.NDArray[np.bool_], str | None]:
        n = self.dataset.num_samples
        # floor(fraction * 2**64): a key below it is validation
        limit = (self.fraction.numerator << 64) // self.fraction.denominator
        salt = self.salt.encode("utf-8")

        def in_validation(key: bytes) -> bool:
            return derive_u64(SPLIT_TAG, len(salt), tail=salt + key) < limit

        if self.key is SplitKey.ID:
            ids = (i.to_bytes(8, "little") for i in range(n))
            return np.fromiter(map(in_validation, ids), dtype=bool, count=n), None
        path = None
        if cache is not None:
            name = digest_bytes(canonical_json([self.rule, self.dataset.identity()]))
            path = cache / f"split-{name[3:35]}.json"
            cached = _read_cache(path)
            if cached is not None:
                return cached
        keys: list[bytes] = []  # every sample's content key, in id order (each read once)
        with base_progress(
            n, "split: hashing samples", unit="sample", enabled=self.progress
        ) as update:
            for start in range(0, n, READ_CHUNK):
                batch = self.dataset.read(
                    np.arange(start, min(n, start + READ_CHUNK), dtype=np.int64)
                )
                rows = len(next(iter(batch.values())))
                keys.extend(content_key({k: v[j] for k, v in batch.items()}) for j in range(rows))
                update(rows)
        hits = [in_validation(k) for k in keys]
        mask = np.array(hits, dtype=bool).reshape(n)
        val_keys = digest_bytes(b"".join(sorted(k for k, h in zip(keys, hits, strict=True) if h)))
        if path is not None:
            _write_cache(path, mask, val_keys)
        return mask, val_keys

    def identity(self, part: str | None = None) -> dict[str, Any]:
        """The rule, the assignment digest(s) and the wrapped dataset's identity."""
        out: dict[str, Any] = {
            "type": "split",
            K_RULE: dict(self.rule),
            K_ASSIGNMENT: self.assignment,
            K_DATASET: self.dataset.identity(),
        }
        if self.validation_keys is not None:
            out[K_VALIDATION_KEYS] = self.validation_keys
        if part is not None:
            out[K_PART] = part
        return out


class SplitPart:
    """One side of a `Split`: a dataset whose id ``i`` is the side's ``i``-th sample."""

    def __init__(self, split: Split, part: str, ids: IntArray) -> None:
        self.split = split
        self.part = part
        self.ids = ids.astype(np.int64)
        self.ids.setflags(write=False)

    @property
    def num_samples(self) -> int:
        return int(self.ids.size)

    def __len__(self) -> int:
        """`num_samples` (samples of one epoch), as torch's ``len(dataset)``."""
        return self.num_samples

    def read(self, ids: IntArray) -> Batch:
        idx = check_ids(ids, self.num_samples, f"split {self.part}")
        return self.split.dataset.read(self.ids[idx])

    def identity(self) -> dict[str, Any]:
        out = self.split.identity(self.part)
        out["num_samples"] = self.num_samples
        return out


def _write_cache(path: Path, mask: npt.NDArray[np.bool_], val_keys: str) -> None:
    from detdata.storage.atomic import atomic_write_bytes

    doc = {
        "kind": CACHE_KIND,
        "format_version": 1,
        "num_samples": len(mask),
        K_ASSIGNMENT: assignment_digest(mask),
        K_VALIDATION_KEYS: val_keys,
        "validation_ids": np.flatnonzero(mask).tolist(),
    }
    atomic_write_bytes(str(path), canonical_json(doc) + b"\n")


def _read_cache(path: Path) -> tuple[npt.NDArray[np.bool_], str] | None:
    """The cached assignment, or None when absent or not matching its own digest (rebuilt)."""
    try:
        doc = json.loads(path.read_bytes())
        mask = np.zeros(int(doc["num_samples"]), dtype=bool)
        mask[np.asarray(doc["validation_ids"], dtype=np.int64)] = True
        if doc.get("kind") != CACHE_KIND or assignment_digest(mask) != doc[K_ASSIGNMENT]:
            return None
        return mask, str(doc[K_VALIDATION_KEYS])
    except (OSError, ValueError, KeyError, TypeError, IndexError):
        return None
