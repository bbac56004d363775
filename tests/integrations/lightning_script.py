"""One PyTorch Lightning ``Trainer.fit`` over a `detdata.DataLoader`, run by test_lightning.py.

    python tests/integrations/lightning_script.py '<config as JSON>'

It is a script because Lightning's ``strategy="ddp"`` re-launches this very file (same argv)
once per extra rank. The user's side is what the README shows: the loader goes to ``fit``
(or comes out of ``train_dataloader()``) like a torch DataLoader; no callback, no glue.

Config keys: ``package`` (``"pytorch_lightning"``, the default, or ``"lightning.pytorch"``:
``import lightning.pytorch as pl``, the unified package's copy of every class), ``out`` (folder
for the trace), ``tag``, ``ckpt_dir``, ``devices``, ``workers``,
``source`` (``"arg"``: built before ``fit`` and passed as ``train_dataloaders=``;
``"module"``: built before ``fit``, returned by ``train_dataloader()``; ``"hook"``: built
inside ``train_dataloader()``), ``global_batch``, ``micro``, ``accum``, ``seed``, ``n``,
``total_samples``, ``max_steps``, ``max_epochs``, ``every`` (checkpoint every N train
steps, as ``step=S.ckpt``; each epoch's end writes ``end-epoch=E-step=S.ckpt`` too, as
Lightning's default checkpoint does), ``resume`` (a ``ckpt_path``), ``steps_callback``
(add `detdata.integrations.lightning.DetdataSteps`, the README's optional line, which must be
a ``Callback`` of ``package``),
``raise_at`` (``[step, k]``: ``training_step`` raises at micro batch ``k`` of optimizer step
``step``, after ``OnExceptionCheckpoint`` is set to write ``on_exception.ckpt``),
``val_every`` (a validation every this many micro batches, ``val_check_interval``, over a plain
torch DataLoader, logging ``val_loss``), ``monitored`` (in place of the two checkpoints above,
the stock ``ModelCheckpoint(monitor="val_loss", every_n_train_steps=every, save_last=True)``:
Lightning defers its save to the end of the next validation).

Every rank writes ``out/trace-{tag}-rank{r}.json``: one record per ``training_step`` call
(the global step it belongs to, the epoch, a digest of every row the model saw), and which
Lightning top-level packages the process imported (``lightning_modules``).
"""

from __future__ import annotations

import hashlib
import importlib
import json
import sys
from pathlib import Path
from typing import Any

import numpy as np

import detdata

FEATURES = 4


def make_dataset(n: int) -> detdata.ArrayDataset:
    """``n`` rows: an ``id`` and ``FEATURES`` seeded floats (the same in every process)."""
    rng = np.random.default_rng(7)
    return detdata.ArrayDataset(
        {
            "id": np.arange(n, dtype=np.int64),
            "x": rng.standard_normal((n, FEATURES)).astype(np.float32),
        },
        name=f"lightning-rows-{n}",
    )


def row_digests(batch: dict[str, Any]) -> list[str]:
    """One digest per row over every column of a batch (dict of tensors)."""
    keys = sorted(batch)
    rows = len(batch[keys[0]])
    out = []
    for i in range(rows):
        h = hashlib.sha256()
        for key in keys:
            h.update(key.encode())
            h.update(np.ascontiguousarray(batch[key][i].cpu().numpy()).tobytes())
        out.append(h.hexdigest()[:16])
    return out


def build_loader(cfg: dict[str, Any]) -> detdata.DataLoader:
    """What the user writes: nothing about rank, world size or Lightning."""
    return detdata.DataLoader(
        make_dataset(cfg["n"]),
        global_batch_size=cfg["global_batch"],
        micro_batch_size=cfg["micro"],
        seed=cfg["seed"],
        num_workers=cfg["workers"],
        options=detdata.LoaderOptions(total_samples=cfg.get("total_samples")),
    )


def main() -> None:
    cfg = json.loads(sys.argv[1])
    pl = importlib.import_module(cfg.get("package", "pytorch_lightning"))
    import torch

    ModelCheckpoint = pl.callbacks.ModelCheckpoint

    torch.set_num_threads(1)
    records: list[dict[str, Any]] = []
    early = build_loader(cfg) if cfg["source"] in ("arg", "module") else None

    class Model(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.lin = torch.nn.Linear(FEATURES, 1)

        def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
            if cfg.get("raise_at") == [self.trainer.global_step, batch_idx % cfg["accum"]]:
                raise RuntimeError("injected failure inside gradient accumulation")
            records.append(
                {
                    "step": self.trainer.global_step,
                    "epoch": self.current_epoch,
                    "batch_idx": batch_idx,
                    "rows": row_digests(batch),
                }
            )
            out: torch.Tensor = self.lin(batch["x"]).pow(2).mean()
            return out

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.SGD(self.parameters(), lr=0.01)

    class Validated(Model):
        def validation_step(self, batch: list[torch.Tensor], batch_idx: int) -> None:
            self.log("val_loss", self.lin(batch[0]).pow(2).mean())

    class HookModel(Model):
        def train_dataloader(self) -> Any:
            return early if early is not None else build_loader(cfg)

    callbacks: list[Any] = [
        # every N train steps, and Lightning's default: at the end of every epoch
        ModelCheckpoint(cfg["ckpt_dir"], "{step}", every_n_train_steps=cfg["every"], save_top_k=-1),
        ModelCheckpoint(cfg["ckpt_dir"], "end-{epoch}-{step}", save_top_k=-1),
    ]
    if cfg.get("monitored"):  # a stock monitored checkpoint, as a Lightning user writes it
        every = cfg["every"]
        callbacks = [
            ModelCheckpoint(
                cfg["ckpt_dir"], monitor="val_loss", every_n_train_steps=every, save_last=True
            )
        ]
    val: Any = None
    if cfg.get("val_every"):
        rows = torch.utils.data.TensorDataset(torch.ones(8, FEATURES))
        val = torch.utils.data.DataLoader(rows, batch_size=4)
    if cfg.get("raise_at") is not None:
        callbacks.append(pl.callbacks.OnExceptionCheckpoint(cfg["ckpt_dir"], "on_exception"))
    if cfg.get("steps_callback"):
        from detdata.integrations.lightning import DetdataSteps

        steps = DetdataSteps()
        assert isinstance(steps, pl.Callback), type(steps).__mro__
        callbacks.append(steps)
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=cfg["devices"],
        strategy="ddp" if cfg["devices"] > 1 else "auto",
        max_steps=cfg["max_steps"],
        max_epochs=cfg["max_epochs"],
        accumulate_grad_batches=cfg["accum"],
        callbacks=callbacks,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        val_check_interval=cfg.get("val_every"),
    )
    model = Model() if cfg["source"] == "arg" else HookModel()
    if val is not None:
        assert cfg["source"] == "arg"
        model = Validated()
    trainer.fit(
        model,
        train_dataloaders=early if cfg["source"] == "arg" else None,
        val_dataloaders=val,
        ckpt_path=cfg["resume"],
    )
    trace = Path(cfg["out"]) / f"trace-{cfg['tag']}-rank{trainer.global_rank}.json"
    imported = [m for m in ("pytorch_lightning", "lightning") if m in sys.modules]
    trace.write_text(
        json.dumps(
            {"records": records, "global_step": trainer.global_step, "lightning_modules": imported}
        )
    )


if __name__ == "__main__":
    main()
