"""HTTP statuses of a real nginx (tests/servers.py) reach the caller with their meaning.

401 / 403 (a presigned URL whose signature expired or was never given) are a
`StorageError` naming the redacted URL and the status, exit 3 from the CLI, raised at
once (a retry cannot renew a signature); 404 stays "missing" (`FileNotFoundError`
for a manifest, a verification failure naming the shard). nginx answers 403 for
``?sig=expired`` and 401 for ``?sig=missing`` (its config), 200 otherwise.
"""

from __future__ import annotations

import re
import subprocess
import time
from pathlib import Path

import numpy as np
import pytest

import detdata
from detdata.base.errors import ManifestError, StorageError, VerificationError
from detdata.storage.retry import RetryPolicy
from tests.cli.test_cli_manifest import console
from tests.servers import HttpServer

pytestmark = pytest.mark.multiproc

SECRET = "tok-s3cr3t-1d1d"
PATIENT = RetryPolicy(deadline_s=20.0, base_delay_s=0.5, max_delay_s=1.0)


@pytest.fixture(scope="module")
def site(http_server: HttpServer) -> tuple[Path, str]:
    directory, url = http_server.new_dir()
    rng = np.random.default_rng(4)
    for i in range(2):
        np.save(directory / f"shard-{i}.npy", rng.integers(0, 999, 300).astype(np.uint16))
    detdata.build_manifest(str(directory)).save(str(directory / "manifest.json"))
    return directory, url.replace("http://", f"http://bob:{SECRET}@")


STATUSES = [("expired", 403), ("missing", 401)]


@pytest.mark.parametrize(("sig", "status"), STATUSES)
def test_a_denied_manifest_is_a_storage_error_naming_url_and_status_at_once(
    site: tuple[Path, str], sig: str, status: int
) -> None:
    url = f"{site[1]}/manifest.json?sig={sig}&X-Amz-Signature=abc{SECRET}"
    start = time.monotonic()
    with pytest.raises(StorageError) as denied:
        detdata.Manifest.load(url, retry=PATIENT)
    assert time.monotonic() - start < 5.0  # not retried until the 20 s deadline
    text = str(denied.value)
    assert f"HTTP {status}" in text and "manifest.json" in text, text
    assert SECRET not in text and "http://***@127.0.0.1" in text, text
    assert not isinstance(denied.value, FileNotFoundError)


@pytest.mark.parametrize(("sig", "status"), STATUSES)
def test_a_denied_shard_is_a_storage_error_not_a_missing_shard(
    site: tuple[Path, str], sig: str, status: int
) -> None:
    directory, base = site
    manifest = detdata.Manifest.load(str(directory / "manifest.json"), verify="off")
    root = f"{base}?sig={sig}"
    start = time.monotonic()
    with pytest.raises(StorageError) as denied:
        detdata.Manifest.load(
            str(directory / "manifest.json"), root=root, verify="quick", retry=PATIENT
        )
    assert time.monotonic() - start < 5.0
    text = str(denied.value)
    assert f"HTTP {status}" in text and "shard-0" in text, text
    assert not isinstance(denied.value, VerificationError), text
    assert SECRET not in text
    windows = detdata.TokenWindows(
        manifest, 8, storage=detdata.Storage(root=root, verify="off", retry=PATIENT)
    )
    with pytest.raises(StorageError, match=f"HTTP {status}") as read:
        windows.read(np.array([0]))
    assert not isinstance(read.value, FileNotFoundError) and SECRET not in str(read.value)


def test_a_404_stays_missing(site: tuple[Path, str]) -> None:
    with pytest.raises(ManifestError, match="not found") as gone:
        detdata.Manifest.load(f"{site[1]}/nope.json?sig=ok", retry=PATIENT)
    assert not isinstance(gone.value, StorageError)
    directory, base = site
    (directory / "shard-1.npy").rename(directory / "moved.npy")
    try:
        with pytest.raises(VerificationError, match=r"shard-1\.npy.*missing"):
            detdata.Manifest.load(
                str(directory / "manifest.json"), root=f"{base}?sig=ok", retry=PATIENT
            )
    finally:
        (directory / "moved.npy").rename(directory / "shard-1.npy")


@pytest.mark.parametrize(("sig", "status"), STATUSES)
def test_the_cli_exits_3_naming_the_redacted_url_and_status(
    site: tuple[Path, str], sig: str, status: int
) -> None:
    directory, base = site
    for args in (
        ["verify", f"{base}/manifest.json?sig={sig}"],
        ["verify", "--root", f"{base}?sig={sig}", str(directory / "manifest.json")],
        ["inspect", f"{base}/manifest.json?sig={sig}"],
    ):
        result = subprocess.run(
            [*console(), *args], capture_output=True, text=True, timeout=120, check=False
        )
        assert result.returncode == 3, (args, result.stderr)
        assert re.search(rf"detdata: storage error: .*HTTP {status}", result.stderr), result.stderr
        assert "http://***@127.0.0.1" in result.stderr and SECRET not in result.stderr
        assert "Traceback" not in result.stderr and "internal error" not in result.stderr
