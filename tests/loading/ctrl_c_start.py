"""Child process of tests/loading/test_ctrl_c_storm.py: a real Ctrl-C (SIGINT raised in the
main thread) at chosen points of the start of torch's worker-process iterator, round after
round, with ``persistent_workers=True``.

``python -m tests.loading.ctrl_c_start ROUNDS`` prints one JSON line: per round the point,
what the interrupted iteration raised, and whether the next iteration delivered the bytes of
an uninterrupted run from ``samples_consumed``. The points are reached by wrapping torch's
own functions on its iterator's start path (the wrapper raises the signal, then lets torch
go on, as a Ctrl-C there would):

* ``registered``: right after torch registered the worker pids under ``id(iterator)``,
  before its iterator records that it did (the window issue 40 found);
* ``sigchld``: inside torch's ``_set_SIGCHLD_handler`` call that follows;
* ``first_reset``: at the start of the new iterator's first ``_reset`` (workers running);
* ``put_index``: while that reset hands the first indices to the workers;
* ``persistent_reset``: at the ``_reset`` of kept persistent workers (a second ``iter()``).

Every round but the persistent ones starts from closed workers (``DataLoader.close``), so
each goes through a new torch iterator, which CPython often places where an interrupted one
was.
"""

from __future__ import annotations

import faulthandler
import gc
import json
import multiprocessing
import signal
import sys
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import torch.utils.data.dataloader as torch_dl
from torch.utils.data._utils import signal_handling

import detdata
from tests.resume_checker import digest

POINTS = ("registered", "sigchld", "first_reset", "put_index", "persistent_reset")
PER = 4
IDS = np.arange(2000, dtype=np.int64)
PLAIN = detdata.ArrayDataset({"id": IDS, "x": (IDS * 5).astype(np.int32)})


def make(**kw: Any) -> detdata.DataLoader:
    return detdata.DataLoader(PLAIN, global_batch_size=2 * PER, micro_batch_size=PER, seed=2, **kw)


class Presses:
    """Raises SIGINT once at the armed point (``arm``), from a wrapper around torch's own
    function there."""

    def __init__(self) -> None:
        self.armed: str | None = None
        self.pressed = 0
        iterator = torch_dl._MultiProcessingDataLoaderIter
        self._wrap(signal_handling, "_set_worker_pids", "registered", after=True)
        self._wrap(signal_handling, "_set_SIGCHLD_handler", "sigchld", after=False)
        reset = iterator._reset

        def _reset(it: Any, loader: Any, first_iter: bool = False) -> None:
            self.press("first_reset" if first_iter else "persistent_reset")
            reset(it, loader, first_iter)

        iterator._reset = _reset  # type: ignore[method-assign]
        put = iterator._try_put_index

        def _try_put_index(it: Any) -> None:
            put(it)
            self.press("put_index")

        iterator._try_put_index = _try_put_index  # type: ignore[method-assign]

    def _wrap(self, module: Any, name: str, point: str, *, after: bool) -> None:
        original: Callable[..., Any] = getattr(module, name)

        def wrapper(*args: Any) -> Any:
            if not after:
                self.press(point)
            out = original(*args)
            if after:
                self.press(point)
            return out

        setattr(module, name, wrapper)

    def press(self, point: str) -> None:
        if self.armed == point:
            self.armed = None
            self.pressed += 1
            signal.raise_signal(signal.SIGINT)  # the default handler raises KeyboardInterrupt


def run(rounds: int) -> dict[str, Any]:
    reference = [digest(b) for _, b in zip(range(rounds * 3 + 8), make(), strict=False)]
    dl = make(
        num_workers=2,
        persistent_workers=True,
        prefetch_factor=2,
        options=detdata.LoaderOptions(read=detdata.ReadOptions(batches_ahead=1)),
    )
    presses = Presses()
    results: list[dict[str, Any]] = []
    for r in range(rounds):
        point = POINTS[r % len(POINTS)]
        print(f"round {r} {point}", file=sys.stderr, flush=True)
        faulthandler.dump_traceback_later(60, exit=True)
        if point == "persistent_reset":  # kept workers: the next iter() resets them
            for _ in zip(range(1), dl, strict=False):
                pass
        else:
            dl.close()  # no workers: the next iter() starts a new torch iterator
        presses.armed = point
        raised = "nothing"
        try:
            for _ in dl:
                break
        except BaseException as exc:  # what the interrupted iteration raised, whatever it is
            raised = f"{type(exc).__name__}: {exc}"[:300]
        presses.armed = None
        start = dl.samples_consumed // PER
        got: list[str] = []
        after = "nothing"
        try:
            got = [digest(b) for _, b in zip(range(2), dl, strict=False)]
        except BaseException as exc:
            after = f"{type(exc).__name__}: {exc}"[:300]
        results.append(
            {
                "point": point,
                "raised": raised,
                "after": after,
                "exact": got == reference[start : start + 2],
            }
        )
    dl.close()
    del dl
    gc.collect()
    deadline = time.monotonic() + 30
    while multiprocessing.active_children() and time.monotonic() < deadline:
        time.sleep(0.05)
    return {
        "results": results,
        "pressed": presses.pressed,
        "children_left": len(multiprocessing.active_children()),
    }


def main() -> None:
    signal.signal(signal.SIGINT, signal.default_int_handler)
    print(json.dumps(run(int(sys.argv[1]))))


if __name__ == "__main__":
    main()
