"""A manifest's shard entry and verification levels: the leaf types of `detdata.identity`,
below `detdata.identity.manifest` so that the fast form and the checks need not import it.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Final, Protocol

from detdata.base.errors import ConfigError, ManifestError
from detdata.base.hashing import is_digest
from detdata.identity.formats import JSONL_LAYOUTS, TABLE_FORMATS, TOKEN_DTYPES, Format
from detdata.storage.fs import check_relative_path

FORMAT_VERSION: Final = 1
KIND: Final = "detdata.manifest"

_SHARD_REQUIRED: Final = ("path", "bytes", "blake3", "quick", "num_samples", "format")
_SHARD_OPTIONAL: Final = ("dtype", "data_offset", "schema", "row_groups")


class Verify(str, enum.Enum):
    """How much of the bytes to check when opening a manifest."""

    OFF = "off"
    QUICK = "quick"
    FULL = "full"


@dataclass(frozen=True, kw_only=True)
class ShardEntry:
    """One shard of a manifest. ``num_samples`` counts tokens (token files) or rows (tables)."""

    path: str
    bytes: int
    blake3: str
    quick: str
    num_samples: int
    format: Format
    dtype: str | None = None
    data_offset: int | None = None
    schema: str | None = None
    row_groups: tuple[int, ...] | None = None

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {key: getattr(self, key) for key in _SHARD_REQUIRED}
        out["format"] = self.format.value
        for key in _SHARD_OPTIONAL:
            value = getattr(self, key)
            if value is not None:
                out[key] = list(value) if isinstance(value, tuple) else value
        return out

    @classmethod
    def from_json(cls, obj: object, where: str) -> ShardEntry:
        if not isinstance(obj, dict):
            raise ManifestError(f"{where}: expected an object, found {type(obj).__name__}")
        missing = [k for k in _SHARD_REQUIRED if k not in obj]
        unknown = sorted(set(obj) - set(_SHARD_REQUIRED) - set(_SHARD_OPTIONAL))
        if missing or unknown:
            raise ManifestError(f"{where}: missing fields {missing}, unknown fields {unknown}")
        path = check_relative_path(obj["path"], where=where)
        for key in ("bytes", "num_samples"):
            _check_int(obj[key], f"{where} ({path}) field {key!r}")
        for key in ("blake3", "quick"):
            if not is_digest(obj[key]):
                raise ManifestError(
                    f"{where} ({path}) field {key!r} must look like 'b3:<64 hex>', "
                    f"found {obj[key]!r}"
                )
        try:
            fmt = Format(obj["format"])
        except ValueError:
            raise ManifestError(f"{where} ({path}): unknown format {obj['format']!r}") from None
        groups = obj.get("row_groups")
        if groups is not None:
            if not isinstance(groups, list):
                raise ManifestError(f"{where} ({path}): row_groups must be a list")
            for g in groups:
                _check_int(g, f"{where} ({path}) row_groups")
            groups = tuple(groups)
        offset = obj.get("data_offset")
        if offset is not None:
            _check_int(offset, f"{where} ({path}) field 'data_offset'")
        for key in ("dtype", "schema"):
            if obj.get(key) is not None and not isinstance(obj[key], str):
                raise ManifestError(f"{where} ({path}): field {key!r} must be a string")
        _check_format_fields(fmt, obj, f"{where} ({path})")
        fields: dict[str, Any] = {k: obj.get(k) for k in (*_SHARD_REQUIRED, *_SHARD_OPTIONAL)}
        return cls(**{**fields, "path": path, "format": fmt, "row_groups": groups})


def _check_format_fields(fmt: Format, obj: dict[str, Any], where: str) -> None:
    """Token shards need a token dtype and a data offset; tables need a schema fingerprint."""
    if fmt is Format.JSONL:
        if obj.get("schema") not in JSONL_LAYOUTS:
            raise ManifestError(
                f"{where}: jsonl shard field 'schema' must be one of {JSONL_LAYOUTS} (its "
                f"compression), found {obj.get('schema')!r}"
            )
        return
    if fmt in TABLE_FORMATS:
        if obj.get("schema") is None:
            raise ManifestError(
                f"{where}: {fmt.value} shard without field 'schema' (the schema "
                "fingerprint); hint: rebuild the manifest with build_manifest"
            )
        return
    if obj.get("dtype") not in TOKEN_DTYPES:
        raise ManifestError(
            f"{where}: field 'dtype' must be one of {TOKEN_DTYPES} for a "
            f"{fmt.value} shard, found {obj.get('dtype')!r}"
        )
    if obj.get("data_offset") is None:
        raise ManifestError(f"{where}: {fmt.value} shard without field 'data_offset'")


def _check_int(value: object, where: str) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ManifestError(f"{where} must be a non-negative integer, found {value!r}")


#: verification levels, weakest first (a level covers every weaker one)
STRENGTH: Final = {Verify.OFF: 0, Verify.QUICK: 1, Verify.FULL: 2}


def parse_verify(value: str | Verify) -> Verify:
    """`Verify` from ``"quick"`` / ``"full"`` / ``"off"``, else `ConfigError`."""
    try:
        return Verify(value)
    except ValueError:
        raise ConfigError(f"verify must be one of 'quick', 'full', 'off', got {value!r}") from None


class ShardList(Protocol):
    """What verification and receipts read of a manifest (`detdata.identity.manifest.Manifest`
    fits)."""

    @property
    def id(self) -> str: ...

    @property
    def root(self) -> str | None: ...

    @property
    def shards(self) -> Sequence[ShardEntry]: ...

    def url(self, shard: ShardEntry) -> str: ...
