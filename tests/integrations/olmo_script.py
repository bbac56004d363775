"""One OLMo-core ``Trainer.fit()`` over `detdata.integrations.olmo_core`, run by
test_olmo_core.py under ``python -m torch.distributed.run`` (CPU, gloo).

    python -m torch.distributed.run --nproc-per-node N ... olmo_script.py '<config as JSON>'

The user's side is what the README shows: a stock OLMo-core script (a tiny ``olmo2_1M``
``TransformerConfig``, ``TransformerTrainModuleConfig`` with DDP, ``TrainerConfig`` with a
``CheckpointerCallback``) whose data loader is ``OlmoCoreDataLoader(TokenWindows(...), ...)``.
``hard_stop`` ends a run after ``stop_at`` steps (a preemption right after the checkpoint of
that step); the next run with the same ``save`` folder loads its latest checkpoint, as
OLMo-core does on a restart. ``warmup`` adds OLMo-core's ``BatchSizeSchedulerCallback``
(double the batch at step ``warmup``).

The recording, not on the data path: a forward pre-hook on the model writes every micro
batch the model gets (input_ids and labels, per row digests) with the trainer step it belongs
to (the dry-run batch, before step 1, has no step and is left out), to
``out/trace-{tag}-rank{r}.json``.

Config: ``runs``, a list of runs done one after the other in the same processes, each with
the keys ``manifest``, ``save``, ``out``, ``tag``, ``seq_len``, ``labels`` (windows of
``seq_len + 1`` tokens, else ``seq_len``), ``global_tokens``, ``micro_tokens``, ``seed``,
``steps``, ``interval`` (checkpoint every N steps, or null: no checkpoints), ``stop_at``,
``warmup`` (or null); keys outside ``runs`` are shared by all (``seq_len`` and
``micro_tokens`` must be: the runs of a process share one model and train module).
"""

from __future__ import annotations

import hashlib
import json
import sys
import traceback
from pathlib import Path
from typing import Any

import torch
from olmo_core.distributed.parallel import DataParallelType
from olmo_core.nn.transformer import TransformerConfig
from olmo_core.optim import AdamWConfig
from olmo_core.train import Duration, TrainerConfig, prepare_training_environment
from olmo_core.train.callbacks import BatchSizeSchedulerCallback, Callback, CheckpointerCallback
from olmo_core.train.train_module import (
    TransformerDataParallelConfig,
    TransformerTrainModuleConfig,
)

import detdata
from detdata.integrations.olmo_core import OlmoCoreDataLoader

VOCAB = 512


def row_digests(input_ids: torch.Tensor, labels: torch.Tensor) -> list[str]:
    """One digest per row over the row's int64 input_ids and labels."""
    out = []
    for x, y in zip(input_ids, labels, strict=True):
        h = hashlib.sha256(x.to(torch.int64).numpy().tobytes())
        h.update(y.to(torch.int64).numpy().tobytes())
        out.append(h.hexdigest()[:16])
    return out


class StepOfBatch(Callback):  # type: ignore[misc]
    """Tells the recording hook which trainer step the batches now belong to."""

    def __init__(self, state: dict[str, Any]) -> None:
        self.state = state

    def pre_step(self, batch: dict[str, Any]) -> None:
        self.state["step"] = self.trainer.global_step


def build_train_module(cfg: dict[str, Any], state: dict[str, Any]) -> Any:
    """The model (with the recording hook) and its train module: once a process (OLMo-core
    builds its device mesh once a process), shared by the runs."""
    model = TransformerConfig.olmo2_1M(vocab_size=VOCAB, n_layers=2).build(init_device="cpu")

    def record(module: Any, args: Any, kwargs: Any) -> None:
        if state["step"] is not None:  # the dry run (mock batch) comes before step 1
            rows = row_digests(args[0], kwargs["labels"])
            state["records"].append({"step": state["step"], "rows": rows})

    model.register_forward_pre_hook(record, with_kwargs=True)
    return TransformerTrainModuleConfig(
        rank_microbatch_size=cfg["micro_tokens"],
        max_sequence_length=cfg["seq_len"],
        optim=AdamWConfig(lr=1e-3),
        dp_config=TransformerDataParallelConfig(name=DataParallelType.ddp),
    ).build(model, device=torch.device("cpu"))


def run(cfg: dict[str, Any], train_module: Any, state: dict[str, Any]) -> None:
    """One ``Trainer.fit()``; writes the trace (and the error ``fit`` raised, if any)."""
    state.update(step=None, records=[])
    data_loader = OlmoCoreDataLoader(
        detdata.TokenWindows(cfg["manifest"], seq_len=cfg["seq_len"], labels=cfg["labels"]),
        global_batch_size=cfg["global_tokens"],
        seed=cfg["seed"],
        dp_process_group=train_module.dp_process_group,
        work_dir=cfg["save"],
    )
    callbacks: dict[str, Callback] = {
        "checkpointer": CheckpointerCallback(
            save_interval=cfg["interval"], save_async=False, enabled=cfg["interval"] is not None
        ),
        "step_of_batch": StepOfBatch(state),
    }
    if cfg["warmup"] is not None:
        callbacks["batch_size"] = BatchSizeSchedulerCallback(
            batch_sizes=[cfg["global_tokens"], 2 * cfg["global_tokens"]],
            schedule=[Duration.steps(0), Duration.steps(cfg["warmup"])],
        )
    trainer = TrainerConfig(
        save_folder=cfg["save"],
        max_duration=Duration.steps(cfg["steps"]),
        hard_stop=Duration.steps(cfg["stop_at"]),
        metrics_collect_interval=1000,
        cancel_check_interval=1000,
        callbacks=callbacks,
    ).build(train_module, data_loader)
    error = None
    try:
        trainer.fit()
    except Exception as exc:  # the warm-up run: keep the error the trainer raised
        error = "".join(traceback.format_exception_only(exc))
    rank = torch.distributed.get_rank()
    out = Path(cfg["out"]) / f"trace-{cfg['tag']}-rank{rank}.json"
    result = {
        "records": state["records"],
        "final_step": trainer.global_step,
        "samples_consumed": data_loader.loader.samples_consumed,
        "epoch": trainer.epoch,
        "error": error,
    }
    out.write_text(json.dumps(result), encoding="utf-8")


def main(cfg: dict[str, Any]) -> None:
    """``cfg["runs"]``: the runs, in order, in these processes (each the shared keys +
    its own)."""
    prepare_training_environment(seed=0, backend="gloo")
    shared = {k: v for k, v in cfg.items() if k != "runs"}
    state: dict[str, Any] = {}
    train_module = build_train_module(shared, state)
    for one in cfg["runs"]:
        run({**shared, **one}, train_module, state)
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main(json.loads(sys.argv[1]))
