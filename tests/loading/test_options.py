"""The `DataLoader`'s options (issues 30, 42): a short signature, self-validating option
objects, no legacy spellings.

* the signature has at most 16 parameters a caller sets, torch's keywords top-level, every
  other keyword of torch's DataLoader refused by name (keyword-only, default
  `TorchOnly.UNSET`), no ``**kwargs``; ``help()`` documents each parameter and option;
* every option object refuses a bad value with a `ConfigError` naming the field, what was
  expected and found, and a hint; they are frozen and keyword-only;
* the options deliver the bytes the documented order gives (an independent reference);
* the flat keywords of earlier versions (``rank=``, ``read_ahead=``, ...) and typos are
  Python's ``TypeError``; torch habits a `ConfigError` naming detdata's argument.
"""

from __future__ import annotations

import ast
import dataclasses
import inspect
import pathlib
import pydoc
import warnings
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
import torch

import detdata
from detdata.loading.arguments import TorchOnly
from tests.resume_checker import digest, take

N = 240
TORCH_KEYWORDS = (
    "num_workers",
    "pin_memory",
    "collate_fn",
    "prefetch_factor",
    "persistent_workers",
    "timeout",
    "worker_init_fn",
    "multiprocessing_context",
)
OPTION_CLASSES = (
    detdata.LoaderOptions,
    detdata.ReadOptions,
    detdata.DeviceFeed,
    detdata.ResumePolicy,
)


def data() -> detdata.ArrayDataset:
    ids = np.arange(N, dtype=np.int64)
    return detdata.ArrayDataset({"id": ids, "x": (ids * 7).astype(np.int32)})


def double(sample: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    return {"id": sample["id"], "x": sample["x"] * 2}


# --------------------------------------------------------------- signature
def test_signature_has_torchs_keywords_top_level_and_refuses_the_rest_by_name() -> None:
    params = inspect.signature(detdata.DataLoader).parameters
    refused = {n for n, p in params.items() if p.default is TorchOnly.UNSET}
    settable = [n for n, p in params.items() if n not in refused and p.kind is not p.VAR_POSITIONAL]
    assert len(settable) <= 16, settable
    for name in (*TORCH_KEYWORDS, "global_batch_size", "micro_batch_size", "seed", "order"):
        assert params[name].kind is inspect.Parameter.KEYWORD_ONLY, name
    assert params["options"].kind is inspect.Parameter.KEYWORD_ONLY
    assert all(params[n].kind is inspect.Parameter.KEYWORD_ONLY for n in refused)
    assert inspect.Parameter.VAR_KEYWORD not in {p.kind for p in params.values()}
    # torch's own DataLoader is the reference: each of its keywords is taken or refused
    torch_params = set(inspect.signature(torch.utils.data.DataLoader).parameters) - {"dataset"}
    assert torch_params == set(TORCH_KEYWORDS) | refused


def test_help_documents_every_parameter_and_every_option() -> None:
    text = pydoc.render_doc(detdata.DataLoader, renderer=pydoc.plaintext)
    names = list(inspect.signature(detdata.DataLoader).parameters)
    names += [f.name for cls in OPTION_CLASSES for f in dataclasses.fields(cls)]
    names += [cls.__name__ for cls in OPTION_CLASSES]
    missing = [n for n in names if f"``{n}``" not in text and f"`{n}`" not in text]
    assert missing == [], missing
    for cls in OPTION_CLASSES:  # each option class documents its own fields
        doc = inspect.getdoc(cls) or ""
        assert all(f"``{f.name}``" in doc for f in dataclasses.fields(cls)), cls


# ------------------------------------------------------------- validation
BAD: list[tuple[str, Any, list[str]]] = [
    (
        "read_ahead",
        lambda: detdata.ReadOptions(batches_ahead=0),
        ["ReadOptions.batches_ahead", "[1, 64]", "got 0"],
    ),
    (
        "read_ahead-none",
        lambda: detdata.ReadOptions(batches_ahead=None),
        ["ReadOptions.batches_ahead", "integer", "None"],
    ),
    (
        "connections-none",
        lambda: detdata.ReadOptions(steps_ahead_connections=None),
        ["ReadOptions.steps_ahead_connections", "integer", "None"],
    ),
    (
        "read_ahead-type",
        lambda: detdata.ReadOptions(batches_ahead="16"),
        ["ReadOptions.batches_ahead", "integer", "'16'"],
    ),
    (
        "worker_mode",
        lambda: detdata.ReadOptions(worker_mode="greenlet"),
        ["ReadOptions.worker_mode", "'thread'", "'greenlet'"],
    ),
    (
        "lookahead",
        lambda: detdata.ReadOptions(steps_ahead=-1),
        ["ReadOptions.steps_ahead", "got -1"],
    ),
    (
        "connections",
        lambda: detdata.ReadOptions(steps_ahead_connections=0),
        ["ReadOptions.steps_ahead_connections", "got 0"],
    ),
    (
        "prefetch",
        lambda: detdata.DeviceFeed(copies_ahead=0),
        ["DeviceFeed.copies_ahead", "[1, 64]", "got 0"],
    ),
    ("device", lambda: detdata.DeviceFeed(device="tpu"), ["DeviceFeed.device", "'tpu'"]),
    (
        "device-type",
        lambda: detdata.DeviceFeed(device=3),
        ["DeviceFeed.device", "str or torch.device"],
    ),
    (
        "allow",
        lambda: detdata.ResumePolicy(allow=["sed"]),
        ["ResumePolicy.allow", "'sed'", "global_batch_size"],
    ),
    (
        "allow-str",
        lambda: detdata.ResumePolicy(allow="seed"),
        ["ResumePolicy.allow", "list of field names"],
    ),
    (
        "mid_step",
        lambda: detdata.ResumePolicy(mid_step="later"),
        ["ResumePolicy.mid_step", "'redo'", "'later'"],
    ),
    ("rank", lambda: detdata.LoaderOptions(rank=-1), ["rank", "got -1"]),
    ("world_size", lambda: detdata.LoaderOptions(world_size=0), ["world_size", "got 0"]),
    ("total_samples", lambda: detdata.LoaderOptions(total_samples=-8), ["total_samples", "got -8"]),
    (
        "transform",
        lambda: detdata.LoaderOptions(transform="tokenize"),
        ["transform must be callable", "'tokenize'"],
    ),
    (
        "transform_id",
        lambda: detdata.LoaderOptions(transform_id=""),
        ["transform_id", "non-empty", "''"],
    ),
    ("trace", lambda: detdata.LoaderOptions(trace=3), ["trace must be a path", "int"]),
    (
        "read",
        lambda: detdata.LoaderOptions(read={"read_ahead": 4}),
        ["LoaderOptions.read", "ReadOptions", "dict"],
    ),
    (
        "resume",
        lambda: detdata.LoaderOptions(resume=["seed"]),
        ["LoaderOptions.resume", "ResumePolicy", "list"],
    ),
]


@pytest.mark.parametrize(("case", "make", "words"), BAD, ids=[b[0] for b in BAD])
def test_a_bad_option_is_a_config_error_naming_the_field_with_a_hint(
    case: str, make: Any, words: list[str]
) -> None:
    with pytest.raises(detdata.ConfigError) as info:
        make()
    message = str(info.value)
    assert "hint:" in message, message
    for word in words:
        assert word in message, (word, message)


def test_options_are_frozen_keyword_only_and_normalised() -> None:
    with pytest.raises(TypeError):
        detdata.ReadOptions(8)  # type: ignore[misc]
    read = detdata.ReadOptions(worker_mode="thread", batches_ahead=np.int64(4))
    assert read.worker_mode is detdata.WorkerMode.THREAD and type(read.batches_ahead) is int
    with pytest.raises(dataclasses.FrozenInstanceError):
        read.batches_ahead = 2  # type: ignore[misc]
    resume = detdata.ResumePolicy(allow=["seed", "seed"], mid_step="continue")
    assert resume.allow == frozenset({"seed"}) and resume.mid_step is detdata.MidStep.CONTINUE
    assert detdata.LoaderOptions() == detdata.LoaderOptions(read=detdata.ReadOptions())


def test_a_loader_refuses_options_of_another_type() -> None:
    with pytest.raises(detdata.ConfigError, match=r"options must be a detdata.LoaderOptions.*hint"):
        detdata.DataLoader(data(), global_batch_size=8, options={"rank": 0})  # type: ignore[arg-type]


# ------------------------------------------------------- bytes, old spellings
def _documented_batches(seed: int, rank: int, world: int, micro: int, count: int) -> list[str]:
    """The micro batches of ``rank`` as docs/design.md section 4 places them, read straight
    from the array (feistel-v1 order, then ``double``): independent of the loader."""
    order = detdata.GlobalOrder(N, seed)
    out = []
    for j in range(count):
        start = j * micro * world + rank * micro
        ids = order.ids(np.arange(start, start + micro)).astype(np.int64)
        batch = {"id": torch.from_numpy(ids), "x": torch.from_numpy((ids * 14).astype(np.int32))}
        out.append(digest(batch))
    return out


@pytest.mark.parametrize("workers", [0, 2])
def test_options_deliver_the_documented_bytes_and_trace(
    tmp_path: pathlib.Path, workers: int
) -> None:
    options = detdata.LoaderOptions(
        rank=1,
        world_size=2,
        total_samples=96,
        transform=double,
        transform_id="double-v1",
        trace=tmp_path / "new.jsonl",
        read=detdata.ReadOptions(
            worker_mode="thread" if workers else "process",
            batches_ahead=3,
            steps_ahead=0,
            steps_ahead_connections=2,
        ),
        resume=detdata.ResumePolicy(allow=["global_batch_size"], mid_step="continue"),
        device=detdata.DeviceFeed(copies_ahead=3),
    )
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the options warn of nothing
        loader = detdata.DataLoader(
            data(),
            global_batch_size=16,
            micro_batch_size=4,
            seed=11,
            num_workers=workers,
            options=options,
        )
    got = [digest(b) for b in take(loader, 12)]
    loader.close()
    assert got == _documented_batches(11, 1, 2, 4, 12)
    trace = (tmp_path / "new.jsonl.rank1").read_text().splitlines()  # rank 1: its own file
    assert len(trace) == 12


def test_the_resume_policy_sets_load_state_dicts_defaults() -> None:
    """``ResumePolicy(mid_step=...)`` / ``ResumePolicy(allow=...)`` decide what a plain
    ``load_state_dict(state)`` does."""
    straight = detdata.DataLoader(data(), global_batch_size=8, micro_batch_size=4, seed=3)
    reference = [digest(b) for b in take(straight, 6)]
    saved = detdata.DataLoader(data(), global_batch_size=8, micro_batch_size=4, seed=3)
    list(take(saved, 3))  # inside step 1
    state = saved.state_dict()
    policy = detdata.LoaderOptions(resume=detdata.ResumePolicy(mid_step="continue"))
    resumed = detdata.DataLoader(
        data(), global_batch_size=8, micro_batch_size=4, seed=3, options=policy
    )
    resumed.load_state_dict(state)
    assert [digest(b) for b in take(resumed, 3)] == reference[3:]
    other = detdata.DataLoader(data(), global_batch_size=8, micro_batch_size=4, seed=4)
    with pytest.raises(detdata.StateError, match="seed"):
        other.load_state_dict(state)
    allow = detdata.LoaderOptions(resume=detdata.ResumePolicy(allow=["seed"]))
    allowed = detdata.DataLoader(
        data(), global_batch_size=8, micro_batch_size=4, seed=4, options=allow
    )
    allowed.load_state_dict(state)
    assert allowed.samples_consumed == 8  # redo: the start of the saved step


#: The flat keywords of earlier versions (issue 30 mapped them onto `LoaderOptions` with a
#: `DeprecationWarning`; issue 42 removed them), each with a value its field takes.
OLD_KEYWORDS: list[tuple[str, Any]] = [
    ("rank", 1),
    ("world_size", 2),
    ("total_samples", 16),
    ("transform", double),
    ("transform_id", "t-v2"),
    ("trace", "trace.jsonl"),
    ("worker_mode", "thread"),
    ("read_ahead", 2),
    ("lookahead", 7),
    ("lookahead_connections", 9),
    ("device", "cpu"),
    ("device_prefetch", 5),
    ("allow_on_resume", ["seed"]),
    ("mid_step_on_resume", "continue"),
]


@pytest.mark.parametrize(("keyword", "value"), OLD_KEYWORDS, ids=[c[0] for c in OLD_KEYWORDS])
def test_each_old_keyword_is_a_type_error(keyword: str, value: Any) -> None:
    with pytest.raises(TypeError, match=rf"unexpected keyword argument '{keyword}'"):
        detdata.DataLoader(data(), global_batch_size=8, **{keyword: value})


#: One word family for what is done ahead (issue 42): each former spelling of an option
#: object's field, refused with a `ConfigError` naming the new one (no alias).
RENAMED: list[tuple[Callable[..., object], str, str]] = [
    (detdata.ReadOptions, "read_ahead", "batches_ahead"),
    (detdata.ReadOptions, "lookahead", "steps_ahead"),
    (detdata.ReadOptions, "lookahead_connections", "steps_ahead_connections"),
    (detdata.DeviceFeed, "prefetch", "copies_ahead"),
]


@pytest.mark.parametrize(("make", "old", "new"), RENAMED, ids=[c[1] for c in RENAMED])
def test_each_renamed_field_is_refused_naming_the_new_one(
    make: Callable[..., object], old: str, new: str
) -> None:
    with pytest.raises(detdata.ConfigError, match=rf"\({old}=\.\.\.\) is now .*\({new}=") as err:
        make(**{old: 2})
    assert f"hint: write {new}=" in str(err.value)
    assert getattr(make(**{new: 2}), new) == 2  # the new spelling takes the same value


TORCH_HABITS: list[tuple[str, Any, str]] = [
    ("batch_size", 8, "micro_batch_size="),
    ("shuffle", True, "seed="),
    ("sampler", [0, 1], "order="),
    ("batch_sampler", [[0, 1]], "DeterministicBatchSampler"),
    ("drop_last", True, "every global batch is whole"),
    ("generator", torch.Generator(), "seed="),
    ("in_order", False, "always delivered in order"),
    ("pin_memory_device", "cuda", "device="),
]


@pytest.mark.parametrize(
    ("keyword", "value", "named"), TORCH_HABITS, ids=[h[0] for h in TORCH_HABITS]
)
def test_each_refused_torch_keyword_names_detdatas_argument(
    keyword: str, value: Any, named: str
) -> None:
    with pytest.raises(detdata.ConfigError, match=rf"DataLoader\({keyword}=.*hint: .*{named}"):
        detdata.DataLoader(data(), global_batch_size=8, **{keyword: value})


def test_positional_batch_sizes_are_refused_and_typos_are_type_errors() -> None:
    with pytest.raises(detdata.ConfigError, match="micro_batch_size"):
        detdata.DataLoader(data(), 8)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="'read_ahed'"):
        detdata.DataLoader(data(), global_batch_size=8, read_ahed=2)  # type: ignore[call-arg]
    with pytest.raises(TypeError, match="'option'"):
        detdata.DataLoader(data(), global_batch_size=8, option=detdata.LoaderOptions())  # type: ignore[call-arg]
    # no hint suggests a keyword the loader refuses (batch_siz= once got "did you mean
    # batch_size or micro_batch_size or global_batch_size?")
    with pytest.raises(TypeError) as info:
        detdata.DataLoader(data(), global_batch_size=8, batch_siz=4)  # type: ignore[call-arg]
    assert "'batch_siz'" in str(info.value) and "did you mean" not in str(info.value)


# ------------------------------------------------------------------- sizes
LOADING = pathlib.Path(detdata.__file__).parent / "loading"
LOADER_MODULES = (
    "loader",
    "cursor",
    "iteration",
    "sources",
    "torch_workers",
    "resume",
    "lookup",
    "options",
)


def test_the_loader_modules_and_classes_stay_small() -> None:
    """No loader module over 700 lines, no class of it over 500 (issue 30)."""
    for name in LOADER_MODULES:
        source = (LOADING / f"{name}.py").read_text(encoding="utf-8")
        assert len(source.splitlines()) <= 700, name
        for node in ast.walk(ast.parse(source)):
            if isinstance(node, ast.ClassDef):
                size = (node.end_lineno or node.lineno) - node.lineno + 1
                assert size <= 500, (name, node.name, size)
