"""`Mixture`: several datasets as one seeded, exact, random-access `Stream` (``mixture-v1``,
defined as pure functions in `detdata.order.mixing`); here what needs datasets: each
source's `GlobalOrder`, the column checks across sources, batched reads, the identity.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping, Sequence
from fractions import Fraction
from typing import Any, Final

import numpy as np
import numpy.typing as npt

from detdata.base.canonical import canonical_json
from detdata.base.checks import check_count, check_seed
from detdata.base.errors import ConfigError, FormatError
from detdata.base.groupby import stable_groups
from detdata.base.hashing import digest_bytes
from detdata.base.types import Batch, IntArray
from detdata.datasets.base import Dataset
from detdata.datasets.batch_columns import describe_column, same_kind
from detdata.datasets.capabilities import Origins, info
from detdata.order.feistel import ALGORITHM as ORDER_ALGORITHM
from detdata.order.feistel import GlobalOrder, permute_sources
from detdata.order.memo import ChunkMemo
from detdata.order.mixing import (
    ALGORITHM,
    MixtureSchedule,
    Phase,
    PhaseSpec,
    ScheduleLike,
    WeightLike,
    check_schedule,
    continue_schedule,
    normalize_weights,
    rational,
    schedule_from_json,
    schedule_to_json,
    source_seed,
)
from detdata.order.mixture_changes import change_schedule

_PER_SOURCE: Final = 8  # up to this many sources in a request, `locate` asks each one's order


# ------------------------------------------------------------------ the stream
class Mixture:
    """Several datasets mixed with exact, seeded, resumable proportions (``mixture-v1``).

    ``Mixture(sources={name: dataset}, weights={name: w}, seed=s)`` or with
    ``schedule=[(0, {...}), (start, {...}), ...]`` instead of ``weights``. Weights are
    relative and exact (int, decimal string, ``"p/q"``, `Fraction`, float by its repr): each
    is divided by their sum, so ``{"a": 7, "b": 3}`` and ``{"a": "0.7", "b": "0.3"}`` are one
    mixture and ``{"a": 0.7, "b": 0.2}`` means 7/9 and 2/9 (``repr`` shows the proportions
    used).

    Every source must deliver the same columns (dtype, trailing shape, object kind):
    checked at construction (`source_columns`, a `FormatError` naming both sources and each
    differing column) into ``columns``, and every read against it. `fetch` returns new
    arrays (nothing aliases a source's memory).
    """

    algorithm: Final = ALGORITHM

    def __init__(
        self,
        sources: Mapping[str, Dataset],
        weights: Mapping[str, WeightLike] | None = None,
        *,
        seed: int,
        schedule: ScheduleLike | None = None,
        allow_zero: bool = False,
    ) -> None:
        self.seed = check_seed(seed)
        self.sources = _check_sources(sources)
        self.source_names: tuple[str, ...] = tuple(self.sources)
        self.allow_zero = bool(allow_zero)
        if (weights is None) == (schedule is None):
            raise ConfigError(
                "Mixture needs exactly one of weights={...} or schedule=[(0, {...}), ...]"
            )
        raw = [(0, weights)] if weights is not None else check_schedule(schedule)
        ints = [
            self._normalized(w, "weights" if schedule is None else f"schedule[{i}] weights")
            for i, (_, w) in enumerate(raw)
        ]
        self._schedule = MixtureSchedule.build(self.seed, [s for s, _ in raw], ints)
        self.phases: tuple[Phase, ...] = self._schedule.phases
        self.source_seeds = {n: source_seed(self.seed, n) for n in self.source_names}
        self.orders = {
            n: GlobalOrder(self.sources[n].num_samples, self.source_seeds[n])
            for n in self.source_names
        }
        self._sizes_u64 = np.array([o.num_samples for o in self.orders.values()], np.uint64)
        self._seeds_u64 = np.array([o.seed for o in self.orders.values()], np.uint64)
        self.columns: dict[str, str] = _common_columns(self.sources)
        self._memo = ChunkMemo(self.locate)

    def _normalized(self, weights: Mapping[str, object], where: str) -> tuple[int, ...]:
        """`normalize_weights` of ``weights`` over this mixture's sources (``where`` names
        them in its `ConfigError`)."""
        return normalize_weights(
            weights, self.source_names, allow_zero=self.allow_zero, where=where
        )

    def __repr__(self) -> str:
        weights = {
            n: rational(f)
            for n, f in zip(self.source_names, self.phases[0].fractions(), strict=True)
        }
        return (
            f"Mixture(sources={list(self.source_names)}, weights={weights}, seed={self.seed}, "
            f"phases={len(self.phases)}, algorithm={ALGORITHM!r})"
        )

    # -------------------------------------------------------------- mapping
    def assign(self, positions: npt.ArrayLike) -> tuple[IntArray, IntArray]:
        """``(source_index, index_in_source)`` for each global position (same shape), no
        sample ids (`MixtureSchedule.assign`)."""
        return self._schedule.assign(positions)

    def locate(self, positions: npt.ArrayLike) -> tuple[IntArray, IntArray, IntArray]:
        """``(source_index, index_in_source, sample_id)`` for each global position (same
        shape): ``sample_id = GlobalOrder(n_s, source_seeds[name]).ids(index_in_source)``."""
        src, index = self.assign(positions)
        flat, flat_index = src.reshape(-1), index.reshape(-1)
        present = np.flatnonzero(np.bincount(flat, minlength=len(self.source_names)))
        if present.size > _PER_SOURCE:  # every source's GlobalOrder in one pass
            ids = permute_sources(
                flat_index.astype(np.uint64), self._sizes_u64[flat], self._seeds_u64[flat]
            ).view(np.int64)
        else:  # a few sources: each order on its own positions (one key per epoch)
            ids = np.empty(flat.size, dtype=np.int64)
            for s in present.tolist():
                sel = flat == s
                ids[sel] = self.orders[self.source_names[s]].ids(flat_index[sel])
        return src, index, ids.reshape(src.shape)

    def sample_ids(self, positions: IntArray) -> IntArray:
        """Sample ids (within their source; pair them with ``locate(...)[0]``) of ``positions``."""
        return self.locate(positions)[2]

    def origins(self, positions: IntArray) -> Origins:
        """Source and sample id of each of the 1-D ``positions`` (`HasOrigins`)."""
        pos = np.asarray(positions, dtype=np.int64).reshape(-1)
        src, _, ids = self.locate(pos)
        return Origins(
            names=self.source_names,
            datasets=tuple(self.sources[n] for n in self.source_names),
            source=src.astype(np.int64),
            ids=ids.astype(np.int64),
            notes=(None,) * pos.size,
        )

    def fetch(self, positions: IntArray) -> Batch:
        """The samples at ``positions``, rows in position order: one batched read per source
        (positions resolved through a chunk cache of `locate`)."""
        src, _, ids = self._memo(np.asarray(positions, dtype=np.int64).reshape(-1))
        if src.size == 0:
            return self.sources[self.source_names[0]].read(np.empty(0, dtype=np.int64))
        first = int(src[0])
        runs: list[tuple[int, IntArray | None]]
        if len(self.source_names) == 1 or not (src != first).any():
            runs = [(first, None)]  # one source: every row, in order
            parts = {first: self.sources[self.source_names[first]].read(ids)}
        else:  # group positions by source: stable, so each source's ids stay in position order
            groups = stable_groups(src)
            runs = [(s, groups.order[a:b]) for s, a, b in groups.spans]
            parts = {s: self.sources[self.source_names[s]].read(ids[rows]) for s, rows in runs}
        return self._assemble(src.size, runs, parts)

    def _assemble(
        self, size: int, runs: Sequence[tuple[int, IntArray | None]], parts: Mapping[int, Batch]
    ) -> Batch:
        """One new output array per column, each source's rows scattered to its positions
        (``rows`` of a run; None: all of them); each part checked against `columns`."""
        for s, batch in parts.items():
            self._check_part(self.source_names[s], batch)
        first = next(iter(parts.values()))
        out: Batch = {}
        for col, ref in first.items():
            arr = np.empty((size, *ref.shape[1:]), dtype=ref.dtype)
            for s, rows in runs:
                value = np.asarray(parts[s][col])
                if rows is None:
                    arr[...] = value
                else:
                    arr[rows] = value
            out[col] = arr
        return out

    def _check_part(self, name: str, batch: Batch) -> None:
        if set(batch) != set(self.columns):
            raise FormatError(
                f"Mixture source {name!r} read columns {sorted(batch)}, but the "
                f"sources were found at construction to have {sorted(self.columns)}; "
                "hint: a dataset's read must always return the same columns"
            )
        for col, expected in self.columns.items():
            found = describe_column(batch[col])
            if not same_kind(found, expected):
                raise FormatError(
                    f"Mixture source {name!r} column {col!r}: read gave {found}, "
                    f"but the sources were found at construction to give {expected}; "
                    "hint: a dataset's read must always give one dtype and shape "
                    "per column"
                )

    def consumed(self, position: int) -> dict[str, int]:
        """Samples of each source consumed by positions ``[0, position)``:
        O(phases + sources + 16)."""
        return dict(zip(self.source_names, self._schedule.consumed(position), strict=True))

    def epochs_completed(self, position: int) -> dict[str, int]:
        """Complete epochs of each source's own order after positions ``[0, position)``."""
        return {n: c // self.sources[n].num_samples for n, c in self.consumed(position).items()}

    def weights_at(self, position: int) -> dict[str, Fraction]:
        """The exact proportions ``p_s`` in effect at global ``position``."""
        return dict(
            zip(self.source_names, self._schedule.phase_at(position).fractions(), strict=True)
        )

    @property
    def mixes(self) -> bool:
        """A mixture mixes its sources (`Reweights`)."""
        return True

    def mixture_weights_at(self, position: int) -> dict[str, Fraction]:
        """`weights_at` (the `Reweights` capability)."""
        return self.weights_at(position)

    def with_mixture_weights(self, position: int, weights: Mapping[str, WeightLike]) -> Mixture:
        """This mixture with ``weights`` (as for the constructor, else `ConfigError`) in force
        from global ``position`` on: a new phase there (`change_schedule`: earlier positions
        unchanged, each source continuing from its consumed count). Nothing is read."""
        return self.with_weight_changes([(position, weights)])

    def with_weight_changes(
        self, changes: Sequence[tuple[int, Mapping[str, WeightLike]]]
    ) -> Mixture:
        """`with_mixture_weights` of each ``(position, weights)`` in turn (a recorded
        trajectory replayed): O(changes x (log phases + sources)) in all."""
        ints = [
            (position, self._normalized(weights, f"mixture weights from position {position}"))
            for position, weights in changes
        ]
        schedule = change_schedule(self._schedule, self.seed, ints)
        if schedule is self._schedule:
            return self
        out = copy.copy(self)
        out._schedule, out.phases = schedule, schedule.phases
        # the cached positions before the first change stay valid (the phases before it
        # are the same objects): only the rest is located again
        out._memo = self._memo.forked(out.locate, min(p for p, _ in ints))
        return out

    # -------------------------------------------------------------- identity
    def schedule_json(self) -> list[list[Any]]:
        """``[[start, {name: "p/q"}], ...]`` with exact normalised proportions."""
        return schedule_to_json(self._schedule, self.source_names)

    def identity(self) -> dict[str, Any]:
        """Plain JSON pinning sources, seed, schedule and algorithms."""
        return {
            "type": "mixture",
            "algorithm": ALGORITHM,
            "seed": self.seed,
            "sources": {n: self.sources[n].identity() for n in self.source_names},
            "schedule": self.schedule_json(),
            "source_order_algorithm": ORDER_ALGORITHM,
        }

    def fingerprint(self) -> str:
        """``b3:<hex>`` of the canonical JSON (sorted keys, no whitespace, UTF-8) of `identity`."""
        return digest_bytes(canonical_json(self.identity()))

    def continue_from(self, saved_identity: Mapping[str, Any], position: int) -> Mixture:
        """This mixture's weights from ``position`` on, after the saved mixture's schedule
        before it: equal to the saved mixture on every position ``< position``, each source
        continuing from its consumed count (no sample repeated or skipped). Sources, seed
        and algorithms must match the saved ones (`ConfigError` listing what differs).
        Returns ``self`` when the result has this mixture's own phases.
        """
        saved = _saved_schedule(saved_identity, self)
        phases = continue_schedule(saved, self._schedule.proportions(), position)
        if tuple(phases) == self._schedule.proportions():
            return self
        schedule = [(s, dict(zip(self.source_names, w, strict=True))) for s, w in phases]
        zero = any(f == 0 for _, w in schedule for f in w.values())
        return Mixture(
            self.sources, seed=self.seed, schedule=schedule, allow_zero=zero or self.allow_zero
        )


def _saved_schedule(doc: Mapping[str, Any], mixture: Mixture) -> tuple[PhaseSpec, ...]:
    """The schedule of the saved mixture identity ``doc`` (as in a loader state); a
    `ConfigError` where it is not one, or where it differs from ``mixture`` in anything but
    its weights (each difference listed)."""
    if not isinstance(doc, Mapping) or doc.get("type") != "mixture":
        raise ConfigError(
            "saved identity is not a mixture identity (type "
            f"{doc.get('type') if isinstance(doc, Mapping) else type(doc).__name__!r})"
        )
    sources = doc.get("sources")
    schedule = doc.get("schedule")
    if not isinstance(sources, Mapping) or not isinstance(schedule, list) or not schedule:
        raise ConfigError(
            "saved mixture identity needs 'sources' (object) and 'schedule' (non-empty list)"
        )
    phases = schedule_from_json(schedule, sorted(sources))
    now = {
        "algorithm": ALGORITHM,
        "source_order_algorithm": ORDER_ALGORITHM,
        "seed": mixture.seed,
    }
    diffs = [f"{k}: saved {doc.get(k)!r}, now {v!r}" for k, v in now.items() if doc.get(k) != v]
    saved_names, names = set(sources), set(mixture.source_names)
    if saved_names - names:
        diffs.append(f"sources removed: {sorted(saved_names - names)}")
    if names - saved_names:
        diffs.append(f"sources added: {sorted(names - saved_names)}")
    for n in sorted(saved_names & names):
        if sources[n] != mixture.sources[n].identity():
            diffs.append(
                f"source {n!r} identity differs: saved {sources[n]!r:.120}, "
                f"now {mixture.sources[n].identity()!r:.120}"
            )
    if diffs:
        raise ConfigError(
            "cannot continue the saved mixture: "
            + "; ".join(diffs)
            + "; hint: continue_from only changes weights"
        )
    return phases


# ------------------------------------------------------------------ validation
def _check_sources(sources: object) -> dict[str, Dataset]:
    if not isinstance(sources, Mapping) or not sources:
        raise ConfigError(
            f"Mixture needs a non-empty mapping of source name -> dataset, got {sources!r:.80}"
        )
    for name in sources:
        if not isinstance(name, str) or not name:
            raise ConfigError(f"Mixture source names must be non-empty strings, got {name!r}")
    out: dict[str, Dataset] = {}
    for name in sorted(sources):
        data = sources[name]
        if not isinstance(data, Dataset):
            raise ConfigError(
                f"Mixture source {name!r}: expected a Dataset (num_samples, read, identity), "
                f"got {type(data).__name__}"
            )
        n = data.num_samples
        if isinstance(n, (int, np.integer)) and not isinstance(n, bool) and int(n) == 0:
            raise ConfigError(f"Mixture source {name!r} is empty (num_samples == 0); hint: drop it")
        check_count(n, f"Mixture source {name!r} num_samples")
        out[name] = data
    return out


def source_columns(name: str, dataset: Dataset) -> dict[str, str]:
    """Column -> `describe_column` of what ``dataset`` delivers: its `DatasetInfo` ``schema()``
    if it answers in that form, else described from ``read([0])``."""
    found: object = info(dataset).schema()
    if isinstance(found, Mapping) and all(
        isinstance(k, str) and isinstance(v, str) for k, v in found.items()
    ):
        return dict(found)
    try:
        batch = dataset.read(np.zeros(1, dtype=np.int64))
    except Exception as exc:
        exc.add_note(f"(while reading sample 0 of Mixture source {name!r} to learn its columns)")
        raise
    if not isinstance(batch, Mapping):
        raise ConfigError(
            f"Mixture source {name!r}: read must return a mapping of column -> "
            f"array, got {type(batch).__name__}"
        )
    return {str(k): describe_column(v) for k, v in batch.items()}


def _common_columns(sources: Mapping[str, Dataset]) -> dict[str, str]:
    """The columns every source delivers (`source_columns`), or `FormatError` naming each
    source that differs from the first (by name) and each differing column."""
    found = {name: source_columns(name, data) for name, data in sources.items()}
    first, *others = found
    ref = found[first]
    problems = []
    for name in others:
        cols = found[name]
        diffs = [
            f"column {c!r}: {first!r} gives {ref.get(c, 'nothing')}, {name!r} gives "
            f"{cols.get(c, 'nothing')}"
            for c in dict.fromkeys([*ref, *cols])
            if c not in ref or c not in cols or not same_kind(ref[c], cols[c])
        ]
        if diffs:
            problems.append(f"sources {first!r} and {name!r}: " + "; ".join(diffs))
        else:  # keep the most specific description ('str' over 'object': all None so far)
            ref = {c: cols[c] if t == "object" else t for c, t in ref.items()}
    if problems:
        raise FormatError(
            "Mixture sources deliver different columns (a batch would change dtype "
            "or shape with the sources it draws from, or fail mid-run): "
            + " | ".join(problems)
            + "; hint: make every source deliver the same "
            "columns with the same dtype and shape (TokenWindows out_dtype= and "
            "seq_len=, TableRows columns=)"
        )
    return ref
