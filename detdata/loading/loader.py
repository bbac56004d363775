"""`detdata.DataLoader`: a drop-in for torch's DataLoader with one-integer resume.

The loader delegates to its parts: a `Cursor` (position, plan, layout, state), a `Lookup`
(provenance), a `BatchSource`, the `DeviceFeed` and a `RankTrace`; each ``iter()`` is a
`LoaderIterator` over them.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Iterable, Mapping
from fractions import Fraction
from typing import Any, Final

from detdata.base.checks import check_count, check_seed
from detdata.base.errors import ConfigError, StateError
from detdata.base.types import MAX_POSITION, Batch, IntArray
from detdata.datasets.base import Dataset, Stream
from detdata.datasets.streams import OrderedStream
from detdata.loading import frameworks
from detdata.loading.arguments import (
    TorchOnly,
    check_torch_args,
    refuse_torch_habits,
)
from detdata.loading.attest import Attestor
from detdata.loading.cursor import Cursor, Definition
from detdata.loading.history import Plan, as_schedule
from detdata.loading.iteration import Delivery, LoaderIterator, SchemaCheck
from detdata.loading.layout import Layout, Placement
from detdata.loading.lookup import Lookup
from detdata.loading.options import DEFAULT_STEPS_AHEAD, LoaderOptions
from detdata.loading.reading import Reads
from detdata.loading.reweighting import MixtureController, reweightable
from detdata.loading.sources import batch_source
from detdata.loading.state import transform_identity
from detdata.loading.steps import MidStep, RunSteps
from detdata.loading.trace import RankTrace
from detdata.order.batches import BatchSchedule
from detdata.order.choice import OrderLike

__all__ = ["DEFAULT_STEPS_AHEAD", "DataLoader", "EpochStart"]

_UNSET: Final = TorchOnly.UNSET


class EpochStart:
    """``DataLoader.sampler``: not a torch sampler, only the ``set_epoch`` hook trainers call
    on ``loader.sampler`` at every epoch start (Lightning does); forwards to the loader."""

    def __init__(self, loader: DataLoader) -> None:
        self._loader = loader

    def set_epoch(self, epoch: int) -> None:
        self._loader.set_epoch(epoch)


class DataLoader(RunSteps):
    """Deterministic, resumable loader over a `Dataset` or `Stream` (e.g. `Mixture`).

    Each iteration yields this rank's next micro batch (``micro_batch_size`` samples,
    positions in order) as a dict of tensors; global positions follow docs/design.md section
    4, so a step's samples never depend on ``world_size``, ``micro_batch_size`` or
    ``num_workers``. Iteration is infinite unless ``total_samples`` is given. Every argument
    after ``data`` is a keyword:

    * ``data``: a `Dataset` (ordered with ``seed`` and ``order``) or a `Stream` (a `Mixture`,
      `OrderedStream`, `Excluded`: it has its own order).
    * ``global_batch_size``: samples per optimizer step over all ranks, an int or a
      `BatchSchedule` (ramp-up or explicit changes; needs ``micro_batch_size``, and
      ``micro_batch_size * world_size`` must divide every step's batch). A checked field;
      a change allowed at a resume joins the state's ``history`` (`load_state_dict`).
    * ``micro_batch_size``: this rank's batch per iteration (torch's ``batch_size``);
      default one micro step per step.
    * ``seed``: the order of a dataset, and every sample's transform generator.
    * ``order``: for a dataset, `Order.FEISTEL_V1` (default) or
      ``LocalityOrder(window_shards=k)`` (`detdata.order.locality`); the checked field
      ``algorithm``.
    * ``options``: a `LoaderOptions` (``rank``, ``world_size``, ``total_samples``,
      ``transform``, ``transform_id``, ``trace``, ``read``: a `ReadOptions` with
      ``worker_mode``, ``batches_ahead``, ``steps_ahead``, ``steps_ahead_connections``;
      ``device``: a `DeviceFeed` with ``device``, ``copies_ahead``; ``resume``: a
      `ResumePolicy` with ``allow``, ``mid_step``, ``fresh_each_run``, ``attest``), each
      described on its class (`detdata.loading.options`).
    * torch's keywords, as torch: ``num_workers``, ``pin_memory``, ``collate_fn``,
      ``prefetch_factor`` (groups per worker), ``persistent_workers``, ``timeout`` (per
      group), ``worker_init_fn``, ``multiprocessing_context``. ``persistent_workers`` keeps
      the processes unless an interrupt or error left them in an unknown state (fresh
      workers then continue at ``samples_consumed``); with a ``DeviceFeed`` device,
      ``pin_memory`` is ignored.
    * torch's keywords refused, keyword-only with default `TorchOnly.UNSET`:
      ``batch_size``, ``shuffle``, ``sampler``, ``batch_sampler``, ``drop_last``,
      ``generator``, ``in_order``, ``pin_memory_device``, and a positional batch size
      (``torch_positional``): each a `ConfigError` naming detdata's argument
      (`detdata.loading.arguments.TORCH_ONLY`). Any other keyword is Python's ``TypeError``.

    A failed read group is re-read batch by batch, so an error surfaces at the unreadable
    batch. Memory in flight is about ``batches_ahead`` x micro-batch bytes x (``num_workers``
    x ``prefetch_factor`` + 1). ``steps_ahead`` None means `DEFAULT_STEPS_AHEAD`.

    ``state_dict()`` is one JSON object; ``samples_consumed`` counts samples delivered to
    the callers of all ranks (batches read or copied ahead are not counted).
    """

    def __init__(
        self,
        data: Dataset | Stream,
        *torch_positional: TorchOnly,
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
        batch_size: TorchOnly = _UNSET,
        shuffle: TorchOnly = _UNSET,
        sampler: TorchOnly = _UNSET,
        batch_sampler: TorchOnly = _UNSET,
        drop_last: TorchOnly = _UNSET,
        generator: TorchOnly = _UNSET,
        in_order: TorchOnly = _UNSET,
        pin_memory_device: TorchOnly = _UNSET,
    ) -> None:
        refuse_torch_habits(
            torch_positional,
            {
                "batch_size": batch_size,
                "shuffle": shuffle,
                "sampler": sampler,
                "batch_sampler": batch_sampler,
                "drop_last": drop_last,
                "generator": generator,
                "in_order": in_order,
                "pin_memory_device": pin_memory_device,
            },
        )
        opts = _checked_options(options)
        if global_batch_size is None:
            raise ConfigError(
                "DataLoader needs global_batch_size= (samples per optimizer step over all "
                "ranks); hint: micro_batch_size= is each rank's batch per iteration (torch's "
                "batch_size), e.g. DataLoader(data, global_batch_size=512, micro_batch_size=8)"
            )
        self.options, self.seed = opts, check_seed(seed)
        self.num_workers = check_count(num_workers, "num_workers", minimum=0, maximum=1024)
        check_torch_args(
            worker_mode=opts.read.mode,
            num_workers=self.num_workers,
            prefetch_factor=prefetch_factor,
            persistent_workers=persistent_workers,
            timeout=timeout,
            multiprocessing_context=multiprocessing_context,
            collate_fn=collate_fn,
            worker_init_fn=worker_init_fn,
        )
        self._cursor = _cursor(
            data, global_batch_size, micro_batch_size, self.seed, order, opts, collate_fn
        )
        self._lookup = Lookup(self._cursor)
        self._collate_fn, self._pin_memory = collate_fn, bool(pin_memory)
        pin = self._pin_memory and opts.device.target is None
        workers: dict[str, Any] = {  # torch's worker keywords, as torch takes them
            "num_workers": self.num_workers,
            "pin_memory": pin,
            "timeout": timeout,
            "persistent_workers": persistent_workers,
            "multiprocessing_context": multiprocessing_context,
        }
        if prefetch_factor is not None:
            workers["prefetch_factor"] = check_count(prefetch_factor, "prefetch_factor")
        reads = Reads(opts.transform, self.seed, collate_fn, pin, opts.read.batches_ahead)
        self._source = batch_source(reads, opts.read.mode, workers, worker_init_fn)
        self._trace = RankTrace(opts.trace, self._cursor.layout.rank)
        self._delivery = Delivery(
            cursor=self._cursor,
            source=self._source,
            device=opts.device,
            trace=self._trace,
            schema=None if opts.transform is None else SchemaCheck(),
            attestor=Attestor(reads) if opts.resume.attest else None,
            read=opts.read,
        )
        self._live: weakref.WeakSet[LoaderIterator] = weakref.WeakSet()
        frameworks.built()  # a framework integration watches the calls the user makes

    # ------------------------------------------------------------------ info
    @property
    def samples_consumed(self) -> int:
        """Global samples delivered so far (all ranks), i.e. the next step's first position."""
        return self._cursor.samples_consumed

    @property
    def _steps_plan(self) -> Plan:
        return self._cursor.plan

    @property
    def stream(self) -> Stream:
        """The stream in force (over a saved mixture: this loader's, continued from it)."""
        return self._cursor.stream

    @property
    def layout(self) -> Layout:
        """This rank's micro batch and placement (re-read when an iteration starts)."""
        return self._cursor.layout

    @property
    def total_samples(self) -> int | None:
        """The run's bound (None: unbounded; `set_total_samples`)."""
        return self._cursor.total_samples

    def positions_of_next(self) -> IntArray:
        """Positions of the micro batch the next iteration will deliver on this rank."""
        return self._cursor.positions_of_next()

    @property
    def history(self) -> list[dict[str, Any]]:
        """The run's batch history as saved in the state (`detdata.loading.history`)."""
        return self._cursor.plan.to_json()

    def set_total_samples(self, total_samples: int | None) -> None:
        """Bound the run at ``total_samples`` (None: unbounded), a step end of this run at or
        after ``samples_consumed`` (after a global-batch change at a resume, set it here)."""
        self._cursor.set_total_samples(total_samples)

    def tokens_consumed(self) -> dict[str, int]:
        """Tokens delivered to all ranks, per source name (`detdata.loading.token_counts`)."""
        from detdata.loading.token_counts import tokens_consumed

        return tokens_consumed(self._cursor.stream, self._cursor.samples_consumed)

    def __len__(self) -> int:
        """Micro batches of this rank per epoch, a constant of whole global steps (so a
        trainer never takes a short step): all of ``total_samples``, else the whole steps in
        one pass over a plain `OrderedStream`'s dataset (at least one) or in ``2**62``
        samples. Samples past the last whole step are not lost: ``iter()`` continues.
        """
        per = self._cursor.layout_now().samples_per_micro_step  # as iteration binds it
        total = self._cursor.total_samples
        if total is not None:
            return total // per
        stream = self._cursor.stream
        epoch = stream.dataset.num_samples if isinstance(stream, OrderedStream) else MAX_POSITION
        return self._cursor.whole_steps(int(epoch)) // per

    def check_trainer_batch(
        self,
        *,
        micro_batch_size: int,
        accumulation: int,
        world_size: int,
        trainer: str,
        fix: str,
    ) -> None:
        """A trainer stepping every ``accumulation`` micro batches of ``micro_batch_size`` on
        ``world_size`` processes must match this loader's micro batch, world size and global
        batch; otherwise a `ConfigError` naming both sides with ``fix`` (formatted with the
        agreeing ``micro`` and ``accumulation``) as the hint."""
        layout = self._cursor.layout_now()  # as iteration binds it
        gbs = self.global_batch_size
        micro, world = layout.micro_batch_size, layout.world_size
        same_layout = micro_batch_size == micro and world_size == world
        agree = same_layout and accumulation * world * micro_batch_size == gbs
        if agree and self._cursor.plan.single_constant:
            return
        if not self._cursor.plan.single_constant:
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

    # ------------------------------------------------ surface trainers probe
    @property
    def dataset(self) -> Any:
        """The dataset or stream this loader reads (what ``data`` was)."""
        return self._cursor.definition.data

    @property
    def batch_size(self) -> int:
        """Samples per delivered batch: this rank's micro batch."""
        return self.layout.micro_batch_size

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

    @property
    def sampler(self) -> EpochStart:
        """Not a torch sampler (the data is sharded by rank already): `EpochStart`."""
        return EpochStart(self)

    def set_epoch(self, epoch: int) -> None:
        """Never moves the position (the order is a function of the global position).

        A trainer starting epoch ``epoch > 0`` on a loader that has delivered nothing did not
        restore its state (Lightning from an end-of-epoch checkpoint) and would replay the
        run from its first sample: a `StateError`.
        """
        epoch = check_count(epoch, "epoch", minimum=0)
        if epoch > 0 and self._cursor.samples_consumed == 0:
            raise StateError(
                f"a trainer starts epoch {epoch}, but this loader has delivered nothing: its "
                "state was not restored, and it would replay the run from its first sample; "
                "hint: resume from a checkpoint written inside an epoch (Lightning: "
                "ModelCheckpoint(every_n_train_steps=...), or train by max_steps), or call "
                "loader.load_state_dict(saved_state) before training",
                fields=("samples_consumed",),
            )

    # ------------------------------------------------------ state and resume
    def state_dict(self) -> dict[str, Any]:
        """JSON state: samples delivered, identity, layout, environment, attestation."""
        workers = {"num_workers": self.num_workers, "worker_mode": self.options.read.mode.value}
        return self._cursor.state_dict(workers, self._delivery.attestor)

    def load_state_dict(
        self,
        state_dict: Mapping[str, Any] | str,
        *,
        allow: Iterable[str] = (),
        mid_step: str | MidStep | None = None,
        at_step: int | None = None,
    ) -> None:
        """Resume at the saved position in O(1).

        A state saved inside a global step (``step_position.delivered_in_step`` > 0) resumes
        by default at that step's first position, re-delivering it whole (its partial
        gradients are in no state dict; logged; ``mid_step="redo"``, `MidStep.REDO`);
        ``mid_step="continue"`` resumes right after the delivered part (the default comes
        from ``ResumePolicy.mid_step``). ``at_step`` (an integration's trainer step): resume at
        that optimizer step's first position (`LoaderState.resumed`); with an explicit
        ``mid_step="continue"`` a `ConfigError`. Live iterators are stale afterwards
        (`StaleIteratorError` at their next batch).

        Differences in checked fields (manifests, data, seed, algorithm, mixture, global
        batch) are a `StateError` listing each, unless named in ``allow`` (or
        ``ResumePolicy.allow``). Over a saved mixture, this loader's `Mixture` continues the
        saved one from the resume position (`Mixture.continue_from`): that mixture in force is
        what is compared, recorded and saved, so resuming again with the same weights changes
        nothing. The layout may differ where the position is one of its micro-step boundaries.
        An allowed ``global_batch_size`` change joins the state's ``history``, in
        effect from the saved step's start, so earlier steps keep their positions.
        """
        self._cursor.load_state_dict(state_dict, allow=allow, mid_step=mid_step, at_step=at_step)
        self._trace.follow(self._cursor.layout.rank)
        self._trace.restore(self._cursor.samples_consumed)
        self._source.reset()  # kept workers hold the old position's stream and sampler

    # ------------------------------------------------------------ mixture weights
    def set_mixture_weights(self, weights: Mapping[str, Any]) -> int:
        """Put ``weights`` (of every `Mixture` source) in force from the first position of
        the next global step, returned (`Cursor.set_mixture_weights`; a collective)."""
        return self._cursor.set_mixture_weights(weights)

    def set_mixture_controller(self, controller: MixtureController | None) -> None:
        """Ask ``controller.mixture_weights(step)`` before each global step (None: stop)."""
        self._cursor.set_controller(controller)

    def mixture_weights_at_step(self, step: int) -> dict[str, Fraction]:
        """The exact proportions in force at global ``step``'s first position."""
        position = self.position_of_step(step)
        return reweightable(self._cursor.stream).mixture_weights_at(position)

    # ------------------------------------------------------------ provenance
    def provenance(
        self,
        step: int,
        *,
        decode: Callable[[Mapping[str, Any]], Any] | None = None,
        as_saved: bool = False,
    ) -> Any:
        """Every sample of global ``step`` (all ranks) as a list of
        `detdata.loading.provenance.SampleRecord`, read once; never moves ``samples_consumed``.

        Each position is answered with the stream (`stream_at`) and layout in force when it
        was delivered; ``as_saved``: positions after the loaded state's use the layout that
        state was saved with (a diagnostic tool outside the run's ranks). A step past
        ``total_samples`` is a `ConfigError` naming the last."""
        return self._lookup.provenance(step, decode=decode, as_saved=as_saved)

    def positions_seen(self, source: str | None, sample_id: int, *, until: int) -> IntArray:
        """Every global position ``< until`` at which this run delivers sample ``sample_id``
        of ``source`` (inverted with the stream in force there: `stream_at`); ``until`` past
        ``total_samples`` is a `ConfigError`."""
        return self._lookup.positions_seen(source, sample_id, until=until)

    def stream_at(self, position: int) -> Stream:
        """The stream that delivered ``position``: this loader's, or, before a change of
        ``seed``, ``stream_seed``, ``manifests``, ``data`` or ``algorithm`` allowed at a resume,
        the stream of that time when this loader can rebuild it; otherwise a `StateError`
        naming the change."""
        return self._lookup.stream_at(position)

    # ------------------------------------------------------------ iteration
    def __iter__(self) -> LoaderIterator:
        """This rank's micro batches from ``samples_consumed`` on; rank and world size not
        given are (re)read from torch.distributed here."""
        self._cursor.bind()
        self._trace.follow(self._cursor.layout.rank)
        if self._cursor.samples_consumed == 0:
            frameworks.check_start(self)  # a framework resuming a loader that starts over
        self._cursor.supersede("a second iter() on this loader started a new iterator")
        iterator = LoaderIterator(self._delivery)
        self._live.add(iterator)
        return iterator

    def close(self) -> None:
        """End every live iterator (their readers stop now), drop persistent workers and
        close the trace file; the loader can be iterated again."""
        self._cursor.supersede("close() ended the loader's iterators")
        for iterator in list(self._live):  # ended on purpose: they stop, they do not raise
            iterator.close()
        self._live.clear()
        self._source.reset()  # the workers' shared-memory slots are unmapped with them
        self._trace.close()


def _cursor(
    data: Dataset | Stream,
    global_batch_size: int | BatchSchedule,
    micro_batch_size: int | None,
    seed: int,
    order: OrderLike | None,
    opts: LoaderOptions,
    collate_fn: Callable[[Batch], Any] | None,
) -> Cursor:
    schedule = as_schedule(global_batch_size)
    constant = schedule.changes[0][1] if schedule.is_constant else None
    placement = Placement(constant, micro_batch_size, opts.rank, opts.world_size)
    definition = Definition.of(
        data,
        seed=seed,
        order=order,
        schedule=schedule,
        transform=transform_identity(opts.transform_id, opts.transform, collate_fn),
    )
    return Cursor(definition, placement, total_samples=opts.total_samples, policy=opts.resume)


def _checked_options(options: LoaderOptions | None) -> LoaderOptions:
    if options is None:
        return LoaderOptions()
    if not isinstance(options, LoaderOptions):
        raise ConfigError(
            f"DataLoader options must be a detdata.LoaderOptions, got "
            f"{type(options).__name__} {options!r:.60}; hint: options=LoaderOptions(rank=0, "
            "world_size=8, read=ReadOptions(batches_ahead=16))"
        )
    return options
