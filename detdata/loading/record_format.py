"""The run record's format (`detdata.loading.record`): its version, the ``K_*`` keys of its
sections, the checked field names and groups, and the shape check of a parsed record."""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any, Final

from detdata.base.errors import ConfigError, StateError
from detdata.loading.state import CHECKED_FIELDS, K_MANIFESTS, K_SEED, K_STREAM_SEED

RECORD_VERSION: Final = 2
READABLE_VERSIONS: Final = (1, 2)
KIND: Final = "detdata.run_record"

K_KIND: Final = "kind"
K_VERSION: Final = "format_version"
K_CODE: Final = "code"
K_REVISION: Final = "revision"
K_DIRTY: Final = "dirty"
K_DIRTY_FILES: Final = "dirty_files"
K_NOTE: Final = "note"
K_LOCKS: Final = "lock_files"
K_PACKAGES: Final = "packages"
K_DIGEST: Final = "digest"
K_LIST: Final = "list"
K_VERSIONS: Final = "versions"
K_GPUS: Final = "gpus"
K_GPU_UUIDS: Final = "gpu_uuids"
K_ENV: Final = "env"
K_LAYOUT: Final = "layout"
K_CONFIG: Final = "config"
K_DATA: Final = "data"
K_SEEDS: Final = "seeds"
K_LOADER: Final = "loader"
K_LOADER_STATE: Final = "loader_state"
K_EXECUTION: Final = "execution"
K_DETERMINISM: Final = "determinism"
K_PLATFORM: Final = "platform"
K_CONTAINER: Final = "container"
#: The container section's note of where its values came from (not a checked field).
K_SOURCE: Final = "source"
#: Sections added in format 2 (empty when a format-1 record is read).
V2_SECTIONS: Final = (K_EXECUTION, K_DETERMINISM, K_PLATFORM, K_CONTAINER)
#: The top-level keys of a record.
TOP_KEYS: Final = (
    K_KIND,
    K_VERSION,
    K_CODE,
    K_LOCKS,
    K_PACKAGES,
    K_VERSIONS,
    K_GPUS,
    K_ENV,
    K_LAYOUT,
    K_CONFIG,
    K_DATA,
    *V2_SECTIONS,
)

VERSION_FIELDS: Final = ("python", "torch", "cuda", "cudnn", "nccl", "driver")
LAYOUT_KEYS: Final = ("world", "dp", "tp", "pp")
EXECUTION_KEYS: Final = ("micro_batch", "accumulation", "workers", "worker_mode", "precision")
PLATFORM_KEYS: Final = ("os", "kernel", "machine", "libc")
CONTAINER_KEYS: Final = ("image", "image_digest")
#: Field groups: ``allow=("env",)`` allows every ``env.NAME``, ``("loader",)`` every ``loader.*``,
#: and so on for each sectioned field.
GROUPS: Final = (K_ENV, K_LOADER, K_EXECUTION, K_DETERMINISM, K_PLATFORM, K_CONTAINER)
#: The loader state's checked fields recorded under ``loader.*`` (manifests and seeds have
#: their own fields).
LOADER_FIELDS: Final = tuple(
    f for f in CHECKED_FIELDS if f not in (K_MANIFESTS, K_SEED, K_STREAM_SEED)
)
FIELDS: Final = (
    K_REVISION,
    K_DIRTY,
    K_LOCKS,
    K_PACKAGES,
    *VERSION_FIELDS,
    K_GPUS,
    K_GPU_UUIDS,
    K_LAYOUT,
    K_CONFIG,
    K_MANIFESTS,
    K_SEEDS,
    *(f"{K_LOADER}.{f}" for f in LOADER_FIELDS),
    *(f"{K_EXECUTION}.{k}" for k in EXECUTION_KEYS),
    *(f"{K_PLATFORM}.{k}" for k in PLATFORM_KEYS),
    *(f"{K_CONTAINER}.{k}" for k in CONTAINER_KEYS),
)
"""Every checked field name except ``env.NAME`` and ``determinism.NAME`` (one per recorded
variable or flag)."""


def check_shape(doc: Mapping[str, Any], where: str) -> None:
    """Every section has the type `RunRecord.fields` reads (`StateError` naming the first that
    has not): a record edited by hand is refused here, never with a raw Python error later."""
    odd: dict[str, type | tuple[type, ...]] = {K_GPUS: list, K_CONFIG: (str, type(None))}
    for name in TOP_KEYS[2:]:  # the sections, after kind and format_version
        value = doc[name]
        if not isinstance(value, odd.get(name, dict)):
            raise StateError(f"{where}: field {name!r} has the wrong type ({type(value).__name__})")
    packages = doc[K_PACKAGES]
    if not isinstance(packages.get(K_DIGEST), str) or not isinstance(packages.get(K_LIST), list):
        raise StateError(f"{where}: field 'packages' must hold a digest string and a list")
    if not all(isinstance(p, list) and len(p) == 2 for p in packages[K_LIST]):
        raise StateError(f"{where}: field 'packages.list' must hold [name, version] pairs")
    if not all(isinstance(g, dict) for g in doc[K_GPUS]):
        raise StateError(f"{where}: field 'gpus' must hold objects (name, uuid)")
    data = doc[K_DATA]
    for key, kind in ((K_MANIFESTS, list), (K_SEEDS, dict), (K_LOADER, dict)):
        if not isinstance(data.get(key), kind):
            raise StateError(
                f"{where}: field 'data.{key}' has the wrong type ({type(data.get(key)).__name__})"
            )


def plain(doc: Any) -> Any:
    """A JSON round trip: tuples become lists, and anything not JSON-plain is refused."""
    try:
        return json.loads(json.dumps(doc, allow_nan=False))
    except (TypeError, ValueError) as exc:
        raise ConfigError(f"run record: a value is not JSON-plain ({exc})") from None
