"""`Storage`: where and how a shard dataset reads its files, as one frozen object.

Every dataset that reads the shard files of a manifest (`TokenWindows`, `TableRows`,
`Documents`: each holds a `detdata.datasets.shard_files.ShardFiles`) takes one
``storage=Storage(...)``. Its fields:

* ``root``: the path or fsspec URL the manifest's shards are read under (None: the
  manifest's own root).
* ``verify``: how much of the bytes is checked when the dataset is opened (`Verify`:
  ``"quick"``, ``"full"``, ``"off"``).
* ``fs_options``: the keyword arguments of the fsspec file system of the root
  (credentials, endpoint, ...): what fsspec calls ``storage_options``. Its values are never
  shown (``repr`` masks them).
* ``retry``: how remote reads retry (`RetryPolicy`; default ``RetryPolicy()``).
* ``cache_dir``: where whole remote shards are copied (verified against the manifest's
  blake3, in a bounded `detdata.storage.cache.ShardCache`) and read from: a local folder;
  None: no copies (remote shards are read with range requests); `DefaultCache.USER`: a
  bounded per-user folder (`user_cache`); `DefaultCache.AUTO` (the default): the dataset's
  own default, USER for `TokenWindows` and None for `TableRows` and `Documents`.
* ``shard_cache_bytes``: the bound of that cache (None: 16 GiB for a folder, see
  `user_cache` for USER); only with a cache.
* ``cache_verify``: how a cached copy is re-checked when it is opened (``"quick"``: its
  size and first and last MiB; ``"full"``: re-hashed).
* ``max_open_shards``: the shards of the dataset with an open handle per process
  (default 128; `detdata.set_max_open_shards` bounds all datasets of a process together).

None of them changes a byte delivered (remote bytes are checked against the manifest
wherever they are read from), so none is part of a dataset's ``identity()``. Every field is
checked when the object is made: a bad value is a `ConfigError` naming the field, what was
expected and what was found, with a hint.

The keywords of those fields given to the dataset itself (``TokenWindows(path, 64,
verify="full")``, the spelling before `Storage`) are refused (`checked_storage`): a
`ConfigError` naming the `Storage` field to pass instead (``storage_options`` is
``fs_options``, ``cache_bytes`` is ``shard_cache_bytes``; `TableRows`, where
``cache_bytes`` named the in-memory row-group cache, says so).
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
#: The environment variable naming the default cache's folder (it chooses where copies
#: live, never which bytes are read).
#: A dataset's keywords before `Storage` (refused) -> the field of `Storage` to pass instead.
REMOVED_KEYWORDS: Final = {
    "verify": "verify",
    "root": "root",
    "storage_options": "fs_options",
    "retry": "retry",
    "cache_dir": "cache_dir",
    "shard_cache_bytes": "shard_cache_bytes",
    "cache_verify": "cache_verify",
    "max_open_shards": "max_open_shards",
    "cache_bytes": "shard_cache_bytes",  # its older name
}

log: Final = get_logger("detdata.cache")


class DefaultCache(enum.Enum):
    """The values of ``Storage.cache_dir`` that are not a folder or None.

    ``USER``: a bounded per-user folder (`user_cache_dir`), used for remote roots only (see
    `user_cache`). ``AUTO``: the dataset's default (``USER`` for `TokenWindows`, whose remote
    windows are small reads; None for `TableRows` and `Documents`)."""

    USER = "user"
    AUTO = "auto"


@dataclass(frozen=True, kw_only=True, repr=False)
class Storage:
    """Where and how a shard dataset reads its files (see the module docstring).

    Frozen and checked when made: each field is normalised (``root`` and a ``cache_dir``
    folder to ``str``, ``verify`` to `Verify`, ``fs_options`` to a ``dict`` copy, a None
    ``retry`` / ``max_open_shards`` to the default) or refused with a `ConfigError` naming
    it. ``repr`` masks the values of ``fs_options`` and the credentials of a root URL.
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
    """The `Storage` dataset ``owner`` reads with: ``storage`` (None: ``Storage()``).

    ``refused``: the keywords given to ``owner``'s constructor that it does not take (its
    ``**refused``, typed ``Never`` so that type checkers flag each). A field of `Storage`
    given there (the spelling before `Storage`, `REMOVED_KEYWORDS`) is a `ConfigError`
    naming the field to pass in ``storage=Storage(...)``; any other keyword is the
    `TypeError` Python gives an unknown one. A ``storage`` that is not a `Storage` is a
    `ConfigError`.
    """
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


def _check_root(value: object) -> str | None:
    if value is None:
        return None
    if isinstance(value, (str, os.PathLike)):
        root = os.fspath(value)
        if isinstance(root, str) and root:
            return root
    raise _bad(
        "root",
        "a path or fsspec URL (a non-empty str or os.PathLike) or None",
        repr(value),
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
    if value is None or isinstance(value, DefaultCache):
        return value
    if isinstance(value, (str, os.PathLike)):
        folder = os.fspath(value)
        if isinstance(folder, str) and folder:
            return folder
    raise _bad(
        "cache_dir",
        "a local folder (a non-empty str or os.PathLike), None (no copies) or a DefaultCache",
        repr(value),
        "cache_dir='/local/ssd/detdata-cache'",
    )


def _check_cache_bytes(value: object, cache_dir: object) -> int | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise _bad(
            "shard_cache_bytes",
            "an integer >= 1 (bytes) or None",
            repr(value),
            "shard_cache_bytes=64 << 30 for 64 GiB",
        )
    if cache_dir is None:
        raise _bad(
            "shard_cache_bytes",
            "None without a cache of shard copies (cache_dir=None, the default of "
            "TableRows and Documents)",
            repr(value),
            "pass cache_dir='/local/dir' to cache remote shards, or leave shard_cache_bytes out",
        )
    return int(value)


def _check_cache_verify(value: object) -> str:
    if value == "quick" or value == "full":
        return "quick" if value == "quick" else "full"
    raise _bad(
        "cache_verify",
        "'quick' (size + first/last MiB) or 'full' (re-hash the whole copy on open)",
        repr(value),
        "cache_verify='full' re-hashes each cached copy when it is opened",
    )


def _check_max_open_shards(value: object) -> int:
    if value is None:
        return DEFAULT_MAX_OPEN_SHARDS
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise _bad(
            "max_open_shards",
            "an integer >= 1 (shards with an open handle per process) or None",
            repr(value),
            f"leave it out for the default {DEFAULT_MAX_OPEN_SHARDS}",
        )
    return int(value)


# the default cache (DefaultCache.USER) -----------------------------------------------------
def user_cache(manifest: Manifest, shard_cache_bytes: int | None) -> tuple[str | None, int]:
    """``(cache_dir, shard_cache_bytes)`` of the default cache for ``manifest`` (resolved,
    with a root). A reader uses it at once where the whole corpus fits in the bound (each
    shard is then fetched once, in any order), else only for a locality order
    (`ShardFiles.use_user_cache`): under a global shuffle a cache smaller than the corpus
    would fetch a whole shard for each sample, where range reads fetch the sample.

    None (coalesced range reads, as with ``cache_dir=None``) for a local root, and, with a
    logged warning, where the folder cannot be made or written, or where the bound (
    ``shard_cache_bytes``, else `DEFAULT_USER_CACHE_BYTES` and at most half the free space)
    holds fewer than `USER_CACHE_MIN_SHARDS` of the largest shard. Which of these applies
    never changes a byte read: copies are verified against the manifest's blake3."""
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
