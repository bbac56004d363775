"""`detdata.DataLoader`: a drop-in for torch's DataLoader with one-integer resume.

A sampler yields the positions of this rank's micro batches (`Layout`) and a
map-style dataset turns a whole array of positions into one batch with one
batched read (`Stream.fetch`). With process workers these go to torch's public
``DataLoader``, which handles workers, prefetching and pinning; with
``num_workers=0`` the same sampler, dataset and collate run inline (torch's
per-batch plumbing cost more than the read; the shard files of the next groups are
read in the background there, `DataLoader._inline_batches`), and
``worker_mode="thread"`` runs them on reader threads. The loader counts samples *delivered*
to the caller; its state is that count plus identity fields (`LoaderState`).
"""

from __future__ import annotations

import collections
import functools
import inspect
import itertools
import json
import os
import random
import signal
import weakref
from collections.abc import Callable, Generator, Iterable, Iterator, Mapping
from typing import Any, Final

import numpy as np
import torch
import torch.utils.data as tud

from detdata.base.checks import check_count, check_seed
from detdata.base.errors import ConfigError, StaleIteratorError, StateError
from detdata.base.redact import get_logger
from detdata.base.types import MAX_POSITION, Batch, IntArray
from detdata.datasets.base import Dataset, Stream
from detdata.datasets.prefetch import Lookahead
from detdata.datasets.streams import OrderedStream, as_stream
from detdata.loading import frameworks
from detdata.loading.arguments import (
    WorkerMode,
    check_thread_mode,
    check_torch_args,
    parse_worker_mode,
    refuse_torch_habits,
)
from detdata.loading.device import check_depth, check_device
from detdata.loading.history import Plan, as_schedule
from detdata.loading.layout import Layout, process_group_rank_world
from detdata.loading.reading import (
    GroupReader,
    GroupSampler,
    PositionDataset,
    ReadAhead,
    SlotSampler,
    Transform,
)
from detdata.loading.slots import SlotGroup, SlotTransport
from detdata.loading.state import (
    K_ALGORITHM,
    K_DATA,
    K_EXCLUSIONS,
    K_GLOBAL_BATCH,
    K_MANIFESTS,
    K_MIXTURE,
    K_SEED,
    K_STREAM_SEED,
    LoaderState,
    check_allow,
    environment,
    identity_fields,
    mismatch_message,
    transform_identity,
)
from detdata.loading.steps import MidStep, parse_mid_step
from detdata.loading.trace import StepSpan, TraceWriter
from detdata.order.batches import BatchSchedule
from detdata.order.choice import OrderLike
from detdata.order.rng import worker_seed
from detdata.storage.fileread import set_read_threads

_LOG: Final = get_logger("detdata")
#: Checked fields whose change at a resume gives earlier positions another stream.
_STREAM_FIELDS: Final = (K_SEED, K_STREAM_SEED, K_MANIFESTS, K_DATA, K_ALGORITHM)


def _same(a: Any, b: Any) -> bool:
    return bool(json.dumps(a, sort_keys=True) == json.dumps(b, sort_keys=True))


#: Groups of micro batches the inline loader (``num_workers=0``) hints to the stream ahead
#: of the one it reads (`DataLoader._inline_batches`).
PREFETCH_GROUPS: Final = 2
#: ``lookahead``'s default: micro steps whose shards are filled into a shard cache ahead of
#: the consumer (the window is cut where it would not fit the cache's bound).
DEFAULT_LOOKAHEAD: Final = 1024


def seed_globals(seed64: int) -> None:
    """Seed python, numpy-legacy and torch global generators from one 64-bit value."""
    random.seed(seed64)
    np.random.seed(seed64 % (1 << 32))
    torch.manual_seed(seed64 % (1 << 63))


def _init_worker(
    seed: int, rank: int, user_init: Callable[[int], None] | None, worker_id: int
) -> None:
    # a terminal's Ctrl-C (SIGINT to the process group) is for the main process, which
    # keeps or replaces the workers (`DataLoader._loader_from_here`): a kept worker that died
    # of it would cost the next iteration torch's "worker exited unexpectedly" error
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    seed_globals(worker_seed(seed, rank, worker_id))
    set_read_threads(1)  # the worker processes read side by side (never changes a byte)
    if user_init is not None:
        user_init(worker_id)


def _schema(batch: Any) -> dict[str, str] | str:
    """Keys and element types of a delivered batch (shapes excluded: a collate may pad)."""
    if not isinstance(batch, Mapping):
        return type(batch).__name__
    out = {}
    for key, value in batch.items():
        if isinstance(value, torch.Tensor):
            out[str(key)] = str(value.dtype)
        elif isinstance(value, np.ndarray):
            out[str(key)] = value.dtype.str
        else:
            out[str(key)] = type(value).__name__
    return dict(sorted(out.items()))


def _identity(item: Any) -> Any:
    return item


class EpochStart:
    """``DataLoader.sampler``: not a torch sampler, only the ``set_epoch`` hook trainers call
    on ``loader.sampler`` at every epoch start (Lightning does); forwards to the loader."""

    def __init__(self, loader: DataLoader) -> None:
        self._loader = loader

    def set_epoch(self, epoch: int) -> None:
        self._loader.set_epoch(epoch)


class LoaderIterator:
    """One iteration of a `DataLoader` (what ``iter(loader)`` returns): its micro batches from
    ``samples_consumed`` on. Once superseded (a second ``iter()``, ``load_state_dict``), every
    further ``next()`` raises `StaleIteratorError` (its readers are released at the first),
    never `StopIteration`: a training loop over a stale iterator fails, it does not end early."""

    def __init__(self, loader: DataLoader, generation: int) -> None:
        self._loader = loader
        self._generation = generation
        self._batches = loader._iterate(generation)
        self._closed = False

    def __iter__(self) -> LoaderIterator:
        return self

    def __next__(self) -> Any:
        if self._closed:
            raise StopIteration  # ended on purpose: `close`, `DataLoader.close`
        if self._generation != self._loader._generation:
            self._batches.close()
            raise self._loader._stale()
        return next(self._batches)

    def close(self) -> None:
        """End this iteration now (its readers and worker processes stop); `DataLoader.close`
        calls it for every live iterator. Later ``next()`` calls end the iteration."""
        self._closed = True
        self._batches.close()


class DataLoader:
    """Deterministic, resumable loader over a `Dataset` or `Stream` (e.g. `Mixture`).

    Each iteration yields this rank's next micro batch (``micro_batch_size``
    samples, positions in order) as a dict of tensors. Global positions are
    assigned as in docs/design.md section 4, so the samples of a step never depend on
    ``world_size``, ``micro_batch_size`` or ``num_workers``. Iteration is
    infinite (epochs continue) unless ``total_samples`` is given.

    ``order`` (for a dataset the loader orders itself; a stream has its own): the
    default `Order.FEISTEL_V1`, or ``LocalityOrder(window_shards=k)`` to read shards in
    windows of ``k`` (large or remote corpora: `detdata.order.locality`). Its name with
    its parameters is the checked field ``algorithm``.

    ``global_batch_size`` is an int or a `BatchSchedule` (a Megatron-style ramp-up,
    explicit ``(step, global_batch)`` or ``(samples, global_batch)`` changes): positions
    stay sample-counted, the micro batch stays fixed and the micro steps per step follow
    the schedule (``global_batch_size(step) / (micro_batch_size * world_size)``, which
    must divide for every step; a schedule needs ``micro_batch_size``). It is the checked
    field ``global_batch_size``; a change allowed by name at a resume is recorded in the
    state's ``history`` and takes effect at the saved step (`load_state_dict`).

    With ``device`` set (e.g. ``"cuda"``), batches arrive on that device through
    reused pinned buffers and a side stream, ``device_prefetch`` batches ahead;
    those are not counted until yielded. ``pin_memory`` is then ignored: the
    device path pins into its own reused buffers.

    ``read_ahead`` (default 16): this many consecutive micro batches of the rank
    are read with one batched read and then split, which amortises the fixed
    per-read cost and, with worker processes, the fixed per-transfer cost (with
    the default collate a worker writes a group of numeric columns into a reused
    shared-memory slot and hands over only its index, `detdata.loading.slots`;
    other groups cross as one tensor per column). Bytes and order never depend on it.
    A group that fails to read is
    re-read batch by batch, so the error surfaces exactly at the unreadable batch
    and every batch before it is delivered. A worker process that hangs or dies
    takes its whole group with it (the state still counts only delivered
    batches). With workers, ``prefetch_factor`` counts groups per worker and
    ``timeout`` applies to each group. Memory in flight is about ``read_ahead``
    x micro-batch bytes x (``num_workers`` x ``prefetch_factor`` + 1): lower
    ``read_ahead`` for large samples (images, long documents in big micro batches).
    With ``num_workers=0`` the next `PREFETCH_GROUPS` groups are hinted to the stream
    while a group is delivered: a `TokenWindows` over local shards reads their files in
    the background (native threads, no GIL) while the caller trains, so memory in
    flight is up to 3 groups there (the same bytes and checks; see
    `TokenWindows.prefetch`).

    ``persistent_workers=True`` keeps the worker processes from one iteration to the next
    when the last one left them between two groups (``break``, the end of the data, a batch
    with the caller). After an interrupt (Ctrl-C) or an error inside torch's iterator, its
    reset of the kept workers at ``iter()`` included, the next iteration starts fresh
    workers and continues exactly at ``samples_consumed``: a half-reset torch iterator is
    never reused (it would raise torch's ``KeyError: _ResumeIteration`` or wait forever).
    Worker processes ignore SIGINT: a terminal's Ctrl-C interrupts the main process only.

    ``lookahead`` (default None: `DEFAULT_LOOKAHEAD` micro steps where some shards are read
    through a shard cache, e.g. `TokenWindows`' default cache of a remote root; 0: off): with
    remote shards read through a shard cache
    (``cache_dir``), the shards of the next ``lookahead`` micro steps of this rank are
    filled into the cache in the background, in order of first use, on
    ``lookahead_connections`` threads, released after their last use, the window kept
    under the cache's byte bound (`detdata.datasets.prefetch`). Make it larger than
    ``num_workers x prefetch_factor x read_ahead``. It never changes a delivered byte.

    ``state_dict()`` is one JSON object; ``samples_consumed`` counts samples
    delivered to the callers of all ranks (prefetched batches are not counted).
    """

    def __init__(
        self,
        data: Dataset | Stream,
        *torch_positional: object,
        global_batch_size: int | BatchSchedule | None = None,
        micro_batch_size: int | None = None,
        seed: int = 0,
        rank: int | None = None,
        world_size: int | None = None,
        num_workers: int = 0,
        pin_memory: bool = False,
        collate_fn: Callable[[Batch], Any] | None = None,
        prefetch_factor: int | None = None,
        persistent_workers: bool = False,
        transform: Transform | None = None,
        total_samples: int | None = None,
        trace: str | os.PathLike[str] | None = None,
        worker_init_fn: Callable[[int], None] | None = None,
        multiprocessing_context: str | None = None,
        timeout: float = 0,
        allow_on_resume: Iterable[str] = (),
        device: str | torch.device | None = None,
        device_prefetch: int = 2,
        worker_mode: str | WorkerMode = WorkerMode.PROCESS,
        read_ahead: int = 16,
        transform_id: str | None = None,
        lookahead: int | None = None,
        lookahead_connections: int = 4,
        order: OrderLike | None = None,
        mid_step_on_resume: str | MidStep = MidStep.REDO,
        **torch_keywords: object,
    ) -> None:
        refuse_torch_habits(torch_positional, torch_keywords, _KEYWORDS)
        if global_batch_size is None:
            raise ConfigError(
                "DataLoader needs global_batch_size= (samples per optimizer step over all "
                "ranks); hint: micro_batch_size= is each rank's batch per iteration (torch's "
                "batch_size), e.g. DataLoader(data, global_batch_size=512, micro_batch_size=8)"
            )
        self.seed = check_seed(seed)
        check_torch_args(
            num_workers=num_workers,
            prefetch_factor=prefetch_factor,
            persistent_workers=persistent_workers,
            timeout=timeout,
            multiprocessing_context=multiprocessing_context,
            callables={
                "transform": transform,
                "collate_fn": collate_fn,
                "worker_init_fn": worker_init_fn,
            },
        )
        check_thread_mode(
            worker_mode,
            num_workers,
            persistent_workers=persistent_workers,
            timeout=timeout,
            multiprocessing_context=multiprocessing_context,
            worker_init_fn=worker_init_fn,
        )
        if transform_id is not None and (not isinstance(transform_id, str) or not transform_id):
            raise ConfigError(
                f"transform_id must be a non-empty string naming the transform's "
                f"version (e.g. 'tokenize-v3'), got {transform_id!r}"
            )
        self._schedule = as_schedule(global_batch_size)
        constant = self._schedule.changes[0][1] if self._schedule.is_constant else None
        self._layout_args = (constant, micro_batch_size, rank, world_size)
        self.layout = self._layout_now(0)
        self._plan = Plan.fresh(self._schedule, self.layout)
        # the batches before the settled one are checked from the start position (0, or the
        # saved one) when iteration starts or a state is loaded: a resume past a ramp-up
        # may use a layout the ramp's batches do not fit
        self._plan.check_settles(self.layout)
        self.num_workers = check_count(num_workers, "num_workers", minimum=0, maximum=1024)
        if total_samples is not None:
            total_samples = check_count(total_samples, "total_samples", minimum=0)
            self._plan.check_step_end(total_samples)
        self.total_samples = total_samples
        self._data = data
        self._stream = as_stream(data, self.seed, order=order)
        self._order = order
        self._saved_plan: Plan | None = None  # the history of the state loaded last, as saved
        # the loader ordered a plain dataset with its seed, or an `Excluded` did with that same
        # seed (adding exclusions at a resume of a loader-ordered run keeps ``stream_seed``)
        self._wrapped = self._stream is not data or (
            getattr(self._stream, "orders_dataset", False) is True
            and getattr(self._stream, "seed", None) == self.seed
        )
        self._transform = transform
        self._collate_fn = collate_fn
        self._transform_name = transform_identity(transform_id, transform, collate_fn)
        self._torch_kwargs: dict[str, Any] = {
            "num_workers": self.num_workers,
            "pin_memory": pin_memory,
            "timeout": timeout,
            "persistent_workers": persistent_workers and self.num_workers > 0,
            "multiprocessing_context": multiprocessing_context if self.num_workers > 0 else None,
        }
        self._user_worker_init = worker_init_fn
        if self.num_workers > 0 and prefetch_factor is not None:
            self._torch_kwargs["prefetch_factor"] = prefetch_factor
        self._allow = check_allow(allow_on_resume)
        self._mid_step = parse_mid_step(mid_step_on_resume, "mid_step_on_resume")
        self.worker_mode = parse_worker_mode(worker_mode)
        self.read_ahead = check_count(read_ahead, "read_ahead", minimum=1, maximum=64)
        self.lookahead = check_count(
            DEFAULT_LOOKAHEAD if lookahead is None else lookahead, "lookahead", minimum=0
        )
        self.lookahead_connections = check_count(
            lookahead_connections, "lookahead_connections", maximum=256
        )
        self._pin_memory = bool(pin_memory)
        self._prefetch_factor = (
            2 if prefetch_factor is None else check_count(prefetch_factor, "prefetch_factor")
        )
        self.device = None if device is None else check_device(device)
        self.device_prefetch = check_depth(device_prefetch, "device_prefetch")
        if self.device is not None:
            # the device path stages into its own reused pinned buffers; torch pinning would copy
            # twice
            self._torch_kwargs["pin_memory"] = False
        self._live: weakref.WeakSet[LoaderIterator] = weakref.WeakSet()
        self._consumed = 0
        self._schema: dict[str, str] | str | None = None  # of the first transformed batch
        self._generation = 0
        self._superseded = ""  # what ended the iterators of earlier generations
        self._torch_loader: tud.DataLoader[Any] | None = None
        self._sampler: GroupSampler | None = None
        # True from a call into torch's iterator (or the group it returns) until the batches
        # reach the caller: still True at the next iteration means that call was interrupted
        # (Ctrl-C, an error) and its persistent workers' state is unknown (`_loader_from_here`)
        self._workers_busy = False
        self._slot_transfer = True  # False: every group takes torch's transfer (benchmarks)
        self._trace_path = trace
        self._trace = self._new_trace()
        frameworks.built()  # a framework integration watches the calls the user makes

    # ------------------------------------------------------------------ info
    @property
    def samples_consumed(self) -> int:
        """Global samples delivered so far (all ranks), i.e. the next step's first position."""
        return self._consumed

    @property
    def stream(self) -> Stream:
        return self._stream

    @property
    def global_batch_size(self) -> int:
        """Global batch of the current step (`step`): constant unless a `BatchSchedule` or
        a change at a resume (the state's ``history``) says otherwise."""
        return self._plan.batch_of(self.step)

    @property
    def step(self) -> int:
        """Index of the global step the next micro batch belongs to (from the run's history:
        right across schedule changes and resumes)."""
        return self._plan.step_of(self._consumed)

    @property
    def batch_schedule(self) -> BatchSchedule:
        """The global batch schedule in effect (the checked field ``global_batch_size``)."""
        return self._schedule

    @property
    def history(self) -> list[dict[str, Any]]:
        """The run's batch history as saved in the state (`detdata.loading.history`): one
        entry per schedule or layout, with the position and step it began at."""
        return self._plan.to_json()

    def position_of_step(self, step: int) -> int:
        """First global position of step ``step`` of this run (all ranks)."""
        return self._plan.start_of(check_count(step, "step", minimum=0))

    def step_of_position(self, position: int) -> int:
        """The step global position ``position`` belongs to in this run."""
        return self._plan.step_of(check_count(position, "position", minimum=0))

    def set_total_samples(self, total_samples: int | None) -> None:
        """Bound the run at ``total_samples`` (None: unbounded), a step boundary of this run at
        or after ``samples_consumed``: after a global-batch change at a resume the steps end
        elsewhere than a fresh run's, so a bound for the resumed run is set here."""
        if total_samples is not None:
            total_samples = check_count(total_samples, "total_samples", minimum=0)
            self._plan.check_step_end(total_samples)
            if total_samples < self._consumed:
                raise ConfigError(
                    f"total_samples {total_samples} is before samples_consumed {self._consumed}"
                )
        self.total_samples = total_samples
        self._torch_loader = None  # a persistent worker's sampler holds the old bound

    def tokens_consumed(self) -> dict[str, int]:
        """Tokens delivered to the callers of all ranks so far, per source name (a `Mixture`'s
        sources, or one entry for a single dataset): see `detdata.loading.tokens`."""
        from detdata.loading.tokens import tokens_consumed

        return tokens_consumed(self._stream, self._consumed)

    def __len__(self) -> int:
        """Micro batches of this rank per epoch of the run, in whole global steps: a constant,
        whatever was consumed.

        An epoch is the whole global steps of one pass over the dataset a plain
        `OrderedStream` orders (the steps that end within ``num_samples`` samples; one step
        when the dataset is smaller than a global batch), all of ``total_samples`` (a step
        end), or the steps within ``2**62`` samples for other streams (a `Mixture` has no
        epoch); counted in this rank's micro batches (``/ (micro_batch_size * world_size)``).
        So a trainer that takes an optimizer step every ``global_batch / (micro_batch *
        world_size)`` micro batches (gradient accumulation) and one at each epoch's end never
        takes a short step: its step N is detdata's step N. The samples past the last whole
        step of a pass are not lost: a new ``iter()`` never restarts the stream, it continues
        at ``samples_consumed`` (the order is a function of the global position), so a
        trainer that counts ``len(loader)`` batches per epoch (and, knowing the length, does
        not fetch ahead) sees each batch once, across epochs and resumes. A `BatchSchedule`
        changes the micro steps per step, never the samples per micro step; its epoch is the
        steps of the schedule from position 0 that end within the pass.
        """
        per = self._layout_now(self._consumed).samples_per_micro_step  # as iteration binds it
        if self.total_samples is not None:
            return self.total_samples // per
        dataset = getattr(self._stream, "dataset", None)
        if isinstance(self._stream, OrderedStream) and dataset is not None:
            return self._whole_steps(int(dataset.num_samples)) // per
        return self._whole_steps(MAX_POSITION) // per

    def check_trainer_batch(
        self,
        *,
        micro_batch_size: int,
        accumulation: int,
        world_size: int,
        trainer: str,
        fix: str,
    ) -> None:
        """A trainer's batch settings agree with this loader's global batch: it takes an
        optimizer step every ``accumulation`` micro batches of ``micro_batch_size`` samples on
        each of ``world_size`` processes, which must be this loader's micro batch, world size
        and global batch (of the step it is at). Otherwise a `ConfigError` naming both sides,
        with ``fix`` (formatted with ``micro`` and ``accumulation``: the values that agree) as
        the hint. Integrations call it before the first batch."""
        layout = self._layout_now(self._consumed)  # as iteration binds it
        gbs = self.global_batch_size
        micro, world = layout.micro_batch_size, layout.world_size
        same_layout = micro_batch_size == micro and world_size == world
        agree = same_layout and accumulation * world * micro_batch_size == gbs
        if agree and self._plan.single_constant:
            return
        if not self._plan.single_constant:
            raise ConfigError(
                f"{trainer} takes an optimizer step every {accumulation} micro batches, but this "
                "detdata.DataLoader has a global batch schedule (its micro steps per step "
                f"change; now {gbs // (micro * world)}); hint: a batch schedule needs a trainer "
                "that steps at detdata's step boundaries; use one global batch with this trainer"
            )
        raise ConfigError(
            f"{trainer}'s batch settings disagree with this detdata.DataLoader: it takes an "
            f"optimizer step every {accumulation} micro batch(es) of {micro_batch_size} samples "
            f"on each of {world_size} process(es) = {accumulation * world_size * micro_batch_size}"
            f" samples, but the loader's global batch is {gbs} samples (micro batch {micro} x "
            f"world size {world} x {gbs // (micro * world)} micro steps); its steps would not be "
            f"detdata's steps; hint: "
            + fix.format(micro=micro, accumulation=gbs // (micro * world))
        )

    def _whole_steps(self, samples: int) -> int:
        """Samples of the run's steps that end within ``samples`` (at least its first step)."""
        end = self._plan.start_of(self._plan.step_of(samples))
        return end if end > 0 else self._plan.start_of(1)

    # ------------------------------------------------ surface trainers probe
    @property
    def dataset(self) -> Any:
        """The dataset or stream this loader reads (what ``data`` was)."""
        return self._data

    @property
    def batch_size(self) -> int:
        """Samples per delivered batch: this rank's micro batch."""
        return self.layout.micro_batch_size

    @property
    def drop_last(self) -> bool:
        """Always True: every delivered batch is a full micro batch."""
        return True

    @property
    def sampler(self) -> EpochStart:
        """Not a torch sampler: positions come from detdata's layout (a trainer must not
        inject a DistributedSampler: the data is sharded by rank already). It carries only
        ``set_epoch``, which trainers call on ``loader.sampler``: see `set_epoch`."""
        return EpochStart(self)

    @property
    def batch_sampler(self) -> None:
        """None (see `sampler`)."""
        return None

    @property
    def collate_fn(self) -> Callable[[Batch], Any] | None:
        return self._collate_fn

    @property
    def pin_memory(self) -> bool:
        return self._pin_memory

    def set_epoch(self, epoch: int) -> None:
        """Never moves the position: the order is a function of the global position, not of
        an epoch counter, so a trainer's epoch numbers never change which samples come next.

        One check: a trainer starting epoch ``epoch > 0`` on a loader that has delivered
        nothing did not restore its state (Lightning resuming from an end-of-epoch
        checkpoint hands a loader its state only when the saved epoch was unfinished), and
        continuing would replay the run from its first sample: refused with a `StateError`.
        """
        epoch = check_count(epoch, "epoch", minimum=0)
        if epoch > 0 and self._consumed == 0:
            raise StateError(
                f"a trainer starts epoch {epoch}, but this loader has delivered nothing: its "
                "state was not restored, and it would replay the run from its first sample; "
                "hint: resume from a checkpoint written inside an epoch (Lightning: "
                "ModelCheckpoint(every_n_train_steps=...), or train by max_steps), or call "
                "loader.load_state_dict(saved_state) before training",
                fields=("samples_consumed",),
            )

    def _new_trace(self) -> TraceWriter | None:
        if self._trace_path is None:
            return None
        return TraceWriter(self._trace_path, self.layout.rank)  # each record gets its StepSpan

    def _step_span(self) -> StepSpan:
        """Where the next micro batch lies in the run's steps (a trace record's step fields)."""
        step = self._plan.step_of(self._consumed)
        return StepSpan(
            step=step,
            start=self._plan.start_of(step),
            size=self._plan.batch_of(step),
            next=self._consumed + self.layout.samples_per_micro_step,
        )

    # ------------------------------------------------------ rank and world
    def _layout_now(self, anchor: int) -> Layout:
        """The layout with rank / world size not given explicitly read from torch.distributed,
        its micro-step grid through position ``anchor``."""
        gbs, micro, rank, world = self._layout_args
        group_rank, group_world = process_group_rank_world()
        world = group_world if world is None else world
        return Layout.create(gbs, micro, world, group_rank if rank is None else rank, anchor=anchor)

    @staticmethod
    def _check_layout(layout: Layout, position: int, plan: Plan) -> None:
        """``layout`` can continue at ``position`` of ``plan``: a micro-step boundary of its
        step, and every global batch from there on divides into its micro steps."""
        layout.check_resume_position(position, plan.start_of(plan.step_of(position)))
        plan.check_fits(layout, position)

    def _bind_layout(self, *, check: bool = True) -> None:
        """Re-read rank and world size when an iteration starts (a loader built before the
        process group existed then reads its own rank's slice, not the whole global batch).

        With ``check``, the layout must fit every global batch from ``samples_consumed`` on
        (`ConfigError` naming the first batch and step that does not); a fresh run is
        checked here from position 0."""
        layout = self._layout_now(self._consumed)
        if check:
            self._check_layout(layout, self._consumed, self._plan)
        if layout == self.layout:
            return
        rank_changed = layout.rank != self.layout.rank
        self.layout = layout
        self._plan = self._plan.with_layout(self._consumed, layout)
        self._torch_loader = None  # persistent workers were started for the old layout
        if rank_changed and self._trace is not None:
            self._trace.close()
            self._trace = self._new_trace()

    def positions_of_next(self) -> IntArray:
        """Positions of the micro batch the next iteration will deliver on this rank."""
        return self.layout.positions(self._consumed // self.layout.samples_per_micro_step)

    def _stop(self) -> int | None:
        """``total_samples`` as `GroupSampler` counts it: micro step ``j`` of the layout begins at
        ``j * m * D + offset``, and the sampler stops before ``j * m * D`` reaches the bound."""
        return None if self.total_samples is None else self.total_samples - self.layout.offset

    # ------------------------------------------------------------- iteration
    def _build(self) -> tud.DataLoader[Any]:
        args = (self.layout, self._consumed, self._stop(), self.read_ahead)
        if self._slot_transfer and self._collate_fn is None:
            # groups come back through reused shared-memory slots (detdata.loading.slots)
            transport = SlotTransport(self.num_workers, self._prefetch_factor)
            self._sampler = SlotSampler(*args, transport)
        else:
            self._sampler = GroupSampler(*args)
        return tud.DataLoader(
            self._reader(in_worker=True),
            batch_size=None,
            sampler=self._sampler,
            collate_fn=_identity,
            worker_init_fn=functools.partial(
                _init_worker, self.seed, self.layout.rank, self._user_worker_init
            ),
            **self._torch_kwargs,
        )

    def _loader_from_here(self) -> tud.DataLoader[Any]:
        """torch's DataLoader for an iteration from ``samples_consumed``: the persistent one
        when its workers were left between two groups, else a new one (new workers): a call
        into torch's iterator that was interrupted (`_workers_busy`; Ctrl-C in its ``_reset``
        leaves ``_ResumeIteration`` replies queued, one in ``next`` a half-received group) leaves
        them in a state no later iteration can trust. The old loader's workers are shut down
        by torch when it is collected."""
        persistent = self._torch_kwargs["persistent_workers"]
        if self._torch_loader is None or not persistent or self._workers_busy:
            self._torch_loader = None  # before building: an interrupted build rebuilds again
            self._torch_loader = self._build()
            self._workers_busy = False
        else:
            assert self._sampler is not None  # built together with the loader
            self._sampler.start = self._consumed
        return self._torch_loader

    @property
    def _threaded(self) -> bool:
        return self.worker_mode is WorkerMode.THREAD and self.num_workers > 0

    @property
    def _process_workers(self) -> bool:
        return self.num_workers > 0 and not self._threaded

    def _reader(self, *, in_worker: bool) -> GroupReader:
        # worker processes: torch's pin-memory thread pins in the main process
        # (ReadAhead.pin_memory)
        pin = (
            not in_worker and self._pin_memory and torch.cuda.is_available() and self.device is None
        )
        return GroupReader(
            PositionDataset(self._stream, self._transform, self.seed),
            self._collate_fn,
            pin,
            in_worker,
        )

    def _groups(self) -> Iterator[list[IntArray]]:
        return iter(GroupSampler(self.layout, self._consumed, self._stop(), self.read_ahead))

    def _inline_batches(self) -> Iterator[Any]:
        """``num_workers=0``: the same reader as the workers', without torch's per-batch
        plumbing. The order is known ahead, so the next `PREFETCH_GROUPS` groups are
        hinted to the stream before a group's batches are delivered
        (`GroupReader.prefetch`): a dataset that takes the hint reads their files in the
        background meanwhile (the same bytes and checks; dropped when the loop ends)."""
        read = self._reader(in_worker=False)
        groups = self._groups()
        ahead: collections.deque[list[IntArray]] = collections.deque()
        try:
            while True:
                while len(ahead) <= PREFETCH_GROUPS and (group := next(groups, None)):
                    read.prefetch(group)
                    ahead.append(group)
                if not ahead:
                    return
                result = read(ahead.popleft())
                yield from result.deliver()
        finally:
            read.prefetch(None)

    def _thread_batches(self) -> Iterator[Any]:
        """Reads on ``num_workers`` threads of this process, in order (see `WorkerMode.THREAD`)."""
        from detdata.loading.threads import threaded_batches

        groups = threaded_batches(
            self._reader(in_worker=False),
            self._groups(),
            self.num_workers,
            self.num_workers * self._prefetch_factor,
        )
        try:
            for result in groups:
                yield from result.deliver()
        finally:
            # an error raised here must not leave the readers to the garbage collector
            groups.close()

    def _batches(self) -> Iterator[Any]:
        if self.num_workers == 0:
            return self._inline_batches()
        if self._threaded:
            return self._thread_batches()
        loader = self._loader_from_here()
        self._workers_busy = True
        groups = iter(loader)  # forks the workers, or torch's ``_reset`` of persistent ones
        return self._worker_batches(groups)

    def _worker_batches(self, groups: Iterator[ReadAhead | SlotGroup]) -> Iterator[Any]:
        """The batches of the groups torch's iterator returns. `_workers_busy` is False only
        while a batch is with the caller (the generator suspended at ``yield``: torch's iterator
        between two calls), so any interrupt or error inside torch or a group's hand-over leaves
        it True and the next iteration starts fresh workers (`_loader_from_here`)."""
        while True:
            self._workers_busy = True
            group = next(groups, None)
            if group is None:
                self._workers_busy = False
                return
            for batch in group.deliver():
                self._workers_busy = False
                yield batch
                self._workers_busy = True

    def __iter__(self) -> Iterator[Any]:
        """This rank's micro batches from ``samples_consumed`` on (see `_iterate`).

        Rank and world size not given explicitly are (re)read from torch.distributed here.
        """
        self._bind_layout()
        if self._consumed == 0:
            frameworks.check_start(self)  # a framework resuming a loader that starts over
        self._supersede("a second iter() on this loader started a new iterator")
        iterator = LoaderIterator(self, self._generation)
        self._live.add(iterator)
        return iterator

    def _supersede(self, why: str) -> None:
        """Start a new generation: the live iterators of earlier ones raise at their next batch
        (`StaleIteratorError` saying ``why``), never end quietly."""
        self._generation += 1
        self._superseded = why

    def _stale(self) -> StaleIteratorError:
        return StaleIteratorError(
            f"this detdata.DataLoader iterator is stale: {self._superseded} after it was "
            f"created (samples_consumed is now {self._consumed}); a stale iterator would "
            "deliver batches out of order, so it stops with this error rather than ending the "
            "loop quietly; hint: iterate the new iterator (a `for batch in loader:` started "
            "after the change), and call load_state_dict before the loop, not inside it"
        )

    def _iterate(self, generation: int) -> Generator[Any, None, None]:
        """This rank's micro batches from ``samples_consumed`` on.

        A batch is counted (and traced) only once it reaches the caller: any
        failure before that (read, transform, collate, device copy, trace, an
        interrupt) leaves ``samples_consumed`` at that batch. Leaving the loop
        early (``break``, an exception) closes the readers at once; after an
        abnormal end, or an interrupt anywhere inside torch's iterator (its
        creation and reset included, `_workers_busy`), persistent worker
        processes are replaced on the next iteration (torch's iterator may be
        mid-transfer).
        """
        if generation != self._generation:
            raise self._stale()
        batches: Iterator[Any] = iter(())
        iterator = batches
        lookahead = None
        clean = False
        try:  # from the start: torch's iter() itself can be interrupted (see `_workers_busy`)
            batches = iterator = self._batches()
            lookahead = self._lookahead()  # after _batches(): worker processes are forked by now
            if self.device is not None:
                from detdata.loading.device import device_batches

                iterator = device_batches(batches, self.device, self.device_prefetch)
            yield from self._deliver(iterator, generation, lookahead)
            clean = True
        except GeneratorExit:
            clean = True  # the caller stopped early (break): nothing is in flight in a broken state
            raise
        finally:
            if lookahead is not None:
                lookahead.close()
            for it in (iterator, batches):
                close = getattr(it, "close", None)
                if close is not None:
                    close()
            if not clean and generation == self._generation:
                self._torch_loader = None  # persistent workers may be mid-transfer: start fresh
                self._sampler = None  # and its shared-memory slots (detdata.loading.slots) go

    def _lookahead(self) -> Any:
        """A started `detdata.datasets.prefetch.Lookahead`, or None (off, or nothing cached)."""
        if not self.lookahead:
            return None
        per = self.layout.samples_per_micro_step
        stop = self._stop()  # micro step j begins at j * per + offset: stop before the bound
        plan = Lookahead(
            self._stream,
            self.layout.positions,
            steps=self.lookahead,
            connections=self.lookahead_connections,
            stop=None if stop is None else -(-stop // per),
        )
        return plan if plan.active else None

    def _deliver(
        self, iterator: Iterator[Any], generation: int, lookahead: Any = None
    ) -> Iterator[Any]:
        per = self.layout.samples_per_micro_step
        while True:
            if generation != self._generation:
                raise self._stale()
            if lookahead is not None:
                lookahead.advance(self._consumed // per)
            try:
                batch = next(iterator)
            except StopIteration:
                return
            except Exception as exc:
                if generation == self._generation:
                    exc.add_note(self._failure_note())
                    if self._died_in_hand_over(exc):
                        raise RuntimeError(
                            "a DataLoader worker process exited unexpectedly while handing over "
                            f"a batch (the transfer socket failed: {type(exc).__name__}: {exc}); "
                            f"{self._failure_note()}; hint: a worker killed mid hand-over (OOM "
                            "killer?); rerun with num_workers=0 to see any error in the main "
                            "process"
                        ) from exc
                    if isinstance(exc, (ConnectionError, EOFError)) and self._process_workers:
                        exc.add_note(
                            "hint: torch hands batches over from worker processes through "
                            "sockets; unless the dataset itself raised this, a worker "
                            "process probably died mid hand-over (OOM killer?); rerun "
                            "with num_workers=0 to see any error in the main process"
                        )
                raise
            if generation != self._generation:
                raise self._stale()  # the fetch itself loaded a state or started an iterator
            if self._transform is not None:
                self._check_schema(batch)
            if self._trace is not None:  # before counting: a failed trace write delivers nothing
                self._trace.add(
                    self._consumed, self.positions_of_next(), batch, span=self._step_span()
                )
            self._consumed += per
            yield batch

    def _check_schema(self, batch: Any) -> None:
        """Batches of a transformed stream keep the keys and dtypes of the first one delivered.

        A transform whose output keys or dtypes depend on the sample is refused within a
        micro batch by `apply_transform`; across micro batches (and worker processes) it
        is caught here, before the batch is counted.
        """
        found = _schema(batch)
        if self._schema is None:
            self._schema = found
            return
        if found != self._schema:
            positions = self.positions_of_next()
            raise ConfigError(
                f"transform output changed at the micro batch of positions "
                f"[{int(positions[0])}, {int(positions[-1])}]: {found} where earlier "
                f"batches had {self._schema}; hint: return the same keys with the "
                "same dtypes for every sample"
            )

    def _died_in_hand_over(self, exc: BaseException) -> bool:
        """A socket error from torch's transfer, not one a dataset raised in a worker (those
        travel as values and carry the worker's traceback note, see `reading.portable`)."""
        if not self._process_workers or not isinstance(exc, (ConnectionError, EOFError)):
            return False
        notes = getattr(exc, "__notes__", [])
        return not any("raised in DataLoader worker process" in n for n in notes)

    def _failure_note(self) -> str:
        """Where a failed fetch happened: rank, step and positions of the undelivered batch."""
        positions = self.positions_of_next()
        grouped = ""
        if self._process_workers and self.read_ahead > 1:
            grouped = (
                f"; worker processes read groups of {self.read_ahead} micro batches, so a "
                "worker that hung or died did so somewhere in the group starting here"
            )
        return (
            f"(detdata.DataLoader rank {self.layout.rank}/{self.layout.world_size}: failed while "
            f"fetching the micro batch at global positions [{int(positions[0])}, "
            f"{int(positions[-1])}] of step {self.step}; samples_consumed is still "
            f"{self._consumed}, so state_dict() resumes at this batch{grouped})"
        )

    # ----------------------------------------------------------------- state
    def _fields(self) -> dict[str, Any]:
        identity = self._stream.identity()
        stream_seed = None if self._wrapped else identity.get("seed")
        return identity_fields(
            identity,
            self.seed,
            self._schedule.to_json(),
            stream_seed=stream_seed,
            transform=self._transform_name,
        )

    def state_dict(self) -> dict[str, Any]:
        """JSON-serialisable state: samples delivered plus identity, layout and environment."""
        layout = {
            "world_size": self.layout.world_size,
            "micro_batch_size": self.layout.micro_batch_size,
            "num_workers": self.num_workers,
            "worker_mode": self.worker_mode.value,
        }
        state = LoaderState(
            samples_consumed=self._consumed,
            fields=self._fields(),
            stream=self._stream.identity(),
            layout=layout,
            env=environment(),
            history=tuple(self._plan.to_json()),
        )
        return state.to_json()

    def load_state_dict(
        self,
        state_dict: Mapping[str, Any] | str,
        *,
        allow: Iterable[str] = (),
        mid_step: str | MidStep | None = None,
        at_step: int | None = None,
    ) -> None:
        """Resume at the saved position in O(1).

        A state saved inside a global step (its ``step_position`` has ``delivered_in_step``
        > 0: a checkpoint between two micro batches of gradient accumulation) resumes by
        default at that step's first position: the whole step is delivered again, since the
        partial step's gradients are in no state dict (logged as a warning; ``mid_step="redo"``,
        `MidStep.REDO`). ``mid_step="continue"`` resumes right after the delivered part, for a
        caller that saved and restores the partial gradients too (``mid_step_on_resume=`` sets
        the default, for callers such as ``torch.distributed.checkpoint`` that call
        ``load_state_dict(state)`` themselves). ``at_step`` (an integration's trainer step):
        resume at the first position of that optimizer step, the saved step or, for a state
        saved at the end of a step the trainer had not stepped yet, the one before
        (`LoaderState.resumed`). Live iterators are stale afterwards: the next
        batch asked of them raises `StaleIteratorError`.

        Differences in checked fields (manifests, data, seed, algorithm,
        mixture, global batch) are refused with a `StateError` listing each,
        unless named in ``allow`` (or ``allow_on_resume``). An allowed mixture
        change continues each source from its consumed count (`Mixture.continue_from`).
        Layout may differ if the position is a micro-step boundary of this layout within
        its step (counted from the step's first position).

        An allowed ``global_batch_size`` change (another int or `BatchSchedule`) is appended
        to the state's ``history``: the new schedule is in effect from the start of the
        saved step (a step boundary; inside a step, the new batch completes the step being
        accumulated), so every earlier step keeps its positions and ``step`` stays right;
        this loader's micro steps start at the saved position.
        """
        how = self._mid_step if mid_step is None else parse_mid_step(mid_step)
        self._bind_layout(check=False)  # `_resumed_plan` checks from the saved position
        saved = LoaderState.from_json(state_dict)
        allowed = self._allow | check_allow(allow)
        current = self._fields()
        diffs = saved.differences(current)
        refused = [d for d in diffs if d not in allowed]
        if refused:
            raise StateError(
                mismatch_message(refused, saved.fields, current), fields=tuple(refused)
            )
        if at_step is not None:
            at_step = check_count(at_step, "at_step", minimum=0)
        # a state saved inside a step: by default, the step's start
        saved = saved.resumed(how, at_step)
        if self.total_samples is not None and saved.samples_consumed > self.total_samples:
            raise StateError(
                f"saved samples_consumed {saved.samples_consumed} is beyond this loader's "
                f"total_samples {self.total_samples}"
            )
        plan, layout = self._resumed_plan(saved, K_GLOBAL_BATCH in diffs)
        for name in diffs:  # each allowed change joins the history, and is logged
            plan = plan.with_change(
                name, saved.samples_consumed, saved.fields.get(name), current.get(name)
            )
            _LOG.warning(
                "detdata: resume at samples_consumed=%d: %s (allowed by name)",
                saved.samples_consumed,
                plan.changes[-1].describe(),
            )
        if K_EXCLUSIONS in diffs:
            self._check_exclusions(saved)
        if K_MIXTURE in diffs and saved.fields.get(K_MIXTURE) is not None:
            self._stream = self._continue_mixture(saved, diffs)
        self._plan, self.layout = plan, layout
        self._saved_plan = Plan(saved.plan.entries, plan.changes)
        self._consumed = saved.samples_consumed
        if self._trace is not None:
            self._trace.restore(self._consumed)
        self._supersede("load_state_dict() moved the loader")
        self._torch_loader = None

    def _resumed_plan(self, saved: LoaderState, changed: bool) -> tuple[Plan, Layout]:
        """The saved run's history continued by this loader's schedule (when ``changed``) and
        layout (its micro steps from the saved position); nothing is modified."""
        position = saved.samples_consumed
        layout = self._layout_now(position)
        plan = saved.plan
        if changed:
            plan = plan.with_schedule(position, self._schedule, layout)
        try:
            self._check_layout(layout, position, plan)
        except ConfigError as exc:
            raise StateError(f"cannot resume: {exc}") from None
        if self.total_samples is not None:
            try:
                plan.check_step_end(self.total_samples)
            except ConfigError as exc:
                raise StateError(
                    f"cannot resume: {exc} (in the resumed run's steps); hint: build the "
                    "loader with total_samples=None and call set_total_samples() after "
                    "load_state_dict",
                    fields=(K_GLOBAL_BATCH,),
                ) from None
        return plan.with_layout(position, layout), layout

    def _check_exclusions(self, saved: LoaderState) -> None:
        """An allowed ``exclusions`` change may only append lists in force from the saved
        position on (`Excluded.check_continues`); anything else is a `StateError`."""
        check = getattr(self._stream, "check_continues", None)
        if check is None:
            raise StateError(
                "the saved state excludes samples but this loader's stream is not an "
                "Excluded stream: the excluded samples would be delivered again; hint: wrap "
                "the data in detdata.Excluded with the saved lists (and append new ones)",
                fields=(K_EXCLUSIONS,),
            )
        check(dict(saved.stream), saved.samples_consumed)

    def _continue_mixture(self, saved: LoaderState, diffs: list[str]) -> Stream:
        cont = getattr(self._stream, "continue_from", None)
        if cont is None:
            raise StateError(
                "the saved state has a mixture but this loader's data is not a Mixture",
                fields=(K_MIXTURE,),
            )
        if K_SEED in diffs:
            raise StateError(
                "cannot change the mixture and the seed in the same resume", fields=(K_SEED,)
            )
        try:
            stream: Stream = cont(dict(saved.stream), saved.samples_consumed)
        except ConfigError as exc:
            raise StateError(
                f"allowed mixture change cannot be applied: {exc}", fields=(K_MIXTURE,)
            ) from None
        return stream

    def provenance(
        self,
        step: int,
        *,
        decode: Callable[[Mapping[str, Any]], Any] | None = None,
        as_saved: bool = False,
    ) -> Any:
        """Every sample of global ``step`` (all ranks): a list of
        `detdata.loading.provenance.SampleRecord` (position, rank, micro step, source, sample id,
        shard path and row/token/byte range, blake3 of the sample as the stream delivers it).
        Reads that step's samples once; never moves ``samples_consumed``.

        Each position is answered with the configuration in force when it was delivered: the
        stream of the seed, data and order of that time (`stream_at`: a `StateError` when this
        loader cannot rebuild it), the layout of the run's history. ``as_saved``: positions
        after the loaded state's are placed with the layout that state was saved with, not
        this process's (a diagnostic tool, whose own process is not one of the run's ranks).
        A step past ``total_samples`` is never delivered: `ConfigError` naming the last."""
        from detdata.loading import provenance as prov

        step = check_count(step, "step", minimum=0)
        self._check_delivered(step)
        start, end = self.position_of_step(step), self.position_of_step(step + 1)
        plan = self._saved_plan if as_saved and self._saved_plan is not None else self._plan
        layouts = [  # the layout each position was delivered with (history)
            (e.position, e.micro_batch_size, e.world_size)
            for e in plan.entries
            if e.micro_batch_size is not None and e.world_size is not None
        ]
        records: list[Any] = []
        for lo, hi in self._segments(start, end):
            records += prov.provenance(
                self.stream_at(lo),
                np.arange(lo, hi),
                step=step,
                micro_batch_size=self.layout.micro_batch_size,
                world_size=self.layout.world_size,
                decode=decode,
                layouts=layouts,
                first=start,
            )
        return records

    def positions_seen(self, source: str | None, sample_id: int, *, until: int) -> IntArray:
        """Every global position ``< until`` at which this run delivered (or, past its
        position, delivers) sample ``sample_id`` of ``source``, each range of positions
        inverted with the stream in force there (`stream_at`); ``until`` past
        ``total_samples`` is a `ConfigError`."""
        from detdata.loading.provenance import positions_seen

        until = check_count(until, "until", minimum=0, maximum=MAX_POSITION)
        if self.total_samples is not None and until > self.total_samples:
            raise ConfigError(
                f"until={until} is past the last position this run delivers: total_samples is "
                f"{self.total_samples} (last step {self._last_step()}); hint: until <= "
                f"{self.total_samples}"
            )
        parts = [np.zeros(0, dtype=np.int64)]
        for lo, hi in self._segments(0, until):
            found = positions_seen(self.stream_at(lo), source, sample_id, until=hi)
            parts.append(found[found >= lo])
        return np.concatenate(parts).astype(np.int64)

    def _segments(self, start: int, end: int) -> list[tuple[int, int]]:
        """``[start, end)`` cut at the positions where a change of the stream took effect."""
        cuts = sorted({c.position for c in self._plan.changes_after(start, _STREAM_FIELDS)} - {end})
        bounds = [start, *(c for c in cuts if c < end), end]
        return [(a, b) for a, b in itertools.pairwise(bounds) if a < b]

    def stream_at(self, position: int) -> Stream:
        """The stream that delivered (or delivers) ``position``: this loader's, or, before a
        change of ``seed``, ``stream_seed``, ``manifests``, ``data`` or ``algorithm`` allowed
        at a resume (the state's history), the stream of that time when this loader can
        rebuild it (another seed over the same dataset and order, checked against the
        fields in force then); otherwise a `StateError` naming the change."""
        later = self._plan.changes_after(position, _STREAM_FIELDS)
        if not later:
            return self._stream
        then = dict(self._fields())
        for change in reversed(self._plan.changes):
            if change.position > position:
                then[change.field] = change.old
        for candidate in self._earlier_streams(then):
            if self._delivers_as(candidate, then):
                return candidate
        raise StateError(
            f"position {position} (step {self.step_of_position(position)}) was delivered before "
            + "; ".join(c.describe() for c in later)
            + ", and this loader cannot rebuild the stream of that time; hint: answer it with "
            "the data definition of that time and the state saved before the change",
            fields=tuple(dict.fromkeys(c.field for c in later)),
        )

    def _delivers_as(self, stream: Stream, then: Mapping[str, Any]) -> bool:
        """``stream`` has the fields in force ``then`` and orders with the seed of that time
        (its identity's own seed: ``stream_seed``, or ``seed`` when the loader ordered it)."""
        fields = self._fields_of(stream, then)
        if not all(_same(fields[k], then[k]) for k in _STREAM_FIELDS):
            return False
        own = stream.identity().get("seed")
        expected = then[K_SEED] if then[K_STREAM_SEED] is None else then[K_STREAM_SEED]
        return own is None or _same(own, expected)

    def _earlier_streams(self, then: Mapping[str, Any]) -> Iterator[Stream]:
        """This loader's stream (a change of the loader's own seed leaves a stream the caller
        built as it was), then the streams it can build with the seeds in force ``then``
        (same data, same order)."""
        yield self._stream
        seed = then[K_SEED]
        if self._stream is not self._data and isinstance(seed, int):  # the loader ordered it
            yield as_stream(self._data, seed, order=self._order)
        own = then[K_STREAM_SEED]
        if isinstance(self._stream, OrderedStream) and isinstance(own, int):
            yield OrderedStream(self._stream.dataset, own, order=self._stream.order_choice)

    def _fields_of(self, stream: Stream, then: Mapping[str, Any]) -> dict[str, Any]:
        identity = stream.identity()
        wrapped = self._stream is not self._data
        return identity_fields(
            identity,
            then[K_SEED],
            self._schedule.to_json(),
            stream_seed=None if wrapped else identity.get("seed"),
            transform=self._transform_name,
        )

    def _last_step(self) -> str:
        total = self.total_samples
        if not total:
            return "none: it delivers nothing"
        return str(self._plan.step_of(total - 1))

    def _check_delivered(self, step: int) -> None:
        """``step`` ends at or before ``total_samples`` and the last addressable position
        ``2**62`` (`ConfigError` naming the last step delivered)."""
        end = self._plan.start_of(step + 1)
        if end > MAX_POSITION:
            raise ConfigError(
                f"step {step} is never delivered: it ends at position {end}, past the last "
                f"addressable position 2**62 - 1 (last step "
                f"{self._plan.step_of(MAX_POSITION - 1)}); hint: ask for a step the run delivers"
            )
        if self.total_samples is None:
            return
        if end > self.total_samples:
            raise ConfigError(
                f"step {step} is never delivered: this run stops at total_samples "
                f"{self.total_samples} (last delivered step {self._last_step()}); hint: ask "
                "for a step the run delivers"
            )

    def close(self) -> None:
        """End every live iterator (their reader threads and worker processes stop now),
        drop persistent workers and close the trace file. The loader can be iterated again."""
        self._supersede("close() ended the loader's iterators")
        for iterator in list(self._live):  # ended on purpose: they stop, they do not raise
            iterator.close()
        self._live.clear()
        self._torch_loader = None
        self._sampler = None  # its shared-memory slots are unmapped with it
        self._workers_busy = False
        if self._trace is not None:
            self._trace.close()


#: The loader's keyword arguments (the "did you mean" candidates of `refuse_torch_habits`).
_KEYWORDS: Final = tuple(
    name
    for name, p in inspect.signature(DataLoader.__init__).parameters.items()
    if p.kind is inspect.Parameter.KEYWORD_ONLY
)
