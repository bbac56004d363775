"""PyTorch Lightning 2.6 ``Trainer.fit`` over a `detdata.DataLoader`: stop, resume, exact.

Each run is a real ``Trainer.fit`` in a fresh process (``lightning_script.py``; DDP runs are
``strategy="ddp"`` on gloo, CPU, the script re-launched by Lightning for rank 1), with
``ModelCheckpoint(every_n_train_steps=3)`` and a resume through ``fit(ckpt_path=...)`` (so
Lightning's ``torch.load`` default, ``weights_only=True``, loads the checkpoint). Every
``training_step`` records a digest of every row it was handed. The reference is an
uninterrupted plain `detdata.DataLoader`, iterated here by hand: at one rank with the whole
global batch (the rows of each global step), and at the run's own rank / world size / micro
batch (the rows of each micro batch, in order).

Two first runs (world 1, stopped by ``max_steps=4``; world 2, stopped by ``max_epochs=1`` at the
end of its 4-step epoch; both checkpoint at step 3) are each resumed twice, at world 1 and
world 2, so the four pairs 1->1, 1->2, 2->2, 2->1 cost six runs. Between them they cover
``num_workers`` 0 and 2, the loader built before ``fit`` (passed as ``train_dataloaders=``, or
returned by ``train_dataloader()``) or inside ``train_dataloader()``, gradient accumulation,
``total_samples`` (the resumed run ends its epoch where an uninterrupted one does), an epoch
boundary crossed after the resume, and (a seventh run) a resume from Lightning's default
end-of-epoch checkpoint. Each process is forked from a warm interpreter that imported
Lightning once (`Launcher`, tests/forkserver.py): importing it took most of a run's time.

The script imports ``pytorch_lightning`` unless a config names the unified package
(``"package": "lightning.pytorch"``, its own copy of Lightning's classes, watched as well):
the refused batch settings and the monitored checkpoint inside accumulation run with both.
"""

from __future__ import annotations

import functools
import json
import os
import subprocess
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

import detdata
from tests.forkserver import Forkserver
from tests.integrations.lightning_script import make_dataset, row_digests

pytestmark = [pytest.mark.multiproc, pytest.mark.slow]

SCRIPT = Path(__file__).with_name("lightning_script.py")
ROOT = Path(__file__).resolve().parents[2]
GLOBAL, N, SEED = 8, 32, 3  # 32 rows: one dataset epoch is 4 global steps
CKPT_STEP, FIRST_STOP, LAST = 3, 4, 6  # checkpoint at step 3, first run stops after step 4

# The first runs, checkpointed every 3 train steps, trained steps 0-3. Gradient accumulation
# stays the same across a resume (README: keep accumulate_grad_batches, change micro_batch_size),
# except in "1->1 accum 4": micro 4 x accumulation 2 resumed as micro 2 x accumulation 4
# (Lightning counts micro batches: detdata recounts its counters at the new accumulation).
FIRST: dict[str, dict[str, Any]] = {
    # world 1, inline reads, built inside train_dataloader(), total_samples = 6 steps (one
    # epoch); stopped by max_steps=4
    "w1": dict(devices=1, micro=4, accum=2, workers=0, source="hook", total_samples=48)
    | {"max_steps": FIRST_STOP, "max_epochs": None},
    # world 2, two worker processes per rank, built before fit and passed to fit(); stopped
    # by max_epochs=1 at the end of its epoch (one pass over the 32 rows: 4 steps), so it
    # also writes an end-of-epoch checkpoint (Lightning's default one)
    "w2": dict(devices=2, micro=4, accum=1, workers=2, source="arg", total_samples=None)
    | {"max_steps": -1, "max_epochs": 1},
}
# The resumed runs: (first run, settings). With total_samples they run to the end of the
# epoch (max_epochs=1) and must stop by themselves after step 6; otherwise max_steps=6.
RESUMED: dict[str, tuple[str, dict[str, Any]]] = {
    "1->1": ("w1", dict(devices=1, micro=4, accum=2, workers=2, source="module")),
    "1->2": ("w1", dict(devices=2, micro=2, accum=2, workers=0, source="arg")),
    "2->2": ("w2", dict(devices=2, micro=4, accum=1, workers=2, source="hook")),
    "2->1": ("w2", dict(devices=1, micro=8, accum=1, workers=0, source="arg")),
    "1->1 accum 4": ("w1", dict(devices=1, micro=2, accum=4, workers=0, source="arg")),
}


class Launcher:
    """Starts each run as a fresh process forked from a warm interpreter that imported the
    run's Lightning package once (tests/forkserver.py: a new pid, environment and working
    directory, the script as ``__main__``; DDP's rank 1 is Lightning's own re-launch of the
    script). One server per package, so that a ``lightning.pytorch`` run never sees
    ``pytorch_lightning`` imported."""

    def __init__(self) -> None:
        self._servers: dict[str, Forkserver] = {}

    def run(self, cfg: dict[str, Any], out: Path) -> subprocess.CompletedProcess[str]:
        env = {
            **os.environ,
            "OMP_NUM_THREADS": "1",
            "MASTER_ADDR": "127.0.0.1",
            "PYTHONPATH": os.pathsep.join(
                p for p in (os.environ.get("PYTHONPATH"), str(ROOT)) if p
            ),
        }
        env.pop("MASTER_PORT", None)  # Lightning picks a free port for its own ranks
        package = cfg.get("package", "pytorch_lightning")
        if package not in self._servers:
            # in the script's order: detdata first, so that its watch sees Lightning's import
            # (detdata/integrations/watch.py), then Lightning (and torch with it)
            self._servers[package] = Forkserver(["numpy", "detdata", package, "torch"], env)
        server = self._servers[package]
        return server.run(SCRIPT, [json.dumps(cfg)], cwd=out, env=env, timeout=300)

    def close(self) -> None:
        for server in self._servers.values():
            server.close()


@pytest.fixture(scope="module")
def launcher() -> Iterator[Launcher]:
    started = Launcher()
    yield started
    started.close()


def _run(
    launcher: Launcher,
    cfg: dict[str, Any],
    out: Path,
    *,
    fails: str | tuple[str, ...] | None = None,
) -> list[dict[str, Any]]:
    """One ``Trainer.fit`` in a fresh process; the trace of every rank, by rank. With
    ``fails``: the process must fail with (each of) ``fails`` in its stderr."""
    out.mkdir(parents=True, exist_ok=True)
    cfg = {"global_batch": GLOBAL, "seed": SEED, "n": N, "out": str(out), **cfg}
    done = launcher.run(cfg, out)
    if fails is not None:
        wanted = (fails,) if isinstance(fails, str) else fails
        assert done.returncode != 0, done.stderr[-6000:]
        assert all(w in done.stderr for w in wanted), done.stderr[-6000:]
        return [
            json.loads(p.read_text()) for p in sorted(out.glob(f"trace-{cfg['tag']}-rank*.json"))
        ]
    assert done.returncode == 0, f"{cfg}\n{done.stdout[-3000:]}\n{done.stderr[-6000:]}"
    traces = sorted(out.glob(f"trace-{cfg['tag']}-rank*.json"))
    assert [p.name for p in traces] == [
        f"trace-{cfg['tag']}-rank{r}.json" for r in range(cfg["devices"])
    ]
    return [json.loads(p.read_text()) for p in traces]


class Runs:
    """The runs, each made once per test session and shared by the tests that read it."""

    def __init__(self, root: Path, launcher: Launcher) -> None:
        self.root = root
        self.launcher = launcher

    @functools.cache  # noqa: B019 (one instance per session)
    def first(self, name: str) -> list[dict[str, Any]]:
        cfg = {**FIRST[name], "tag": name, "ckpt_dir": str(self.root / name / "ckpt")}
        return _run(self.launcher, cfg | {"every": CKPT_STEP, "resume": None}, self.root / name)

    def checkpoint(self, name: str, file: str = f"step={CKPT_STEP}.ckpt") -> Path:
        self.first(name)
        return self.root / name / "ckpt" / file

    @functools.cache  # noqa: B019
    def resumed(self, pair: str) -> list[dict[str, Any]]:
        first, settings = RESUMED[pair]
        total = FIRST[first]["total_samples"]
        tag = pair.replace("->", "to").replace(" ", "-")
        cfg = {
            **settings,
            "tag": tag,
            "total_samples": total,
            "ckpt_dir": str(self.root / tag / "ckpt"),
            "max_steps": -1 if total else LAST,
            "max_epochs": 1 if total else None,
            "every": CKPT_STEP,
            "resume": str(self.checkpoint(first)),
        }
        return _run(self.launcher, cfg, self.root / tag)


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory, launcher: Launcher) -> Runs:
    return Runs(tmp_path_factory.mktemp("lightning"), launcher)


def reference(steps: int, *, world: int = 1, micro: int = GLOBAL, rank: int = 0) -> list[Any]:
    """Rows of the first ``steps`` global steps of an uninterrupted plain `detdata.DataLoader`
    at this rank / world / micro batch: per step, the row digests of each of its micro
    batches on this rank, in order."""
    loader = detdata.DataLoader(
        make_dataset(N),
        global_batch_size=GLOBAL,
        micro_batch_size=micro,
        seed=SEED,
        options=detdata.LoaderOptions(rank=rank, world_size=world),
    )
    per_step = GLOBAL // (micro * world)
    batches = iter(loader)
    out = [[row_digests(next(batches)) for _ in range(per_step)] for _ in range(steps)]
    loader.close()
    return out


def per_step(traces: list[dict[str, Any]]) -> dict[int, Counter[str]]:
    """Rows seen by the training_step of all ranks, assembled per global step."""
    steps: dict[int, Counter[str]] = {}
    for trace in traces:
        for record in trace["records"]:
            steps.setdefault(record["step"], Counter()).update(record["rows"])
    return steps


def check_ranks_in_order(traces: list[dict[str, Any]], cfg: dict[str, Any], steps: range) -> None:
    """Each rank's micro batches, in the order training_step saw them, are those of the
    same layout's uninterrupted loader for these steps."""
    for rank, trace in enumerate(traces):
        ref = reference(steps.stop, world=cfg["devices"], micro=cfg["micro"], rank=rank)
        seen = [(r["step"], r["rows"]) for r in trace["records"]]
        assert seen == [(s, rows) for s in steps for rows in ref[s]], f"rank {rank}"


def check_epochs(
    traces: list[dict[str, Any]], accum: int, steps_per_epoch: int, steps: range
) -> None:
    """The epoch and batch_idx Lightning hands training_step are an uninterrupted run's."""
    want = [
        (s, s // steps_per_epoch, (s % steps_per_epoch) * accum + j)
        for s in steps
        for j in range(accum)
    ]
    for rank, trace in enumerate(traces):
        seen = [(r["step"], r["epoch"], r["batch_idx"]) for r in trace["records"]]
        assert seen == want, f"rank {rank}"


@pytest.mark.parametrize("pair", list(RESUMED))
def test_stop_and_resume_trains_the_rows_of_an_uninterrupted_loader(runs: Runs, pair: str) -> None:
    """Checkpoint at step 3 (every_n_train_steps); the first run goes on to step 4 and stops;
    the resumed run (fresh processes, ckpt_path=, the same or another world size) trains
    steps 3, 4, 5: every global step's rows, over all ranks, are the uninterrupted loader's,
    none repeated and none skipped at the resume (the fetcher does not read ahead: the
    loader has a constant len()), each rank's micro batches in its layout's order, with the
    epoch and batch_idx an uninterrupted run has. With total_samples the resumed epoch ends
    by itself at step 6; without, the dataset epoch ends at step 4 and the next continues
    the stream."""
    first_name, settings = RESUMED[pair]
    first, resumed = runs.first(first_name), runs.resumed(pair)
    plain = reference(LAST)
    want = {s: Counter(plain[s][0]) for s in range(LAST)}

    before, after = per_step(first), per_step(resumed)
    assert before == {s: want[s] for s in range(FIRST_STOP)}
    assert after == {s: want[s] for s in range(CKPT_STEP, LAST)}
    stitched = {**{s: before[s] for s in range(CKPT_STEP)}, **after}
    assert stitched == want
    assert all(sum(rows.values()) == GLOBAL for rows in stitched.values())
    assert [t["global_step"] for t in resumed] == [LAST] * settings["devices"]

    check_ranks_in_order(first, FIRST[first_name], range(FIRST_STOP))
    check_ranks_in_order(resumed, settings, range(CKPT_STEP, LAST))
    # the epoch is the loader's constant len(): 4 steps (one pass over the 32 rows) or, with
    # total_samples=48, 6; the resumed run goes on with the epoch and batch_idx it stopped at
    steps_per_epoch = (FIRST[first_name]["total_samples"] or N) // GLOBAL
    check_epochs(first, FIRST[first_name]["accum"], steps_per_epoch, range(FIRST_STOP))
    check_epochs(resumed, settings["accum"], steps_per_epoch, range(CKPT_STEP, LAST))


def _walk(value: Any, path: str = "state") -> list[str]:
    """Paths of the leaves that are not JSON-plain (str/int/float/bool/None/list/dict)."""
    if isinstance(value, dict):
        bad = [f"{path} key {k!r}" for k in value if not isinstance(k, str)]
        return bad + [p for k, v in value.items() for p in _walk(v, f"{path}.{k}")]
    if isinstance(value, list):
        return [p for i, v in enumerate(value) for p in _walk(v, f"{path}[{i}]")]
    if value is None or type(value) in (str, int, float, bool):
        return []
    return [f"{path}: {type(value).__qualname__}"]


@pytest.mark.parametrize("name", list(FIRST))
def test_checkpoint_loads_with_weights_only_and_counts_only_trained_batches(
    runs: Runs, name: str
) -> None:
    """The whole Lightning checkpoint loads with torch.load(weights_only=True) (what fit's
    resume does by default); the loader's state in it is JSON-plain, and the checkpoint
    written at step 3 counts the samples of exactly 3 global steps: the fetcher had not
    read a batch ahead (the issue saw one more)."""
    import torch

    checkpoint = torch.load(runs.checkpoint(name), weights_only=True)
    (state,) = checkpoint["loops"]["fit_loop"]["state_dict"]["combined_loader"]
    assert _walk(state) == []
    assert json.loads(json.dumps(state)) == state
    assert state["samples_consumed"] == CKPT_STEP * GLOBAL
    assert checkpoint["global_step"] == CKPT_STEP
    # what a resume re-derives before its first batch: the last 4 samples before the save
    attested = state["attestation"]
    assert attested["first"] == CKPT_STEP * GLOBAL - 4 and len(attested["samples"]) == 4


def test_resume_from_the_default_end_of_epoch_checkpoint_is_refused_not_replayed(
    runs: Runs,
) -> None:
    """Epoch-based training (max_epochs) resumed from Lightning's default end-of-epoch
    checkpoint: Lightning hands a loader its state only when the saved epoch was unfinished,
    so the fresh loader would replay the first epoch. Instead, Lightning's epoch-start call
    ``loader.sampler.set_epoch(1)`` on a loader that delivered nothing is refused with a
    clear error, before any step trains (documented: resume from a mid-epoch checkpoint)."""
    epoch = N // GLOBAL
    ckpt = runs.checkpoint("w2", f"end-epoch=0-step={epoch}.ckpt")
    second = _run(
        runs.launcher,
        dict(devices=1, micro=8, accum=1, workers=0, source="module", total_samples=None)
        | {"max_steps": -1, "max_epochs": 2, "every": CKPT_STEP, "resume": str(ckpt)}
        | {"tag": "epoch2", "ckpt_dir": str(runs.root / "epoch2" / "ckpt")},
        runs.root / "epoch2",
        fails="state was not restored",
    )
    assert second == []  # the run stopped at the refusal; it wrote no trace of trained rows


@pytest.mark.parametrize(
    ("n", "global_batch", "micro", "accum", "steps"),
    [(44, 8, 4, 2, 12), (40, 16, 2, 8, 5)],
    ids=["accumulate-2", "accumulate-8"],
)
def test_accumulation_over_a_ragged_epoch_keeps_lightning_on_detdata_steps(
    launcher: Launcher,
    tmp_path: Path,
    n: int,
    global_batch: int,
    micro: int,
    accum: int,
    steps: int,
) -> None:
    """An epoch that is not a whole number of global steps (44 rows of 8, 40 of 16), trained
    by ``max_steps`` across two or more epoch ends with ``accumulate_grad_batches`` 2 and 8 and
    no glue: Lightning's optimizer step k (its ``global_step`` while it accumulates) holds
    exactly the micro batches of an uninterrupted plain loader's step k, in order; Lightning
    never takes a short step at an epoch's end (``len()`` is whole steps), and its epoch and
    batch_idx are those of epochs of ``n // global_batch`` whole steps."""
    cfg = dict(devices=1, micro=micro, accum=accum, workers=0, source="arg", total_samples=None)
    cfg |= {"n": n, "global_batch": global_batch, "max_steps": steps, "max_epochs": None}
    cfg |= {"every": 1000, "resume": None, "tag": "ragged", "ckpt_dir": str(tmp_path / "ck")}
    (trace,) = _run(launcher, cfg, tmp_path)
    plain = detdata.DataLoader(
        make_dataset(n), global_batch_size=global_batch, micro_batch_size=micro, seed=SEED
    )
    it = iter(plain)
    want = [(k, row_digests(next(it))) for k in range(steps) for _ in range(accum)]
    assert [(r["step"], r["rows"]) for r in trace["records"]] == want
    per_epoch = n // global_batch
    assert [(r["epoch"], r["batch_idx"]) for r in trace["records"]] == [
        (k // per_epoch, (k % per_epoch) * accum + j) for k in range(steps) for j in range(accum)
    ]
    assert trace["global_step"] == steps


@pytest.mark.parametrize(
    ("micro", "accum", "raise_at", "steps_callback"),
    [(2, 4, [5, 2], False), (4, 2, [3, 1], True)],
    ids=["mid-step", "after-the-last-micro-batch"],
)
def test_a_checkpoint_inside_an_optimizer_step_trains_that_step_whole(
    launcher: Launcher,
    tmp_path: Path,
    micro: int,
    accum: int,
    raise_at: list[int],
    steps_callback: bool,
) -> None:
    """``training_step`` raises inside gradient accumulation and ``OnExceptionCheckpoint``
    writes a checkpoint there: the loader state counts the micro batches of the step (the
    batch in hand too), whose gradients no checkpoint holds. Resumed with no detdata line,
    Lightning trains that whole step again: every micro batch from there on, with its
    optimizer step, epoch and batch_idx, is an uninterrupted plain loader's (44 rows of global
    batch 8: 5 whole steps an epoch). Both a state inside the step and one at its end (the last
    micro batch counted, the optimizer step not taken); the second with the optional line of
    earlier versions (``DetdataSteps``), which must not move the counters a second time."""
    base = dict(devices=1, micro=micro, accum=accum, workers=0, source="arg", total_samples=None)
    base |= {"n": 44, "max_steps": 8, "max_epochs": None, "every": 1000}
    base |= {"steps_callback": steps_callback}
    ck = tmp_path / "ck"
    _run(
        launcher,
        base | {"resume": None, "tag": "first", "ckpt_dir": str(ck), "raise_at": raise_at},
        tmp_path,
        fails="injected failure inside gradient accumulation",
    )
    import torch

    saved = torch.load(ck / "on_exception.ckpt", weights_only=True)
    (state,) = saved["loops"]["fit_loop"]["state_dict"]["combined_loader"]
    assert saved["global_step"] == raise_at[0]
    assert state["samples_consumed"] == raise_at[0] * 8 + (raise_at[1] + 1) * micro
    resume = str(ck / "on_exception.ckpt")
    (trace,) = _run(
        launcher,
        base | {"resume": resume, "tag": "again", "ckpt_dir": str(tmp_path / "c2")},
        tmp_path,
    )
    plain = detdata.DataLoader(
        make_dataset(44), global_batch_size=8, micro_batch_size=micro, seed=SEED
    )
    it = iter(plain)
    want = [(k, row_digests(next(it))) for k in range(8) for _ in range(accum)]
    first = raise_at[0]
    assert [(r["step"], r["rows"]) for r in trace["records"]] == want[first * accum :]
    assert [(r["epoch"], r["batch_idx"]) for r in trace["records"]] == [
        (k // 5, (k % 5) * accum + j) for k in range(first, 8) for j in range(accum)
    ]


@pytest.mark.parametrize("package", ["pytorch_lightning", "lightning.pytorch"])
def test_lightning_batch_settings_that_disagree_are_refused_before_the_first_batch(
    launcher: Launcher, tmp_path: Path, package: str
) -> None:
    """accumulate_grad_batches 1 x micro 4 is 4 samples a step, the loader's global batch is
    8 (plain Lightning, no detdata line): the fit stops before any training_step, naming the
    Trainer of the package imported (``import pytorch_lightning as pl`` and the unified
    ``import lightning.pytorch as pl``) and the accumulate_grad_batches that agrees (steps of
    4 rows trained silently before; with the unified package, until it was watched too)."""
    cfg = dict(devices=1, micro=4, accum=1, workers=0, source="arg", total_samples=None)
    cfg |= {"max_steps": 2, "max_epochs": None, "every": 1000, "resume": None}
    cfg |= {"tag": "mismatch", "ckpt_dir": str(tmp_path / "ck"), "package": package}
    fails = (f"{package}.Trainer's batch settings disagree", "Trainer(accumulate_grad_batches=2)")
    assert _run(launcher, cfg, tmp_path, fails=fails) == []


def test_a_loader_lightning_did_not_restore_is_refused_at_train_start(
    launcher: Launcher, tmp_path: Path
) -> None:
    """Epoch-based training (44 rows of global batch 8: 5 steps an epoch, ``max_epochs=1``)
    resumed for a second epoch from Lightning's end-of-epoch checkpoint at step 5: Lightning
    restores ``global_step`` 5 but hands the loader no state (its epoch had ended), so it
    stands at position 0. With no detdata line the fit stops at its start (before
    ``on_train_start``, Lightning's ``set_epoch`` and any ``training_step``), naming
    Lightning's step and the fix."""
    base = dict(devices=1, micro=4, accum=2, workers=0, source="arg", total_samples=None)
    base |= {"n": 44, "max_steps": -1, "every": 1000}
    ck = tmp_path / "ck"
    _run(
        launcher,
        base | {"max_epochs": 1, "resume": None, "tag": "first", "ckpt_dir": str(ck)},
        tmp_path,
    )
    resume = str(ck / "end-epoch=0-step=5.ckpt")
    again = base | {"max_epochs": 2, "resume": resume, "tag": "again", "ckpt_dir": str(ck / "2")}
    fails = (
        "Lightning resumes at optimizer step 5, but this detdata.DataLoader starts at position 0"
    )
    assert _run(launcher, again, tmp_path, fails=fails) == []


# A stock monitored checkpoint (what a Lightning user writes): every 2 steps, but Lightning
# defers the save until validation has produced val_loss, and validation runs every 10 micro
# batches (val_check_interval), here inside step 2 (accumulation 4: after 2 of its micro
# batches). 32 rows of global batch 8: 4 whole steps an epoch (16 micro batches of 2).
MONITORED = dict(workers=0, source="arg", total_samples=None, max_epochs=None, every=2)
MONITORED |= {"monitored": True, "val_every": 10}


@pytest.mark.parametrize(
    ("devices", "micro", "package"),
    [(1, 2, "pytorch_lightning"), (2, 1, "pytorch_lightning"), (1, 2, "lightning.pytorch")],
    ids=["1->1", "2->1", "1->1 lightning.pytorch"],
)
def test_a_monitored_checkpoint_saved_inside_accumulation_resumes_exactly_with_no_line(
    launcher: Launcher, tmp_path: Path, devices: int, micro: int, package: str
) -> None:
    """Plain Lightning (no detdata line), ``ModelCheckpoint(monitor="val_loss",
    every_n_train_steps=2, save_last=True)``, ``accumulate_grad_batches=4`` and a validation
    every 10 micro batches: the step-2 save is written at the end of the validation after
    micro batch 2 of step 2. Resumed with ``fit(ckpt_path="last")`` at 1 device (from 1 and
    from 2): step 2 is trained whole from its first micro batch and every optimizer step from
    there on holds exactly an uninterrupted plain loader's step (rows, order, epoch and
    batch_idx); before, step 2 trained 4 rows and every later step straddled two.

    Also with the unified package (``import lightning.pytorch as pl``, its own copy of
    Lightning's classes; the process never imports ``pytorch_lightning``): its first run passes
    the optional ``DetdataSteps()``, which must be a ``lightning.pytorch`` Callback and change
    nothing; the resumed run has no line."""
    import torch

    ck = tmp_path / "ck"
    unified = package != "pytorch_lightning"
    first_cfg = MONITORED | {"devices": devices, "micro": micro, "accum": 4, "max_steps": 3}
    first_cfg |= {"package": package, "steps_callback": unified}
    first = _run(
        launcher, first_cfg | {"resume": None, "tag": "first", "ckpt_dir": str(ck)}, tmp_path
    )
    saved = torch.load(ck / "last.ckpt", weights_only=True)
    (state,) = saved["loops"]["fit_loop"]["state_dict"]["combined_loader"]
    assert (saved["global_step"], state["samples_consumed"]) == (2, 2 * GLOBAL + GLOBAL // 2)
    cfg = MONITORED | {"devices": 1, "micro": 2, "accum": 4, "max_steps": LAST, "package": package}
    resumed = _run(
        launcher, cfg | {"resume": "last", "tag": "again", "ckpt_dir": str(ck)}, tmp_path
    )
    top = package.split(".")[0]
    assert [t["lightning_modules"] for t in first + resumed] == [[top]] * (devices + 1)

    want = {s: Counter(rows[0]) for s, rows in enumerate(reference(LAST))}
    assert per_step(first) == {s: want[s] for s in range(3)}
    assert per_step(resumed) == {s: want[s] for s in range(2, LAST)}
    check_ranks_in_order(resumed, cfg, range(2, LAST))
    check_epochs(resumed, 4, N // GLOBAL, range(2, LAST))
    assert [t["global_step"] for t in resumed] == [LAST]
