"""Child of tests/integrations/test_accelerate.py: accelerate's own gradient accumulation over a
`detdata.DataLoader`, and the accelerate watch's cases (one per process).

    python -m torch.distributed.run ... accelerate_steps_script.py '<config as JSON>'  # train
    python accelerate_steps_script.py '<config as JSON>'                                  # a case

``train`` (config without ``case``): the loop accelerate's documentation shows, ``Accelerator(
gradient_accumulation_steps=accum)`` and ``with accelerator.accumulate(model):`` around every
micro batch, ``optimizer.step()`` each time (accelerate skips it until the step is
accumulated); the loader is registered for checkpointing. Keys: ``global_batch``, ``micro``,
``accum``, ``n``, ``seed``, ``out``, ``ckpt``, ``resume`` (``load_state(ckpt)`` first),
``start`` (the optimizer steps the checkpoint had taken), ``stop`` (``save_state(ckpt)`` and stop
after this many optimizer steps), ``last``. Every micro batch is recorded (``rank<r>.jsonl``)
with the optimizer step it is accumulated into: ``start`` plus the optimizer steps accelerate
took before it (``accelerator.sync_gradients`` after a micro batch). A detdata error from
``register_for_checkpointing``, ``load_state`` or the first batch is recorded (``refused``,
``where``) and the run ends there.

``case`` (one process, no launcher; ``dir`` a scratch folder): the lines of `CASES` print one
JSON object: ``refused`` (the message, or None) and ``rows`` (the rows of the loader's first
two batches when it was not refused).
"""

from __future__ import annotations

import functools
import json
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

import detdata
from tests.integrations.accelerate_script import TorchRows, make_dataset, row_digests


def train(cfg: dict[str, Any]) -> None:
    from accelerate import Accelerator

    torch.manual_seed(0)
    loader = detdata.DataLoader(
        make_dataset(cfg["n"]),
        global_batch_size=cfg["global_batch"],
        micro_batch_size=cfg["micro"],
        seed=cfg["seed"],
    )
    accelerator = Accelerator(cpu=True, gradient_accumulation_steps=cfg["accum"])
    rank = accelerator.process_index
    out = Path(cfg["out"])
    out.mkdir(parents=True, exist_ok=True)
    with open(out / f"rank{rank}.jsonl", "w", encoding="utf-8") as log:
        where = "register"
        try:
            accelerator.register_for_checkpointing(loader)  # the README's one line
            model = torch.nn.Linear(4, 1)
            optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
            model, optimizer = accelerator.prepare(model, optimizer)
            where = "load_state"
            if cfg["resume"]:
                accelerator.load_state(cfg["ckpt"])
            where = "first batch"
            batches = iter(loader)
        except (detdata.StateError, detdata.ConfigError) as exc:
            log.write(json.dumps({"refused": str(exc), "where": where, "end": "refused"}) + "\n")
            return
        step, micro = cfg["start"], 0
        for batch in batches:
            with accelerator.accumulate(model):
                record = {"step": step, "micro": micro, "rank": rank, "rows": row_digests(batch)}
                log.write(json.dumps(record) + "\n")
                accelerator.backward(model(batch["x"]).pow(2).mean())
                optimizer.step()
                optimizer.zero_grad()
            micro += 1
            if not accelerator.sync_gradients:
                continue
            step, micro = step + 1, 0
            if step == cfg.get("stop"):
                accelerator.save_state(cfg["ckpt"])
                break
            if step == cfg["last"]:
                break
        log.write(json.dumps({"end": step, "micro_steps": accelerator.step}) + "\n")
    accelerator.wait_for_everyone()
    accelerator.end_training()


# ------------------------------------------------------------------ the watch's cases
#: what a script keeps alive while its loader trains (the accelerators, their models)
ALIVE: list[Any] = []


def _resumed_accelerator(folder: Path) -> Any:
    """An Accelerator that saved a checkpoint with no detdata loader in it and loaded it back
    (a teacher model's, or a run that trains on a torch DataLoader); kept alive."""
    from accelerate import Accelerator

    accelerator = Accelerator(cpu=True)
    model = accelerator.prepare(torch.nn.Linear(4, 1))
    accelerator.save_state(str(folder))
    accelerator.load_state(str(folder))
    ALIVE.extend((accelerator, model))
    return accelerator


def _loader(**options: Any) -> detdata.DataLoader:
    return detdata.DataLoader(
        make_dataset(40),
        global_batch_size=8,
        seed=3,
        options=detdata.LoaderOptions(resume=detdata.ResumePolicy(**options)),
    )


def case_teacher(folder: Path) -> detdata.DataLoader:
    """A fresh training run (its loader registered with its Accelerator) beside a teacher's
    Accelerator that loads the teacher's own checkpoint."""
    from accelerate import Accelerator

    loader = _loader()
    student = Accelerator(cpu=True)
    student.register_for_checkpointing(loader)
    ALIVE.append(student)
    _resumed_accelerator(folder)
    return loader


def case_sampler_eval(folder: Path, **declared: Any) -> detdata.DataLoader:
    """Training on the documented torch-sampler path (a prepared stateful DataLoader over
    sharded_by_framework), resumed; an evaluation detdata.DataLoader starts at position 0
    (``declared``: its `ResumePolicy` arguments)."""
    from accelerate import Accelerator
    from accelerate.utils import DataLoaderConfiguration

    config = DataLoaderConfiguration(split_batches=True, use_stateful_dataloader=True)
    accelerator = Accelerator(cpu=True, dataloader_config=config)
    sampler = detdata.DeterministicBatchSampler.sharded_by_framework(
        40, global_batch_size=8, batch_size=8, seed=3
    )
    dl = torch.utils.data.DataLoader(TorchRows(40), batch_sampler=sampler)
    model, dl = accelerator.prepare(torch.nn.Linear(4, 1), dl)
    next(iter(dl))
    accelerator.save_state(str(folder))
    accelerator.load_state(str(folder))
    ALIVE.extend((accelerator, model, dl))
    return _loader(**declared)


def case_registered_late(folder: Path) -> detdata.DataLoader:
    """A training loader registered with its Accelerator only after that Accelerator's
    load_state (of a checkpoint saved without it): nothing restored its position."""
    loader = _loader()
    accelerator = _resumed_accelerator(folder)
    accelerator.register_for_checkpointing(loader)
    return loader


def case_built_first(folder: Path) -> detdata.DataLoader:
    """A loader built before accelerate is imported, not registered; the Accelerator then
    resumes from a checkpoint without it."""
    assert "accelerate" not in sys.modules
    loader = _loader()
    _resumed_accelerator(folder)
    return loader


CASES: dict[str, Callable[[Path], detdata.DataLoader]] = {
    "teacher": case_teacher,
    "sampler_eval_declared": functools.partial(case_sampler_eval, fresh_each_run=True),
    "sampler_eval": case_sampler_eval,
    "registered_late": case_registered_late,
    "built_first": case_built_first,
}


def run_case(cfg: dict[str, Any]) -> None:
    folder = Path(cfg["dir"])
    loader = CASES[cfg["case"]](folder)
    result: dict[str, Any] = {"refused": None, "rows": None}
    try:
        batches = iter(loader)
        result["rows"] = [row_digests(next(batches)) for _ in range(2)]
    except detdata.StateError as exc:
        result["refused"] = str(exc)
    loader.close()
    print(json.dumps(result))


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    torch.set_num_threads(1)
    config = json.loads(sys.argv[1])
    if "case" in config:
        run_case(config)
    else:
        train(config)
