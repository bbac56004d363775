"""Reading a trace: `read_trace` parses a JSONL file into validated `Record` objects (formats 2
and 3, `detdata.loading.trace`); `FormatError` naming ``file:line`` for anything malformed."""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Final

from detdata.base.errors import ConfigError, FormatError
from detdata.loading.history import is_count
from detdata.loading.trace.digests import READABLE_VERSIONS, TRACE_VERSION, is_hex_digest

#: A record's int fields and their minimums (named as in `Record`), and those format 3 added.
_V2_INTS: Final = (("rank", 0), ("step", 0), ("at", 0), ("next", 1), ("gbs", 1))
_V3_INTS: Final = (("step_at", 0), ("micro", 0))


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
        out: dict[str, Any] = {"v": self.version, **{k: getattr(self, k) for k, _ in _V2_INTS}}
        out["pos"] = [list(r) for r in self.runs]
        out["cols"] = dict(self.cols)
        out["batch_b3"] = {k: f"{v:064x}" for k, v in self.sums.items()}
        if self.version >= 3:
            out.update({k: getattr(self, k) for k, _ in _V3_INTS})
        if self.restored:
            out["restored"] = True
        return out

    def describe(self) -> str:
        return f"{self.where}: " + json.dumps(self.to_json(), sort_keys=True)


def _bad(where: str, what: str) -> FormatError:
    return FormatError(
        f"{where}: {what}; hint: traces are the JSONL files written by "
        "DataLoader(options=LoaderOptions(trace=...)) with this detdata version"
    )


def _runs(where: str, pos: Any, at: int, nxt: int) -> tuple[tuple[int, int], ...]:
    if not isinstance(pos, list) or not pos:
        raise _bad(
            where, f"field 'pos' must be a non-empty list of [first, count], found {pos!r:.60}"
        )
    runs = []
    for run in pos:
        if not (
            isinstance(run, list) and len(run) == 2 and is_count(run[0]) and is_count(run[1], 1)
        ):
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
        if not is_hex_digest(text):
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
    for key, minimum in _V2_INTS + (_V3_INTS if version >= 3 else ()):
        if not is_count(doc.get(key), minimum):
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
    lines = read_local(p, "trace", "pass the trace file inside it").split(b"\n")
    records = []
    for number, raw in enumerate(lines, start=1):
        if not raw.strip():
            continue
        where = f"{p}:{number}"
        last = number == len(lines)  # only a last line without its newline can be cut short
        records.append(parse_record(_decode(raw, where, last), where))
    return records


def read_local(path: str, what: str, hint: str) -> bytes:
    """The bytes of local file ``path`` (a ``what`` file), or `ConfigError` naming it: not found,
    a directory (with ``hint``), unreadable."""
    try:
        with open(path, "rb") as fh:
            return fh.read()
    except FileNotFoundError:
        raise ConfigError(f"{what} file not found: {path}") from None
    except IsADirectoryError:
        raise ConfigError(f"{what} path {path} is a directory; hint: {hint}") from None
    except OSError as exc:
        raise ConfigError(f"cannot read {what} file {path}: {exc.strerror or exc}") from None
