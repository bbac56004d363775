"""No secret in any output: every CLI command and record-producing API against a credentialed root.

The root is a real nginx directory (tests/servers.py) reached through
``http://alice:USER_SECRET@127.0.0.1:PORT/dir?sig=SIG_SECRET&X-Amz-Signature=AMZ_SECRET&v=1``
(nginx ignores user info and query for static files, as a presigned store ignores the
signature's form). Every command of ``detdata --help`` that can name a root or read
data is run as the real console script, in success and in failure; every
record-producing API (provenance, where, seen, preflight, env, diff, inspect,
replay-check) is called; all of stdout, stderr, the records, the exceptions and the
files written are searched for each secret. The redaction boundary
(`detdata.base.redact`) is what this checks: no feature redacts for itself.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
import traceback
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import detdata
from detdata.base.redact import get_logger
from tests.cli.test_cli_manifest import console
from tests.servers import HttpServer

pytestmark = [pytest.mark.multiproc, pytest.mark.slow]

USER_SECRET = "usr-s3cr3t-4b1d"
SIG_SECRET = "sig-s3cr3t-99e0"
AMZ_SECRET = "amz-s3cr3t-7c7c"
SECRETS = (USER_SECRET, SIG_SECRET, AMZ_SECRET)
QUERY = f"sig={SIG_SECRET}&X-Amz-Signature={AMZ_SECRET}&v=1"

DATA_MODULE = """\
import os
import detdata

def build():
    manifest = detdata.Manifest.load(os.environ["DD_MANIFEST"], root=os.environ["DD_ROOT"])
    windows = detdata.TokenWindows(manifest, 16)
    return detdata.DataLoader(windows, global_batch_size=4, micro_batch_size=4, seed=1)
"""

FAILING_SCRIPT = """\
import os, sys
print("reading " + os.environ["DD_ROOT"], file=sys.stderr)
raise SystemExit("cannot open " + os.environ["DD_ROOT"] + "/shard-00.npy")
"""


@pytest.fixture(scope="module")
def secret_site(
    http_server: HttpServer, tmp_path_factory: pytest.TempPathFactory
) -> dict[str, Any]:
    directory, url = http_server.new_dir()
    rng = np.random.default_rng(29)
    for i in range(3):
        np.save(directory / f"shard-{i:02d}.npy", rng.integers(0, 9000, 400).astype(np.uint16))
    base = url.replace("http://", f"http://alice:{USER_SECRET}@")
    root = f"{base}?{QUERY}"
    local = detdata.build_manifest(str(directory))
    local.save(str(directory / "manifest.json"))
    work = tmp_path_factory.mktemp("secret-work")
    (work / "data_module.py").write_text(DATA_MODULE)
    (work / "failing.py").write_text(FAILING_SCRIPT)
    return {
        "root": root,
        "manifest": f"{base}/manifest.json?{QUERY}",
        "missing": f"{base}/nope.json?{QUERY}",
        "names": [s.path for s in local.shards],
        "work": work,
    }


def _env(site: dict[str, Any]) -> dict[str, str]:
    import os

    env = dict(os.environ)
    env.update(DD_MANIFEST=site["manifest"], DD_ROOT=site["root"])
    # a numerics variable the run record captures, holding a credentialed URL
    env["CUBLAS_WORKSPACE_CONFIG"] = site["root"]
    return env


def _cli(site: dict[str, Any], *args: str) -> tuple[int, str]:
    result = subprocess.run(
        [*console(), *args],
        capture_output=True,
        text=True,
        timeout=240,
        check=False,
        cwd=site["work"],
        env=_env(site),
    )
    return result.returncode, f"{result.stdout}\n{result.stderr}"


def _commands(site: dict[str, Any]) -> list[tuple[list[str], set[int]]]:
    w, root, man, missing = site["work"], site["root"], site["manifest"], site["missing"]
    data = f"{w}/data_module.py:build"
    return [
        (["manifest", "build", root, "-o", f"{w}/built.json"], {0, 2, 3}),
        (["manifest", "build", missing, "-o", f"{w}/x.json"], {2, 3}),
        (["manifest", "build", root, "--part", "0/1", "-o", f"{w}/part0.json"], {0, 2, 3}),
        (
            ["manifest", "merge", "--root", root, "-o", f"{w}/merged.json", f"{w}/part0.json"],
            {0, 2},
        ),
        (["verify", man], {0}),
        (["verify", "--full", "--root", root, man], {0}),
        (["verify", missing], {2, 3}),
        (["hash", f"{root.split('?')[0]}/shard-00.npy?{QUERY}"], {0, 2, 3}),
        (["register", "--registry", f"{w}/reg", man, "secret@v1"], {0}),
        (["inspect", man], {0}),
        (["inspect", "--registry", f"{w}/reg", "secret@v1"], {0}),
        (["inspect", missing], {2, 3}),
        (["env", "--manifest", man, "--out", f"{w}/env.json"], {0}),
        (["env", "--manifest", missing], {2, 3}),
        (["preflight", "--manifest", man, "--root", root, "--backend", "gloo"], {0}),
        (["preflight", "--manifest", missing, "--backend", "gloo"], {1}),
        (
            [
                "split",
                "--manifest",
                man,
                "--root",
                root,
                "--fraction",
                "0.5",
                "--salt",
                "s",
                "--seq-len",
                "16",
                "--out",
                f"{w}/split",
            ],
            {0},
        ),
        (["where", "--state", f"{w}/state.json", "--step", "1", "--data", data], {0}),
        (["seen", "--until", "40", "--data", data, "3"], {0}),
        (["seen", "--until", "40", "--data", data, "--state", f"{w}/state.json", "3"], {0}),
        (["diff", f"{w}/trace.jsonl", f"{w}/trace.jsonl"], {0}),
        (["diff", "--state", f"{w}/state.json", f"{w}/state.json"], {0}),
        (["order", "--n", "10", "--seed", "1", "--at", "0", "--count", "3"], {0}),
        (
            [
                "replay-check",
                "--out",
                f"{w}/replay",
                "--steps",
                "2",
                "--stop-at",
                "1",
                "--",
                sys.executable,
                f"{w}/failing.py",
            ],
            {2},
        ),
    ]


def _records(site: dict[str, Any]) -> dict[str, str]:
    """Every record-producing API, run in this process; their results as text."""
    from detdata.cli import preflight, replay
    from detdata.loading.provenance import positions_seen
    from detdata.loading.record import RunRecord
    from detdata.loading.trace import compare, read_trace

    w = site["work"]
    out: dict[str, str] = {}
    manifest = detdata.Manifest.load(site["manifest"], root=site["root"])
    out["manifest repr"] = repr(manifest)
    windows = detdata.TokenWindows(manifest, 16)
    loader = detdata.DataLoader(
        windows,
        global_batch_size=4,
        micro_batch_size=4,
        seed=1,
        options=detdata.LoaderOptions(trace=w / "trace.jsonl"),
    )
    for _, _batch in zip(range(3), loader, strict=False):
        pass
    (w / "state.json").write_text(json.dumps(loader.state_dict()))
    records = loader.provenance(1)
    assert records and all("url" in r.to_json() for r in records)  # the field is there
    out["provenance"] = "\n".join(repr(r) + json.dumps(r.to_json()) for r in records)
    out["provenance location"] = repr([dict(r.location) for r in records])
    out["seen"] = repr(positions_seen(loader.stream, None, 3, until=40).tolist())
    out["preflight"] = preflight.check_manifest(site["manifest"], site["root"])
    record = RunRecord.capture(allow_dirty=True, manifests=[manifest])
    out["env"] = json.dumps(record.to_json()) + repr(record)
    trace = read_trace(str(w / "trace.jsonl"))
    out["diff"] = repr(compare(trace, trace).first)
    out["inspect"] = json.dumps(manifest.to_json())
    out["replay"] = repr(getattr(replay, "__doc__", ""))
    get_logger("detdata.test").warning("reading %s", site["root"])
    return out


def _files(root: Path) -> dict[str, bytes]:
    return {str(p): p.read_bytes() for p in root.rglob("*") if p.is_file()}


def test_no_secret_in_any_cli_output_record_log_error_or_file(
    secret_site: dict[str, Any], capfd: pytest.CaptureFixture[str], caplog: pytest.LogCaptureFixture
) -> None:
    import logging
    import os

    caplog.set_level(logging.DEBUG)
    texts: dict[str, str] = {}
    saved = {k: os.environ.get(k) for k in ("CUBLAS_WORKSPACE_CONFIG",)}
    os.environ["CUBLAS_WORKSPACE_CONFIG"] = secret_site["root"]
    try:
        texts.update(_records(secret_site))
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
    errors: list[BaseException] = []
    for make in (
        lambda: detdata.Manifest.load(secret_site["missing"]),
        lambda: detdata.build_manifest(secret_site["missing"]),
    ):
        try:
            make()
        except Exception as exc:  # every failure's text is searched
            errors.append(exc)
    assert errors
    texts |= {f"error{i}": "".join(traceback.format_exception(e)) for i, e in enumerate(errors)}
    unexpected: list[str] = []
    for args, allowed in _commands(secret_site):
        code, text = _cli(secret_site, *args)
        texts[" ".join(args)] = text
        if code not in allowed:
            unexpected.append(f"exit {code} {args[:2]}: {text}")
    captured = capfd.readouterr()
    texts["captured"] = captured.out + captured.err
    texts["log"] = caplog.text
    files = _files(secret_site["work"])
    assert {"env.json", "trace.jsonl", "state.json"} <= {Path(p).name for p in files}
    for secret in SECRETS:
        leaks = [k for k, v in texts.items() if secret in v]
        leaks += [p for p, body in files.items() if secret.encode() in body]
        assert leaks == [], f"{secret} leaked into {leaks}:\n" + "\n".join(
            textwrap.shorten(texts.get(k, ""), 600) for k in leaks if k in texts
        )
    assert unexpected == [], "\n".join(unexpected)
    # the redacted forms are there: the records still say which URL, without its secrets
    assert "http://***@127.0.0.1" in texts["provenance"]
    where = next(v for k, v in texts.items() if k.startswith("where "))
    assert '"url": "http://***@127.0.0.1' in where and "sig=***" in where
