"""Hashing a corpus anywhere: executors, partial manifests, and their deterministic merge.

The reference is always the one-machine `build_manifest` of the same files
(same entries, same id); the distributed run is a real local Dask cluster with
two worker *processes*.
"""

from __future__ import annotations

import json
from concurrent.futures import ProcessPoolExecutor, ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from detdata.base.errors import ConfigError, ManifestError, StorageError
from detdata.identity.build import build_manifest
from detdata.identity.manifest import Manifest
from detdata.identity.parts import (
    ManifestPart,
    build_part,
    listing_digest,
    merge_manifests,
    split_listing,
)

META = {"tokenizer": "b3:" + "ab" * 32, "note": "parts"}


@pytest.fixture(scope="module")
def corpus(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("parts")
    rng = np.random.default_rng(9)
    for i in range(11):
        sub = root / ("deep" if i % 3 == 0 else "")
        sub.mkdir(exist_ok=True)
        np.save(sub / f"s{i:02d}.npy", rng.integers(0, 60_000, 50 + 37 * i).astype(np.uint16))
    table = pa.table({"x": np.arange(120, dtype=np.int64)})
    pq.write_table(table, root / "t.parquet", row_group_size=50)
    return root


@pytest.fixture(scope="module")
def reference(corpus: Path) -> Manifest:
    return build_manifest(str(corpus), metadata=META, threads=1)


def test_split_listing_is_a_partition_in_order() -> None:
    rels = [f"f{i:03d}" for i in range(17)][::-1]
    for count in (1, 2, 5, 17, 30):
        parts = [split_listing(rels, i, count) for i in range(count)]
        assert [r for p in parts for r in p] == sorted(rels)
        assert max(map(len, parts)) - min(map(len, parts)) <= 1
    with pytest.raises(ConfigError, match="part index"):
        split_listing(rels, 3, 3)


@pytest.mark.parametrize("count", [1, 3, 5])
def test_parts_merge_to_the_one_machine_id(corpus: Path, reference: Manifest, count: int) -> None:
    parts = [build_part(str(corpus), part=(i, count), metadata=META) for i in range(count)]
    assert sum(len(p.shards) for p in parts) == len(reference.shards)
    for order in (parts, parts[::-1]):
        merged = merge_manifests(order)
        assert merged.id == reference.id and merged.shards == reference.shards
        assert merged.root == reference.root


def test_parts_saved_as_files_and_merged(corpus: Path, reference: Manifest, tmp_path: Path) -> None:
    files = []
    for i in range(3):
        path = tmp_path / f"part-{i}.json"
        build_part(str(corpus), part=(i, 3), metadata=META).save(str(path))
        files.append(str(path))
    doc = json.loads(Path(files[0]).read_text())
    assert doc["kind"] == "detdata.manifest-part" and doc["part"]["count"] == 3
    with pytest.raises(ManifestError, match="kind"):
        Manifest.load(files[0])  # a part is never mistaken for a dataset manifest
    merged = merge_manifests([ManifestPart.load(f) for f in files])
    assert merged.id == reference.id


def test_explicit_path_parts_and_manifests_merge(corpus: Path, reference: Manifest) -> None:
    names = [s.path for s in reference.shards]
    a = build_part(str(corpus), paths=names[::2], metadata=META)
    b = build_manifest(str(corpus), paths=names[1::2], metadata=META)  # a whole manifest too
    assert merge_manifests([b, a]).id == reference.id


def test_merge_refuses_overlaps_conflicts_and_mismatches(corpus: Path, reference: Manifest) -> None:
    names = [s.path for s in reference.shards]
    a = build_part(str(corpus), paths=names[:6], metadata=META)
    b = build_part(str(corpus), paths=names[5:], metadata=META)
    with pytest.raises(ManifestError, match=rf"shard {names[5]} is in two parts"):
        merge_manifests([a, b])
    entry = b.shards[0]
    forged = type(entry)(**{**entry.__dict__, "num_samples": entry.num_samples + 1})
    c = ManifestPart(shards=(forged, *b.shards[1:]), metadata=META, root=b.root)
    with pytest.raises(ManifestError, match=rf"conflicting entries for shard {names[5]}.*num_s"):
        merge_manifests([a, c])
    other_meta = build_part(str(corpus), paths=names[6:], metadata={**META, "note": "x"})
    with pytest.raises(ManifestError, match=r"different metadata \(keys \['note'\]"):
        merge_manifests([a, other_meta])
    moved = ManifestPart(shards=b.shards[1:], metadata=META, root="s3://bucket/elsewhere")
    with pytest.raises(ManifestError, match="different roots"):
        merge_manifests([a, moved])
    assert merge_manifests([a, moved], root=str(corpus)).shards == reference.shards
    p0, p1, p2 = (build_part(str(corpus), part=(i, 3), metadata=META) for i in range(3))
    with pytest.raises(ManifestError, match=r"missing \[1\], given twice \[\]"):
        merge_manifests([p0, p2])
    with pytest.raises(ManifestError, match=r"given twice \[2\]"):
        merge_manifests([p0, p1, p2, p2])
    q = build_part(str(corpus), part=(0, 2), metadata=META)
    with pytest.raises(ManifestError, match="different splits"):
        merge_manifests([q, p1, p2])
    with pytest.raises(ManifestError, match="explicit paths"):
        merge_manifests([p0, p1, p2, a])
    trimmed = ManifestPart(
        shards=p1.shards[1:], metadata=META, root=p1.root, index=1, count=3, listing=p1.listing
    )
    with pytest.raises(ManifestError, match="do not cover their listing"):
        merge_manifests([p0, trimmed, p2])
    assert p1.listing == listing_digest(names)


def test_build_manifest_on_executors_gives_the_same_id(corpus: Path, reference: Manifest) -> None:
    with ThreadPoolExecutor(3) as pool:
        assert build_manifest(str(corpus), metadata=META, executor=pool).id == reference.id
    with ProcessPoolExecutor(2) as procs:
        assert build_manifest(str(corpus), metadata=META, executor=procs).id == reference.id
    with pytest.raises(ConfigError, match=r"concurrent\.futures\.Executor"):
        build_manifest(str(corpus), executor=object())  # type: ignore[arg-type]


@pytest.mark.multiproc
def test_dask_local_cluster_builds_the_same_id(corpus: Path, reference: Manifest) -> None:
    distributed = pytest.importorskip("distributed")
    with (
        distributed.LocalCluster(
            n_workers=2, processes=True, threads_per_worker=1, dashboard_address=None
        ) as cluster,
        distributed.Client(cluster) as client,
    ):
        executor = client.get_executor()
        built = build_manifest(str(corpus), metadata=META, executor=executor)
        parts = [
            build_part(str(corpus), part=(i, 2), metadata=META, executor=executor) for i in range(2)
        ]
        pids = client.run(lambda: __import__("os").getpid())
    assert len(set(pids.values())) == 2  # two worker processes really ran
    assert built.id == reference.id and built.shards == reference.shards
    assert merge_manifests(parts).id == reference.id


class _Losing(ThreadPoolExecutor):
    """A real thread pool whose ``map`` loses one task's result (``drop``) or repeats one."""

    def __init__(self, drop: int | None, repeat: bool = False) -> None:
        super().__init__(2)
        self.drop, self.repeat = drop, repeat

    def map(self, fn, *iterables, timeout=None, chunksize=1, **kw):  # type: ignore[no-untyped-def,override]
        results = list(super().map(fn, *iterables, timeout=timeout, chunksize=chunksize))
        if self.repeat:
            results[1] = results[0]
        elif self.drop is not None:
            del results[self.drop]
        return iter(results)


@pytest.mark.parametrize(("drop", "repeat"), [(-1, False), (0, False), (None, True)])
def test_an_executor_losing_a_task_is_refused_naming_the_shard(
    corpus: Path, reference: Manifest, drop: int | None, repeat: bool
) -> None:
    names = [s.path for s in reference.shards]
    missing = names[-1] if drop == -1 else names[0] if drop == 0 else names[1]
    with _Losing(drop, repeat) as pool, pytest.raises(StorageError, match=rf"shard {missing}\b"):
        build_manifest(str(corpus), metadata=META, executor=pool)


def test_a_failing_task_names_its_shard(corpus: Path, tmp_path: Path) -> None:
    """An OS error inside a task (here: a shard that is a folder) names the shard, with
    threads and on an executor."""
    root = tmp_path / "root"
    root.mkdir()
    np.save(root / "a.npy", np.arange(9, dtype=np.uint16))
    (root / "b.npy").mkdir()
    for executor in (ThreadPoolExecutor(2), None):
        with pytest.raises(StorageError, match=r"shard b\.npy: cannot be hashed") as failed:
            build_manifest(str(root), paths=["a.npy", "b.npy"], executor=executor)
        assert isinstance(failed.value.__cause__, IsADirectoryError)
