"""torchtitan (0.3) data loader backed by `detdata.DataLoader` (README, "torchtitan").

torchtitan builds its data loader from ``Trainer.Config.dataloader`` with only the local batch
and the data-parallel coordinates, so `TorchtitanDataLoader.Config` takes the global batch
(samples per optimizer step, ``training.global_batch_size``) explicitly. Each batch is
torchtitan's ``({"input": tokens[:, :-1], "positions": ...}, tokens[:, 1:])`` over
``TokenWindows(manifest, seq_len=training.seq_len)``; micro batches and ranks take the
positions of docs/design.md section 4.

Checkpoints: ``states["dataloader"]`` (a DCP ``Stateful``) is detdata's JSON state, identical
on every rank, so a run resumes at another data-parallel degree. A state saved between two
optimizer steps of the configured global batch is refused (`ConfigError`).

When a torchtitan ``Trainer`` method starts iterating the loader (its ``batch_generator``),
``gradient_accumulation_steps x pipeline micro batches x local batch x dp degree`` must be the
loader's global batch (`ConfigError`) and the loader must stand at the first position of the
step the Trainer resumes after (`StateError`), before any micro batch trains.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from types import FrameType
from typing import Annotated, Any

import torch
import tyro
from torchtitan.components.dataloader import BaseDataLoader

from detdata.base.checks import refuses_renamed
from detdata.base.errors import ConfigError, StateError
from detdata.datasets.base import Dataset, Stream
from detdata.datasets.tokens import TokenWindows
from detdata.identity.registry import Registry
from detdata.loading.loader import DataLoader
from detdata.loading.options import LoaderOptions, ReadOptions

__all__ = ["TorchtitanDataLoader", "titan_batch"]

#: builds the data from torchtitan's ``seq_len`` (e.g. a `Mixture` of `TokenWindows`)
DataFactory = Callable[[int], "Dataset | Stream"]


def titan_batch(
    batch: Mapping[str, torch.Tensor],
    seq_len: int,
    key: str = "tokens",
    *,
    positions: bool = True,
) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """torchtitan's batch (module doc; int64 copies) from rows of ``seq_len + 1`` tokens
    (another width is a `ConfigError`); ``positions``: ``0 .. seq_len - 1`` in every row."""
    if key not in batch:
        raise ConfigError(
            f"the detdata batch has no {key!r} column (columns: {sorted(batch)}); "
            "hint: set TorchtitanDataLoader.Config(tokens_key=...) to the token column"
        )
    tokens = batch[key]
    if tokens.ndim != 2 or tokens.shape[1] != seq_len + 1:
        raise ConfigError(
            f"torchtitan needs windows of seq_len + 1 = {seq_len + 1} tokens (inputs and "
            f"next-token labels), the detdata batch has {key!r} of shape {tuple(tokens.shape)}; "
            f"hint: TokenWindows(manifest, seq_len={seq_len}) with labels=True (the default)"
        )
    inputs: dict[str, torch.Tensor] = {"input": tokens[:, :-1].to(torch.int64)}
    if positions:
        row = torch.arange(seq_len, dtype=torch.int64)
        inputs["positions"] = row.repeat(tokens.shape[0], 1)
    return inputs, tokens[:, 1:].to(torch.int64)


class TorchtitanDataLoader(BaseDataLoader):  # type: ignore[misc]  # torchtitan is untyped
    """A torchtitan ``BaseDataLoader`` (a DCP ``Stateful``) over `loader`, a
    `detdata.DataLoader`, built by torchtitan's trainer from `Config`."""

    @refuses_renamed(read_ahead="batches_ahead")
    @dataclass(kw_only=True, slots=True)
    class Config(BaseDataLoader.Config):  # type: ignore[misc]
        """What the data is and the global batch. ``dataset`` (inherited) is a detdata
        registry name (``name@version``, resolved in ``Registry(registry)``);
        ``dataset_path`` (inherited) a manifest path or URL and wins over ``dataset``;
        ``data`` (Python configs only) builds any detdata dataset or stream from ``seq_len``
        and wins over both."""

        global_batch_size: int = 0
        """Samples per optimizer step, all ranks and micro batches together (set it to
        ``training.global_batch_size``); required."""

        seed: int = 0
        """Order seed (detdata's ``seed``)."""

        registry: str | None = None
        """Registry root for ``dataset`` (default: ``$DETDATA_REGISTRY`` or the user cache)."""

        data: Annotated[DataFactory | None, tyro.conf.Suppress] = None
        """``seq_len -> Dataset | Stream``; each sample needs ``seq_len + 1`` tokens."""

        tokens_key: str = "tokens"
        """The token column of the detdata batches."""

        positions: bool = True
        """Add ``"positions"`` (``0 .. seq_len - 1``) to the inputs (flex / varlen attention
        needs them to build its masks)."""

        total_samples: int | None = None
        """Stop after this many samples (detdata's ``total_samples``); None: never."""

        num_workers: int = 0
        worker_mode: str = "process"
        batches_ahead: int = 16
        pin_memory: bool = False

    def __init__(
        self,
        config: Config,
        *,
        dp_world_size: int,
        dp_rank: int,
        seq_len: int,
        local_batch_size: int,
        tokenizer: Any = None,
        snapshot_every_n_steps: int | None = None,
        **kwargs: Any,
    ) -> None:
        del tokenizer, snapshot_every_n_steps, kwargs  # the data is tokenized already
        if config.global_batch_size <= 0:
            raise ConfigError(
                "TorchtitanDataLoader.Config(global_batch_size=...) is required: torchtitan "
                "passes only the local batch to data loaders; set it to "
                "training.global_batch_size (samples per optimizer step)"
            )
        self.config = config
        self.dp_rank = dp_rank
        self.dp_world_size = dp_world_size
        self.seq_len = seq_len
        self.loader = DataLoader(
            _data(config, seq_len),
            global_batch_size=config.global_batch_size,
            micro_batch_size=local_batch_size,
            seed=config.seed,
            options=LoaderOptions(
                rank=dp_rank,
                world_size=dp_world_size,
                total_samples=config.total_samples,
                read=ReadOptions(
                    worker_mode=config.worker_mode, batches_ahead=config.batches_ahead
                ),
            ),
            num_workers=config.num_workers,
            pin_memory=config.pin_memory,
        )

    def __iter__(self) -> Iterator[tuple[dict[str, torch.Tensor], torch.Tensor]]:
        """torchtitan's batches; a torchtitan ``Trainer`` iterating is checked first."""
        trainer = _titan_trainer(sys._getframe(1))
        if trainer is not None:
            self._check_trainer(trainer)
        return self._batches()

    def _batches(self) -> Iterator[tuple[dict[str, torch.Tensor], torch.Tensor]]:
        for batch in self.loader:
            yield titan_batch(
                batch, self.seq_len, self.config.tokens_key, positions=self.config.positions
            )

    def _check_trainer(self, trainer: Any) -> None:
        """The module doc's two checks against ``trainer`` (``trainer.step`` is counted before
        the step's first batch: the loader stands at the first position of the step before)."""
        loader = self.loader
        steps = int(trainer.gradient_accumulation_steps)
        steps *= int(getattr(trainer, "num_pipeline_parallel_microbatches", 1))
        gbs = loader.global_batch_size
        loader.check_trainer_batch(
            micro_batch_size=loader.batch_size,
            accumulation=steps,
            world_size=self.dp_world_size,
            trainer="torchtitan (training.global_batch_size)",
            fix=f"config.training.global_batch_size = {gbs}, the loader's; or "
            "TorchtitanDataLoader.Config(global_batch_size=config.training.global_batch_size)",
        )
        resumed = int(trainer.step) - 1  # the step restored from the checkpoint (0: none)
        if loader.samples_consumed == loader.position_of_step(resumed):
            return
        where = (
            "starts at position 0: its state was not loaded (checkpoint.exclude_from_loading "
            "names 'dataloader', or the checkpoint has none)"
            if loader.samples_consumed == 0
            else f"stands at position {loader.samples_consumed} (global step {loader.step})"
        )
        raise StateError(
            f"torchtitan resumes after optimizer step {resumed} (position "
            f"{loader.position_of_step(resumed)}), but the detdata loader {where}; it would "
            "not train the samples of the steps it resumes at; hint: load the dataloader "
            "state with the checkpoint (leave 'dataloader' out of "
            "checkpoint.exclude_from_loading) and keep TorchtitanDataLoader.Config as saved",
            fields=("samples_consumed",),
        )

    def state_dict(self) -> dict[str, Any]:
        """detdata's JSON state; refused between two optimizer steps (see the module doc)."""
        consumed = self.loader.samples_consumed
        if consumed % self.loader.global_batch_size:
            raise ConfigError(
                f"torchtitan saved its state after {consumed} samples, inside an optimizer step of"
                f" TorchtitanDataLoader.Config(global_batch_size={self.loader.global_batch_size});"
                " hint: set training.global_batch_size to the same value (samples)"
            )
        return self.loader.state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.loader.load_state_dict(state_dict)


def _titan_trainer(frame: FrameType | None) -> Any:
    """The torchtitan ``Trainer`` whose method (``frame``) called ``iter()``, or None."""
    module = sys.modules.get("torchtitan.trainer")
    owner = None if frame is None else frame.f_locals.get("self")
    if module is None or owner is None or not isinstance(owner, module.Trainer):
        return None
    return owner


def _data(config: TorchtitanDataLoader.Config, seq_len: int) -> Dataset | Stream:
    if config.data is not None:
        return config.data(seq_len)
    if config.dataset_path:
        return TokenWindows(config.dataset_path, seq_len)
    if config.dataset:
        return TokenWindows(Registry(config.registry).resolve(config.dataset), seq_len)
    raise ConfigError(
        "TorchtitanDataLoader.Config needs the data: dataset='name@version' (a detdata registry "
        "name), dataset_path='manifest.json' or data=callable(seq_len)"
    )
