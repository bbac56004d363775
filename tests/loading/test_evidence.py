"""Evidence that must not lie: traces across resumes, replays, restarts; ``detdata diff``.

The reference is always an uninterrupted run of the real `detdata.DataLoader`
over the same files; the runs under test stop and resume in fresh processes
appending to one trace file, rewind with ``load_state_dict``, restart their cursor
by mistake, or deliver other bytes. ``detdata diff`` runs as a subprocess.

Covers: detdata/cli/trace.py, detdata/loading/trace/read.py.
"""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

import detdata
from tests.conftest import write_token_shards

pytestmark = pytest.mark.multiproc  # runs the real console command / child processes

G = 8  # global batch of every run here
SEQ = 16

RUNNER = """
import json, sys
import detdata
cfg = json.loads(sys.argv[1])
data = detdata.TokenWindows(detdata.Manifest.load(cfg["manifest"]), cfg["seq"])
dl = detdata.DataLoader(data, global_batch_size=cfg["gbs"], micro_batch_size=cfg["micro"], seed=3,
                        options=detdata.LoaderOptions(trace=cfg["trace"]))
if cfg["state_in"]:
    with open(cfg["state_in"]) as fh:
        dl.load_state_dict(json.load(fh), mid_step="continue")
it = iter(dl)
for _ in range(cfg["batches"]):
    next(it)
if cfg["state_out"]:
    with open(cfg["state_out"], "w") as fh:
        json.dump(dl.state_dict(), fh)
dl.close()
"""


@pytest.fixture
def manifest(tmp_path: Path) -> str:
    root = tmp_path / "data"
    write_token_shards(root, (3000, 2000))
    path = tmp_path / "manifest.json"
    detdata.build_manifest(str(root), progress=False).save(str(path))
    return str(path)


def fresh_process(
    manifest: str,
    trace: Path,
    *,
    micro: int,
    batches: int,
    state_in: Path | None = None,
    state_out: Path | None = None,
) -> None:
    """Deliver ``batches`` micro batches in a new Python process (optionally resuming a state)."""
    cfg = {
        "manifest": manifest,
        "seq": SEQ,
        "gbs": G,
        "micro": micro,
        "trace": str(trace),
        "batches": batches,
        "state_in": str(state_in) if state_in else None,
        "state_out": str(state_out) if state_out else None,
    }
    done = subprocess.run(
        [sys.executable, "-c", RUNNER, json.dumps(cfg)],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-3000:]


def diff(*args: str | Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "detdata.cli.main", "diff", *map(str, args)],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )


def arrays(changed: int | None = None) -> dict[str, np.ndarray]:
    x = np.arange(200 * 5, dtype=np.int32).reshape(200, 5)
    if changed is not None:
        x[changed, 1] += 1
    return {"x": x}


def loader(
    trace: Path | None,
    micro: int = 2,
    columns: dict[str, np.ndarray] | None = None,
    *,
    read: detdata.ReadOptions | None = None,
    resume: detdata.ResumePolicy | None = None,
    rank: int | None = None,
    world_size: int | None = None,
    **kwargs: Any,
) -> detdata.DataLoader:
    return detdata.DataLoader(
        detdata.ArrayDataset(columns or arrays()),
        global_batch_size=G,
        micro_batch_size=micro,
        seed=4,
        options=detdata.LoaderOptions(
            trace=trace,
            rank=rank,
            world_size=world_size,
            read=read or detdata.ReadOptions(),
            resume=resume or detdata.ResumePolicy(),
        ),
        **kwargs,
    )


def deliver(dl: detdata.DataLoader, count: int) -> None:
    it = iter(dl)
    for _ in range(count):
        next(it)


def straight(trace: Path, steps: int, micro: int = 2, **kwargs: Any) -> Path:
    dl = loader(trace, micro, **kwargs)
    deliver(dl, steps * G // micro)
    dl.close()
    return trace


def step_of(sample: int, steps: int) -> int:
    """The step whose global batch holds ``sample`` (brute force over the order)."""
    ids = detdata.GlobalOrder(200, 4).ids(np.arange(steps * G, dtype=np.int64))
    return int(np.flatnonzero(ids == sample)[0]) // G


#: a sample read in step 3 (position 3 * G + 5) of the runs over `arrays`
CHANGED = int(detdata.GlobalOrder(200, 4).ids(np.array([3 * G + 5], dtype=np.int64))[0])


# ------------------------------------------------------------------ resumes


@pytest.mark.slow
def test_resumes_in_fresh_processes_appending_to_one_trace_are_identical(
    tmp_path: Path, manifest: str
) -> None:
    """Stop in the middle of step 5 (micro 2); resume in a new process with micro 4 up to step 9
    and "crash"; resume again from the same mid-step checkpoint (steps 5..8 delivered twice) to
    step 12."""
    fresh_process(manifest, tmp_path / "ref.jsonl", micro=2, batches=12 * G // 2)
    trace, state = tmp_path / "resumed.jsonl", tmp_path / "state.json"
    fresh_process(manifest, trace, micro=2, batches=5 * G // 2 + 2, state_out=state)
    mid = json.loads(state.read_text())["samples_consumed"]
    assert mid == 5 * G + 4  # mid-step indeed
    fresh_process(manifest, trace, micro=4, batches=(9 * G - mid) // 4, state_in=state)
    fresh_process(manifest, trace, micro=4, batches=(12 * G - mid) // 4, state_in=state)
    result = diff(tmp_path / "ref.jsonl", trace)
    assert result.returncode == 0, result.stdout + result.stderr
    assert result.stdout.strip() == "identical: 12 steps"


def test_load_state_dict_back_to_a_step_start_is_identical(tmp_path: Path) -> None:
    """In one process: 3 steps and 2 micro batches, then rewind to the start of step 3."""
    ref = straight(tmp_path / "ref.jsonl", steps=8)
    dl = loader(tmp_path / "rewound.jsonl")
    deliver(dl, 3 * G // 2)
    saved = dl.state_dict()
    deliver(dl, 2)
    dl.load_state_dict(saved, mid_step="continue")
    deliver(dl, 5 * G // 2)
    dl.close()
    result = diff(ref, tmp_path / "rewound.jsonl")
    assert result.returncode == 0, result.stdout + result.stderr
    assert result.stdout.strip() == "identical: 8 steps"


# ------------------------------------------------------------- differences


@pytest.mark.slow
def test_loader_restarted_at_zero_is_found_at_the_step_it_should_have_delivered(
    tmp_path: Path, manifest: str
) -> None:
    """8 steps, then a fresh loader (state not loaded) appends 12 steps from position 0.

    Every step number 0..11 then holds bytes equal to the reference's, so a diff
    keyed by step alone says "identical" up to step 11; the run really diverged
    at step 8, which it delivered with step 0's samples.
    """
    ref = tmp_path / "ref.jsonl"
    fresh_process(manifest, ref, micro=2, batches=13 * G // 2)
    trace = tmp_path / "restarted.jsonl"
    fresh_process(manifest, trace, micro=2, batches=8 * G // 2)
    fresh_process(manifest, trace, micro=2, batches=12 * G // 2)  # cursor not restored
    for a, b in ((ref, trace), (trace, ref)):
        result = diff(a, b)
        assert result.returncode == 1, result.stdout + result.stderr
        first = result.stdout.splitlines()[0]
        assert first.startswith("first difference at step 8 (rank 0): discontinuity"), first
        assert "samples_consumed 0" in first and f"samples_consumed {8 * G}" in first


def test_first_difference_is_the_smallest_step_whatever_the_record_order(tmp_path: Path) -> None:
    """Two ranks' records interleaved in either order; a changed sample plus a missing tail."""
    changed = CHANGED
    s = step_of(changed, 10)
    assert s == 3
    parts = []
    for name, columns, steps in (("clean", arrays(), 10), ("bad", arrays(changed), 9)):
        dl0 = loader(tmp_path / name, 2, columns, rank=0, world_size=2)
        dl1 = loader(tmp_path / name, 2, columns, rank=1, world_size=2)
        deliver(
            dl1, steps * G // 4
        )  # rank 1 first: its records are not in step order with rank 0's
        deliver(dl0, steps * G // 4)
        dl0.close()
        dl1.close()
        parts.append((tmp_path / name, Path(f"{tmp_path / name}.rank1")))
    (clean0, clean1), (bad0, bad1) = parts
    a = tmp_path / "a.jsonl"
    a.write_text(clean1.read_text() + clean0.read_text())
    b = tmp_path / "b.jsonl"
    b.write_text(bad0.read_text() + bad1.read_text())
    result = diff(a, b)
    assert result.returncode == 1, result.stderr
    assert result.stdout.startswith(f"first difference at step {s} "), result.stdout
    assert "batch_b3" in result.stdout.splitlines()[0]
    # world size 1 delivered the same global steps: identical to both ranks' records together
    one = straight(tmp_path / "one.jsonl", steps=10, micro=4)
    assert diff(one, a).returncode == 0


def test_positions_delivered_by_two_ranks_are_reported(tmp_path: Path) -> None:
    """Rank 0 built for world size 1 (reads whole steps), rank 1 for world size 2: both read
    [4, 8)."""
    ref = straight(tmp_path / "ref.jsonl", steps=3, micro=4)
    trace = tmp_path / "t.jsonl"
    wrong0 = loader(trace, 4, rank=0, world_size=1)
    right1 = loader(trace, 4, rank=1, world_size=2)
    deliver(wrong0, 3 * 2)
    deliver(right1, 3)
    wrong0.close()
    right1.close()
    both = tmp_path / "both.jsonl"
    both.write_text(trace.read_text() + Path(f"{trace}.rank1").read_text())
    result = diff(ref, both)
    assert result.returncode == 1, result.stdout + result.stderr
    first = result.stdout.splitlines()[0]
    assert first.startswith(
        "first difference at step 0 (rank 0): overlap in B: positions [4, 8) "
    ), first


def test_conflicting_replay_after_a_restore_is_reported(tmp_path: Path) -> None:
    """A resume delivers step s again with other bytes: not "identical", whatever came last."""
    changed = CHANGED
    s = step_of(changed, 8)
    assert s == 3
    # reference: the bytes that were delivered last for every step (a last-record-wins diff agrees)
    ref = straight(tmp_path / "ref.jsonl", steps=8, columns=arrays(changed))
    trace = tmp_path / "run.jsonl"
    first = loader(trace)
    deliver(first, (s + 1) * G // 2)
    first.close()
    resumed = loader(
        trace, columns=arrays(changed), resume=detdata.ResumePolicy(allow=["manifests", "data"])
    )
    saved = loader(None)
    deliver(saved, (s - 1) * G // 2)
    resumed.load_state_dict(saved.state_dict(), mid_step="continue")
    deliver(resumed, (8 - s + 1) * G // 2)
    resumed.close()
    result = diff(ref, trace)
    assert result.returncode == 1, result.stdout + result.stderr
    lines = result.stdout.splitlines()
    assert lines[0].startswith(f"first difference at step {s} (rank 0): conflict in B"), lines[0]
    shown = [line for line in lines[1:] if line.startswith("B ")]
    assert len(shown) >= 2 and all(f'"step": {s}' in line for line in shown)
    assert any(f"{trace}:" in line for line in shown)  # names the lines in the file


def test_duplicated_record_with_another_digest_is_reported(tmp_path: Path) -> None:
    """A record copied with one changed digest right before its original (no restore in between)."""
    ref = straight(tmp_path / "ref.jsonl", steps=6)
    lines = ref.read_text().splitlines()
    k = next(i for i, line in enumerate(lines) if json.loads(line)["step"] == 3)
    forged = json.loads(lines[k])
    digests = forged["batch_b3"]
    if isinstance(digests, dict):
        name = sorted(digests)[0]
        digests[name] = f"{(int(digests[name], 16) + 1) % (1 << 256):064x}"
    else:
        forged["batch_b3"] = f"{(int(digests, 16) + 1) % (1 << 256):064x}"
    edited = tmp_path / "edited.jsonl"
    edited.write_text("\n".join([*lines[:k], json.dumps(forged), *lines[k:]]) + "\n")
    result = diff(ref, edited)
    assert result.returncode == 1, result.stdout + result.stderr
    first = result.stdout.splitlines()[0]
    assert first.startswith("first difference at step 3 (rank 0): conflict in B"), first
    assert f"{edited}:{k + 1}" in result.stdout and f"{edited}:{k + 2}" in result.stdout


def test_steps_window(tmp_path: Path) -> None:
    changed = CHANGED
    s = step_of(changed, 10)
    assert s == 3
    a = straight(tmp_path / "a.jsonl", steps=10)
    b = straight(tmp_path / "b.jsonl", steps=10, columns=arrays(changed))
    before = diff(a, b, "--steps", f"0:{s}")
    assert (
        before.returncode == 0 and before.stdout.strip() == f"identical: {s} steps in steps 0:{s}"
    )
    around = diff(a, b, "--steps", f"{s}:")
    assert around.returncode == 1 and around.stdout.startswith(f"first difference at step {s} ")
    for bad in ("5:3", "x:4", "-1:2"):
        refused = diff(a, b, "--steps", bad)
        assert (
            refused.returncode == 2
            and "--steps" in refused.stderr
            and "Traceback" not in refused.stderr
        )
    empty = diff(a, b, "--steps", "50:60")
    assert empty.returncode == 2 and "nothing to compare" in empty.stderr


# ------------------------------------------------------------------ digests


def _bf16(batch: dict[str, np.ndarray]) -> dict[str, torch.Tensor]:
    return {"x": torch.from_numpy(batch["x"].astype(np.float32) / 7).to(torch.bfloat16)}


def test_bfloat16_batches_are_traced_by_their_raw_bytes(tmp_path: Path) -> None:
    changed = CHANGED
    s = step_of(changed, 6)
    assert not torch.equal(_bf16(arrays())["x"][changed], _bf16(arrays(changed))["x"][changed])
    a = straight(tmp_path / "a.jsonl", steps=6, micro=4, collate_fn=_bf16)
    b = straight(tmp_path / "b.jsonl", steps=6, micro=2, collate_fn=_bf16)
    c = straight(tmp_path / "c.jsonl", steps=6, collate_fn=_bf16, columns=arrays(changed))
    assert diff(a, b).returncode == 0
    result = diff(a, c)
    assert result.returncode == 1 and result.stdout.startswith(f"first difference at step {s} ")
    record = json.loads(a.read_text().splitlines()[0])
    assert record["cols"] == {"x": "torch.bfloat16[5]"}


def test_micro_batch_and_worker_invariance(tmp_path: Path) -> None:
    from detdata.loading.trace import read_trace, step_digests

    a = straight(tmp_path / "a.jsonl", steps=10, micro=8)
    b = straight(tmp_path / "b.jsonl", steps=10, micro=2, num_workers=2)
    c = straight(
        tmp_path / "c.jsonl",
        steps=10,
        micro=1,
        num_workers=2,
        read=detdata.ReadOptions(worker_mode="thread"),
    )
    assert step_digests(read_trace(a)) == step_digests(read_trace(b)) == step_digests(read_trace(c))
    assert sorted(step_digests(read_trace(a))) == list(range(10))
    assert [d["positions"] for d in step_digests(read_trace(b)).values()] == [
        [[G * t, G * (t + 1)]] for t in range(10)
    ]
    assert diff(a, b).returncode == 0 and diff(b, c).returncode == 0


# ------------------------------------------------------------ trace writing


def test_trace_path_is_checked_when_the_loader_is_built(tmp_path: Path) -> None:
    (tmp_path / "folder").mkdir()
    (tmp_path / "file").write_text("x")
    for bad in (tmp_path / "folder", tmp_path / "file" / "trace.jsonl"):
        with pytest.raises(detdata.ConfigError, match=str(bad).replace(".", r"\.")):
            loader(bad)


class _Opaque:
    """A batch leaf the trace cannot digest exactly (its repr would not be its data)."""


def _opaque(batch: dict[str, np.ndarray]) -> dict[str, Any]:
    return {"x": torch.from_numpy(batch["x"]), "meta": _Opaque()}


def test_a_batch_the_trace_cannot_digest_is_not_delivered(tmp_path: Path) -> None:
    trace = tmp_path / "t.jsonl"
    dl = loader(trace, collate_fn=_opaque)
    with pytest.raises(detdata.ConfigError, match="'meta'"):
        deliver(dl, 1)
    assert dl.samples_consumed == 0
    assert trace.read_text() == ""
    dl.close()


# ---------------------------------------------------------------- bad input

TraceMaker = Callable[[Path], Path]


def _line(text: str) -> TraceMaker:
    def make(folder: Path) -> Path:
        good = straight(folder / "good.jsonl", steps=2)
        path = folder / "bad.jsonl"
        path.write_text(good.read_text() + text)
        return path

    return make


def _list_step(folder: Path) -> Path:
    good = straight(folder / "good.jsonl", steps=2).read_text().splitlines()
    record = json.loads(good[1])
    record["step"] = [record["step"]]
    path = folder / "bad.jsonl"
    path.write_text("\n".join([good[0], json.dumps(record), *good[2:]]) + "\n")
    return path


def _truncated(folder: Path) -> Path:
    good = straight(folder / "good.jsonl", steps=2).read_text()
    path = folder / "bad.jsonl"
    path.write_text(good[:-20])
    return path


def _non_utf8(folder: Path) -> Path:
    path = folder / "bad.jsonl"
    path.write_bytes(
        straight(folder / "good.jsonl", steps=2).read_bytes() + b'{"v": 2, "\xff": 1}\n'
    )
    return path


def _folder(folder: Path) -> Path:
    (folder / "dir.jsonl").mkdir()
    return folder / "dir.jsonl"


MALFORMED: dict[str, tuple[TraceMaker, str]] = {
    "not-an-object": (_line("[1, 2]\n"), ":9: expected a JSON object"),
    "list-as-step": (_list_step, ":2: field 'step'"),
    "truncated-last-line": (_truncated, ":8: truncated last record"),
    "not-utf8": (_non_utf8, ":9: not UTF-8"),
    "directory": (_folder, "is a directory"),
    "missing": (lambda folder: folder / "missing.jsonl", "not found"),
}


@pytest.mark.slow
def test_malformed_traces_exit_2_naming_file_and_line(tmp_path: Path) -> None:
    good = straight(tmp_path / "reference.jsonl", steps=2)
    for case, (make, expected) in MALFORMED.items():
        folder = tmp_path / case
        folder.mkdir()
        bad = make(folder)
        for args in ((good, bad), (bad, good)):
            result = diff(*args)
            context = f"{case}: {result.stdout} {result.stderr}"
            assert result.returncode == 2, context
            assert "Traceback" not in result.stderr and result.stdout == "", context
            assert f"{bad}{expected}" in result.stderr or (
                str(bad) in result.stderr and expected in result.stderr
            ), context


# ------------------------------------------------------------------ states


def test_diff_states_reports_each_differing_field(tmp_path: Path) -> None:
    one, two = loader(None), loader(None)
    deliver(two, 3)
    other_seed = detdata.DataLoader(
        detdata.ArrayDataset(arrays()), global_batch_size=G, micro_batch_size=2, seed=5
    )
    paths = {}
    for name, dl in (("one", one), ("again", loader(None)), ("two", two), ("seed", other_seed)):
        paths[name] = tmp_path / f"{name}.json"
        with open(paths[name], "w") as fh:
            json.dump(dl.state_dict(), fh)
    same = diff("--state", paths["one"], paths["again"])
    assert same.returncode == 0 and same.stdout.startswith("identical: "), same.stdout + same.stderr
    moved = diff("--state", paths["one"], paths["two"])
    assert moved.returncode == 1
    lines = moved.stdout.splitlines()[1:]
    assert [line for line in lines if not line.startswith("attestation.")] == [
        "samples_consumed: A 0 | B 6  [position]",
        "step_position.delivered_in_step: A 0 | B 6  [position]",  # 6 of step 0's 8 samples
    ]
    # B attests the last 4 samples delivered before it (issue 43): positions 2..5
    assert "attestation.first: A null | B 2" in lines
    attested = [line.split(":")[0] for line in lines if line.startswith("attestation.samples[")]
    assert attested == [f"attestation.samples[{i}]" for i in range(4)]
    seeded = diff("--state", paths["one"], paths["seed"])
    assert seeded.returncode == 1 and "\nseed: A 4 | B 5  [checked on resume]" in seeded.stdout
    (tmp_path / "bad.json").write_text("{")
    trace = straight(tmp_path / "trace.jsonl", steps=1)
    for bad in (tmp_path / "bad.json", tmp_path / "nope.json", trace, tmp_path):
        refused = diff("--state", paths["one"], bad)
        assert (
            refused.returncode == 2
            and str(bad) in refused.stderr
            and "Traceback" not in refused.stderr
        )
