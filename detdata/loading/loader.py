"""`detdata.DataLoader`: a drop-in for torch's DataLoader with one-integer resume.

The loader is assembled from concept-sized parts (`detdata.loading.loader_base`): its
construction and the surface trainers probe live here; iteration and the worker lifecycle in
`detdata.loading.iteration`; the state and resume in `detdata.loading.resume`; provenance
queries over the run's history in `detdata.loading.lookup`; the options beyond torch's
keywords in `detdata.loading.options`. The loader counts samples *delivered* to the caller;
its state is that count plus identity fields (`LoaderState`).
"""

from __future__ import annotations

import inspect
import weakref
from collections.abc import Callable
from typing import Any, Final

from detdata.base.checks import check_count, check_seed
from detdata.base.errors import ConfigError, StateError
from detdata.base.types import MAX_POSITION, Batch
from detdata.datasets.base import Dataset, Stream
from detdata.datasets.capabilities import OrdersDataset
from detdata.datasets.streams import OrderedStream, as_stream
from detdata.loading import frameworks
from detdata.loading.arguments import check_thread_mode, check_torch_args, refuse_torch_habits
from detdata.loading.history import Plan, as_schedule
from detdata.loading.iteration import PREFETCH_GROUPS, Iteration, LoaderIterator, seed_globals
from detdata.loading.lookup import Lookup
from detdata.loading.options import LEGACY_KEYWORDS, LoaderOptions, split_legacy, with_legacy
from detdata.loading.resume import Resume
from detdata.loading.state import transform_identity
from detdata.order.batches import BatchSchedule
from detdata.order.choice import OrderLike

__all__ = ["DEFAULT_LOOKAHEAD", "PREFETCH_GROUPS", "DataLoader", "EpochStart", "seed_globals"]

#: ``ReadOptions.lookahead``'s default: micro steps whose shards are filled into a shard cache
#: ahead of the consumer (the window is cut where it would not fit the cache's bound).
DEFAULT_LOOKAHEAD: Final = 1024


class EpochStart:
    """``DataLoader.sampler``: not a torch sampler, only the ``set_epoch`` hook trainers call
    on ``loader.sampler`` at every epoch start (Lightning does); forwards to the loader."""

    def __init__(self, loader: DataLoader) -> None:
        self._loader = loader

    def set_epoch(self, epoch: int) -> None:
        self._loader.set_epoch(epoch)


class DataLoader(Iteration, Resume, Lookup):
    """Deterministic, resumable loader over a `Dataset` or `Stream` (e.g. `Mixture`).

    ``DataLoader(data, global_batch_size=..., micro_batch_size=..., seed=..., order=...,
    options=LoaderOptions(...), <torch's keywords>)``. Each iteration yields this rank's next
    micro batch (``micro_batch_size`` samples, positions in order) as a dict of tensors.
    Global positions are assigned as in docs/design.md section 4, so the samples of a step
    never depend on ``world_size``, ``micro_batch_size`` or ``num_workers``. Iteration is
    infinite (epochs continue) unless ``total_samples`` is given.

    Arguments (every one after ``data`` is a keyword; torch's ``batch_size=``, ``shuffle=``,
    ``sampler=`` or a positional batch size get a `ConfigError` naming detdata's own):

    * ``data``: a `Dataset` (the loader orders it with ``seed`` and ``order``) or a `Stream`
      (a `Mixture`, an `OrderedStream`, an `Excluded`: it has its own order).
    * ``global_batch_size``: samples per optimizer step over all ranks, an int or a
      `BatchSchedule` (a Megatron-style ramp-up, explicit ``(step, global_batch)`` or
      ``(samples, global_batch)`` changes): positions stay sample-counted, the micro batch
      stays fixed and the micro steps per step follow the schedule (``global_batch_size(step)
      / (micro_batch_size * world_size)``, which must divide for every step; a schedule needs
      ``micro_batch_size``). It is the checked field ``global_batch_size``; a change allowed by
      name at a resume is recorded in the state's ``history`` and takes effect at the saved
      step (`load_state_dict`).
    * ``micro_batch_size``: this rank's batch per iteration (torch's ``batch_size``); default
      one micro step per step.
    * ``seed``: the order of a dataset the loader orders, and every sample's transform
      generator.
    * ``order`` (for a dataset the loader orders itself; a stream has its own): the default
      `Order.FEISTEL_V1`, or ``LocalityOrder(window_shards=k)`` to read shards in windows of
      ``k`` (large or remote corpora: `detdata.order.locality`). Its name with its
      parameters is the checked field ``algorithm``.
    * ``options``: a `LoaderOptions`, everything detdata adds beyond torch's keywords:
      ``rank``, ``world_size`` (None: torch.distributed's), ``total_samples``, ``transform``,
      ``transform_id``, ``trace``, ``read`` (a `ReadOptions`: ``worker_mode``,
      ``read_ahead``, ``lookahead``, ``lookahead_connections``), ``device`` (a `DeviceFeed`:
      ``device``, ``prefetch``) and ``resume`` (a `ResumePolicy`: ``allow``, ``mid_step``,
      ``fresh_each_run``).
      Each is described below and on its class.
    * torch's keywords, as torch: ``num_workers``, ``pin_memory``, ``collate_fn``,
      ``prefetch_factor`` (groups per worker), ``persistent_workers``, ``timeout`` (per group),
      ``worker_init_fn``, ``multiprocessing_context``.
    * ``torch_positional`` (``*``) and ``torch_keywords`` (``**``): catch torch habits
      (``DataLoader(ds, 8)``, ``batch_size=8``, ``shuffle=True``) with a `ConfigError` naming
      detdata's argument, and a misspelt keyword with "did you mean"; ``torch_keywords``
      also takes the keywords of earlier versions (below).

    The keywords of earlier versions (``rank=``, ``world_size=``, ``total_samples=``,
    ``transform=``, ``transform_id=``, ``trace=``, ``worker_mode=``, ``read_ahead=``,
    ``lookahead=``, ``lookahead_connections=``, ``device=``, ``device_prefetch=``,
    ``allow_on_resume=``, ``mid_step_on_resume=``) still work, with a `DeprecationWarning`
    naming the new spelling (`detdata.loading.options.LEGACY_KEYWORDS`) and the same bytes;
    one given together with its field in ``options`` is a `ConfigError`.

    With ``DeviceFeed(device=...)`` set (e.g. ``"cuda"``), batches arrive on that device
    through reused pinned buffers and a side stream, ``DeviceFeed.prefetch`` batches ahead;
    those are not counted until yielded. ``pin_memory`` is then ignored: the device path
    pins into its own reused buffers.

    ``ReadOptions.read_ahead`` (default 16): this many consecutive micro batches of the rank
    are read with one batched read and then split, which amortises the fixed per-read cost
    and, with worker processes, the fixed per-transfer cost (with the default collate a
    worker writes a group of numeric columns into a reused shared-memory slot and hands over
    only its index, `detdata.loading.slots`; other groups cross as one tensor per column).
    Bytes and order never depend on it. A group that fails to read is re-read batch by
    batch, so the error surfaces exactly at the unreadable batch and every batch before it
    is delivered. A worker process that hangs or dies takes its whole group with it (the
    state still counts only delivered batches). With workers, ``prefetch_factor`` counts
    groups per worker and ``timeout`` applies to each group. Memory in flight is about
    ``read_ahead`` x micro-batch bytes x (``num_workers`` x ``prefetch_factor`` + 1): lower
    ``read_ahead`` for large samples (images, long documents in big micro batches). With
    ``num_workers=0`` the next `PREFETCH_GROUPS` groups are hinted to the stream while a
    group is delivered: a `TokenWindows` over local shards reads their files in the
    background (native threads, no GIL) while the caller trains, so memory in flight is up
    to 3 groups there (the same bytes and checks; see `TokenWindows.prefetch`).
    ``ReadOptions.worker_mode="thread"`` runs the ``num_workers`` readers on threads of this
    process (`WorkerMode`).

    ``persistent_workers=True`` keeps the worker processes from one iteration to the next
    when the last one left them between two groups (``break``, the end of the data, a batch
    with the caller). After an interrupt (Ctrl-C) or an error inside torch's iterator, its
    reset of the kept workers at ``iter()`` included, the next iteration starts fresh
    workers and continues exactly at ``samples_consumed``: a half-reset torch iterator is
    never reused (it would raise torch's ``KeyError: _ResumeIteration`` or wait forever).
    Worker processes ignore SIGINT: a terminal's Ctrl-C interrupts the main process only.

    ``ReadOptions.lookahead`` (default None: `DEFAULT_LOOKAHEAD` micro steps where some
    shards are read through a shard cache, e.g. `TokenWindows`' default cache of a remote
    root; 0: off): with remote shards read through a shard cache (``cache_dir``), the shards
    of the next ``lookahead`` micro steps of this rank are filled into the cache in the
    background, in order of first use, on ``ReadOptions.lookahead_connections`` threads,
    released after their last use, the window kept under the cache's byte bound
    (`detdata.datasets.prefetch`). Make it larger than ``num_workers x prefetch_factor x
    read_ahead``. It never changes a delivered byte.

    ``LoaderOptions.trace``: a JSON-lines file with one record per delivered micro batch.
    ``ResumePolicy.allow`` and ``ResumePolicy.mid_step``: the defaults of
    `load_state_dict`'s ``allow`` (added to) and ``mid_step``. ``ResumePolicy.fresh_each_run``:
    this loader starts over in every run by design (evaluation); framework watches do not take
    it for a training loader a checkpoint left out (`detdata.integrations.accelerate`).

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
        order: OrderLike | None = None,
        options: LoaderOptions | None = None,
        num_workers: int = 0,
        pin_memory: bool = False,
        collate_fn: Callable[[Batch], Any] | None = None,
        prefetch_factor: int | None = None,
        persistent_workers: bool = False,
        timeout: float = 0,
        worker_init_fn: Callable[[int], None] | None = None,
        multiprocessing_context: str | None = None,
        **torch_keywords: object,
    ) -> None:
        legacy, unknown = split_legacy(torch_keywords)
        refuse_torch_habits(torch_positional, unknown, _KEYWORDS)
        opts = with_legacy(options, legacy)
        if global_batch_size is None:
            raise ConfigError(
                "DataLoader needs global_batch_size= (samples per optimizer step over all "
                "ranks); hint: micro_batch_size= is each rank's batch per iteration (torch's "
                "batch_size), e.g. DataLoader(data, global_batch_size=512, micro_batch_size=8)"
            )
        self.options = opts
        self.seed = check_seed(seed)
        check_torch_args(
            num_workers=num_workers,
            prefetch_factor=prefetch_factor,
            persistent_workers=persistent_workers,
            timeout=timeout,
            multiprocessing_context=multiprocessing_context,
            callables={"collate_fn": collate_fn, "worker_init_fn": worker_init_fn},
        )
        check_thread_mode(
            opts.read.mode,
            num_workers,
            persistent_workers=persistent_workers,
            timeout=timeout,
            multiprocessing_context=multiprocessing_context,
            worker_init_fn=worker_init_fn,
        )
        self._init_plan(global_batch_size, micro_batch_size, opts)
        self.num_workers = check_count(num_workers, "num_workers", minimum=0, maximum=1024)
        self._init_data(data, order, opts, collate_fn)
        self._init_workers(
            pin_memory=pin_memory,
            timeout=timeout,
            persistent_workers=persistent_workers,
            multiprocessing_context=multiprocessing_context,
            prefetch_factor=prefetch_factor,
            worker_init_fn=worker_init_fn,
        )
        self._init_reads(opts)
        self._init_iteration(opts)
        frameworks.built()  # a framework integration watches the calls the user makes

    def _init_plan(
        self,
        global_batch_size: int | BatchSchedule,
        micro_batch_size: int | None,
        opts: LoaderOptions,
    ) -> None:
        """The batch schedule, the layout of position 0 and the run's plan (``total_samples``
        must be a step end of it)."""
        self._schedule = as_schedule(global_batch_size)
        constant = self._schedule.changes[0][1] if self._schedule.is_constant else None
        self._layout_args = (constant, micro_batch_size, opts.rank, opts.world_size)
        self.layout = self._layout_now(0)
        self._plan = Plan.fresh(self._schedule, self.layout)
        # the batches before the settled one are checked from the start position (0, or the
        # saved one) when iteration starts or a state is loaded: a resume past a ramp-up
        # may use a layout the ramp's batches do not fit
        self._plan.check_settles(self.layout)
        if opts.total_samples is not None:
            self._plan.check_step_end(opts.total_samples)
        self.total_samples = opts.total_samples
        self._saved_plan = None

    def _init_data(
        self,
        data: Dataset | Stream,
        order: OrderLike | None,
        opts: LoaderOptions,
        collate_fn: Callable[[Batch], Any] | None,
    ) -> None:
        """The stream read (``data`` ordered by the loader unless it is a stream) and what user
        code does to its samples (the checked ``transform`` field)."""
        self._data = data
        self._stream = as_stream(data, self.seed, order=order)
        self._order = order
        # the loader ordered a plain dataset with its seed, or an `Excluded` did with that same
        # seed (adding exclusions at a resume of a loader-ordered run keeps ``stream_seed``)
        stream = self._stream
        self._wrapped = stream is not data or (
            isinstance(stream, OrdersDataset)
            and stream.orders_dataset is True
            and stream.seed == self.seed
        )
        self._transform = opts.transform
        self._collate_fn = collate_fn
        self._transform_name = transform_identity(opts.transform_id, opts.transform, collate_fn)

    def _init_workers(
        self,
        *,
        pin_memory: bool,
        timeout: float,
        persistent_workers: bool,
        multiprocessing_context: str | None,
        prefetch_factor: int | None,
        worker_init_fn: Callable[[int], None] | None,
    ) -> None:
        """torch's keywords, as its DataLoader of worker processes takes them."""
        workers = self.num_workers > 0
        self._torch_kwargs = {
            "num_workers": self.num_workers,
            "pin_memory": pin_memory,
            "timeout": timeout,
            "persistent_workers": persistent_workers and workers,
            "multiprocessing_context": multiprocessing_context if workers else None,
        }
        self._user_worker_init = worker_init_fn
        if workers and prefetch_factor is not None:
            self._torch_kwargs["prefetch_factor"] = prefetch_factor
        self._pin_memory = bool(pin_memory)
        self._prefetch_factor = (
            2 if prefetch_factor is None else check_count(prefetch_factor, "prefetch_factor")
        )

    def _init_reads(self, opts: LoaderOptions) -> None:
        """`ReadOptions`, `DeviceFeed` and `ResumePolicy` as the loader's attributes."""
        self._allow = opts.resume.allowed
        self._mid_step = opts.resume.mid_step_mode
        self.worker_mode = opts.read.mode
        self.read_ahead = opts.read.read_ahead
        lookahead = opts.read.lookahead
        self.lookahead = DEFAULT_LOOKAHEAD if lookahead is None else lookahead
        self.lookahead_connections = opts.read.lookahead_connections
        self.device = opts.device.target
        self.device_prefetch = opts.device.prefetch
        if self.device is not None:
            # the device path stages into its own reused pinned buffers; torch pinning would copy
            # twice
            self._torch_kwargs["pin_memory"] = False

    def _init_iteration(self, opts: LoaderOptions) -> None:
        """Nothing delivered yet, no iterator, no workers; the trace file opened."""
        self._live = weakref.WeakSet()
        self._consumed = 0
        self._schema = None
        self._generation = 0
        self._superseded = ""
        self._torch_loader = None
        self._sampler = None
        # True from a call into torch's iterator (or the group it returns) until the batches
        # reach the caller: still True at the next iteration means that call was interrupted
        # (Ctrl-C, an error) and its persistent workers' state is unknown (`_loader_from_here`)
        self._workers_busy = False
        self._slot_transfer = True
        self._trace_path = opts.trace
        self._trace = self._new_trace()

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
    def batch_schedule(self) -> BatchSchedule:
        """The global batch schedule in effect (the checked field ``global_batch_size``)."""
        return self._schedule

    @property
    def history(self) -> list[dict[str, Any]]:
        """The run's batch history as saved in the state (`detdata.loading.history`): one
        entry per schedule or layout, with the position and step it began at."""
        return self._plan.to_json()

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
        if isinstance(self._stream, OrderedStream):
            return self._whole_steps(int(self._stream.dataset.num_samples)) // per
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

    def __iter__(self) -> LoaderIterator:
        """This rank's micro batches from ``samples_consumed`` on (see `Iteration._iterate`).

        Rank and world size not given explicitly are (re)read from torch.distributed here.
        """
        self._bind_layout()
        if self._consumed == 0:
            frameworks.check_start(self)  # a framework resuming a loader that starts over
        self._supersede("a second iter() on this loader started a new iterator")
        iterator = LoaderIterator(self, self._generation)
        self._live.add(iterator)
        return iterator


#: The loader's keyword arguments and the old ones it still maps (the "did you mean"
#: candidates of `refuse_torch_habits`).
_KEYWORDS: Final = (
    *(
        name
        for name, p in inspect.signature(DataLoader.__init__).parameters.items()
        if p.kind is inspect.Parameter.KEYWORD_ONLY
    ),
    *LEGACY_KEYWORDS,
)
