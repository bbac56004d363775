"""Child of tests/integrations/test_accelerate.py: one accelerate 1.15 training run.

Run under ``python -m torch.distributed.run`` (CPU, gloo: ``Accelerator(cpu=True)`` forms
the process group). Two data paths train side by side, each its own tiny model, in
lockstep (the same global step and micro step):

- ``loader``: a `detdata.DataLoader`, built before the ``Accelerator`` exists (rank and
  world size are bound when iteration starts), passed through ``prepare`` (which hands it
  back untouched) and saved by ``accelerator.register_for_checkpointing(loader)``;
- ``sampler``: a torch ``DataLoader`` over a plain map-style dataset with
  ``batch_sampler=DeterministicBatchSampler.sharded_by_framework(...)``, prepared by
  accelerate with ``DataLoaderConfiguration(split_batches=True,
  use_stateful_dataloader=True)`` (accelerate shards it and saves its position).

``argv[1]`` is a JSON config: ``resume`` (``accelerator.load_state(ckpt)`` first, counting
steps from ``start``), ``stop`` (after this many global steps, ``accelerator.save_state(ckpt)``
and stop), ``last`` (the step count where the run ends), ``global_batch``, ``micro`` (the
loader's micro batch per process), ``batch`` (the sampler's item: one micro step of all
processes), ``seed``, ``n``, ``workers`` (of the torch DataLoader), ``loader_workers``,
``probe``, ``out``; and, to leave out what each path needs, ``register`` (default True:
``register_for_checkpointing(loader)``) and ``stateful`` (default True:
``use_stateful_dataloader``). A `detdata.StateError` from ``load_state`` or from the loader's
first batch is recorded (``refused``, ``where``) and the run ends there, before any step.

Each training step records the rows it was handed (``row_digests``) to
``out/rank<r>.jsonl``: one line per micro batch and path, with the global step, the micro
step and the process index. With ``probe`` it first records what detdata raises where
accelerate would shard its data a second time, and what a sampler built before the
process group yields once the group exists.
"""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import blake3
import numpy as np
import torch
import torch.utils.data as tud

import detdata
from detdata.loading.sampler import DeterministicBatchSampler


def make_dataset(n: int) -> detdata.ArrayDataset:
    """``n`` rows: an ``id`` and 4 float features that are a function of it."""
    ids = np.arange(n, dtype=np.int64)
    x = np.sin(np.outer(ids + 1, np.arange(1, 5))).astype(np.float32)
    return detdata.ArrayDataset({"id": ids, "x": x}, name="accelerate-rows")


class TorchRows(tud.Dataset[dict[str, Any]]):
    """The same rows as a plain map-style torch dataset (what a user keeps)."""

    def __init__(self, n: int) -> None:
        self.data = make_dataset(n)
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> dict[str, Any]:
        row = self.data.read(np.array([i], dtype=np.int64))
        return {"id": torch.as_tensor(row["id"][0]), "x": torch.as_tensor(row["x"][0])}


def row_digests(batch: dict[str, Any]) -> list[str]:
    """One digest per row of a batch: its id and the bytes of its features."""
    ids = torch.as_tensor(batch["id"]).tolist()
    x = torch.as_tensor(batch["x"]).contiguous().numpy()
    return [f"{i}:{blake3.blake3(x[r].tobytes()).hexdigest()[:16]}" for r, i in enumerate(ids)]


def _raised(first: Callable[[], Any]) -> str:
    try:
        first()
    except detdata.ConfigError as exc:
        return str(exc)
    return "no error"


def probe(accelerator: Any, cfg: dict[str, Any], early: DeterministicBatchSampler) -> Any:
    """What detdata raises where accelerate would shard its data a second time."""
    from accelerate.data_loader import prepare_data_loader

    n, gbs, batch = cfg["n"], cfg["global_batch"], cfg["batch"]

    def prepared(sampler: Any) -> Callable[[], Any]:
        dl = prepare_data_loader(
            tud.DataLoader(TorchRows(n), batch_sampler=sampler),
            num_processes=accelerator.num_processes,
            process_index=accelerator.process_index,
            split_batches=False,  # accelerate's default
        )
        return lambda: next(iter(dl))

    whole = DeterministicBatchSampler.sharded_by_framework
    plain = tud.DataLoader(
        TorchRows(n), batch_sampler=whole(n, global_batch_size=gbs, batch_size=batch)
    )
    return {
        # a rank-sliced sampler dealt to the processes again (the double sharding)
        "rank_sampler": _raised(prepared(DeterministicBatchSampler(n, global_batch_size=gbs))),
        # whole micro steps dealt whole (split_batches=False)
        "no_split": _raised(prepared(whole(n, global_batch_size=gbs, batch_size=batch))),
        # whole micro steps that nobody splits (a plain torch DataLoader in a process group)
        "unsplit": _raised(lambda: next(iter(plain))),
        # built before the process group: its first item once the group exists
        "early": [next(iter(early)), early.layout.rank, early.layout.world_size],
    }


def main() -> None:
    cfg = json.loads(sys.argv[1])
    torch.manual_seed(0)
    from accelerate import Accelerator
    from accelerate.utils import DataLoaderConfiguration

    gbs, seed, n = cfg["global_batch"], cfg["seed"], cfg["n"]
    # built before the process group exists: rank and world size are bound at iteration
    loader = detdata.DataLoader(
        make_dataset(n),
        global_batch_size=gbs,
        micro_batch_size=cfg["micro"],
        seed=seed,
        num_workers=cfg["loader_workers"],
    )
    early = DeterministicBatchSampler(n, global_batch_size=gbs, micro_batch_size=4, seed=seed)
    stateful = cfg.get("stateful", True)  # False: the sampler path without the setting it needs
    config = DataLoaderConfiguration(split_batches=True, use_stateful_dataloader=stateful)
    accelerator = Accelerator(cpu=True, dataloader_config=config)
    if cfg.get("register", True):  # False: the loader path without its one line
        accelerator.register_for_checkpointing(loader)  # the one line the loader path needs
    rank, world = accelerator.process_index, accelerator.num_processes
    probes = probe(accelerator, cfg, early) if cfg.get("probe") else None

    sampler = DeterministicBatchSampler.sharded_by_framework(
        n, global_batch_size=gbs, batch_size=cfg["batch"], seed=seed
    )
    dl = tud.DataLoader(TorchRows(n), batch_sampler=sampler, num_workers=cfg["workers"])
    models = [torch.nn.Linear(4, 1), torch.nn.Linear(4, 1)]
    optimizers = [torch.optim.SGD(m.parameters(), lr=0.1) for m in models]
    *prepared, batches = accelerator.prepare(*models, *optimizers, loader, dl)
    models, optimizers, same = prepared[:2], prepared[2:4], prepared[4]
    assert same is loader  # prepare() hands a detdata.DataLoader back untouched
    accum = {"loader": gbs // (cfg["micro"] * world), "sampler": gbs // cfg["batch"]}
    assert accum["loader"] == accum["sampler"], accum  # lockstep
    out = Path(cfg["out"])
    out.mkdir(parents=True, exist_ok=True)
    step, micro = cfg["start"], 0
    with open(out / f"rank{rank}.jsonl", "w", encoding="utf-8") as log:
        if probes is not None:
            log.write(json.dumps({"probes": probes}) + "\n")
        where = "load_state"
        try:  # what detdata refuses, and where: no micro batch is recorded before it
            if cfg["resume"]:
                accelerator.load_state(cfg["ckpt"])
            where = "first batch"
            pairs = zip(loader, batches, strict=False)  # iter(loader): its first batch's check
        except detdata.StateError as exc:
            refused = {"refused": str(exc), "where": where, "end": "refused", "world": world}
            log.write(json.dumps(refused) + "\n")
            return
        for pair in pairs:
            for path, batch, model in zip(("loader", "sampler"), pair, models, strict=True):
                record = {"path": path, "step": step, "micro": micro, "rank": rank}
                log.write(json.dumps({**record, "rows": row_digests(batch)}) + "\n")
                accelerator.backward(model(batch["x"]).pow(2).mean() / accum[path])
            micro += 1
            if micro < accum["loader"]:
                continue
            for optimizer in optimizers:
                optimizer.step()
                optimizer.zero_grad()
            step, micro = step + 1, 0
            if step == cfg.get("stop"):
                accelerator.save_state(cfg["ckpt"])
                break
            if step == cfg["last"]:
                break
        log.write(json.dumps({"end": step, "world": world}) + "\n")
    accelerator.wait_for_everyone()
    accelerator.end_training()


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()
