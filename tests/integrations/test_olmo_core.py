"""OLMo-core 3.0: its own ``Trainer.fit()`` with a ``CheckpointerCallback`` over
`detdata.integrations.olmo_core.OlmoCoreDataLoader`, 2 ranks (DDP, gloo) then a resume at 1;
and its batch-size warm-up (``BatchSizeSchedulerCallback``), refused with a clear error.

The rows the model got at each step (input_ids and labels, recorded by a forward pre-hook in
olmo_script.py) are compared with the rows of an uninterrupted plain `detdata.DataLoader`
over the same windows (1 rank, one batch a step): the independent reference. One module
fixture starts the processes: 2 ranks (the first run), then 1 rank (the resumed run, then
the warm-up run in the same processes).
"""

from __future__ import annotations

import hashlib
import json
import os
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import detdata

pytestmark = [pytest.mark.multiproc, pytest.mark.slow]

SCRIPT = Path(__file__).resolve().parent / "olmo_script.py"
REPO = Path(__file__).resolve().parents[2]
VOCAB = 512  # olmo_script.py's model
SEQ, SAMPLES, SEED = 16, 8, 3  # a global batch of 8 windows = 128 tokens
IGNORE = -100  # OLMo-core's label_ignore_index: the last label of a shifted window
# 30 + 14 = 44 windows of 16 (+1) tokens: OLMo-core's epoch is 44 // 8 = 5 steps, so the
# resumed run crosses into epoch 2 at step 6, which also holds detdata's own epoch boundary
# (position 44)
SHARD_TOKENS = (481, 225)


def _manifest(root: Path) -> str:
    data = root / "tokens"
    data.mkdir(parents=True)
    rng = np.random.default_rng(12)
    for i, size in enumerate(SHARD_TOKENS):
        np.save(data / f"shard-{i}.npy", rng.integers(0, VOCAB, size=size).astype(np.uint16))
    path = root / "manifest.json"
    detdata.build_manifest(str(data), pattern="*.npy").save(str(path))
    return str(path)


def _digest(input_ids: np.ndarray, labels: np.ndarray) -> str:
    h = hashlib.sha256(input_ids.astype(np.int64).tobytes())
    h.update(labels.astype(np.int64).tobytes())
    return h.hexdigest()[:16]


def _reference(manifest: str, steps: int, *, labels: bool) -> list[list[str]]:
    """Per step, the rows of an uninterrupted plain detdata.DataLoader, as (input_ids,
    labels): with a label token, the window's first S and last S tokens; without, the window
    and the window shifted left by one, ending in the ignore index."""
    loader = detdata.DataLoader(
        detdata.TokenWindows(manifest, seq_len=SEQ, labels=labels),
        global_batch_size=SAMPLES,
        seed=SEED,
    )
    out = []
    for _, batch in zip(range(steps), loader, strict=False):
        rows = batch["tokens"].numpy().astype(np.int64)
        if labels:
            out.append([_digest(w[:-1], w[1:]) for w in rows])
        else:
            out.append([_digest(w, np.append(w[1:], IGNORE)) for w in rows])
    return out


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _torchrun(nproc: int, cfg: dict[str, Any]) -> None:
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc-per-node",
        str(nproc),
        "--master-addr",
        "127.0.0.1",
        "--master-port",
        str(_free_port()),
        str(SCRIPT),
        json.dumps(cfg),
    ]
    done = subprocess.run(cmd, env=env, timeout=300, capture_output=True, text=True)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-6000:]


def _result(out: Path, tag: str, rank: int) -> dict[str, Any]:
    data: dict[str, Any] = json.loads((out / f"trace-{tag}-rank{rank}.json").read_text())
    return data


def _steps_seen(out: Path, tag: str, world: int) -> dict[int, list[str]]:
    """Rows per global step in global position order. OLMo-core hands each rank its whole
    share of a step at once (rank r: the r-th slice of the step) and splits it into micro
    batches in order."""
    per_rank = [_result(out, tag, r)["records"] for r in range(world)]
    steps = sorted({rec["step"] for recs in per_rank for rec in recs})
    return {
        step: [
            row for recs in per_rank for rec in recs if rec["step"] == step for row in rec["rows"]
        ]
        for step in steps
    }


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, Path]:
    root = tmp_path_factory.mktemp("olmo")
    manifest = _manifest(root)
    out = root / "out"
    out.mkdir()
    shared = {"manifest": manifest, "out": str(out), "seq_len": SEQ, "seed": SEED}
    shared |= {"global_tokens": SAMPLES * SEQ, "warmup": None}
    resume = {"save": str(root / "run"), "labels": True, "steps": 6, "interval": 3}
    # 2 ranks x 4 windows each, in micro batches of 2 (32 tokens); preempted after step 3
    first = {**resume, "tag": "first", "stop_at": 3}
    _torchrun(2, {**shared, "micro_tokens": 2 * SEQ, "runs": [first]})
    # restart at 1 rank x 8 windows in micro batches of 4: OLMo-core loads step3; then, in the
    # same process (and train module), a fresh run whose batch-size warm-up doubles the batch
    # at step 2
    resumed = {**resume, "tag": "resumed", "stop_at": 6}
    warmup = {"save": str(root / "warmup"), "labels": False, "steps": 4, "interval": None}
    warmup |= {"tag": "warmup", "stop_at": 4, "warmup": 2}
    _torchrun(1, {**shared, "micro_tokens": 4 * SEQ, "runs": [resumed, warmup]})
    return manifest, out


def test_trainer_checkpoint_at_2_ranks_resumed_at_1_rank_sees_the_uninterrupted_rows(
    runs: tuple[str, Path],
) -> None:
    manifest, out = runs
    first, resumed = _steps_seen(out, "first", 2), _steps_seen(out, "resumed", 1)
    assert sorted(first) == [1, 2, 3]
    assert sorted(resumed) == [4, 5, 6]
    assert _result(out, "resumed", 0)["error"] is None
    assert _result(out, "resumed", 0)["epoch"] == 2  # OLMo-core ended epoch 1 after step 5
    reference = _reference(manifest, 6, labels=True)
    for step in range(1, 7):
        seen = first[step] if step <= 3 else resumed[step]
        assert seen == reference[step - 1], f"step {step}: the model saw other rows"


def test_batch_size_warmup_is_refused_before_a_sample_of_the_new_batch_is_read(
    runs: tuple[str, Path],
) -> None:
    manifest, out = runs
    result = _result(out, "warmup", 0)
    assert result["error"] is not None
    assert result["error"].startswith("detdata.ConfigError: global batch change ")
    assert "from 128 to 256 tokens before step 3" in result["error"]
    assert "BatchSizeSchedulerCallback" in result["error"]
    assert result["final_step"] == 2
    assert result["samples_consumed"] == 2 * SAMPLES
    seen = _steps_seen(out, "warmup", 1)
    assert [seen[1], seen[2]] == _reference(manifest, 2, labels=False)


def test_a_renamed_keyword_is_refused_naming_the_new_one() -> None:
    """``read_ahead`` is ``batches_ahead`` now (one word family for what is read ahead): the
    old spelling is a `ConfigError` naming the new one, not an alias."""
    from detdata.integrations.olmo_core import OlmoCoreDataLoader

    data = detdata.ArrayDataset({"tokens": np.zeros((8, 5), np.int64)})
    with pytest.raises(detdata.ConfigError, match=r"\(read_ahead=\.\.\.\) is now .*batches_ahead"):
        OlmoCoreDataLoader(data, global_batch_size=8, sequence_length=4, read_ahead=4)  # type: ignore[call-arg]
