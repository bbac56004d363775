"""`TokenWindows`' window index (detdata.datasets.window_index, DESIGN.md 8): stored once,
mapped by every later open, checked in full by each; a damaged, truncated or stale file is
named and rebuilt, never trusted; a rank that maps it touches no manifest column at open.

References are independent of the code under test: windows cut from the ``.npy`` files'
own tokens (brute force), and the file's own bytes.
"""

from __future__ import annotations

import json
import os
import pickle
import re
import shutil
import stat
import time
from pathlib import Path

import blake3
import numpy as np
import pytest

from detdata import FormatError, Manifest, Storage, TokenWindows, build_manifest
from detdata.datasets import window_index
from detdata.identity import local_key
from detdata.identity.columns import CHUNK, ShardTable
from detdata.identity.receipts import RACY_S

SEQ = 16


@pytest.fixture(autouse=True)
def _stored_from_one_shard(monkeypatch: pytest.MonkeyPatch) -> None:
    """Small corpora here: the index is stored whatever the shard count (a real corpus
    stores it from `window_index.STORE_MIN_SHARDS` shards on)."""
    monkeypatch.setattr(window_index, "STORE_MIN_SHARDS", 1)


def _corpus(root: Path, shards: int = 40) -> Path:
    root.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(41)
    for i in range(shards):
        dtype = np.uint16 if i % 4 else np.int32
        np.save(root / f"p{i:03d}.npy", rng.integers(0, 50_000, 20 + 29 * (i % 9)).astype(dtype))
    path = root / "manifest.json"
    build_manifest(str(root), threads=2).save(str(path))
    return path


def _brute(root: Path, seq: int = SEQ) -> np.ndarray:
    """Every window (seq + 1 tokens) of every shard in path order, from the files (int32)."""
    rows = []
    for file in sorted(root.glob("*.npy")):
        tokens = np.load(file)
        rows += [tokens[w * seq : w * seq + seq + 1] for w in range((tokens.size - 1) // seq)]
    return np.stack(rows).astype(np.int32)


def _stored(receipts: Path) -> Path:
    (found,) = receipts.glob("*.windows")
    return found


def _receipts(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Path:
    folder = tmp_path / "receipts"
    monkeypatch.setenv("DETDATA_RECEIPTS", str(folder))
    return folder


def test_the_index_is_stored_once_and_mapped_by_later_opens(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    receipts = _receipts(monkeypatch, tmp_path)
    path = _corpus(tmp_path / "d")
    want = _brute(tmp_path / "d")
    first = TokenWindows(str(path), SEQ)
    stored = _stored(receipts)
    assert first._index.path == str(stored)
    before = stored.stat().st_mtime_ns
    calls: list[int] = []
    build = window_index.build_window_index
    monkeypatch.setattr(
        window_index, "build_window_index", lambda *a, **k: calls.append(1) or build(*a, **k)
    )
    again = TokenWindows(str(path), SEQ)
    assert calls == [] and again._index.path == str(stored)  # mapped, not built
    assert stored.stat().st_mtime_ns == before
    for ds in (first, again, pickle.loads(pickle.dumps(again))):
        assert ds.num_samples == len(want)
        assert np.array_equal(ds.read(np.arange(ds.num_samples))["tokens"], want)
    # other options are another index (another file)
    other = TokenWindows(str(path), 8)
    assert other._index.path != str(stored) and len(list(receipts.glob("*.windows"))) == 2
    got = other.read(np.arange(other.num_samples))["tokens"]
    assert np.array_equal(got, _brute(path.parent, 8))


def _damage(stored: Path, how: str, receipts: Path, path: Path) -> None:
    raw = bytearray(stored.read_bytes())
    if how == "flipped":
        raw[len(raw) // 2] ^= 0x10  # inside the sections
        stored.write_bytes(bytes(raw))
    elif how == "truncated":
        stored.write_bytes(bytes(raw[: len(raw) - 100]))
    elif how == "stale":  # a valid file of other inputs (seq_len 8) under this one's name
        TokenWindows(str(path), 8)
        (other,) = [p for p in receipts.glob("*.windows") if p != stored]
        shutil.copy(other, stored)
    elif how == "header":
        at = raw.index(b'"windows":') + len(b'"windows":')
        raw[at] = ord("9") if raw[at] != ord("9") else ord("8")  # a count edited
        stored.write_bytes(bytes(raw))


@pytest.mark.parametrize("how", ["flipped", "truncated", "stale", "header"])
def test_a_damaged_or_stale_index_is_named_and_rebuilt(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, how: str
) -> None:
    receipts = _receipts(monkeypatch, tmp_path)
    path = _corpus(tmp_path / "d")
    want = _brute(tmp_path / "d")
    TokenWindows(str(path), SEQ)
    stored = _stored(receipts)
    good = stored.read_bytes()
    _damage(stored, how, receipts, path)
    assert stored.read_bytes() != good
    named = rf"token windows index {re.escape(str(stored))} does not match .*rebuilding it"
    with pytest.warns(RuntimeWarning, match=named):
        ds = TokenWindows(str(path), SEQ)
    assert stored.read_bytes() == good  # rebuilt: the file a fresh build writes
    assert ds.num_samples == len(want)
    assert np.array_equal(ds.read(np.arange(ds.num_samples))["tokens"], want)


def test_the_index_checks_run_once_and_a_bad_manifest_is_still_refused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The open-time checks moved into the build: a shard too short is named, no file is
    written, and allow_short_shards is part of the index's inputs."""
    receipts = _receipts(monkeypatch, tmp_path)
    path = _corpus(tmp_path / "d")
    with pytest.raises(FormatError, match=r"shard p000.npy: 20 tokens is too short"):
        TokenWindows(str(path), 32)
    assert list(receipts.glob("*.windows")) == []
    ds = TokenWindows(str(path), 32, allow_short_shards=True)
    assert ds.windows_per_shard[0] == 0 and len(list(receipts.glob("*.windows"))) == 1
    assert np.array_equal(ds.read(np.arange(ds.num_samples))["tokens"], _brute(path.parent, 32))


def test_a_rank_that_maps_the_index_touches_no_manifest_column_at_open(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Many shards: with the index stored, opening touches (checks) no data chunk of the
    manifest's columns, and a read touches the path chunks of the shards it reads only."""
    _receipts(monkeypatch, tmp_path)
    root = tmp_path / "d"
    root.mkdir()
    tokens = np.arange(100, dtype=np.uint16)
    np.save(root / "x.npy", tokens)
    one = build_manifest(str(root)).shards[0]
    names = [f"s{i:06d}.npy" for i in range(30_000)]
    for name in names[:: 30_000 // 6]:
        shutil.copy(root / "x.npy", root / name)
    (root / "x.npy").unlink()
    entries = [type(one)(**{**one.__dict__, "path": name}) for name in names]
    path = root / "manifest.json"
    Manifest(shards=tuple(entries), root=str(root)).save(str(path))
    TokenWindows(str(path), SEQ, storage=Storage(verify="off"))  # builds and stores the index
    manifest = Manifest.load(str(path), verify="off")
    table = manifest.shards
    assert isinstance(table, ShardTable)
    ds = TokenWindows(manifest, SEQ, storage=Storage(verify="off"))
    assert ds._index.path is not None
    assert sum(table.columns._checked) == 0  # no column chunk hashed (or touched)
    assert table._cache == {}
    shard = 30_000 // 6 * 4
    per = (tokens.size - 1) // SEQ
    got = ds.read(np.arange(shard * per, shard * per + per))["tokens"]
    want = np.stack([tokens[w * SEQ : w * SEQ + SEQ + 1] for w in range(per)]).astype(np.int32)
    assert np.array_equal(got, want)
    total = -(-table.columns.header["data_bytes"] // CHUNK)
    assert 0 < sum(table.columns._checked) <= 3 < total  # its path's chunks only (<= 3)
    assert table._cache == {}  # and no entry built


def test_a_rank_maps_neither_the_index_nor_the_manifest_columns(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The index and the manifest's columns are read with ``pread``: a rank that opens the
    dataset and reads windows of shards all over the corpus has neither file mapped, so no
    page of either counts in its resident set (a fault on a mapping maps a whole large
    folio: ~2 MiB a lookup at 1M shards). The windows equal a brute-force cut."""
    receipts = _receipts(monkeypatch, tmp_path)
    path = _corpus(tmp_path / "d", shards=60)
    want = _brute(tmp_path / "d")
    TokenWindows(str(path), SEQ)  # builds and stores the index
    ds = TokenWindows(str(path), SEQ)
    ids = np.random.default_rng(3).permutation(ds.num_samples)
    for part in np.array_split(ids, 7):
        assert np.array_equal(ds.read(part)["tokens"], want[part])
    shard, local = ds.locate(ids)
    bounds = np.concatenate(
        (
            [0],
            np.cumsum(
                [(np.load(f).size - 1) // SEQ for f in sorted((tmp_path / "d").glob("*.npy"))]
            ),
        )
    )
    assert np.array_equal(bounds[shard] + local, ids)
    maps = Path("/proc/self/maps").read_text()
    assert str(_stored(receipts)) not in maps
    assert str(path) + ".columns" not in maps


def _rchar() -> int:
    """Bytes this thread has read through system calls so far."""
    for line in Path("/proc/thread-self/io").read_text().splitlines():
        if line.startswith("rchar:"):
            return int(line.split()[1])
    raise AssertionError("no rchar")


def _many(root: Path, count: int = 30_000, real: int = 6) -> tuple[Path, np.ndarray, int]:
    """A manifest of ``count`` entries of one 100-token shard, ``real`` of them on disk
    (every ``count // real``-th; open with ``verify="off"``): ``(path, tokens, step)``."""
    root.mkdir(parents=True)
    tokens = np.arange(100, dtype=np.uint16)
    np.save(root / "x.npy", tokens)
    one = build_manifest(str(root)).shards[0]
    names = [f"s{i:06d}.npy" for i in range(count)]
    for name in names[:: count // real]:
        shutil.copy(root / "x.npy", root / name)
    (root / "x.npy").unlink()
    entries = [type(one)(**{**one.__dict__, "path": name}) for name in names]
    path = root / "manifest.json"
    Manifest(shards=tuple(entries), root=str(root)).save(str(path))
    return path, tokens, count // real


def _identity(path: Path) -> list[int]:
    st = path.stat()
    return [st.st_size, st.st_mtime_ns, st.st_ctime_ns, st.st_ino, st.st_dev]


def test_a_file_unchanged_since_its_full_check_is_not_read_again_and_a_changed_one_is(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The ``.checked`` note: the builder notes the file it wrote; an open whose file has
    the noted identity reads the header and the few blocks it uses, not the whole file; a
    file changed in place since (even with its mtime set back: the ctime moves) is checked
    in full again, named and rebuilt. A file another writer changed less than `RACY_S`
    before its full check is not noted (the note keeps the old identity) until a later
    full check finds it settled."""
    receipts = _receipts(monkeypatch, tmp_path)
    path, tokens, step = _many(tmp_path / "d")
    off = Storage(verify="off")
    TokenWindows(str(path), SEQ, storage=off)  # built and noted (its own write)
    stored = _stored(receipts)
    note = Path(str(stored) + window_index.CHECKED)
    st = stored.stat()
    assert json.loads(note.read_text())["identity"] == _identity(stored)
    manifest = Manifest.load(str(path), verify="off")
    per = (tokens.size - 1) // SEQ
    want = np.stack([tokens[w * SEQ : w * SEQ + SEQ + 1] for w in range(per)]).astype(np.int32)
    before = _rchar()
    ds = TokenWindows(manifest, SEQ, storage=off)
    shard = 3 * step
    got = ds.read(np.arange(shard * per, shard * per + per))["tokens"]
    read = _rchar() - before
    assert np.array_equal(got, want)
    # the index file is 780 KB; verify="off": the manifest's path chunks (2 x CHUNK) are
    # checked on use, as before
    assert read < 2 * CHUNK + st.st_size // 20, (read, st.st_size)
    # the same bytes written again in place just now: checked in full, not noted (racy)
    good = stored.read_bytes()
    stored.write_bytes(good)
    TokenWindows(str(path), SEQ, storage=off)
    assert json.loads(note.read_text())["identity"] != _identity(stored)
    time.sleep(RACY_S + 0.1)
    TokenWindows(str(path), SEQ, storage=off)  # settled now: checked in full, noted
    assert json.loads(note.read_text())["identity"] == _identity(stored)
    # a byte changed in place, the modification time set back: the change time moved
    st = stored.stat()
    raw = bytearray(good)
    raw[len(raw) // 2] ^= 0x01
    stored.write_bytes(bytes(raw))
    os.utime(stored, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert stored.stat().st_mtime_ns == st.st_mtime_ns
    with pytest.warns(RuntimeWarning, match=r"does not match .*rebuilding it"):
        again = TokenWindows(str(path), SEQ, storage=off)
    assert stored.read_bytes() == good
    assert np.array_equal(again.read(np.arange(shard * per, shard * per + per))["tokens"], want)


class _Store:
    """The part of torch.distributed's store the meeting uses, in memory."""

    def __init__(self, values: dict[str, bytes]) -> None:
        self.values = values

    def wait(self, keys: list[str], timeout: object) -> None:
        assert all(k in self.values for k in keys), keys

    def check(self, keys: list[str]) -> bool:
        return all(k in self.values for k in keys)

    def get(self, key: str) -> bytes:
        return self.values[key]

    def set(self, key: str, value: bytes) -> None:
        self.values[key] = value


def test_a_rank_trusts_its_leaders_identity_or_its_own_note_and_checks_anything_else(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Under a process group, a non-leader skips the digest of a file whose identity its
    leader published, or whose ``.checked`` note holds it (a leader on another host checked
    another file); a file with neither identity is checked in full."""
    receipts_dir = _receipts(monkeypatch, tmp_path)
    path, tokens, step = _many(tmp_path / "d")
    off = Storage(verify="off")
    TokenWindows(str(path), SEQ, storage=off)  # built and noted
    stored = _stored(receipts_dir)
    digests: list[int] = []
    real = window_index._digest
    monkeypatch.setattr(window_index, "_digest", lambda *a: digests.append(1) or real(*a))
    key = "k"
    done = {key + "/started": b"1", key + "/done": b"1"}
    per = (tokens.size - 1) // SEQ
    want = np.stack([tokens[w * SEQ : w * SEQ + SEQ + 1] for w in range(per)]).astype(np.int32)

    def rank(published: list[int] | None) -> TokenWindows:
        values = dict(done)
        if published is not None:
            values[key + "/checked"] = json.dumps(published).encode()
        meeting = (_Store(values), False, key)
        monkeypatch.setattr(window_index, "job_meeting", lambda *a, **k: meeting)
        ds = TokenWindows(str(path), SEQ, storage=off)
        got = ds.read(np.arange(3 * step * per, 3 * step * per + per))["tokens"]
        assert np.array_equal(got, want)
        return ds

    rank(_identity(stored))  # the leader's identity
    rank([1, 2, 3, 4, 5])  # a leader elsewhere: the note holds this file's identity
    assert digests == []
    Path(str(stored) + window_index.CHECKED).unlink()
    rank([1, 2, 3, 4, 5])  # neither: checked in full
    assert digests == [1]


def _sections(raw: bytes) -> tuple[int, dict[str, list[object]]]:
    """``(where the data starts, the header's sections)`` of an index file, read as its
    layout says (magic, u64 header length, header, padding to 64)."""
    hlen = int.from_bytes(raw[8:16], "little")
    header = json.loads(raw[16 : 16 + hlen])
    return 16 + hlen + (-(16 + hlen) % 64), header["sections"]


@pytest.mark.parametrize("forgery", ["stat-note", "tagged-note", "valid-digest"])
def test_an_index_edited_in_place_with_a_forged_note_or_digest_is_not_trusted(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, forgery: str
) -> None:
    """Someone who can write the receipts folder but not read this user's key edits the
    stored index in place (shard 1's token offset moved back by one token: its windows
    would start inside the .npy header) and then either writes a ``.checked`` note for the
    edited file's identity (as a bare ``stat`` identity, or tagged under a key of their
    own) or rewrites the file's trailing digest (blake3 of the edited bytes). None of them
    is trusted: the file is checked in full, named and rebuilt, and the windows are the
    ones a brute-force cut of the .npy files gives."""
    receipts = _receipts(monkeypatch, tmp_path)
    path = _corpus(tmp_path / "d")
    want = _brute(tmp_path / "d")
    TokenWindows(str(path), SEQ)  # built, stored and noted
    stored = _stored(receipts)
    good = stored.read_bytes()
    data_at, sections = _sections(good)
    at = data_at + int(str(sections["offsets"][0])) + 8 * 1  # shard 1 (uint16)
    offset = int.from_bytes(good[at : at + 8], "little", signed=True)
    edited = bytearray(good)
    edited[at : at + 8] = (offset - 2).to_bytes(8, "little", signed=True)
    if forgery == "valid-digest":
        edited[-32:] = blake3.blake3(bytes(edited[:-32])).digest()
    with open(stored, "r+b") as fh:  # in place: the same file
        fh.write(bytes(edited))
    note = Path(str(stored) + window_index.CHECKED)
    identity = _identity(stored)
    if forgery == "stat-note":
        note.write_text(json.dumps(identity))
    elif forgery == "tagged-note":
        tag = window_index.note_tag(str(stored), identity, os.urandom(32))
        note.write_text(json.dumps({"identity": identity, "tag": tag}))
    with pytest.warns(RuntimeWarning, match=rf"index {re.escape(str(stored))} does not match"):
        ds = TokenWindows(str(path), SEQ)
    assert np.array_equal(ds.read(np.arange(ds.num_samples))["tokens"], want)
    assert stored.read_bytes() == good  # rebuilt: what this user's build writes


def _plant(key: Path, how: str) -> None:
    if how == "readable-by-others":
        key.write_bytes(os.urandom(32))
        key.chmod(0o644)
    elif how == "another-users":
        key.write_bytes(os.urandom(32))
        key.chmod(0o600)
        os.chown(key, 65534, 65534)
    else:  # a link to a private 32-byte file: never followed
        target = key.parent / "elsewhere"
        target.write_bytes(os.urandom(32))
        target.chmod(0o600)
        key.symlink_to(target)


@pytest.mark.parametrize("how", ["readable-by-others", "another-users", "a-link"])
def test_a_key_file_others_could_know_is_never_used(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, how: str
) -> None:
    """This user's key (`detdata.identity.local_key`) is made private (0600, this user's);
    a key file others can read, another user's, or a link is named in a warning and not
    used: no index is stored or trusted, every open builds its own (the right windows)."""
    if how == "another-users" and os.geteuid() != 0:
        pytest.skip("giving a file to another user needs root")
    receipts = _receipts(monkeypatch, tmp_path)
    path = _corpus(tmp_path / "d")
    want = _brute(tmp_path / "d")
    receipts.mkdir()
    key = Path(local_key.key_path(str(receipts)))
    _plant(key, how)
    with pytest.warns(RuntimeWarning, match=rf"key file {re.escape(str(key))} .*not used"):
        ds = TokenWindows(str(path), SEQ)
    assert np.array_equal(ds.read(np.arange(ds.num_samples))["tokens"], want)
    assert list(receipts.glob("*.windows")) == []


def test_this_users_key_is_made_private_once(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    receipts = _receipts(monkeypatch, tmp_path)
    path = _corpus(tmp_path / "d")
    os.umask(old := os.umask(0))  # the most permissive umask: the key is private anyway
    try:
        TokenWindows(str(path), SEQ)
    finally:
        os.umask(old)
    key = Path(local_key.key_path(str(receipts)))
    st = key.lstat()
    assert stat.S_ISREG(st.st_mode) and stat.S_IMODE(st.st_mode) == 0o600
    assert st.st_uid == os.geteuid() and st.st_size == 32
    made = key.read_bytes()
    assert (
        _stored(receipts).read_bytes()[-32:]
        == blake3.blake3(_stored(receipts).read_bytes()[:-32], key=made).digest()
    )  # the index's digest is keyed under it
    TokenWindows(str(path), SEQ)
    assert key.read_bytes() == made
