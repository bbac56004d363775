"""Worker processes hand groups over through reused shared-memory slots (detdata.loading.slots).

Every test compares what the loader delivers with worker processes against an
independent reference: the same loader with ``num_workers=0`` (which never uses
slots), or the dataset's own arrays. The transport's counters only show which path
the groups took; they are never the reference.
"""

from __future__ import annotations

import contextlib
import gc
import json
import multiprocessing
import os
import signal
import subprocess
import sys
import textwrap
import threading
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

import detdata
from detdata.loading.loader import DataLoader
from detdata.loading.slots import SlotTransport
from detdata.loading.torch_workers import WorkerSource
from tests.resume_checker import digest, take

pytestmark = pytest.mark.multiproc

N = 1000
REPO = Path(__file__).resolve().parents[2]


def dataset(n: int = N, width: int = 6) -> detdata.ArrayDataset:
    ids = np.arange(n, dtype=np.int64)
    return detdata.ArrayDataset(
        {
            "id": ids,
            "x": (ids[:, None] * 7 + np.arange(width)).astype(np.int32),
            "when": (ids * 1000).astype("datetime64[ms]"),
            "ok": ids % 3 == 0,
        }
    )


def make(data: Any = None, **kw: Any) -> DataLoader:
    kw = {"global_batch_size": 8, "micro_batch_size": 4, "seed": 5, **kw}
    return DataLoader(dataset() if data is None else data, **kw)


def transport(dl: DataLoader) -> SlotTransport:
    source = dl._source
    assert isinstance(source, WorkerSource) and source.transport is not None
    return source.transport


def _plus_noise(sample: dict[str, np.ndarray], rng: np.random.Generator) -> dict[str, Any]:
    """A per-sample Python transform (holds the GIL) with position-derived randomness."""
    return {"id": sample["id"], "y": sample["x"].astype(np.float64) + rng.random(6)}


@pytest.mark.parametrize("read_ahead", [1, 4, 16])
def test_same_bytes_as_inline_and_groups_use_slots(read_ahead: int) -> None:
    """Past the first groups (which size the slots), groups come through slots; the bytes of
    every batch, over three epochs, equal the inline loader's."""
    count = 3 * N // 4 + 5
    reference = [
        digest(b)
        for b in take(
            make(options=detdata.LoaderOptions(read=detdata.ReadOptions(batches_ahead=read_ahead))),
            count,
        )
    ]
    dl = make(
        options=detdata.LoaderOptions(read=detdata.ReadOptions(batches_ahead=read_ahead)),
        num_workers=2,
    )
    assert [digest(b) for b in take(dl, count)] == reference
    sent = transport(dl)
    assert sent.slot_groups > 0 and sent.fallbacks <= 2 * 2 + 2  # the groups before sizing


def test_transformed_batches_through_slots_equal_inline() -> None:
    options = detdata.LoaderOptions(
        transform=_plus_noise, read=detdata.ReadOptions(batches_ahead=4)
    )
    kw = {"options": options}
    reference = [digest(b) for b in take(make(**kw), 120)]
    dl = make(num_workers=2, **kw)
    assert [digest(b) for b in take(dl, 120)] == reference
    assert transport(dl).slot_groups > 0


def test_kept_batches_own_their_memory_and_are_never_overwritten() -> None:
    """A slot is reused for later groups: batches the caller keeps (and edits) must be copies."""
    reference = [
        digest(b)
        for b in take(
            make(options=detdata.LoaderOptions(read=detdata.ReadOptions(batches_ahead=2))), 200
        )
    ]
    dl = make(
        options=detdata.LoaderOptions(read=detdata.ReadOptions(batches_ahead=2)),
        num_workers=2,
        prefetch_factor=1,
    )  # few slots: each reused often
    kept = list(take(dl, 200))
    assert transport(dl).slot_groups > 50
    assert [digest(b) for b in kept] == reference  # checked after all of them were delivered
    for batch in kept:
        for value in batch.values():
            assert value.untyped_storage().nbytes() == value.nbytes  # owns exactly its bytes
    dl = make(
        options=detdata.LoaderOptions(read=detdata.ReadOptions(batches_ahead=2)),
        num_workers=2,
        prefetch_factor=1,
        persistent_workers=True,
    )
    it = iter(dl)
    for _ in range(100):
        for value in next(it).values():
            value.zero_()  # the caller edits what it was given, while the workers go on
    assert [digest(next(it)) for _ in range(100)] == reference[100:]


class _Mixed:
    """Strings and ragged columns cannot use a slot: those groups take torch's transfer."""

    num_samples = 300

    def read(self, ids: np.ndarray) -> dict[str, np.ndarray]:
        ragged = np.empty(len(ids), dtype=object)
        ragged[:] = [np.arange(int(i) % 5 + 1, dtype=np.int16) for i in ids]
        return {"id": ids.copy(), "name": np.array([f"s{i}" for i in ids]), "seq": ragged}

    def identity(self) -> dict[str, Any]:
        return {"type": "mixed"}


def _plain(batch: dict[str, Any]) -> Any:
    return {
        "id": batch["id"].tolist(),
        "name": list(batch["name"]),
        "seq": [t.tolist() for t in batch["seq"]],
    }


def test_strings_and_ragged_columns_fall_back_to_torchs_transfer() -> None:
    reference = [
        _plain(b)
        for b in take(
            make(
                _Mixed(), options=detdata.LoaderOptions(read=detdata.ReadOptions(batches_ahead=4))
            ),
            90,
        )
    ]
    dl = make(
        _Mixed(),
        options=detdata.LoaderOptions(read=detdata.ReadOptions(batches_ahead=4)),
        num_workers=2,
    )
    assert [_plain(b) for b in take(dl, 90)] == reference
    assert transport(dl).slot_groups == 0 and transport(dl).fallbacks > 0


class _Growing:
    """A stream whose samples widen with the position: later groups outgrow the slots."""

    def fetch(self, positions: np.ndarray) -> dict[str, np.ndarray]:
        width = 1 + int(positions.max()) // 2
        return {"pos": positions.copy(), "x": np.full((len(positions), width), 3, np.int64)}

    def sample_ids(self, positions: np.ndarray) -> np.ndarray:
        return positions.copy()

    def identity(self) -> dict[str, Any]:
        return {"type": "growing"}


def test_groups_that_outgrow_their_slots_grow_the_ring() -> None:
    reference = [
        digest(b)
        for b in take(
            make(
                _Growing(), options=detdata.LoaderOptions(read=detdata.ReadOptions(batches_ahead=4))
            ),
            400,
        )
    ]
    dl = make(
        _Growing(),
        options=detdata.LoaderOptions(read=detdata.ReadOptions(batches_ahead=4)),
        num_workers=2,
    )
    assert [digest(b) for b in take(dl, 400)] == reference
    sent = transport(dl)
    assert sent.slot_groups > 0 and len(sent._rings) <= 2  # retired rings were freed
    assert sent._current is not None and sent._current.generation >= 3  # it grew several times


def test_resume_and_persistent_workers_across_iterations() -> None:
    """State saved mid-group, restored into a fresh loader with slots; persistent workers keep
    their ring across ``iter()`` passes."""
    reference = [
        digest(b)
        for b in take(
            make(options=detdata.LoaderOptions(read=detdata.ReadOptions(batches_ahead=4))), 150
        )
    ]
    dl = make(
        options=detdata.LoaderOptions(read=detdata.ReadOptions(batches_ahead=4)),
        num_workers=2,
        persistent_workers=True,
    )
    got = [digest(b) for b in take(dl, 37)]
    state = dl.state_dict()
    first = transport(dl)
    got += [digest(b) for b in take(dl, 40)]  # a new iter() pass of the same workers
    assert transport(dl) is first and first.slot_groups > 0
    assert got == reference[:77]
    fresh = make(
        options=detdata.LoaderOptions(read=detdata.ReadOptions(batches_ahead=4)), num_workers=2
    )
    fresh.load_state_dict(state, mid_step="continue")
    assert [digest(b) for b in take(fresh, 113)] == reference[37:]


class _FailsAt:
    num_samples = N

    def __init__(self, bad: int, mode: str) -> None:
        self.bad, self.mode = bad, mode

    def read(self, ids: np.ndarray) -> dict[str, np.ndarray]:
        if self.bad in ids.tolist():
            if self.mode == "exit":
                os._exit(3)
            raise detdata.FormatError(f"shard bad.npy: cannot decode sample {self.bad}")
        return {"id": ids.copy(), "x": np.repeat(ids[:, None], 100, axis=1)}

    def identity(self) -> dict[str, Any]:
        return {"type": "fails-at", "bad": self.bad}


def _bad_id_at(position: int) -> int:
    return int(detdata.GlobalOrder(N, 5).ids(np.array([position]))[0])


def test_dataset_error_after_slots_are_in_use_keeps_type_message_and_position() -> None:
    position = 4 * 60 + 2  # micro batch 60: well past the groups that size the slots
    dl = make(
        _FailsAt(_bad_id_at(position), "raise"),
        options=detdata.LoaderOptions(read=detdata.ReadOptions(batches_ahead=4)),
        num_workers=2,
    )
    delivered, used = 0, 0
    with pytest.raises(detdata.FormatError, match=r"shard bad\.npy: cannot decode") as err:
        for _ in dl:
            delivered += 1
            used = transport(dl).slot_groups
    assert delivered == 60 and dl.samples_consumed == 240
    assert used > 0  # groups were coming through slots when the error came
    notes = "\n".join(getattr(err.value, "__notes__", []))
    assert "in DataLoader worker process" in notes and "global positions [240, 243]" in notes


def test_worker_exit_after_slots_are_in_use_is_a_runtime_error() -> None:
    dl = make(
        _FailsAt(_bad_id_at(4 * 60 + 2), "exit"),
        options=detdata.LoaderOptions(read=detdata.ReadOptions(batches_ahead=4)),
        num_workers=2,
        timeout=20,
    )
    delivered = 0
    with pytest.raises(RuntimeError, match="exited unexpectedly") as err:
        for _ in dl:
            delivered += 1
    assert "pid" in str(err.value) or "handing over a batch" in str(err.value)
    assert dl.samples_consumed == 4 * delivered and delivered <= 60


def test_worker_killed_from_outside_mid_run_is_a_runtime_error_state_exact() -> None:
    """SIGKILL to a worker at an arbitrary moment (mid read, mid slot write or mid hand-over)."""
    data = dataset(20_000, width=64)
    total = 8 * 3000
    reference = [
        digest(b)
        for b in take(
            make(data, options=detdata.LoaderOptions(read=detdata.ReadOptions(batches_ahead=4))),
            3000,
        )
    ]
    before = {p.pid for p in multiprocessing.active_children()}
    dl = make(
        data,
        options=detdata.LoaderOptions(
            total_samples=total, read=detdata.ReadOptions(batches_ahead=4)
        ),
        num_workers=2,
        timeout=20,
    )
    got: list[str] = []
    with pytest.raises(RuntimeError, match=r"exited unexpectedly|handing over"):
        for batch in dl:
            got.append(digest(batch))
            if len(got) == 300:
                workers = [p.pid for p in multiprocessing.active_children() if p.pid not in before]
                assert len(workers) == 2, workers
                timer = threading.Timer(0.01, os.kill, (workers[0], signal.SIGKILL))
                timer.start()
    assert dl.samples_consumed == 4 * len(got) and got == reference[: len(got)]
    assert len(got) < 3000
    # the loader is usable again and continues exactly
    assert [digest(b) for b in take(dl, 20)] == reference[len(got) : len(got) + 20]


def _rings(pid: int | str = "self") -> set[int]:
    """Inodes of the detdata-slots rings process ``pid`` maps or holds open."""
    found: set[int] = set()
    with contextlib.suppress(FileNotFoundError, ProcessLookupError):
        with open(f"/proc/{pid}/maps") as maps:
            found |= {int(line.split()[4]) for line in maps if "detdata-slots" in line}
        for fd in os.listdir(f"/proc/{pid}/fd"):
            with contextlib.suppress(OSError):
                if "detdata-slots" in os.readlink(f"/proc/{pid}/fd/{fd}"):
                    found.add(os.stat(f"/proc/{pid}/fd/{fd}").st_ino)
    return found


#: Names other processes of the machine create and unlink in /dev/shm meanwhile (it is
#: shared by the whole machine; other pytest-xdist workers run loaders too): the POSIX
#: semaphores of multiprocessing (spawn / forkserver contexts: ``sem.mp-*``; fork unlinks
#: them at creation, each queue maps its own) and torch's own worker transfer
#: (file_descriptor strategy: ``shm_open("/torch_<pid>_...")``, unlinked right after the
#: mmap). detdata's rings are memfds; any other name, and any mapping or descriptor of a
#: /dev/shm file by this process or its workers, is checked.
_THEIRS = ("sem.", "torch_")


def _shm_names() -> set[str]:
    """Names in /dev/shm, less `_THEIRS` (one listing)."""
    if not Path("/dev/shm").exists():
        return set()
    return {n for n in os.listdir("/dev/shm") if not n.startswith(_THEIRS)}


def _shm_paths(pid: int | str = "self") -> set[str]:
    """/dev/shm files, less `_THEIRS`, that process ``pid`` maps or holds open: attributable
    to this test's processes alone (against a snapshot taken before), whatever other
    processes on the machine do."""
    found = set()
    with contextlib.suppress(FileNotFoundError, ProcessLookupError):
        with open(f"/proc/{pid}/maps") as maps:
            found |= {line.split(None, 5)[5].strip() for line in maps if "/dev/shm/" in line}
        for fd in os.listdir(f"/proc/{pid}/fd"):
            with contextlib.suppress(OSError):
                found.add(os.readlink(f"/proc/{pid}/fd/{fd}"))
    theirs = tuple(f"/dev/shm/{n}" for n in _THEIRS)
    return {p for p in found if p.startswith("/dev/shm/") and not p.startswith(theirs)}


@pytest.mark.skipif(not Path("/proc/self/maps").exists(), reason="needs /proc (Linux)")
@pytest.mark.parametrize("ending", ["close", "garbage", "error", "interrupt"])
def test_no_shared_memory_left_behind(ending: str) -> None:
    """Nothing is ever named in /dev/shm, and the ring is unmapped and its descriptors closed
    when the loader is closed, collected, or its iteration ends by an error or a Ctrl-C."""
    shm_before = _shm_names()
    gc.collect()
    rings_before = _rings()  # rings an earlier test of this process may still hold
    # files this process maps already (e.g. a multiprocessing heap arena, /dev/shm/pym-*, of
    # an earlier test: kept for the process's life, and inherited by forked workers)
    paths_before = _shm_paths()
    children_before = {p.pid for p in multiprocessing.active_children()}
    bad = _bad_id_at(4 * 40) if ending == "error" else -1
    dl = make(
        _FailsAt(bad, "raise"),
        options=detdata.LoaderOptions(read=detdata.ReadOptions(batches_ahead=4)),
        num_workers=2,
    )
    try:
        for i, _ in enumerate(dl):
            if i == 30:
                assert _rings() - rings_before  # the ring is in use
                assert _shm_names() <= shm_before
                workers = [
                    p.pid for p in multiprocessing.active_children() if p.pid not in children_before
                ]
                assert len(workers) == 2, workers
                assert _shm_paths() <= paths_before
                assert all(_shm_paths(w) <= paths_before for w in workers)
                if ending == "interrupt":
                    raise KeyboardInterrupt
                if ending in ("close", "garbage"):
                    break
    except (KeyboardInterrupt, detdata.FormatError):
        pass
    if ending == "close":
        dl.close()
    else:
        del dl
    gc.collect()
    assert _rings() <= rings_before
    assert _shm_names() <= shm_before
    assert _shm_paths() <= paths_before


_SPAWN_CHILD = textwrap.dedent("""
    import json, sys
    import numpy as np
    import detdata
    from tests.resume_checker import digest, take

    def make(**kw):
        ids = np.arange(500, dtype=np.int64)
        data = detdata.ArrayDataset({"id": ids, "x": np.repeat(ids[:, None], 40, axis=1)})
        return detdata.DataLoader(data, global_batch_size=8, micro_batch_size=4, seed=1,
                                  options=detdata.LoaderOptions(
                                      read=detdata.ReadOptions(batches_ahead=4)), **kw)

    if __name__ == "__main__":
        reference = [digest(b) for b in take(make(), 60)]
        dl = make(num_workers=2, multiprocessing_context=sys.argv[1])
        got = [digest(b) for b in take(dl, 60)]
        print(json.dumps({"same": got == reference, "slots": dl._source.transport.slot_groups}))
""")


@pytest.mark.slow
@pytest.mark.parametrize("context", ["spawn", "forkserver"])
def test_slots_reach_spawned_workers(tmp_path: Path, context: str) -> None:
    """The ring's descriptor reaches workers that were not forked from the loader."""
    script = tmp_path / "child.py"
    script.write_text(_SPAWN_CHILD)
    proc = subprocess.run(
        [sys.executable, str(script), context],
        capture_output=True,
        text=True,
        env={**os.environ, "PYTHONPATH": str(REPO)},
        timeout=300,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["same"] and out["slots"] > 0


def test_collate_fn_keeps_torchs_transfer() -> None:
    def collate(batch: dict[str, np.ndarray]) -> dict[str, torch.Tensor]:
        return {"id": torch.from_numpy(batch["id"].copy())}

    reference = [
        b["id"].tolist()
        for b in take(
            make(
                collate_fn=collate,
                options=detdata.LoaderOptions(read=detdata.ReadOptions(batches_ahead=4)),
            ),
            40,
        )
    ]
    dl = make(
        collate_fn=collate,
        options=detdata.LoaderOptions(read=detdata.ReadOptions(batches_ahead=4)),
        num_workers=2,
    )
    assert [b["id"].tolist() for b in take(dl, 40)] == reference
    assert isinstance(dl._source, WorkerSource) and dl._source.transport is None
