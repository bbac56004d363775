"""Shared resume checker: restore at every step and compare bytes.

`run_digests` iterates a loader and returns one digest per delivered micro batch
(blake3 of positions + batch bytes). `check_resume_everywhere` saves the state
after every micro batch of a straight run, restores each saved state into a fresh
loader with ``mid_step="continue"``, and requires the remaining digests to equal the straight
run's suffix; the default resume (``mid_step="redo"``) must restart at the saved step's first
position and deliver the straight run's batches from there.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from typing import Any

import blake3
import numpy as np
import torch

import detdata


def batch_bytes(batch: Any) -> bytes:
    """Deterministic bytes of a delivered batch (dict of tensors, sorted keys)."""
    if isinstance(batch, torch.Tensor):
        return (
            str(batch.dtype).encode()
            + str(tuple(batch.shape)).encode()
            + batch.contiguous().numpy().tobytes()
        )
    if isinstance(batch, np.ndarray):
        return (
            str(batch.dtype).encode()
            + str(batch.shape).encode()
            + np.ascontiguousarray(batch).tobytes()
        )
    if isinstance(batch, dict):
        return b"".join(k.encode() + b"=" + batch_bytes(batch[k]) for k in sorted(batch))
    raise TypeError(type(batch))


def digest(batch: Any) -> str:
    return blake3.blake3(batch_bytes(batch)).hexdigest()


def take(loader: detdata.DataLoader, count: int) -> Iterator[Any]:
    it = iter(loader)
    for _ in range(count):
        yield next(it)


def run_digests(
    loader: detdata.DataLoader, count: int, states: list[dict[str, Any]] | None = None
) -> list[str]:
    """Digests of the next ``count`` micro batches; optionally the state after each."""
    out = []
    for batch in take(loader, count):
        out.append(digest(batch))
        if states is not None:
            states.append(json.loads(json.dumps(loader.state_dict())))  # must be pure JSON
    return out


def check_resume_everywhere(make: Callable[[], detdata.DataLoader], count: int) -> list[str]:
    """Restore at every micro batch boundary of a ``count``-batch run; compare bytes."""
    straight = make()
    states = [json.loads(json.dumps(straight.state_dict()))]
    reference = run_digests(straight, count, states)
    for k, state in enumerate(states):
        resumed = make()
        resumed.load_state_dict(state, mid_step="continue")  # micro-batch exact, asked by name
        assert resumed.samples_consumed == state["samples_consumed"]
        rest = run_digests(resumed, count - k)
        assert rest == reference[k:], f"resume after {k} micro batches diverged"
        # the default: a state saved inside a global step re-delivers that step whole
        redo = make()
        redo.load_state_dict(state)
        back = state["step_position"]["delivered_in_step"] // (
            state["layout"]["micro_batch_size"] * state["layout"]["world_size"]
        )
        assert redo.samples_consumed == state["step_position"]["first_position"]
        assert (
            redo.samples_consumed
            == state["samples_consumed"] - state["step_position"]["delivered_in_step"]
        )
        assert run_digests(redo, count - k + back) == reference[k - back :], f"redo after {k}"
    return reference
