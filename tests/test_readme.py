"""Every code block of README.md runs as written (issue 34).

The test extracts the fenced blocks of the README and runs the Python ones, in order, in one
namespace (the README reads as one story: the Quickstart's loader is the one whose step 41,000
spiked), inside a temporary folder holding tiny data prepared here: ``data/wiki-en/*.npy``
token shards for the Quickstart, a Megatron ``corpus/P.bin`` + ``P.idx`` for "Real corpora".
Names a block borrows from the reader's own script (a model, a config) are bound by
``PRELUDES``, keyed by the block's first line, and each is the real object (a torch module, a
dict), never a stand-in for detdata. The shell blocks that a test machine can run are run
through ``bash`` in the same folder (``SHELL_RUN``); every other block is listed in ``NOT_RUN``
with the reason and the test that runs the same calls, so a new block cannot go untested.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import warnings
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest

from tests.datasets.doc_corpora import random_documents, write_megatron

pytestmark = pytest.mark.multiproc  # the shell blocks run the real console command

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
FENCE = re.compile(r"^```(\w*)\n(.*?)^```", re.M | re.S)


@dataclass(frozen=True, kw_only=True)
class Block:
    """One fenced block: its language tag, first line, text and line number in README.md."""

    lang: str
    first: str
    code: str
    line: int


def readme_blocks() -> list[Block]:
    """Every fenced block of README.md, in order."""
    text = README.read_text()
    out = []
    for m in FENCE.finditer(text):
        code = m.group(2)
        line = text.count("\n", 0, m.start()) + 2
        out.append(Block(lang=m.group(1), first=code.splitlines()[0].strip(), code=code, line=line))
    return out


# Names a block takes from the reader's script; each value is Python run before the block.
PRELUDES: dict[str, str] = {
    "import detdata": "max_steps = 2\n",
    "from detdata import RunRecord, Split": "cfg = {'lr': 3e-4, 'model': 'gpt-tiny'}\n",
}

# Blocks not run here, with the reason and the test that runs the same calls.
NOT_RUN: dict[str, str] = {
    "make demo   # builds a byte-level corpus from the Python stdlib, registers 3 manifests,": (
        "builds a virtual environment; .ci/run runs `make test`, tests/cli runs `detdata demo`"
    ),
    "loader = detdata.DataLoader(ds, global_batch_size=512, micro_batch_size=8, seed=1234)": (
        "Lightning on 8 devices: tests/integrations/test_lightning.py runs the same calls on 1-2"
    ),
    "loader = detdata.DataLoader(ds, global_batch_size=512, micro_batch_size=8, seed=1)": (
        "accelerate: tests/integrations/test_accelerate.py (register_for_checkpointing)"
    ),
    "sampler = detdata.DeterministicBatchSampler.sharded_by_framework(": (
        "accelerate processes: tests/integrations/test_accelerate.py"
    ),
    "from detdata.integrations.torchtitan import TorchtitanDataLoader": (
        "a torchtitan job config: tests/integrations/test_torchtitan.py"
    ),
    "import pytorch_lightning as pl": (
        "a Lightning Trainer: tests/integrations/test_lightning.py (DetdataSteps)"
    ),
    "from detdata.integrations.transformers import DetdataTrainer": (
        "a transformers Trainer with a model: tests/integrations/test_transformers.py"
    ),
    "from detdata.integrations.olmo_core import OlmoCoreDataLoader": (
        "an OLMo-core trainer: tests/integrations/test_olmo_core.py"
    ),
    "detdata where --state ckpt/loader.json --step 41000 --data train.py:build_loader [--decode"
    " train.py:detok]": "a synopsis ([optional] flags): tests/cli/test_cli_where.py",
    "detdata manifest build ROOT --pattern '**/*.npy' -o manifest.json": (
        "a synopsis of every command (ROOT, FILES...): tests/cli"
    ),
}


def _prepare(tmp: Path) -> None:
    """Tiny data at the paths the README names, in a git checkout of the user's code (the run
    record names the code; its data folders are untracked, which is not dirty)."""
    import subprocess

    (tmp / "train.py").write_text("# the user's training code\n")
    for args in (
        ["init", "-q"],
        ["add", "train.py"],
        ["-c", "user.name=t", "-c", "user.email=t@t", "commit", "-q", "-m", "code"],
    ):
        subprocess.run(["git", "-C", str(tmp), *args], check=True, capture_output=True)
    rng = np.random.default_rng(0)
    wiki = tmp / "data" / "wiki-en"
    wiki.mkdir(parents=True)
    for i in range(3):  # 3 shards, 1,200 windows of 2,049 tokens in all
        np.save(wiki / f"shard-{i:03d}.npy", rng.integers(0, 50_000, 820_000).astype(np.uint16))
    (tmp / "corpus").mkdir()
    write_megatron(tmp / "corpus" / "P", random_documents(rng, 3000, max_len=800, empty=False))


def _env(tmp: Path) -> dict[str, str]:
    return {
        **os.environ,
        "DETDATA_REGISTRY": str(tmp / "registry"),
        "PYTHONPATH": str(ROOT),
        "OMP_NUM_THREADS": "1",
        "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}",
    }


def test_every_readme_block_is_run_or_listed_with_its_reason() -> None:
    blocks = readme_blocks()
    assert len(blocks) >= 12
    unknown = [
        f"README.md:{b.line}: {b.first}"
        for b in blocks
        if b.lang != "python" and b.first not in NOT_RUN and b.first not in SHELL_RUN
    ]
    assert unknown == [], "shell blocks neither run nor listed:\n" + "\n".join(unknown)
    stale = sorted(set(NOT_RUN) - {b.first for b in blocks})
    assert stale == [], f"NOT_RUN names blocks the README no longer has: {stale}"


# Shell blocks run through bash, each command line by line (comments stripped by bash).
SHELL_RUN = {
    "detdata env --out run_record.json             # print (and save) this machine's record",
    "detdata split --manifest data/manifest.json --seq-len 2048 --fraction 0.01 --salt val-v1"
    " --out split/",
}


@pytest.mark.slow
def test_readme_python_blocks_run_as_written(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    _prepare(tmp_path)
    for key, value in _env(tmp_path).items():
        monkeypatch.setenv(key, value)
    monkeypatch.chdir(tmp_path)
    namespace: dict[str, object] = {"__name__": "__readme__"}
    ran = 0
    for block in readme_blocks():
        if block.lang != "python" or block.first in NOT_RUN:
            continue
        code = "\n" * (block.line - 1) + block.code  # tracebacks name README.md's lines
        try:
            with warnings.catch_warnings():
                warnings.simplefilter(
                    "error"
                )  # a block that warns misleads as much as one that fails
                exec(PRELUDES.get(block.first, ""), namespace)
                exec(compile(code, "README.md", "exec"), namespace)
        except Exception as exc:
            raise AssertionError(
                f"README.md:{block.line} ({block.first!r}) fails: {exc!r}"
            ) from exc
        ran += 1
    assert ran >= 5


@pytest.mark.slow
def test_readme_shell_blocks_run_as_written(tmp_path: Path) -> None:
    _prepare(tmp_path)
    env = _env(tmp_path)
    blocks = [b for b in readme_blocks() if b.first in SHELL_RUN]
    assert len(blocks) == len(SHELL_RUN)
    setup = [  # the manifest the shell blocks name, built with the README's own command
        "detdata manifest build data/wiki-en --pattern '**/*.npy' -o data/manifest.json",
    ]
    for line in [*setup, *(ln for b in blocks for ln in b.code.splitlines())]:
        if not line.strip() or line.lstrip().startswith("#"):
            continue
        done = subprocess.run(
            ["bash", "-c", line],
            cwd=tmp_path,
            env=env,
            capture_output=True,
            text=True,
            timeout=600,
            check=False,
        )
        assert done.returncode == 0, f"{line}\n{done.stdout[-2000:]}\n{done.stderr[-3000:]}"
        assert "Warning" not in done.stderr, f"{line} warns:\n{done.stderr[-3000:]}"


def test_replay_check_help_lists_every_flag_it_appends_to_your_command() -> None:
    """README: "the flags it must accept are in `detdata replay-check --help`"."""
    source = (ROOT / "detdata" / "cli" / "replay.py").read_text()
    appended = set(re.findall(r'"(--[a-z-]+)"', source))  # the flags the runs pass to CMD
    assert {"--steps", "--stop-at", "--resume", "--run-dir"} <= appended
    done = subprocess.run(
        [sys.executable, "-m", "detdata.cli", "replay-check", "--help"],
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        capture_output=True,
        text=True,
        check=True,
    )
    contract = done.stdout.split("must accept", 1)
    assert len(contract) == 2, done.stdout
    missing = [flag for flag in sorted(appended) if flag not in contract[1]]
    assert missing == [], f"replay-check --help does not explain {missing}"
    assert "weights <hex" in contract[1]
