"""Every detdata error keeps its class across worker processes, reader threads and inline reads.

A dataset raises each `DetdataError` subclass (found by walking the class tree, so a
new one is covered without editing this test) from ``read``; the loader runs it with
``num_workers=0``, ``worker_mode="thread"`` and ``worker_mode="process"`` (fork and
spawn). ``except detdata.StorageError`` (and every class) must still catch it, it
must still be the matching built-in, and its message must survive. Pickling keeps the
attributes too.
"""

from __future__ import annotations

import pickle
from typing import Any

import numpy as np
import pytest

import detdata
import detdata.base.errors as errors
from detdata.base.types import Batch, IntArray


def _subclasses(cls: type[BaseException]) -> list[type[BaseException]]:
    out = [cls]
    for sub in cls.__subclasses__():
        out += [s for s in _subclasses(sub) if s not in out]
    return out


ERROR_TYPES = [t for t in _subclasses(errors.DetdataError) if t.__module__.startswith("detdata")]
MESSAGE = "sample 5 cannot be read: the marker text"


def test_the_tree_holds_every_documented_error() -> None:
    names = {t.__name__ for t in ERROR_TYPES}
    assert {"ConfigError", "StorageError", "RetriesExhausted", "VerificationError"} <= names
    assert {"ShortRead", "StateError", "FormatError", "ManifestError", "RegistryError"} <= names


class Failing:
    """Eight samples; reading sample 5 raises ``kind``."""

    def __init__(self, kind: type[BaseException]) -> None:
        self.kind = kind

    @property
    def num_samples(self) -> int:
        return 8

    def schema(self) -> dict[str, str]:
        return {"x": "int64"}

    def identity(self) -> dict[str, Any]:
        return {"type": "failing", "kind": self.kind.__name__}

    def read(self, ids: IntArray) -> Batch:
        ids = np.asarray(ids, dtype=np.int64)
        if 5 in ids.tolist():
            if self.kind is errors.RetriesExhausted:  # as the retry loop raises it
                raise self.kind(
                    MESSAGE, shard="s.npy", url="http://h/s.npy", attempts=2, last_error=OSError()
                )
            raise self.kind(MESSAGE)
        return {"x": ids.copy()}


def _built_in(kind: type[BaseException]) -> type[BaseException]:
    for base in kind.__mro__:
        if base.__module__ == "builtins" and base not in (Exception, BaseException, object):
            return base
    return Exception


THREADS = detdata.LoaderOptions(read=detdata.ReadOptions(worker_mode="thread"))
MODES: list[dict[str, Any]] = [
    {"num_workers": 0},
    {"num_workers": 2, "options": THREADS},
    {"num_workers": 2},  # worker processes: the default worker mode
    {"num_workers": 1, "multiprocessing_context": "spawn"},
]


#: spawn start-up is slow: three representative classes run under spawn (the others take the
#: same path); the others' spawn cases run the process case again, in the slow set only
SPAWNED = (errors.RetriesExhausted, errors.StorageError, errors.VerificationError)
MODE_IDS = ["inline", "thread", "process", "spawn"]
CASES = [
    pytest.param(
        mode,
        kind,
        id=f"{mode_id}-{kind.__name__}",
        marks=[pytest.mark.slow] if mode_id == "spawn" and kind not in SPAWNED else [],
    )
    for mode_id, mode in zip(MODE_IDS, MODES, strict=True)
    for kind in ERROR_TYPES
]


@pytest.mark.parametrize(("mode", "kind"), CASES)
def test_each_error_keeps_its_class_in_each_worker_mode(
    kind: type[BaseException], mode: dict[str, Any]
) -> None:
    if mode.get("multiprocessing_context") == "spawn" and kind not in SPAWNED:
        mode = {"num_workers": 2}
    loader = detdata.DataLoader(
        Failing(kind), global_batch_size=4, micro_batch_size=2, seed=0, **mode
    )
    with pytest.raises(kind) as caught:
        for _ in loader:
            pass
    assert type(caught.value) is kind
    assert isinstance(caught.value, _built_in(kind))
    assert isinstance(caught.value, errors.DetdataError)
    assert MESSAGE in str(caught.value)


@pytest.mark.parametrize("kind", ERROR_TYPES, ids=lambda t: t.__name__)
def test_each_error_pickles_with_its_attributes(kind: type[BaseException]) -> None:
    exc = kind(MESSAGE)
    exc.extra = "kept"  # type: ignore[attr-defined]
    if kind is errors.RetriesExhausted:
        exc = kind(MESSAGE, shard="s.npy", url="http://h/s.npy", attempts=3, last_error=OSError(5))
    again = pickle.loads(pickle.dumps(exc))
    assert type(again) is kind and str(again) == str(exc)
    assert again.__dict__.keys() == exc.__dict__.keys()
    for key, value in exc.__dict__.items():
        if not isinstance(value, BaseException):
            assert getattr(again, key) == value, key
