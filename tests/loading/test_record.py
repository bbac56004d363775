"""`detdata.RunRecord`: capture, plain JSON, and verify refusing each changed field (issue 15).

Covers: detdata/loading/record_format.py.
"""

from __future__ import annotations

import copy
import json
import logging
import random
import re
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import blake3
import pytest

import detdata
from detdata import ConfigError, DataLoader, RunRecord, StateError, TokenWindows, build_manifest
from detdata.loading.record_capture import (
    IMAGE_DIGEST_ENV,
    IMAGE_ENV,
    normalise_version,
    package_list,
    packages_section,
)
from tests.conftest import write_token_shards


def _git(repo: Path, *args: str) -> str:
    done = subprocess.run(
        ["git", "-C", str(repo), *args], check=True, capture_output=True, text=True
    )
    return done.stdout.strip()


@pytest.fixture
def repo(tmp_path: Path) -> Path:
    """A real git repository with one commit holding a lock file and a script."""
    path = tmp_path / "repo"
    path.mkdir()
    _git(path, "init", "-q")
    _git(path, "config", "user.email", "t@example.com")
    _git(path, "config", "user.name", "t")
    (path / "requirements-lock.txt").write_text("numpy==2.0.0\n")
    (path / "train.py").write_text("print('train')\n")
    _git(path, "add", ".")
    _git(path, "commit", "-q", "-m", "first")
    return path


@pytest.fixture
def data(tmp_path: Path) -> Path:
    root = tmp_path / "data"
    write_token_shards(root, sizes=(400, 300))
    return root


def _loader(data: Path, seed: int = 7) -> DataLoader:
    return DataLoader(TokenWindows(build_manifest(str(data)), 8), global_batch_size=4, seed=seed)


def _capture(repo: Path, data: Path, **kw: Any) -> RunRecord:
    args: dict[str, Any] = {
        "repo": repo,
        "layout": {"world": 1},
        "config": {"lr": 0.001, "model": "tiny"},
        "loader": _loader(data),
    }
    args.update(kw)
    return RunRecord.capture(**args)


def test_capture_holds_the_inputs_and_round_trips_plain_json(repo: Path, data: Path) -> None:
    rec = _capture(repo, data)
    doc = rec.to_json()
    assert json.loads(json.dumps(doc)) == doc  # JSON-plain
    assert doc["kind"] == "detdata.run_record" and doc["format_version"] == 2
    assert doc["code"]["revision"] == _git(repo, "rev-parse", "HEAD")
    assert doc["code"]["dirty"] is False and doc["code"]["dirty_files"] == 0
    lock = (repo / "requirements-lock.txt").read_bytes()
    assert doc["lock_files"] == {"requirements-lock.txt": "b3:" + blake3.blake3(lock).hexdigest()}
    # packages: an independent listing through importlib.metadata
    import importlib.metadata as md
    import re

    names = {re.sub(r"[-_.]+", "-", d.metadata["Name"]).lower() for d in md.distributions()}
    assert {n for n, _ in doc["packages"]["list"]} == names
    assert ["numpy", md.version("numpy")] in doc["packages"]["list"]
    listed = json.dumps(doc["packages"]["list"], separators=(",", ":")).encode()
    assert doc["packages"]["digest"] == "b3:" + blake3.blake3(listed).hexdigest()
    import torch

    assert doc["versions"]["python"] == sys.version.split()[0]
    assert doc["versions"]["torch"] == torch.__version__
    if not torch.cuda.is_available():  # the CPU build here: no CUDA, cuDNN, NCCL, GPUs
        assert doc["versions"]["cuda"] is None and doc["versions"]["nccl"] is None
        assert doc["gpus"] == []
    assert doc["layout"] == {"world": 1, "dp": 1, "tp": 1, "pp": 1}
    config = json.dumps({"lr": 0.001, "model": "tiny"}, sort_keys=True, separators=(",", ":"))
    assert doc["config"] == "b3:" + blake3.blake3(config.encode()).hexdigest()
    manifest = build_manifest(str(data))
    assert doc["data"]["manifests"] == [manifest.id]
    assert doc["data"]["seeds"] == {"seed": 7, "stream_seed": None}
    assert doc["data"]["loader_state"] == _loader(data).state_dict()
    assert set(doc["env"]) >= {"CUBLAS_WORKSPACE_CONFIG", "NCCL_ALGO", "NCCL_PROTO"}
    back = RunRecord.from_json(json.dumps(doc))
    assert back.to_json() == doc
    back.verify(rec)
    rec.verify(doc)


def test_save_and_load(repo: Path, data: Path, tmp_path: Path) -> None:
    rec = _capture(repo, data)
    path = tmp_path / "ckpt" / "run_record.json"
    rec.save(path)
    assert RunRecord.load(path).to_json() == rec.to_json()
    assert [p.name for p in path.parent.iterdir()] == ["run_record.json"]  # no temp left


def test_outside_git_revision_and_dirty_are_none_with_a_note(tmp_path: Path, data: Path) -> None:
    plain = tmp_path / "plain"
    plain.mkdir()
    with pytest.raises(ConfigError, match=r"cannot tell whether the code is dirty.*allow_dirty"):
        _capture(plain, data, lock_files=[])  # an unknown dirty state is not a clean one
    rec = _capture(plain, data, lock_files=[], allow_dirty=True)
    code = rec.to_json()["code"]
    assert code["revision"] is None and code["dirty"] is None
    assert "not in a git repository" in code["note"]


def test_a_dirty_tree_is_refused_unless_allowed(repo: Path, data: Path) -> None:
    (repo / "train.py").write_text("print('edited')\n")
    (repo / "requirements-lock.txt").write_text("numpy==2.1.0\n")
    (repo / "untracked.txt").write_text("not counted\n")
    with pytest.raises(ConfigError, match=r"dirty tree: 2 tracked file\(s\).*allow_dirty=True"):
        _capture(repo, data)
    rec = _capture(repo, data, allow_dirty=True)
    assert rec.to_json()["code"]["dirty"] is True
    assert rec.to_json()["code"]["dirty_files"] == 2


def _edit(path: tuple[str, ...], value: Any) -> Callable[[dict[str, Any]], None]:
    """Set ``doc[path...] = value``: a record saved on another machine."""

    def apply(doc: dict[str, Any]) -> None:
        node = doc
        for key in path[:-1]:
            node = node[key]
        node[path[-1]] = value

    return apply


def _fake_package(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    site = tmp_path / "site"
    info = site / "Fake_Pkg-1.0.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: Fake_Pkg\nVersion: 1.0\n")
    monkeypatch.syspath_prepend(str(site))


def _commit(repo: Path) -> None:
    (repo / "train.py").write_text("print('second')\n")
    _git(repo, "commit", "-q", "-am", "second")


# (field name refused, how the second capture differs: a change before capturing or kwargs,
#  or an edit of the first record's document standing for another machine)
CASES: dict[str, Any] = {
    "revision": {"setup": lambda repo, tmp, mp: _commit(repo)},
    "dirty": {"setup": lambda repo, tmp, mp: (repo / "train.py").write_text("x = 1\n")},
    "lock_files": {"kwargs": {"lock_files": ["requirements-lock.txt", "train.py"]}},
    "packages": {"setup": lambda repo, tmp, mp: _fake_package(tmp, mp)},
    "python": {"edit": _edit(("versions", "python"), "3.9.0")},
    "torch": {"edit": _edit(("versions", "torch"), "2.0.0")},
    "cuda": {"edit": _edit(("versions", "cuda"), "12.4")},
    "cudnn": {"edit": _edit(("versions", "cudnn"), "90100")},
    "nccl": {"edit": _edit(("versions", "nccl"), "2.21.5")},
    "driver": {"edit": _edit(("versions", "driver"), "550.54.15")},
    "gpus": {
        "edit": _edit(("gpus",), [{"name": "NVIDIA H100", "uuid": "GPU-1"}]),
        "edit_now": _edit(("gpus",), [{"name": "NVIDIA H200", "uuid": "GPU-1"}]),
    },
    "gpu_uuids": {
        "edit": _edit(("gpus",), [{"name": "NVIDIA H100", "uuid": "GPU-1"}]),
        "edit_now": _edit(("gpus",), [{"name": "NVIDIA H100", "uuid": "GPU-2"}]),
    },
    "env.CUBLAS_WORKSPACE_CONFIG": {
        "setup": lambda repo, tmp, mp: mp.setenv("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    },
    "env.NCCL_ALGO": {"setup": lambda repo, tmp, mp: mp.setenv("NCCL_ALGO", "Tree")},
    "env.MY_FLAG": {
        "kwargs": {"extra_env": ["MY_FLAG"]},
        "setup": lambda repo, tmp, mp: mp.setenv("MY_FLAG", "1"),
    },
    "layout": {"kwargs": {"layout": {"world": 8, "tp": 2}}},
    "config": {"kwargs": {"config": {"lr": 0.002, "model": "tiny"}}},
    "manifests": {"kwargs": {"manifests": ["b3:" + "0" * 64]}},
    "seeds": {"seed": 8},
    # the global batch 4 -> 8 with the micro batch kept at 4: the accumulation doubles too
    "loader.global_batch_size": {"batch": 8, "also": ["execution.accumulation"]},
    # DP 1 x micro 4 -> DP 2 x micro 2: the same global batch and accumulation, other numerics
    "execution.micro_batch": {
        "loader": {
            "global_batch_size": 4,
            "micro_batch_size": 2,
            "options": detdata.LoaderOptions(world_size=2, rank=0),
        }
    },
    "execution.workers": {"loader": {"global_batch_size": 4, "num_workers": 2}},
    "execution.worker_mode": {"edit": _edit(("execution", "worker_mode"), "thread")},
    "execution.precision": {"kwargs": {"execution": {"precision": "bf16-mixed"}}},
    "determinism.cudnn_benchmark": {
        "setup": lambda repo, tmp, mp: mp.setattr("torch.backends.cudnn.benchmark", True)
    },
    "determinism.cuda_matmul_allow_tf32": {
        "edit": _edit(("determinism", "cuda_matmul_allow_tf32"), True)
    },
    "determinism.deterministic_algorithms": {
        "edit": _edit(("determinism", "deterministic_algorithms"), True)
    },
    "platform.kernel": {"edit": _edit(("platform", "kernel"), "5.4.0-generic")},
    "platform.os": {"edit": _edit(("platform", "os"), "Darwin")},
    "container.image_digest": {
        "setup": lambda repo, tmp, mp: mp.setenv("DETDATA_IMAGE_DIGEST", "sha256:" + "a" * 64)
    },
    "container.image": {
        "setup": lambda repo, tmp, mp: mp.setenv("CONTAINER_IMAGE", "nvcr.io/nvidia/pytorch:25.01")
    },
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_verify_refuses_each_changed_field_and_logs_it_when_allowed(
    name: str,
    repo: Path,
    data: Path,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    case = CASES[name]
    for var in ("CUBLAS_WORKSPACE_CONFIG", "NCCL_ALGO", "MY_FLAG", *IMAGE_ENV, *IMAGE_DIGEST_ENV):
        monkeypatch.delenv(var, raising=False)
    kwargs = {k: v for k, v in case.get("kwargs", {}).items() if k == "extra_env"}
    saved = _capture(repo, data, **kwargs)
    if "edit" in case:
        doc = copy.deepcopy(saved.to_json())
        case["edit"](doc)
        saved = RunRecord.from_json(doc)
    if "setup" in case:
        case["setup"](repo, tmp_path, monkeypatch)
    kw: dict[str, Any] = dict(case.get("kwargs", {}))
    if name == "dirty":
        kw["allow_dirty"] = True
    if "seed" in case:
        kw["loader"] = _loader(data, seed=case["seed"])
    if "batch" in case:
        ds = TokenWindows(build_manifest(str(data)), 8)
        kw["loader"] = DataLoader(ds, global_batch_size=case["batch"], micro_batch_size=4, seed=7)
    if "loader" in case:
        ds = TokenWindows(build_manifest(str(data)), 8)
        kw["loader"] = DataLoader(ds, seed=7, **case["loader"])
    now = _capture(repo, data, **kw)
    if "edit_now" in case:  # both records stand for machines with GPUs
        doc = copy.deepcopy(now.to_json())
        case["edit_now"](doc)
        now = RunRecord.from_json(doc)
    expected = sorted([name, *case.get("also", [])])
    assert now.differences(saved) == expected
    with pytest.raises(StateError) as info:
        now.verify(saved)
    assert info.value.fields == tuple(expected)
    message = str(info.value)
    assert f"  {name}: " in message and "saved" in message and "now" in message
    if not case.get("also"):
        assert f"allow=('{name}',)" in message
    caplog.set_level(logging.WARNING, logger="detdata.loading.record")
    now.verify(saved.to_json(), allow=expected)
    lines = [r.getMessage() for r in caplog.records if "allowed difference" in r.getMessage()]
    assert len(lines) == len(expected) and any(f"allowed difference {name}: " in x for x in lines)
    group = name.split(".")[0]
    if "." in name and not case.get("also"):
        now.verify(saved, allow=[group])


def test_packages_difference_names_the_package(
    repo: Path, data: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    saved = _capture(repo, data)
    _fake_package(tmp_path, monkeypatch)
    with pytest.raises(StateError, match=r"packages: fake-pkg saved absent, now 1\.0"):
        _capture(repo, data).verify(saved)


def test_several_differences_are_all_listed(repo: Path, data: Path) -> None:
    saved = _capture(repo, data)
    now = _capture(repo, data, layout={"world": 2}, config={"lr": 1.0})
    with pytest.raises(StateError) as info:
        now.verify(saved, allow=["seeds"])
    assert info.value.fields == ("config", "layout")
    assert '  layout: saved {"dp": 1, "pp": 1, "tp": 1, "world": 1}, now {"dp": 2' in str(
        info.value
    )


def test_bad_inputs_are_refused(repo: Path, data: Path) -> None:
    rec = _capture(repo, data)
    with pytest.raises(ConfigError, match=r"unknown run record fields.*'torhc'"):
        rec.verify(rec, allow=["torhc"])
    with pytest.raises(ConfigError, match="the string"):
        rec.verify(rec, allow="torch")
    with pytest.raises(ConfigError, match="unknown keys"):
        RunRecord.capture(repo=repo, layout={"word": 2})
    with pytest.raises(ConfigError, match="lock file"):
        RunRecord.capture(repo=repo, lock_files=["missing.lock"])
    with pytest.raises(StateError, match="not a run record"):
        RunRecord.from_json({"kind": "detdata.loader_state"})
    doc = rec.to_json()
    doc["format_version"] = 99
    with pytest.raises(StateError, match="unknown format_version 99"):
        RunRecord.from_json(doc)
    assert detdata.RunRecord is RunRecord


def test_a_micro_batch_change_is_refused(repo: Path, data: Path) -> None:
    """The issue's case: micro batch 16 -> 8 (accumulation 1 -> 2) at the same global batch 16,
    which changes numerics, no longer passes verify."""
    ds = TokenWindows(build_manifest(str(data)), 8)
    saved = _capture(repo, data, loader=DataLoader(ds, global_batch_size=16, micro_batch_size=16))
    now = _capture(repo, data, loader=DataLoader(ds, global_batch_size=16, micro_batch_size=8))
    with pytest.raises(StateError) as info:
        now.verify(saved)
    assert info.value.fields == ("execution.accumulation", "execution.micro_batch")
    assert "execution.micro_batch: saved 16, now 8" in str(info.value)


def test_extra_env_values_are_hashed_unless_asked_in_clear(
    repo: Path, data: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    secret = "hf_SECRET_token_value_123"
    monkeypatch.setenv("HF_TOKEN", secret)
    monkeypatch.setenv("MY_FLAG", "on")
    rec = _capture(repo, data, extra_env=["HF_TOKEN", "MY_FLAG"], clear_env=["MY_FLAG"])
    text = json.dumps(rec.to_json())
    assert secret not in text
    assert rec.to_json()["env"]["HF_TOKEN"] == "b3:" + blake3.blake3(secret.encode()).hexdigest()
    assert rec.to_json()["env"]["MY_FLAG"] == "on"
    monkeypatch.setenv("HF_TOKEN", secret + "x")  # another value: still a checked difference
    now = _capture(repo, data, extra_env=["HF_TOKEN", "MY_FLAG"], clear_env=["MY_FLAG"])
    assert now.differences(rec) == ["env.HF_TOKEN"]
    with pytest.raises(ConfigError, match="clear_env names"):
        _capture(repo, data, clear_env=["OTHER"])


def test_container_platform_and_determinism_are_recorded(
    repo: Path, data: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import platform

    import torch

    for var in (*IMAGE_ENV, *IMAGE_DIGEST_ENV):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("CONTAINER_IMAGE_DIGEST", "sha256:" + "b" * 64)
    doc = _capture(repo, data).to_json()
    assert doc["container"] == {
        "image": None,
        "image_digest": "sha256:" + "b" * 64,
        "source": "CONTAINER_IMAGE_DIGEST",
    }
    assert doc["platform"]["os"] == platform.system()
    assert doc["platform"]["kernel"] == platform.release()
    flags = doc["determinism"]
    assert flags["deterministic_algorithms"] is torch.are_deterministic_algorithms_enabled()
    assert flags["cudnn_benchmark"] is torch.backends.cudnn.benchmark
    assert flags["cuda_matmul_allow_tf32"] is torch.backends.cuda.matmul.allow_tf32
    assert flags["float32_matmul_precision"] == torch.get_float32_matmul_precision()
    assert doc["execution"] == {
        "micro_batch": 4, "accumulation": 1, "workers": 0, "worker_mode": "process",
        "precision": None,
    }  # fmt: skip
    given = _capture(repo, data, image="img:1", image_digest="sha256:" + "c" * 64).to_json()
    assert given["container"]["source"] == "image=, image_digest="


def test_a_checkout_git_refuses_is_reported_as_such(tmp_path: Path, data: Path) -> None:
    """A checkout owned by another user: git refuses it ("dubious ownership"); the record says
    so (not "not a git repository") and capture refuses without allow_dirty."""
    import os

    if os.geteuid() != 0:
        pytest.skip("needs root to give the checkout to another user")
    other = tmp_path / "theirs"
    other.mkdir()
    _git(other, "init", "-q")
    (other / "train.py").write_text("x = 1\n")
    _git(other, "add", "train.py")
    _git(other, "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-q", "-m", "x")
    subprocess.run(["chown", "-R", "65534:65534", str(other)], check=True)
    with pytest.raises(ConfigError, match=r"dubious ownership.*safe\.directory"):
        _capture(other, data, lock_files=[])
    rec = _capture(other, data, lock_files=[], allow_dirty=True)
    code = rec.to_json()["code"]
    assert code["dirty"] is None and "git refused the checkout" in code["note"]
    assert "not in a git repository" not in code["note"]


@pytest.mark.parametrize(
    "edit",
    [
        _edit(("gpus",), "NVIDIA H100"),
        _edit(("gpus",), ["NVIDIA H100"]),
        _edit(("code",), None),
        _edit(("packages", "list"), "numpy"),
        _edit(("packages",), "b3:00"),
        _edit(("data", "seeds"), [7]),
        _edit(("data", "loader"), None),
        _edit(("env",), ["A"]),
        _edit(("execution",), 3),
        _edit(("versions",), None),
    ],
)
def test_a_tampered_record_is_a_clear_error(
    repo: Path, data: Path, edit: Callable[[dict[str, Any]], None]
) -> None:
    rec = _capture(repo, data)
    doc = copy.deepcopy(rec.to_json())
    edit(doc)
    with pytest.raises(StateError, match="run record"):
        rec.verify(doc)
    with pytest.raises(StateError):
        RunRecord.from_json(json.dumps(doc))


def test_a_format_1_record_is_read_and_its_new_sections_differ_by_name(
    repo: Path, data: Path
) -> None:
    rec = _capture(repo, data)
    old = copy.deepcopy(rec.to_json())
    for section in ("execution", "determinism", "platform", "container"):
        del old[section]
    old["format_version"] = 1
    saved = RunRecord.from_json(old)
    diffs = rec.differences(saved)
    assert diffs and {d.split(".")[0] for d in diffs} <= {
        "execution", "determinism", "platform", "container",
    }  # fmt: skip
    with pytest.raises(StateError):
        rec.verify(saved)
    rec.verify(saved, allow=["execution", "determinism", "platform", "container"])


def test_allowing_an_env_or_determinism_name_neither_record_holds_is_refused(
    repo: Path, data: Path
) -> None:
    """``allow=["env.ANYTHING"]`` was accepted and allowed nothing: a typo said nothing."""
    rec = _capture(repo, data)
    held = [n for n in rec.fields() if n.startswith("env.")]
    assert held  # the record holds some env names: allowing one of them is fine
    rec.verify(rec, allow=[held[0]])
    for name in ("env.ANYTHING", "env.CUBLAS_WORKSPACE_CONFG", "determinism.nope"):
        with pytest.raises(ConfigError, match=rf"allow= names \['{re.escape(name)}'\]"):
            rec.verify(rec, allow=[name])


# -- package versions in PEP 440 normal form (issue 40) ---------------------------------------
def _spellings(count: int) -> list[str]:
    """Versions spelt every way PEP 440 allows (and some it does not), from a fixed seed."""
    rng = random.Random(40)

    def case(text: str) -> str:
        return "".join(c.upper() if rng.random() < 0.5 else c for c in text)

    def sep() -> str:
        return rng.choice(["", "", "-", "_", "."])

    def num() -> str:
        return rng.choice(["", "0", "1", "01", "10", "007", "123456789012345678901234567890"])

    out = []
    for _ in range(count):
        text = rng.choice(["", "", "v", "V", " "])
        text += rng.choice(["", "", "0!", "1!", "02!"])
        text += ".".join(
            rng.choice(["0", "1", "01", "2", "10", "000"]) for _ in range(rng.randint(1, 4))
        )
        if rng.random() < 0.5:
            letter = rng.choice(["a", "alpha", "b", "beta", "c", "rc", "pre", "preview"])
            text += sep() + case(letter) + sep() + num()
        if rng.random() < 0.4:
            letter = rng.choice(["post", "rev", "r"])
            text += rng.choice(["-" + (num() or "1"), sep() + case(letter) + sep() + num()])
        if rng.random() < 0.4:
            text += sep() + case("dev") + sep() + num()
        if rng.random() < 0.3:
            text += "+" + rng.choice(["-", "_", "."]).join(
                case(rng.choice(["ubuntu", "cpu", "cu121", "01", "7", "abc0"]))
                for _ in range(rng.randint(1, 3))
            )
        if rng.random() < 0.1:  # something PEP 440 refuses
            text += rng.choice(["-custom", "+", "..", "!", " x", "+a..b", "rc1rc2"])
        out.append(text + rng.choice(["", "", " ", "\t"]))
    return out


def test_versions_take_the_pep440_normal_form_packaging_gives() -> None:
    """Reference: ``str(packaging.version.Version(v))`` (packaging, the reference
    implementation, is a dev requirement; detdata does not depend on it at run time). What
    packaging cannot parse is kept exactly as spelt."""
    from packaging.version import InvalidVersion, Version

    cases = [
        *_spellings(6000),
        *("1.0RC1", "1.0rc1", "1.0-rc.1", "v1.0c1", "1.0-1", "1.0post", "1!1.0", "0!1.0"),
        *("1.0+Ubuntu-01", "2.13.0+cpu", "2024.01.15", "2.0-custom", "abc", "", "1.0+"),
        *("\u0661.\u0660", "1.0\u017f1", "1.0.dev", "1.0.DEV-3", "1.0a1.post2.dev3+abc.DEF-ghi"),
    ]
    invalid = 0
    for version in cases:
        try:
            want = str(Version(version))
        except InvalidVersion:
            want, invalid = version, invalid + 1
        assert normalise_version(version) == want, repr(version)
    assert 100 < invalid < len(cases) // 4  # both kinds were tried


def test_two_spellings_of_one_version_give_one_packages_digest() -> None:
    """``1.0RC1`` vs ``1.0rc1`` gave two digests: a resume refused for a spelling."""
    upper = packages_section(package_list([("Foo_Bar", "1.0RC1"), ("torch", "2.13.0+CPU")]))
    lower = packages_section(package_list([("foo-bar", "1.0rc1"), ("torch", "2.13.0+cpu")]))
    assert upper == lower
    assert upper["list"] == [["foo-bar", "1.0rc1"], ["torch", "2.13.0+cpu"]]
    other = packages_section(package_list([("foo-bar", "1.0rc2"), ("torch", "2.13.0+cpu")]))
    assert other["digest"] != upper["digest"]
    kept = package_list([("foo", "2.0-Custom")])  # not PEP 440: kept as spelt
    assert kept == [["foo", "2.0-Custom"]]


def _install(site: Path, version: str) -> None:
    """A real installed distribution ``Fake_Pkg`` at ``version`` (what importlib reads)."""
    info = site / "Fake_Pkg-1.0.dist-info"
    info.mkdir(parents=True, exist_ok=True)
    (info / "METADATA").write_text(
        f"Metadata-Version: 2.1\nName: Fake_Pkg\nVersion: {version}\n", encoding="utf-8"
    )


def test_a_resume_after_a_respelt_version_passes_and_a_new_version_is_refused(
    repo: Path, data: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    site = tmp_path / "site"
    _install(site, "1.0RC1")
    monkeypatch.syspath_prepend(str(site))
    saved = _capture(repo, data)
    assert ["fake-pkg", "1.0rc1"] in saved.to_json()["packages"]["list"]
    _install(site, "1.0rc1")
    _capture(repo, data).verify(saved.to_json())
    _install(site, "1.0rc2")
    with pytest.raises(StateError, match=r"packages: fake-pkg saved 1\.0rc1, now 1\.0rc2"):
        _capture(repo, data).verify(saved.to_json())


def test_a_record_saved_before_normal_versions_reads_with_its_versions_normalised(
    repo: Path, data: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A record an earlier detdata saved holds versions as spelt, with the blake3 of that
    list's canonical JSON (sorted keys, no spaces): read, it matches today's capture."""
    site = tmp_path / "site"
    _install(site, "1.0rc1")
    monkeypatch.syspath_prepend(str(site))
    now = _capture(repo, data)
    old = copy.deepcopy(now.to_json())
    spelt = [[n, "1.0RC1" if n == "fake-pkg" else v] for n, v in old["packages"]["list"]]
    text = json.dumps(spelt, separators=(",", ":"), ensure_ascii=False).encode()
    old["packages"] = {"digest": "b3:" + blake3.blake3(text).hexdigest(), "list": spelt}
    now.verify(old)
    edited = copy.deepcopy(old)  # a digest that is not its list's: compared as saved
    edited["packages"]["digest"] = "b3:" + "0" * 64
    with pytest.raises(StateError, match="packages"):
        now.verify(edited)
