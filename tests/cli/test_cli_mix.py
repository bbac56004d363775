"""``detdata mix`` through the real console entry point."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from detdata.cli.mix import CountDataset
from detdata.datasets.mixture import Mixture

pytestmark = pytest.mark.multiproc  # runs the real console command / child processes

CONFIG: dict[str, Any] = {
    "seed": 1234,
    "sources": {
        "web": {"num_samples": 1_000_000},
        "code": {"num_samples": 5000},
        "math": {"num_samples": 3},
    },
    "schedule": [
        [0, {"web": 0.7, "code": "0.2", "math": "1/10"}],
        [40, {"web": 1, "code": 1, "math": 0}],
    ],
    "allow_zero": True,
}


def detdata_exe() -> str:
    exe = Path(sys.executable).parent / "detdata"
    if not exe.exists():
        pytest.fail(f"console entry point {exe} missing; run `make setup` (pip install -e .)")
    return str(exe)


def run_mix(config: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [detdata_exe(), "mix", "--config", str(config), *args],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )


@pytest.fixture
def config_file(tmp_path: Path) -> Path:
    path = tmp_path / "mix.json"
    path.write_text(json.dumps(CONFIG), encoding="utf-8")
    return path


def expected_lines(at: int, count: int) -> list[str]:
    sources = {n: CountDataset(s["num_samples"], name=n) for n, s in CONFIG["sources"].items()}
    m = Mixture(sources, seed=CONFIG["seed"], schedule=CONFIG["schedule"], allow_zero=True)
    positions = np.arange(at, at + count)
    src, idx, ids = m.locate(positions)
    return [
        f"{g}\t{m.source_names[s]}\t{i}\t{d}"
        for g, s, i, d in zip(
            positions.tolist(), src.tolist(), idx.tolist(), ids.tolist(), strict=True
        )
    ]


def test_mix_prints_assignment_deterministically(config_file: Path) -> None:
    first = run_mix(config_file, "--at", "30", "--count", "25")
    assert first.returncode == 0, first.stderr
    lines = first.stdout.splitlines()
    assert lines[0] == "position\tsource\tindex_in_source\tsample_id"
    assert lines[1:] == expected_lines(30, 25)
    after_change = [line.split("\t")[1] for line in lines[1:] if int(line.split("\t")[0]) >= 40]
    assert after_change and "math" not in after_change  # weight 0 from position 40
    again = run_mix(config_file, "--at", "0", "--count", "100")  # another process, another window
    assert again.returncode == 0, again.stderr
    assert again.stdout.splitlines()[31:56] == lines[1:]
    assert again.stdout.splitlines()[1:] == expected_lines(0, 100)


@pytest.mark.parametrize(
    ("change", "needle"),
    [
        ({"schedule": [[0, {"web": -1, "code": 1, "math": 1}]]}, "negative"),
        ({"sources": {"web": {"num_samples": 0}}, "schedule": [[0, {"web": 1}]]}, "'web' is empty"),
        ({"colour": "blue"}, "unknown key"),
    ],
)
def test_mix_bad_config(tmp_path: Path, change: dict[str, Any], needle: str) -> None:
    path = tmp_path / "bad.json"
    path.write_text(json.dumps({**CONFIG, **change}), encoding="utf-8")
    proc = run_mix(path)
    assert proc.returncode == 2
    assert needle in proc.stderr and proc.stdout == ""


def test_mix_unreadable_config(tmp_path: Path) -> None:
    missing = run_mix(tmp_path / "missing.json")
    assert missing.returncode == 2 and "cannot read mix config" in missing.stderr
    broken = tmp_path / "broken.json"
    broken.write_text("{not json", encoding="utf-8")
    proc = run_mix(broken)
    assert proc.returncode == 2 and "not valid JSON" in proc.stderr


def test_mix_unreadable_state_is_a_usage_error_naming_the_file(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A ``--state`` file that is missing, not UTF-8 or not JSON: exit 2 naming the file (a
    non-UTF-8 one was reported as an internal error, a bug in detdata)."""
    from detdata.cli.main import main

    config = tmp_path / "mix.json"
    config.write_text(json.dumps(CONFIG), encoding="utf-8")
    (tmp_path / "binary.json").write_bytes(b"\xff\xfe{")
    (tmp_path / "cut.json").write_text('{"kind": ', encoding="utf-8")
    for name in ("missing.json", "binary.json", "cut.json"):
        state = tmp_path / name
        assert main(["mix", "--config", str(config), "--state", str(state)]) == 2, name
        err = capsys.readouterr().err
        assert str(state) in err and "internal error" not in err, err


def test_mix_config_errors_in_process(tmp_path: Path) -> None:
    """The remaining config checks, without paying for a process start each."""
    from detdata.base.errors import ConfigError
    from detdata.cli.mix import mixture_from_config

    with pytest.raises(ConfigError, match="exactly one of"):
        mixture_from_config({**CONFIG, "weights": {"web": 1}})
    with pytest.raises(ConfigError, match="num_samples"):
        mixture_from_config({**CONFIG, "sources": {"web": {"path": "x"}}})
    with pytest.raises(ConfigError, match="seed"):
        mixture_from_config({k: v for k, v in CONFIG.items() if k != "seed"})
    with pytest.raises(ConfigError, match="allow_zero"):
        mixture_from_config({**CONFIG, "allow_zero": "yes"})
    with pytest.raises(ConfigError, match="no data to read"):
        mixture_from_config(CONFIG).fetch(np.arange(4))


def test_mix_state_answers_with_the_weights_changed_during_the_run(tmp_path: Path) -> None:
    """``--state``: a run that changed its weights twice during the run (issue 44) is listed
    and plotted with the weights in force at each position: equal to the mixture built
    with those phases (the reference), and the plot's printed target shares are each
    phase's proportions summed over its positions."""
    from fractions import Fraction

    import detdata

    sizes = {n: s["num_samples"] for n, s in CONFIG["sources"].items()}
    data = {n: detdata.ArrayDataset({"id": np.arange(min(n_, 5000))}) for n, n_ in sizes.items()}
    sizes = {n: min(v, 5000) for n, v in sizes.items()}
    w0 = {"web": 1, "code": 1, "math": 1}
    loader = detdata.DataLoader(
        Mixture(data, w0, seed=CONFIG["seed"]), global_batch_size=16, seed=0
    )
    it = iter(loader)
    changes = {2: {"web": 5, "code": 2, "math": 1}, 5: {"web": 1, "code": 0.5, "math": 2}}
    for step in range(8):
        if step in changes:
            loader.set_mixture_weights(changes[step])
        next(it)
    state = tmp_path / "state.json"
    state.write_text(json.dumps(loader.state_dict()), encoding="utf-8")
    config = tmp_path / "mix.json"
    doc = {"seed": CONFIG["seed"], "sources": {n: {"num_samples": v} for n, v in sizes.items()}}
    config.write_text(json.dumps({**doc, "weights": {"web": 9, "code": 1, "math": 1}}))
    schedule = [(0, w0), (32, changes[2]), (80, changes[5])]
    ref = Mixture(
        {n: CountDataset(v, name=n) for n, v in sizes.items()},
        seed=CONFIG["seed"],
        schedule=schedule,
    )
    proc = run_mix(config, "--state", str(state), "--at", "20", "--count", "100")
    assert proc.returncode == 0, proc.stderr
    positions = np.arange(20, 120)
    src, idx, ids = ref.locate(positions)
    expected = [
        f"{g}\t{ref.source_names[s]}\t{i}\t{d}"
        for g, s, i, d in zip(
            positions.tolist(), src.tolist(), idx.tolist(), ids.tolist(), strict=True
        )
    ]
    assert proc.stdout.splitlines()[1:] == expected
    png = tmp_path / "shares.png"
    proc = run_mix(config, "--state", str(state), "--count", "128", "--plot", str(png))
    if "matplotlib" in proc.stderr:
        pytest.fail("matplotlib missing: the plots extra is part of the dev environment")
    assert proc.returncode == 0, proc.stderr
    assert png.stat().st_size > 1000
    bounds = [0, 32, 80, 128]
    for line in proc.stdout.splitlines()[1:4]:
        name, _, _, target = line.split("\t")
        total = Fraction(0)
        for k, (_, w) in enumerate(schedule):
            fr = {n: Fraction(str(v)) for n, v in w.items()}
            total += fr[name] / sum(fr.values()) * (bounds[k + 1] - bounds[k])
        assert target == f"{float(total) / 128:.6f}", (name, target)
    other = tmp_path / "other.json"
    other.write_text(json.dumps({**doc, "seed": 5, "weights": w0}))
    proc = run_mix(other, "--state", str(state))
    assert proc.returncode != 0 and "seed is 1234, the config's 5" in proc.stderr
