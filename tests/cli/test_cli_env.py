"""``detdata env`` and ``detdata preflight`` through the real console entry point (issue 15)."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from tests.cli.test_cli_exit_codes import check_failure
from tests.cli.test_cli_mix import detdata_exe
from tests.conftest import write_token_shards
from tests.loading.test_record import _git

pytestmark = pytest.mark.multiproc  # runs the real console command

REPO = Path(__file__).resolve().parents[2]


def _run(*args: str, cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [detdata_exe(), *args], capture_output=True, text=True, timeout=300, cwd=cwd
    )


def _repo(tmp_path: Path) -> Path:
    path = tmp_path / "repo"
    path.mkdir()
    _git(path, "init", "-q")
    _git(path, "config", "user.email", "t@example.com")
    _git(path, "config", "user.name", "t")
    (path / "uv.lock").write_text("lock\n")
    _git(path, "add", ".")
    _git(path, "commit", "-q", "-m", "first")
    return path


def _data(tmp_path: Path) -> tuple[Path, Path]:
    root = tmp_path / "data"
    write_token_shards(root, sizes=(3000, 2000))
    manifest = tmp_path / "manifest.json"
    done = _run("manifest", "build", str(root), "--out", str(manifest))
    assert done.returncode == 0, done.stderr
    return root, manifest


def test_env_prints_the_record_and_checks_a_saved_one(tmp_path: Path) -> None:
    repo = _repo(tmp_path)
    _, manifest = _data(tmp_path)
    config = tmp_path / "config.json"
    config.write_text(json.dumps({"lr": 0.1}))
    saved = tmp_path / "record.json"
    done = _run(
        "env",
        "--repo",
        str(repo),
        "--manifest",
        str(manifest),
        "--config",
        str(config),
        "--out",
        str(saved),
    )
    assert done.returncode == 0, done.stderr
    doc = json.loads(done.stdout)
    assert doc["kind"] == "detdata.run_record"
    assert doc["code"]["revision"] == _git(repo, "rev-parse", "HEAD")
    assert list(doc["lock_files"]) == ["uv.lock"]
    assert doc["data"]["manifests"] == [json.loads(manifest.read_text())["id"]]
    assert json.loads(saved.read_text()) == doc
    same = _run(
        "env",
        "--repo",
        str(repo),
        "--manifest",
        str(manifest),
        "--config",
        str(config),
        "--check",
        str(saved),
    )
    assert same.returncode == 0, same.stderr
    config.write_text(json.dumps({"lr": 0.2}))
    differs = _run(
        "env",
        "--repo",
        str(repo),
        "--manifest",
        str(manifest),
        "--config",
        str(config),
        "--check",
        str(saved),
    )
    assert differs.returncode == 1
    assert "config: saved" in differs.stderr and "allow=('config',)" in differs.stderr
    allowed = _run(
        "env",
        "--repo",
        str(repo),
        "--manifest",
        str(manifest),
        "--config",
        str(config),
        "--check",
        str(saved),
        "--allow",
        "config",
    )
    assert allowed.returncode == 0, allowed.stderr
    assert "allowed difference config: saved" in allowed.stderr


def test_preflight_world_one_passes(tmp_path: Path) -> None:
    _, manifest = _data(tmp_path)
    done = _run("preflight", "--manifest", str(manifest))
    assert done.returncode == 0, done.stderr
    assert "ok devices" in done.stdout
    assert "ok all_reduce world 1 (gloo)" in done.stdout
    assert "2 shard(s) quick-verified" in done.stdout


def test_preflight_fails_naming_a_corrupted_shard(tmp_path: Path) -> None:
    root, manifest = _data(tmp_path)
    shard = root / "shard-001.npy"
    data = bytearray(shard.read_bytes())
    data[-3] ^= 0xFF  # same size, other bytes: the quick digest (head + tail) catches it
    shard.write_bytes(bytes(data))
    done = _run("preflight", "--manifest", str(manifest))
    assert done.returncode == 1
    assert "detdata: preflight failed: manifest" in done.stderr
    assert "shard-001.npy" in done.stderr
    assert "ok all_reduce world 1" in done.stdout  # the other checks still ran


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _torchrun(*args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    return subprocess.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--nproc-per-node",
            "2",
            "--master-addr",
            "127.0.0.1",
            "--master-port",
            str(_free_port()),
            "-m",
            "detdata.cli.main",
            "preflight",
            *args,
        ],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
    )


@pytest.mark.slow
def test_preflight_under_torchrun_two_ranks(tmp_path: Path) -> None:
    root, manifest = _data(tmp_path)
    done = _torchrun("--manifest", str(manifest))
    assert done.returncode == 0, done.stderr
    for rank in (0, 1):
        assert f"preflight[rank {rank}]: ok all_reduce world 2 (gloo)" in done.stdout
        assert f"preflight[rank {rank}]: ok manifest" in done.stdout
    (root / "shard-000.npy").write_bytes(b"short")
    failed = _torchrun("--manifest", str(manifest))
    assert failed.returncode != 0
    assert "shard-000.npy" in failed.stderr


def test_env_check_of_a_record_saved_from_python_reports_no_false_difference(
    tmp_path: Path,
) -> None:
    """One record shape: a record captured in Python (layout, config, loader, manifests, an
    extra variable) and `detdata env --check` given the same inputs agree field by field; one
    real change (the micro batch in the loader state) is then the only difference named."""
    from detdata import DataLoader, LoaderOptions, RunRecord, TokenWindows
    from detdata.identity.manifest import Manifest

    repo = _repo(tmp_path)
    _, manifest = _data(tmp_path)
    config = {"lr": 0.1, "model": "tiny"}
    (tmp_path / "config.json").write_text(json.dumps(config))
    loader = DataLoader(
        TokenWindows(Manifest.load(str(manifest)), 8),
        global_batch_size=16,
        micro_batch_size=4,
        options=LoaderOptions(rank=0, world_size=2),
        seed=3,
    )
    state = tmp_path / "loader.json"
    state.write_text(json.dumps(loader.state_dict()))
    env = {**os.environ, "MY_TOKEN": "s3cret-value", "DETDATA_IMAGE_DIGEST": "sha256:" + "d" * 64}
    saved = tmp_path / "record.json"
    script = (
        "import json, sys; from detdata import RunRecord; "
        "RunRecord.capture(repo=sys.argv[1], layout={'world': 8, 'tp': 2}, "
        "config=json.load(open(sys.argv[2])), loader=json.load(open(sys.argv[3])), "
        "extra_env=['MY_TOKEN'], execution={'precision': 'bf16-mixed'}).save(sys.argv[4])"
    )
    made = subprocess.run(
        [sys.executable, "-c", script, str(repo), str(tmp_path / "config.json"), str(state),
         str(saved)],
        capture_output=True, text=True, timeout=300, env=env,
    )  # fmt: skip
    assert made.returncode == 0, made.stderr
    assert "s3cret-value" not in saved.read_text()
    args = [
        "env", "--repo", str(repo), "--config", str(tmp_path / "config.json"),
        "--layout", "world=8,tp=2", "--loader-state", str(state), "--extra-env", "MY_TOKEN",
        "--execution", "precision=bf16-mixed", "--check", str(saved),
    ]  # fmt: skip
    same = subprocess.run(  # -v: the record too, not only the ok line
        [detdata_exe(), *args, "-v"], capture_output=True, text=True, timeout=300, env=env
    )
    assert same.returncode == 0, same.stderr
    assert "differs" not in same.stderr
    printed = same.stdout.rstrip("\n").rpartition("\n")[0]  # the record, then the ok line
    assert RunRecord.load(saved).differences(RunRecord.from_json(printed)) == []
    other = DataLoader(
        TokenWindows(Manifest.load(str(manifest)), 8),
        global_batch_size=16,
        micro_batch_size=8,
        options=LoaderOptions(rank=0, world_size=2),
        seed=3,
    )
    state.write_text(json.dumps(other.state_dict()))
    changed = subprocess.run(
        [detdata_exe(), *args], capture_output=True, text=True, timeout=300, env=env
    )
    assert changed.returncode == 1
    assert "in 2 field(s)" in changed.stderr
    assert "execution.micro_batch: saved 4, now 8" in changed.stderr
    assert "execution.accumulation: saved 2, now 1" in changed.stderr


def test_preflight_out_saves_the_result(tmp_path: Path) -> None:
    root, manifest = _data(tmp_path)
    out = tmp_path / "ckpt" / "preflight.json"
    out.parent.mkdir()
    done = _run("preflight", "--manifest", str(manifest), "--out", str(out))
    assert done.returncode == 0, done.stderr
    doc = json.loads(out.read_text())
    assert doc["kind"] == "detdata.preflight" and doc["passed"] is True and doc["rank"] == 0
    assert [c["check"] for c in doc["checks"]] == [
        "devices",
        "process group",
        f"manifest {manifest}",
    ]
    assert all(c["ok"] for c in doc["checks"])
    (root / "shard-001.npy").write_bytes(b"short")
    failed = _run("preflight", "--manifest", str(manifest), "--out", str(out))
    assert failed.returncode == 1
    doc = json.loads(out.read_text())
    assert doc["passed"] is False and "shard-001.npy" in doc["failures"][0]


# -- usage errors: exit 2, one line, nothing printed or saved (issue 40) ----------------------
def _saved_record(tmp_path: Path) -> tuple[Path, Path]:
    repo = _repo(tmp_path)
    saved = tmp_path / "saved.json"
    done = _run("env", "--repo", str(repo), "--out", str(saved))
    assert done.returncode == 0, done.stderr
    return repo, saved


@pytest.fixture(scope="module")
def saved_record(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """One checkout and the record ``detdata env`` saved of it, shared by the tests below that
    only read them (each writes its own output under its own ``tmp_path``). Receipts and the
    shard cache in folders of its own, as tests/conftest.py gives each test."""
    tmp = tmp_path_factory.mktemp("env-record")
    with pytest.MonkeyPatch.context() as env:
        env.setenv("DETDATA_RECEIPTS", str(tmp / "receipts"))
        env.setenv("DETDATA_CACHE_DIR", str(tmp / "shard-cache"))
        return _saved_record(tmp)


@pytest.mark.parametrize(
    ("name", "valid"),
    [
        ("env.TYPO", "env.CUBLAS_WORKSPACE_CONFIG"),  # a recorded variable is listed
        ("determinism.nope", "determinism.cudnn_benchmark"),
        ("gpu_uuid", "gpu_uuids"),  # every field name is listed
    ],
)
def test_env_check_with_a_misspelt_allow_is_a_one_line_usage_error(
    tmp_path: Path, saved_record: tuple[Path, Path], name: str, valid: str
) -> None:
    repo, saved = saved_record
    new = tmp_path / "new.json"
    done = _run(
        "env", "--repo", str(repo), "--check", str(saved), "--allow", name, "--out", str(new)
    )
    assert not new.exists(), done.stderr  # no record saved for a command refused
    assert done.stdout == ""  # nor printed
    check_failure(done, 2, "--allow names", f"'{name}'", valid)


def test_env_allow_without_check_is_a_one_line_usage_error(tmp_path: Path) -> None:
    repo = _repo(tmp_path)
    done = _run("env", "--repo", str(repo), "--allow", "gpu_uuids")
    check_failure(done, 2, "--allow gpu_uuids", "--check")
    assert done.stdout == ""


@pytest.mark.parametrize("timeout", ["-1", "0", "nan", "inf", "1e20", "2m"])
def test_preflight_with_a_bad_timeout_is_a_one_line_usage_error(
    tmp_path: Path, timeout: str
) -> None:
    out = tmp_path / "preflight.json"
    done = _run("preflight", "--timeout", timeout, "--out", str(out))
    check_failure(done, 2, f"--timeout {timeout}", "positive")
    assert done.stdout == ""  # no check ran
    assert not out.exists()


def test_env_check_prints_one_line_when_it_passes_and_the_record_with_v(tmp_path: Path) -> None:
    """Issue 46: ``env --check`` printed the whole record (187 lines) on success. Now one
    ``ok`` line; the record with ``-v``; on a refused difference the record and the difference."""
    repo = _repo(tmp_path)
    saved = tmp_path / "record.json"
    assert _run("env", "--repo", str(repo), "--out", str(saved)).returncode == 0
    record = json.loads(saved.read_text())
    passed = _run("env", "--repo", str(repo), "--check", str(saved))
    assert passed.returncode == 0, passed.stderr
    assert passed.stdout.splitlines() == [f"ok: this run's record matches {saved}"]
    verbose = _run("env", "--repo", str(repo), "--check", str(saved), "-v")
    assert verbose.returncode == 0, verbose.stderr
    body, _, last = verbose.stdout.rstrip("\n").rpartition("\n")
    assert json.loads(body)["code"] == record["code"]
    assert last == f"ok: this run's record matches {saved}"
    (repo / "uv.lock").write_text("another lock\n")
    _git(repo, "commit", "-qam", "second")
    failed = _run("env", "--repo", str(repo), "--check", str(saved))
    assert failed.returncode == 1
    assert json.loads(failed.stdout)["code"]["revision"] == _git(repo, "rev-parse", "HEAD")
    assert "run record check failed" in failed.stderr and "revision" in failed.stderr
