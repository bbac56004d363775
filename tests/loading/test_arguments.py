"""Arguments: checked at construction as torch checks them, nothing ignored silently;
interrupts and errors leave a loader that continues exactly (or a clear error)."""

from __future__ import annotations

import gc
import threading
import time
from typing import Any

import numpy as np
import pytest

import detdata
from detdata.loading.sampler import FrameworkBatchSampler
from tests.resume_checker import digest, take

N = 300


def data() -> detdata.ArrayDataset:
    ids = np.arange(N, dtype=np.int64)
    return detdata.ArrayDataset({"id": ids, "x": (ids * 5).astype(np.int32)})


def loader(**kw: Any) -> detdata.DataLoader:
    base: dict[str, Any] = {"global_batch_size": 8, "micro_batch_size": 4, "seed": 2}
    return detdata.DataLoader(kw.pop("data", None) or data(), **{**base, **kw})


#: Thread mode, for the cases that refuse what it would ignore (a bad ``worker_mode`` or
#: ``transform`` is refused by its option object: tests/loading/test_options.py).
THREAD = detdata.LoaderOptions(read=detdata.ReadOptions(worker_mode="thread"))
BAD: list[tuple[str, dict[str, Any], str]] = [
    ("timeout<0", {"num_workers": 2, "timeout": -1}, "timeout must be a number of seconds >= 0"),
    ("timeout-str", {"num_workers": 2, "timeout": "5"}, "timeout must be a number"),
    (
        "mp-context",
        {"num_workers": 2, "multiprocessing_context": "fork-server"},
        "multiprocessing_context 'fork-server' is not a start method",
    ),
    (
        "mp-context-type",
        {"num_workers": 2, "multiprocessing_context": 3},
        "multiprocessing_context must",
    ),
    (
        "mp-context-no-workers",
        {"multiprocessing_context": "spawn"},
        "multiprocessing_context needs num_workers",
    ),
    ("collate", {"collate_fn": 3}, "collate_fn must be callable"),
    (
        "worker-init",
        {"num_workers": 1, "worker_init_fn": "init"},
        "worker_init_fn must be callable",
    ),
    ("prefetch-no-workers", {"prefetch_factor": 4}, "prefetch_factor needs num_workers > 0"),
    (
        "persistent-no-workers",
        {"persistent_workers": True},
        "persistent_workers=True needs num_workers",
    ),
    (
        "persistent-not-bool",
        {"num_workers": 1, "persistent_workers": "yes"},
        "persistent_workers must be",
    ),
    (
        "thread-persistent",
        {"num_workers": 2, "options": THREAD, "persistent_workers": True},
        r"would ignore \['persistent_workers'\]",
    ),
    (
        "thread-init-timeout",
        {"num_workers": 2, "options": THREAD, "timeout": 3, "worker_init_fn": print},
        r"would ignore \['timeout', 'worker_init_fn'\]",
    ),
    (
        "thread-mp",
        {"num_workers": 2, "options": THREAD, "multiprocessing_context": "spawn"},
        r"would ignore \['multiprocessing_context'\]",
    ),
]


@pytest.mark.parametrize(("case", "kwargs", "message"), BAD, ids=[b[0] for b in BAD])
def test_bad_loader_argument_refused_at_construction(
    case: str, kwargs: dict[str, Any], message: str
) -> None:
    with pytest.raises(detdata.ConfigError, match=message):
        loader(**kwargs)


def test_unwritable_trace_path_refused_at_construction(tmp_path: Any) -> None:
    with pytest.raises(detdata.ConfigError, match=str(tmp_path)):
        loader(options=detdata.LoaderOptions(trace=tmp_path))  # a directory
    blocker = tmp_path / "file"
    blocker.write_text("x")
    with pytest.raises(detdata.ConfigError, match="trace"):
        loader(options=detdata.LoaderOptions(trace=blocker / "trace.jsonl"))  # parent is a file


def test_thread_mode_with_zero_workers_accepts_process_defaults() -> None:
    """worker_mode='thread' with num_workers=0 reads inline: nothing is ignored, nothing refused."""
    a = [
        digest(b)
        for b in take(
            loader(options=detdata.LoaderOptions(read=detdata.ReadOptions(worker_mode="thread"))), 6
        )
    ]
    assert a == [digest(b) for b in take(loader(), 6)]


def test_sampler_refuses_a_seed_the_mixture_would_ignore() -> None:
    mix = detdata.Mixture({"a": data(), "b": data()}, {"a": "0.5", "b": "0.5"}, seed=4)
    with pytest.raises(detdata.ConfigError, match=r"seed=999 would be ignored.*own seed \(4\)"):
        detdata.DeterministicBatchSampler(mix, global_batch_size=8, seed=999)
    same = detdata.DeterministicBatchSampler(mix, global_batch_size=8, seed=4)
    assert same.seed == 4


@pytest.mark.parametrize("name", ["drop_last", "batch_sampler", "collate_fn", "pin_memory"])
def test_torch_surface_of_the_loader_is_read_only(name: str) -> None:
    """These are fixed at construction (the reads are built from them): assigning one later
    would change nothing, so it is refused rather than silently kept."""
    made = loader()
    with pytest.raises(AttributeError):
        setattr(made, name, getattr(made, name))


@pytest.mark.parametrize("name", ["drop_last", "sampler"])
def test_torch_surface_of_the_samplers_is_read_only(name: str) -> None:
    for sampler in (
        detdata.DeterministicBatchSampler(64, global_batch_size=8, seed=0),
        FrameworkBatchSampler(64, global_batch_size=8, batch_size=4, seed=0),
    ):
        with pytest.raises(AttributeError):
            setattr(sampler, name, getattr(sampler, name))


def _reader_threads(before: frozenset[threading.Thread] = frozenset()) -> list[threading.Thread]:
    """Reader threads alive now, less ``before`` (an earlier test's, if any)."""
    return [
        t for t in threading.enumerate() if t.name.startswith("detdata-read") and t not in before
    ]


class FailsAt:
    def __init__(self, bad: int) -> None:
        self.inner, self.bad = data(), bad

    @property
    def num_samples(self) -> int:
        return N

    def read(self, ids: np.ndarray) -> dict[str, np.ndarray]:
        if self.bad in ids.tolist():
            raise LookupError(f"bad sample {self.bad}")
        time.sleep(0.002)
        return self.inner.read(ids)

    def identity(self) -> dict[str, Any]:
        return self.inner.identity()


def test_reader_threads_end_when_an_error_leaves_the_loop() -> None:
    gc.disable()  # the threads must end without the garbage collector's help
    try:
        before = frozenset(threading.enumerate())
        bad = int(detdata.GlobalOrder(N, 2).ids(np.array([30]))[0])
        dl = loader(
            data=FailsAt(bad),
            num_workers=2,
            options=detdata.LoaderOptions(
                read=detdata.ReadOptions(worker_mode="thread", batches_ahead=2)
            ),
        )
        with pytest.raises(LookupError):
            for _ in dl:
                pass
        assert _reader_threads(before) == []
        dl2 = loader(
            num_workers=2,
            options=detdata.LoaderOptions(read=detdata.ReadOptions(worker_mode="thread")),
        )
        with pytest.raises(ZeroDivisionError):
            for _ in dl2:
                assert _reader_threads(before)
                raise ZeroDivisionError("the training step failed")
        assert _reader_threads(before) == []
    finally:
        gc.enable()


_CTRL_C_SCRIPT = r"""
import faulthandler, os, signal, sys, threading, time
import numpy as np
import detdata
from tests.resume_checker import digest, take

# a hang shows where every thread waits (stderr, in the assertion message) before the
# test's own timeout kills the process without a word
faulthandler.dump_traceback_later(180, exit=True)
# a terminal's Python raises KeyboardInterrupt on SIGINT; a process started in the background
# by a non-interactive shell (nohup ... &) inherits SIGINT ignored, and Python keeps that
signal.signal(signal.SIGINT, signal.default_int_handler)

N = 300
ids = np.arange(N, dtype=np.int64)
plain = detdata.ArrayDataset({"id": ids, "x": (ids * 5).astype(np.int32)})


class Slow:  # reads take a while, so the interrupt lands while torch waits for a worker
    num_samples = N

    def read(self, i):
        time.sleep(0.03)
        return plain.read(i)

    def identity(self):
        return plain.identity()


def make(data, **kw):
    return detdata.DataLoader(data, global_batch_size=8, micro_batch_size=4, seed=2, **kw)


reference = [digest(b) for b in take(make(plain), 24)]
dl = make(Slow(), num_workers=2, persistent_workers=True,
          options=detdata.LoaderOptions(read=detdata.ReadOptions(batches_ahead=1)))
batches = []
for delay in (0.05, 0.1, 0.02):
    it = iter(dl)
    batches.append(next(it))
    # a terminal's Ctrl-C: SIGINT to the whole process group, worker processes included;
    # pressed again every 3 s while the loop runs on (CPython drops a KeyboardInterrupt
    # raised inside a finalizer: one CI run in many hung on a first press lost that way)
    stop = threading.Event()

    def press():
        if not stop.wait(delay):
            os.killpg(0, signal.SIGINT)
            while not stop.wait(3.0):
                print("Ctrl-C pressed again", file=sys.stderr)
                os.killpg(0, signal.SIGINT)

    timer = threading.Thread(target=press)
    try:  # the loader is infinite: only the interrupt ends this loop
        timer.start()
        for b in it:
            batches.append(b)  # no interrupt check between receiving and keeping it
    except KeyboardInterrupt:
        stop.set()
    timer.join()
    assert dl.samples_consumed == len(batches) * 4, (dl.samples_consumed, len(batches))
assert len(batches) < 24
batches += list(take(dl, 24 - len(batches)))
assert [digest(b) for b in batches] == reference, "not the uninterrupted stream"
print("EXACT", len(batches))
"""


@pytest.mark.multiproc
def test_ctrl_c_with_persistent_workers_then_iterating_again_continues_exactly(
    tmp_path: Any,
) -> None:
    """The notebook pattern: Ctrl-C (SIGINT to the process group, so the worker processes get it
    too) mid-iteration, then ``for batch in loader`` again: continues exactly. Run in its own
    session so the signal reaches nothing but that process and its workers."""
    import os
    import subprocess
    import sys

    script = tmp_path / "ctrl_c.py"
    script.write_text(_CTRL_C_SCRIPT)
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    proc = subprocess.run(
        [sys.executable, str(script)],
        cwd=root,
        capture_output=True,
        text=True,
        timeout=240,
        start_new_session=True,
        env={**os.environ, "PYTHONPATH": root},
    )
    assert proc.returncode == 0 and "EXACT 24" in proc.stdout, proc.stderr[-3000:]


@pytest.mark.parametrize("persistent", [False, True])
def test_close_stops_the_workers_of_a_live_iterator(persistent: bool) -> None:
    """``close()`` does what it says even while an iterator is suspended mid-epoch; the loader
    can then be iterated again and continues exactly."""
    import multiprocessing

    reference = [digest(b) for b in take(loader(), 6)]
    before = {p.pid for p in multiprocessing.active_children()}  # an earlier test's, if any
    dl = loader(num_workers=2, persistent_workers=persistent)
    it = iter(dl)
    got = [digest(next(it)) for _ in range(3)]
    mine = [p for p in multiprocessing.active_children() if p.pid not in before]
    assert len(mine) == 2, mine
    dl.close()
    deadline = time.monotonic() + 30
    while any(p.is_alive() for p in mine) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not any(p.is_alive() for p in mine)
    with pytest.raises(StopIteration):
        next(it)  # the closed iterator is finished
    got += [digest(b) for b in take(dl, 3)]
    assert got == reference
    dl.close()
