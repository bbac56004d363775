"""`Storage`: where and how a shard dataset (`TokenWindows`, `TableRows`, `Documents`) reads
its files, as one frozen, checked object; `checked_storage` refuses its fields given to the
dataset itself (the spelling before `Storage`), naming the field to pass instead.
"""

from __future__ import annotations

import dataclasses
import enum
import os
import shutil
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Final

from detdata.base.errors import ConfigError
from detdata.base.redact import MASK, get_logger, redact_url
from detdata.datasets.handles import DEFAULT_MAX_OPEN_SHARDS
from detdata.identity.entry import Verify
from detdata.identity.manifest import Manifest
from detdata.storage.cache_folder import ENV_CACHE_DIR, user_cache_dir
from detdata.storage.fs import is_url
from detdata.storage.retry import DEFAULT_RETRY, RetryPolicy

#: Default bound of the disk cache of shard copies (``shard_cache_bytes``).
DEFAULT_SHARD_CACHE_BYTES: Final = 16 << 30
#: Bound of the default cache (`DefaultCache.USER`) when ``shard_cache_bytes`` is not given;
#: also at most half the free space of its file system when the dataset is made.
DEFAULT_USER_CACHE_BYTES: Final = 4 << 30
#: The default cache is used only where it holds this many of the largest shard at once.
USER_CACHE_MIN_SHARDS: Final = 4
#: A dataset's keywords before `Storage` (refused) -> the field of `Storage` to pass instead.
_SAME: Final = ("verify", "root", "retry", "cache_dir", "shard_cache_bytes", "cache_verify")
REMOVED_KEYWORDS: Final = {
    **{name: name for name in (*_SAME, "max_open_shards")},
    "storage_options": "fs_options",
    "cache_bytes": "shard_cache_bytes",  # its older name
}

log: Final = get_logger("detdata.cache")


class DefaultCache(enum.Enum):
    """The values of ``Storage.cache_dir`` that are not a folder or None: ``USER``, a bounded
    per-user folder for remote roots (`user_cache`); ``AUTO``, the dataset's default."""

    USER = "user"
    AUTO = "auto"


@dataclass(frozen=True, kw_only=True, repr=False)
class Storage:
    """Where and how a shard dataset reads its files:

    * ``root``: path or fsspec URL the shards are read under (None: the manifest's root).
    * ``verify``: how much is checked at open (`Verify`: ``"quick"``, ``"full"``, ``"off"``).
    * ``fs_options``: the fsspec file system's keyword arguments (``storage_options``).
    * ``retry``: how remote reads retry (`RetryPolicy`).
    * ``cache_dir``: a local folder whole remote shards are copied into (verified, bounded
      `detdata.storage.cache.ShardCache`) and read from; None: range requests, no copies;
      `DefaultCache.USER`: a per-user folder (`user_cache`); `DefaultCache.AUTO`: the
      dataset's default (USER for `TokenWindows`, None for `TableRows` and `Documents`).
    * ``shard_cache_bytes``: that cache's bound (None: 16 GiB, or `user_cache`'s for USER).
    * ``cache_verify``: re-check of a cached copy at open (``"quick"``: size and first and
      last MiB; ``"full"``: re-hashed).
    * ``max_open_shards``: shards of the dataset with an open handle per process
      (`detdata.set_max_open_shards` bounds all datasets of a process together).

    None changes a delivered byte, so none is in ``identity()``. Frozen; each field is
    normalised or refused with a `ConfigError` naming it. ``repr`` masks ``fs_options``'
    values and a root URL's credentials.
    """

    root: str | os.PathLike[str] | None = None
    verify: Verify | str = Verify.QUICK
    fs_options: Mapping[str, Any] = field(default_factory=dict)
    retry: RetryPolicy = DEFAULT_RETRY
    cache_dir: str | os.PathLike[str] | DefaultCache | None = DefaultCache.AUTO
    shard_cache_bytes: int | None = None
    cache_verify: str = "quick"
    max_open_shards: int = DEFAULT_MAX_OPEN_SHARDS

    def __post_init__(self) -> None:
        checked = {
            "root": _check_root(self.root),
            "verify": _check_verify(self.verify),
            "fs_options": _check_fs_options(self.fs_options),
            "retry": _check_retry(self.retry),
            "cache_dir": _check_cache_dir(self.cache_dir),
            "cache_verify": _check_cache_verify(self.cache_verify),
            "max_open_shards": _check_max_open_shards(self.max_open_shards),
        }
        checked["shard_cache_bytes"] = _check_cache_bytes(
            self.shard_cache_bytes, checked["cache_dir"]
        )
        for name, value in checked.items():
            object.__setattr__(self, name, value)

    def __repr__(self) -> str:
        shown: dict[str, Any] = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        shown["fs_options"] = dict.fromkeys(self.fs_options, MASK)
        if isinstance(self.root, str):
            shown["root"] = redact_url(self.root)
        return "Storage(" + ", ".join(f"{k}={v!r}" for k, v in shown.items()) + ")"

    def with_default_cache(self, default: DefaultCache | None) -> Storage:
        """This storage with a ``cache_dir`` of `DefaultCache.AUTO` replaced by a dataset's
        default ``default`` (`DefaultCache.USER`, or None: no copies); checked again."""
        if self.cache_dir is not DefaultCache.AUTO:
            return self
        return dataclasses.replace(self, cache_dir=default)


def checked_storage(owner: str, storage: Storage | None, refused: Mapping[str, object]) -> Storage:
    """``storage`` (None: ``Storage()``) for dataset ``owner``, else a `ConfigError`.
    ``refused`` (``owner``'s ``**refused: Never``): one in `REMOVED_KEYWORDS` is a
    `ConfigError` naming the field to pass instead, any other Python's `TypeError`."""
    for name in refused:
        field = REMOVED_KEYWORDS.get(name)
        if field is None:
            raise TypeError(f"{owner}() got an unexpected keyword argument {name!r}")
        raise ConfigError(
            f"{owner}({name}=...) is not a keyword of {owner}: where and how shards are read "
            f"is one Storage object; hint: pass storage=detdata.Storage({field}=...)"
        )
    if storage is not None and not isinstance(storage, Storage):
        raise ConfigError(
            f"{owner}: storage must be a detdata.Storage, found {type(storage).__name__}; "
            "hint: storage=Storage(root=..., cache_dir=...)"
        )
    return Storage() if storage is None else storage


# the checks of the fields ----------------------------------------------------------------
def _bad(name: str, expected: str, found: str, hint: str) -> ConfigError:
    return ConfigError(f"Storage.{name}: expected {expected}, found {found}; hint: {hint}")


def _check_path(name: str, value: object, expected: str, hint: str) -> str | None:
    """``value`` as a non-empty path string (from a str or ``os.PathLike``) or None, else
    `_bad` naming field ``name``."""
    path = os.fspath(value) if isinstance(value, (str, os.PathLike)) else None
    if value is None or (isinstance(path, str) and path):
        return path
    raise _bad(name, expected, repr(value), hint)


def _check_root(value: object) -> str | None:
    return _check_path(
        "root",
        value,
        "a path or fsspec URL (a non-empty str or os.PathLike) or None",
        "root='s3://bucket/prefix' or a local folder; None reads under the manifest's root",
    )


def _check_verify(value: object) -> Verify:
    try:
        return Verify(value)
    except (ValueError, TypeError):
        raise _bad(
            "verify",
            "one of 'quick', 'full', 'off' (or a detdata.Verify)",
            repr(value),
            "'quick' checks sizes and quick digests, 'full' re-hashes every byte",
        ) from None


def _check_fs_options(value: object) -> dict[str, Any]:
    if value is None:
        return {}
    if not isinstance(value, Mapping):
        raise _bad(
            "fs_options",
            "a mapping of the fsspec file system's keyword arguments, or None",
            f"a {type(value).__name__}",
            "fs_options={'anon': True} (fsspec's storage_options)",
        )
    for key in value:
        if not isinstance(key, str):
            raise _bad(
                "fs_options",
                "keyword names (str keys)",
                f"the key {key!r}",
                "fs_options={'key': ..., 'secret': ...} (fsspec's storage_options)",
            )
    return dict(value)


def _check_retry(value: object) -> RetryPolicy:
    if value is None:
        return DEFAULT_RETRY
    if not isinstance(value, RetryPolicy):
        raise _bad(
            "retry",
            "a detdata.RetryPolicy or None",
            f"a {type(value).__name__}",
            "retry=RetryPolicy(deadline_s=60)",
        )
    return value


def _check_cache_dir(value: object) -> str | DefaultCache | None:
    if isinstance(value, DefaultCache):
        return value
    return _check_path(
        "cache_dir",
        value,
        "a local folder (a non-empty str or os.PathLike), None (no copies) or a DefaultCache",
        "cache_dir='/local/ssd/detdata-cache'",
    )


def _positive_int(value: object, name: str, unit: str, hint: str) -> int:
    """``value`` as an integer >= 1, else `_bad` naming field ``name``."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise _bad(name, f"an integer >= 1 ({unit}) or None", repr(value), hint)
    return int(value)


def _check_cache_bytes(value: object, cache_dir: object) -> int | None:
    if value is None:
        return None
    size = _positive_int(
        value, "shard_cache_bytes", "bytes", "shard_cache_bytes=64 << 30 for 64 GiB"
    )
    if cache_dir is None:
        raise _bad(
            "shard_cache_bytes",
            "None without a cache of shard copies (cache_dir=None, the default of "
            "TableRows and Documents)",
            repr(value),
            "pass cache_dir='/local/dir' to cache remote shards, or leave shard_cache_bytes out",
        )
    return size


def _check_cache_verify(value: object) -> str:
    if value in ("quick", "full"):
        return str(value)
    raise _bad(
        "cache_verify",
        "'quick' (size + first/last MiB) or 'full' (re-hash the whole copy on open)",
        repr(value),
        "cache_verify='full' re-hashes each cached copy when it is opened",
    )


def _check_max_open_shards(value: object) -> int:
    if value is None:
        return DEFAULT_MAX_OPEN_SHARDS
    return _positive_int(
        value,
        "max_open_shards",
        "shards with an open handle per process",
        f"leave it out for the default {DEFAULT_MAX_OPEN_SHARDS}",
    )


# the default cache (DefaultCache.USER) -----------------------------------------------------
def user_cache(manifest: Manifest, shard_cache_bytes: int | None) -> tuple[str | None, int]:
    """``(cache_dir, shard_cache_bytes)`` of the default cache for ``manifest`` (resolved,
    with a root; docs/design.md "Remote reads"). None (range reads) for a local root, and,
    with a logged warning, where the folder cannot be made or written, or where the bound
    (``shard_cache_bytes``, else `DEFAULT_USER_CACHE_BYTES` and at most half the free
    space) holds fewer than `USER_CACHE_MIN_SHARDS` of the largest shard."""
    root = manifest.root or ""
    if not is_url(root) or root.startswith("file://"):
        return None, DEFAULT_SHARD_CACHE_BYTES
    folder = user_cache_dir()
    try:
        os.makedirs(folder, mode=0o700, exist_ok=True)  # private under any umask
        if not os.access(folder, os.W_OK | os.X_OK):
            raise PermissionError(f"{folder} is not writable")
        free = shutil.disk_usage(folder).free
    except OSError as exc:
        log.warning(
            "detdata: the default shard cache %s cannot be used (%s); remote shards are read "
            "with range requests (slower); hint: set %s or pass Storage(cache_dir=...)",
            folder,
            exc,
            ENV_CACHE_DIR,
        )
        return None, DEFAULT_SHARD_CACHE_BYTES
    bound = shard_cache_bytes
    if bound is None:
        bound = min(DEFAULT_USER_CACHE_BYTES, free // 2)
    sizes = manifest.bytes_per_shard()
    largest = int(sizes.max()) if sizes.size else 0
    if largest * USER_CACHE_MIN_SHARDS > bound:
        log.warning(
            "detdata: the default shard cache %s (bound %d bytes) holds fewer than %d of the "
            "largest shard (%d bytes); remote shards are read with range requests (slower); "
            "hint: pass Storage(cache_dir=..., shard_cache_bytes=...) for a larger cache",
            folder,
            bound,
            USER_CACHE_MIN_SHARDS,
            largest,
        )
        return None, DEFAULT_SHARD_CACHE_BYTES
    return folder, bound
