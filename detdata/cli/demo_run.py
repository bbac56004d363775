"""The demo: a real (tiny) pretraining loop with interrupt, resume and reshard proof.

`build_corpus` writes Python standard-library sources as byte tokens (vocab 256) into three
registered sources; `train_run` trains a tiny GPT on their `Mixture`, tracing the data and
hashing the final weights; `replay_check` runs it in fresh processes three ways (A, B, and C
stopped at step k on 2 in-process ranks, resumed on 1) and compares weights and traces.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import sysconfig
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any, Final

import blake3
import numpy as np
import torch
from torch import nn

from detdata.base.errors import ConfigError
from detdata.cli.replay import first_divergences
from detdata.datasets.mixture import Mixture
from detdata.datasets.tokens import TokenWindows
from detdata.identity.build import build_manifest
from detdata.identity.registry import Registry
from detdata.loading.loader import DataLoader
from detdata.loading.options import LoaderOptions
from detdata.loading.trace import StepSpan, TraceWriter, read_trace

#: Three sources, each a sorted list of standard-library packages (byte-tokenised).
SOURCES: Final = {
    "stdlib-asyncio": ("asyncio", "concurrent"),
    "stdlib-email": ("email", "json", "http"),
    "stdlib-misc": ("xml", "logging", "unittest"),
}
WEIGHTS: Final = {"stdlib-asyncio": "0.5", "stdlib-email": "0.3", "stdlib-misc": "0.2"}
SHARD_TOKENS: Final = 1 << 17


@dataclass(frozen=True, kw_only=True)
class RunConfig:
    """One training run of the demo."""

    out: str
    steps: int = 40
    global_batch: int = 16
    seq_len: int = 64
    seed: int = 1234
    world_size: int = 1
    stop_at: int | None = None
    resume: bool = False
    tag: str = "run"


def _source_files(packages: tuple[str, ...]) -> list[Path]:
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    files = [p for pkg in packages for p in (stdlib / pkg).rglob("*.py") if "test" not in p.parts]
    return sorted(files, key=lambda p: p.relative_to(stdlib).as_posix())  # never listing order


def build_corpus(out: Path) -> dict[str, str]:
    """Write byte-token shards per source, build manifests, register them; returns name -> id."""
    registry = Registry(str(out / "registry"))
    ids = {}
    for name, packages in SOURCES.items():
        files = _source_files(packages)
        if not files:
            raise ConfigError(f"demo source {name}: no standard-library files found for {packages}")
        tokens = np.frombuffer(b"".join(p.read_bytes() for p in files), dtype=np.uint8).astype(
            np.uint16
        )
        root = out / "data" / name
        root.mkdir(parents=True, exist_ok=True)
        for i in range(0, len(tokens), SHARD_TOKENS):
            np.save(root / f"shard-{i // SHARD_TOKENS:05d}.npy", tokens[i : i + SHARD_TOKENS])
        manifest = build_manifest(
            str(root),
            pattern="*.npy",
            progress=False,
            metadata={
                "tokenizer": "bytes-v1",
                "description": f"stdlib {packages}",
                "python": sys.version.split()[0],
            },
        )
        manifest.save(str(out / "manifests" / f"{name}.json"))
        ids[name] = registry.register(f"demo-{name}@v1", manifest)
    return ids


def make_mixture(out: Path, seq_len: int, seed: int) -> Mixture:
    registry = Registry(str(out / "registry"))
    sources = {
        name: TokenWindows(registry.resolve(f"demo-{name}@v1"), seq_len, allow_short_shards=True)
        for name in SOURCES
    }
    return Mixture(sources, WEIGHTS, seed=seed)


class TinyGPT(nn.Module):
    """A 2-layer causal transformer over 256 byte tokens."""

    def __init__(self, seq_len: int, dim: int = 64) -> None:
        super().__init__()
        self.embed = nn.Embedding(256, dim)
        self.pos = nn.Parameter(torch.zeros(seq_len, dim))
        layer = nn.TransformerEncoderLayer(
            dim, 4, 4 * dim, dropout=0.0, batch_first=True, norm_first=True
        )
        self.blocks = nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)
        self.head = nn.Linear(dim, 256)
        self.mask: torch.Tensor
        self.register_buffer(
            "mask", nn.Transformer.generate_square_subsequent_mask(seq_len), persistent=False
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.embed(x) + self.pos[: x.shape[1]]
        out: torch.Tensor = self.head(
            self.blocks(h, mask=self.mask[: x.shape[1], : x.shape[1]], is_causal=True)
        )
        return out


def weights_digest(model: nn.Module) -> str:
    hasher = blake3.blake3()
    for name, tensor in sorted(model.state_dict().items()):
        hasher.update(name.encode() + tensor.detach().contiguous().numpy().tobytes())
    return hasher.hexdigest()


def _setup(cfg: RunConfig) -> tuple[TinyGPT, torch.optim.Optimizer, list[DataLoader]]:
    torch.manual_seed(cfg.seed)
    torch.use_deterministic_algorithms(True)
    model = TinyGPT(cfg.seq_len)
    optim = torch.optim.AdamW(model.parameters(), lr=3e-3)
    mixture = make_mixture(Path(cfg.out), cfg.seq_len, cfg.seed)
    micro = cfg.global_batch // cfg.world_size
    loaders = [
        DataLoader(
            mixture,
            global_batch_size=cfg.global_batch,
            micro_batch_size=micro,
            seed=cfg.seed,
            options=LoaderOptions(rank=r, world_size=cfg.world_size),
        )
        for r in range(cfg.world_size)
    ]
    return model, optim, loaders


def train_run(cfg: RunConfig) -> dict[str, Any]:
    """Train; ranks are simulated in-process (their micro batches form the global batch in
    order)."""
    torch.set_num_threads(1)
    out = Path(cfg.out)
    model, optim, loaders = _setup(cfg)
    ckpt = out / "runs" / f"{cfg.tag}.ckpt"
    trace = TraceWriter(out / "runs" / f"{cfg.tag}.trace.jsonl", 0)
    if cfg.resume:
        saved = torch.load(ckpt, weights_only=True)
        model.load_state_dict(saved["model"])
        optim.load_state_dict(saved["optim"])
        state = json.loads((out / "runs" / f"{cfg.tag}.loader.json").read_text())
        for dl in loaders:
            dl.load_state_dict(state)
        trace.restore(loaders[0].samples_consumed)  # the resumed run appends to the same trace
    iters = [iter(dl) for dl in loaders]
    step, last = loaders[0].step, cfg.stop_at if cfg.stop_at is not None else cfg.steps
    losses = []
    while step < last:
        parts = [next(it) for it in iters]
        positions = np.concatenate(
            [dl.positions_of_next() - dl.layout.samples_per_micro_step for dl in loaders]
        )
        tokens = torch.cat([p["tokens"] for p in parts]).long()
        at = step * cfg.global_batch
        span = StepSpan(step=step, start=at, size=cfg.global_batch, next=at + cfg.global_batch)
        trace.add(at, positions, {"tokens": tokens}, span=span)
        logits = model(tokens[:, :-1])
        loss = nn.functional.cross_entropy(logits.reshape(-1, 256), tokens[:, 1:].reshape(-1))
        optim.zero_grad(set_to_none=True)
        loss.backward()  # type: ignore[no-untyped-call]
        optim.step()
        losses.append(float(loss))
        step += 1
    trace.close()
    if cfg.stop_at is not None:
        torch.save({"model": model.state_dict(), "optim": optim.state_dict()}, ckpt)
        (out / "runs" / f"{cfg.tag}.loader.json").write_text(json.dumps(loaders[0].state_dict()))
    return {
        "tag": cfg.tag,
        "steps": step,
        "weights_b3": weights_digest(model),
        "losses": losses,
        "samples_consumed": loaders[0].samples_consumed,
    }


def _spawn(cfg: RunConfig) -> dict[str, Any]:
    cmd = [sys.executable, "-m", "detdata.cli.demo_run", json.dumps(asdict(cfg))]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    done = subprocess.run(cmd, check=True, capture_output=True, text=True, env=env)
    result: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
    return result


def replay_check(out: Path, *, steps: int, stop_at: int) -> dict[str, Any]:
    """Three runs in fresh processes (``0 < stop_at < steps``, `check_run_args`); compares
    final weights and data traces bytewise."""
    (out / "runs").mkdir(parents=True, exist_ok=True)
    for old in (out / "runs").glob("*"):
        old.unlink()
    base = RunConfig(out=str(out), steps=steps)
    a = _spawn(replace(base, tag="A"))
    b = _spawn(replace(base, tag="B"))
    _spawn(replace(base, tag="C", world_size=2, stop_at=stop_at))
    c = _spawn(replace(base, tag="C", world_size=1, resume=True))
    ta, tb, tc = (read_trace(out / "runs" / f"{t}.trace.jsonl") for t in ("A", "B", "C"))
    return {
        "weights": {"A": a["weights_b3"], "B": b["weights_b3"], "C": c["weights_b3"]},
        "weights_identical": a["weights_b3"] == b["weights_b3"] == c["weights_b3"],
        **first_divergences(ta, tb, tc),
        "steps": steps,
        "stop_at": stop_at,
        "final_loss": a["losses"][-1],
        "first_loss": a["losses"][0],
    }


def loader_throughput(out: Path, seconds: float = 3.0) -> float:
    """Samples/s of the demo mixture loader (global batch 64, seq 64)."""
    dl = DataLoader(make_mixture(out, 64, 1), global_batch_size=64, seed=1)
    it = iter(dl)
    next(it)
    start, n = time.perf_counter(), 0
    while time.perf_counter() - start < seconds:
        next(it)
        n += 64
    return n / (time.perf_counter() - start)


if __name__ == "__main__":
    print(json.dumps(train_run(RunConfig(**json.loads(sys.argv[1])))))
