"""OLMo-core (3.0) data loader backed by `detdata.DataLoader` (README, "OLMo-core").

OLMo-core's ``Trainer`` takes any ``DataLoaderBase``; its global batch is counted in *tokens*
and each rank receives its whole share of a step as one batch. Windows of ``S + 1`` tokens
(``TokenWindows(..., seq_len=S)``) become ``{"input_ids": w[:, :-1], "labels": w[:, 1:]}``;
windows of ``S`` tokens (``labels=False``) ``{"input_ids": w}`` (OLMo-core shifts the labels).

State: detdata's JSON state plus OLMo-core's epoch bookkeeping, identical on every rank, so a
run resumes at another data-parallel size. Epochs are bookkeeping only (``reshuffle`` changes
no sample). Setting ``global_batch_size`` to another value (``BatchSizeSchedulerCallback``'s
warm-up) is a `ConfigError`.
"""

from __future__ import annotations

import tempfile
from collections.abc import Iterable, Mapping
from typing import Any

import torch
import torch.distributed as dist
from olmo_core.data.collator import DataCollator
from olmo_core.data.data_loader import TextDataLoaderBase
from olmo_core.distributed.utils import get_rank, get_world_size

from detdata.base.checks import refuses_renamed
from detdata.base.errors import ConfigError
from detdata.datasets.base import Dataset, Stream
from detdata.loading.loader import DataLoader
from detdata.loading.options import LoaderOptions, ReadOptions

__all__ = ["OlmoCoreDataLoader", "olmo_batch"]


def olmo_batch(
    batch: Mapping[str, torch.Tensor], sequence_length: int, key: str = "tokens"
) -> dict[str, torch.Tensor]:
    """OLMo-core's batch (module doc; int64 copies); another width is a `ConfigError`."""
    if key not in batch:
        raise ConfigError(
            f"the detdata batch has no {key!r} column (columns: {sorted(batch)}); "
            "hint: OlmoCoreDataLoader(..., tokens_key=...) names the token column"
        )
    tokens = batch[key]
    width = tokens.shape[1] if tokens.ndim == 2 else -1
    if width == sequence_length + 1:
        return {
            "input_ids": tokens[:, :-1].to(torch.int64),
            "labels": tokens[:, 1:].to(torch.int64),
        }
    if width == sequence_length:
        return {"input_ids": tokens.to(torch.int64)}
    raise ConfigError(
        f"sequence_length is {sequence_length} but the detdata batch has {key!r} of shape "
        f"{tuple(tokens.shape)}; hint: TokenWindows(manifest, seq_len={sequence_length}) "
        f"({sequence_length + 1} tokens: inputs and labels) or with labels=False "
        f"({sequence_length} tokens: OLMo-core shifts the labels)"
    )


@refuses_renamed(read_ahead="batches_ahead")
class OlmoCoreDataLoader(TextDataLoaderBase):
    """An OLMo-core ``TextDataLoaderBase`` over `loader`, a `detdata.DataLoader` (module doc).

    ``global_batch_size`` is in tokens (a multiple of ``sequence_length`` x the data-parallel
    size); ``sequence_length`` defaults to the data's ``seq_len``; ``dp_process_group`` gives
    ``dp_rank`` / ``dp_world_size`` when they are not passed.
    """

    def __init__(
        self,
        data: Dataset | Stream,
        *,
        global_batch_size: int,
        sequence_length: int | None = None,
        seed: int = 0,
        dp_process_group: dist.ProcessGroup | None = None,
        dp_world_size: int | None = None,
        dp_rank: int | None = None,
        fs_local_rank: int | None = None,
        work_dir: str | None = None,
        collator: DataCollator | None = None,
        tokens_key: str = "tokens",
        num_workers: int = 0,
        worker_mode: str = "process",
        batches_ahead: int = 16,
        pin_memory: bool = False,
    ) -> None:
        length = sequence_length if sequence_length is not None else getattr(data, "seq_len", None)
        if not isinstance(length, int) or isinstance(length, bool) or length <= 0:
            raise ConfigError(
                "OlmoCoreDataLoader needs sequence_length (the tokens of input_ids a row) "
                f"when the data has no seq_len; got {length!r}"
            )
        if not isinstance(global_batch_size, int) or global_batch_size % length:
            raise ConfigError(
                f"global_batch_size counts tokens in OLMo-core: {global_batch_size!r} is not a "
                f"multiple of sequence_length {length}"
            )
        world = get_world_size(dp_process_group) if dp_world_size is None else dp_world_size
        rank = get_rank(dp_process_group) if dp_rank is None else dp_rank
        super().__init__(
            collator=collator if collator is not None else DataCollator(pad_token_id=0),
            work_dir=work_dir if work_dir is not None else tempfile.gettempdir(),
            global_batch_size=global_batch_size,
            dp_world_size=world,
            dp_rank=rank,
            fs_local_rank=fs_local_rank,
        )
        self.sequence_length = length
        self.tokens_key = tokens_key
        self.data = data
        self.loader = DataLoader(
            data,
            global_batch_size=global_batch_size // length,
            seed=seed,
            options=LoaderOptions(
                rank=rank,
                world_size=world,
                read=ReadOptions(worker_mode=worker_mode, batches_ahead=batches_ahead),
            ),
            num_workers=num_workers,
            pin_memory=pin_memory,
        )

    # the global batch is fixed for the run ------------------------------------------------
    @property
    def global_batch_size(self) -> int:
        return int(self._global_batch_size)

    @global_batch_size.setter
    def global_batch_size(self, new_global_batch_size: int) -> None:
        if new_global_batch_size == self._global_batch_size:
            return
        raise ConfigError(
            f"global batch change refused: OLMo-core set the data loader's global_batch_size "
            f"from {self._global_batch_size} to {new_global_batch_size} tokens before step "
            f"{self.loader.step + 1} (a batch-size schedule, e.g. BatchSizeSchedulerCallback's "
            "warm-up); detdata.integrations.olmo_core.OlmoCoreDataLoader keeps one global batch "
            "for the whole run (batch-size schedules are not supported yet); hint: remove the "
            "schedule or train with one global batch"
        )

    # OLMo-core's DataLoaderBase protocol ----------------------------------------------------
    @property
    def total_batches(self) -> int | None:
        """Steps per epoch of a `Dataset` (its samples // samples per step); None for a stream."""
        n = getattr(self.data, "num_samples", None)
        if not isinstance(n, int):
            return None
        return max(1, n // self.loader.global_batch_size)

    def reshuffle(self, epoch: int | None = None, **kwargs: Any) -> None:
        """Epoch bookkeeping only: detdata's order is a function of the global position."""
        del kwargs
        if epoch is None:
            epoch = 1 if self._epoch is None else self._epoch + 1
        if epoch <= 0:
            raise ValueError(f"'epoch' must be at least 1, got {epoch}")
        self._epoch = epoch

    def _iter_batches(self) -> Iterable[dict[str, Any]]:
        total = self.total_batches
        remaining = None if total is None else total - self.batches_processed
        if remaining is not None and remaining <= 0:
            return
        batches = iter(self.loader)  # continues at samples_consumed, epoch after epoch
        try:
            for delivered, batch in enumerate(batches, start=1):
                yield olmo_batch(batch, self.sequence_length, self.tokens_key)
                if remaining is not None and delivered >= remaining:
                    return  # the epoch's last step: nothing more is read (or counted)
        finally:
            batches.close()

    def get_mock_batch(self) -> dict[str, Any]:
        """A batch of this rank's shape (zeros) for OLMo-core's dry run; reads no data."""
        rows = self.rank_batch_size // self.sequence_length
        return {"input_ids": torch.zeros((rows, self.sequence_length), dtype=torch.int64)}

    def state_dict(self) -> dict[str, Any]:
        return {
            "detdata": self.loader.state_dict(),
            "epoch": self._epoch,
            "batches_processed": self.batches_processed,
            "tokens_processed": self.tokens_processed,
        }

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        if "detdata" not in state_dict:
            raise ConfigError(
                "this checkpoint's data-loader state was not saved by "
                f"detdata.integrations.olmo_core.OlmoCoreDataLoader (keys: {sorted(state_dict)})"
            )
        self.loader.load_state_dict(state_dict["detdata"])
        self.batches_processed = int(state_dict["batches_processed"])
        self.tokens_processed = int(state_dict["tokens_processed"])
        self._epoch = state_dict["epoch"] or self._epoch
