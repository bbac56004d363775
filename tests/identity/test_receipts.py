"""Verification receipts (docs/design.md section 8): a restart over unchanged shards reads (almost)
nothing, and a shard changed between two starts (same size new bytes, replaced, truncated)
is still caught at the next start, naming it: local files, S3 and HTTP.

Bytes read are measured outside the code under test: for local files by the kernel
(``rchar`` of ``/proc/self/io``: bytes read through ``read``-family system calls), for
the servers by a TCP proxy in front of them (`tests.faultproxy`: bytes sent to the
client).

Covers: detdata/identity/shared.py (the ``stat`` identities a local receipt records).
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import blake3
import numpy as np
import pytest

from detdata import Manifest, VerificationError, build_manifest
from detdata.base.canonical import canonical_json
from detdata.identity import receipts
from tests import servers
from tests.faultproxy import FaultProxy

SHARDS = 40
TOKENS = 50_000  # 100 KB a shard, 4 MB a corpus: 1% is 40 KB


def _rchar() -> int:
    with open("/proc/self/io") as fh:
        for line in fh:
            if line.startswith("rchar:"):
                return int(line.split()[1])
    raise AssertionError("no rchar in /proc/self/io")


def _shard_bytes(i: int, salt: int = 0) -> np.ndarray[Any, Any]:
    rng = np.random.default_rng(1000 * salt + i)
    return rng.integers(0, 60_000, TOKENS).astype(np.uint16)


def _write_local(root: Path) -> None:
    root.mkdir(parents=True, exist_ok=True)
    for i in range(SHARDS):
        np.save(root / f"s{i:03d}.npy", _shard_bytes(i))


def _age(root: Path) -> None:
    """Wait out the receipt's racy window (a file changed under `RACY_S` ago is read again)."""
    time.sleep(receipts.RACY_S + 0.2)


def _load_counting(path: str, **options: Any) -> int:
    """Bytes read (kernel count) by one quick-verified load of the manifest at ``path``."""
    before = _rchar()
    Manifest.load(path, **options)
    return _rchar() - before


def _change(kind: str, path: Path) -> None:
    """Change one local shard file: the same size with new bytes (in place), replaced by
    another file (rename over it), or truncated."""
    data = path.read_bytes()
    if kind == "rewrite":
        with open(path, "r+b") as fh:
            fh.seek(len(data) - 4)
            fh.write(bytes(b ^ 0xFF for b in data[-4:]))
    elif kind == "replace":
        other = path.with_suffix(".new")
        other.write_bytes(data[:-4] + bytes(b ^ 0xFF for b in data[-4:]))
        os.replace(other, path)
    else:
        with open(path, "r+b") as fh:
            fh.truncate(len(data) - 2)


@pytest.mark.parametrize("kind", ["rewrite", "replace", "truncate"])
def test_local_restart_reads_nothing_and_catches_a_changed_shard(tmp_path: Path, kind: str) -> None:
    root = tmp_path / "data"
    _write_local(root)
    manifest = build_manifest(str(root))
    path = str(root / "manifest.json")
    manifest.save(path)
    corpus = manifest.total_bytes
    _age(root)

    first = _load_counting(path)
    assert first >= corpus  # the first start reads every checked byte (shards <= 2 MiB)
    again = _load_counting(path)
    assert again <= corpus // 100, f"restart read {again} bytes of a {corpus}-byte corpus"

    victim = root / "s017.npy"
    _change(kind, victim)  # right after the receipt was written: no waiting
    with pytest.raises(VerificationError) as info:
        Manifest.load(path)
    assert info.value.shard == "s017.npy"
    assert info.value.field == ("bytes" if kind == "truncate" else "quick")
    # and again at the start after that (a failed verification writes no receipt)
    with pytest.raises(VerificationError, match=r"s017\.npy"):
        Manifest.load(path)


def _forge(receipt: Path, root: Path, names: list[str]) -> None:
    """What someone who can write the receipts folder but not read this user's key does
    after changing a shard: rewrite the receipt's body with the shards' identities now,
    and make its head consistent again (a digest of the new body, or a tag under a key of
    their own)."""
    head_raw, _, _ = receipt.read_bytes().partition(b"\n")
    head = json.loads(head_raw)
    body = receipts.identity_digests(receipts.local_identities(str(root), names))
    raw = body.astype("<u8").tobytes()
    if "digest" in head:
        head["digest"] = blake3.blake3(raw).hexdigest()
    if "tag" in head:
        head.pop("tag")
        signed = canonical_json(head) + b"\n" + raw
        head["tag"] = blake3.blake3(signed, key=os.urandom(32)).hexdigest()
    receipt.write_bytes(canonical_json(head) + b"\n" + raw)


def test_a_forged_receipt_is_not_trusted(tmp_path: Path) -> None:
    """A shard changed in place and the receipt rewritten to record its new identity, by
    someone who cannot read this user's key: the receipt is not trusted, the shard is read
    and named."""
    root = tmp_path / "data"
    _write_local(root)
    manifest = build_manifest(str(root))
    path = str(root / "manifest.json")
    manifest.save(path)
    _age(root)
    assert _load_counting(path) >= manifest.total_bytes  # verified, receipt written
    (receipt,) = Path(os.environ[receipts.ENV_DIR]).glob("*.receipt")
    _change("rewrite", root / "s017.npy")
    _age(root)  # settled: its identity would be recorded
    _forge(receipt, root, [s.path for s in manifest.shards])
    with pytest.raises(VerificationError) as info:
        Manifest.load(path)
    assert info.value.shard == "s017.npy" and info.value.field == "quick"


@pytest.mark.slow
def test_many_small_shards_are_read_once_at_a_first_start_and_a_restart_reads_under_1pct(
    tmp_path: Path,
) -> None:
    """The issue's hard case: 2 KiB shards, where what is read besides the shards (the
    fast form's columns and paths, the JSON, the receipt) weighs most. A first start reads
    the corpus once, the columns once and the JSON once (its tie to the columns: ~400
    bytes a shard, here 1.2x the checked bytes in all); a restart over unchanged files
    reads under 1% of them (every path, to take its identity, and the receipt); a shard
    rewritten in place is still caught after."""
    root = tmp_path / "data"
    count = 30_000
    for i in range(count):
        folder = root / f"{i // 1000:03d}"
        if i % 1000 == 0:
            folder.mkdir(parents=True)
        np.save(folder / f"s{i:06d}.npy", np.full(960, i % 60_000, dtype=np.uint16))
    manifest = build_manifest(str(root))
    path = str(root / "manifest.json")
    manifest.save(path)
    corpus = manifest.total_bytes
    assert corpus == count * 2048
    _load_counting(path, verify="off")  # imports (their files are read bytes too)
    _age(root)

    first = _load_counting(path)
    once = corpus + os.path.getsize(path) + os.path.getsize(path + ".columns")
    assert corpus <= first <= once * 1.02, f"first start read {first / once:.4f}x each once"
    again = _load_counting(path)
    assert again <= corpus // 100, f"restart read {again / corpus:.4%} of the corpus"
    _change("rewrite", root / "017" / "s017345.npy")
    with pytest.raises(VerificationError) as info:
        Manifest.load(path)
    assert info.value.shard == "017/s017345.npy"


def test_receipt_is_per_level_and_again_reads_everything(tmp_path: Path) -> None:
    root = tmp_path / "data"
    _write_local(root)
    path = str(root / "manifest.json")
    manifest = build_manifest(str(root))
    manifest.save(path)
    corpus = manifest.total_bytes
    _age(root)
    assert _load_counting(path) >= corpus
    assert _load_counting(path, verify="full") >= corpus  # quick does not stand for full
    assert _load_counting(path) <= corpus // 100  # full stands for quick
    before = _rchar()
    Manifest.load(path, verify="off").verify("quick", again=True)
    assert _rchar() - before >= corpus


def test_disabled_receipts_read_everything(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(receipts.ENV_DIR, "off")
    root = tmp_path / "data"
    _write_local(root)
    path = str(root / "manifest.json")
    manifest = build_manifest(str(root))
    manifest.save(path)
    _age(root)
    assert _load_counting(path) >= manifest.total_bytes
    assert _load_counting(path) >= manifest.total_bytes


def test_a_recent_change_is_not_recorded(tmp_path: Path) -> None:
    """Shards changed under `RACY_S` before a verification are read again at the next one
    (a same-size rewrite within the clock's granularity could keep their identity)."""
    root = tmp_path / "data"
    _write_local(root)
    path = str(root / "manifest.json")
    manifest = build_manifest(str(root))
    manifest.save(path)
    assert _load_counting(path) >= manifest.total_bytes
    assert _load_counting(path) >= manifest.total_bytes  # nothing was old enough to record


# ------------------------------------------------------------------------ remote
def _remote_cycle(
    manifest_path: str,
    corpus: int,
    change: Callable[[], None],
    victim: str,
    field: str,
    options: dict[str, Any],
    proxy: FaultProxy,
) -> None:
    before = proxy.stats.bytes_down
    Manifest.load(manifest_path, **options)
    assert proxy.stats.bytes_down - before >= corpus
    before = proxy.stats.bytes_down
    Manifest.load(manifest_path, **options)
    again = proxy.stats.bytes_down - before
    assert again <= corpus // 100, f"restart fetched {again} bytes of a {corpus}-byte corpus"
    change()
    with pytest.raises(VerificationError) as info:
        Manifest.load(manifest_path, **options)
    assert info.value.shard == victim
    assert info.value.field == field


@pytest.mark.parametrize("kind", ["rewrite", "replace", "truncate"])
def test_s3_restart_reads_nothing_and_catches_a_changed_shard(
    tmp_path: Path,
    s3_server: servers.S3Server,
    fault_proxy: Callable[[int], FaultProxy],
    kind: str,
) -> None:
    import s3fs

    proxy = fault_proxy(s3_server.port)
    fs = s3fs.S3FileSystem(**s3_server.storage_options())
    options = s3_server.storage_options(f"http://{proxy.address}")
    prefix = s3_server.url(f"receipts-{kind}-{os.getpid()}-{time.time_ns()}")
    local = tmp_path / "src"
    _write_local(local)
    for i in range(SHARDS):
        fs.pipe(f"{prefix}/s{i:03d}.npy", (local / f"s{i:03d}.npy").read_bytes())
    manifest = build_manifest(prefix, **options)
    path = str(tmp_path / "manifest.json")
    manifest.save(path)
    victim = f"{prefix}/s017.npy"
    data = (local / "s017.npy").read_bytes()

    def change() -> None:
        if kind == "truncate":
            fs.pipe(victim, data[:-2])
        else:  # an object store has no in-place write: a new object at the key
            if kind == "replace":
                fs.rm(victim)
            fs.pipe(victim, data[:-4] + bytes(b ^ 0xFF for b in data[-4:]))
        fs.invalidate_cache()

    field = "bytes" if kind == "truncate" else "quick"
    _remote_cycle(path, manifest.total_bytes, change, "s017.npy", field, dict(options), proxy)


@pytest.mark.parametrize("kind", ["rewrite", "replace", "truncate"])
def test_http_restart_reads_nothing_and_catches_a_changed_shard(
    tmp_path: Path,
    http_server: servers.HttpServer,
    fault_proxy: Callable[[int], FaultProxy],
    kind: str,
) -> None:
    proxy = fault_proxy(http_server.port)
    folder, _ = http_server.new_dir()
    url = f"http://{proxy.address}/{folder.name}"
    _write_local(folder)
    old = time.time() - 60  # nginx's ETag / Last-Modified: the file's mtime, in seconds
    for p in folder.iterdir():
        os.utime(p, (old, old))
    manifest = build_manifest(url, paths=[f"s{i:03d}.npy" for i in range(SHARDS)])
    path = str(tmp_path / "manifest.json")
    manifest.save(path)
    victim = folder / "s017.npy"

    def change() -> None:
        _change(kind, victim)

    field = "bytes" if kind == "truncate" else "quick"
    _remote_cycle(path, manifest.total_bytes, change, "s017.npy", field, {}, proxy)
