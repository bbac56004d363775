"""What every part of the `DataLoader` shares: its attributes, its placement and its steps.

`detdata.loading.loader.DataLoader` is built from concept-sized parts, each a base class of it:
`detdata.loading.iteration.Iteration` (reading and delivering batches, worker lifecycle),
`detdata.loading.resume.Resume` (``state_dict`` / ``load_state_dict``) and
`detdata.loading.lookup.Lookup` (which stream and sample delivered a position). `LoaderBase`
declares the attributes they share (set by ``DataLoader.__init__``) and holds the placement
logic all of them use: the layout of this rank (re-read from ``torch.distributed`` when an
iteration starts), the step map of the run's history, the checked identity fields, and the
generations that make superseded iterators stale.
"""

from __future__ import annotations

import os
import weakref
from typing import TYPE_CHECKING, Any

from detdata.base.checks import check_count
from detdata.base.errors import StaleIteratorError
from detdata.base.types import IntArray
from detdata.datasets.base import Dataset, Stream
from detdata.loading.arguments import WorkerMode
from detdata.loading.history import Plan
from detdata.loading.layout import Layout, process_group_rank_world
from detdata.loading.state import identity_fields
from detdata.loading.steps import MidStep
from detdata.loading.trace import StepSpan, TraceWriter
from detdata.order.batches import BatchSchedule
from detdata.order.choice import OrderLike

if TYPE_CHECKING:
    from collections.abc import Callable

    import torch
    import torch.utils.data as tud

    from detdata.base.types import Batch
    from detdata.loading.iteration import LoaderIterator
    from detdata.loading.reading import GroupSampler, Transform


class LoaderBase:
    """The attributes and placement logic every part of a `DataLoader` shares."""

    # ----------------------------------------------- set by DataLoader.__init__
    seed: int
    layout: Layout
    num_workers: int
    total_samples: int | None
    worker_mode: WorkerMode
    read_ahead: int
    lookahead: int
    lookahead_connections: int
    device: torch.device | None
    device_prefetch: int
    _schedule: BatchSchedule
    _layout_args: tuple[int | None, int | None, int | None, int | None]
    _plan: Plan
    _saved_plan: Plan | None  # the history of the state loaded last, as saved
    _data: Dataset | Stream
    _stream: Stream
    _order: OrderLike | None
    _wrapped: bool  # the loader (or an `Excluded` with its seed) ordered a plain dataset
    _transform: Transform | None
    _collate_fn: Callable[[Batch], Any] | None
    _transform_name: str | None
    _torch_kwargs: dict[str, Any]
    _user_worker_init: Callable[[int], None] | None
    _allow: frozenset[str]
    _mid_step: MidStep
    _pin_memory: bool
    _prefetch_factor: int
    _live: weakref.WeakSet[LoaderIterator]
    _consumed: int
    _schema: dict[str, str] | str | None  # of the first transformed batch
    _generation: int
    _superseded: str  # what ended the iterators of earlier generations
    _torch_loader: tud.DataLoader[Any] | None
    _sampler: GroupSampler | None
    _workers_busy: bool  # see `Iteration._worker_batches`
    _slot_transfer: bool  # False: every group takes torch's transfer (benchmarks)
    _trace_path: str | os.PathLike[str] | None
    _trace: TraceWriter | None

    # ------------------------------------------------------------ the run's steps
    @property
    def step(self) -> int:
        """Index of the global step the next micro batch belongs to (from the run's history:
        right across schedule changes and resumes)."""
        return self._plan.step_of(self._consumed)

    def position_of_step(self, step: int) -> int:
        """First global position of step ``step`` of this run (all ranks)."""
        return self._plan.start_of(check_count(step, "step", minimum=0))

    def step_of_position(self, position: int) -> int:
        """The step global position ``position`` belongs to in this run."""
        return self._plan.step_of(check_count(position, "position", minimum=0))

    def _step_span(self) -> StepSpan:
        """Where the next micro batch lies in the run's steps (a trace record's step fields)."""
        step = self._plan.step_of(self._consumed)
        return StepSpan(
            step=step,
            start=self._plan.start_of(step),
            size=self._plan.batch_of(step),
            next=self._consumed + self.layout.samples_per_micro_step,
        )

    def _new_trace(self) -> TraceWriter | None:
        if self._trace_path is None:
            return None
        return TraceWriter(self._trace_path, self.layout.rank)  # each record gets its StepSpan

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

    # ----------------------------------------------------- identity, generations
    def _fields(self, stream: Stream | None = None) -> dict[str, Any]:
        """The checked identity fields of this loader now (`identity_fields`), or of this
        loader reading ``stream`` instead (the stream a resume puts in force)."""
        identity = (self._stream if stream is None else stream).identity()
        stream_seed = None if self._wrapped else identity.get("seed")
        return identity_fields(
            identity,
            self.seed,
            self._schedule.to_json(),
            stream_seed=stream_seed,
            transform=self._transform_name,
        )

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
