"""A shard-cache folder shared with another party (`detdata.storage.cache_folder`).

Real parties: a second Unix user (made with ``useradd`` where this test runs as root; its
file operations run as that user through ``sh``), a process in another pid namespace
(``unshare --pid`` where permitted), a full file system (a small tmpfs, where mounting is
permitted). Each test is skipped, saying why, where its party cannot be made here. Bytes
are compared with the shards' own bytes (the writer's input).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import pwd
import shutil
import signal
import subprocess
import sys
import tempfile
import textwrap
import time
from collections.abc import Iterator
from pathlib import Path

import blake3
import fsspec
import numpy as np
import pytest

from detdata import DataLoader, Storage, TokenWindows
from detdata.base.errors import StorageError
from detdata.identity.build import build_manifest
from detdata.identity.manifest import Manifest, ShardEntry
from detdata.storage.boot import boot_id
from detdata.storage.cache import ShardCache
from detdata.storage.retry import RetryPolicy
from detdata.storage.verified import forget_verified
from tests.faultproxy import FaultProxy, schedule
from tests.servers import HttpServer

CO_USER = "detdata-co"
MIB = 1 << 20
N = 1_600_000  # uint16 tokens: a 3.2 MB shard (a middle outside the quick digest's 2 MiB)


# parties --------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def co_user() -> str:
    """A second Unix user (made once; root only)."""
    if os.geteuid() != 0 or shutil.which("useradd") is None:
        pytest.skip("a second user needs root and useradd")
    try:
        pwd.getpwnam(CO_USER)
    except KeyError:
        made = subprocess.run(
            ["useradd", "--no-create-home", "--shell", "/bin/sh", CO_USER],
            capture_output=True,
            text=True,
        )
        if made.returncode != 0:
            pytest.skip(f"useradd refused: {made.stderr.strip()}")
    return CO_USER


def as_user(user: str, script: str) -> None:
    """Run ``script`` (sh) as ``user``; fail the test with its output if it fails."""
    done = subprocess.run(["sh", "-ec", script], user=user, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr


@pytest.fixture
def scratch() -> Iterator[Path]:
    """A team scratch folder every user can reach and write (under /tmp, not pytest's
    private tmp_path)."""
    path = Path(tempfile.mkdtemp(prefix="detdata-scratch-"))
    path.chmod(0o777)
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest.fixture
def shard(http_server: HttpServer) -> tuple[ShardEntry, fsspec.AbstractFileSystem, str, bytes]:
    """(manifest entry, fs, URL, true bytes) of one 3.2 MB shard served by nginx."""
    directory, url = http_server.new_dir()
    tokens = np.random.default_rng(7).integers(0, 60_000, size=N).astype(np.uint16)
    np.save(directory / "big.npy", tokens)
    entry = build_manifest(url).shards[0]
    return entry, fsspec.filesystem("http"), f"{url}/big.npy", (directory / "big.npy").read_bytes()


def forged(true: bytes) -> bytes:
    """Another shard of the same size with the same first and last MiB (what the quick
    digest reads): only its middle differs."""
    data = bytearray(true)
    data[MIB + 10 : len(data) - MIB - 10] = bytes(len(data) - 2 * MIB - 20)
    assert len(data) == len(true) and data[:MIB] == true[:MIB] and data[-MIB:] == true[-MIB:]
    return bytes(data)


def planted_layout(user: str, cache: Path) -> None:
    """The co-user makes the cache folder and its layout first, writable by all (as a
    team folder is)."""
    as_user(user, f"mkdir -m 777 {cache} {cache}/objects {cache}/tmp {cache}/locks")


# a co-user's copies -----------------------------------------------------------------------
@pytest.mark.parametrize("when", ["planted before the first use", "swapped after a fill"])
def test_a_co_user_cannot_choose_the_bytes_a_job_reads(
    co_user: str,
    scratch: Path,
    shard: tuple[ShardEntry, fsspec.AbstractFileSystem, str, bytes],
    when: str,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A copy of the same size with the same first and last MiB, named on this boot's
    record, put in place by another user: the job still reads the shard's own bytes."""
    entry, fs, url, true = shard
    cache = scratch / "cache"
    planted_layout(co_user, cache)
    hex_name = entry.blake3.removeprefix("b3:")
    (scratch / "forged").write_bytes(forged(true))
    (scratch / "forged").chmod(0o644)
    plant = (
        f"cp {scratch}/forged {cache}/objects/.x && mv -f {cache}/objects/.x "
        f"{cache}/objects/{hex_name} && {{ echo {hex_name} >> {cache}/checked-{boot_id()}; }} "
        "2>/dev/null || true"  # a record the job wrote itself may not be the co-user's to edit
    )
    if when == "planted before the first use":
        as_user(co_user, plant)
    else:
        ShardCache(cache, 1 << 26).path(entry, fs, url, url)
        forget_verified()  # the next job: a new process
        as_user(co_user, plant)
    with caplog.at_level(logging.WARNING, logger="detdata.cache"):
        job = ShardCache(cache, 1 << 26)
        path = job.path(entry, fs, url, url)
    assert Path(path).read_bytes() == true
    assert job.stats.corrupt == 1 and job.shared is not None
    assert "is shared" in caplog.text and "corrupted" in caplog.text


def test_a_job_never_follows_a_co_user_s_links(
    co_user: str,
    scratch: Path,
    shard: tuple[ShardEntry, fsspec.AbstractFileSystem, str, bytes],
) -> None:
    """Links planted by another user for the record, the accounting lock and a shard lock:
    nothing is appended, created or locked where the planter chose; a lock that is a link
    is refused, naming it."""
    entry, fs, url, true = shard
    cache = scratch / "cache"
    planted_layout(co_user, cache)
    victim = scratch / "victim.txt"  # a file of the job's user
    victim.write_text("mine\n")
    chosen = scratch / "chosen-by-planter"
    hex_name = entry.blake3.removeprefix("b3:")
    as_user(co_user, f"ln -s {victim} {cache}/checked-{boot_id()}")
    as_user(co_user, f"ln -s {chosen} {cache}/locks/{hex_name}.lock")
    with pytest.raises(StorageError, match=r"locks/.*\.lock is a symbolic link"):
        ShardCache(cache, 1 << 26).path(entry, fs, url, url)
    assert not chosen.exists()
    as_user(co_user, f"rm {cache}/locks/{hex_name}.lock && ln -s {chosen} {cache}/.lock")
    with pytest.raises(StorageError, match=r"lock file .*/\.lock is a symbolic link"):
        ShardCache(cache, 1 << 26).path(entry, fs, url, url)
    assert not chosen.exists() and victim.read_text() == "mine\n"
    as_user(co_user, f"rm {cache}/.lock")  # the planter gives up
    path = ShardCache(cache, 1 << 26).path(entry, fs, url, url)
    assert Path(path).read_bytes() == true
    assert not chosen.exists() and victim.read_text() == "mine\n"  # the record: not written


def test_a_layout_folder_that_is_a_link_is_refused(co_user: str, scratch: Path) -> None:
    cache = scratch / "cache"
    elsewhere = scratch / "elsewhere"
    as_user(co_user, f"mkdir -m 777 {cache} {elsewhere} && ln -s {elsewhere} {cache}/objects")
    with pytest.raises(StorageError, match=r"objects is a symbolic link"):
        ShardCache(cache, 1 << 26)
    assert list(elsewhere.iterdir()) == []


def test_a_private_folder_keeps_the_quick_check_and_the_record(
    tmp_path: Path, shard: tuple[ShardEntry, fsspec.AbstractFileSystem, str, bytes]
) -> None:
    """The per-user default is private (owned by the user, mode 0700 parents): copies known
    whole in this boot are checked with the quick digest only (the cost a shared folder
    does not pay is stated in the README)."""
    entry, fs, url, _ = shard
    cache = tmp_path / "mine"
    first = ShardCache(cache, 1 << 26)
    assert first.shared is None
    first.path(entry, fs, url, url)
    forget_verified()
    again = ShardCache(cache, 1 << 26)
    again.path(entry, fs, url, url)
    assert again.stats.digests == 1 and again.stats.corrupt == 0
    os.chmod(cache / "objects", 0o777)  # now others can write a layout folder: shared
    assert ShardCache(cache, 1 << 26).shared is not None


def test_a_reader_s_open_is_confirmed_to_be_the_file_checked(
    scratch: Path, shard: tuple[ShardEntry, fsspec.AbstractFileSystem, str, bytes]
) -> None:
    """In a shared folder another process can rename another file over a copy between its
    check and a reader's open: the open is not confirmed, and the reader asks again."""
    entry, fs, url, true = shard
    cache = ShardCache(scratch / "cache", 1 << 26)
    os.chmod(scratch / "cache", 0o777)
    cache = ShardCache(scratch / "cache", 1 << 26)
    assert cache.shared is not None
    path = cache.path(entry, fs, url, url)
    checked = os.stat(path).st_ino
    assert cache.confirm_open(path, checked)
    other = scratch / "cache" / "objects" / ".swap"
    other.write_bytes(forged(true))
    os.replace(other, path)
    assert not cache.confirm_open(path, os.stat(path).st_ino)
    assert Path(cache.path(entry, fs, url, url)).read_bytes() == true  # checked again
    assert cache.confirm_open(path, os.stat(path).st_ino)


# temp files --------------------------------------------------------------------------------
def test_a_leftover_with_a_live_pid_in_its_name_neither_blocks_nor_stays(
    tmp_path: Path, shard: tuple[ShardEntry, fsspec.AbstractFileSystem, str, bytes]
) -> None:
    """After a reboot a leftover's pid may belong to a live process (here: pid 1). Nobody
    holds it: it is removed, and a fill that needs its room does not wait for it."""
    entry, fs, url, true = shard
    cache = ShardCache(tmp_path, entry.bytes + 1000, retry=RetryPolicy(deadline_s=20))
    hex_name = entry.blake3.removeprefix("b3:")
    leftover = tmp_path / "tmp" / f"{hex_name}.{entry.bytes}.1.0.part"
    leftover.write_bytes(b"half a fill")
    old = time.time() - 3600
    os.utime(leftover, (old, old))
    began = time.monotonic()
    path = cache.path(entry, fs, url, url)
    assert time.monotonic() - began < 10  # not the 20 s deadline
    assert Path(path).read_bytes() == true and not leftover.exists()


_CHILD = textwrap.dedent(
    """
    import json, sys, fsspec
    from detdata.identity.manifest import Manifest
    from detdata.storage.cache import ShardCache
    doc, cache_dir, url = sys.argv[1], sys.argv[2], sys.argv[3]
    with open(doc) as fh:
        entry = Manifest.from_json(json.load(fh)).shards[0]
    cache = ShardCache(cache_dir, 1 << 26)
    cache.path(entry, fsspec.filesystem("http"), url, url)
    print(json.dumps({"fills": cache.stats.fills, "pid": __import__("os").getpid()}))
    """
)


def test_a_fill_in_another_pid_namespace_is_never_taken_for_a_dead_one(
    tmp_path: Path, http_server: HttpServer
) -> None:
    """Two containers share a cache folder: a fill in flight in one (a pid namespace whose
    pids mean nothing here) is counted as reserved by the other and left alone."""
    if shutil.which("unshare") is None or os.geteuid() != 0:
        pytest.skip("a pid namespace needs root and unshare")
    directory, url = http_server.new_dir()
    np.save(directory / "big.npy", np.arange(N, dtype=np.uint16))
    manifest = build_manifest(url)
    entry = manifest.shards[0]
    pid_max = int(Path("/proc/sys/kernel/pid_max").read_text())
    with FaultProxy(http_server.port) as proxy:
        proxy.set_plan(schedule(rate_bps=800_000))  # a ~4 s fill
        slow = f"{url}/big.npy".replace(f"127.0.0.1:{http_server.port}", proxy.address)
        # a pid far from any pid of this namespace: in today's naming it looks dead here
        (tmp_path / "child.py").write_text(_CHILD)
        (tmp_path / "manifest.json").write_text(json.dumps(Manifest.to_json(manifest)))
        cache_dir = tmp_path / "cache"
        script = (
            f"{{ echo {pid_max - 200} > /proc/sys/kernel/ns_last_pid; }} 2>/dev/null; "
            f"exec {sys.executable} "
            f"{tmp_path / 'child.py'} {tmp_path / 'manifest.json'} {cache_dir} {slow}"
        )
        child = subprocess.Popen(
            ["unshare", "--pid", "--fork", "--mount-proc", "sh", "-c", script],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            cwd=Path(__file__).resolve().parents[2],
        )
        try:
            parts = _wait_for(lambda: list((cache_dir / "tmp").glob("*.part")), child)
            here = ShardCache(cache_dir, 1 << 26)
            assert here.usage() >= entry.bytes  # the other's fill counts
            assert all(p.exists() for p in parts)  # and is not deleted
            out, err = child.communicate(timeout=120)
        finally:
            with contextlib.suppress(ProcessLookupError):
                child.kill()
    assert child.returncode == 0, err
    assert json.loads(out.strip().splitlines()[-1])["fills"] == 1
    assert "removed while in use" not in err
    copy = cache_dir / "objects" / entry.blake3.removeprefix("b3:")
    assert "b3:" + blake3.blake3(copy.read_bytes()).hexdigest() == entry.blake3


def _wait_for(found: object, child: subprocess.Popen[str]) -> list[Path]:
    assert callable(found)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        parts = found()
        if parts:
            return list(parts)
        if child.poll() is not None:
            _, err = child.communicate()
            if "Operation not permitted" in err or "unshare failed" in err:
                pytest.skip(f"unshare --pid refused here: {err.strip()[:200]}")
            raise AssertionError(f"the child ended before its fill began: {err}")
        time.sleep(0.05)
    raise AssertionError("no fill began within 60 s")


# a full disk -------------------------------------------------------------------------------
@pytest.fixture
def small_disk() -> Iterator[Path]:
    """A 1 MiB tmpfs (root and a kernel that lets this process mount)."""
    if os.geteuid() != 0:
        pytest.skip("mounting a tmpfs needs root")
    path = Path(tempfile.mkdtemp(prefix="detdata-full-"))
    mounted = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(path)],
        capture_output=True,
        text=True,
    )
    if mounted.returncode != 0:
        path.rmdir()
        pytest.skip(f"mount refused: {mounted.stderr.strip()}")
    yield path
    # lazily: a worker process of the test may still be closing a file there
    subprocess.run(["umount", "--lazy", str(path)], check=False)
    with contextlib.suppress(OSError):
        path.rmdir()


def test_a_full_disk_under_a_fill_is_a_storage_error_naming_the_folder(
    small_disk: Path, shard: tuple[ShardEntry, fsspec.AbstractFileSystem, str, bytes]
) -> None:
    entry, fs, url, _ = shard
    cache = ShardCache(small_disk / "cache", 1 << 30)
    with pytest.raises(StorageError) as caught:
        cache.path(entry, fs, url, url)
    message = str(caught.value)
    assert f"shard cache folder {small_disk / 'cache'}" in message
    assert "No space left on device" in message
    assert "shard_cache_bytes" in message and "cache_dir=None" in message
    assert list((small_disk / "cache" / "tmp").iterdir()) == []  # nothing half-written kept


@pytest.mark.parametrize("workers", [0, 2], ids=["inline", "2-process"])
def test_a_full_disk_through_the_loader_is_the_same_error(
    small_disk: Path, http_server: HttpServer, workers: int
) -> None:
    """The loader's error is the cache's, with the folder and the hint, whether the fill ran
    in the loop's process or in a worker process."""
    directory, url = http_server.new_dir()
    np.save(directory / "big.npy", np.arange(N, dtype=np.uint16))
    manifest = build_manifest(url)
    data = TokenWindows(manifest, 64, storage=Storage(cache_dir=small_disk / "c"))
    loader = DataLoader(data, global_batch_size=8, micro_batch_size=8, seed=1, num_workers=workers)
    with pytest.raises(StorageError, match=r"No space left on device.*hint: free space"):
        next(iter(loader))
    assert loader.samples_consumed == 0


def test_a_folder_the_cache_makes_is_private_under_any_umask(
    tmp_path: Path, shard: tuple[ShardEntry, fsspec.AbstractFileSystem, str, bytes]
) -> None:
    """A umask of 002 (user private groups) would make group-writable folders: the cache
    makes its own folder 0700 and its layout with the folder's permissions, so it stays
    private (quick checks); a team folder's layout is as writable as the team folder."""
    entry, fs, url, _ = shard
    old = os.umask(0o002)
    try:
        mine = ShardCache(tmp_path / "a" / "cache", 1 << 26)
        team = tmp_path / "team"
        team.mkdir()
        team.chmod(0o777)
        shared = ShardCache(team, 1 << 26)
    finally:
        os.umask(old)
    assert mine.shared is None
    assert all(
        (tmp_path / "a" / "cache" / sub).stat().st_mode & 0o077 == 0
        for sub in ("", "objects", "tmp", "locks")
    )
    assert shared.shared is not None
    assert all((team / sub).stat().st_mode & 0o777 == 0o777 for sub in ("objects", "tmp", "locks"))
    mine.path(entry, fs, url, url)
    forget_verified()
    again = ShardCache(tmp_path / "a" / "cache", 1 << 26)
    again.path(entry, fs, url, url)
    assert again.stats.digests == 1  # the quick check of a private folder, not a full hash


_SWAPPER = textwrap.dedent(
    """
    import os, sys, time
    target, real, forged, until = sys.argv[1], sys.argv[2], sys.argv[3], float(sys.argv[4])
    side = os.path.join(os.path.dirname(real), "swap.tmp")
    flip = False
    while time.time() < until:
        flip = not flip
        try:
            os.link(forged if flip else real, side)
            os.rename(side, target)
        except OSError:
            pass
    """
)


def test_a_copy_swapped_back_and_forth_is_never_read_unchecked(
    scratch: Path, shard: tuple[ShardEntry, fsspec.AbstractFileSystem, str, bytes]
) -> None:
    """Another process keeps swapping a shared folder's copy between the real bytes and a
    forgery (same size, same first and last MiB): the file that is stat-ed, hashed and
    confirmed at a reader's open is one file, so a reader that is told to go ahead always
    has the real bytes."""
    entry, fs, url, true = shard
    folder = scratch / "cache"
    first = ShardCache(folder, 1 << 26)
    os.chmod(folder, 0o777)
    target = Path(first.path(entry, fs, url, url))
    side = scratch / "side"
    side.mkdir()
    real, fake = side / "real", side / "forged"
    os.link(target, real)
    fake.write_bytes(forged(true))
    (side / "swapper.py").write_text(_SWAPPER)
    until = str(time.time() + 20)
    swapper = subprocess.Popen(
        [sys.executable, str(side / "swapper.py"), str(target), str(real), str(fake), until]
    )
    confirmed = 0
    try:
        for _ in range(150):
            forget_verified()  # each a first use, as in a new process
            cache = ShardCache(folder, 1 << 26)
            try:
                path = cache.path(entry, fs, url, url)
                with open(path, "rb") as fh:
                    inode, data = os.fstat(fh.fileno()).st_ino, fh.read()
            except (FileNotFoundError, StorageError):
                continue  # swapped away mid-way: asked again, as a reader does
            if cache.confirm_open(path, inode):
                confirmed += 1
                assert data == true
    finally:
        swapper.kill()
        swapper.wait()
    assert confirmed > 0


def test_a_stopped_fill_is_not_waited_for_without_end(
    http_server: HttpServer, tmp_path: Path
) -> None:
    """A process stopped in the middle of a fill (Ctrl-Z, a debugger) holds the shard's
    lock: another process waits while the fill progresses, then gives up with a
    `StorageError` naming the lock, instead of waiting forever."""
    directory, url = http_server.new_dir()
    np.save(directory / "big.npy", np.arange(N, dtype=np.uint16))
    manifest = build_manifest(url)
    entry = manifest.shards[0]
    (tmp_path / "child.py").write_text(_CHILD)
    (tmp_path / "manifest.json").write_text(json.dumps(Manifest.to_json(manifest)))
    cache_dir = tmp_path / "cache"
    with FaultProxy(http_server.port) as proxy:
        proxy.set_plan(schedule(rate_bps=400_000))  # an ~8 s fill
        slow = f"{url}/big.npy".replace(f"127.0.0.1:{http_server.port}", proxy.address)
        args = [str(tmp_path / "child.py"), str(tmp_path / "manifest.json"), str(cache_dir)]
        child = subprocess.Popen(
            [sys.executable, *args, slow],
            stderr=subprocess.PIPE,
            text=True,
            cwd=Path(__file__).resolve().parents[2],
        )
        try:
            _wait_for(lambda: list((cache_dir / "tmp").glob("*.part")), child)
            time.sleep(0.5)
            os.kill(child.pid, signal.SIGSTOP)  # stopped mid-fill, holding the lock
            cache = ShardCache(cache_dir, 1 << 26, retry=RetryPolicy(deadline_s=3))
            began = time.monotonic()
            with pytest.raises(StorageError, match=r"lock .*locks/.*\.lock stayed held"):
                cache.path(entry, fsspec.filesystem("http"), slow, slow)
            assert time.monotonic() - began < 30
        finally:
            os.kill(child.pid, signal.SIGKILL)
            child.wait()


@pytest.mark.parametrize("sub", ["locks", "tmp"])
def test_a_layout_folder_relinked_after_the_cache_opened_receives_nothing(
    co_user: str,
    scratch: Path,
    shard: tuple[ShardEntry, fsspec.AbstractFileSystem, str, bytes],
    sub: str,
) -> None:
    """A co-user who owns the layout replaces one of its folders by a link to a folder they
    chose once the job's cache is open: the fill is refused naming it, and nothing (no lock
    file, no temp file with the shard's bytes) is made where the link points."""
    entry, fs, url, _ = shard
    cache = scratch / "cache"
    planted_layout(co_user, cache)
    chosen = scratch / "chosen"
    as_user(co_user, f"mkdir -m 777 {chosen}")
    job = ShardCache(cache, 1 << 26)
    as_user(co_user, f"rmdir {cache}/{sub} && ln -s {chosen} {cache}/{sub}")
    with pytest.raises(StorageError, match=rf"{sub} is no longer a folder"):
        job.path(entry, fs, url, url)
    assert list(chosen.iterdir()) == []
