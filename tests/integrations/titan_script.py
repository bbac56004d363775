"""One torchtitan ``Trainer.train()`` over `detdata.integrations.torchtitan`, run by
test_torchtitan.py under ``python -m torch.distributed.run`` (CPU, gloo).

    python -m torch.distributed.run --nproc-per-node N ... titan_script.py '<config as JSON>'

The user's side is what the README shows: ``config.dataloader = TorchtitanDataLoader.Config(...)``
in an otherwise stock llama3 ``debugmodel`` config, checkpoints by torchtitan's own DCP
``CheckpointManager`` in ``dump_folder``. A run stops after step ``stop_at`` (a preemption
right after the checkpoint of that step); the next run with the same ``dump`` loads the
latest checkpoint, as torchtitan does on a restart.

What the script adds, none of it on the data path: (1) torchtitan 0.3 knows no CPU device
(``torch._utils._get_available_device_type() or "cuda"``), so its device module is a small CPU
stand-in while ``torchtitan.tools.utils`` is imported; (2) a trivial tokenizer (the data is
tokenized already; torchtitan builds a tokenizer anyway); (3) the recording: every micro batch
the model gets (``forward_backward_step``) is written, with the step it belongs to, as a
digest of each row of inputs + labels, to ``out/trace-{tag}-rank{r}.json``.

Config keys: ``manifest``, ``dump``, ``out``, ``tag``, ``global_batch``, ``local_batch``,
``seq_len``, ``seed``, ``steps``, ``interval``, ``stop_at``; to get a setting wrong on purpose,
``titan_global_batch`` (torchtitan's ``training.global_batch_size``; default ``global_batch``)
and ``exclude_dataloader`` (``checkpoint.exclude_from_loading=["dataloader"]``). A
`detdata.DetdataError` from ``train()`` is recorded in the trace (``refused``).
"""

from __future__ import annotations

import hashlib
import json
import sys
import types
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch._utils
from torch.distributed.fsdp import FSDPModule

# ---- (1) a CPU device module for torchtitan (read once, when torchtitan.tools.utils loads)
_CPU = types.SimpleNamespace(
    set_device=lambda device: None,
    device_count=lambda: 1,
    current_device=lambda: 0,
    get_device_name=lambda device=None: "cpu",
    get_device_properties=lambda device=None: types.SimpleNamespace(
        total_memory=1 << 34, name="cpu"
    ),
    reset_peak_memory_stats=lambda device=None: None,
    empty_cache=lambda: None,
    memory_stats=lambda device=None: {},
    synchronize=lambda device=None: None,
    is_available=lambda: True,
    manual_seed=lambda seed: None,
    manual_seed_all=lambda seed: None,
)
_type, _module = torch._utils._get_available_device_type, torch._utils._get_device_module


def _cpu_module(device_type: str = "cpu") -> Any:
    return _CPU if device_type == "cpu" else _module(device_type)


torch._utils._get_available_device_type = lambda: "cpu"
torch._utils._get_device_module = _cpu_module
import torchtitan.tools.utils  # noqa: E402

torch._utils._get_available_device_type, torch._utils._get_device_module = _type, _module

# ---- (4) torchtitan 0.3 calls torch.distributed.set_timeout after the first step (on any
# device); torch 2.13 has it only as the private _set_pg_timeout
if not hasattr(torch.distributed, "set_timeout"):
    from torch.distributed.distributed_c10d import _set_pg_timeout

    torch.distributed.set_timeout = lambda timeout, group=None: _set_pg_timeout(timeout, group)

from torchtitan.components.checkpoint import CheckpointManager  # noqa: E402
from torchtitan.components.tokenizer import BaseTokenizer  # noqa: E402
from torchtitan.models.common.attention import (  # noqa: E402
    FlexAttention,
    ScaledDotProductAttention,
)
from torchtitan.models.llama3.config_registry import llama3_debugmodel  # noqa: E402
from torchtitan.trainer import Trainer  # noqa: E402

import detdata  # noqa: E402
from detdata.integrations.torchtitan import TorchtitanDataLoader  # noqa: E402

assert torchtitan.tools.utils.device_type == "cpu"


class ByteTokenizer(BaseTokenizer):  # type: ignore[misc]
    """(2) torchtitan builds a tokenizer even when the data is tokens already."""

    @dataclass(kw_only=True, slots=True)
    class Config(BaseTokenizer.Config):  # type: ignore[misc]
        pass

    def __init__(self, config: Config, **kwargs: Any) -> None:
        super().__init__()

    def encode(self, *args: Any, **kwargs: Any) -> list[int]:
        raise NotImplementedError

    def decode(self, *args: Any, **kwargs: Any) -> str:
        raise NotImplementedError

    def get_vocab_size(self) -> int:
        return 2048


def row_digests(inputs: torch.Tensor, labels: torch.Tensor) -> list[str]:
    """One digest per row over the row's int64 inputs and labels."""
    out = []
    for x, y in zip(inputs, labels, strict=True):
        h = hashlib.sha256(x.to(torch.int64).numpy().tobytes())
        h.update(y.to(torch.int64).numpy().tobytes())
        out.append(h.hexdigest()[:16])
    return out


def gloo_fsdp(parallelize: Any) -> Any:
    """(1) gloo has no PREMUL_SUM, which FSDP2 uses for torchtitan's gradient divide factor
    of 1: reduce with SUM (the same sums) instead."""

    def parallelize_for_gloo(model: Any, **kwargs: Any) -> Any:
        model = parallelize(model, **kwargs)
        for module in model.modules():
            if isinstance(module, FSDPModule):
                module.set_force_sum_reduction_for_comms(True)
        return model

    return parallelize_for_gloo


class RecordingTrainer(Trainer):  # type: ignore[misc]
    """(3) torchtitan's Trainer; records each micro batch, stops after ``stop_at``."""

    def __init__(self, config: Trainer.Config, stop_at: int) -> None:
        super().__init__(config)
        self.stop_at = stop_at
        self.records: list[dict[str, Any]] = []

    def forward_backward_step(self, *, input_dict: Any, labels: Any, **kwargs: Any) -> Any:
        self.records.append({"step": self.step, "rows": row_digests(input_dict["input"], labels)})
        return super().forward_backward_step(input_dict=input_dict, labels=labels, **kwargs)

    def should_continue_training(self) -> bool:
        return bool(self.step < min(self.stop_at, self.config.training.steps))


def main(cfg: dict[str, Any]) -> None:
    config = llama3_debugmodel()
    model = config.model_spec.model
    model.layers = model.layers[:2]  # a 2-layer debugmodel: the data is the subject
    # torch's flex attention (the debugmodel's default) has no backward on CPU: torchtitan's
    # test-only SDPA inner attention instead (causal; the positions still feed RoPE)
    for _fqn, _attn, parent, attr in model.traverse(FlexAttention.Config):
        if isinstance(parent, list):
            parent[attr] = ScaledDotProductAttention.Config()
        else:
            setattr(parent, attr, ScaledDotProductAttention.Config())
    config.dump_folder = cfg["dump"]
    config.tokenizer = ByteTokenizer.Config()
    config.dataloader = TorchtitanDataLoader.Config(
        dataset_path=cfg["manifest"], global_batch_size=cfg["global_batch"], seed=cfg["seed"]
    )
    config.training.local_batch_size = cfg["local_batch"]
    # ``titan_global_batch``: torchtitan's own setting, when a test makes it differ
    config.training.global_batch_size = cfg.get("titan_global_batch", cfg["global_batch"])
    config.training.seq_len = cfg["seq_len"]
    config.training.steps = cfg["steps"]
    config.training.mixed_precision_param = "float32"
    config.training.disable_cuda_graphs = True
    config.parallelism.data_parallel_shard_degree = -1
    config.parallelism.spmd_backend = "partial_dtensor"
    config.validator.enable = False
    config.metrics.log_freq = 1000
    config.metrics.enable_tensorboard = False
    config.debug.seed = 0
    config.debug.enable_structured_logging = False
    config.checkpoint = CheckpointManager.Config(
        enable=True,
        interval=cfg["interval"],
        last_save_model_only=False,
        keep_latest_k=0,
        exclude_from_loading=["dataloader"] if cfg.get("exclude_dataloader") else [],
    )
    config.model_spec.parallelize_fn = gloo_fsdp(config.model_spec.parallelize_fn)
    trainer = RecordingTrainer(config, cfg["stop_at"])
    try:
        refused = None
        try:
            trainer.train()
        except detdata.DetdataError as exc:  # what detdata refuses (the test says where)
            refused = f"{type(exc).__name__}: {exc}"
        rank = torch.distributed.get_rank()
        out = Path(cfg["out"]) / f"trace-{cfg['tag']}-rank{rank}.json"
        trace = {"records": trainer.records, "final_step": trainer.step, "refused": refused}
        out.write_text(json.dumps(trace), encoding="utf-8")
    finally:
        trainer.close()
        torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main(json.loads(sys.argv[1]))
