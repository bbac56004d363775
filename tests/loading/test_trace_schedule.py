"""Traces (format 3) across a batch-size ramp-up and a global-batch change at a resume.

The reference is always an uninterrupted traced run; the steps a record claims are checked
against independent arithmetic (Megatron-LM's ramp-up rule re-implemented here, and the
DP 8 -> 7 change written out by hand). Digests are bound to positions, so a run on other
ranks, micro batches or accumulation gives the same per-step digests.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import detdata
from detdata.base.errors import FormatError
from detdata.cli.main import main
from detdata.loading.loader import DataLoader
from detdata.loading.trace import compare, parse_record, read_trace, step_digests
from detdata.order.batches import BatchSchedule

N = 4_001
SEED = 23
START, INC, RAMP, GBS = 4, 4, 48, 16  # Megatron: --global-batch-size 16 --rampup-batch-size 4 4 48
STEPS = 12


def rows() -> detdata.ArrayDataset:
    """Row ``i`` is the 8 little-endian bytes of ``i``."""
    return detdata.ArrayDataset(
        {"row": np.arange(N, dtype="<u8").view(np.uint8).reshape(N, 8)}, name="ids"
    )


def megatron_steps(count: int) -> list[tuple[int, int]]:
    """``(first position, global batch)`` of steps ``0..count-1`` as Megatron-LM runs them."""
    per_increment = RAMP / ((GBS - START) // INC)
    out, consumed = [], 0
    for _ in range(count):
        batch = GBS if consumed > RAMP else START + int(consumed / per_increment) * INC
        out.append((consumed, batch))
        consumed += batch
    return out


EXPECTED = megatron_steps(STEPS)
TOTAL = sum(b for _, b in EXPECTED)


def ramp(
    trace: Path | None, rank: int = 0, world: int = 2, micro: int = 2, **kw: Any
) -> DataLoader:
    return DataLoader(
        rows(),
        global_batch_size=BatchSchedule.rampup(START, INC, RAMP, global_batch_size=GBS),
        micro_batch_size=micro,
        seed=SEED,
        options=detdata.LoaderOptions(
            rank=rank, world_size=world, total_samples=TOTAL, trace=trace
        ),
        **kw,
    )


def run(loaders: list[DataLoader], micro_batches: int | None = None) -> None:
    """Deliver ``micro_batches`` (None: all) on each of ``loaders`` (ranks in one process)."""
    for dl in loaders:
        it = iter(dl)
        n = 0
        while micro_batches is None or n < micro_batches:
            try:
                next(it)
            except StopIteration:
                break
            n += 1


def records(path: Path, world: int) -> list[Any]:
    """The records of every rank's file of a trace."""
    files = [path] + [Path(f"{path}.rank{r}") for r in range(1, world)]
    return [rec for f in files for rec in read_trace(f)]


def diff(a: Path, b: Path, capsys: pytest.CaptureFixture[str], *extra: str) -> tuple[int, str]:
    capsys.readouterr()
    code = main(["diff", str(a), str(b), *extra])
    return code, capsys.readouterr().out


def check_steps_by_megatron(recs: list[Any]) -> None:
    """Each record's step, step start and batch are Megatron's, and its positions lie inside."""
    for rec in recs:
        start, batch = EXPECTED[rec.step]
        assert (rec.step_at, rec.gbs) == (start, batch), rec
        assert start <= rec.runs[0][0] and rec.runs[-1][0] + rec.runs[-1][1] <= start + batch
        assert rec.micro == (rec.at - start) // (rec.next - rec.at)


@pytest.mark.parametrize("stop", [3, 7, 13, 25])  # micro batches per rank before the stop
def test_ramp_up_trace_stopped_and_resumed_equals_the_uninterrupted_trace(
    tmp_path: Path, stop: int, capsys: pytest.CaptureFixture[str]
) -> None:
    ref = tmp_path / "ref.jsonl"
    run([ramp(ref, r) for r in range(2)])
    one = tmp_path / "one.jsonl"
    run([ramp(one, 0, world=1, micro=4)])  # DP 1: other ranks and micro batch, same digests
    ref_recs = records(ref, 2)
    check_steps_by_megatron(ref_recs)
    assert sorted(step_digests(ref_recs)) == list(range(STEPS))

    trace = tmp_path / "resumed.jsonl"
    first = [ramp(trace, r) for r in range(2)]
    run(first, stop)
    state = json.loads(json.dumps(first[0].state_dict()))
    for dl in first:
        dl.close()
    again = [ramp(trace, r) for r in range(2)]  # fresh loaders appending to the same files
    for dl in again:
        dl.load_state_dict(state)
    run(again)
    for dl in again:
        dl.close()
    got = records(trace, 2)
    check_steps_by_megatron(got)
    assert step_digests(got) == step_digests(ref_recs) == step_digests(read_trace(one))
    assert compare(got, ref_recs).first is None
    assert compare(read_trace(one), got).first is None
    for suffix in ("", ".rank1"):
        code, out = diff(Path(f"{ref}{suffix}"), Path(f"{trace}{suffix}"), capsys)
        assert (code, out.strip()) == (0, f"identical: {STEPS} steps"), out


def test_dropped_cursor_on_a_ramp_is_reported_at_the_step_after_the_stop(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A run stopped after step 7 whose restart forgot load_state_dict (it delivers from
    position 0 again): the first divergence is step 8, where the ramp puts it (position 56,
    not 56 // 16 = 3)."""
    ref = tmp_path / "ref.jsonl"
    run([ramp(ref, 0, world=1, micro=4)])
    bad = tmp_path / "bad.jsonl"
    stop_step = 8
    run([ramp(bad, 0, world=1, micro=4)], EXPECTED[stop_step][0] // 4)
    run([ramp(bad, 0, world=1, micro=4)])  # the restart: no state loaded, runs to the end
    found = compare(read_trace(bad), read_trace(ref)).first
    assert found is not None and (found.step, found.kind) == (stop_step, "discontinuity")
    code, out = diff(ref, bad, capsys)
    assert code == 1
    assert out.splitlines()[0].startswith(
        f"first difference at step {stop_step} (rank 0): discontinuity in B"
    ), out
    code, out = diff(ref, bad, capsys, "--steps", f"0:{stop_step}")
    assert code == 0 and out.startswith(f"identical: {stop_step} steps"), out
    code, out = diff(ref, bad, capsys, "--steps", f"{stop_step}:{stop_step + 1}")
    assert code == 1 and f"at step {stop_step} " in out


# --------------------------------------------------------------- DP 8 -> DP 7
OLD, NEW, CHANGE, END = 16, 14, 5, 8  # global batch 16 on DP 8, 14 on DP 7 from step 5


def step_by_hand(position: int) -> tuple[int, int, int]:
    """``(step, its first position, its batch)`` of the DP 8 -> 7 run, written out."""
    if position < CHANGE * OLD:
        return position // OLD, position // OLD * OLD, OLD
    k = (position - CHANGE * OLD) // NEW
    return CHANGE + k, CHANGE * OLD + k * NEW, NEW


def test_elastic_dp8_to_dp7_trace_equals_the_uninterrupted_trace(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """DP 8 (micro 1 x 2 accumulation, batch 16) loses a rank at step 5 and resumes on DP 7
    (micro 2 x 1, batch 14), appending to the same trace: the trace equals a one-rank run whose
    schedule makes the same change, step by step, and diff finds nothing."""

    def loader(trace: Path, rank: int, world: int, gbs: int, micro: int) -> DataLoader:
        return DataLoader(
            rows(),
            global_batch_size=gbs,
            micro_batch_size=micro,
            seed=SEED,
            options=detdata.LoaderOptions(rank=rank, world_size=world, trace=trace),
        )

    trace = tmp_path / "elastic.jsonl"
    dp8 = [loader(trace, r, 8, OLD, 1) for r in range(8)]
    run(dp8, CHANGE * 2)
    state = dp8[0].state_dict()
    assert state["samples_consumed"] == CHANGE * OLD
    dp7 = [loader(trace, r, 7, NEW, 2) for r in range(7)]
    for dl in dp7:
        dl.load_state_dict(state, allow=("global_batch_size",))
        assert dl.step == CHANGE
    run(dp7, END - CHANGE)
    for dl in dp8 + dp7:
        dl.close()
    got = records(trace, 8)
    for rec in got:
        assert (rec.step, rec.step_at, rec.gbs) == step_by_hand(rec.at), rec

    ref = tmp_path / "ref.jsonl"
    run(
        [
            DataLoader(
                rows(),
                global_batch_size=BatchSchedule.by_steps([(0, OLD), (CHANGE, NEW)]),
                micro_batch_size=2,
                seed=SEED,
                options=detdata.LoaderOptions(
                    total_samples=CHANGE * OLD + (END - CHANGE) * NEW, trace=ref
                ),
            )
        ]
    )
    expected = step_digests(read_trace(ref))
    assert sorted(expected) == list(range(END))
    assert step_digests(got) == expected
    assert compare(got, read_trace(ref)).first is None
    for t, step in expected.items():
        start = step_by_hand(CHANGE * OLD + (t - CHANGE) * NEW if t >= CHANGE else t * OLD)[1]
        size = OLD if t < CHANGE else NEW
        assert step["positions"] == [[start, start + size]]

    # ``detdata diff`` reads one file: all ranks' files concatenated are one trace
    every = tmp_path / "every.jsonl"
    every.write_bytes(
        b"".join(Path(f"{trace}{'' if r == 0 else f'.rank{r}'}").read_bytes() for r in range(8))
    )
    code, out = diff(ref, every, capsys)
    assert (code, out.strip()) == (0, f"identical: {END} steps"), out
    code, out = diff(ref, trace, capsys, "--steps", f"{CHANGE}:")
    assert code == 1 and f"first difference at step {CHANGE} " in out  # rank 0 alone: a part


def test_format_2_records_are_still_read(tmp_path: Path) -> None:
    """A format 2 trace (no ``step_at``/``micro``, step = at // gbs) compares equal to the
    format 3 trace of the same run."""
    path = tmp_path / "t.jsonl"
    run(
        [
            DataLoader(
                rows(),
                global_batch_size=8,
                micro_batch_size=4,
                seed=SEED,
                options=detdata.LoaderOptions(trace=path),
            )
        ],
        10,
    )
    v2 = tmp_path / "v2.jsonl"
    lines = []
    for line in path.read_text().splitlines():
        doc = json.loads(line)
        assert doc["v"] == 3 and doc["step_at"] == doc["step"] * 8
        doc = {k: v for k, v in doc.items() if k not in ("step_at", "micro")} | {"v": 2}
        lines.append(json.dumps(doc))
    v2.write_text("\n".join(lines) + "\n")
    old, new = read_trace(v2), read_trace(path)
    assert [r.micro for r in old] == [r.micro for r in new] == [0, 1] * 5
    assert compare(old, new).first is None and step_digests(old) == step_digests(new)
    assert old[0].to_json()["v"] == 2 and "step_at" not in old[0].to_json()


@pytest.mark.parametrize(
    ("edit", "match"),
    [
        ({"step_at": 9}, "inconsistent fields: step_at=9"),
        ({"micro": 1}, "micro=1"),
        ({"gbs": 2}, "next <= step_at \\+ gbs"),
        ({"step_at": None}, "field 'step_at' must be an integer"),
        ({"v": 4}, "reads versions \\[2, 3\\]"),
    ],
)
def test_inconsistent_format_3_records_are_refused(
    tmp_path: Path, edit: dict[str, Any], match: str
) -> None:
    path = tmp_path / "t.jsonl"
    run(
        [
            DataLoader(
                rows(),
                global_batch_size=8,
                micro_batch_size=4,
                seed=SEED,
                options=detdata.LoaderOptions(trace=path),
            )
        ],
        1,
    )
    doc = json.loads(path.read_text()) | edit
    with pytest.raises(FormatError, match=match):
        parse_record(doc, "t.jsonl:1")
