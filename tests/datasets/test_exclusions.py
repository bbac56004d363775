"""Exclusions: exactly the excluded samples change, nothing excluded is delivered, resumes,
reshards, and lists added at a resume leave every earlier step as it was."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from detdata.base.errors import ConfigError, StateError
from detdata.datasets.exclusions import Excluded, ExclusionList
from detdata.datasets.mixture import Mixture
from detdata.datasets.streams import OrderedStream
from detdata.datasets.tokens import TokenWindows
from detdata.identity.build import build_manifest
from detdata.loading.loader import DataLoader
from detdata.loading.options import LoaderOptions
from tests.conftest import write_token_shards
from tests.resume_checker import check_resume_everywhere, digest

N_POS = 4000


@pytest.fixture
def windows(tmp_path: Path) -> TokenWindows:
    write_token_shards(tmp_path / "tok", sizes=(700, 900, 260))
    return TokenWindows(build_manifest(str(tmp_path / "tok")), 16)


def _positions_changed(base: object, excluded: Excluded, n: int) -> None:
    """Compare position by position with the unexcluded stream (ids and bytes)."""
    pos = np.arange(n)
    before, after = base.sample_ids(pos), excluded.sample_ids(pos)  # type: ignore[attr-defined]
    banned = np.isin(before, excluded.excluded_ids(0, 0))
    assert banned.any()
    np.testing.assert_array_equal(after[~banned], before[~banned])
    assert not np.isin(after, excluded.excluded_ids(0, 0)).any()
    got = excluded.fetch(pos)["tokens"]
    ref = base.fetch(pos)["tokens"]  # type: ignore[attr-defined]
    np.testing.assert_array_equal(got[~banned], ref[~banned])
    ds = excluded.origins(pos).datasets[0]
    np.testing.assert_array_equal(got[banned], ds.read(after[banned])["tokens"])


def test_exactly_the_excluded_samples_change(windows: TokenWindows) -> None:
    base = OrderedStream(windows, seed=3)
    bad = ExclusionList.of([0, 17, 100])
    _positions_changed(base, Excluded(base, bad), N_POS)
    again = Excluded(base, bad).sample_ids(np.arange(N_POS))  # deterministic
    np.testing.assert_array_equal(again, Excluded(base, bad).sample_ids(np.arange(N_POS)))


def test_mixture_exclusions_replace_from_the_same_source(tmp_path: Path) -> None:
    for name, seed in (("web", 1), ("code", 2)):
        write_token_shards(tmp_path / name, sizes=(500, 300), seed=seed)
    sources = {n: TokenWindows(build_manifest(str(tmp_path / n)), 16) for n in ("web", "code")}
    mix = Mixture(sources, {"web": 2, "code": 1}, seed=5)
    excluded = Excluded(mix, ExclusionList.of(["web:3", "web:40", "code:7"]))
    pos = np.arange(N_POS)
    src, _, before = mix.locate(pos)
    found = excluded.origins(pos)
    np.testing.assert_array_equal(found.source, src)
    names = np.array(mix.source_names)[src]
    banned = ((names == "web") & np.isin(before, [3, 40])) | ((names == "code") & (before == 7))
    assert banned.sum() > 3
    np.testing.assert_array_equal(found.ids[~banned], before[~banned])
    np.testing.assert_array_equal(
        excluded.fetch(pos)["tokens"][~banned], mix.fetch(pos)["tokens"][~banned]
    )
    for s, name in enumerate(mix.source_names):
        bad = [int(e[1]) for e in excluded.history[0][1].entries if e[0] == name]
        assert not np.isin(found.ids[found.source == s], bad).any()


def test_identity_carries_the_content_address(windows: TokenWindows, tmp_path: Path) -> None:
    a = ExclusionList.of([5, 1, (None, 3)])
    assert a == ExclusionList.of([3, 5, 1]) and a.digest == ExclusionList.of([1, 3, 5]).digest
    assert a.digest != ExclusionList.of([1, 3]).digest
    path = tmp_path / "bad.json"
    assert a.save(path) == a.digest
    assert ExclusionList.load(path, digest=a.digest) == a
    with pytest.raises(ConfigError, match="does not match"):
        ExclusionList.load(path, digest=ExclusionList.of([1]).digest)
    stream = Excluded(windows, a, seed=2)
    assert stream.identity()["history"] == [{"from": 0, "list": a.digest, "count": 3}]
    loader = DataLoader(stream, global_batch_size=4)
    other = DataLoader(Excluded(windows, ExclusionList.of([1]), seed=2), global_batch_size=4)
    with pytest.raises(StateError, match="data"):
        other.load_state_dict(loader.state_dict())
    with pytest.raises(ConfigError, match="SOURCE:ID"):
        ExclusionList.of(["web"])
    with pytest.raises(ConfigError, match="source"):
        Excluded(windows, ExclusionList.of(["web:1"]))
    with pytest.raises(ConfigError, match="beyond"):
        Excluded(windows, ExclusionList.of([windows.num_samples]))


def test_survives_resume_everywhere_and_reshard(windows: TokenWindows) -> None:
    stream = Excluded(windows, ExclusionList.of(range(0, windows.num_samples, 3)), seed=4)

    def make() -> DataLoader:
        return DataLoader(stream, global_batch_size=8, micro_batch_size=4)

    check_resume_everywhere(make, 12)
    straight = make()
    it = iter(straight)
    reference = [next(it)["tokens"].numpy() for _ in range(10)]  # 5 steps at world 1
    saved = DataLoader(stream, global_batch_size=8, micro_batch_size=4)
    sit = iter(saved)
    for _ in range(4):
        next(sit)
    state = json.loads(json.dumps(saved.state_dict()))
    ranks = [
        DataLoader(
            stream,
            global_batch_size=8,
            micro_batch_size=2,
            options=LoaderOptions(rank=r, world_size=2),
        )
        for r in (0, 1)
    ]
    rows = []
    for loader in ranks:
        loader.load_state_dict(state)
    its = [iter(r) for r in ranks]
    for _ in range(6):  # resumed at 2 ranks: the same rows position by position
        for k in (0, 1):
            rows.append(next(its[k])["tokens"].numpy())
    np.testing.assert_array_equal(np.concatenate(rows), np.concatenate(reference[4:]))


def test_adding_exclusions_at_a_resume(windows: TokenWindows) -> None:
    base = OrderedStream(windows, seed=8)
    run = DataLoader(base, global_batch_size=8)
    it = iter(run)
    original = [digest(next(it)) for _ in range(10)]
    early_state = None
    run2 = DataLoader(base, global_batch_size=8)
    it2 = iter(run2)
    for step in range(6):
        if step == 2:
            early_state = json.loads(json.dumps(run2.state_dict()))
        next(it2)
    saved = json.loads(json.dumps(run2.state_dict()))
    p = saved["samples_consumed"]
    later = base.sample_ids(np.arange(p, 80))
    bad = ExclusionList.of([int(later[1]), int(later[9])])
    stream = Excluded(base, [(p, bad)])
    assert stream.continue_from(saved["stream"], p) is stream
    resumed = DataLoader(stream, global_batch_size=8)
    with pytest.raises(StateError, match="exclusions") as err:
        resumed.load_state_dict(saved)
    assert err.value.fields == ("exclusions",)
    resumed.load_state_dict(saved, allow=["exclusions"])
    rit = iter(resumed)
    after = [digest(next(rit)) for _ in range(4)]
    changed = [k for k in range(4) if after[k] != original[6 + k]]
    assert changed == [0, 1]  # the steps holding positions p + 1 and p + 9
    # the history is in the state, and a replay of an earlier step reproduces what it saw
    assert resumed.state_dict()["stream"]["history"][0]["from"] == p
    replay = DataLoader(stream, global_batch_size=8)
    assert early_state is not None
    replay.load_state_dict(early_state, allow=["exclusions"])
    pit = iter(replay)
    assert [digest(next(pit)) for _ in range(4)] == original[2:6]
    assert [r.digest for r in replay.provenance(3)] == [r.digest for r in run.provenance(3)]
    with pytest.raises(StateError, match="before the resume position"):
        Excluded(base, [(p - 8, bad)]).continue_from(saved["stream"], p)
    newer = Excluded(base, [(p, bad), (p + 16, ExclusionList.of([0]))])
    assert newer.continue_from(stream.identity(), p + 16) is newer
    with pytest.raises(StateError, match="prefix"):
        Excluded(base, [(p + 16, ExclusionList.of([0]))]).continue_from(stream.identity(), p + 16)
    with pytest.raises(StateError, match="not the stream"):
        Excluded(OrderedStream(windows, seed=9), [(p, bad)]).continue_from(saved["stream"], p)


def test_adding_exclusions_is_allowed_as_exclusions_not_as_data(windows: TokenWindows) -> None:
    """Exclusions have their own checked field: ``allow=("data",)`` no longer lets them in,
    ``allow=("exclusions",)`` does (and the loader checks the lists only append from the
    resume position on), and any other data change is still refused under it."""
    base = OrderedStream(windows, seed=8)
    run = DataLoader(base, global_batch_size=8)
    it = iter(run)
    for _ in range(5):
        next(it)
    saved = json.loads(json.dumps(run.state_dict()))
    p = saved["samples_consumed"]
    assert saved["exclusions"] is None
    bad = ExclusionList.of([int(i) for i in base.sample_ids(np.arange(p, p + 3))])

    def fresh(stream: object) -> DataLoader:
        return DataLoader(stream, global_batch_size=8)  # type: ignore[arg-type]

    with pytest.raises(StateError) as err:
        fresh(Excluded(base, [(p, bad)])).load_state_dict(saved, allow=("data",))
    assert err.value.fields == ("exclusions",)
    resumed = fresh(Excluded(base, [(p, bad)]))
    resumed.load_state_dict(saved, allow=("exclusions",))
    assert resumed.samples_consumed == p
    state = resumed.state_dict()
    assert state["data"] == saved["data"]  # the wrapped stream is the saved one
    assert state["exclusions"] == [
        {"rule": "exclude-v1", "seed": 8, "history": [{"from": p, "list": bad.digest, "count": 3}]}
    ]
    # the loader runs Excluded.continue_from itself: a list in force before p is refused
    early = fresh(Excluded(base, [(p - 8, bad)]))
    with pytest.raises(StateError, match="before the resume position") as err:
        early.load_state_dict(saved, allow=("exclusions",))
    assert err.value.fields == ("exclusions",) and early.samples_consumed == 0
    # dropping or rewriting a saved list is refused as well
    with pytest.raises(StateError, match="not an Excluded stream") as err:
        fresh(base).load_state_dict(state, allow=("exclusions",))
    assert err.value.fields == ("exclusions",)
    other = ExclusionList.of([int(base.sample_ids(np.arange(p + 5, p + 6))[0])])
    with pytest.raises(StateError, match="prefix"):
        fresh(Excluded(base, [(p, other)])).load_state_dict(state, allow=("exclusions",))
    # a data change other than the exclusions is still refused under allow exclusions
    shorter = TokenWindows(windows.manifest, 8)
    with pytest.raises(StateError) as err:
        fresh(Excluded(OrderedStream(shorter, seed=8), [(p, bad)])).load_state_dict(
            saved, allow=("exclusions",)
        )
    assert err.value.fields == ("data",)
    with pytest.raises(StateError) as err:
        fresh(Excluded(OrderedStream(windows, seed=9), [(p, bad)])).load_state_dict(
            saved, allow=("exclusions",)
        )
    assert err.value.fields == ("stream_seed",)
    # an edited exclusions field disagrees with the saved stream identity
    edited = dict(state, exclusions=None)
    with pytest.raises(StateError, match="inconsistent"):
        fresh(Excluded(base, [(p, bad)])).load_state_dict(edited)


def test_exclusions_added_at_a_resume_of_a_loader_ordered_run(windows: TokenWindows) -> None:
    """Run 1 is ``DataLoader(data, seed=S)`` (the loader orders the dataset: ``stream_seed``
    None); the resume wraps ``Excluded(data, [(p, lst)], seed=S)`` and needs only
    ``allow=("exclusions",)``. Position by position against the unexcluded run continued
    uninterrupted: the same tokens except at excluded samples, which are replaced. Another
    seed in ``Excluded`` is still refused as ``stream_seed``."""
    seed = 5
    run = DataLoader(windows, global_batch_size=8, seed=seed)
    it = iter(run)
    for _ in range(6):
        next(it)
    saved = json.loads(json.dumps(run.state_dict()))
    assert saved["stream_seed"] is None
    p = saved["samples_consumed"]
    reference = [next(it)["tokens"].numpy() for _ in range(4)]  # the unexcluded run goes on
    ref_ids = OrderedStream(windows, seed=seed).sample_ids(np.arange(p, p + 32))
    bad = ExclusionList.of([int(ref_ids[1]), int(ref_ids[9])])
    resumed = DataLoader(Excluded(windows, [(p, bad)], seed=seed), global_batch_size=8, seed=seed)
    resumed.load_state_dict(saved, allow=("exclusions",))
    rit = iter(resumed)
    got = np.concatenate([next(rit)["tokens"].numpy() for _ in range(4)])
    ref = np.concatenate(reference)
    banned = np.isin(ref_ids, bad.ids_of(None))
    assert banned.tolist() == [k in (1, 9) for k in range(32)]
    np.testing.assert_array_equal(got[~banned], ref[~banned])
    for k in np.flatnonzero(banned):
        for b in bad.ids_of(None).tolist():
            assert not np.array_equal(got[k], windows.read(np.array([b]))["tokens"][0])
    other = DataLoader(Excluded(windows, [(p, bad)], seed=seed + 1), global_batch_size=8, seed=seed)
    with pytest.raises(StateError, match="stream_seed") as err:
        other.load_state_dict(saved, allow=("exclusions",))
    assert "stream_seed" in err.value.fields


def test_tokens_consumed_through_exclusions(windows: TokenWindows) -> None:
    """An `Excluded` stream counts tokens as the stream it wraps (a replacement is a window of
    the same dataset): delivered batches x micro batch x seq_len, counted by hand."""
    stream = Excluded(OrderedStream(windows, seed=2), ExclusionList.of([0, 5]))
    dl = DataLoader(stream, global_batch_size=8, micro_batch_size=4)
    it = iter(dl)
    delivered = sum(next(it)["tokens"].shape[0] for _ in range(3))
    assert delivered == 12
    (count,) = dl.tokens_consumed().values()
    assert count == delivered * 16


@pytest.mark.parametrize(
    ("content", "match"),
    [
        (b'{"kind": "detdata.exclusions", ', "not valid JSON"),
        (b"\xff\xfe not text", "not valid JSON"),
        (b"[" * 100_000, "not valid JSON|not a detdata exclusion list"),
        (b"", "not valid JSON"),
        (None, "a folder"),
    ],
)
def test_loading_a_bad_file_or_a_folder_is_a_config_error_naming_it(
    tmp_path: Path, content: bytes | None, match: str
) -> None:
    path = tmp_path / "excl.json"
    if content is None:
        path.mkdir()
    else:
        path.write_bytes(content)
    with pytest.raises(ConfigError, match=match) as bad:
        ExclusionList.load(path)
    assert str(path) in str(bad.value)


def test_a_saved_list_loads_back_equal(tmp_path: Path) -> None:
    original = ExclusionList([("a.npy", 3), ("b.npy", 0)])
    digest = original.save(tmp_path / "e.json")
    again = ExclusionList.load(tmp_path / "e.json", digest=digest)
    assert again.to_json() == original.to_json() and again.digest == digest
