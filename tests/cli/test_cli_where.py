"""``detdata where`` and ``detdata seen`` through the real console entry point.

Covers: detdata/cli/seen.py.
"""

from __future__ import annotations

import json
import subprocess
import textwrap
from pathlib import Path

import numpy as np
import pytest

from tests.cli.test_cli_mix import detdata_exe
from tests.conftest import write_token_shards

pytestmark = pytest.mark.multiproc  # runs the real console command

DEFINITION = """
from detdata import DataLoader, LoaderOptions, Mixture, TokenWindows, build_manifest

ROOT = {root!r}
SEED = {seed}


def build_mixture():
    sources = {{n: TokenWindows(build_manifest(ROOT + "/" + n), 8) for n in ("code", "web")}}
    return Mixture(sources, {{"web": 3, "code": 1}}, seed=SEED)


def build_loader():
    return DataLoader(
        build_mixture(),
        global_batch_size=8,
        micro_batch_size=2,
        options=LoaderOptions(world_size=2),
    )


def first_token(sample):
    return "first=" + str(int(sample["tokens"][0]))
"""


def _setup(tmp_path: Path, seed: int = 1) -> tuple[Path, Path]:
    root = tmp_path / "data"
    write_token_shards(root / "web", sizes=(300, 200), seed=1)
    write_token_shards(root / "code", sizes=(120,), seed=2)
    defn = tmp_path / "defn.py"
    defn.write_text(textwrap.dedent(DEFINITION.format(root=str(root), seed=seed)))
    return root, defn


def _run(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([detdata_exe(), *args], capture_output=True, text=True, timeout=120)


def _saved_state(defn: Path, tmp_path: Path, steps: int) -> tuple[Path, object]:
    import importlib.util

    spec = importlib.util.spec_from_file_location("defn_for_test", defn)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    loader = module.build_loader()
    it = iter(loader)
    for _ in range(steps * 2):  # two micro steps per global step on this rank
        next(it)
    state_path = tmp_path / "state.json"
    state_path.write_text(json.dumps(loader.state_dict()))
    return state_path, module


def test_where_lists_the_step_like_loader_provenance(tmp_path: Path) -> None:
    _, defn = _setup(tmp_path)
    state, module = _saved_state(defn, tmp_path, steps=5)
    for data in (f"{defn}:build_loader", f"{defn}:build_mixture"):
        done = _run(
            "where", "--state", str(state), "--step", "3", "--data", data,
            "--decode", f"{defn}:first_token",
        )  # fmt: skip
        assert done.returncode == 0, done.stderr
        rows = [json.loads(line) for line in done.stdout.splitlines()]
        expected = module.build_loader().provenance(3)  # type: ignore[attr-defined]
        assert [r["digest"] for r in rows] == [e.digest for e in expected]
        assert [(r["rank"], r["micro_step"], r["row"]) for r in rows] == [
            (e.rank, e.micro_step, e.row) for e in expected
        ]
        for r in rows:
            tokens = np.load(r["url"], mmap_mode="r")[r["tokens"][0] : r["tokens"][1]]
            assert r["text"] == f"first={int(tokens[0])}"


def test_where_refuses_a_definition_that_does_not_match_the_state(tmp_path: Path) -> None:
    _, defn = _setup(tmp_path)
    state, _ = _saved_state(defn, tmp_path, steps=2)
    other = tmp_path / "other.py"
    other.write_text(defn.read_text().replace("SEED = 1", "SEED = 2"))
    done = _run("where", "--state", str(state), "--step", "0", "--data", f"{other}:build_loader")
    assert done.returncode == 2
    assert "stream_seed" in done.stderr
    bad = _run("where", "--state", str(state), "--step", "0", "--data", "no_colon")
    assert bad.returncode == 2 and "MODULE:FUNCTION" in bad.stderr


def test_seen_equals_a_brute_force_scan(tmp_path: Path) -> None:
    _, defn = _setup(tmp_path)
    state, module = _saved_state(defn, tmp_path, steps=1)
    until = 20_000
    done = _run(
        "seen", "code:3", "--until", str(until), "--data", f"{defn}:build_loader",
        "--state", str(state),
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    out = json.loads(done.stdout)
    mix = module.build_mixture()  # type: ignore[attr-defined]
    src, _, ids = mix.locate(np.arange(until))
    expected = np.flatnonzero((src == mix.source_names.index("code")) & (ids == 3))
    assert out["positions"] == expected.tolist() and out["count"] == expected.size > 0
    assert out["steps"] == (expected // 8).tolist()
    assert _run("seen", "nope:x", "--until", "5", "--data", f"{defn}:build_loader").returncode == 2


# ------------------------------------------------- batch schedules (issue 14)
ROWS = """
import numpy as np
import detdata

N = 4001


def build_rows():
    return detdata.ArrayDataset(
        {"row": np.arange(N, dtype="<u8").view(np.uint8).reshape(N, 8)}, name="ids"
    )
"""
RAMP = (4, 4, 48, 16)  # Megatron: --global-batch-size 16 --rampup-batch-size 4 4 48


def _megatron_steps(count: int) -> list[tuple[int, int]]:
    """``(first position, global batch)`` of each step as Megatron-LM's ramp-up runs them."""
    start, inc, ramp, gbs = RAMP
    per_increment = ramp / ((gbs - start) // inc)
    out, consumed = [], 0
    for _ in range(count):
        batch = gbs if consumed > ramp else start + int(consumed / per_increment) * inc
        out.append((consumed, batch))
        consumed += batch
    return out


def _where(state: Path, step: int, data: str, capsys: pytest.CaptureFixture[str]) -> list[dict]:
    from detdata.cli.main import main

    capsys.readouterr()
    assert main(["where", "--state", str(state), "--step", str(step), "--data", data]) == 0
    return [json.loads(line) for line in capsys.readouterr().out.splitlines()]


def test_where_follows_a_ramp_up_schedule_state(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A state saved under a ramp-up (its global_batch_size is a schedule object): each step's
    samples are Megatron's positions of that step, in the order GlobalOrder gives, on the
    rank and micro step of docs/design.md section 4 (DP 2, micro 2)."""
    import detdata
    from detdata.loading.loader import DataLoader
    from detdata.order.batches import BatchSchedule

    defn = tmp_path / "rows.py"
    defn.write_text(ROWS)
    start, inc, ramp, gbs = RAMP
    schedule = BatchSchedule.rampup(start, inc, ramp, global_batch_size=gbs)
    spec = {"N": 4001}
    exec(ROWS, spec)  # the same definition the CLI imports
    dl = DataLoader(
        spec["build_rows"](),
        global_batch_size=schedule,
        micro_batch_size=2,
        options=detdata.LoaderOptions(rank=0, world_size=2),
        seed=23,
    )
    it = iter(dl)
    for _ in range(20):
        next(it)
    state = tmp_path / "state.json"
    state.write_text(json.dumps(dl.state_dict()))
    assert isinstance(json.loads(state.read_text())["global_batch_size"], dict)
    expected = _megatron_steps(12)
    order = detdata.GlobalOrder(4001, 23)
    for step in (0, 3, 4, 7, 8, 11):
        rows = _where(state, step, f"{defn}:build_rows", capsys)
        first, batch = expected[step]
        positions = list(range(first, first + batch))
        assert [r["position"] for r in rows] == positions
        assert [r["step"] for r in rows] == [step] * batch
        assert [r["sample_id"] for r in rows] == order.ids(np.array(positions)).tolist()
        assert [(r["rank"], r["micro_step"], r["row"]) for r in rows] == [
            ((q // 2) % 2, q // 4, q % 2) for q in range(batch)
        ]


def test_where_follows_a_global_batch_change_at_a_resume(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A DP 8 run at 16 resumed on DP 7 at 14 from step 5: steps before the change are 16 wide,
    after it 14 wide, from the history (not step * 14)."""
    from detdata.loading.loader import DataLoader
    from detdata.loading.options import LoaderOptions

    defn = tmp_path / "rows.py"
    defn.write_text(ROWS)
    spec: dict = {}
    exec(ROWS, spec)

    def loader(world: int, gbs: int, micro: int) -> DataLoader:
        return DataLoader(
            spec["build_rows"](),
            global_batch_size=gbs,
            micro_batch_size=micro,
            options=LoaderOptions(rank=0, world_size=world),
            seed=23,
        )

    old = loader(8, 16, 1)
    it = iter(old)
    for _ in range(10):
        next(it)
    new = loader(7, 14, 2)
    new.load_state_dict(old.state_dict(), allow=("global_batch_size",))
    it = iter(new)
    next(it)
    state = tmp_path / "state.json"
    state.write_text(json.dumps(new.state_dict()))
    for step, first, batch in ((2, 32, 16), (4, 64, 16), (5, 80, 14), (9, 136, 14)):
        rows = _where(state, step, f"{defn}:build_rows", capsys)
        assert [r["position"] for r in rows] == list(range(first, first + batch)), step
        # the layout of that step: DP 8 x micro 1 before the change, DP 7 x micro 2 after
        world, micro = (8, 1) if step < 5 else (7, 2)
        assert [(r["rank"], r["micro_step"], r["row"]) for r in rows] == [
            ((q // micro) % world, q // (micro * world), q % micro) for q in range(batch)
        ], step


DP_ROWS = """
import numpy as np
import detdata

SEED = {seed}


def build_loader():  # rank and world size from torch.distributed: world 1 in the CLI
    rows = detdata.ArrayDataset({{"id": np.arange(501, dtype=np.int64)}})
    return detdata.DataLoader(
        rows, global_batch_size=8, micro_batch_size=2, seed=SEED,
        options=detdata.LoaderOptions(total_samples={total}),
    )
"""


def _dp2_run(
    seeds: tuple[int, ...], steps: int, delivered: dict[int, tuple[int, int, int]]
) -> dict[str, object]:
    """A DP 2 run (micro 2, global batch 8) of ``steps`` steps per seed in ``seeds`` (a resume
    allowing the seed at each change): position -> (id, rank, micro step), recorded here."""
    import numpy as np

    import detdata

    state = None
    for seed in seeds:
        for rank in (0, 1):
            rows = detdata.ArrayDataset({"id": np.arange(501, dtype=np.int64)})
            dl = detdata.DataLoader(
                rows,
                global_batch_size=8,
                micro_batch_size=2,
                options=detdata.LoaderOptions(rank=rank, world_size=2, total_samples=400),
                seed=seed,
            )
            if state is not None:
                dl.load_state_dict(state, allow=["seed"])
            it = iter(dl)
            for k in range(2 * steps):
                positions = dl.positions_of_next().tolist()
                ids = next(it)["id"].tolist()
                for p, i in zip(positions, ids, strict=True):
                    delivered[p] = (i, rank, k % 2)
            if rank == 0:
                saved = json.loads(json.dumps(dl.state_dict()))
        state = saved
    assert state is not None
    return state


def test_where_takes_the_layout_and_seed_of_each_step_from_the_state(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A DP 2 run whose build_loader reads rank/world from torch.distributed (the CLI process is
    world 1), seed 4 -> 9 allowed at step 6: `where` gives, for steps before and after the
    change and after the saved state, the id, rank and micro step the run delivered."""
    delivered: dict[int, tuple[int, int, int]] = {}
    state = _dp2_run((4, 9), 6, delivered)
    path = tmp_path / "state.json"
    path.write_text(json.dumps(state))
    defn = tmp_path / "dp.py"
    defn.write_text(DP_ROWS.format(seed=9, total=400))
    later: dict[int, tuple[int, int, int]] = {}  # the run went on after the saved state
    _dp2_run((4, 9, 9), 6, later)  # same run, 6 more steps: steps 12..17 (reference)
    for step in (0, 5, 6, 11, 12, 17):
        rows = _where(path, step, f"{defn}:build_loader", capsys)
        reference = delivered if step < 12 else later
        assert [(r["sample_id"], r["rank"], r["micro_step"]) for r in rows] == [
            reference[p] for p in range(step * 8, step * 8 + 8)
        ], step


def test_where_and_seen_refuse_positions_the_run_never_delivers(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from detdata.cli.main import main

    delivered: dict[int, tuple[int, int, int]] = {}
    state = _dp2_run((4,), 3, delivered)
    path = tmp_path / "state.json"
    path.write_text(json.dumps(state))
    defn = tmp_path / "dp.py"
    defn.write_text(DP_ROWS.format(seed=4, total=400))
    assert len(_where(path, 49, f"{defn}:build_loader", capsys)) == 8  # the last step
    capsys.readouterr()
    code = main(["where", "--state", str(path), "--step", "50", "--data", f"{defn}:build_loader"])
    err = capsys.readouterr().err
    assert code == 2 and "step 50 is never delivered" in err and "last delivered step 49" in err
    code = main(["seen", "7", "--until", "401", "--data", f"{defn}:build_loader"])
    assert code == 2 and "past the last position" in capsys.readouterr().err


def test_seen_follows_a_seed_change_at_a_resume(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from detdata.cli.main import main

    delivered: dict[int, tuple[int, int, int]] = {}
    state = _dp2_run((4, 9), 6, delivered)
    path = tmp_path / "state.json"
    path.write_text(json.dumps(state))
    defn = tmp_path / "dp.py"
    defn.write_text(DP_ROWS.format(seed=9, total=400))
    for sample in sorted({i for i, _, _ in delivered.values()})[:40]:
        capsys.readouterr()
        args = ["seen", str(sample), "--until", "96", "--data", f"{defn}:build_loader"]
        assert main([*args, "--state", str(path)]) == 0
        out = json.loads(capsys.readouterr().out)
        assert out["positions"] == sorted(p for p, v in delivered.items() if v[0] == sample)


def test_a_json_file_nested_too_deep_is_a_usage_error_naming_it(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """``--state`` (where), ``--config`` (env, mix): JSON nested deeper than the parser goes is
    refused as not valid JSON, naming the file, not reported as an internal error."""
    from detdata.cli.main import main

    deep = tmp_path / "deep.json"
    deep.write_text("[" * 100_000)
    for args in (
        ["where", "--state", str(deep), "--step", "0", "--data", "x:y"],
        ["env", "--config", str(deep)],
        ["mix", "--config", str(deep)],
    ):
        capsys.readouterr()
        assert main(args) == 2
        err = capsys.readouterr().err
        assert f"{deep}: not valid JSON" in err and "internal error" not in err, err
