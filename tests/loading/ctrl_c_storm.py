"""Child process of tests/loading/test_ctrl_c_storm.py: Ctrl-C at random moments into a
loader with persistent worker processes, many rounds, every kept batch compared by bytes
with an uninterrupted run.

``python -m tests.loading.ctrl_c_storm ROUNDS SEED HANG_S`` prints one JSON line (the summary the
test asserts on). Rounds alternate: a short clean round (1-3 batches, then ``break``: the
persistent workers are kept, so the next ``iter()`` goes through torch's ``_reset``) and a
round that a timer thread ends with a real SIGINT to the main thread (``pthread_kill``,
what a terminal's Ctrl-C raises there) at a random moment: during ``iter()``, torch's
reset of the persistent workers (waiting for their ``_ResumeIteration`` replies), a
``next()``, a worker start. Each round starts where ``samples_consumed`` says and must
keep it exact.
"""

from __future__ import annotations

import faulthandler
import gc
import json
import multiprocessing
import random
import signal
import sys
import threading
import time
from typing import Any

import numpy as np

import detdata
from tests.resume_checker import digest

N = 1000
PER = 2  # micro batch size: samples per delivered batch
NUM_WORKERS = 2
MAX_DELAY_S = 0.012  # the interrupt lands within this of the round's start
ARRAYS = {"id": np.arange(N, dtype=np.int64), "x": (np.arange(N) * 5).astype(np.int32)}


class Slow:
    """Reads take a while, so an interrupt lands while torch waits for a worker."""

    num_samples = N

    def __init__(self) -> None:
        self.plain = detdata.ArrayDataset(ARRAYS)

    def read(self, i: int) -> Any:
        time.sleep(0.001)
        return self.plain.read(i)

    def identity(self) -> dict[str, Any]:
        return self.plain.identity()


def make(data: Any, **kw: Any) -> detdata.DataLoader:
    return detdata.DataLoader(data, global_batch_size=2 * PER, micro_batch_size=PER, seed=2, **kw)


class Press:
    """A timer thread that sends SIGINT to the main thread after ``delay``, and again every
    half second until stopped (as a user presses Ctrl-C again when nothing happened: CPython
    drops a KeyboardInterrupt raised inside a fork hook or a finalizer, "Exception ignored
    in ...", so a press while worker processes start can be lost)."""

    def __init__(self, delay: float) -> None:
        self.main = threading.get_ident()
        self.fired, self.stop = threading.Event(), threading.Event()
        self.presses = 0
        self.thread = threading.Thread(target=self._run, args=(delay,), daemon=True)

    def _run(self, delay: float) -> None:
        while not self.stop.wait(delay):
            self.presses += 1
            self.fired.set()
            signal.pthread_kill(self.main, signal.SIGINT)
            delay = 0.5

    def finish(self, caught: bool) -> bool:
        """Stop pressing once a press was caught; whether one was. A press sent before the
        timer stopped raises its KeyboardInterrupt in here at the latest."""
        while True:
            try:
                while self.fired.is_set() and not caught:
                    time.sleep(0.05)  # a lost press: the next one ends this
                self.stop.set()
                self.thread.join()
                time.sleep(0.01)
                return caught
            except KeyboardInterrupt:
                caught = True


def storm(rounds: int, seed: int, hang_s: float) -> dict[str, Any]:
    rng = random.Random(seed)
    dl = make(
        Slow(),
        num_workers=NUM_WORKERS,
        persistent_workers=True,
        options=detdata.LoaderOptions(read=detdata.ReadOptions(batches_ahead=1)),
        prefetch_factor=1,
    )
    kept: dict[int, list[str]] = {}  # batch index -> digests of the batches kept there
    errors: list[str] = []
    interrupts = presses = skipped = max_children = 0
    for r in range(rounds):
        # a round takes well under a second: one that hangs is dumped (every thread's stack,
        # on stderr after the round's number) and ends the process, which the test reports
        print(f"round {r}", file=sys.stderr, flush=True)
        faulthandler.dump_traceback_later(hang_s, exit=True)
        press = Press(rng.uniform(0, MAX_DELAY_S)) if r % 2 else None
        n = 10**9 if press else rng.randint(1, 3)
        start = dl.samples_consumed // PER
        batches: list[Any] = []
        caught, failure = False, None
        try:
            if press is not None:
                press.thread.start()
            for batch in dl:  # the user's loop
                batches.append(batch)  # no interrupt check between receiving and keeping it
                if len(batches) == n:
                    break
        except KeyboardInterrupt:
            caught = True
        except Exception as exc:  # the failure this test is about: never a torch internal
            failure = exc  # kept only: a press may still land in this handler
        if press is not None:
            interrupts += press.finish(caught)
            presses += press.presses
        if failure is not None:
            errors.append(f"round {r}: {type(failure).__name__}: {failure}"[:600])
        for i, batch in enumerate(batches):
            kept.setdefault(start + i, []).append(digest(batch))
        moved = dl.samples_consumed // PER - start - len(batches)
        if moved:  # counted but never received: at most the one batch an interrupt cut off
            skipped += 1
            if moved != 1 or press is None:
                errors.append(f"round {r}: {len(batches)} batches kept, {moved} more counted")
        max_children = max(max_children, len(multiprocessing.active_children()))
    faulthandler.dump_traceback_later(4 * hang_s, exit=True)
    end = dl.samples_consumed // PER
    tail: list[str] = []
    resumed_tail: list[str] = []
    try:  # the same loader goes on, and a fresh one from its state
        tail = [digest(b) for _, b in zip(range(3), dl, strict=False)]
        resumed = make(detdata.ArrayDataset(ARRAYS))
        resumed.load_state_dict(dl.state_dict(), mid_step="continue")
        resumed_tail = [digest(b) for _, b in zip(range(3), resumed, strict=False)]
    except Exception as exc:
        errors.append(f"after the rounds: {type(exc).__name__}: {exc}"[:600])
    dl.close()
    del dl
    gc.collect()
    deadline = time.monotonic() + 30
    while multiprocessing.active_children() and time.monotonic() < deadline:
        time.sleep(0.05)
    straight = make(detdata.ArrayDataset(ARRAYS))  # the uninterrupted run
    reference = [digest(b) for _, b in zip(range(end + 6), straight, strict=False)]
    return {
        "rounds": rounds,
        "interrupts": interrupts,
        "presses": presses,
        "skipped": skipped,
        "errors": errors,
        "batches": end,
        "kept": sum(len(d) for d in kept.values()),
        "mismatched": sorted(k for k, ds in kept.items() if any(d != reference[k] for d in ds)),
        "repeated": sorted(k for k, ds in kept.items() if len(ds) > 1),
        "tail_exact": tail == reference[end : end + 3] and resumed_tail == reference[end + 3 :],
        "max_children": max_children,
        "children_left": len(multiprocessing.active_children()),
    }


def main() -> None:
    # a terminal's Python raises KeyboardInterrupt on SIGINT; a process started in the
    # background by a non-interactive shell inherits SIGINT ignored, and Python keeps that
    signal.signal(signal.SIGINT, signal.default_int_handler)
    print(json.dumps(storm(int(sys.argv[1]), int(sys.argv[2]), float(sys.argv[3]))))


if __name__ == "__main__":
    main()
