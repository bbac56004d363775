"""Lazy modules first used by several threads at once (issue 45: text and table shards are
inspected in parallel threads while a manifest is built).

Before `LazyModule` serialised first imports, threads importing ``pyarrow``,
``pyarrow.ipc`` and ``pyarrow.parquet`` at once saw a partially initialised
``pyarrow.ipc`` (a `DependencyError` "cannot import name 'serialize_pandas'"), in every
fresh interpreter tried. Each run here is a fresh interpreter (the imports must be first).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = """
import threading
from detdata.base.lazy import LazyModule
names = ("pyarrow", "pyarrow.ipc", "pyarrow.parquet")
attrs = {"pyarrow": "PythonFile", "pyarrow.ipc": "open_file", "pyarrow.parquet": "ParquetFile"}
mods = [LazyModule(n, install="pyarrow") for n in names] * 3
barrier = threading.Barrier(len(mods))
errors = []
def go(m):
    barrier.wait()
    try:
        getattr(m, attrs[m.__name__])
    except Exception as exc:
        errors.append(repr(exc))
threads = [threading.Thread(target=go, args=(m,)) for m in mods]
for t in threads:
    t.start()
for t in threads:
    t.join()
print(errors)
"""


def test_first_use_from_many_threads_imports_each_module_whole() -> None:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    for _ in range(3):
        run = subprocess.run(
            [sys.executable, "-c", SCRIPT], capture_output=True, text=True, env=env, timeout=120
        )
        assert run.returncode == 0, run.stderr
        assert run.stdout.strip() == "[]", run.stdout
