"""The ``detdata`` console command: manifest build, verify, hash, register, inspect, order.

The must-show flows run the real console script in a subprocess; edge cases go
through ``detdata.cli.main.main`` in-process (same parser, same exit-code mapping)
to keep the suite fast.

Covers: detdata/cli/order.py.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import blake3
import numpy as np
import pytest

from detdata import cli
from detdata.identity.build import build_manifest
from detdata.identity.manifest import Manifest
from detdata.order.feistel import GlobalOrder
from tests.conftest import write_token_shards

pytestmark = pytest.mark.multiproc  # runs the real console command / child processes

MiB = 1 << 20


def console() -> list[str]:
    script = Path(sys.executable).parent / "detdata"
    return [str(script)] if script.exists() else [sys.executable, "-m", "detdata.cli.main"]


def run(*args: str, cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
    """Run the installed ``detdata`` console script."""
    return subprocess.run(
        [*console(), *args], capture_output=True, text=True, cwd=cwd, timeout=120, check=False
    )


def call(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str, str]:
    """``detdata.cli.main.main`` in-process: (exit code, stdout, stderr); argparse exits
    included."""
    try:
        code = cli.main(list(args))
    except SystemExit as exc:
        code = int(exc.code or 0)
    out, err = capsys.readouterr()
    return code, out, err


@pytest.fixture
def big_shards(tmp_path: Path) -> Path:
    """Shards where ``shard-001.npy`` is 3 MiB (a middle byte escapes the quick digest)."""
    root = tmp_path / "data"
    write_token_shards(root, (100, 3 * MiB // 2, 50))
    return root


# ---------------------------------------------------------------- must show (subprocess)
def test_build_then_verify_quick_and_full(big_shards: Path, tmp_path: Path) -> None:
    """A changed middle byte is found by ``--full`` only; a truncation by the default check."""
    out = tmp_path / "m.json"
    built = run(
        "manifest",
        "build",
        str(big_shards),
        "--pattern",
        "*.npy",
        "--format",
        "npy",
        "--meta",
        "tokenizer=b3:tok",
        "--meta",
        "description=test set",
        "-o",
        str(out),
    )
    assert built.returncode == 0, built.stderr
    expected = build_manifest(
        str(big_shards), metadata={"tokenizer": "b3:tok", "description": "test set"}
    )
    assert built.stdout.strip() == expected.id == Manifest.load(str(out)).id
    # not a terminal: no bar; the closing lines of the listing and the hashing (issue 46)
    assert [ln.split(":")[1] for ln in built.stderr.splitlines()] == [" listing files", " hashing"]
    assert "hashing: 3/3 (100%)" in built.stderr and "done in" in built.stderr

    middle = big_shards / "shard-001.npy"  # 3 MiB: its middle is outside the quick digest
    data = bytearray(middle.read_bytes())
    data[len(data) // 2] ^= 0x01
    middle.write_bytes(bytes(data))
    truncated = big_shards / "shard-002.npy"
    size = truncated.stat().st_size
    truncated.write_bytes(truncated.read_bytes()[:-4])

    quick = run("verify", str(out))
    assert quick.returncode == 1
    assert "shard-002.npy" in quick.stderr and "shard-001.npy" not in quick.stderr
    assert f"expected {size} bytes, found {size - 4}" in quick.stderr

    full = run("verify", str(out), "--full")
    assert full.returncode == 1
    assert "shard-001.npy" in full.stderr and "blake3 mismatch" in full.stderr
    assert expected.shards[1].blake3 in full.stderr
    assert "b3:" + blake3.blake3(bytes(data)).hexdigest() in full.stderr


def test_order_from_console() -> None:
    order = run("order", "--n", "1000", "--seed", "7", "--at", "990", "--count", "25")
    assert order.returncode == 0, order.stderr
    expected = GlobalOrder(1000, 7).ids(np.arange(990, 1015))
    assert [int(x) for x in order.stdout.split()] == expected.tolist()


def test_usage_error_exit_code_from_console() -> None:
    missing = run("verify")  # argparse: missing MANIFEST
    assert missing.returncode == 2 and "MANIFEST" in missing.stderr


# ---------------------------------------------------------------- in-process edge cases
def test_moved_directory_verify_with_root(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, token_shards: Path
) -> None:
    code, out, _ = call(
        capsys, "manifest", "build", str(token_shards), "-o", str(tmp_path / "m.json")
    )
    assert code == 0
    first_id = out.strip()
    moved = tmp_path / "moved"
    shutil.move(str(token_shards), moved)
    code, _, err = call(capsys, "verify", str(tmp_path / "m.json"))
    assert code == 1 and "missing" in err
    code, out, _ = call(capsys, "verify", str(tmp_path / "m.json"), "--root", str(moved), "--full")
    assert code == 0 and out.startswith(f"ok {first_id} ") and "verify=full" in out
    code, out, _ = call(capsys, "manifest", "build", str(moved), "-o", str(tmp_path / "m2.json"))
    assert code == 0 and out.strip() == first_id


def test_build_options(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    (tmp_path / "d").mkdir()
    (tmp_path / "d" / "a.bin").write_bytes(np.arange(100, dtype=np.uint32).tobytes())
    out = str(tmp_path / "m.json")
    code, _, err = call(capsys, "manifest", "build", str(tmp_path / "d"), "-o", out)
    assert code == 2 and "declared dtype" in err
    code, stdout, _ = call(
        capsys, "manifest", "build", str(tmp_path / "d"), "--dtype", "uint32", "-o", out
    )
    assert code == 0
    (shard,) = Manifest.load(out).shards
    assert (shard.dtype, shard.num_samples) == ("uint32", 100)
    assert stdout.strip() == Manifest.load(out).id
    for bad in (["--meta", "novalue"], ["--meta", "=x"], ["--format", "csv"], []):
        args = ["manifest", "build", str(tmp_path / "d"), "--dtype", "uint32", *bad]
        if bad:
            args += ["-o", out]
        code, _, err = call(capsys, *args)
        assert code == 2, (bad, err)
    code, _, err = call(
        capsys,
        "manifest",
        "build",
        str(tmp_path / "d"),
        "--dtype",
        "uint32",
        "--meta",
        "k=1",
        "--meta",
        "k=2",
        "-o",
        out,
    )
    assert code == 2 and "--meta k= given twice" in err
    code, _, err = call(capsys, "manifest", "build", str(tmp_path / "nope"), "-o", out)
    assert code == 2 and "does not exist" in err


def test_verify_bad_manifest_is_usage_error(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    code, _, err = call(capsys, "verify", str(tmp_path / "nope.json"))
    assert code == 2 and "not found" in err
    (tmp_path / "bad.json").write_text("{broken")
    code, _, err = call(capsys, "verify", str(tmp_path / "bad.json"))
    assert code == 2 and "malformed JSON" in err


def test_hash(capsys: pytest.CaptureFixture[str], token_shards: Path) -> None:
    files = sorted(str(p) for p in token_shards.iterdir())
    code, out, _ = call(capsys, "hash", *files)
    assert code == 0
    expected = [
        f"b3:{blake3.blake3(Path(f).read_bytes()).hexdigest()}  {Path(f).stat().st_size}  {f}"
        for f in files
    ]
    assert out.splitlines() == expected
    code, _, err = call(capsys, "hash", str(token_shards / "nope"))
    assert code == 2 and "not found" in err


def test_register_conflicts_and_force(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, token_shards: Path
) -> None:
    reg = str(tmp_path / "reg")
    a, b = str(tmp_path / "a.json"), str(tmp_path / "b.json")
    build_manifest(str(token_shards), metadata={"v": 1}).save(a)
    id_b = build_manifest(str(token_shards), metadata={"v": 2}).save(b)
    assert call(capsys, "register", a, "ds@v1", "--registry", reg)[0] == 0
    code, _, err = call(capsys, "register", b, "ds@v1", "--registry", reg)
    assert code == 2 and "already points at" in err and "--force" in err
    code, out, _ = call(capsys, "register", b, "ds@v1", "--registry", reg, "--force")
    assert code == 0 and out.strip() == id_b
    code, _, err = call(capsys, "register", a, "bad name", "--registry", reg)
    assert code == 2 and "invalid registry name 'bad name'" in err
    (token_shards / "shard-000.npy").write_bytes(b"x")
    code, _, err = call(capsys, "register", a, "ds@v2", "--registry", reg)
    assert code == 1 and "shard-000.npy" in err
    assert call(capsys, "register", a, "ds@v2", "--registry", reg, "--verify", "off")[0] == 0


def test_register_then_inspect_name(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, token_shards: Path
) -> None:
    m = build_manifest(str(token_shards))
    m.save(str(tmp_path / "m.json"))
    registry = str(tmp_path / "reg")
    code, out, _ = call(
        capsys, "register", str(tmp_path / "m.json"), "ds@v1", "--registry", registry
    )
    assert code == 0 and out.strip() == m.id
    code, out, _ = call(capsys, "inspect", "ds", "--registry", registry)
    assert code == 0
    summary = json.loads(out)
    assert summary["id"] == m.id and summary["num_samples"] == m.num_samples
    assert summary["root"] == str(token_shards) and summary["num_shards"] == 3
    assert [(e["name"], e["id"]) for e in summary["history"]] == [("ds@v1", m.id)]


def test_inspect_id_file_and_env_registry(
    capsys: pytest.CaptureFixture[str],
    tmp_path: Path,
    token_shards: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    m = build_manifest(str(token_shards), metadata={"tokenizer": "t"})
    path = str(tmp_path / "m.json")
    m.save(path)
    monkeypatch.setenv("DETDATA_REGISTRY", str(tmp_path / "env-reg"))
    assert call(capsys, "register", path, "ds@v1")[0] == 0
    code, out, _ = call(capsys, "inspect", m.id)
    assert code == 0
    by_id = json.loads(out)
    assert by_id["id"] == m.id and by_id["root"] is None and by_id["source"] == "registry"
    code, out, _ = call(capsys, "inspect", path)
    by_file = json.loads(out)
    assert by_file["source"] == "file" and by_file["metadata"] == {"tokenizer": "t"}
    assert by_file["shards"] == [s.path for s in m.shards]
    code, _, err = call(capsys, "inspect", "unknown@v1")
    assert code == 2 and "unknown@v1 is not in registry" in err


def test_order_edge_cases(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = call(capsys, "order", "--n", "1", "--seed", "0", "--at", "0", "--count", "3")
    assert code == 0 and out.split() == ["0", "0", "0"]
    code, out, _ = call(
        capsys, "order", "--n", str(10**12), "--seed", str(2**64 - 1), "--at", str(5 * 10**12)
    )
    assert code == 0 and int(out) == GlobalOrder(10**12, 2**64 - 1)[5 * 10**12]
    for bad in (
        ["--seed", "-1"],
        ["--seed", str(2**64)],
        ["--at", "-5"],
        ["--count", "0"],
        ["--n", "x"],
    ):
        base = {"--n": "10", "--seed": "1", "--at": "0", "--count": "1"}
        base[bad[0]] = bad[1]
        args = [item for pair in base.items() for item in pair]
        code, _, err = call(capsys, "order", *args)
        assert code == 2, (bad, err)


def test_build_in_parts_then_merge_gives_the_one_machine_id(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """``manifest build --part I/N`` on N machines, ``manifest merge``: the id of one build."""
    root = tmp_path / "data"
    write_token_shards(root, (40, 90, 10, 70, 55))
    whole = build_manifest(str(root), metadata={"k": "v"})
    parts = []
    for i in range(3):
        out = tmp_path / f"part-{i}.json"
        code, text, err = call(
            capsys, "manifest", "build", str(root), "--meta", "k=v", "--part", f"{i}/3",
            "-o", str(out),
        )  # fmt: skip
        assert code == 0, err
        assert text.startswith(f"part {i}/3: ")
        parts.append(str(out))
    code, text, err = call(
        capsys, "manifest", "merge", *parts[::-1], "-o", str(tmp_path / "m.json")
    )
    assert code == 0, err
    assert text.strip() == whole.id == Manifest.load(str(tmp_path / "m.json")).id
    code, _, err = call(capsys, "manifest", "merge", parts[0], parts[2], "-o", str(tmp_path / "x"))
    assert code == 2 and "missing [1]" in err
    code, _, err = call(capsys, "manifest", "build", str(root), "--part", "3/3", "-o", "x.json")
    assert code == 2 and "0 <= I < N" in err
