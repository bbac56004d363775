"""Every code block of README.md runs exactly as written, in order (issues 34, 46).

The test extracts the fenced blocks of the README and runs them in README order inside one
temporary folder: the Python blocks in one namespace (the README reads as one story: the
Quickstart's loader is the one whose step 41,000 spiked), the ``bash`` blocks through
``bash -e`` in the same folder, so a block that needs a file finds it only if an earlier
block made it (the Quickstart writes ``data/manifest.json``, the loss-spike block writes
``ckpt/loader.json`` and ``data_def.py``). Nothing is prepared but the reader's own inputs:
their token shards (``data/wiki-en/*.npy``), a Megatron ``corpus/P.bin`` + ``P.idx`` for
"Real corpora", and the git checkout of their code the run record names. Names a block
borrows from the reader's own script (``max_steps``, a config dict) are bound by
``PRELUDES``, keyed by the block's first line, each a real value. Every other block is
listed in ``NOT_RUN`` with the reason and the test that runs the same calls, so a new block
cannot go untested. A comment that lists a record's fields (``# fields: ...``) is checked
against every record the block prints.
"""

from __future__ import annotations

import ast
import contextlib
import io
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
from tests.datasets.text_corpora import make_documents, train_bpe, write_jsonl

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
        "builds a virtual environment; .ci/run runs `make check`, tests/cli runs `detdata demo`"
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
    texts = make_documents(400, seed=3)  # "Raw text": JSONL shards and a local tokenizer.json
    (tmp / "text").mkdir()
    write_jsonl(tmp / "text" / "part-0.jsonl", texts[:200])
    write_jsonl(tmp / "text" / "part-1.jsonl.zst", texts[200:])
    train_bpe(tmp / "tokenizer.json", texts)


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
        if b.lang not in RUNNERS and b.first not in NOT_RUN
    ]
    assert unknown == [], "blocks neither run nor listed:\n" + "\n".join(unknown)
    stale = sorted(set(NOT_RUN) - {b.first for b in blocks})
    assert stale == [], f"NOT_RUN names blocks the README no longer has: {stale}"


#: The languages whose blocks are run (every other block must be in `NOT_RUN`).
RUNNERS = ("python", "bash")
FIELDS = re.compile(r"#\s*fields:(.*?)\n(?!\s*#\s{2,})", re.S)


def promised_fields(code: str) -> list[str]:
    """The record fields a ``# fields: a, b, ...`` comment (continued on ``#`` lines) lists."""
    found = FIELDS.search(code + "\n")
    if found is None:
        return []
    text = re.sub(r"\n\s*#", " ", found.group(1))
    return [f.strip() for f in text.split(",") if f.strip()]


def _run_python(block: Block, namespace: dict[str, object]) -> None:
    """``block`` in ``namespace`` (warnings are errors); a ``# fields:`` comment must list
    exactly the keys of every record the block prints."""
    code = "\n" * (block.line - 1) + block.code  # tracebacks name README.md's lines
    out = io.StringIO()
    with warnings.catch_warnings(), contextlib.redirect_stdout(out):
        warnings.simplefilter("error")  # a block that warns misleads as much as one that fails
        exec(PRELUDES.get(block.first, ""), namespace)
        exec(compile(code, "README.md", "exec"), namespace)
    promised = promised_fields(block.code)
    if promised:
        records = [ast.literal_eval(line) for line in out.getvalue().splitlines()]
        assert records, f"README.md:{block.line} printed no record"
        for record in records:
            assert sorted(record) == sorted(promised), (
                f"README.md:{block.line}: the comment lists {promised}, a record holds "
                f"{list(record)}"
            )


def _run_bash(block: Block, tmp: Path) -> None:
    """``block`` as one ``bash -e`` script in ``tmp`` (a heredoc spans lines)."""
    done = subprocess.run(
        ["bash", "-e", "-c", block.code],
        cwd=tmp,
        env=_env(tmp),
        capture_output=True,
        text=True,
        timeout=900,
        check=False,
    )
    assert done.returncode == 0, (
        f"README.md:{block.line} ({block.first!r}) fails:\n{done.stdout[-2000:]}\n"
        f"{done.stderr[-3000:]}"
    )
    assert "Warning" not in done.stderr, f"README.md:{block.line} warns:\n{done.stderr[-3000:]}"


@pytest.mark.slow
def test_readme_blocks_run_as_written_in_order(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    _prepare(tmp_path)
    for key, value in _env(tmp_path).items():
        monkeypatch.setenv(key, value)
    monkeypatch.chdir(tmp_path)
    namespace: dict[str, object] = {"__name__": "__readme__"}
    ran = {lang: 0 for lang in RUNNERS}
    for block in readme_blocks():
        if block.lang not in RUNNERS or block.first in NOT_RUN:
            continue
        try:
            if block.lang == "python":
                _run_python(block, namespace)
            else:
                _run_bash(block, tmp_path)
        except Exception as exc:
            raise AssertionError(
                f"README.md:{block.line} ({block.first!r}) fails: {exc!r}"
            ) from exc
        ran[block.lang] += 1
    assert ran["python"] >= 5 and ran["bash"] >= 3, ran


def test_the_fields_comment_is_read_as_the_readme_writes_it() -> None:
    """`promised_fields` reads a continued comment whole (the check above rests on it)."""
    code = "print(r)  # fields: a, b_c,\n          #         d\nx = 1  # other\n"
    assert promised_fields(code) == ["a", "b_c", "d"]
    spike = next(b for b in readme_blocks() if "provenance(41_000)" in b.code)
    assert "shard" in promised_fields(spike.code) and "digest" in promised_fields(spike.code)


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
