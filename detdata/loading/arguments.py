"""Loader arguments checked at construction, as torch checks them (or should), and the
worker mode. Nothing is ignored silently: thread mode refuses process-only arguments."""

from __future__ import annotations

import enum
from collections.abc import Mapping
from typing import Final

from detdata.base.errors import ConfigError


class WorkerMode(str, enum.Enum):
    """Where ``num_workers`` readers run. ``PROCESS`` (default, as torch): worker processes,
    each seeding python/numpy/torch globals from (seed, rank, worker). ``THREAD``: threads
    of this process (no transfer: faster for small samples), sharing global generators:
    transforms must use the ``rng`` they are handed (identical in both modes)."""

    PROCESS = "process"
    THREAD = "thread"


def check_torch_args(
    *,
    worker_mode: WorkerMode,
    num_workers: int,
    prefetch_factor: object,
    persistent_workers: object,
    timeout: object,
    multiprocessing_context: object,
    collate_fn: object,
    worker_init_fn: object,
) -> None:
    """Refuse at construction what torch would refuse late (or silently ignore), and what
    thread mode would ignore."""
    for name, fn in (("collate_fn", collate_fn), ("worker_init_fn", worker_init_fn)):
        if fn is not None and not callable(fn):
            raise ConfigError(
                f"{name} must be callable or None, got {type(fn).__name__} {fn!r:.60}"
            )
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not timeout >= 0:
        raise ConfigError(
            f"timeout must be a number of seconds >= 0 (0: wait forever), got {timeout!r}"
        )
    if not isinstance(persistent_workers, bool):
        raise ConfigError(f"persistent_workers must be True or False, got {persistent_workers!r}")
    for name, passed, why in (
        ("prefetch_factor", prefetch_factor is not None, " (read-ahead groups per worker)"),
        ("persistent_workers=True", persistent_workers, ""),
        ("multiprocessing_context", multiprocessing_context is not None, " (no process to start)"),
    ):
        if passed and num_workers == 0:
            raise ConfigError(
                f"{name} needs num_workers > 0{why}; hint: drop it or set num_workers"
            )
    if multiprocessing_context is not None and isinstance(multiprocessing_context, str):
        import multiprocessing

        methods = multiprocessing.get_all_start_methods()
        if multiprocessing_context not in methods:
            raise ConfigError(
                f"multiprocessing_context {multiprocessing_context!r} is not a start "
                f"method of this platform; expected one of {methods}"
            )
    elif multiprocessing_context is not None and not hasattr(multiprocessing_context, "Process"):
        raise ConfigError(
            f"multiprocessing_context must be a start method name or a multiprocessing "
            f"context, got {type(multiprocessing_context).__name__}"
        )
    threads = worker_mode is WorkerMode.THREAD and num_workers != 0
    process_only = (
        ("persistent_workers", persistent_workers, False),
        ("timeout", timeout, 0),
        ("multiprocessing_context", multiprocessing_context, None),
        ("worker_init_fn", worker_init_fn, None),
    )
    given = sorted(name for name, value, unused in process_only if threads and value != unused)
    if given:  # thread mode would ignore what only means something for worker processes
        raise ConfigError(
            f"worker_mode='thread' runs reads on threads of this process and would ignore "
            f"{given} (they only apply to worker processes); hint: drop them, or use "
            "worker_mode='process'"
        )


def parse_worker_mode(value: str | WorkerMode) -> WorkerMode:
    try:
        return WorkerMode(value)
    except ValueError:
        raise ConfigError(f"worker_mode must be 'process' or 'thread', got {value!r}") from None


#: torch.utils.data.DataLoader arguments and what detdata takes instead.
TORCH_ONLY: Final = {
    "batch_size": "micro_batch_size= (this rank's batch per iteration, torch's batch_size) and "
    "global_batch_size= (samples per optimizer step over all ranks: micro x world x accumulation)",
    "shuffle": "seed= (the order is always a seeded shuffle: order=GlobalOrder() by default)",
    "sampler": "order= (detdata orders samples itself); to keep your own torch DataLoader, use "
    "detdata.DeterministicBatchSampler as its batch_sampler",
    "batch_sampler": "global_batch_size= / micro_batch_size= (detdata batches itself); to keep "
    "your own torch DataLoader, use detdata.DeterministicBatchSampler as its batch_sampler",
    "drop_last": "nothing: every global batch is whole (total_samples= bounds a run)",
    "generator": "seed= (order and per-sample randomness derive from it)",
    "in_order": "nothing: batches are always delivered in order",
    "pin_memory_device": "device= (batches moved to that device by the loader)",
}


class TorchOnly(enum.Enum):
    """The default of each torch keyword the `DataLoader` refuses (``batch_size=``,
    ``shuffle=``, ... `TORCH_ONLY`): any other value is a `ConfigError` naming detdata's
    argument for it, and a type checker's error first."""

    UNSET = "unset"


def refuse_torch_habits(positional: tuple[object, ...], keywords: Mapping[str, object]) -> None:
    """A `ConfigError` for torch-style calls: ``DataLoader(ds, 8)`` (``positional``),
    ``batch_size=8`` (``keywords``, each `TorchOnly.UNSET` unless given)."""
    if positional:
        shown = ", ".join(f"{a!r:.40}" for a in positional)
        raise ConfigError(
            f"DataLoader(data, {shown}): every argument after the dataset is a keyword; "
            f"hint: {TORCH_ONLY['batch_size']}, e.g. DataLoader(data, "
            "global_batch_size=512, micro_batch_size=8, seed=1234)"
        )
    for name, value in keywords.items():
        if value is not TorchOnly.UNSET:
            raise ConfigError(
                f"DataLoader({name}={value!r:.40}) is torch.utils.data.DataLoader's argument; "
                f"hint: detdata takes {TORCH_ONLY[name]}"
            )
