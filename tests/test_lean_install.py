"""A lean install (issue 34): every declared dependency is used, pyarrow only where tables are read.

* each package of ``[project] dependencies`` is imported somewhere in ``detdata/`` (a declared
  dependency the package never imports costs every user its download and its own dependencies);
* ``import detdata`` and a whole ``.npy`` token run (manifest, `TokenWindows`, `DataLoader`)
  never import pyarrow, checked in a fresh interpreter;
* a Parquet read where pyarrow cannot be imported raises `DependencyError` (an `ImportError`)
  naming pyarrow and the ``pip install`` that fixes it.

Covers: detdata/base/lazy.py.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
#: distribution name -> the module it installs (where they differ)
MODULE = {"pyyaml": "yaml"}


def _run(code: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "DETDATA_REGISTRY": str(cwd / "registry")}
    return subprocess.run(
        [sys.executable, "-c", code], cwd=cwd, env=env, capture_output=True, text=True, check=False
    )


def test_every_declared_dependency_is_imported_by_the_package() -> None:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    names = [re.split(r"[<>=!~\[; ]", d, maxsplit=1)[0].lower() for d in project["dependencies"]]
    source = "\n".join(p.read_text() for p in (ROOT / "detdata").rglob("*.py"))
    unused = []
    for name in names:
        module = MODULE.get(name, name.replace("-", "_"))
        used = re.search(
            rf"^\s*(import {module}\b|from {module}\b)|LazyModule\(\"{module}\b", source, re.M
        )
        if used is None:
            unused.append(name)
    assert unused == [], f"declared dependencies detdata never imports: {unused}"


def test_a_token_run_never_imports_pyarrow(tmp_path: Path) -> None:
    code = """
import json, sys
import numpy as np
import detdata
after_import = sorted(m for m in ("pyarrow", "torchdata") if m in sys.modules)
np.save("tokens.npy", np.arange(10_000, dtype=np.uint16))
m = detdata.build_manifest(".", pattern="*.npy")
ds = detdata.TokenWindows(m, seq_len=15)
batch = next(iter(detdata.DataLoader(ds, global_batch_size=8, micro_batch_size=8, seed=0)))
assert batch["tokens"].shape == (8, 16)
print(json.dumps({"after_import": after_import, "after_run": "pyarrow" in sys.modules}))
"""
    done = _run(code, tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    seen = json.loads(done.stdout.splitlines()[-1])
    assert seen == {"after_import": [], "after_run": False}


def test_parquet_without_pyarrow_names_the_package_and_the_install(tmp_path: Path) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"text": ["a", "b", "c"]}), tmp_path / "t.parquet")
    code = """
import sys
sys.modules["pyarrow"] = None  # as if pyarrow were not installed: importing it raises ImportError
import detdata
try:
    detdata.build_manifest(".", pattern="*.parquet")
except ImportError as exc:
    print(type(exc).__name__, isinstance(exc, detdata.DetdataError), exc)
"""
    done = _run(code, tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    out = done.stdout.strip()
    assert out.startswith("DependencyError True pyarrow cannot be imported"), out
    assert "pip install 'pyarrow>=15'" in out
