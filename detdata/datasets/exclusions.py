"""Excluding samples deterministically: `ExclusionList` and the `Excluded` stream (``exclude-v1``).

An `ExclusionList` is a set of ``(source, sample_id)`` (source None for a single-dataset
stream, else a `Mixture` source name), addressed by the blake3 of its canonical JSON.
`Excluded` wraps a stream with a *history* of lists, each in force from a global position
on. A position ``g`` whose sample is excluded delivers the first of the draws ``r_k =
u64le⁻¹(blake3(b"detdata:exclude-v1" + u64le(seed) + u64le(g) + u64le(k))[:8]) mod n_s``,
``k = 0, 1, ...`` (``n_s`` the samples of its source, ``seed`` the wrapped stream's) that
is not excluded at ``g``; every other position keeps its sample. Why replacement and not a
mask, the identity checked at a resume and the loader-ordered case: docs/design.md,
"Exclusions".
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, replace
from fractions import Fraction
from typing import Any, Final

import numpy as np

from detdata.base.canonical import canonical_json
from detdata.base.checks import check_count
from detdata.base.errors import ConfigError, StateError
from detdata.base.hashing import digest_bytes
from detdata.base.keys import derive_u64
from detdata.base.types import MAX_POSITION, Batch, IntArray
from detdata.datasets.base import Dataset, Stream
from detdata.datasets.capabilities import Reweights, reweights
from detdata.datasets.origins import Origins, origins
from detdata.datasets.streams import as_stream

ALGORITHM: Final = "exclude-v1"
KIND: Final = "detdata.exclusions"
LIST_VERSION: Final = 1
K_KIND: Final = "kind"
K_VERSION: Final = "version"
K_ENTRIES: Final = "entries"
K_FROM: Final = "from"
K_LIST: Final = "list"
K_COUNT: Final = "count"
#: Identity keys of the `Excluded` wrapper (`Excluded.identity`, `split_identity`).
TYPE: Final = "excluded"
K_TYPE: Final = "type"
K_RULE: Final = "rule"
K_SEED: Final = "seed"
K_STREAM: Final = "stream"
K_HISTORY: Final = "history"
#: The state field exclusions are checked under (`detdata.loading.state`).
FIELD: Final = "exclusions"
_TAG: Final = b"detdata:" + ALGORITHM.encode()
_MAX_DRAWS: Final = 10_000

Entry = tuple[str | None, int]


@dataclass(frozen=True)
class ExclusionList:
    """A content-addressed set of ``(source, sample_id)`` entries (sorted, no duplicates)."""

    entries: tuple[Entry, ...]

    @classmethod
    def of(cls, entries: Iterable[Entry | int | str]) -> ExclusionList:
        """From ``(source, id)`` pairs, plain ids (source None) or ``"SOURCE:ID"`` strings."""
        parsed = {_parse_entry(e) for e in entries}
        return cls(tuple(sorted(parsed, key=lambda e: (e[0] is not None, e[0] or "", e[1]))))

    def to_json(self) -> dict[str, Any]:
        return {K_KIND: KIND, K_VERSION: LIST_VERSION, K_ENTRIES: [[s, i] for s, i in self.entries]}

    @property
    def digest(self) -> str:
        """``b3:<hex>`` of the canonical JSON of `to_json`: the list's content address."""
        return digest_bytes(canonical_json(self.to_json()))

    def save(self, path: str | os.PathLike[str]) -> str:
        """Write the list as JSON to ``path`` (atomically, `atomic_write_bytes`); its digest."""
        from detdata.storage.atomic import atomic_write_bytes

        text = json.dumps(self.to_json(), indent=1) + "\n"
        atomic_write_bytes(os.fspath(path), text.encode("utf-8"))
        return self.digest

    @classmethod
    def load(cls, path: str | os.PathLike[str], *, digest: str | None = None) -> ExclusionList:
        """Read a saved list; with ``digest``, refuse (`ConfigError`) a list of other content."""
        try:
            with open(path, encoding="utf-8") as fh:
                doc = json.load(fh)
        except IsADirectoryError:
            raise ConfigError(
                f"{path}: a folder, not an exclusion list file; hint: pass the JSON file "
                "ExclusionList.save wrote"
            ) from None
        except (ValueError, RecursionError) as exc:  # JSON and UTF-8 errors
            raise ConfigError(
                f"{path}: not a detdata exclusion list (not valid JSON: {exc}); hint: pass the "
                "JSON file ExclusionList.save wrote"
            ) from None
        if not isinstance(doc, Mapping) or doc.get(K_KIND) != KIND:
            raise ConfigError(f"{path}: not a detdata exclusion list (kind {KIND!r} expected)")
        if doc.get(K_VERSION) != LIST_VERSION:
            raise ConfigError(f"{path}: exclusion list version {doc.get(K_VERSION)!r} unknown")
        raw = doc.get(K_ENTRIES)
        if not isinstance(raw, list) or not all(isinstance(e, list) and len(e) == 2 for e in raw):
            raise ConfigError(f"{path}: 'entries' must be a list of [source, id] pairs")
        out = cls.of((s, i) for s, i in raw)
        if digest is not None and out.digest != digest:
            raise ConfigError(
                f"{path}: exclusion list digest {out.digest} does not match the expected "
                f"{digest}; hint: this is not the list the run recorded"
            )
        return out

    def ids_of(self, source: str | None) -> IntArray:
        """The sorted sample ids of ``source``."""
        return np.array(sorted(i for s, i in self.entries if s == source), dtype=np.int64)


def entry_label(source: str | None, ident: int) -> str:
    """An entry as a user writes it: ``web:1234`` on a mixture, ``1234`` on one dataset."""
    return str(ident) if source is None else f"{source}:{ident}"


def _parse_entry(entry: object) -> Entry:
    if isinstance(entry, str):
        source, sep, ident = entry.rpartition(":")
        if not sep or not ident.strip().isdigit():
            raise ConfigError(
                f"exclusion {entry!r} is not 'SOURCE:ID' (ID a sample id); hint: 'web:1234', "
                "or a plain int for a single-dataset stream"
            )
        return (source or None, int(ident))
    if isinstance(entry, (tuple, list)) and len(entry) == 2:
        source, ident = entry
        if source is not None and not isinstance(source, str):
            raise ConfigError(f"exclusion {entry!r}: the source must be a name or None")
        return (source, check_count(ident, "excluded sample id", minimum=0))
    return (None, check_count(entry, "excluded sample id", minimum=0))


class Excluded:
    """``stream`` with the samples of each list of ``history`` replaced from its position on
    (the rule: module docstring). ``history`` is ``[(from_position, ExclusionList), ...]``,
    positions strictly increasing (one `ExclusionList`: ``[(0, it)]``). A plain dataset is
    first ordered with ``seed`` (`OrderedStream`)."""

    algorithm: Final = ALGORITHM

    def __init__(
        self,
        data: Dataset | Stream,
        history: ExclusionList | Sequence[tuple[int, ExclusionList]] = (),
        *,
        seed: int = 0,
    ) -> None:
        self.stream = as_stream(data, seed)
        #: True when ``data`` was a plain dataset ordered here with ``seed``, as a DataLoader
        #: orders one (the loader then records it as loader-ordered when the seeds agree)
        self.orders_dataset = self.stream is not data
        base = self.stream.identity()
        self.seed = int(base.get("seed", seed))
        self.history = _check_history(history)
        probe = origins(self.stream, np.zeros(1, dtype=np.int64))
        self.names = probe.names
        self._datasets = probe.datasets
        for _, lst in self.history:
            self._check_list(lst)
        # per list: per source index, the sorted excluded ids
        self._ids = [tuple(lst.ids_of(n) for n in self.names) for _, lst in self.history]
        self._starts = np.array([g for g, _ in self.history], dtype=np.int64)

    def _check_list(self, lst: ExclusionList) -> None:
        for source, ident in lst.entries:
            if source not in self.names:
                shown = [n for n in self.names if n is not None] or ["None (one dataset)"]
                hint = (
                    f"; hint: on a mixture each entry names its source: ExclusionList.of("
                    f"[({shown[0]!r}, {ident})]) or ExclusionList.of(['{shown[0]}:{ident}'])"
                    if source is None
                    else ""
                )
                raise ConfigError(
                    f"exclusion {entry_label(source, ident)} names source {source!r}; this "
                    f"stream's sources are {shown}{hint}"
                )
            n = self._datasets[self.names.index(source)].num_samples
            if ident >= n:
                raise ConfigError(
                    f"exclusion {entry_label(source, ident)}: sample id beyond the "
                    f"{'source' if source is not None else 'dataset'}'s {n} samples (ids "
                    f"0 .. {n - 1}); hint: an exclusion names a sample id (what where / "
                    "seen print), not a global position"
                )
        for s, name in enumerate(self.names):
            n = self._datasets[s].num_samples
            total = len({i for _, lst_ in self.history for src, i in lst_.entries if src == name})
            if total >= n:
                raise ConfigError(
                    f"source {name!r}: {total} of its {n} samples are excluded; at least one "
                    "must remain to draw replacements from"
                )

    def source_index(self, name: str | None) -> int:
        """Index of source ``name`` in `names` (`ConfigError` naming the sources if unknown)."""
        if name not in self.names:
            shown = [n for n in self.names if n is not None] or ["None (one dataset)"]
            raise ConfigError(f"unknown source {name!r}; this stream's sources are {shown}")
        return self.names.index(name)

    def excluded_ids(self, k: int, source: int) -> list[int]:
        """The ids of source index ``source`` in ``history[k]``'s list, sorted."""
        return [int(i) for i in self._ids[k][source].tolist()]

    def excluded_mask(self, source: IntArray, ids: IntArray, pos: IntArray) -> np.ndarray[Any, Any]:
        """Which ``(source index, id)`` pairs are excluded at their positions ``pos``."""
        out = np.zeros(pos.size, dtype=bool)
        for k, start in enumerate(self._starts.tolist()):
            live = pos >= start
            for s, banned in enumerate(self._ids[k]):
                if banned.size:
                    sel = live & (source == s)
                    out[sel] |= np.isin(ids[sel], banned)
        return out

    def _replace(self, position: int, source: int) -> tuple[int, int]:
        """``(replacement id, draws)`` for an excluded sample of ``source`` at ``position``."""
        n = self._datasets[source].num_samples
        pos = np.array([position], dtype=np.int64)
        src = np.array([source], dtype=np.int64)
        for k in range(_MAX_DRAWS):
            candidate = derive_u64(_TAG, self.seed, position, k) % n
            if not self.excluded_mask(src, np.array([candidate], dtype=np.int64), pos)[0]:
                return candidate, k + 1
        raise ConfigError(
            f"position {position}: no replacement found in {_MAX_DRAWS} draws; nearly every "
            "sample of the source is excluded"
        )

    def origins(self, positions: IntArray) -> Origins:
        """The wrapped stream's `Origins` with excluded samples replaced; a replaced position's
        note is ``{"excluded": id, "draws": k}``."""
        pos = np.asarray(positions, dtype=np.int64).reshape(-1)
        base = origins(self.stream, pos)
        ids = base.ids.copy()
        notes: list[dict[str, Any] | None] = list(base.notes)
        if self.history:
            for j in np.flatnonzero(self.excluded_mask(base.source, base.ids, pos)).tolist():
                new, draws = self._replace(int(pos[j]), int(base.source[j]))
                notes[j] = {"excluded": int(ids[j]), "draws": draws}
                ids[j] = new
        return replace(base, ids=ids, notes=tuple(notes))

    def sample_ids(self, positions: IntArray) -> IntArray:
        pos = np.asarray(positions)
        return self.origins(pos.reshape(-1)).ids.reshape(pos.shape)

    def fetch(self, positions: IntArray) -> Batch:
        """The samples at ``positions``: one batched read per source, rows in position order.
        Nothing excluded is read."""
        found = self.origins(np.asarray(positions, dtype=np.int64).reshape(-1))
        if found.source.size == 0 or len(found.datasets) == 1:
            return found.datasets[0].read(found.ids)
        parts = {}
        for s in np.unique(found.source).tolist():
            rows = np.flatnonzero(found.source == s)
            parts[s] = (rows, found.datasets[s].read(found.ids[rows]))
        first = next(iter(parts.values()))[1]
        out: Batch = {}
        for col, ref in first.items():
            arr = np.empty((found.ids.size, *ref.shape[1:]), dtype=ref.dtype)
            for rows, batch in parts.values():
                arr[rows] = batch[col]
            out[col] = arr
        return out

    def history_json(self) -> list[dict[str, Any]]:
        return [
            {K_FROM: g, K_LIST: lst.digest, K_COUNT: len(lst.entries)} for g, lst in self.history
        ]

    def identity(self) -> dict[str, Any]:
        """The wrapped identity, the seed the draws use and the exclusion history."""
        return {
            K_TYPE: TYPE,
            K_RULE: ALGORITHM,  # not "algorithm": a first list changes ``exclusions`` only
            K_SEED: self.seed,
            K_STREAM: self.stream.identity(),
            K_HISTORY: self.history_json(),
        }

    @property
    def mixes(self) -> bool:
        """Whether the wrapped stream mixes sources (`Reweights`): its weights can change."""
        return reweights(self.stream) is not None

    def mixture_weights_at(self, position: int) -> dict[str, Fraction]:
        """The wrapped mixture's proportions at ``position`` (`Reweights`)."""
        return self._reweighted().mixture_weights_at(position)

    def with_mixture_weights(self, position: int, weights: Mapping[str, Any]) -> Excluded:
        """These exclusions over the wrapped mixture with ``weights`` in force from
        ``position`` on (`Mixture.with_mixture_weights`): an excluded sample stays excluded
        (and replaced) at every position its list is in force, whatever the weights."""
        return self.with_weight_changes([(position, weights)])

    def with_weight_changes(self, changes: Sequence[tuple[int, Mapping[str, Any]]]) -> Excluded:
        """`with_mixture_weights` of each ``(position, weights)`` in turn."""
        inner = self._reweighted().with_weight_changes(changes)
        if inner is self.stream:
            return self
        out = Excluded(inner, self.history, seed=self.seed)
        out.orders_dataset = self.orders_dataset
        return out

    def _reweighted(self) -> Reweights:
        inner = reweights(self.stream)
        if inner is None:
            raise ConfigError(
                f"cannot change mixture weights: this Excluded wraps a "
                f"{type(self.stream).__name__}, not a Mixture; hint: wrap a detdata.Mixture"
            )
        return inner

    def continue_from(self, saved_identity: Mapping[str, Any], position: int) -> Excluded:
        """This stream, after a resume of ``saved_identity`` at ``position`` that allows an
        ``exclusions`` change (`ContinuesFrom`): `StateError` unless the wrapped stream is
        the saved one, the saved history is a prefix of this one and every added list is in
        force only from ``position`` on."""
        p = check_count(position, "position", minimum=0, maximum=MAX_POSITION - 1)
        saved = dict(saved_identity)
        if saved.get(K_TYPE) == TYPE:
            base, past = saved.get(K_STREAM), list(saved.get(K_HISTORY) or [])
        else:
            base, past = saved, []
        if canonical_json(base) != canonical_json(self.stream.identity()):
            raise StateError(
                "the saved stream is not the stream these exclusions wrap; hint: wrap exactly "
                "the saved dataset/mixture",
                fields=("data",),
            )
        mine = self.history_json()
        if mine[: len(past)] != past:
            raise StateError(
                f"the saved exclusion history {past} is not a prefix of this one {mine}; hint: "
                "keep every earlier list, in order, and append new ones",
                fields=(FIELD,),
            )
        early = [h for h in mine[len(past) :] if h[K_FROM] < p]
        if early:
            raise StateError(
                f"exclusion list(s) {early} take effect before the resume position {p}: that "
                "would change steps already trained on; hint: add them from position "
                f"{p} (the saved samples_consumed) on",
                fields=(FIELD,),
            )
        return self


def split_identity(identity: Mapping[str, Any]) -> tuple[dict[str, Any], list[Any] | None]:
    """``identity`` with every `Excluded` wrapper replaced by the stream it wraps (checked as
    ``data``), and the exclusions taken out (checked as ``exclusions``): ``[{"rule", "seed",
    "history"}]`` per wrapper with a non-empty history, outermost first, or None."""
    found: list[Any] = []

    def walk(node: Any) -> Any:
        if isinstance(node, Mapping):
            if node.get(K_TYPE) == TYPE and isinstance(node.get(K_STREAM), Mapping):
                if node.get(K_HISTORY):
                    found.append({k: node.get(k) for k in (K_RULE, K_SEED, K_HISTORY)})
                return walk(node[K_STREAM])
            return {k: walk(v) for k, v in node.items()}
        if isinstance(node, list):
            return [walk(v) for v in node]
        return node

    core = walk(identity)
    return core, (found or None)


def _check_history(
    history: ExclusionList | Sequence[tuple[int, ExclusionList]],
) -> tuple[tuple[int, ExclusionList], ...]:
    if isinstance(history, ExclusionList):
        return ((0, history),)
    out: list[tuple[int, ExclusionList]] = []
    for i, item in enumerate(history):
        if not isinstance(item, (tuple, list)) or len(item) != 2:
            raise ConfigError(f"history[{i}] must be a (from_position, ExclusionList) pair")
        start = check_count(item[0], f"history[{i}] from", minimum=0, maximum=MAX_POSITION - 1)
        if not isinstance(item[1], ExclusionList):
            raise ConfigError(f"history[{i}]: expected an ExclusionList, got {type(item[1])}")
        if out and start <= out[-1][0]:
            raise ConfigError(f"history[{i}] from {start} is not after history[{i - 1}]")
        out.append((start, item[1]))
    return tuple(out)
