"""Atomic, durable writes: temp file + fsync + rename locally; single PUT on object stores."""

from __future__ import annotations

import os
import tempfile
from typing import Any, Final

from detdata.storage.fs import filesystem, is_url

TEMP_PREFIX: Final = ".tmp-"
"""Unpublished local writes are named ``TEMP_PREFIX + random`` in the target's directory."""


def atomic_write_bytes(
    path: str, data: bytes, *, temp_dir: str | None = None, **storage_options: Any
) -> None:
    """Write ``data`` so that readers see either the old file or the whole new one.

    Locally the data goes to a ``TEMP_PREFIX`` file, is fsynced and renamed over
    ``path``. The temp file is made in ``temp_dir`` when given (a folder on the
    same file system, so the rename stays atomic: a registry keeps its temp files
    in one folder so that sweeping crash leftovers never lists its objects), else
    in the target's directory.
    """
    if is_url(path) and not path.startswith("file://"):
        fs, fpath = filesystem(path, **storage_options)
        parent = fpath.rsplit("/", 1)[0]
        if parent:
            fs.makedirs(parent, exist_ok=True)
        fs.pipe_file(fpath, data)  # object stores publish a PUT atomically
        return
    local = path[len("file://") :] if path.startswith("file://") else path
    directory = os.path.dirname(os.path.abspath(local))
    os.makedirs(directory, exist_ok=True)
    if temp_dir is not None:
        os.makedirs(temp_dir, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=TEMP_PREFIX, dir=temp_dir or directory)
    try:
        with os.fdopen(fd, "wb") as fh:
            fh.write(data)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, local)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
    dir_fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)
