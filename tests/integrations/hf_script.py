"""One Hugging Face ``Trainer.train`` over a `detdata.DataLoader`, run by test_transformers.py.

    python tests/integrations/hf_script.py '<config as JSON>'          # one process
    python -m torch.distributed.run --nproc_per_node 2 hf_script.py ...  # two (gloo, CPU)

The user's side is what the README shows: ``DetdataTrainer(model=..., args=...,
train_dataloader=loader)`` in place of ``Trainer``, ``train(resume_from_checkpoint=...)``.
The subclass here only records, in ``compute_loss``, what the model is handed: for every micro
batch the Trainer's ``global_step`` (the optimizer step it is accumulated into), its ``epoch``
and a digest of every row.

Config keys: ``out``, ``tag``, ``output_dir`` (the Trainer's), ``n`` (rows), ``global_batch``,
``micro``, ``accum`` (``gradient_accumulation_steps``), ``seed``, ``max_steps``, ``save_steps``,
``workers``, ``resume`` (a checkpoint folder, or None), ``save_inside`` (a step: write a
checkpoint after its first micro batch, inside gradient accumulation), ``args`` (more
``TrainingArguments``, e.g. ``{"dataloader_num_workers": 2}``).
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any

import numpy as np

import detdata
from tests.integrations.lightning_script import row_digests

VOCAB, WIDTH = 32, 6


def make_dataset(n: int) -> detdata.ArrayDataset:
    """``n`` rows of ``WIDTH`` seeded tokens (``input_ids`` and the same ``labels``)."""
    tokens = np.random.default_rng(11).integers(0, VOCAB, (n, WIDTH), dtype=np.int64)
    return detdata.ArrayDataset({"input_ids": tokens, "labels": tokens.copy()}, name=f"hf-{n}")


def build_loader(cfg: dict[str, Any]) -> detdata.DataLoader:
    """What the user writes: nothing about rank, world size or the Trainer."""
    return detdata.DataLoader(
        make_dataset(cfg["n"]),
        global_batch_size=cfg["global_batch"],
        micro_batch_size=cfg["micro"],
        seed=cfg["seed"],
        num_workers=cfg.get("workers", 0),
    )


def make_trainer(cfg: dict[str, Any], records: list[dict[str, Any]]) -> Any:
    """The Trainer the README shows (``DetdataTrainer``), recording what the model sees."""
    import torch
    from transformers import TrainingArguments

    from detdata.integrations.transformers import DetdataTrainer

    class Tiny(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.emb = torch.nn.Embedding(VOCAB, 8)
            self.out = torch.nn.Linear(8, VOCAB)

        def forward(self, input_ids: torch.Tensor, labels: torch.Tensor) -> dict[str, Any]:
            logits = self.out(self.emb(input_ids))
            loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), labels.flatten())
            return {"loss": loss}

    class Recording(DetdataTrainer):
        def compute_loss(self, model: Any, inputs: Any, *args: Any, **kwargs: Any) -> Any:
            records.append(
                {
                    "step": self.state.global_step,
                    "epoch": self.state.epoch,
                    "rows": row_digests(inputs),
                }
            )
            return super().compute_loss(model, inputs, *args, **kwargs)

    args = TrainingArguments(
        output_dir=cfg["output_dir"],
        per_device_train_batch_size=cfg["micro"],
        gradient_accumulation_steps=cfg["accum"],
        max_steps=cfg["max_steps"],
        save_strategy="steps",
        save_steps=cfg["save_steps"],
        logging_strategy="no",
        report_to=[],
        use_cpu=True,
        learning_rate=0.01,
        seed=cfg["seed"],
        disable_tqdm=True,
        **cfg.get("args", {}),
    )
    torch.manual_seed(0)
    trainer = Recording(model=Tiny(), args=args, train_dataloader=build_loader(cfg))
    if cfg.get("save_inside") is not None:  # a checkpoint inside gradient accumulation
        from transformers import TrainerCallback

        class SaveInside(TrainerCallback):  # type: ignore[misc]
            def on_substep_end(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
                if state.global_step == cfg["save_inside"] and not list(
                    Path(cfg["output_dir"]).glob("*")
                ):
                    trainer._save_checkpoint(trainer.model, None)

        trainer.add_callback(SaveInside())
    return trainer


def main() -> None:
    cfg = json.loads(sys.argv[1])
    import torch

    torch.set_num_threads(1)
    records: list[dict[str, Any]] = []
    trainer = make_trainer(cfg, records)
    trainer.train(resume_from_checkpoint=cfg["resume"])
    rank = int(os.environ.get("RANK", "0"))
    done = {
        "records": records,
        "global_step": trainer.state.global_step,
        "epoch": trainer.state.epoch,
    }
    (Path(cfg["out"]) / f"trace-{cfg['tag']}-rank{rank}.json").write_text(json.dumps(done))
    import torch.distributed as dist

    if dist.is_initialized():  # a torchrun script ends its group (else torch's threads may
        dist.barrier()  # be torn down mid-flight at exit: "terminate called", SIGABRT)
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
