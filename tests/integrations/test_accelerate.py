"""accelerate 1.15: ``prepare`` + ``save_state`` / ``load_state`` mid-epoch, exact at 2->2 and 2->1.

Each run is a real accelerate training run under ``python -m torch.distributed.run`` (CPU,
gloo; ``accelerate_script.py``). Two data paths train side by side, each its own tiny
model: a `detdata.DataLoader` registered with ``accelerator.register_for_checkpointing``,
and a torch ``DataLoader`` over a plain map-style dataset whose ``batch_sampler`` is
``DeterministicBatchSampler.sharded_by_framework(...)``, prepared by accelerate
(``split_batches=True, use_stateful_dataloader=True``). Every training step records a digest
of every row it was handed. The first run (2 processes) saves at global step 3 and stops;
it is resumed at 2 processes and at 1 and runs to step 6. The 40-row dataset ends its
first epoch inside step 2 and its second inside step 5.

The reference is an uninterrupted plain `detdata.DataLoader` at one process with the whole
global batch, iterated here: the rows of each global step, in position order. A run's rows
of step ``t`` are its micro batches of step ``t`` ordered by (micro step, process).

Also here, in-process: accelerate's own ``BatchSamplerShard`` over detdata's samplers (the
rows each process gets, and the refusals), with no process group.

Covers: detdata/integrations/watch.py, detdata/loading/frameworks.py.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from collections import defaultdict
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from accelerate.data_loader import BatchSamplerShard

import detdata
from detdata.loading.sampler import DeterministicBatchSampler, FrameworkBatchSampler
from tests.integrations.accelerate_script import make_dataset, row_digests
from tests.resume_checker import take

SCRIPT = Path(__file__).with_name("accelerate_script.py")
ROOT = Path(__file__).resolve().parents[2]
GLOBAL, N, SEED, STOP, LAST = 16, 40, 3, 3, 6
PATHS = ("loader", "sampler")
# world 2: the loader's micro batch 4 per process (2 micro steps a step); the sampler's item
# is one micro step of both processes (8 rows, 4 each). ``workers``: the torch DataLoader's
# (torchdata's StatefulDataLoader refuses a resume at another num_workers, so it stays 2);
# ``loader_workers``: the detdata.DataLoader's, whose state does not depend on them.
FIRST: dict[str, Any] = {"world": 2, "micro": 4, "batch": 8, "workers": 2, "loader_workers": 0}
RESUMED: dict[str, dict[str, Any]] = {
    "2->2": {"world": 2, "micro": 4, "batch": 8, "workers": 2, "loader_workers": 2},
    # one process: the loader's micro batch doubles, the sampler's item stays a micro step
    "2->1": {"world": 1, "micro": 8, "batch": 8, "workers": 2, "loader_workers": 0},
}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _launch(cfg: dict[str, Any], out: Path) -> list[dict[str, Any]]:
    """One accelerate run under torchrun; every line every process wrote."""
    world = cfg.pop("world")
    cfg = {"global_batch": GLOBAL, "seed": SEED, "n": N, "out": str(out), **cfg}
    env = {
        **os.environ,
        "OMP_NUM_THREADS": "1",
        "PYTHONPATH": os.pathsep.join(p for p in (os.environ.get("PYTHONPATH"), str(ROOT)) if p),
    }
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(world)]
    command += ["--master-addr", "127.0.0.1", "--master-port", str(_free_port())]
    done = subprocess.run(
        [*command, str(SCRIPT), json.dumps(cfg)],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-6000:]
    lines = []
    for rank in range(world):
        text = (out / f"rank{rank}.jsonl").read_text(encoding="utf-8")
        lines += [json.loads(line) for line in text.splitlines()]
    ends = [line for line in lines if "end" in line]
    assert [e["world"] for e in ends] == [world] * world
    return lines


def _steps(lines: list[dict[str, Any]], path: str) -> dict[int, list[str]]:
    """The rows each global step of ``path`` was handed, ordered by (micro step, process)."""
    records = sorted(
        (r for r in lines if r.get("path") == path),
        key=lambda r: (r["step"], r["micro"], r["rank"]),
    )
    steps: dict[int, list[str]] = defaultdict(list)
    for r in records:
        steps[r["step"]] += r["rows"]
    return dict(steps)


def _micro_rows(lines: list[dict[str, Any]], path: str) -> set[int]:
    return {len(r["rows"]) for r in lines if r.get("path") == path}


@pytest.fixture(scope="module")
def reference() -> list[list[str]]:
    """Rows of each global step of an uninterrupted plain detdata.DataLoader (one process)."""
    plain = detdata.DataLoader(make_dataset(N), global_batch_size=GLOBAL, seed=SEED)
    return [row_digests(batch) for batch in take(plain, LAST)]


@pytest.fixture(scope="module")
def first_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[list[dict[str, Any]], Path]:
    """2 processes, ``save_state`` after step 3, stopped; probes the refusals too."""
    root = tmp_path_factory.mktemp("accelerate-first")
    cfg = {**FIRST, "resume": False, "start": 0, "stop": STOP, "last": LAST, "probe": True}
    lines = _launch({**cfg, "ckpt": str(root / "ckpt")}, root / "out")
    return lines, root / "ckpt"


@pytest.mark.multiproc
@pytest.mark.slow
def test_first_run_trains_the_reference_steps_and_refuses_double_sharding(
    first_run: tuple[list[dict[str, Any]], Path], reference: list[list[str]]
) -> None:
    lines, ckpt = first_run
    for path in PATHS:
        assert _steps(lines, path) == dict(enumerate(reference[:STOP])), path
        assert _micro_rows(lines, path) == {4}  # each process's micro batch: 4 rows
    assert {line["end"] for line in lines if "end" in line} == {STOP}
    # the loader is saved only because it is registered; the sampler's position by accelerate
    assert {"custom_checkpoint_0.pkl", "dl_state_dict.bin"} <= {p.name for p in ckpt.iterdir()}
    probes = {r: line["probes"] for r, line in enumerate(x for x in lines if "probes" in x)}
    assert sorted(probes) == [0, 1]
    for rank, found in probes.items():
        assert "BatchSamplerShard deals them to 2 processes again" in found["rank_sampler"]
        assert "(split_batches=False)" in found["no_split"]
        assert "with nobody splitting them" in found["unsplit"]
        # a sampler built before the process group reads its rank's slice once it exists
        ids, bound_rank, bound_world = found["early"]
        expected = [int(row.split(":")[0]) for row in reference[0][4 * rank : 4 * rank + 4]]
        assert (ids, bound_rank, bound_world) == (expected, rank, 2)


@pytest.mark.multiproc
@pytest.mark.slow
@pytest.mark.parametrize("pair", sorted(RESUMED))
def test_save_state_load_state_resume_is_exact(
    pair: str,
    first_run: tuple[list[dict[str, Any]], Path],
    reference: list[list[str]],
    tmp_path: Path,
) -> None:
    first, ckpt = first_run
    cfg = {**RESUMED[pair], "resume": True, "start": STOP, "last": LAST, "ckpt": str(ckpt)}
    world = cfg["world"]
    resumed = _launch(cfg, tmp_path / "out")
    assert {line["end"] for line in resumed if "end" in line} == {LAST}
    for path in PATHS:
        # the resumed run starts at step 3 and trains exactly the reference's steps 3..5
        assert _steps(resumed, path) == {t: reference[t] for t in range(STOP, LAST)}, path
        joined = {**_steps(first, path), **_steps(resumed, path)}
        assert joined == dict(enumerate(reference)), path
    assert _micro_rows(resumed, "loader") == {RESUMED[pair]["micro"]}
    assert _micro_rows(resumed, "sampler") == {RESUMED[pair]["batch"] // world}


# ------------------------------------------------ in-process: accelerate's shard wrapper
def _first(sampler: Any, count: int) -> list[Any]:
    return [b for _, b in zip(range(count), sampler, strict=False)]


def _dealt(sampler: Any, world: int, split: bool) -> list[list[list[int]]]:
    """What accelerate's BatchSamplerShard hands each process, as lists of ids."""
    return [
        [list(b) for _, b in zip(range(6), shard, strict=False)]
        for shard in (
            BatchSamplerShard(sampler, num_processes=world, process_index=p, split_batches=split)
            for p in range(world)
        )
    ]


def test_split_framework_sampler_gives_each_process_detdata_rank_slice() -> None:
    ds = detdata.ArrayDataset({"id": np.arange(300)})
    sampler = DeterministicBatchSampler.sharded_by_framework(
        300, global_batch_size=24, batch_size=12, seed=5
    )
    assert isinstance(sampler, FrameworkBatchSampler)
    assert sampler.batch_size == 12 and sampler.drop_last and sampler.sampler is None
    for world in (1, 2, 3):
        got = _dealt(sampler, world, split=True)
        for rank in range(world):
            own = detdata.DataLoader(
                ds,
                global_batch_size=24,
                micro_batch_size=12 // world,
                seed=5,
                options=detdata.LoaderOptions(rank=rank, world_size=world),
            )
            assert got[rank] == [b["id"].tolist() for b in take(own, 6)], (world, rank)


def test_framework_sampler_pass_len_and_mixture() -> None:
    bounded = FrameworkBatchSampler(50, global_batch_size=8, batch_size=4, total_samples=48)
    assert len(bounded) == 12 and len(list(bounded)) == 12
    assert list(bounded) == list(bounded)  # each iter() is the run from its start
    assert len(FrameworkBatchSampler(50, global_batch_size=8, batch_size=4)) == (1 << 62) // 4
    bounded.set_epoch(3)  # no-op
    unbounded = FrameworkBatchSampler(50, global_batch_size=8, batch_size=4)
    assert next(iter(bounded)) == next(iter(unbounded))
    ds = detdata.ArrayDataset({"id": np.arange(50)})
    plain = detdata.DataLoader(
        ds, global_batch_size=8, micro_batch_size=4, options=detdata.LoaderOptions(total_samples=48)
    )
    assert list(bounded) == [b["id"].tolist() for b in plain]
    sources = {
        "a": detdata.ArrayDataset({"x": np.arange(50)}),
        "b": detdata.ArrayDataset({"x": np.arange(30) + 1000}),
    }
    mix = detdata.Mixture(sources, {"a": "0.6", "b": "0.4"}, seed=4)
    items = _first(FrameworkBatchSampler(mix, global_batch_size=8, batch_size=4), 4)
    loader = detdata.DataLoader(mix, global_batch_size=8, micro_batch_size=4)
    for item, batch in zip(items, take(loader, 4), strict=True):
        assert [i if s == "a" else i + 1000 for s, i in item] == batch["x"].tolist()


def test_framework_sampler_refuses_to_be_dealt_whole() -> None:
    sampler = FrameworkBatchSampler(300, global_batch_size=24, batch_size=12, seed=5)
    with pytest.raises(detdata.ConfigError, match=r"\(split_batches=False\)"):
        _dealt(sampler, 2, split=False)


def test_rank_sampler_refuses_a_second_sharding() -> None:
    sampler = DeterministicBatchSampler(300, global_batch_size=24, micro_batch_size=6, seed=5)
    with pytest.raises(detdata.ConfigError, match="deals them to 2 processes again") as info:
        _dealt(sampler, 2, split=False)
    assert "sharded_by_framework" in str(info.value)
    with pytest.raises(detdata.ConfigError, match="again"):
        _dealt(sampler, 2, split=True)
    assert sampler.samples_consumed == 0  # nothing was counted


# ------------------------------------------------ what the trainer does not checkpoint
ONE: dict[str, Any] = {"world": 1, "micro": 8, "batch": 8, "workers": 0, "loader_workers": 0}


def _stop_and_resume(tmp_path: Path, **left_out: bool) -> list[dict[str, Any]]:
    """One process: ``save_state`` after step 3 and stop, then a fresh process that calls
    ``load_state`` and starts its loop, with the same settings (``left_out``: the one line
    or setting a path needs, left out of both runs). The resumed run's lines."""
    ckpt = str(tmp_path / "ckpt")
    first = {**ONE, **left_out, "resume": False, "start": 0, "stop": STOP, "last": LAST}
    _launch({**first, "ckpt": ckpt}, tmp_path / "first")
    resumed = {**ONE, **left_out, "resume": True, "start": STOP, "last": LAST, "ckpt": ckpt}
    return _launch(resumed, tmp_path / "resumed")


@pytest.mark.multiproc
@pytest.mark.slow  # accelerate launches: a framework run, like the other resumes
def test_a_loader_accelerate_does_not_checkpoint_is_refused_at_its_first_batch(
    tmp_path: Path,
) -> None:
    """The README's one line left out (no ``register_for_checkpointing(loader)``): accelerate
    saves no loader state, ``load_state`` resumes the model and optimizer, and the loader
    would start the run over at position 0. It raises at its first batch, naming the line;
    no micro batch reaches the model (the sampler path, set up right, is not refused)."""
    lines = _stop_and_resume(tmp_path, register=False)
    (refused,) = [line for line in lines if "refused" in line]
    assert refused["where"] == "first batch"
    assert "starts at position 0" in refused["refused"]
    assert "accelerator.register_for_checkpointing(loader)" in refused["refused"]
    assert [line for line in lines if "rows" in line] == []


@pytest.mark.multiproc
@pytest.mark.slow  # accelerate launches: a framework run, like the other resumes
def test_a_prepared_detdata_sampler_without_a_stateful_loader_is_refused_at_load_state(
    tmp_path: Path,
) -> None:
    """The sampler path without ``use_stateful_dataloader=True``: accelerate saves no
    position for the prepared DataLoader and would start its batch sampler over. Refused by
    ``load_state`` (before the first batch), naming the setting."""
    lines = _stop_and_resume(tmp_path, stateful=False)
    (refused,) = [line for line in lines if "refused" in line]
    assert refused["where"] == "load_state"
    assert "FrameworkBatchSampler" in refused["refused"]
    assert "use_stateful_dataloader=True" in refused["refused"]
    assert [line for line in lines if "rows" in line] == []


@pytest.mark.multiproc
@pytest.mark.slow
def test_registered_at_one_process_resumes_exactly(
    tmp_path: Path, reference: list[list[str]]
) -> None:
    """The README's setup at 1 -> 1 (the watch of ``load_state`` in place): every row of every
    micro batch of both paths is the uninterrupted plain loader's, steps 3-5 after the resume."""
    lines = _stop_and_resume(tmp_path)
    assert [line for line in lines if "refused" in line] == []
    for path in PATHS:
        assert _steps(lines, path) == {t: reference[t] for t in range(STOP, LAST)}, path
    assert _micro_rows(lines, "loader") == {8}


_IMPORTED_FIRST = """
import sys
import torch
from accelerate import Accelerator  # imported before detdata, as many scripts do
import detdata
from tests.integrations.accelerate_script import make_dataset

accelerator = Accelerator(cpu=True)
model = accelerator.prepare(torch.nn.Linear(4, 1))
accelerator.save_state(sys.argv[1])  # a run that registered no loader
accelerator.load_state(sys.argv[1])  # resumed before any detdata loader exists
loader = detdata.DataLoader(make_dataset(40), global_batch_size=16, seed=3)
try:
    next(iter(loader))
except detdata.StateError as exc:
    print("refused:", exc)
"""


def _one_process(script: str, tmp_path: Path) -> subprocess.CompletedProcess[str]:
    """``script`` run as one plain process (no launcher), its checkpoint folder under
    ``tmp_path``; it must exit 0."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    env["PYTHONPATH"] = os.pathsep.join(p for p in (os.environ.get("PYTHONPATH"), str(ROOT)) if p)
    done = subprocess.run(
        [sys.executable, "-c", script, str(tmp_path / "ckpt")],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-6000:]
    return done


def test_accelerate_imported_before_detdata_is_watched_from_the_import(tmp_path: Path) -> None:
    """``from accelerate import Accelerator`` before ``import detdata``, and ``load_state``
    before the loader is built (one process, no launcher): the watch started at ``import
    detdata``, so the loader that starts at position 0 is refused at its first batch."""
    done = _one_process(_IMPORTED_FIRST, tmp_path)
    assert "refused: accelerator.load_state resumed the model" in done.stdout
    assert "accelerator.register_for_checkpointing(loader)" in done.stdout


_INTEGRATION_FIRST = _IMPORTED_FIRST.replace(
    "from accelerate import Accelerator  # imported before detdata, as many scripts do\n"
    "import detdata\n",
    "import detdata\nimport detdata.integrations.accelerate  # the integration module first\n"
    "from accelerate import Accelerator\n",
)


def test_the_integration_module_imported_before_accelerate_still_watches_it(
    tmp_path: Path,
) -> None:
    """``import detdata.integrations.accelerate`` before accelerate itself (its watch then starts
    when accelerate has finished importing, not while the integration module is half made):
    no "could not start the watch" warning, and a ``load_state`` before any loader is built is
    seen, so the loader that starts at position 0 is refused at its first batch."""
    assert _INTEGRATION_FIRST != _IMPORTED_FIRST
    done = _one_process(_INTEGRATION_FIRST, tmp_path)
    assert "could not start the watch" not in done.stderr, done.stderr[-3000:]
    assert "refused: accelerator.load_state resumed the model" in done.stdout


# ------------------------------------------------ accelerate's own gradient accumulation
STEPS_SCRIPT = Path(__file__).with_name("accelerate_steps_script.py")
STEPS: dict[str, Any] = {"global_batch": 8, "n": N, "seed": SEED}


def _steps_run(cfg: dict[str, Any], out: Path, world: int = 1) -> list[dict[str, Any]]:
    """One run of ``accelerate_steps_script.py`` (``world`` processes under torchrun, or one
    plain process); every line every process wrote."""
    cfg = {**STEPS, "out": str(out), **cfg}
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    env["PYTHONPATH"] = os.pathsep.join(p for p in (os.environ.get("PYTHONPATH"), str(ROOT)) if p)
    command = [sys.executable]
    if world > 1:
        command += ["-m", "torch.distributed.run", "--nproc-per-node", str(world)]
        command += ["--master-addr", "127.0.0.1", "--master-port", str(_free_port())]
    done = subprocess.run(
        [*command, str(STEPS_SCRIPT), json.dumps(cfg)],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-6000:]
    lines = []
    for rank in range(world):
        text = (out / f"rank{rank}.jsonl").read_text(encoding="utf-8")
        lines += [json.loads(line) for line in text.splitlines()]
    return lines


def _rank_steps(lines: list[dict[str, Any]], rank: int) -> list[tuple[int, list[str]]]:
    """(optimizer step, rows) of each micro batch process ``rank`` was handed, in order."""
    return [(r["step"], r["rows"]) for r in lines if "rows" in r and r["rank"] == rank]


def _layout_reference(world: int, micro: int, rank: int, steps: range) -> list[Any]:
    """(step, rows) of each micro batch of an uninterrupted plain loader at this layout."""
    options = detdata.LoaderOptions(rank=rank, world_size=world)
    plain = detdata.DataLoader(
        make_dataset(N), global_batch_size=8, micro_batch_size=micro, seed=SEED, options=options
    )
    per = 8 // (micro * world)
    batches = [row_digests(b) for b in take(plain, steps.stop * per)]
    return [(t, batches[t * per + j]) for t in steps for j in range(per)]


@pytest.mark.multiproc
@pytest.mark.slow  # accelerate launches: a framework run, like the other resumes
def test_accumulation_changed_at_a_resume_keeps_accelerate_on_detdata_steps(
    tmp_path: Path,
) -> None:
    """``Accelerator(gradient_accumulation_steps=...)`` with ``accumulate()``, the loader
    registered: 2 processes x micro 2 x accumulation 2 save at optimizer step 3; resumed as 1
    process x micro 2 x accumulation 4 (8 samples a step either way). ``load_state`` restores
    ``accelerator.step`` counted at the old layout (6 micro steps; 6 % 4 would make the first
    resumed step 2 micro batches and every later one straddle two of detdata's); the watch sets
    it to this layout's count. Every optimizer step, before and after the resume, holds
    exactly an uninterrupted plain loader's step: its rows over all processes, and each
    process's micro batches in order."""
    ckpt = str(tmp_path / "ckpt")
    first = {"micro": 2, "accum": 2, "resume": False, "start": 0, "stop": STOP, "last": LAST}
    before = _steps_run({**first, "ckpt": ckpt}, tmp_path / "first", world=2)
    again = {"micro": 2, "accum": 4, "resume": True, "start": STOP, "last": LAST, "ckpt": ckpt}
    after = _steps_run(again, tmp_path / "again")

    for rank in range(2):
        assert _rank_steps(before, rank) == _layout_reference(2, 2, rank, range(STOP))
    assert _rank_steps(after, 0) == _layout_reference(1, 2, 0, range(STOP, LAST))
    plain = detdata.DataLoader(make_dataset(N), global_batch_size=8, seed=SEED)
    want = {t: sorted(rows) for t, rows in enumerate(row_digests(b) for b in take(plain, LAST))}
    stitched: dict[int, list[str]] = defaultdict(list)
    for record in [r for r in before if "rows" in r] + [r for r in after if "rows" in r]:
        stitched[record["step"]] += record["rows"]
    assert {t: sorted(rows) for t, rows in stitched.items()} == want
    assert [line["end"] for line in after if "end" in line] == [LAST]


@pytest.mark.multiproc
def test_a_gradient_accumulation_that_disagrees_is_refused_before_the_first_batch(
    tmp_path: Path,
) -> None:
    """``gradient_accumulation_steps=2`` x micro 2 x 1 process is 4 samples a step, the
    loader's global batch is 8: ``register_for_checkpointing`` refuses it, naming the
    ``gradient_accumulation_steps`` that agrees; no micro batch is read (before, accelerate
    stepped every 4 rows silently)."""
    cfg = {"micro": 2, "accum": 2, "resume": False, "start": 0, "stop": STOP, "last": LAST}
    lines = _steps_run({**cfg, "ckpt": str(tmp_path / "ckpt")}, tmp_path / "out")
    (refused,) = [line for line in lines if "refused" in line]
    assert refused["where"] == "register"
    assert "Accelerator(gradient_accumulation_steps=4)" in refused["refused"]
    assert [line for line in lines if "rows" in line] == []


def _case(tmp_path: Path, case: str) -> dict[str, Any]:
    """One case of the watch (``accelerate_steps_script.py``, one process)."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    env["PYTHONPATH"] = os.pathsep.join(p for p in (os.environ.get("PYTHONPATH"), str(ROOT)) if p)
    cfg = json.dumps({"case": case, "dir": str(tmp_path / "ckpt")})
    done = subprocess.run(
        [sys.executable, str(STEPS_SCRIPT), cfg],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-6000:]
    result: dict[str, Any] = json.loads(done.stdout.splitlines()[-1])
    return result


@pytest.mark.multiproc
@pytest.mark.parametrize(
    ("case", "refused"),
    [
        ("teacher", None),
        ("sampler_eval_declared", None),
        ("sampler_eval", "it is not registered for checkpointing"),
        ("registered_late", "registered for checkpointing after accelerator.load_state"),
        ("built_first", "it is not registered for checkpointing"),
    ],
)
def test_the_load_state_watch_refuses_only_a_loader_its_accelerator_left_behind(
    tmp_path: Path, case: str, refused: str | None
) -> None:
    """A `detdata.DataLoader` at position 0 after some ``Accelerator.load_state`` in the
    process. Not refused (each trains the uninterrupted plain loader's first rows): a fresh
    run's training loader registered with its own Accelerator while a teacher's Accelerator
    loads the teacher's checkpoint (before, refused); an evaluation loader beside the
    torch-sampler path declared ``ResumePolicy(fresh_each_run=True)``. Refused at its first
    batch, naming the line and the declaration: the same loader undeclared (it could be that
    Accelerator's training loader left out of its checkpoint); a loader registered only after
    its Accelerator's ``load_state``, and one built before ``import accelerate``, not
    registered (both replayed the run's first samples before; the watch now starts when
    accelerate is imported)."""
    result = _case(tmp_path, case)
    if refused is None:
        assert result["refused"] is None
        plain = detdata.DataLoader(make_dataset(N), global_batch_size=GLOBAL // 2, seed=SEED)
        assert result["rows"] == [row_digests(batch) for batch in take(plain, 2)]
    else:
        assert refused in result["refused"]
        assert "accelerator.register_for_checkpointing(loader)" in result["refused"]
        assert "ResumePolicy(fresh_each_run=True)" in result["refused"]
        assert result["rows"] is None


def test_fresh_each_run_is_a_declared_bool() -> None:
    """The evaluation loader's declaration is a plain bool on `ResumePolicy`; anything else is
    a `ConfigError` naming the field (a string "no" must not count as a declaration)."""
    assert detdata.ResumePolicy().fresh_each_run is False
    assert detdata.ResumePolicy(fresh_each_run=True).fresh_each_run is True
    with pytest.raises(detdata.ConfigError, match=r"ResumePolicy\.fresh_each_run must be"):
        detdata.ResumePolicy(fresh_each_run="no")  # type: ignore[arg-type]
