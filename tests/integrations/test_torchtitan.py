"""torchtitan 0.3: its own ``Trainer.train()`` and DCP ``CheckpointManager`` over
`detdata.integrations.torchtitan.TorchtitanDataLoader`, 2 ranks (FSDP, gloo) then a resume at 1.

The rows the model got at each step (recorded in ``forward_backward_step``, titan_script.py)
are compared with the rows of an uninterrupted plain `detdata.DataLoader` over the same
windows (1 rank, one batch a step): the independent reference.
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

SCRIPT = Path(__file__).resolve().parent / "titan_script.py"
REPO = Path(__file__).resolve().parents[2]
VOCAB = 2048  # the llama3 debugmodel's
SEQ, GLOBAL, SEED = 16, 8, 3
# 30 + 14 = 44 windows of 17 tokens: step 6 (positions 40-47) crosses detdata's epoch boundary
SHARD_TOKENS = (481, 225)


def _manifest(root: Path) -> str:
    data = root / "tokens"
    data.mkdir(parents=True)
    rng = np.random.default_rng(11)
    for i, size in enumerate(SHARD_TOKENS):
        np.save(data / f"shard-{i}.npy", rng.integers(0, VOCAB, size=size).astype(np.uint16))
    path = root / "manifest.json"
    detdata.build_manifest(str(data), pattern="*.npy").save(str(path))
    return str(path)


def _digest(inputs: np.ndarray, labels: np.ndarray) -> str:
    h = hashlib.sha256(inputs.astype(np.int64).tobytes())
    h.update(labels.astype(np.int64).tobytes())
    return h.hexdigest()[:16]


def _reference(manifest: str, steps: int) -> list[list[str]]:
    """Per step, the rows of an uninterrupted plain detdata.DataLoader (inputs, next tokens)."""
    loader = detdata.DataLoader(
        detdata.TokenWindows(manifest, seq_len=SEQ), global_batch_size=GLOBAL, seed=SEED
    )
    out = []
    for _, batch in zip(range(steps), loader, strict=False):
        tokens = batch["tokens"].numpy()
        out.append([_digest(row[:-1], row[1:]) for row in tokens])
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


def _steps_seen(out: Path, tag: str, world: int) -> dict[int, list[str]]:
    """Rows per global step in global position order: micro batch k of rank r covers the
    positions after those of micro batch k of ranks < r (docs/design.md section 4)."""
    per_rank = [
        json.loads((out / f"trace-{tag}-rank{r}.json").read_text())["records"] for r in range(world)
    ]
    steps = sorted({rec["step"] for recs in per_rank for rec in recs})
    seen = {}
    for step in steps:
        micro = [[rec["rows"] for rec in recs if rec["step"] == step] for recs in per_rank]
        assert len({len(m) for m in micro}) == 1, f"step {step}: ranks differ in micro batches"
        seen[step] = [row for k in range(len(micro[0])) for m in micro for row in m[k]]
    return seen


@pytest.mark.slow
@pytest.mark.multiproc
def test_trainer_checkpoint_at_2_ranks_resumed_at_1_rank_sees_the_uninterrupted_rows(
    tmp_path: Path,
) -> None:
    manifest = _manifest(tmp_path)
    out = tmp_path / "out"
    out.mkdir()
    base = {"manifest": manifest, "dump": str(tmp_path / "dump"), "out": str(out)}
    base |= {"global_batch": GLOBAL, "seq_len": SEQ, "seed": SEED, "steps": 6, "interval": 3}
    # 2 ranks x local batch 2 x 2 micro batches a step; preempted after the step-3 checkpoint
    _torchrun(2, {**base, "tag": "first", "local_batch": 2, "stop_at": 3})
    assert sorted(p.name for p in (tmp_path / "dump" / "checkpoint").iterdir()) == ["step-3"]
    # restart at 1 rank x local batch 4 x 2 micro batches: torchtitan loads step-3 (DCP)
    _torchrun(1, {**base, "tag": "resumed", "local_batch": 4, "stop_at": 6})

    first, resumed = _steps_seen(out, "first", 2), _steps_seen(out, "resumed", 1)
    assert sorted(first) == [1, 2, 3]
    assert sorted(resumed) == [4, 5, 6]
    reference = _reference(manifest, 6)
    for step in range(1, 7):
        seen = first[step] if step <= 3 else resumed[step]
        assert seen == reference[step - 1], f"step {step}: the model saw other rows"


def test_adapter_refuses_what_would_break_exactness(tmp_path: Path) -> None:
    """No global batch; windows without the label token; a state saved inside a step."""
    from detdata.integrations.torchtitan import TorchtitanDataLoader, titan_batch

    manifest = _manifest(tmp_path)
    kwargs = {"dp_world_size": 2, "dp_rank": 1, "seq_len": SEQ, "local_batch_size": 2}
    with pytest.raises(detdata.ConfigError, match=r"global_batch_size=\.\.\.\) is required"):
        TorchtitanDataLoader.Config(dataset_path=manifest).build(**kwargs)
    with pytest.raises(detdata.ConfigError, match=r"\(read_ahead=\.\.\.\) is now .*batches_ahead"):
        TorchtitanDataLoader.Config(dataset_path=manifest, read_ahead=4)  # renamed, no alias
    bare = detdata.TokenWindows(manifest, seq_len=SEQ, labels=False)
    batch = next(iter(detdata.DataLoader(bare, global_batch_size=4)))
    with pytest.raises(detdata.ConfigError, match=r"seq_len \+ 1 = 17 tokens"):
        titan_batch(batch, SEQ)

    loader = TorchtitanDataLoader.Config(
        dataset_path=manifest, global_batch_size=GLOBAL, seed=SEED
    ).build(tokenizer=None, snapshot_every_n_steps=None, **kwargs)
    batches = iter(loader)
    inputs, labels = next(batches)
    assert inputs["input"].shape == labels.shape == (2, SEQ)
    assert inputs["positions"].tolist() == [list(range(SEQ))] * 2
    # one micro batch of the two that make a step of this rank: torchtitan's global batch
    # differs from the loader's, the state would not be a step boundary
    with pytest.raises(detdata.ConfigError, match="inside an optimizer step"):
        loader.state_dict()
    next(batches)
    assert loader.state_dict()["samples_consumed"] == GLOBAL


def _titan_trace(out: Path, tag: str) -> dict[str, Any]:
    return dict(json.loads((out / f"trace-{tag}-rank0.json").read_text()))


@pytest.mark.multiproc
def test_a_training_global_batch_that_differs_is_refused_at_the_first_batch(
    tmp_path: Path,
) -> None:
    """training.global_batch_size 16 (4 micro batches of 4) over a loader of global batch 8:
    torchtitan's steps would not be detdata's. Refused when torchtitan's Trainer starts
    iterating, before any micro batch reaches the model, naming the setting that agrees."""
    out = tmp_path / "out"
    out.mkdir()
    cfg = {"manifest": _manifest(tmp_path), "dump": str(tmp_path / "dump"), "out": str(out)}
    cfg |= {"global_batch": GLOBAL, "titan_global_batch": 2 * GLOBAL, "local_batch": 4}
    cfg |= {"seq_len": SEQ, "seed": SEED, "steps": 2, "interval": 10, "stop_at": 2}
    _torchrun(1, {**cfg, "tag": "mismatch"})
    trace = _titan_trace(out, "mismatch")
    assert trace["records"] == []
    assert trace["refused"].startswith("ConfigError: torchtitan (training.global_batch_size)")
    assert "4 micro batch(es) of 4 samples" in trace["refused"]
    assert f"config.training.global_batch_size = {GLOBAL}" in trace["refused"]


@pytest.mark.multiproc
@pytest.mark.slow
def test_a_resume_whose_loader_starts_at_position_0_is_refused_at_the_first_batch(
    tmp_path: Path,
) -> None:
    """A checkpoint at step 3, resumed with ``checkpoint.exclude_from_loading=["dataloader"]``:
    torchtitan restores the model, optimizer and step 3, the loader stands at position 0 and
    would train the run's first rows again. Refused at the first batch, before the model
    gets a micro batch."""
    out = tmp_path / "out"
    out.mkdir()
    cfg = {"manifest": _manifest(tmp_path), "dump": str(tmp_path / "dump"), "out": str(out)}
    cfg |= {"global_batch": GLOBAL, "local_batch": 4, "seq_len": SEQ, "seed": SEED}
    cfg |= {"steps": 6, "interval": 3}
    _torchrun(1, {**cfg, "tag": "first", "stop_at": 3})
    assert _titan_trace(out, "first")["refused"] is None
    _torchrun(1, {**cfg, "tag": "resumed", "stop_at": 6, "exclude_dataloader": True})
    trace = _titan_trace(out, "resumed")
    assert trace["records"] == []
    assert trace["refused"].startswith("StateError: torchtitan resumes after optimizer step 3")
    assert "starts at position 0" in trace["refused"]


@pytest.mark.multiproc
@pytest.mark.slow
def test_a_resume_over_shards_edited_under_a_rewritten_receipt_is_refused_at_the_first_batch(
    tmp_path: Path,
) -> None:
    """Issue 43, through torchtitan's DCP checkpoint: after the step-3 checkpoint every shard
    is edited in place (same size, other tokens) and the verification receipt rewritten to
    vouch for the edited files, so the start-up check passes and every checked field is
    equal. The resume attestation re-derives the last samples before the checkpoint and
    refuses at the first batch, before the model gets a micro batch, naming the position."""
    import re
    import time

    from detdata.identity import receipts
    from detdata.identity.manifest import Manifest

    out = tmp_path / "out"
    out.mkdir()
    manifest = _manifest(tmp_path)
    cfg = {"manifest": manifest, "dump": str(tmp_path / "dump"), "out": str(out)}
    cfg |= {"global_batch": GLOBAL, "local_batch": 4, "seq_len": SEQ, "seed": SEED}
    cfg |= {"steps": 6, "interval": 3}
    _torchrun(1, {**cfg, "tag": "first", "stop_at": 3})
    assert _titan_trace(out, "first")["refused"] is None
    for shard in sorted((tmp_path / "tokens").glob("*.npy")):
        tokens = np.load(shard)
        np.save(shard, ((tokens.astype(np.int64) + 1) % VOCAB).astype(tokens.dtype))
    time.sleep(receipts.RACY_S + 0.2)
    loaded = Manifest.load(manifest, verify="off")
    path = receipts.receipt_path(loaded)
    assert path is not None and os.path.exists(path) and loaded.root is not None
    ids = receipts.local_identities(loaded.root, [s.path for s in loaded.shards])
    receipts.write_receipt(path, loaded, detdata.Verify.QUICK, None, ids)

    _torchrun(1, {**cfg, "tag": "resumed", "stop_at": 6})
    trace = _titan_trace(out, "resumed")
    assert trace["records"] == []
    refused = trace["refused"]
    assert refused.startswith("StateError: resume attestation failed at step 3"), refused
    found = re.search(r"at global position (\d+)", refused)
    assert found and 3 * GLOBAL - 4 <= int(found.group(1)) < 3 * GLOBAL
