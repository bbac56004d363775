"""Verification reads each checked byte once, and a verified object is not verified again.

References are independent of the code under test: bytes and requests are
counted outside it (a wrapper around ``os.pread``; the fault proxy's count of
HTTP request lines and bytes sent), expected digests are computed here with
blake3 directly, and a manifest saved by detdata *before* these changes
(tests/identity/data/pre18-manifest.json, generated once) must load, verify and
keep its id.

Covers: detdata/identity/verify.py.
"""

from __future__ import annotations

import json
import os
import shutil
import struct
from pathlib import Path
from typing import Any

import blake3
import numpy as np
import pytest

import detdata.identity.receipts as verifier  # where verification is called from
from detdata import Storage
from detdata.base.errors import VerificationError
from detdata.datasets.tokens import TokenWindows
from detdata.identity.build import build_manifest
from detdata.identity.entry import Verify
from detdata.identity.manifest import Manifest
from detdata.identity.registry import Registry
from detdata.storage.retry import RetryPolicy
from tests.servers import HttpServer

MiB = 1 << 20
DATA = Path(__file__).parent / "data"
PATIENT = RetryPolicy(deadline_s=20.0, attempt_timeout_s=5.0, base_delay_s=0.01, max_delay_s=0.1)


def quick_by_hand(data: bytes) -> str:
    """quick-v1 written out from its definition (docs/design.md section 1)."""
    span = min(len(data), MiB)
    h = blake3.blake3(b"detdata:quick-v1" + struct.pack("<Q", len(data)))
    h.update(data[:span])
    h.update(data[len(data) - span :])
    return "b3:" + h.hexdigest()


def write_corpus(root: Path) -> dict[str, int]:
    """Small shards (<= 2 MiB, one of them between 1 and 2 MiB) and one large (3 MiB+)."""
    root.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(5)
    sizes = {"a.npy": 1000, "b.npy": 700_000, "c.npy": 30, "d-large.npy": 1_600_000}
    for name, n in sizes.items():
        np.save(root / name, rng.integers(0, 65_000, n).astype(np.uint16))
    return {name: (root / name).stat().st_size for name in sizes}


@pytest.fixture
def corpus(tmp_path: Path) -> tuple[Path, Manifest, dict[str, int]]:
    sizes = write_corpus(tmp_path / "data")
    return tmp_path / "data", build_manifest(str(tmp_path / "data")), sizes


class PreadCounter:
    def __init__(self) -> None:
        self.calls = 0
        self.bytes = 0
        self.real = os.pread

    def __call__(self, fd: int, n: int, offset: int) -> bytes:
        out = self.real(fd, n, offset)
        self.calls += 1
        self.bytes += len(out)
        return out


# ----------------------------------------------------------------- read once
def test_local_quick_check_reads_each_small_shard_once(
    corpus: tuple[Path, Manifest, dict[str, int]], monkeypatch: pytest.MonkeyPatch
) -> None:
    root, manifest, sizes = corpus
    assert 2 * MiB < sizes["d-large.npy"] and MiB < sizes["b.npy"] <= 2 * MiB
    counter = PreadCounter()
    monkeypatch.setattr(os, "pread", counter)
    manifest.with_root(str(root)).verify("quick")
    small = sum(v for k, v in sizes.items() if k != "d-large.npy")
    assert counter.bytes == small + 2 * MiB  # every small byte once; head + tail of the large
    assert counter.calls == 3 + 2
    counter.bytes = counter.calls = 0
    manifest.with_root(str(root)).verify("full")
    assert counter.bytes == small + 2 * MiB + sizes["d-large.npy"]  # + the large one, streamed


def test_small_shard_checks_still_name_field_expected_and_found(
    corpus: tuple[Path, Manifest, dict[str, int]],
) -> None:
    root, manifest, _ = corpus
    victim = root / "b.npy"  # between 1 and 2 MiB: its first and last MiB overlap
    original = victim.read_bytes()
    middle = len(original) // 2
    assert len(original) - MiB < middle < MiB
    flipped = original[:middle] + bytes([original[middle] ^ 1]) + original[middle + 1 :]
    victim.write_bytes(flipped)
    entry = next(s for s in manifest.shards if s.path == "b.npy")
    with pytest.raises(VerificationError, match=r"b\.npy .*quick digest mismatch") as info:
        manifest.with_root(str(root)).verify("quick")
    assert (info.value.field, info.value.expected) == ("quick", entry.quick)
    assert info.value.found == quick_by_hand(flipped)
    victim.write_bytes(original + b"x")
    with pytest.raises(VerificationError, match="size mismatch") as grown:
        manifest.with_root(str(root)).verify("quick")
    assert (grown.value.field, grown.value.found) == ("bytes", len(original) + 1)
    victim.unlink()
    with pytest.raises(VerificationError, match="missing") as gone:
        manifest.with_root(str(root)).verify("quick")
    assert gone.value.field == "exists" and gone.value.shard == "b.npy"


def test_large_shard_quick_sees_the_windows_and_full_sees_the_middle(
    corpus: tuple[Path, Manifest, dict[str, int]],
) -> None:
    root, manifest, sizes = corpus
    victim = root / "d-large.npy"
    original = victim.read_bytes()
    middle = sizes["d-large.npy"] // 2
    assert MiB < middle < sizes["d-large.npy"] - MiB
    flipped = original[:middle] + bytes([original[middle] ^ 1]) + original[middle + 1 :]
    victim.write_bytes(flipped)
    manifest.with_root(str(root)).verify("quick")  # quick-v1 does not read the middle
    with pytest.raises(VerificationError, match="blake3 mismatch") as info:
        manifest.with_root(str(root)).verify("full")
    assert info.value.found == "b3:" + blake3.blake3(flipped).hexdigest()
    tail_flip = original[:-5] + bytes([original[-5] ^ 1]) + original[-4:]
    victim.write_bytes(tail_flip)
    with pytest.raises(VerificationError, match="quick digest mismatch") as tail:
        manifest.with_root(str(root)).verify("quick")
    assert tail.value.found == quick_by_hand(tail_flip)


# -------------------------------------------------------- verified only once
def test_a_verified_object_is_not_verified_again(
    corpus: tuple[Path, Manifest, dict[str, int]], monkeypatch: pytest.MonkeyPatch
) -> None:
    root, manifest, _ = corpus
    calls: list[str] = []
    real = verifier.verify_manifest

    def spy(m: Manifest, mode: Any, *args: Any, **kw: Any) -> Any:
        calls.append(str(Verify(mode).value))
        return real(m, mode, *args, **kw)

    monkeypatch.setattr(verifier, "verify_manifest", spy)
    reg = Registry(str(root.parent / "reg"))
    reg.register("ds@v1", manifest)
    resolved = reg.resolve("ds@v1")
    assert calls == ["quick"] and resolved.verified_level is Verify.QUICK
    TokenWindows(resolved, 16)  # the dataset does not verify the same object again
    TokenWindows(resolved, 16, storage=Storage(verify="quick"))
    assert calls == ["quick"]
    TokenWindows(
        resolved, 16, storage=Storage(verify="full")
    )  # stronger: checked once more, then recorded
    TokenWindows(resolved, 16, storage=Storage(verify="quick"))
    assert calls == ["quick", "full"] and resolved.verified_level is Verify.FULL
    moved = resolved.with_root(str(root))  # same root, new object: starts unverified
    assert moved.verified_level is None
    TokenWindows(moved, 16)
    assert calls == ["quick", "full", "quick"]
    (root / "c.npy").unlink()  # the record says what was checked, and when asked again...
    resolved.verify("quick")
    with pytest.raises(VerificationError, match=r"c\.npy .*missing"):
        resolved.verify("quick", again=True)
    with pytest.raises(VerificationError, match=r"c\.npy .*missing"):
        TokenWindows(moved.with_root(str(root)), 16)


def test_pickled_verified_manifest_stays_verified(
    corpus: tuple[Path, Manifest, dict[str, int]],
) -> None:
    import pickle

    root, manifest, _ = corpus
    m = manifest.with_root(str(root))
    m.verify("full")
    copy = pickle.loads(pickle.dumps(m))
    assert copy.verified_level is Verify.FULL and copy.id == m.id and copy == m


# ------------------------------------------------------- remote: requests/bytes
def test_remote_quick_check_is_one_request_per_small_shard(
    corpus: tuple[Path, Manifest, dict[str, int]],
    http_server: HttpServer,
    fault_proxy: Any,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # the read path alone: a receipt adds one HEAD per HTTP shard (its ETag and
    # Last-Modified, tests/identity/test_receipts.py)
    monkeypatch.setenv("DETDATA_RECEIPTS", "off")
    root, manifest, sizes = corpus
    directory, url = http_server.new_dir()
    shutil.copytree(root, directory, dirs_exist_ok=True)
    proxy = fault_proxy(http_server.port)
    remote_root = url.replace(f"127.0.0.1:{http_server.port}", proxy.address)
    reg = Registry(str(root.parent / "reg"))
    reg.register("ds@v1", manifest.with_root(remote_root))
    proxy.set_plan(proxy.plan)  # zero the counters
    resolved = reg.resolve("ds@v1", storage_options={"skip_instance_cache": True})
    stats = proxy.stats
    assert stats.requests == 3 + 2  # one range per small shard, head and tail of the large
    small = sum(v for k, v in sizes.items() if k != "d-large.npy")
    payload = small + 2 * MiB
    assert payload <= stats.bytes_down <= payload + 5 * 1024  # + headers of 5 answers
    proxy.set_plan(proxy.plan)
    TokenWindows(resolved, 16, storage=Storage(retry=PATIENT))
    assert proxy.stats.requests <= len(manifest.shards)  # no verification; headers at most

    # a shard grown by one byte, one shrunk, one gone: found exactly, named
    (directory / "a.npy").write_bytes((root / "a.npy").read_bytes() + b"z")
    (directory / "c.npy").write_bytes((root / "c.npy").read_bytes()[:-3])
    with pytest.raises(VerificationError, match=r"a\.npy .*size mismatch") as grown:
        manifest.with_root(remote_root).verify("quick", retry=PATIENT)
    assert grown.value.found == sizes["a.npy"] + 1
    (directory / "a.npy").write_bytes((root / "a.npy").read_bytes())
    with pytest.raises(VerificationError, match=r"c\.npy .*size mismatch") as shrunk:
        manifest.with_root(remote_root).verify("quick", retry=PATIENT)
    assert shrunk.value.found == sizes["c.npy"] - 3
    (directory / "c.npy").unlink()
    with pytest.raises(VerificationError, match=r"c\.npy .*missing"):
        manifest.with_root(remote_root).verify("quick", retry=PATIENT)
    shutil.copy(root / "c.npy", directory / "c.npy")
    large = (root / "d-large.npy").read_bytes()
    middle = len(large) // 2
    (directory / "d-large.npy").write_bytes(large[:middle] + b"\x00\x00" + large[middle + 2 :])
    manifest.with_root(remote_root).verify("quick", retry=PATIENT)
    with pytest.raises(VerificationError, match=r"d-large\.npy .*blake3 mismatch"):
        manifest.with_root(remote_root).verify("full", retry=PATIENT)


# ------------------------------------------------ manifests from before issue 18
def make_pre18_shards(root: Path) -> None:
    """The shards tests/identity/data/pre18-manifest.json was built from (same code)."""
    root.mkdir(parents=True, exist_ok=True)
    a = ((np.arange(5000, dtype=np.int64) * 7) % 65521).astype(np.uint16)
    b = ((np.arange(700_000, dtype=np.int64) * 13) % 65521).astype(np.uint16)
    c = ((np.arange(1_300_000, dtype=np.int64) * 31) % 1000003).astype(np.uint32)
    np.save(root / "a-small.npy", a)
    np.save(root / "b-mid.npy", b)
    np.save(root / "c-large.npy", c)
    ((np.arange(3000, dtype=np.int64) * 5) % 60000).astype("<u2").tofile(root / "d.bin")


def test_manifest_saved_before_issue_18_loads_verifies_and_keeps_its_id(tmp_path: Path) -> None:
    make_pre18_shards(tmp_path)
    saved = DATA / "pre18-manifest.json"
    doc = json.loads(saved.read_text())
    for mode in ("quick", "full"):
        old = Manifest.load(str(saved), root=str(tmp_path), verify=mode)
        assert old.id == doc["id"]
    npy = build_manifest(
        str(tmp_path), pattern="*.npy", metadata={"note": "made by detdata before issue 18"}
    )
    raw = build_manifest(str(tmp_path), paths=["d.bin"], format="bin", dtype="uint16")
    rebuilt = Manifest(shards=npy.shards + raw.shards, metadata=npy.metadata)
    assert rebuilt.id == doc["id"]  # the builder still writes the same entries
    assert [s.to_json() for s in rebuilt.shards] == doc["shards"]
