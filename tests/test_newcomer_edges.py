"""The edges a newcomer met in issue 46, each answered with the next step.

* an HTTP root without the ``http`` extra: a `DependencyError` naming
  ``pip install 'detdata[http]'`` (the import is made to fail in a fresh process, by a
  ``sitecustomize`` on ``PYTHONPATH`` that refuses ``aiohttp``), not fsspec's raw ImportError;
* a ragged Parquet list column: the hint names ``Documents(manifest, column=...)`` and
  ``PackedWindows``, and following it delivers the documents' tokens;
* a torch map-style ``Dataset`` given to `DataLoader`: the hint names
  ``DeterministicBatchSampler`` for torch's loader, and following it works;
* a misspelt root: "did you mean" the folder beside it (``manifest build`` and a manifest
  loaded with ``root=``);
* ``load_state_dict("ckpt/loader.json")``: the hint shows the line that reads the file;
* ``TokenWindows("folder")`` without a manifest: the command that makes one, then the file;
* a single-dataset exclusion is labelled ``18744``, not ``None:18744``;
* ``Excluded`` around a loader-ordered dataset at a resume: the error names the seed to pass,
  and following it resumes exactly as an uninterrupted run over the same exclusions.

Each test compares with what the user wrote (the tokens, the batches of an uninterrupted
run), never with numbers read off the code under test.

Covers: detdata/storage/fs.py, detdata/datasets/arrow_numpy.py, detdata/datasets/streams.py,
detdata/identity/build.py, detdata/identity/verify.py, detdata/identity/manifest.py,
detdata/loading/state.py, detdata/datasets/exclusions.py.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import detdata
from tests.conftest import write_token_shards

ROOT = Path(__file__).resolve().parent.parent

BLOCK_AIOHTTP = """\
import sys


class _Refuse:
    def find_spec(self, name, path=None, target=None):
        if name == "aiohttp" or name.startswith("aiohttp."):
            raise ImportError(f"No module named {name!r}")
        return None


sys.meta_path.insert(0, _Refuse())
"""


def _without_aiohttp(tmp_path: Path, *args: str) -> subprocess.CompletedProcess[str]:
    """``python *args`` in a process where ``import aiohttp`` fails (as without the extra)."""
    blocker = tmp_path / "blocker"
    blocker.mkdir(exist_ok=True)
    (blocker / "sitecustomize.py").write_text(BLOCK_AIOHTTP)
    env = {**os.environ, "PYTHONPATH": f"{blocker}{os.pathsep}{ROOT}"}
    return subprocess.run(
        [sys.executable, *args], capture_output=True, text=True, timeout=300, env=env, cwd=tmp_path
    )


def test_http_root_without_the_http_extra_names_the_install_line(tmp_path: Path) -> None:
    probe = _without_aiohttp(tmp_path, "-c", "import aiohttp")
    assert probe.returncode != 0 and "aiohttp" in probe.stderr  # the blocker works
    url = "http://user:s3cret@127.0.0.1:9/data"
    script = (
        "import sys, detdata\n"
        "from detdata.base.errors import DependencyError\n"
        "try:\n"
        f"    detdata.TokenWindows(detdata.build_manifest({url!r}), seq_len=8)\n"
        "except DependencyError as exc:\n"
        "    print(exc)\n"
        "    sys.exit(7)\n"
    )
    done = _without_aiohttp(tmp_path, "-c", script)
    assert done.returncode == 7, done.stderr[-3000:]
    assert "pip install 'detdata[http]'" in done.stdout
    assert "http://" in done.stdout and "s3cret" not in done.stdout
    cli = _without_aiohttp(tmp_path, "-m", "detdata.cli", "manifest", "build", url, "-o", "m.json")
    assert cli.returncode == 2
    assert cli.stderr.startswith("detdata: error: ") and cli.stderr.count("\n") == 1, cli.stderr
    assert "pip install 'detdata[http]'" in cli.stderr and "s3cret" not in cli.stderr


def test_ragged_parquet_list_hint_names_documents_and_packed_windows(tmp_path: Path) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    docs = [[1, 2, 3], [4, 5], [6, 7, 8, 9], [10], [11, 12, 13, 14, 15]] * 4
    (tmp_path / "rag").mkdir()
    pq.write_table(pa.table({"tokens": docs}), tmp_path / "rag" / "a.parquet")
    manifest = detdata.build_manifest(tmp_path / "rag")
    with pytest.raises(detdata.FormatError) as info:
        detdata.TableRows(manifest).read(np.arange(3))
    message = str(info.value)
    assert "Documents(manifest, column='tokens')" in message and "PackedWindows(" in message
    # the hint works: packed windows of the written tokens, in order
    packed = detdata.PackedWindows(
        detdata.Documents(manifest, column="tokens"), seq_len=4, seed=0, shuffle=False
    )
    flat = np.concatenate([np.array(d) for d in docs])
    first = packed.read(np.arange(2))["tokens"]
    np.testing.assert_array_equal(np.asarray(first), np.stack([flat[0:5], flat[4:9]]))


def test_a_torch_dataset_given_to_dataloader_gets_the_sampler_to_use(tmp_path: Path) -> None:
    import torch

    class Squares(torch.utils.data.Dataset[int]):
        def __len__(self) -> int:
            return 20

        def __getitem__(self, i: int) -> int:
            return i * i

    with pytest.raises(detdata.ConfigError) as info:
        detdata.DataLoader(Squares(), global_batch_size=4)  # type: ignore[arg-type]
    message = str(info.value)
    assert "hint:" in message and "batch_sampler=detdata.DeterministicBatchSampler(" in message
    sampler = detdata.DeterministicBatchSampler(
        len(Squares()), global_batch_size=4, micro_batch_size=4, seed=1, total_samples=20
    )
    batches = list(torch.utils.data.DataLoader(Squares(), batch_sampler=sampler))
    seen = sorted(int(v) for b in batches for v in b)
    assert seen == sorted(i * i for i in range(20))  # one epoch: each sample once


def test_a_misspelt_root_says_did_you_mean(tmp_path: Path) -> None:
    write_token_shards(tmp_path / "wiki-en", sizes=(300, 200))
    done = subprocess.run(
        [sys.executable, "-m", "detdata.cli", "manifest", "build", "wiki-em", "-o", "m.json"],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=tmp_path,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    assert done.returncode == 2
    assert "did you mean 'wiki-en'?" in done.stderr, done.stderr
    manifest = detdata.build_manifest(tmp_path / "wiki-en")
    saved = tmp_path / "manifest.json"
    manifest.save(str(saved))
    with pytest.raises(detdata.VerificationError) as info:
        detdata.TokenWindows(detdata.Manifest.load(str(saved), root=str(tmp_path / "wiki_en")), 8)
    message = str(info.value)
    assert "does not exist" in message and f"did you mean {str(tmp_path / 'wiki-en')!r}" in message


def test_load_state_dict_given_a_path_shows_the_line_that_reads_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    ds = detdata.ArrayDataset({"x": np.arange(100)})
    loader = detdata.DataLoader(ds, global_batch_size=10, seed=2)
    it = iter(loader)
    next(it)
    (tmp_path / "ckpt").mkdir()
    (tmp_path / "ckpt" / "loader.json").write_text(json.dumps(loader.state_dict()))
    want = next(it)["x"].tolist()
    monkeypatch.chdir(tmp_path)
    fresh = detdata.DataLoader(ds, global_batch_size=10, seed=2)
    with pytest.raises(detdata.StateError) as info:
        fresh.load_state_dict("ckpt/loader.json")  # type: ignore[arg-type]
    line = "loader.load_state_dict(json.load(open('ckpt/loader.json')))"
    assert line in str(info.value)
    exec(line, {"json": json, "loader": fresh})  # the hint, as written, works
    assert next(iter(fresh))["x"].tolist() == want


def test_token_windows_of_a_folder_says_how_to_make_the_manifest(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    write_token_shards(tmp_path / "data", sizes=(300, 200))
    monkeypatch.chdir(tmp_path)
    with pytest.raises(detdata.ManifestError) as info:
        detdata.TokenWindows("data", seq_len=8)
    command = "detdata manifest build data -o data/manifest.json"
    assert command in str(info.value)
    done = subprocess.run(  # the hint, as written
        ["bash", "-c", command],
        capture_output=True,
        text=True,
        timeout=300,
        env={
            **os.environ,
            "PYTHONPATH": str(ROOT),
            "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}",
        },
    )
    assert done.returncode == 0, done.stderr
    with pytest.raises(detdata.ManifestError) as again:
        detdata.TokenWindows("data", seq_len=8)
    assert "did you mean 'data/manifest.json'?" in str(again.value)
    windows = detdata.TokenWindows("data/manifest.json", seq_len=8)
    assert windows.num_samples == (300 - 1) // 8 + (200 - 1) // 8


def test_a_single_dataset_exclusion_is_labelled_by_its_id() -> None:
    ds = detdata.ArrayDataset({"x": np.arange(1000)})
    with pytest.raises(detdata.ConfigError) as info:
        detdata.Excluded(ds, detdata.ExclusionList.of([18744]))
    assert "None" not in str(info.value) and "exclusion 18744:" in str(info.value)


def test_excluded_around_a_loader_ordered_dataset_at_a_resume_names_the_seed() -> None:
    ds = detdata.ArrayDataset({"x": np.arange(1000)})
    loader = detdata.DataLoader(ds, global_batch_size=10, seed=5)
    it = iter(loader)
    for _ in range(3):
        next(it)
    saved = loader.state_dict()
    bad = detdata.ExclusionList.of([int(i) for i in range(0, 1000, 7)])
    wrong = detdata.DataLoader(
        detdata.Excluded(ds, [(30, bad)]), global_batch_size=10, seed=5
    )  # Excluded's own seed is 0: another order
    with pytest.raises(detdata.StateError) as info:
        wrong.load_state_dict(saved, allow=["exclusions"])
    hint = "Excluded(dataset, [(position, exclusion_list)], seed=5)"
    assert hint in str(info.value) and "allow=['exclusions']" in str(info.value)
    resumed = detdata.DataLoader(
        detdata.Excluded(ds, [(30, bad)], seed=5), global_batch_size=10, seed=5
    )
    resumed.load_state_dict(saved, allow=["exclusions"])
    through = detdata.DataLoader(
        detdata.Excluded(ds, [(30, bad)], seed=5), global_batch_size=10, seed=5
    )
    want = [b["x"].tolist() for b, _ in zip(through, range(6), strict=False)][3:]
    got = [b["x"].tolist() for b, _ in zip(resumed, range(3), strict=False)]
    assert got == want
    assert not {int(v) for b in got for v in b} & set(range(0, 1000, 7))
