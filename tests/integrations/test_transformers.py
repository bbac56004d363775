"""Hugging Face transformers 5.x ``Trainer`` over a `detdata.DataLoader`
(`detdata.integrations.transformers.DetdataTrainer`): stop, resume, exact, step for step.

Each run is a real ``Trainer.train`` in a fresh process (``hf_script.py``; two processes are
``torch.distributed.run`` on gloo, CPU; one is forked from a warm interpreter that imported
torch and transformers' Trainer once, tests/forkserver.py) with ``save_steps=3`` and a
resume through ``train(resume_from_checkpoint=...)``. Every micro batch the model is handed
is recorded with the Trainer's ``global_step`` at that moment (the optimizer step it is
accumulated into) and its ``epoch``. The reference is an uninterrupted plain
`detdata.DataLoader` iterated here by hand at each run's rank / world size / micro batch:
the Trainer's optimizer step k must hold exactly the micro batches of detdata's step k, in
order, on every rank, before and after the resume; and its ``epoch`` must be an
uninterrupted run's (an epoch is the loader's whole steps: 44 rows of global batch 8 are 5
steps, the 4 rows left over start the next epoch).
"""

from __future__ import annotations

import functools
import json
import os
import re
import shutil
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

import detdata
from tests.forkserver import Forkserver
from tests.integrations.hf_script import make_dataset, make_trainer
from tests.integrations.lightning_script import row_digests

pytest.importorskip("transformers")  # pinned in the dev extra: present in CI

pytestmark = [pytest.mark.multiproc, pytest.mark.slow]

SCRIPT = Path(__file__).with_name("hf_script.py")
ROOT = Path(__file__).resolve().parents[2]
SEED = 3
BASE = {"n": 44, "global_batch": 8, "seed": SEED, "save_steps": 3}  # 5 whole steps an epoch
FIRST_STOP, CKPT, LAST = 7, 3, 9  # first run: steps 0-6; resumed from checkpoint-3: 3-8

RUNS: dict[str, dict[str, Any]] = {
    "w1": dict(procs=1, micro=4, accum=2, workers=0),
    "w2": dict(procs=2, micro=2, accum=2, workers=0),
}
RESUMED: dict[str, tuple[str, dict[str, Any]]] = {
    "1->1": ("w1", dict(procs=1, micro=4, accum=2, workers=2)),
    "2->1": ("w2", dict(procs=1, micro=2, accum=4, workers=0)),
}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _env() -> dict[str, str]:
    return {
        **os.environ,
        "OMP_NUM_THREADS": "1",
        "PYTHONPATH": os.pathsep.join(p for p in (os.environ.get("PYTHONPATH"), str(ROOT)) if p),
    }


@pytest.fixture(scope="module")
def warm() -> Iterator[Forkserver]:
    """The warm interpreter one-process runs are forked from (what hf_script.py imports, in
    its order)."""
    preload = ["numpy", "detdata", "torch", "transformers", "detdata.integrations.transformers"]
    server = Forkserver(preload, _env())
    yield server
    server.close()


def _run(warm: Forkserver, cfg: dict[str, Any], out: Path) -> list[dict[str, Any]]:
    """One ``Trainer.train`` (one or two processes); the trace of every rank, by rank."""
    out.mkdir(parents=True, exist_ok=True)
    cfg = {**BASE, "out": str(out), "output_dir": str(out / "ck"), **cfg}
    env = _env()
    if cfg["procs"] == 1:
        done = warm.run(SCRIPT, [json.dumps(cfg)], cwd=out, env=env, timeout=400)
    else:  # a free port: torchrun's "--master_port 0" hangs the workers here
        launch = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node",
                  str(cfg["procs"]), "--master_addr", "127.0.0.1", "--master_port",
                  str(_free_port()), str(SCRIPT)]  # fmt: skip
        done = subprocess.run(
            [*launch, json.dumps(cfg)],
            cwd=out,
            env=env,
            capture_output=True,
            text=True,
            timeout=400,
            check=False,
        )
    assert done.returncode == 0, f"{cfg}\n{done.stdout[-3000:]}\n{done.stderr[-6000:]}"
    return [
        json.loads((out / f"trace-{cfg['tag']}-rank{r}.json").read_text())
        for r in range(cfg["procs"])
    ]


class Runs:
    def __init__(self, root: Path, warm: Forkserver) -> None:
        self.root = root
        self.warm = warm

    @functools.cache  # noqa: B019 (one instance per module)
    def first(self, name: str) -> list[dict[str, Any]]:
        cfg = {**RUNS[name], "tag": name, "max_steps": FIRST_STOP, "resume": None}
        return _run(self.warm, cfg, self.root / name)

    def checkpoint(self, name: str) -> Path:
        self.first(name)
        return self.root / name / "ck" / f"checkpoint-{CKPT}"

    @functools.cache  # noqa: B019
    def resumed(self, pair: str) -> list[dict[str, Any]]:
        first, settings = RESUMED[pair]
        tag = pair.replace("->", "to")
        cfg = {**settings, "tag": tag, "max_steps": LAST, "resume": str(self.checkpoint(first))}
        return _run(self.warm, cfg, self.root / tag)


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory, warm: Forkserver) -> Runs:
    return Runs(tmp_path_factory.mktemp("hf"), warm)


def reference(cfg: dict[str, Any], steps: int, rank: int) -> list[list[list[str]]]:
    """Per global step, the row digests of each of this rank's micro batches, in order, of an
    uninterrupted plain loader at the run's layout."""
    loader = detdata.DataLoader(
        make_dataset(cfg.get("n", BASE["n"])),
        global_batch_size=cfg.get("global_batch", BASE["global_batch"]),
        micro_batch_size=cfg["micro"],
        seed=SEED,
        options=detdata.LoaderOptions(rank=rank, world_size=cfg["procs"]),
    )
    per_step = loader.global_batch_size // (cfg["micro"] * cfg["procs"])
    batches = iter(loader)
    out = [[row_digests(next(batches)) for _ in range(per_step)] for _ in range(steps)]
    loader.close()
    return out


def check_steps(
    traces: list[dict[str, Any]], cfg: dict[str, Any], steps: range, steps_per_epoch: int
) -> None:
    """On every rank, the micro batches accumulated into the Trainer's optimizer step k are
    exactly detdata's step k (rows and order), for every k in ``steps``; the Trainer's epoch
    is an uninterrupted run's (``k / steps_per_epoch`` as the step begins)."""
    for rank, trace in enumerate(traces):
        ref = reference(cfg, steps.stop, rank)
        seen = [(r["step"], r["rows"]) for r in trace["records"]]
        want = [(k, rows) for k in steps for rows in ref[k]]
        assert seen == want, f"rank {rank}"
        epochs = [(r["step"], round(r["epoch"] or 0.0, 6)) for r in trace["records"]]
        assert epochs == [(k, round(k / steps_per_epoch, 6)) for k in steps for _ in ref[k]]


@pytest.mark.parametrize("pair", list(RESUMED))
def test_stop_and_resume_trains_the_steps_of_an_uninterrupted_loader(runs: Runs, pair: str) -> None:
    """Checkpoint at step 3; the first run goes on to step 6 (past the epoch end at step 5)
    and stops; the resumed run (a fresh process, checkpoint-3, one process from one or two,
    another accumulation) trains steps 3-8: each optimizer step holds exactly detdata's step,
    none repeated or skipped at the resume, the epoch counter continues as if uninterrupted
    (the Trainer's own skip of the trained batches is not applied: the loader resumes in
    O(1)), and the stitched run is the uninterrupted one."""
    first_name, settings = RESUMED[pair]
    first, resumed = runs.first(first_name), runs.resumed(pair)
    steps_per_epoch = BASE["n"] // BASE["global_batch"]
    check_steps(first, RUNS[first_name], range(FIRST_STOP), steps_per_epoch)
    check_steps(resumed, settings, range(CKPT, LAST), steps_per_epoch)
    assert [t["global_step"] for t in resumed] == [LAST] * settings["procs"]
    state = json.loads((runs.checkpoint(first_name) / "detdata_loader.json").read_text())
    assert state["samples_consumed"] == CKPT * BASE["global_batch"]
    assert state["step_position"]["delivered_in_step"] == 0
    # the resume above passed the attestation of the last 4 samples before the checkpoint
    attested = state["attestation"]
    assert attested["first"] == CKPT * BASE["global_batch"] - 4 and len(attested["samples"]) == 4


def test_accumulation_8_over_a_ragged_epoch_keeps_the_trainer_on_detdata_steps(
    warm: Forkserver, tmp_path: Path
) -> None:
    """40 rows, global batch 16 (micro 2 x accumulation 8): an epoch is 2 whole steps, 8 rows
    left over. Over 5 steps (three epoch ends) the Trainer never takes a short step at an
    epoch's end: its step k is detdata's step k, micro batch for micro batch."""
    cfg = dict(procs=1, micro=2, accum=8, workers=0, n=40, global_batch=16, save_steps=100)
    traces = _run(warm, {**cfg, "tag": "acc8", "max_steps": 5, "resume": None}, tmp_path)
    check_steps(traces, cfg, range(5), steps_per_epoch=2)


def _trainer(tmp_path: Path, **cfg: Any) -> Any:
    base = {**BASE, "procs": 1, "micro": 4, "accum": 2, "max_steps": 2, "workers": 0}
    return make_trainer({**base, "output_dir": str(tmp_path / "ck"), **cfg}, [])


def test_batch_settings_that_disagree_are_refused_before_the_first_batch(tmp_path: Path) -> None:
    """gradient_accumulation_steps 3 x micro 4 is 12 samples a step, the loader's global
    batch is 8: refused before any batch is read, with the arguments that agree."""
    trainer = _trainer(tmp_path, accum=3)
    with pytest.raises(detdata.ConfigError, match=r"gradient_accumulation_steps=2\)"):
        trainer.train()
    assert trainer.detdata_loader.samples_consumed == 0
    trainer = _trainer(tmp_path, accum=2)
    trainer.args.per_device_train_batch_size = 2  # the Trainer's micro batch is not the loader's
    with pytest.raises(detdata.ConfigError, match=r"per_device_train_batch_size=4"):
        trainer.train()


@pytest.mark.parametrize(
    ("args", "hint"),
    [
        ({"dataloader_num_workers": 2}, "detdata.DataLoader(..., num_workers=2)"),
        ({"dataloader_persistent_workers": True}, "persistent_workers=True"),
    ],
    ids=["num_workers", "persistent_workers"],
)
def test_worker_arguments_the_trainer_would_not_apply_are_refused(
    tmp_path: Path, args: dict[str, Any], hint: str
) -> None:
    """``TrainingArguments(dataloader_num_workers=2)`` (and the other worker arguments) build
    the Trainer's own torch DataLoader, which a DetdataTrainer never builds: the loader reads
    with its own ``num_workers=0``. Refused before any batch is read, naming the loader's
    keyword (before, the argument was silently ignored); the loader's own value is accepted."""
    trainer = _trainer(tmp_path, args=args)
    with pytest.raises(detdata.ConfigError, match=re.escape(hint)):
        trainer.train()
    assert trainer.detdata_loader.samples_consumed == 0
    if "dataloader_num_workers" in args:  # the same value on both sides trains
        records: list[dict[str, Any]] = []
        cfg = {**BASE, "procs": 1, "micro": 4, "accum": 2, "max_steps": 2, "workers": 2}
        cfg |= {"output_dir": str(tmp_path / "same"), "args": args}
        make_trainer(cfg, records).train()
        assert [r["rows"] for r in records] == [
            rows for step in reference(cfg, 2, 0) for rows in step
        ]


def test_a_checkpoint_without_the_loader_state_is_refused(runs: Runs, tmp_path: Path) -> None:
    """A checkpoint folder whose detdata_loader.json is missing (written by a plain Trainer)
    is refused at the resume, naming the file, rather than starting the data at position 0
    while the Trainer resumes at step 3."""
    bare = tmp_path / "checkpoint-3"
    shutil.copytree(runs.checkpoint("w1"), bare)
    (bare / "detdata_loader.json").unlink()
    trainer = _trainer(tmp_path, max_steps=5)
    with pytest.raises(detdata.StateError, match=r"detdata_loader\.json"):
        trainer.train(resume_from_checkpoint=str(bare))
    assert trainer.detdata_loader.samples_consumed == 0


def test_a_checkpoint_inside_gradient_accumulation_trains_that_step_whole(
    warm: Forkserver, tmp_path: Path
) -> None:
    """A checkpoint written after the first micro batch of step 2 (accumulation 4; the
    Trainer had fetched all four): its loader state is the step's first position, so the
    resumed run trains step 2 whole, then 3 and 4, micro batch for micro batch the
    uninterrupted loader's, with the Trainer's step and epoch counters."""
    cfg = dict(procs=1, micro=2, accum=4, workers=0, save_steps=100)
    first = {**cfg, "tag": "inside", "max_steps": 3, "resume": None, "save_inside": 2}
    _run(warm, first, tmp_path / "first")
    ck = tmp_path / "first" / "ck" / "checkpoint-2"
    state = json.loads((ck / "detdata_loader.json").read_text())
    assert state["samples_consumed"] == 2 * BASE["global_batch"]
    again = {**cfg, "tag": "again", "max_steps": 5, "resume": str(ck)}
    traces = _run(warm, again, tmp_path / "again")
    check_steps(traces, cfg, range(2, 5), BASE["n"] // BASE["global_batch"])
