"""Bounded handles: more shards than the descriptor limit are read, every byte checked.

Each check runs in a child Python whose soft ``RLIMIT_NOFILE`` is 256 (workers inherit
it) over 2,000 shards: without a bound on open handles the read dies with EMFILE. The
child compares every delivered byte with what the writer wrote (``np.load`` of each
``.npy`` shard; the Parquet tables as written) and checks, in the main process and inside
each worker (a transform counts its own process), that descriptors of shard files and
mapped shard files stay within ``max_open_shards`` (plus the reads in flight).
"""

from __future__ import annotations

import gc
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

import detdata
from detdata.base.errors import ConfigError
from detdata.datasets.handles import (
    DEFAULT_MAX_OPEN_SHARDS,
    PROCESS_HANDLES,
    HandleLRU,
    ProcessHandles,
    set_max_open_shards,
)

ROOT = Path(__file__).resolve().parents[2]
SHARDS = 2_000
SOFT_LIMIT = 256
SEQ = 8

CHILD = textwrap.dedent(
    '''
    import json, os, resource, sys
    import numpy as np
    import pyarrow.parquet as pq

    kind, data, manifest, mode = sys.argv[1:5]
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (int(sys.argv[5]), hard))
    import detdata

    SEQ = int(sys.argv[6])
    COUNTS = {"fds": 0, "maps": 0, "calls": 0}


    def shard_fds():
        n = 0
        for fd in os.listdir("/proc/self/fd"):
            try:
                n += os.readlink(f"/proc/self/fd/{fd}").startswith(data)
            except OSError:
                pass
        return n


    def shard_maps():
        with open("/proc/self/maps") as fh:
            return len({line[line.index(data):] for line in fh if data in line})


    def counted(sample, rng):
        """A transform: the sample plus this process's shard descriptors / mappings."""
        COUNTS["calls"] += 1
        if COUNTS["calls"] % 4 == 1:
            COUNTS["fds"], COUNTS["maps"] = shard_fds(), shard_maps()
        return {**sample, "fds": np.int64(COUNTS["fds"]), "maps": np.int64(COUNTS["maps"])}


    def reference():
        """What the writer wrote, read back without detdata: rows in id order."""
        paths = sorted(os.path.join(d, f) for d, _, fs in os.walk(data) for f in fs)
        if kind == "tokens":
            rows = []
            for p in paths:
                arr = np.load(p)  # reads and closes the file
                n = (arr.size - 1) // SEQ
                rows += [arr[w * SEQ : w * SEQ + SEQ + 1] for w in range(n)]
            return {"tokens": np.stack(rows)}
        tables = [pq.read_table(p) for p in paths]
        return {
            "x": np.concatenate([t.column("x").to_numpy() for t in tables]),
            "v": np.concatenate([np.stack(t.column("v").to_pylist()) for t in tables]),
        }


    def make(cap=None):
        storage = detdata.Storage(verify="off", max_open_shards=cap)
        if kind == "tokens":
            return detdata.TokenWindows(manifest, SEQ, storage=storage)
        return detdata.TableRows(manifest, ["x", "v"], storage=storage)


    ref = reference()
    peak = {"fds": 0, "maps": 0}
    if mode == "direct":
        cap = 8
        ds = make(cap)
        n = ds.num_samples
        rng = np.random.default_rng(5)
        batches = list(np.array_split(rng.permutation(n), 40))  # shuffled, ~1 per shard
        batches += [np.arange(a, min(a + 1000, n)) for a in range(0, n, 1000)]  # sequential
        if kind == "tokens":  # one whole shard per read: the single-shard path
            starts = np.asarray(ds._layout.starts)
            ends = np.append(starts[1:], n)
            batches += [np.arange(a, b)[::-1] for a, b in zip(starts[::7], ends[::7])]
            big = [(a, b) for a, b in zip(starts, ends) if b - a >= 40]
            batches += [np.arange(a, b, 3) for a, b in big * 2]  # sparse: mapped, evicting
        for ids in batches:
            got = ds.read(ids)
            for k, v in ref.items():
                assert np.array_equal(got[k], v[ids]), (k, ids[:5])
            peak["fds"] = max(peak["fds"], shard_fds())
            peak["maps"] = max(peak["maps"], shard_maps())
            assert len(ds.files.open_shards()) <= cap
        evictions = ds.files.local().handles.evictions
    else:
        cap = ds_cap = detdata.datasets.handles.DEFAULT_MAX_OPEN_SHARDS
        ds = make()
        gbs = max(g for g in range(8, 49) if ds.num_samples % g == 0)  # one whole epoch
        loader = detdata.DataLoader(
            ds,
            global_batch_size=gbs,
            seed=1,
            num_workers=2,
            options=detdata.LoaderOptions(
                transform=counted,
                total_samples=ds.num_samples,
                read=detdata.ReadOptions(worker_mode=mode),
            ),
        )
        seen = {k: [] for k in ref}
        for batch in loader:
            for k in ref:
                seen[k].append(batch[k].numpy())
            peak["fds"] = max(peak["fds"], int(batch["fds"].max()))
            peak["maps"] = max(peak["maps"], int(batch["maps"].max()))
        got = {k: np.concatenate(v) for k, v in seen.items()}
        key = "tokens" if kind == "tokens" else "x"
        if kind == "tokens":
            order_got = np.lexsort(got[key].T[::-1])
            order_ref = np.lexsort(ref[key].T[::-1])
        else:
            order_got, order_ref = np.argsort(got[key]), np.argsort(ref[key])
        for k in ref:  # one epoch: every row exactly once, every byte as written
            assert np.array_equal(got[k][order_got], ref[k][order_ref]), k
        evictions = None
    # threads that read shards at once in the counted process, and the native threads of each
    readers = 2 if mode == "thread" else 1
    read_threads = 1 if mode == "process" else detdata.storage.fileread.READ_THREADS
    out = {"peak": peak, "cap": cap, "n": int(ds.num_samples), "evictions": evictions}
    print(json.dumps({**out, "readers": readers, "read_threads": read_threads}))
    '''
)


def write_tokens(root: Path) -> str:
    rng = np.random.default_rng(0)
    for s in range(SHARDS):
        # most shards hold a few windows; every 100th holds 60 (sparse reads map those)
        windows = 60 if s % 100 == 0 else 1 + s % 12
        sub = root / f"{s // 500}"
        sub.mkdir(exist_ok=True)
        tokens = rng.integers(0, 2**31 - 1, windows * SEQ + 1, dtype=np.int32)
        np.save(sub / f"s{s:05d}.npy", tokens)
    manifest = detdata.build_manifest(str(root), pattern="**/*.npy")
    path = str(root.parent / f"{root.name}.json")
    manifest.save(path)
    return path


def write_tables(root: Path) -> str:
    rng = np.random.default_rng(1)
    for s in range(SHARDS):
        rows = 1 + s % 4
        sub = root / f"{s // 500}"
        sub.mkdir(exist_ok=True)
        table = pa.table(
            {
                "x": rng.integers(0, 2**62, rows, dtype=np.int64),
                "v": [rng.integers(0, 1000, 3).tolist() for _ in range(rows)],
            }
        )
        pq.write_table(table, sub / f"s{s:05d}.parquet", row_group_size=2)
    manifest = detdata.build_manifest(str(root), pattern="**/*.parquet")
    path = str(root.parent / f"{root.name}.json")
    manifest.save(path)
    return path


@pytest.fixture(scope="module")
def corpora(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[str, str]]:
    base = tmp_path_factory.mktemp("bounded")
    (base / "tokens").mkdir()
    (base / "tables").mkdir()
    return {
        "tokens": (str(base / "tokens"), write_tokens(base / "tokens")),
        "tables": (str(base / "tables"), write_tables(base / "tables")),
    }


def run_child(tmp: Path, kind: str, data: str, manifest: str, mode: str) -> dict[str, object]:
    script = tmp / "child.py"
    script.write_text(CHILD)
    proc = subprocess.run(
        [sys.executable, str(script), kind, data, manifest, mode, str(SOFT_LIMIT), str(SEQ)],
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT)},  # this checkout's detdata
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    result: dict[str, object] = json.loads(proc.stdout.strip().splitlines()[-1])
    return result


@pytest.mark.slow
@pytest.mark.multiproc
@pytest.mark.parametrize("mode", ["direct", "thread", "process"])
@pytest.mark.parametrize("kind", ["tokens", "tables"])
def test_more_shards_than_the_descriptor_limit_read_every_byte_within_the_bound(
    corpora: dict[str, tuple[str, str]], tmp_path: Path, kind: str, mode: str
) -> None:
    data, manifest = corpora[kind]
    got = run_child(tmp_path, kind, data, manifest, mode)
    cap = got["cap"]
    assert isinstance(cap, int) and cap < SOFT_LIMIT < SHARDS
    peak = got["peak"]
    assert isinstance(peak, dict)
    # handles held + reads in flight: each reading thread may hold one handle just
    # evicted by another (closed when its read ends) and one transient ``preadv``
    # descriptor per native read thread
    readers, read_threads = got["readers"], got["read_threads"]
    assert isinstance(readers, int) and isinstance(read_threads, int)
    in_flight = readers * (1 + read_threads)
    assert 0 < peak["fds"] <= cap + in_flight, (peak, in_flight)
    assert peak["maps"] <= cap + in_flight, (peak, in_flight)
    if mode == "direct":
        evictions = got["evictions"]
        assert isinstance(evictions, int) and evictions > SHARDS // 100  # the LRU cycled


def test_handle_lru_keeps_the_most_recently_used_and_reports_evictions() -> None:
    lru: HandleLRU[str] = HandleLRU(2, budget=ProcessHandles(2))
    assert lru.put(1, "a") == [] and lru.put(2, "b") == []
    assert lru.get(1) == "a"  # 1 is now the most recently used
    assert lru.put(3, "c") == [2]
    assert lru.keys() == [1, 3] and lru.get(2) is None
    assert lru.put(3, "c2") == [] and lru.keys() == [1, 3] and lru.get(3) == "c2"
    assert lru.pop(1) == "a" and lru.keys() == [3] and lru.evictions == 1


def test_max_open_shards_is_checked_and_defaults_below_the_usual_descriptor_limit(
    tmp_path: Path,
) -> None:
    np.save(tmp_path / "a.npy", np.arange(100, dtype=np.int32))
    manifest = detdata.build_manifest(str(tmp_path))
    assert (
        detdata.TokenWindows(manifest, 8).storage.max_open_shards
        == DEFAULT_MAX_OPEN_SHARDS
        < 1024 // 4
    )
    for bad in (0, -1, True, 2.5, "8"):
        with pytest.raises(ConfigError, match="max_open_shards"):
            detdata.TokenWindows(manifest, 8, storage=detdata.Storage(max_open_shards=bad))  # type: ignore[arg-type]
    ds = detdata.TokenWindows(manifest, 8, storage=detdata.Storage(max_open_shards=1))
    assert ds.identity() == detdata.TokenWindows(manifest, 8).identity()  # keeps bytes


# --------------------------------------------------------- the shard cache and the handle LRU
def _memory_copy(src: Path, name: str) -> str:
    import fsspec

    fs = fsspec.filesystem("memory")
    for path in sorted(src.iterdir()):
        fs.pipe_file(f"/{name}/{path.name}", path.read_bytes())
    return f"memory://{name}"


def test_cached_copies_evicted_by_the_lru_and_by_the_cache_reopen_correctly(
    tmp_path: Path,
) -> None:
    """Remote shards through ``cache_dir`` with 2 open handles and room for 3 copies: handles
    and copies are evicted independently; every read is the writer's bytes, the remembered
    copies never outgrow the open handles, and a copy replaced on disk is re-opened."""
    import uuid

    rng = np.random.default_rng(3)
    src = tmp_path / "src"
    src.mkdir()
    arrays = [rng.integers(0, 2**31 - 1, SEQ * 30 + 1, dtype=np.int32) for _ in range(7)]
    for i, arr in enumerate(arrays):
        np.save(src / f"s{i}.npy", arr)
    windows = np.stack([a[w * SEQ : w * SEQ + SEQ + 1] for a in arrays for w in range(30)])
    root = _memory_copy(src, f"bounded-{uuid.uuid4().hex}")
    manifest = detdata.build_manifest(root)
    bound = 3 * (arrays[0].nbytes + 128)
    ds = detdata.TokenWindows(
        manifest,
        SEQ,
        storage=detdata.Storage(
            cache_dir=tmp_path / "cache", shard_cache_bytes=bound, max_open_shards=2
        ),
    )
    for _ in range(40):
        ids = rng.integers(0, ds.num_samples, size=rng.integers(1, 40))
        np.testing.assert_array_equal(ds.read(ids)["tokens"], windows[ids])
        open_now = ds.files.open_shards()
        assert len(open_now) <= 2 and set(ds.files.local().copies) <= set(open_now)
        cache = ds.files.shard_cache
        assert cache is not None and cache.usage() <= bound
    assert ds.files.local().handles.evictions > 0 and cache.stats.evictions > 0
    # a copy replaced under an open handle (another inode): dropped and re-opened
    shard = ds.files.open_shards()[-1]
    copy = Path(ds.files.local().copies[shard][0])
    data = copy.read_bytes()
    copy.unlink()
    copy.write_bytes(data)
    ids = np.arange(30 * shard, 30 * shard + 30)
    np.testing.assert_array_equal(ds.read(ids)["tokens"], windows[ids])
    assert ds.files.local().copies[shard][1] == copy.stat().st_ino


def test_table_rows_through_the_cache_with_one_open_reader(tmp_path: Path) -> None:
    import uuid

    src = tmp_path / "src"
    src.mkdir()
    rng = np.random.default_rng(8)
    xs = rng.integers(0, 2**62, 5 * 40, dtype=np.int64)
    for i in range(5):
        pq.write_table(pa.table({"x": xs[i * 40 : i * 40 + 40]}), src / f"t{i}.parquet")
    root = _memory_copy(src, f"bounded-t-{uuid.uuid4().hex}")
    ds = detdata.TableRows(
        detdata.build_manifest(root),
        storage=detdata.Storage(cache_dir=tmp_path / "cache", max_open_shards=1),
        cache_row_groups=0,
    )
    for _ in range(20):
        ids = rng.integers(0, ds.num_samples, size=rng.integers(1, 30))
        np.testing.assert_array_equal(ds.read(ids)["x"], xs[ids])
        assert len(ds.files.open_shards()) <= 1 and set(ds.files.local().copies) <= set(
            ds.files.open_shards()
        )
    assert ds.files.local().handles.evictions > 0


# ------------------------------------------- the process-wide budget: many datasets, one bound
MIX_SOURCES = 40
MIX_SHARDS = 50  # per source: 2,000 shards in all, more than the descriptor limit

MIX_CHILD = textwrap.dedent(
    '''
    import collections, gc, json, os, resource, sys
    import numpy as np
    import pyarrow.parquet as pq

    kind, data, manifests, mode = sys.argv[1:5]
    # shard files only: the manifests' mapped fast forms (tokens-src00.json.columns) sit
    # next to the data folder, whose name is their prefix
    data = os.path.join(data, "")
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (int(sys.argv[5]), hard))
    import detdata
    from detdata.datasets import handles as shards_mod

    SEQ = int(sys.argv[6])
    COUNTS = {"fds": 0, "maps": 0, "calls": 0, "open": 0}


    def shard_fds():
        n = 0
        for fd in os.listdir("/proc/self/fd"):
            try:
                n += os.readlink(f"/proc/self/fd/{fd}").startswith(data)
            except OSError:
                pass
        return n


    def shard_maps():
        with open("/proc/self/maps") as fh:
            return len({line[line.index(data):] for line in fh if data in line})


    def counted(sample, rng):
        """A transform: the sample plus this process's shard descriptors / mappings."""
        COUNTS["calls"] += 1
        if COUNTS["calls"] % 4 == 1:
            COUNTS["fds"], COUNTS["maps"] = shard_fds(), shard_maps()
            COUNTS["open"] = len(shards_mod.PROCESS_HANDLES)
        out = {k: sample[k] for k in sample}
        for k in ("fds", "maps", "open"):
            out[k] = np.int64(COUNTS[k])
        return out


    def reference(folder):
        """What the writer wrote to one source, read back without detdata: rows in id order."""
        paths = sorted(os.path.join(folder, f) for f in os.listdir(folder))
        if kind == "tokens":
            rows = []
            for p in paths:
                arr = np.load(p)  # reads and closes the file
                n = (arr.size - 1) // SEQ
                rows += [arr[w * SEQ : w * SEQ + SEQ + 1] for w in range(n)]
            return {"tokens": np.stack(rows)}
        tables = [pq.read_table(p) for p in paths]
        return {
            "x": np.concatenate([t.column("x").to_numpy() for t in tables]),
            "v": np.concatenate([np.stack(t.column("v").to_pylist()) for t in tables]),
        }


    def make(manifest, cap=None):
        storage = detdata.Storage(verify="off", max_open_shards=cap)
        if kind == "tokens":
            return detdata.TokenWindows(manifest, SEQ, storage=storage)
        return detdata.TableRows(manifest, ["x", "v"], storage=storage)


    names = json.loads(open(manifests).read())  # {source name: manifest path}
    refs = [reference(os.path.join(data, name)) for name in names]
    sources = {name: make(path) for name, path in names.items()}
    mix = detdata.Mixture(sources, {name: 1 for name in names}, seed=3)
    total = sum(ds.num_samples for ds in sources.values()) // 32 * 32  # whole steps
    key = "tokens" if kind == "tokens" else "x"
    peak = {"fds": 0, "maps": 0, "open": 0}
    if mode == "direct":
        budget = 32
        shards_mod.set_max_open_shards(budget)
        assert shards_mod.PROCESS_HANDLES.capacity == shards_mod.DEFAULT_MAX_OPEN_SHARDS
        # every dataset's own cap is 128: made again with the budget as their cap (the
        # first ones dropped)
        sources = {name: make(path, cap=budget) for name, path in names.items()}
        mix = detdata.Mixture(sources, {name: 1 for name in names}, seed=3)
        gc.collect()
        assert shards_mod.PROCESS_HANDLES.capacity == budget
        for a in range(0, 3 * total, 97):
            pos = np.arange(a, a + 97)
            got = mix.fetch(pos)
            src, _, ids = mix.locate(pos)  # which sample of which source; bytes: the writer's
            for k in refs[0]:
                want = np.stack([refs[s][k][i] for s, i in zip(src.tolist(), ids.tolist())])
                assert np.array_equal(got[k], want), (k, a)
            peak["fds"] = max(peak["fds"], shard_fds())
            peak["maps"] = max(peak["maps"], shard_maps())
            peak["open"] = max(peak["open"], len(shards_mod.PROCESS_HANDLES))
            assert sum(len(ds.files.open_shards()) for ds in sources.values()) <= budget
        touched = sum(ds.files.local().handles.evictions for ds in sources.values())
    else:
        budget = detdata.datasets.handles.DEFAULT_MAX_OPEN_SHARDS
        loader = detdata.DataLoader(
            mix,
            global_batch_size=32,
            seed=1,
            num_workers=2,
            options=detdata.LoaderOptions(
                transform=counted,
                total_samples=total,
                read=detdata.ReadOptions(worker_mode=mode),
            ),
        )
        index = {}  # row bytes (tokens) or x (tables) -> (source, id): the writer's rows
        for s, ref in enumerate(refs):
            for i, row in enumerate(ref[key]):
                index[row.tobytes() if kind == "tokens" else int(row)] = (s, i)
        delivered = collections.Counter()
        for batch in loader:
            rows = {k: batch[k].numpy() for k in refs[0]}
            for r in range(rows[key].shape[0]):
                row = rows[key][r]
                s, i = index[row.tobytes() if kind == "tokens" else int(row)]
                for k in refs[0]:  # every byte of every column as the writer wrote it
                    assert np.array_equal(rows[k][r], refs[s][k][i]), (k, s, i)
                delivered[(s, i)] += 1
            for k in peak:
                peak[k] = max(peak[k], int(batch[k].max()))
        src, _, ids = mix.locate(np.arange(total))
        assert delivered == collections.Counter(zip(src.tolist(), ids.tolist()))
        touched = None
    print(json.dumps({"peak": peak, "budget": budget, "n": total, "evictions": touched}))
    '''
)


def write_mixture(base: Path, kind: str) -> tuple[str, str]:
    """40 sources x 50 shards of ``kind``; returns (data folder, json of manifest paths)."""
    rng = np.random.default_rng(11 if kind == "tokens" else 12)
    data = base / kind
    data.mkdir()
    names: dict[str, str] = {}
    for src in range(MIX_SOURCES):
        folder = data / f"src{src:02d}"
        folder.mkdir()
        for s in range(MIX_SHARDS):
            if kind == "tokens":
                windows = 1 + (s + src) % 3
                tokens = rng.integers(0, 2**31 - 1, windows * SEQ + 1, dtype=np.int32)
                np.save(folder / f"s{s:03d}.npy", tokens)
            else:
                rows = 1 + (s + src) % 3
                table = pa.table(
                    {
                        "x": rng.integers(0, 2**62, rows, dtype=np.int64),
                        "v": [rng.integers(0, 1000, 3).tolist() for _ in range(rows)],
                    }
                )
                pq.write_table(table, folder / f"s{s:03d}.parquet", row_group_size=2)
        manifest = detdata.build_manifest(str(folder))
        path = base / f"{kind}-src{src:02d}.json"
        manifest.save(str(path))
        names[folder.name] = str(path)
    listing = base / f"{kind}-manifests.json"
    listing.write_text(json.dumps(names))
    return str(data), str(listing)


@pytest.fixture(scope="module")
def mixture_corpora(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[str, str]]:
    base = tmp_path_factory.mktemp("bounded-mix")
    return {kind: write_mixture(base, kind) for kind in ("tokens", "tables")}


@pytest.mark.slow
@pytest.mark.multiproc
@pytest.mark.parametrize("mode", ["direct", "thread", "process"])
@pytest.mark.parametrize("kind", ["tokens", "tables"])
def test_a_mixture_of_many_sources_stays_within_one_process_budget(
    mixture_corpora: dict[str, tuple[str, str]], tmp_path: Path, kind: str, mode: str
) -> None:
    """40 sources x 50 shards (2,000 shards), soft RLIMIT_NOFILE 256: the sources together
    hold at most the process budget (128 by default; 32 set with `set_max_open_shards` in
    "direct"), in the main process and in each worker; every delivered byte is the writer's
    (each row looked up among the writer's rows, and the multiset of (source, sample) equal
    to the mixture's positions)."""
    data, listing = mixture_corpora[kind]
    script = tmp_path / "child.py"
    script.write_text(MIX_CHILD)
    proc = subprocess.run(
        [sys.executable, str(script), kind, data, listing, mode, str(SOFT_LIMIT), str(SEQ)],
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT)},  # this checkout's detdata
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    budget = got["budget"]
    assert budget < SOFT_LIMIT < MIX_SOURCES * MIX_SHARDS
    peak = got["peak"]
    # handles held + reads in flight (one transient preadv descriptor per reader thread)
    assert peak["fds"] + peak["maps"] > 0, peak
    assert peak["fds"] <= budget + 4 and peak["maps"] <= budget + 4, peak
    assert peak["open"] <= budget, peak
    if mode == "direct" and kind == "tables":  # readers are always kept: the budget cycles
        assert got["evictions"] > MIX_SOURCES


def test_the_process_budget_is_shared_by_every_lru_and_evicts_any_owner() -> None:
    """Brute force: the budget's content equals a reference LRU over (owner, shard) pairs."""
    budget = ProcessHandles(3)
    forgotten: dict[str, list[int]] = {"a": [], "b": []}
    a: HandleLRU[str] = HandleLRU(2, budget=budget, forget=forgotten["a"].append)
    b: HandleLRU[str] = HandleLRU(2, budget=budget, forget=forgotten["b"].append)
    assert budget.capacity == 3  # max(bound, the owners' capacities)
    a.put(1, "a1")
    a.put(2, "a2")
    b.put(1, "b1")
    assert b.full and not a.put(2, "a2") and len(budget) == 3  # a2 again: no eviction
    assert b.put(2, "b2") == [] and forgotten["a"] == [1]  # a's LRU handle went for b's
    assert a.keys() == [2] and a.get(1) is None and a.evictions == 1
    assert a.get(2) == "a2"  # now a2 is the most recently used: b1 goes next
    assert b.put(3, "b3") == [1] and forgotten["b"] == [1]  # b's own cap (2) evicts b1 first
    assert sorted(budget.order) == sorted([(a._token, 2), (b._token, 2), (b._token, 3)])
    budget.set_bound(1)  # lowering the bound evicts at once (owners' caps are 2: capacity 2)
    assert budget.capacity == 2 and len(budget) == 2 and len(a) + len(b) == 2
    big: HandleLRU[str] = HandleLRU(5, budget=budget)
    assert budget.capacity == 5  # a dataset's own cap is honoured
    del big
    gc.collect()
    assert budget.capacity == 2 and len(budget) == 2  # a dead owner's cap goes
    assert a.pop(2) in ("a2", None) and (a._token, 2) not in budget.order


def _forked_counts(queue: Any) -> None:
    queue.put((len(PROCESS_HANDLES), len(_READER_KEEP[0].files.open_shards())))


_READER_KEEP: list[Any] = []


def test_a_forked_child_starts_with_an_empty_budget(tmp_path: Path) -> None:
    import multiprocessing as mp

    for i in range(3):
        np.save(tmp_path / f"s{i}.npy", np.arange(100 * i, 100 * i + 41, dtype=np.int32))
    ds = detdata.TokenWindows(detdata.build_manifest(str(tmp_path)), 8)
    ds.read(np.arange(ds.num_samples))
    assert len(PROCESS_HANDLES) >= 3 and len(ds.files.open_shards()) == 3
    _READER_KEEP[:] = [ds]
    try:
        ctx = mp.get_context("fork")
        queue = ctx.Queue()
        proc = ctx.Process(target=_forked_counts, args=(queue,))
        proc.start()
        assert queue.get(timeout=60) == (0, 0)  # the parent's handles are not the child's
        proc.join(60)
    finally:
        _READER_KEEP.clear()
    assert len(ds.files.open_shards()) == 3  # the parent keeps its own


def test_set_max_open_shards_bounds_several_datasets_together(tmp_path: Path) -> None:
    rng = np.random.default_rng(4)
    data = []
    for d in range(3):
        folder = tmp_path / f"d{d}"
        folder.mkdir()
        arrays = [rng.integers(0, 2**31 - 1, SEQ * 5 + 1, dtype=np.int32) for _ in range(12)]
        for i, arr in enumerate(arrays):
            np.save(folder / f"s{i:02d}.npy", arr)
        windows = np.stack([a[w * SEQ : w * SEQ + SEQ + 1] for a in arrays for w in range(5)])
        # below the default own cap of 128, so the budget is 5
        storage = detdata.Storage(max_open_shards=5)
        data.append(
            (
                detdata.TokenWindows(detdata.build_manifest(str(folder)), SEQ, storage=storage),
                windows,
            )
        )
    try:
        set_max_open_shards(5)
        assert PROCESS_HANDLES.capacity == 5
        for _ in range(30):
            for ds, windows in data:
                ids = rng.integers(0, ds.num_samples, size=rng.integers(1, 20))
                np.testing.assert_array_equal(ds.read(ids)["tokens"], windows[ids])
                assert sum(len(d.files.open_shards()) for d, _ in data) <= 5
                assert len(PROCESS_HANDLES) <= 5
    finally:
        set_max_open_shards(None)
    assert PROCESS_HANDLES.capacity == DEFAULT_MAX_OPEN_SHARDS
    with pytest.raises(ConfigError, match="max_open_shards"):
        set_max_open_shards(0)
