"""The `DataLoader`'s options (issue 30): a short signature, self-validating option objects,
and the keywords of earlier versions mapped onto them with the same bytes.

* the signature has at most 16 parameters, torch's keywords top-level, and ``help()``
  documents each parameter and option;
* every option object refuses a bad value with a `ConfigError` naming the field, what was
  expected and found, and a hint; they are frozen and keyword-only;
* an old keyword (``rank=``, ``read_ahead=``, ...) gives the same options, bytes and state as
  the new spelling, and the bytes the documented order gives (an independent reference);
  it warns naming the new spelling; given together with its field in ``options`` it is a
  `ConfigError`.
"""

from __future__ import annotations

import ast
import dataclasses
import inspect
import pathlib
import pydoc
import warnings
from typing import Any

import numpy as np
import pytest

import detdata
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
def test_signature_has_at_most_16_parameters_with_torchs_keywords_top_level() -> None:
    params = inspect.signature(detdata.DataLoader).parameters
    assert len(params) <= 16, list(params)
    for name in (*TORCH_KEYWORDS, "global_batch_size", "micro_batch_size", "seed", "order"):
        assert params[name].kind is inspect.Parameter.KEYWORD_ONLY, name
    assert params["options"].kind is inspect.Parameter.KEYWORD_ONLY
    kinds = {p.kind for p in params.values()}
    assert inspect.Parameter.VAR_POSITIONAL in kinds and inspect.Parameter.VAR_KEYWORD in kinds


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
        lambda: detdata.ReadOptions(read_ahead=0),
        ["ReadOptions.read_ahead", "[1, 64]", "got 0"],
    ),
    (
        "read_ahead-type",
        lambda: detdata.ReadOptions(read_ahead="16"),
        ["ReadOptions.read_ahead", "integer", "'16'"],
    ),
    (
        "worker_mode",
        lambda: detdata.ReadOptions(worker_mode="greenlet"),
        ["ReadOptions.worker_mode", "'thread'", "'greenlet'"],
    ),
    ("lookahead", lambda: detdata.ReadOptions(lookahead=-1), ["ReadOptions.lookahead", "got -1"]),
    (
        "connections",
        lambda: detdata.ReadOptions(lookahead_connections=0),
        ["ReadOptions.lookahead_connections", "got 0"],
    ),
    (
        "prefetch",
        lambda: detdata.DeviceFeed(prefetch=0),
        ["DeviceFeed.prefetch", "[1, 64]", "got 0"],
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
    read = detdata.ReadOptions(worker_mode="thread", read_ahead=np.int64(4))
    assert read.worker_mode is detdata.WorkerMode.THREAD and type(read.read_ahead) is int
    with pytest.raises(dataclasses.FrozenInstanceError):
        read.read_ahead = 2  # type: ignore[misc]
    resume = detdata.ResumePolicy(allow=["seed", "seed"], mid_step="continue")
    assert resume.allow == frozenset({"seed"}) and resume.mid_step is detdata.MidStep.CONTINUE
    assert detdata.LoaderOptions() == detdata.LoaderOptions(read=detdata.ReadOptions())


def test_a_loader_refuses_options_of_another_type() -> None:
    with pytest.raises(detdata.ConfigError, match=r"options must be a detdata.LoaderOptions.*hint"):
        detdata.DataLoader(data(), global_batch_size=8, options={"rank": 0})  # type: ignore[arg-type]


# ------------------------------------------------------------ old keywords
def _documented_batches(seed: int, rank: int, world: int, micro: int, count: int) -> list[str]:
    """The micro batches of ``rank`` as docs/design.md section 4 places them, read straight
    from the array (feistel-v1 order, then ``double``): independent of the loader."""
    order = detdata.GlobalOrder(N, seed)
    out = []
    for j in range(count):
        start = j * micro * world + rank * micro
        ids = order.ids(np.arange(start, start + micro)).astype(np.int64)
        import torch

        batch = {"id": torch.from_numpy(ids), "x": torch.from_numpy((ids * 14).astype(np.int32))}
        out.append(digest(batch))
    return out


def _run(loader: detdata.DataLoader, count: int) -> tuple[list[str], dict[str, Any]]:
    got = [digest(b) for b in take(loader, count)]
    state = loader.state_dict()
    state.pop("environment")
    loader.close()
    return got, state


@pytest.mark.parametrize("workers", [0, 2])
def test_old_keywords_deliver_the_bytes_and_state_of_the_new_spelling(
    tmp_path: pathlib.Path, workers: int
) -> None:
    mode = "thread" if workers else "process"
    common: dict[str, Any] = {
        "global_batch_size": 16,
        "micro_batch_size": 4,
        "seed": 11,
        "num_workers": workers,
    }
    with pytest.warns(DeprecationWarning) as caught:
        old = detdata.DataLoader(
            data(),
            **common,
            rank=1,
            world_size=2,
            total_samples=96,
            transform=double,
            transform_id="double-v1",
            trace=tmp_path / "old.jsonl",
            worker_mode=mode,
            read_ahead=3,
            lookahead=0,
            lookahead_connections=2,
            allow_on_resume=["global_batch_size"],
            mid_step_on_resume="continue",
            device_prefetch=3,
        )
    assert len(caught) == 1  # one warning, naming every new spelling
    for spelling in ("rank= (now options=LoaderOptions(rank=...))", "ReadOptions(read_ahead="):
        assert spelling in str(caught[0].message)
    options = detdata.LoaderOptions(
        rank=1,
        world_size=2,
        total_samples=96,
        transform=double,
        transform_id="double-v1",
        trace=tmp_path / "new.jsonl",
        read=detdata.ReadOptions(
            worker_mode=mode, read_ahead=3, lookahead=0, lookahead_connections=2
        ),
        resume=detdata.ResumePolicy(allow=["global_batch_size"], mid_step="continue"),
        device=detdata.DeviceFeed(prefetch=3),
    )
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the new spelling warns of nothing
        new = detdata.DataLoader(data(), **common, options=options)
    assert old.options == dataclasses.replace(new.options, trace=tmp_path / "old.jsonl")
    old_batches, old_state = _run(old, 12)
    new_batches, new_state = _run(new, 12)
    assert old_batches == new_batches == _documented_batches(11, 1, 2, 4, 12)
    assert old_state == new_state
    old_trace = (tmp_path / "old.jsonl.rank1").read_bytes()  # rank 1 writes its own file
    assert old_trace and old_trace == (tmp_path / "new.jsonl.rank1").read_bytes()


def test_old_resume_keywords_act_as_the_resume_policy() -> None:
    """``allow_on_resume=`` / ``mid_step_on_resume=`` still decide what a resume does."""
    straight = detdata.DataLoader(data(), global_batch_size=8, micro_batch_size=4, seed=3)
    reference = [digest(b) for b in take(straight, 6)]
    saved = detdata.DataLoader(data(), global_batch_size=8, micro_batch_size=4, seed=3)
    list(take(saved, 3))  # inside step 1
    state = saved.state_dict()
    with pytest.warns(DeprecationWarning, match="ResumePolicy"):
        resumed = detdata.DataLoader(
            data(), global_batch_size=8, micro_batch_size=4, seed=3, mid_step_on_resume="continue"
        )
    resumed.load_state_dict(state)
    assert [digest(b) for b in take(resumed, 3)] == reference[3:]
    other = detdata.DataLoader(data(), global_batch_size=8, micro_batch_size=4, seed=4)
    with pytest.raises(detdata.StateError, match="seed"):
        other.load_state_dict(state)
    with pytest.warns(DeprecationWarning):
        allowed = detdata.DataLoader(
            data(), global_batch_size=8, micro_batch_size=4, seed=4, allow_on_resume=["seed"]
        )
    allowed.load_state_dict(state)
    assert allowed.samples_consumed == 8  # redo: the start of the saved step


OLD_AND_NEW: list[tuple[str, Any, Any]] = [
    ("rank", 1, detdata.LoaderOptions(rank=1, world_size=2)),
    ("world_size", 2, detdata.LoaderOptions(rank=1, world_size=2)),
    ("total_samples", 16, detdata.LoaderOptions(total_samples=16)),
    ("transform", double, detdata.LoaderOptions(transform=double)),
    ("transform_id", "t-v2", detdata.LoaderOptions(transform_id="t-v2")),
    (
        "worker_mode",
        "thread",
        detdata.LoaderOptions(read=detdata.ReadOptions(worker_mode="thread")),
    ),
    ("read_ahead", 2, detdata.LoaderOptions(read=detdata.ReadOptions(read_ahead=2))),
    ("lookahead", 7, detdata.LoaderOptions(read=detdata.ReadOptions(lookahead=7))),
    (
        "lookahead_connections",
        9,
        detdata.LoaderOptions(read=detdata.ReadOptions(lookahead_connections=9)),
    ),
    ("device", "cpu", detdata.LoaderOptions(device=detdata.DeviceFeed(device="cpu"))),
    ("device_prefetch", 5, detdata.LoaderOptions(device=detdata.DeviceFeed(prefetch=5))),
    (
        "allow_on_resume",
        ["seed"],
        detdata.LoaderOptions(resume=detdata.ResumePolicy(allow=["seed"])),
    ),
    (
        "mid_step_on_resume",
        "continue",
        detdata.LoaderOptions(resume=detdata.ResumePolicy(mid_step="continue")),
    ),
]


@pytest.mark.parametrize(("keyword", "value", "new"), OLD_AND_NEW, ids=[c[0] for c in OLD_AND_NEW])
def test_each_old_keyword_sets_its_field_and_conflicts_with_it(
    keyword: str, value: Any, new: detdata.LoaderOptions
) -> None:
    other = {"rank": {"world_size": 2}, "world_size": {"rank": 1}}.get(keyword, {})
    common: dict[str, Any] = {"global_batch_size": 8, "micro_batch_size": 4}
    with pytest.warns(DeprecationWarning, match=rf"{keyword}= \(now options=LoaderOptions\("):
        old = detdata.DataLoader(
            data(), **common, options=detdata.LoaderOptions(**other), **{keyword: value}
        )
    assert old.options == new
    with pytest.raises(detdata.ConfigError, match=rf"{keyword}=.*the same setting twice.*hint"):
        detdata.DataLoader(data(), **common, options=new, **{keyword: value})


def test_a_bad_old_keyword_names_itself_and_its_new_spelling() -> None:
    with (
        pytest.warns(DeprecationWarning),
        pytest.raises(detdata.ConfigError, match=r"read_ahead= .*ReadOptions.read_ahead.*got 0"),
    ):
        detdata.DataLoader(data(), global_batch_size=8, read_ahead=0)
    with (
        pytest.warns(DeprecationWarning),
        pytest.raises(detdata.ConfigError, match=r"device_prefetch= .*DeviceFeed\.prefetch"),
    ):
        detdata.DataLoader(data(), global_batch_size=8, device_prefetch=0)


def test_torch_habits_are_still_refused_and_typos_still_get_did_you_mean() -> None:
    with pytest.raises(detdata.ConfigError, match="micro_batch_size"):
        detdata.DataLoader(data(), 8)
    with pytest.raises(detdata.ConfigError, match="did you mean read_ahead"):
        detdata.DataLoader(data(), global_batch_size=8, read_ahed=2)
    with pytest.raises(detdata.ConfigError, match="did you mean options"):
        detdata.DataLoader(data(), global_batch_size=8, option=detdata.LoaderOptions())


# ------------------------------------------------------------------- sizes
LOADING = pathlib.Path(detdata.__file__).parent / "loading"
LOADER_MODULES = ("loader", "loader_base", "iteration", "resume", "lookup", "options")


def test_the_loader_modules_and_classes_stay_small() -> None:
    """No loader module over 700 lines, no class of it over 500 (issue 30)."""
    for name in LOADER_MODULES:
        source = (LOADING / f"{name}.py").read_text(encoding="utf-8")
        assert len(source.splitlines()) <= 700, name
        for node in ast.walk(ast.parse(source)):
            if isinstance(node, ast.ClassDef):
                size = (node.end_lineno or node.lineno) - node.lineno + 1
                assert size <= 500, (name, node.name, size)
