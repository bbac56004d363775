"""Credentials in URLs and storage options never reach a message, a log line, a repr or a file.

Unit part: `redact_url` / `strip_credentials` / `redact_text` against hand-written
expected strings. Remote part: a whole run against real nginx on 127.0.0.1
(through `tests.faultproxy.FaultProxy`, which resets connections so retries
happen) with secrets in the root URL (user info and query parameters) and in
``storage_options``: build, save, register, resolve, open, load through a
`DataLoader` with a trace, save the state, then errors (a missing shard, a store
that resets everything, a rewritten shard). Every file written, every log
record and every exception (message, repr and traceback chain) is searched for
each secret string: none may contain one, while the errors still name the
shard and its redacted URL.
"""

from __future__ import annotations

import json
import logging
import shutil
import traceback
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import detdata
from detdata import Storage
from detdata.base.errors import DetdataError, RetriesExhausted, StorageError, VerificationError
from detdata.base.redact import (
    redact_text,
    redact_url,
    scrub_exception,
    strip_credentials,
)
from detdata.datasets.tokens import TokenWindows
from detdata.identity.build import build_manifest
from detdata.identity.manifest import Manifest
from detdata.identity.registry import Registry
from detdata.storage.retry import RetryPolicy
from tests.faultproxy import Fault, FaultProxy, reset_all, schedule
from tests.servers import HttpServer

USER_SECRET = "s3cr3t-userpw-9f1e"
SIG_SECRET = "s3cr3t-sig-77ab"
TOKEN_SECRET = "s3cr3t-token-5d2c"
HEADER_SECRET = "s3cr3t-header-c0de"
SECRETS = (USER_SECRET, SIG_SECRET, TOKEN_SECRET, HEADER_SECRET)
SEQ = 16
TOKENS = (900, 700, 1100)
PATIENT = RetryPolicy(deadline_s=20.0, attempt_timeout_s=1.0, base_delay_s=0.01, max_delay_s=0.1)
FAST = RetryPolicy(deadline_s=1.5, attempt_timeout_s=0.5, base_delay_s=0.05, max_delay_s=0.2)


# ------------------------------------------------------------------------ unit
@pytest.mark.parametrize(
    "url,shown,stored",
    [
        (
            "http://alice:TOKEN@host:8080/data",
            "http://***@host:8080/data",
            "http://host:8080/data",
        ),
        ("s3://KEY:SECRET@bucket/prefix", "s3://***@bucket/prefix", "s3://bucket/prefix"),
        ("https://ghp_abc@host/x", "https://***@host/x", "https://host/x"),
        (
            "https://b.s3.amazonaws.com/k.npy?X-Amz-Algorithm=AWS4&X-Amz-Credential=AK%2F1"
            "&X-Amz-Date=20260101&X-Amz-Security-Token=tok&X-Amz-Signature=abc",
            "https://b.s3.amazonaws.com/k.npy?X-Amz-Algorithm=AWS4&X-Amz-Credential=***"
            "&X-Amz-Date=20260101&X-Amz-Security-Token=***&X-Amz-Signature=***",
            "https://b.s3.amazonaws.com/k.npy?X-Amz-Algorithm=AWS4&X-Amz-Date=20260101",
        ),
        (
            "https://acct.blob.core.windows.net/c?sv=2024&sp=r&sig=xyz%3D",
            "https://acct.blob.core.windows.net/c?sv=2024&sp=r&sig=***",
            "https://acct.blob.core.windows.net/c?sv=2024&sp=r",
        ),
        (
            "https://h/d?access_token=a&Signature=b&key=c&page=2&myApiKey=d",
            "https://h/d?access_token=***&Signature=***&key=***&page=2&myApiKey=***",
            "https://h/d?page=2",
        ),
        ("https://h/d?token=only", "https://h/d?token=***", "https://h/d"),
        ("/local/path/with:colon@at", "/local/path/with:colon@at", "/local/path/with:colon@at"),
        ("s3://bucket/a@b/c?d.npy", "s3://bucket/a@b/c?d.npy", "s3://bucket/a@b/c?d.npy"),
        ("gs://bucket/x", "gs://bucket/x", "gs://bucket/x"),
    ],
)
def test_redact_and_strip_urls(url: str, shown: str, stored: str) -> None:
    assert redact_url(url) == shown
    assert strip_credentials(url) == stored
    assert redact_url(shown) == shown and strip_credentials(stored) == stored  # idempotent


def test_redact_text_finds_every_url_in_a_message() -> None:
    text = (
        "read failed for shard a.npy at http://u:pw1@h/d/a.npy?sig=pw2: "
        "ClientResponseError(url=URL('http://u:pw1@h/d/a.npy?sig=pw2'), 'Not Found'); "
        "also s3://K:pw3@b/x and a plain /tmp/file"
    )
    out = redact_text(text)
    assert all(s not in out for s in ("pw1", "pw2", "pw3"))
    assert "shard a.npy at http://***@h/d/a.npy?sig=***:" in out
    assert "URL('http://***@h/d/a.npy?sig=***')" in out and "s3://***@b/x" in out
    assert out.endswith("a plain /tmp/file")


def test_scrub_exception_keeps_type_and_chain() -> None:
    pw1, pw2 = "pw" + "-one", "pw" + "-two"  # built at run time: tracebacks quote source lines
    try:
        try:
            raise ConnectionResetError(104, f"reset by http://u:{pw1}@h/x")
        except ConnectionResetError as inner:
            raise FileNotFoundError(f"http://u:{pw1}@h/x?token={pw2}") from inner
    except FileNotFoundError as exc:
        assert scrub_exception(exc) is exc
        rendered = "".join(traceback.format_exception(exc))
    assert pw1 not in rendered and pw2 not in rendered
    assert "ConnectionResetError: [Errno 104] reset by http://***@h/x" in rendered
    assert "FileNotFoundError: http://***@h/x?token=***" in rendered


def test_manifest_repr_save_and_registry_refs_hold_no_credentials(tmp_path: Path) -> None:
    data = tmp_path / "data"
    data.mkdir()
    np.save(data / "a.npy", np.arange(100, dtype=np.uint16))
    manifest = build_manifest(str(data))
    secret_root = f"https://alice:{USER_SECRET}@host/d?sig={SIG_SECRET}&part=1"
    remote = manifest.with_root(secret_root)
    assert USER_SECRET not in repr(remote) and SIG_SECRET not in repr(remote)
    assert "https://***@host/d?sig=***&part=1" in repr(remote)
    remote.save(str(tmp_path / "m.json"))
    doc = json.loads((tmp_path / "m.json").read_text())
    assert doc["root"] == "https://host/d?part=1" and doc["id"] == manifest.id
    reg = Registry(str(tmp_path / "reg"))
    reg.register("ds@v1", remote)
    assert reg.history("ds@v1")[-1].root == "https://host/d?part=1"
    assert reg.resolve("ds@v1", verify="off").root == "https://host/d?part=1"
    assert reg.resolve("ds@v1", verify="off", root=secret_root).root == secret_root
    reg.register("ds@v1", remote)  # the same id and stripped root: no new history event
    assert len(reg.history("ds@v1")) == 1
    secret_reg = Registry(f"file://{tmp_path}/reg2?token={TOKEN_SECRET}")
    assert TOKEN_SECRET not in repr(secret_reg)
    for path in tmp_path.rglob("*"):
        if path.is_file():
            body = path.read_bytes()
            assert all(s.encode() not in body for s in SECRETS), path


# ---------------------------------------------------------------------- remote
def _artifact_text(root: Path) -> dict[str, bytes]:
    return {str(p): p.read_bytes() for p in root.rglob("*") if p.is_file()}


def _exception_text(exc: BaseException) -> str:
    return "\n".join([str(exc), repr(exc), "".join(traceback.format_exception(exc))])


def test_remote_run_never_shows_a_secret(
    http_server: HttpServer,
    fault_proxy: Any,
    tmp_path: Path,
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.DEBUG)
    directory, url = http_server.new_dir()
    rng = np.random.default_rng(3)
    for i, n in enumerate(TOKENS):
        np.save(directory / f"shard-{i:02d}.npy", rng.integers(0, 60_000, n).astype(np.uint16))
    local = build_manifest(str(directory))
    proxy: FaultProxy = fault_proxy(http_server.port)
    host = proxy.address
    path = url.split(f"127.0.0.1:{http_server.port}", 1)[1]
    # user info and credential query parameters (nginx ignores both for static files)
    root = f"http://alice:{USER_SECRET}@{host}{path}?sig={SIG_SECRET}&token={TOKEN_SECRET}&v=1"
    shown_root = f"http://***@{host}{path}?sig=***&token=***&v=1"
    opts = {"headers": {"X-Api-Key": HEADER_SECRET}, "skip_instance_cache": True}
    work = tmp_path / "work"
    work.mkdir()
    errors: list[BaseException] = []
    shown: list[str] = []

    # build over HTTP (the listing needs no query: shards are named), save, register
    names = [s.path for s in local.shards]
    built = build_manifest(root, paths=names, retry=PATIENT, **opts)
    assert built.id == local.id and built.root == root  # the runtime root keeps its credentials
    built.save(str(work / "manifest.json"))
    assert json.loads((work / "manifest.json").read_text())["root"] == f"http://{host}{path}?v=1"
    reg = Registry(str(work / "registry"))
    reg.register("secret@v1", built)
    shown += [repr(built), repr(reg), str(reg.history("secret@v1"))]

    # resolve + open + a loader run through resets (retries are logged), with a trace
    proxy.set_plan(schedule(reset_every=3, reset_after=200))
    resolved = reg.resolve("secret@v1", root=root, storage_options=opts)
    ds = TokenWindows(resolved, SEQ, storage=Storage(fs_options=opts, retry=PATIENT))
    loader = detdata.DataLoader(
        ds,
        global_batch_size=8,
        micro_batch_size=8,
        seed=5,
        options=detdata.LoaderOptions(trace=work / "trace.jsonl"),
    )
    batches = [b for _, b in zip(range(6), loader, strict=False)]
    assert len(batches) == 6 and proxy.stats.resets >= 1
    (work / "state.json").write_text(json.dumps(loader.state_dict()))
    shown += [repr(ds), repr(loader), repr(resolved)]

    # a manifest read from the store whose first connection is reset: retried, logged
    built.save(str(directory / "manifest.json"))
    proxy.set_plan(lambda i: Fault(reset_after=0) if i < 3 else Fault())
    again = Manifest.load(
        f"http://alice:{USER_SECRET}@{host}{path}/manifest.json?sig={SIG_SECRET}",
        root=root,
        retry=PATIENT,
        **opts,
    )
    assert again.id == local.id and proxy.stats.resets == 3
    retried = [r.getMessage() for r in caplog.records if r.name == "detdata.retry"]
    assert any(f"http://***@{host}{path}/manifest.json?sig=***" in m for m in retried)

    # a store that resets every connection: RetriesExhausted names shard and redacted URL
    proxy.set_plan(reset_all)
    # cache_dir=None: range reads (the default cache already holds the copy read above)
    fresh = TokenWindows(
        resolved, SEQ, storage=Storage(fs_options=opts, retry=FAST, cache_dir=None)
    )
    with pytest.raises(RetriesExhausted) as exhausted:
        fresh.read(np.array([0]))
    errors.append(exhausted.value)
    assert f"shard shard-00.npy at {shown_root.split('?')[0]}/shard-00.npy?" in str(exhausted.value)
    proxy.set_plan(schedule())

    # a missing shard: a permanent error naming the shard and its redacted URL
    moved = directory / "shard-02.npy.moved"
    shutil.move(directory / "shard-02.npy", moved)
    try:
        with pytest.raises(StorageError, match=r"shard shard-02\.npy") as gone:
            # cache_dir=None: the default cache holds a verified copy read above
            TokenWindows(
                resolved, SEQ, storage=Storage(fs_options=opts, retry=FAST, cache_dir=None)
            ).read(np.array([ds.num_samples - 1]))
        errors.append(gone.value)
        with pytest.raises(VerificationError, match=r"shard-02\.npy .*missing") as missing:
            Manifest.load(str(work / "manifest.json"), root=root, retry=FAST, **opts)
        errors.append(missing.value)
        assert "http://***@" in str(missing.value)
    finally:
        shutil.move(moved, directory / "shard-02.npy")

    # a rewritten shard: verification names it, with the redacted URL
    victim = directory / "shard-01.npy"
    original = victim.read_bytes()
    victim.write_bytes(original[:-1] + bytes([original[-1] ^ 1]))
    try:
        with pytest.raises(VerificationError, match=r"shard-01\.npy") as bad:
            reg.resolve("secret@v1", root=root, storage_options=opts)
        errors.append(bad.value)
        assert f"{shown_root.split('?')[0]}/shard-01.npy?sig=***" in str(bad.value)
    finally:
        victim.write_bytes(original)

    # a manifest URL with credentials that does not exist
    with pytest.raises(DetdataError) as no_file:
        Manifest.load(
            f"http://alice:{USER_SECRET}@{host}{path}/nope.json?sig={SIG_SECRET}",
            retry=FAST,
            **opts,
        )
    errors.append(no_file.value)

    texts = {"log": caplog.text, **{f"shown{i}": s for i, s in enumerate(shown)}}
    texts |= {f"log{i}": r.getMessage() for i, r in enumerate(caplog.records)}
    texts |= {f"error{i}": _exception_text(e) for i, e in enumerate(errors)}
    files = _artifact_text(tmp_path)
    assert {"manifest.json", "trace.jsonl", "state.json"} <= {Path(p).name for p in files}
    assert any("/registry/refs/" in p for p in files)
    for secret in SECRETS:
        leaks = [k for k, v in texts.items() if secret in v]
        leaks += [p for p, body in files.items() if secret.encode() in body]
        assert leaks == [], f"{secret} leaked into {leaks}"


# ------------------------------------------------------------------ the one boundary
def test_every_detdata_logger_comes_from_the_boundary() -> None:
    """No module makes a logger the redaction filter is not attached to."""
    package = Path(detdata.__file__).resolve().parent
    offenders = [
        str(p.relative_to(package))
        for p in package.rglob("*.py")
        if "logging.getLogger(" in p.read_text(encoding="utf-8") and p.name != "redact.py"
    ]
    assert offenders == [], f"use detdata.base.redact.get_logger in {offenders}"


def _error_types() -> list[type[BaseException]]:
    import detdata.base.errors as errors

    return [
        t
        for t in vars(errors).values()
        if isinstance(t, type) and issubclass(t, errors.DetdataError)
    ]


def test_every_detdata_error_message_is_redacted_when_made() -> None:
    from detdata.base.errors import RetriesExhausted, StateError, VerificationError

    url = f"http://alice:{USER_SECRET}@host/d/s.npy?sig={SIG_SECRET}&part=1"
    shown = "http://***@host/d/s.npy?sig=***&part=1"
    for kind in _error_types():
        if kind is RetriesExhausted:
            exc: BaseException = kind(
                f"read {url}", shard="s.npy", url=url, attempts=1, last_error=OSError(url)
            )
        elif kind in (VerificationError, StateError):
            exc = kind(f"read {url}")
        else:
            exc = kind(f"read {url}")
        text = _exception_text(exc)
        assert all(s not in text for s in SECRETS), (kind, text)
        assert shown in str(exc), kind


def test_the_cli_stream_redacts_urls_cut_across_writes() -> None:
    import io

    from detdata.base.redact import RedactingWriter

    target = io.StringIO()
    writer = RedactingWriter(target)
    line = f"at http://alice:{USER_SECRET}@host/x?sig={SIG_SECRET} done\n"
    for i in range(0, len(line), 3):  # a URL written three characters at a time
        writer.write(line[i : i + 3])
    writer.write(f"progress http://u:{TOKEN_SECRET}@h/y\r")
    writer.write(f"tail http://u:{TOKEN_SECRET}@h/z")
    writer.flush()
    out = target.getvalue()
    assert all(s not in out for s in SECRETS), out
    assert out.count("http://***@h/") == 2 and "http://***@host/x?sig=***" in out
