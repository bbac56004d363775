"""Delivery evidence: one JSONL record per delivered micro batch, and the diff of two traces.

**Record** (format version 3), written by `TraceWriter` when a micro batch is
delivered::

    {"v": 3, "rank": 0, "step": 7, "step_at": 56, "gbs": 8, "micro": 0,
     "at": 56, "next": 60, "pos": [[56, 2]], "cols": {"x": "<i4[5]"},
     "batch_b3": {"x": "<64 hex>"},
     "restored": true}                       # only on the first record after a restore

``at`` is the loader's ``samples_consumed`` before the batch and ``next`` after
it (every rank of a step shares them). ``step`` is the global step the batch
belongs to, ``step_at`` that step's first position and ``gbs`` its global batch,
all three from the run's step <-> position map (the loader's batch schedule and its
``history``: right across a ramp-up and across a global-batch change at a resume);
``micro`` is the micro step within the step, ``(at - step_at) // (next - at)``.
A record holds ``step_at <= at < next <= step_at + gbs``. Format 2 (still read)
had no ``step_at`` or ``micro`` and assumed one constant global batch:
``step == at // gbs``, ``step_at == step * gbs``. ``pos`` lists
the batch's positions as ``[first, count]`` runs. ``cols`` describes each leaf
of the batch (dtype and trailing shape) and ``batch_b3`` holds, per leaf, the sum
modulo 2**256 of one blake3 digest per sample, each taken over the leaf's name,
description, the sample's position (int64 LE) and the sample's bytes (the digest
framing is unchanged from format 2, so format 2 and 3 traces of one run compare
equal). Because
every sample is bound to its position and sums combine in any grouping, the
records of one global step add up to the same digests whatever the micro batch
size, the number of workers or (when the ranks' records are read together) the
world size. Tensors whose dtype numpy lacks (bfloat16, float8) are hashed by
their raw bytes and described by the torch dtype name.

**Timeline.** A trace file is read in order, per rank, as a run's deliveries: what the run
trained on, step after step. A record flagged ``restored`` follows a `TraceWriter.restore`
(the loader's ``load_state_dict``): the run went back (or forward) to ``at``, and what it
delivered after the latest moment its cursor was at ``at`` is superseded by what follows;
replayed positions must carry the same bytes as before, else the trace holds a *conflict*.
A record whose ``at`` does not continue its rank's previous record without a restore is a
*discontinuity* (a *restart* when at 0: a fresh loader whose state was not loaded): the
run's next step got other data, so it is reported at the step the run should have delivered
next, and nothing the rank delivered from there on (unless a restore rolls back before it)
stands for a step. So the first divergent step is the true one whatever the lengths of the
parts, and a ``--steps`` window before it compares what was delivered there.

**Diff.** `compare` assembles each trace per global step from its final records
(all ranks) and compares the steps' positions and summed digests; the first
difference is the smallest step with a difference or with a conflict or
discontinuity in either trace, whatever the order of the records in the files.
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Final

import blake3
import numpy as np
import numpy.typing as npt

from detdata.base.errors import ConfigError, FormatError, StorageError

TRACE_VERSION: Final = 3
#: Trace format versions this detdata reads (format 2: `_upgraded_v2`).
READABLE_VERSIONS: Final = (2, 3)
_TAG: Final = b"detdata-trace-v2\0"
_MOD: Final = 1 << 256
_HEX_LEN: Final = 64
_SCALARS: Final = (str, bytes, bool, int, float, type(None))

# ----------------------------------------------------------------- digests


@dataclass(frozen=True)
class _Leaf:
    """One leaf of a batch: per-sample ``rows`` (n byte strings) or one batch-level ``blob``."""

    name: str
    meta: str
    rows: Sequence[Any] | np.ndarray | None = None
    blob: bytes = b""


def _scalar_bytes(value: Any) -> bytes:
    if isinstance(value, str):
        return b"s" + value.encode("utf-8", "surrogatepass")
    if isinstance(value, bytes):
        return b"b" + value
    return b"r" + repr(value).encode()  # bool, int, float, None: repr is exact


def _tensor_array(tensor: Any, name: str) -> tuple[np.ndarray, str, tuple[int, ...]]:
    """A torch tensor as (contiguous numpy array, dtype text, shape); raw bytes if numpy lacks the
    dtype."""
    import torch

    t = tensor.detach()
    if t.layout != torch.strided:
        raise ConfigError(
            f"trace: batch leaf {name!r} is a {t.layout} tensor; only dense tensors can be "
            "digested; hint: return dense tensors from collate_fn, or trace=None"
        )
    try:
        t = t.cpu().resolve_conj().resolve_neg().contiguous()
    except (RuntimeError, NotImplementedError) as exc:
        raise ConfigError(
            f"trace: cannot copy batch leaf {name!r} ({t.dtype} on {t.device}) to the "
            f"host to digest it: {exc}"
        ) from None
    shape = tuple(t.shape)
    try:
        arr = t.numpy()
        return arr, arr.dtype.str, shape
    except (TypeError, RuntimeError):
        pass  # bfloat16, float8, ...: numpy has no such dtype; hash the raw bytes
    try:
        raw = t.reshape(-1).view(torch.uint8).numpy()
    except (TypeError, RuntimeError) as exc:
        raise ConfigError(
            f"trace: cannot read the bytes of batch leaf {name!r} ({t.dtype}): {exc}; "
            "hint: convert it in collate_fn, or trace=None"
        ) from None
    return raw, str(t.dtype), shape


def _is_array(value: Any) -> bool:
    torch = sys.modules.get("torch")
    return isinstance(value, np.ndarray) or (torch is not None and isinstance(value, torch.Tensor))


def _sample_array_bytes(value: Any, name: str) -> bytes:
    """One sample's array as bytes that include its dtype and shape (so [1, 2] != [[1], [2]])."""
    if isinstance(value, np.ndarray):
        if value.dtype.hasobject:
            raise ConfigError(
                f"trace: batch leaf {name!r} is a numpy object array; hint: return "
                "numeric arrays, or trace=None"
            )
        arr, dtype, shape = np.ascontiguousarray(value), value.dtype.str, value.shape
    else:
        arr, dtype, shape = _tensor_array(value, name)
    return f"{dtype}{list(shape)}:".encode() + arr.tobytes()


def _array_leaf(name: str, arr: np.ndarray, dtype: str, shape: tuple[int, ...], n: int) -> _Leaf:
    """Per-sample rows when the first axis has one entry per position, else one batch-level blob."""
    if arr.dtype.hasobject:
        raise ConfigError(
            f"trace: batch leaf {name!r} is a numpy object array; its bytes are pointers, "
            "not data; hint: return numeric or string arrays, or trace=None"
        )
    arr = np.ascontiguousarray(arr)
    if shape and shape[0] == n:
        return _Leaf(name, f"{dtype}{list(shape[1:])}", rows=arr.reshape(n, -1).view(np.uint8))
    return _Leaf(name, f"batch:{dtype}{list(shape)}", blob=arr.tobytes())


def _leaves(batch: Any, n: int, name: str = "") -> Iterator[_Leaf]:
    """Flatten a delivered batch (tensors/arrays/scalars in dicts, lists, tuples) into leaves."""
    torch = sys.modules.get("torch")
    label = name or "_"
    if torch is not None and isinstance(batch, torch.Tensor):
        yield _array_leaf(label, *_tensor_array(batch, label), n)
    elif isinstance(batch, np.ndarray):
        yield _array_leaf(label, batch, batch.dtype.str, batch.shape, n)
    elif isinstance(batch, Mapping):
        for key in sorted(batch, key=str):
            yield from _leaves(batch[key], n, f"{name}.{key}" if name else str(key))
    elif isinstance(batch, (list, tuple)):
        if len(batch) == n and n > 0 and all(isinstance(v, _SCALARS) for v in batch):
            yield _Leaf(label, "list", rows=[_scalar_bytes(v) for v in batch])
        elif len(batch) == n and n > 0 and all(_is_array(v) for v in batch):
            # one array per sample (ragged rows): per-sample digests, so steps stay micro-batch
            # invariant
            yield _Leaf(
                label,
                "list:arrays",
                rows=[_sample_array_bytes(v, f"{label}[{i}]") for i, v in enumerate(batch)],
            )
        else:
            for i, item in enumerate(batch):
                yield from _leaves(item, n, f"{name}[{i}]")
    elif isinstance(batch, _SCALARS):
        yield _Leaf(label, "batch:scalar", blob=_scalar_bytes(batch))
    else:
        raise ConfigError(
            f"trace: cannot digest batch leaf {label!r} of type {type(batch).__name__}; "
            "traces digest tensors, numpy arrays, str/bytes/numbers and dicts, lists "
            "and tuples of them; hint: return those from collate_fn, or trace=None"
        )


def leaf_digest(
    leaf_name: str,
    meta: str,
    positions: npt.NDArray[np.int64],
    rows: Sequence[Any] | np.ndarray | None,
    blob: bytes = b"",
) -> int:
    """The digest sum of one leaf over a micro batch (see the module docstring)."""
    prefix = _TAG + leaf_name.encode() + b"\0" + meta.encode() + b"\0"
    if rows is None:
        return int.from_bytes(
            blake3.blake3(prefix + positions.astype("<i8").tobytes() + blob).digest(), "little"
        )
    total = 0
    for pos, row in zip(positions.tolist(), rows, strict=True):
        hasher = blake3.blake3(prefix + pos.to_bytes(8, "little", signed=True))
        hasher.update(row)
        total += int.from_bytes(hasher.digest(), "little")
    return total % _MOD


def batch_digests(
    positions: npt.NDArray[np.int64], batch: Any
) -> tuple[dict[str, str], dict[str, int]]:
    """(leaf name -> description, leaf name -> digest sum) of one delivered micro batch."""
    cols: dict[str, str] = {}
    sums: dict[str, int] = {}
    for leaf in _leaves(batch, len(positions)):
        if leaf.name in cols:
            raise ConfigError(
                f"trace: two batch leaves are both named {leaf.name!r} (keys that print "
                "alike); hint: use distinct string keys"
            )
        cols[leaf.name] = leaf.meta
        sums[leaf.name] = leaf_digest(leaf.name, leaf.meta, positions, leaf.rows, leaf.blob)
    return cols, sums


def position_runs(positions: npt.NDArray[np.int64]) -> list[list[int]]:
    """``[first, count]`` runs of consecutive ascending positions, in order."""
    runs: list[list[int]] = []
    for p in positions.tolist():
        if runs and runs[-1][0] + runs[-1][1] == p:
            runs[-1][1] += 1
        else:
            runs.append([p, 1])
    return runs


# ------------------------------------------------------------------ writer


def _open_append(path: str) -> int:
    """Open (creating parent folders) a trace file for appending; ConfigError naming it."""
    if "://" in path:
        raise ConfigError(
            f"trace path {path!r} is a URL; traces are written to local files; hint: "
            "write the trace locally and upload it"
        )
    try:
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        return os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    except IsADirectoryError:
        raise ConfigError(
            f"trace path {path!r} is a directory; hint: pass a file name such as "
            f"{os.path.join(path, 'trace.jsonl')!r}"
        ) from None
    except OSError as exc:
        raise ConfigError(
            f"cannot open trace file {path!r} for appending: {exc.strerror or exc}; "
            "hint: pass a writable file path"
        ) from None


@dataclass(frozen=True)
class StepSpan:
    """Where a micro batch lies in the run's steps: its global ``step``, that step's first
    position ``start`` and global batch ``size``, and ``next`` (``samples_consumed`` after
    the batch is counted). The loader derives it from its step <-> position map."""

    step: int
    start: int
    size: int
    next: int


class TraceWriter:
    """Appends one record per delivered micro batch to a JSONL file (format: module docstring).

    Rank ``r > 0`` writes ``{path}.rank{r}``. The constructor opens the file for
    appending (creating parent folders) and raises `ConfigError` naming the path
    when it cannot (a directory, an unwritable place, a URL).

    Protocol for the loader: ``add(samples_consumed, positions, batch, span=...)`` for
    each micro batch *before* it is counted and delivered (if it raises, nothing was
    written: the batch must not be delivered); ``restore(samples_consumed)`` after
    a state was loaded (``load_state_dict``); ``close()`` at the end. ``span`` (a
    `StepSpan`) places the batch in the run's steps; without it the writer assumes one
    constant ``global_batch_size`` and ``samples_per_micro_step`` (then both are needed).
    """

    def __init__(
        self,
        path: str | os.PathLike[str],
        rank: int,
        *,
        global_batch_size: int | None = None,
        samples_per_micro_step: int | None = None,
    ) -> None:
        p = os.fspath(path)
        self.path = p if rank == 0 else f"{p}.rank{rank}"
        self.rank = rank
        self.global_batch_size = global_batch_size
        self.samples_per_micro_step = samples_per_micro_step
        self._restored = False
        self._fd: int | None = _open_append(self.path)

    def restore(self, samples_consumed: int) -> None:
        """The run continues at ``samples_consumed`` (a loaded state): flags the next record."""
        del samples_consumed  # the next record's ``at`` says where; the flag says it was on purpose
        self._restored = True

    def _span(self, at: int) -> StepSpan:
        """The constant-batch span of ``at`` (callers that pass no `StepSpan`)."""
        gbs, per = self.global_batch_size, self.samples_per_micro_step
        if gbs is None or per is None:
            raise ConfigError(
                f"trace {self.path!r}: a record needs its step: pass span=StepSpan(...) to "
                "add(), or global_batch_size= and samples_per_micro_step= to TraceWriter"
            )
        step = at // gbs
        return StepSpan(step=step, start=step * gbs, size=gbs, next=at + per)

    def add(
        self,
        samples_consumed: int,
        positions: npt.NDArray[np.int64],
        batch: Any,
        *,
        span: StepSpan | None = None,
    ) -> None:
        """Record the micro batch about to be delivered (``samples_consumed`` before counting
        it; ``span`` where it lies in the run's steps)."""
        if self._fd is None:
            raise ConfigError(
                f"trace file {self.path!r} was closed; hint: a closed DataLoader cannot "
                "deliver more batches with its trace"
            )
        at = int(samples_consumed)
        where = self._span(at) if span is None else span
        if not where.start <= at < where.next <= where.start + where.size:
            raise ConfigError(
                f"trace {self.path!r}: micro batch [{at}, {where.next}) is not inside its step "
                f"{where.step} [{where.start}, {where.start + where.size})"
            )
        positions = np.asarray(positions, dtype=np.int64).reshape(-1)
        if not len(positions):
            raise ConfigError(
                f"trace {self.path!r}: a micro batch without positions cannot be recorded"
            )
        cols, sums = batch_digests(positions, batch)
        record: dict[str, Any] = {
            "v": TRACE_VERSION,
            "rank": self.rank,
            "step": where.step,
            "step_at": where.start,
            "gbs": where.size,
            "micro": (at - where.start) // (where.next - at),
            "at": at,
            "next": where.next,
            "pos": position_runs(positions),
            "cols": cols,
            "batch_b3": {k: f"{v:064x}" for k, v in sums.items()},
        }
        if self._restored:
            record["restored"] = True
        self._append((json.dumps(record, sort_keys=True) + "\n").encode())
        self._restored = False

    def _append(self, line: bytes) -> None:
        assert self._fd is not None
        start = os.fstat(self._fd).st_size
        try:
            view = memoryview(line)
            while view:
                view = view[os.write(self._fd, view) :]
        except OSError as exc:
            with contextlib.suppress(OSError):  # leave no partial line behind
                os.ftruncate(self._fd, start)
            raise StorageError(
                f"cannot append to trace file {self.path!r}: {exc.strerror or exc}; the "
                "batch was not delivered; hint: free disk space or move the trace"
            ) from None

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None

    def __del__(self) -> None:
        fd = getattr(self, "_fd", None)
        if fd is not None:
            # no module globals here: at interpreter shutdown they may already be None
            try:
                os.close(fd)
            except Exception:  # a finaliser must never raise
                return


# ------------------------------------------------------------------ reader


@dataclass(frozen=True)
class Record:
    """One parsed trace record; ``where`` is ``file:line``; ``version`` the format it was read
    in (a format 2 record gets ``step_at = step * gbs`` and its ``micro`` derived)."""

    where: str
    rank: int
    step: int
    at: int
    next: int
    gbs: int
    runs: tuple[tuple[int, int], ...]
    cols: Mapping[str, str]
    sums: Mapping[str, int]
    restored: bool = False
    step_at: int = 0
    micro: int = 0
    version: int = TRACE_VERSION

    @property
    def next_step(self) -> int:
        """The step the run's next micro batch (at ``next``) belongs to."""
        return self.step if self.next < self.step_at + self.gbs else self.step + 1

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "v": self.version,
            "rank": self.rank,
            "step": self.step,
            "at": self.at,
            "next": self.next,
            "gbs": self.gbs,
            "pos": [list(r) for r in self.runs],
            "cols": dict(self.cols),
            "batch_b3": {k: f"{v:064x}" for k, v in self.sums.items()},
        }
        if self.version >= 3:
            out["step_at"] = self.step_at
            out["micro"] = self.micro
        if self.restored:
            out["restored"] = True
        return out

    def describe(self) -> str:
        return f"{self.where}: " + json.dumps(self.to_json(), sort_keys=True)


def _is_int(value: Any, minimum: int = 0) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= minimum


def _bad(where: str, what: str) -> FormatError:
    return FormatError(
        f"{where}: {what}; hint: traces are the JSONL files written by "
        "DataLoader(trace=...) with this detdata version"
    )


def _runs(where: str, pos: Any, at: int, nxt: int) -> tuple[tuple[int, int], ...]:
    if not isinstance(pos, list) or not pos:
        raise _bad(
            where, f"field 'pos' must be a non-empty list of [first, count], found {pos!r:.60}"
        )
    runs = []
    for run in pos:
        if not (isinstance(run, list) and len(run) == 2 and _is_int(run[0]) and _is_int(run[1], 1)):
            raise _bad(
                where, f"field 'pos' must hold [first, count] pairs of integers, found {run!r:.60}"
            )
        if run[0] < at or run[0] + run[1] > nxt:
            raise _bad(
                where,
                f"positions {run} lie outside the record's samples [at, next) = [{at}, {nxt})",
            )
        runs.append((run[0], run[1]))
    return tuple(runs)


def _digests(where: str, cols: Any, sums: Any) -> tuple[dict[str, str], dict[str, int]]:
    if not isinstance(cols, dict) or not all(isinstance(v, str) for v in cols.values()):
        raise _bad(where, "field 'cols' must be an object of leaf name -> description strings")
    if not isinstance(sums, dict) or sorted(sums) != sorted(cols):
        raise _bad(where, "field 'batch_b3' must have one digest per leaf named in 'cols'")
    out = {}
    for name, text in sums.items():
        if not (
            isinstance(text, str)
            and len(text) == _HEX_LEN
            and all(c in "0123456789abcdef" for c in text)
        ):
            raise _bad(
                where, f"batch_b3[{name!r}] must be 64 lowercase hex digits, found {text!r:.80}"
            )
        out[name] = int(text, 16)
    return dict(cols), out


def parse_record(doc: Any, where: str) -> Record:
    """Validate one decoded JSON line into a `Record` (`FormatError` naming ``where``)."""
    if not isinstance(doc, dict):
        raise _bad(where, f"expected a JSON object, found {type(doc).__name__}")
    version = doc.get("v")
    if version not in READABLE_VERSIONS or isinstance(version, bool):
        raise _bad(
            where,
            f"trace format version {version!r}; this detdata reads versions "
            f"{list(READABLE_VERSIONS)} (version 1 traces held one record per step and cannot "
            "be compared; re-record)",
        )
    ints = [("rank", 0), ("step", 0), ("at", 0), ("next", 1), ("gbs", 1)]
    if version >= 3:
        ints += [("step_at", 0), ("micro", 0)]
    for key, minimum in ints:
        if not _is_int(doc.get(key), minimum):
            raise _bad(
                where, f"field {key!r} must be an integer >= {minimum}, found {doc.get(key)!r:.60}"
            )
    at, nxt, gbs, step = doc["at"], doc["next"], doc["gbs"], doc["step"]
    if version == 2:
        if nxt <= at or step != at // gbs:
            raise _bad(
                where,
                f"inconsistent fields: at={at}, next={nxt}, gbs={gbs}, step={step} "
                "(expected next > at and step == at // gbs)",
            )
        step_at = step * gbs
        micro = (at - step_at) // (nxt - at)
    else:
        step_at, micro = doc["step_at"], doc["micro"]
        if not step_at <= at < nxt <= step_at + gbs or micro != (at - step_at) // (nxt - at):
            raise _bad(
                where,
                f"inconsistent fields: step_at={step_at}, gbs={gbs}, at={at}, next={nxt}, "
                f"micro={micro} (expected step_at <= at < next <= step_at + gbs and "
                "micro == (at - step_at) // (next - at))",
            )
    restored = doc.get("restored", False)
    if not isinstance(restored, bool):
        raise _bad(where, f"field 'restored' must be true or false, found {restored!r:.60}")
    cols, sums = _digests(where, doc.get("cols"), doc.get("batch_b3"))
    return Record(
        where=where,
        rank=doc["rank"],
        step=step,
        at=at,
        next=nxt,
        gbs=gbs,
        runs=_runs(where, doc.get("pos"), at, nxt),
        cols=cols,
        sums=sums,
        restored=restored,
        step_at=step_at,
        micro=micro,
        version=version,
    )


def _decode(raw: bytes, where: str, last: bool) -> Any:
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise _bad(where, f"not UTF-8 text (byte {exc.start})") from None
    try:
        return json.loads(text)
    except RecursionError:
        raise _bad(where, "JSON nested too deeply") from None
    except json.JSONDecodeError as exc:
        if last:
            raise _bad(
                where,
                f"truncated last record ({exc.msg}; the file does not end with a "
                "newline: was the writer killed mid-write?)",
            ) from None
        raise _bad(where, f"not valid JSON ({exc.msg} at column {exc.colno})") from None
    except ValueError as exc:  # e.g. an integer beyond Python's digit limit
        raise _bad(where, f"not a usable JSON value ({exc})") from None


def read_trace(path: str | os.PathLike[str]) -> list[Record]:
    """Records of a trace file, in file order; `FormatError` naming ``file:line`` if malformed.

    Missing or unreadable files raise `ConfigError` naming the path.
    """
    p = os.fspath(path)
    try:
        with open(p, "rb") as fh:
            data = fh.read()
    except FileNotFoundError:
        raise ConfigError(f"trace file not found: {p}") from None
    except IsADirectoryError:
        raise ConfigError(
            f"trace path {p} is a directory; hint: pass the trace file inside it"
        ) from None
    except OSError as exc:
        raise ConfigError(f"cannot read trace file {p}: {exc.strerror or exc}") from None
    lines = data.split(b"\n")
    records = []
    for number, raw in enumerate(lines, start=1):
        if not raw.strip():
            continue
        where = f"{p}:{number}"
        last = number == len(lines)  # only a last line without its newline can be cut short
        records.append(parse_record(_decode(raw, where, last), where))
    return records


# -------------------------------------------------------------- assembling


def _merged(intervals: Sequence[tuple[int, int]]) -> list[tuple[int, int]]:
    """Union of ``[start, end)`` intervals, sorted and merged."""
    out: list[tuple[int, int]] = []
    for start, end in sorted(intervals):
        if out and start <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], end))
        else:
            out.append((start, end))
    return out


def _spans(records: Sequence[Record]) -> list[tuple[int, int]]:
    return _merged([(first, first + n) for r in records for first, n in r.runs])


def _text(spans: Sequence[tuple[int, int]]) -> str:
    return ", ".join(f"[{a}, {b})" for a, b in spans[:4]) + (" ..." if len(spans) > 4 else "")


@dataclass(frozen=True)
class Block:
    """Records of two sides whose positions overlap transitively (compared as one unit)."""

    left: tuple[Record, ...]
    right: tuple[Record, ...]

    @property
    def start(self) -> int:
        return min(first for r in (*self.left, *self.right) for first, _ in r.runs)


def blocks(left: Sequence[Record], right: Sequence[Record]) -> list[Block]:
    """Connected groups of records (either side) with overlapping positions, by first position."""
    items = [*((r, 0) for r in left), *((r, 1) for r in right)]
    parent = list(range(len(items)))

    def find(i: int) -> int:
        while parent[i] != i:
            parent[i] = parent[parent[i]]
            i = parent[i]
        return i

    spans = sorted(
        (first, first + n, i) for i, (rec, _) in enumerate(items) for first, n in rec.runs
    )
    reach, owner = -1, -1
    for start, end, i in spans:
        if start < reach:  # overlaps the group being swept
            parent[find(i)] = find(owner)
            reach = max(reach, end)
        else:
            reach, owner = end, i
    groups: dict[int, list[int]] = {}
    for i in range(len(items)):
        groups.setdefault(find(i), []).append(i)
    out = [
        Block(
            tuple(items[i][0] for i in g if items[i][1] == 0),
            tuple(items[i][0] for i in g if items[i][1] == 1),
        )
        for g in groups.values()
    ]
    return sorted(out, key=lambda b: b.start)


def _summed(records: Sequence[Record]) -> tuple[dict[str, str], dict[str, int], list[str]]:
    """(leaf descriptions, digest sums, leaves described differently by different records)."""
    cols: dict[str, str] = {}
    sums: dict[str, int] = {}
    clashes = []
    for rec in records:
        for name, meta in rec.cols.items():
            if cols.setdefault(name, meta) != meta and name not in clashes:
                clashes.append(name)
            sums[name] = (sums.get(name, 0) + rec.sums[name]) % _MOD
    for name in cols:
        if any(name not in rec.cols for rec in records) and name not in clashes:
            clashes.append(name)
    return cols, sums, clashes


def block_difference(block: Block, sides: tuple[str, str] = ("A", "B")) -> str | None:
    """Why the two sides of a block differ (None when they delivered the same samples)."""
    left, right = _spans(block.left), _spans(block.right)
    if left != right:
        only_a = _minus(left, right)
        only_b = _minus(right, left)
        parts = [
            f"positions {_text(s)} only in {side}"
            for s, side in zip((only_a, only_b), sides, strict=True)
            if s
        ]
        return "positions differ: " + "; ".join(parts)
    cols_a, sums_a, clash_a = _summed(block.left)
    cols_b, sums_b, clash_b = _summed(block.right)
    if clash_a or clash_b:
        return f"leaves described differently within a step: {sorted({*clash_a, *clash_b})}"
    if cols_a != cols_b:
        return f"batch leaves differ: {sides[0]} {cols_a} vs {sides[1]} {cols_b}"
    changed = [name for name in sorted(sums_a) if sums_a[name] != sums_b[name]]
    if changed:
        batch = [n for n in changed if cols_a[n].startswith("batch:")]
        hint = (
            (
                f" (leaves {batch} are batch-level values, not per sample: they depend on the "
                "micro batch size)"
            )
            if batch
            else ""
        )
        return f"differs: batch_b3 of leaf {changed} at positions {_text(left)}{hint}"
    return None


def _minus(a: Sequence[tuple[int, int]], b: Sequence[tuple[int, int]]) -> list[tuple[int, int]]:
    """Positions in intervals ``a`` and not in ``b`` (both merged)."""
    out = []
    for start, end in a:
        cur = start
        for bs, be in b:
            if be <= cur or bs >= end:
                continue
            if bs > cur:
                out.append((cur, bs))
            cur = max(cur, be)
        if cur < end:
            out.append((cur, end))
    return out


@dataclass(frozen=True)
class Finding:
    """A difference: at ``step``, on ``rank``; ``records`` are (label, record) pairs to show."""

    step: int
    rank: int
    kind: str  # "conflict", "discontinuity" (a restart too), "overlap", "missing", "differs"
    reason: str
    records: tuple[tuple[str, Record], ...] = ()

    def to_json(self) -> dict[str, Any]:
        return {
            "step": self.step,
            "rank": self.rank,
            "kind": self.kind,
            "reason": self.reason,
            "records": [
                [label, rec.to_json() | {"where": rec.where}] for label, rec in self.records
            ],
        }


#: the order in which findings of one step are reported (the first is the most telling)
KIND_PRIORITY: Final = {
    "conflict": 0,
    "discontinuity": 1,
    "overlap": 2,
    "missing": 3,
    "differs": 4,
}


@dataclass
class Trace:
    """A trace assembled per global step: the final records and its own inconsistencies."""

    steps: dict[int, list[Record]] = field(default_factory=dict)
    findings: list[Finding] = field(default_factory=list)


def _conflicts(
    label: str, rank: int, generation: list[Record], final: list[Record]
) -> Iterator[Finding]:
    """Records delivered before a restore whose positions were delivered again with other bytes."""
    by_step: dict[int, tuple[list[Record], list[Record]]] = {}
    for rec in generation:
        by_step.setdefault(rec.step, ([], []))[0].append(rec)
    for rec in final:
        if rec.step in by_step:
            by_step[rec.step][1].append(rec)
    for step, (before, after) in sorted(by_step.items()):
        for block in blocks(before, after):
            if not block.left or not block.right or _spans(block.left) != _spans(block.right):
                continue  # not delivered again (or not comparable as one unit): nothing to check
            why = block_difference(block, ("before", "after"))
            if why is not None:
                shown = (
                    *((f"{label} first", r) for r in block.left[:2]),
                    *((f"{label} again", r) for r in block.right[:2]),
                )
                yield Finding(
                    step,
                    rank,
                    "conflict",
                    f"conflict in {label}: positions {_text(_spans(block.left))} of rank {rank} "
                    f"were delivered twice with different bytes ({why})",
                    shown,
                )


def _restore_point(timeline: Sequence[Record], at: int) -> int:
    """How many of a rank's records stand when the run is restored to ``at``: those up to the
    latest moment its cursor was at ``at`` (a checkpoint taken then), everything delivered
    after it superseded. Position 0 supersedes everything; a position the timeline never
    reached exactly keeps the records ending at or before it (a restore forward keeps all)."""
    for i in range(len(timeline) - 1, -1, -1):
        if timeline[i].next == at:
            return i + 1
    if at == 0:
        return 0
    cut = len(timeline)
    while cut > 0 and timeline[cut - 1].next > at:
        cut -= 1
    return cut


def _break_finding(label: str, prev: Record, rec: Record) -> Finding:
    """A record that does not continue its rank's previous one, without a restore."""
    expected = prev.next_step
    if rec.at == 0:
        what = (
            f"discontinuity in {label} (a restart): rank {rec.rank} started over at "
            f"samples_consumed 0 (step 0) where it should have delivered samples_consumed "
            f"{prev.next} (step {expected}): a fresh loader without load_state_dict (data "
            "cursor not restored?)"
        )
    else:
        what = (
            f"discontinuity in {label}: rank {rec.rank} delivered samples_consumed {rec.at} "
            f"(step {rec.step}) right after samples_consumed {prev.next} (step {expected}) "
            "without a restore; a loader whose state was not loaded, or two runs share the file"
        )
    shown = ((f"{label} before", prev), (f"{label} then", rec))
    return Finding(expected, rec.rank, "discontinuity", what, shown)


def assemble(records: Sequence[Record], label: str = "A") -> Trace:
    """Replay a trace's records in file order into its final records per step (module docstring).

    Each rank's records form a timeline of what the run trained on, step after step. A
    *restore* (a record flagged ``restored``) rolls the timeline back to the latest moment
    the cursor was at its ``at`` (`_restore_point`; the superseded records are kept to
    check that replayed positions carry the same bytes). A record that does not continue
    the previous one without a restore is a *restart* (at 0) or a *discontinuity*: the
    run's next step got other data, so it is reported at the step the run should have
    delivered next, and nothing the rank delivered from there on (until a restore rolls
    back before it) stands for a step: the first divergent step is the true one whatever
    the lengths of the parts, and the steps before it compare as delivered."""
    timelines: dict[int, list[Record]] = {}
    jumps: dict[int, dict[int, Record]] = {}  # rank -> index in its timeline -> record before
    arrivals: dict[int, list[Record]] = {}  # each rank's records in file order
    events: dict[int, list[tuple[list[Record], int]]] = {}  # (records gone back over, arrival)
    for rec in records:
        mine = timelines.setdefault(rec.rank, [])
        breaks = jumps.setdefault(rec.rank, {})
        arrived = arrivals.setdefault(rec.rank, [])
        cut = _restore_point(mine, rec.at) if mine else 0
        if (rec.restored or rec.at != mine[-1].next) if mine else False:
            # positions delivered again (restore, or a jump back) must carry the same bytes
            events.setdefault(rec.rank, []).append((mine[cut:], len(arrived)))
        if rec.restored:
            del mine[cut:]
            for index in [k for k in breaks if k >= cut]:
                del breaks[index]
        elif mine and rec.at != mine[-1].next:
            breaks[len(mine)] = mine[-1]
        mine.append(rec)
        arrived.append(rec)
    trace = Trace()
    final: dict[int, list[Record]] = {}
    for rank, mine in timelines.items():
        breaks = jumps[rank]
        first = min(breaks, default=len(mine))
        final[rank] = mine[:first]
        if breaks:
            trace.findings.append(_break_finding(label, breaks[first], mine[first]))
    for rank, happened in events.items():
        ends = [start for _, start in happened[1:]] + [len(arrivals[rank])]
        for (gone, start), end in zip(happened, ends, strict=True):
            trace.findings.extend(_conflicts(label, rank, gone, arrivals[rank][start:end]))
    for mine in final.values():
        for rec in mine:
            trace.steps.setdefault(rec.step, []).append(rec)
    for step, recs in sorted(trace.steps.items()):
        trace.findings.extend(_overlaps(label, step, recs))
    return trace


def _overlaps(label: str, step: int, records: list[Record]) -> Iterator[Finding]:
    """Positions delivered by two ranks in one step (each rank's own final records never
    overlap)."""
    spans = sorted(
        ((first, first + n, k) for k, rec in enumerate(records) for first, n in rec.runs)
    )
    reach, owner = -1, 0
    for start, end, k in spans:
        if start < reach:
            a, b = records[owner], records[k]
            yield Finding(
                step,
                min(a.rank, b.rank),
                "overlap",
                f"overlap in {label}: positions [{start}, {min(end, reach)}) of step {step} "
                f"were delivered twice, by rank {a.rank} and by rank {b.rank} (ranks built with "
                "different world sizes, data sharded twice, or rank files of different runs?)",
                ((f"{label} rank {a.rank}", a), (f"{label} rank {b.rank}", b)),
            )
            return
        reach, owner = end, k


def step_digests(records: Sequence[Record]) -> dict[int, dict[str, Any]]:
    """Per global step: merged positions, leaf descriptions and summed digests of the final records.

    Two runs that delivered the same samples at the same positions give equal
    values whatever their micro batch size, workers, resumes and replays.
    """
    out = {}
    for step, recs in sorted(assemble(records).steps.items()):
        cols, sums, _ = _summed(recs)
        out[step] = {
            "positions": [list(s) for s in _spans(recs)],
            "cols": cols,
            "batch_b3": {k: f"{v:064x}" for k, v in sorted(sums.items())},
        }
    return out


# ------------------------------------------------------------------ diffing


@dataclass(frozen=True)
class Comparison:
    """All differences between two traces (sorted: the first is the first divergence);
    ``steps``: the global steps either trace holds in the compared window, in order."""

    findings: tuple[Finding, ...]
    steps_compared: int
    steps: tuple[int, ...] = ()

    @property
    def first(self) -> Finding | None:
        return self.findings[0] if self.findings else None

    @property
    def steps_differing(self) -> int:
        return len({f.step for f in self.findings})


def _cross(
    step: int, a: list[Record], b: list[Record], labels: tuple[str, str] = ("A", "B")
) -> Finding | None:
    la, lb = labels
    if not a or not b:
        have = a or b
        return Finding(
            step,
            min(r.rank for r in have),
            "missing",
            f"missing in {la if not a else lb}",
            tuple(((la if a else lb), r) for r in have[:2]),
        )
    for block in blocks(a, b):
        why = block_difference(block, labels)
        if why is not None:
            rank = min(r.rank for r in (*block.left, *block.right))
            return Finding(
                step,
                rank,
                "differs",
                why,
                (*((la, r) for r in block.left[:2]), *((lb, r) for r in block.right[:2])),
            )
    return None


def compare(
    a: Sequence[Record],
    b: Sequence[Record],
    *,
    start: int = 0,
    stop: int | None = None,
    labels: tuple[str, str] = ("A", "B"),
) -> Comparison:
    """Differences between traces ``a`` and ``b`` in steps ``[start, stop)``, first divergence
    first; ``labels`` name the two runs in the reasons."""
    ta, tb = assemble(a, labels[0]), assemble(b, labels[1])

    def inside(step: int) -> bool:
        return step >= start and (stop is None or step < stop)

    findings = [f for f in (*ta.findings, *tb.findings) if inside(f.step)]
    steps = sorted(s for s in set(ta.steps) | set(tb.steps) if inside(s))
    for step in steps:
        found = _cross(step, ta.steps.get(step, []), tb.steps.get(step, []), labels)
        if found is not None:
            findings.append(found)
    findings.sort(key=lambda f: (f.step, KIND_PRIORITY[f.kind], f.rank))
    return Comparison(tuple(findings), len(steps), tuple(steps))


def first_difference(
    a: Sequence[Record],
    b: Sequence[Record],
    *,
    start: int = 0,
    stop: int | None = None,
    labels: tuple[str, str] = ("A", "B"),
) -> dict[str, Any] | None:
    """The first divergence of two traces as JSON (``step``, ``rank``, ``kind``, ``reason``,
    ``records``), or None when they delivered the same samples in every compared step."""
    found = compare(a, b, start=start, stop=stop, labels=labels).first
    return None if found is None else found.to_json()
