"""`detdata.loading.iteration`: an iterator left unfinished when the interpreter exits."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import write_token_shards

ROOT = Path(__file__).resolve().parents[2]

SCRIPT = """
import sys
import detdata
manifest = detdata.build_manifest(sys.argv[1])
ds = detdata.TokenWindows(manifest, 16)
options = detdata.LoaderOptions(read=detdata.ReadOptions(worker_mode=sys.argv[2]))
loader = detdata.DataLoader(ds, global_batch_size=8, seed=0, num_workers=int(sys.argv[3]),
                            options=options)
it = iter(loader)
next(it)
next(it)
print("delivered")
"""


@pytest.mark.parametrize(("mode", "workers"), [("process", 0), ("thread", 2), ("process", 2)])
def test_an_unfinished_iterator_at_exit_prints_no_ignored_exception(
    tmp_path: Path, mode: str, workers: int
) -> None:
    """A script that takes two batches and ends without closing its iterator exits cleanly:
    the generator finalized at interpreter exit, after the module's globals are gone, raises
    nothing that Python would print as ``Exception ignored``."""
    write_token_shards(tmp_path / "data", sizes=(4000, 3000))
    done = subprocess.run(
        [sys.executable, "-c", SCRIPT, str(tmp_path / "data"), mode, str(workers)],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=ROOT,
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "delivered"
    assert "Exception ignored" not in done.stderr, done.stderr
    assert "Traceback" not in done.stderr, done.stderr
