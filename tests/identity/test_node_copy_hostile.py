"""Hostile files in the folder of node copies (docs/design.md section 8, "One manifest read
per node"): a link planted at a copy's name or at the folder itself, in a real cache folder.

Covers: detdata/identity/node_copy.py (`_write_copy`, the node's reader writing its copy;
`_map_copy`, another rank of the node mapping it). The references are the bytes the test
wrote itself (the victim file's, the manifest's).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import warnings
from pathlib import Path

import pytest

from detdata.identity import node_copy

DATA = b'{"kind": "a manifest, as its reader read it"}' * 50


@pytest.fixture
def cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("DETDATA_CACHE_DIR", str(tmp_path / "cache"))
    return tmp_path / "cache"


def _one_copy() -> tuple[dict[str, str], Path]:
    digests, paths = node_copy._write_copy({"json": DATA})
    assert digests is not None and Path(paths["json"]).read_bytes() == DATA
    return digests, Path(paths["json"])


def test_a_link_at_a_copys_name_is_replaced_never_written_through(
    cache: Path, tmp_path: Path
) -> None:
    _, copy = _one_copy()
    victim = tmp_path / "victim.txt"
    victim.write_bytes(b"a file of this user outside the cache")
    copy.unlink()
    copy.symlink_to(victim)  # planted where the next reader writes its copy
    digests, paths = node_copy._write_copy({"json": DATA})
    assert victim.read_bytes() == b"a file of this user outside the cache"
    assert not copy.is_symlink() and copy.read_bytes() == DATA
    assert paths["json"] == str(copy) and digests is not None


def test_a_link_at_a_copys_name_is_refused_by_the_ranks_that_map_it(
    cache: Path, tmp_path: Path
) -> None:
    digests, copy = _one_copy()
    elsewhere = tmp_path / "elsewhere.json"
    elsewhere.write_bytes(DATA)  # even the right bytes: the link's target is not the copy
    copy.unlink()
    copy.symlink_to(elsewhere)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert node_copy._map_copy(digests, "/data/manifest.json") is None
    (said,) = [str(w.message) for w in caught]
    assert "refused" in said and str(copy) in said and "manifest.json" in said, said


def test_a_link_at_the_folder_of_copies_is_never_used(cache: Path, tmp_path: Path) -> None:
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir(mode=0o700)
    cache.mkdir(mode=0o700)
    (cache / node_copy.FOLDER).symlink_to(elsewhere)
    assert node_copy._write_copy({"json": DATA}) == (None, {})
    assert list(elsewhere.iterdir()) == []


#: giving a folder to another user needs root: that case is built only where it can be
HOWS = ["others can write it"] + (["another user owns it"] if os.geteuid() == 0 else [])


@pytest.mark.parametrize("how", HOWS)
def test_a_cache_folder_another_user_can_write_or_owns_gets_no_copy(cache: Path, how: str) -> None:
    cache.mkdir(mode=0o700)
    if how == "others can write it":
        cache.chmod(0o777)
    else:
        os.chown(cache, os.geteuid() + 4242, -1)
    assert node_copy._write_copy({"json": DATA}) == (None, {})
    assert not (cache / node_copy.FOLDER).exists() or not any((cache / node_copy.FOLDER).iterdir())


def test_a_copy_absent_from_this_ranks_file_system_is_read_again_not_waited_for(
    cache: Path,
) -> None:
    """A reader in another container (same host name and boot id, another file system)
    published digests of a copy this rank's cache folder does not hold."""
    digests, copy = _one_copy()
    copy.unlink()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert node_copy._map_copy(digests, "/data/manifest.json") is None
    (said,) = [str(w.message) for w in caught]
    assert "unreadable" in said and str(copy) in said, said


CHILD = """
import json, sys, warnings
from detdata.identity import node_copy
from tests.identity.test_node_copy_hostile import DATA
digests = json.loads(sys.argv[1])
warnings.simplefilter("ignore")
print(node_copy._map_copy(digests, "/data/manifest.json") is None)
print(node_copy._write_copy({"json": DATA})[0] == digests)
"""


def test_a_pipe_at_a_copys_name_neither_blocks_the_reader_nor_the_ranks_that_map_it(
    cache: Path,
) -> None:
    """A named pipe planted at a copy's name: opening it, or writing into it in place, waits
    for a peer that never comes; the ranks refuse it and the reader replaces it with its copy."""
    digests, copy = _one_copy()
    copy.unlink()
    os.mkfifo(copy)
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])}
    done = subprocess.run(
        [sys.executable, "-c", CHILD, json.dumps(digests)],
        env=env,
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert done.stdout.split() == ["True", "True"], done.stderr[-2000:]
    assert copy.is_file() and copy.read_bytes() == DATA
