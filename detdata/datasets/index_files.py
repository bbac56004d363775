"""Content-addressed index files: small arrays built once, keyed by the inputs that make them.

An index (a document table, a packing index) is a pure function of its inputs
(manifest ids, seeds, options, algorithm versions). `load_index` / `save_index`
store it under ``index_dir`` as ``NAME-<key>.npy`` plus ``NAME-<key>.json``, where
``key`` is the blake3 of the canonical JSON of the inputs. The JSON holds the
inputs themselves, small metadata and the blake3 of the ``.npy`` file; a load
re-checks both (a cache file that was edited, truncated or belongs to other inputs
is rebuilt, with a warning), so a cache never changes a delivered byte. The
``.json`` is written last (atomically), so a crash mid-write leaves no index that
loads. Loaded arrays are read-only memory maps.

`progress` is the build-time progress bar: tqdm when importable, else one line
on stderr per tenth of the work.
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
import tempfile
import warnings
from collections.abc import Callable, Iterator, Mapping
from typing import Any, Final

import blake3
import numpy as np

from detdata.base.canonical import canonical_json
from detdata.base.hashing import CHUNK, PREFIX
from detdata.storage.atomic import atomic_write_bytes

#: Version of the index-file layout (``.npy`` + ``.json``).
LAYOUT: Final = "detdata.index-v1"


def index_key(inputs: Mapping[str, Any]) -> str:
    """Hex blake3 of the canonical JSON of ``inputs``: the name an index is stored under."""
    return blake3.blake3(canonical_json(dict(inputs))).hexdigest()


def _paths(index_dir: str, name: str, inputs: Mapping[str, Any]) -> tuple[str, str]:
    stem = os.path.join(os.fspath(index_dir), f"{name}-{index_key(inputs)}")
    return stem + ".npy", stem + ".json"


def _file_digest(path: str) -> str:
    hasher = blake3.blake3()
    with open(path, "rb") as fh:
        while chunk := fh.read(CHUNK):
            hasher.update(chunk)
    return PREFIX + hasher.hexdigest()


def load_index(
    index_dir: str | None, name: str, inputs: Mapping[str, Any]
) -> tuple[np.ndarray[Any, Any], dict[str, Any]] | None:
    """``(array, metadata)`` of a stored index of ``inputs``, or None (absent or not valid)."""
    if index_dir is None:
        return None
    npy, meta_path = _paths(index_dir, name, inputs)
    try:
        with open(meta_path, "rb") as fh:
            doc = json.loads(fh.read())
    except FileNotFoundError:
        return None
    except (OSError, ValueError):
        doc = None
    plain = json.loads(canonical_json(dict(inputs)))
    valid = (
        isinstance(doc, dict)
        and doc.get("layout") == LAYOUT
        and doc.get("inputs") == plain
        and os.path.exists(npy)
        and doc.get("digest") == _file_digest(npy)
    )
    if not valid:
        warnings.warn(
            f"index file {npy} does not match its record (edited, truncated or from other "
            "inputs); rebuilding it",
            RuntimeWarning,
            stacklevel=3,
        )
        return None
    assert isinstance(doc, dict)
    array = np.load(npy, mmap_mode="r", allow_pickle=False)
    return array, dict(doc.get("meta", {}))


def save_index(
    index_dir: str | None,
    name: str,
    inputs: Mapping[str, Any],
    array: np.ndarray[Any, Any],
    meta: Mapping[str, Any],
) -> None:
    """Store ``array`` (and JSON ``meta``) as the index of ``inputs`` (no-op without a dir)."""
    if index_dir is None:
        return
    npy, meta_path = _paths(index_dir, name, inputs)
    os.makedirs(os.path.dirname(npy), exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=".tmp-", suffix=".npy", dir=os.path.dirname(npy))
    try:
        with os.fdopen(fd, "wb") as fh:
            np.save(fh, np.ascontiguousarray(array), allow_pickle=False)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, npy)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise
    record = {
        "layout": LAYOUT,
        "inputs": json.loads(canonical_json(dict(inputs))),
        "digest": _file_digest(npy),
        "meta": dict(meta),
    }
    atomic_write_bytes(meta_path, canonical_json(record) + b"\n")


@contextlib.contextmanager
def progress(total: int, desc: str, enabled: bool | None) -> Iterator[Callable[[int], None]]:
    """A progress callback ``update(done)`` for ``total`` units (``enabled`` None: a tty only)."""
    show = sys.stderr.isatty() if enabled is None else bool(enabled)
    if not show or total <= 0:
        yield lambda _done: None
        return
    try:
        from tqdm import tqdm
    except ImportError:  # pragma: no cover - tqdm is a dependency; the fallback is for vendoring
        state = {"done": 0, "shown": 0}

        def update(done: int) -> None:
            state["done"] += done
            tenth = state["done"] * 10 // total
            if tenth > state["shown"]:
                state["shown"] = tenth
                print(f"{desc}: {state['done']}/{total}", file=sys.stderr, flush=True)

        yield update
        return
    bar = tqdm(total=total, desc=desc, unit="doc", unit_scale=True, file=sys.stderr)
    try:
        yield bar.update
    finally:
        bar.close()
