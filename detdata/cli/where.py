"""``detdata where --state S --step N --data MODULE:FUNCTION``: every sample of a global step.

The data definition is Python code, the same code the training script runs:
``--data`` names a function (``package.module:function`` or ``path/to/file.py:function``)
called with no arguments that returns the `DataLoader`, `Stream` (e.g. `Mixture`,
`Excluded`) or `Dataset` of the run. The saved state ``S`` (``json.dump(loader.state_dict())``)
is loaded into it, so a definition that does not match the run (other manifests,
seed, weights, batch) is refused exactly as a resume would be; a bare stream or
dataset gets a loader built with the state's global batch, micro batch, world size
and seed (a batch schedule too: the step's positions follow the state's step <-> position
map). One JSON object per sample (``SampleRecord.to_json``) on stdout;
``--decode MODULE:FUNCTION`` adds the function's result (e.g. detokenised text) as
``text``.

Every sample is answered with the configuration in force when it was delivered: the seed,
data and order of that time (a change allowed at a resume is in the state's history; a
stream this definition cannot rebuild is refused naming the change), and the ranks and micro
steps of the layout the state's history records, not this process's (a ``build_loader``
that reads rank and world size from torch.distributed sees world 1 here). A step after the
state's position is answered as the run delivers it unless a later resume changed something
(a note on stderr says so); a step past the loader's ``total_samples`` is refused.
Exit 0, or 2 (unusable definition, state or step).
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import json
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from detdata.base.errors import ConfigError
from detdata.loading.state import K_GLOBAL_BATCH, K_LAYOUT, K_SEED
from detdata.order.batches import BatchSchedule


def load_callable(spec: str, what: str) -> Callable[..., Any]:
    """The function named by ``MODULE:FUNCTION`` or ``FILE.py:FUNCTION``."""
    target, sep, name = spec.rpartition(":")
    if not sep or not target or not name:
        raise ConfigError(
            f"{what} must be MODULE:FUNCTION or FILE.py:FUNCTION, got {spec!r}; hint: "
            "e.g. --data train.py:build_loader"
        )
    if target.endswith(".py"):
        path = Path(target)
        if not path.is_file():
            raise ConfigError(f"{what}: file {target} not found")
        module_spec = importlib.util.spec_from_file_location(f"_detdata_user_{path.stem}", path)
        if module_spec is None or module_spec.loader is None:
            raise ConfigError(f"{what}: cannot import {target}")
        module = importlib.util.module_from_spec(module_spec)
        sys.path.insert(0, str(path.parent.resolve()))
        try:
            module_spec.loader.exec_module(module)
        finally:
            sys.path.remove(str(path.parent.resolve()))
    else:
        try:
            module = importlib.import_module(target)
        except ImportError as exc:
            raise ConfigError(f"{what}: cannot import module {target!r}: {exc}") from None
    fn: Callable[..., Any] | None = getattr(module, name, None)
    if not callable(fn):
        raise ConfigError(f"{what}: {target} has no function {name!r}")
    return fn


def read_object(path: str, what: str = "state", hint: str = "") -> dict[str, Any]:
    """The JSON object in file ``path`` (a ``what``: ``state``, ``--config``, ``mix config``),
    or `ConfigError` naming it: unreadable, not UTF-8 JSON (or nested too deep), or not an
    object (these two end in ``hint``)."""
    try:
        with open(path, encoding="utf-8") as fh:
            doc = json.load(fh)
    except OSError as exc:
        raise ConfigError(f"cannot read {what} {path}: {exc.strerror or exc}") from None
    except (ValueError, RecursionError) as exc:  # not UTF-8, not JSON, too deep
        raise ConfigError(f"{what} {path}: not valid JSON ({exc}){hint}") from None
    if not isinstance(doc, dict):
        raise ConfigError(f"{what} {path}: expected a JSON object, got {type(doc).__name__}{hint}")
    return doc


def loader_for(data_spec: str, state: dict[str, Any] | None) -> Any:
    """The run's `DataLoader` from the ``--data`` function, with ``state`` loaded (checked)."""
    from detdata.loading.loader import DataLoader
    from detdata.loading.options import LoaderOptions

    made = load_callable(data_spec, "--data")()
    if isinstance(made, DataLoader):
        loader = made
    elif state is None or state.get(K_GLOBAL_BATCH) is None:
        raise ConfigError(
            "--data returned a stream or dataset and no --state gives the global batch; "
            "hint: pass --state, or return the DataLoader"
        )
    else:
        layout = state.get(K_LAYOUT) or {}
        world = int(layout.get("world_size", 1))
        try:  # an int or a `BatchSchedule`'s JSON: steps then follow the state's history
            schedule = BatchSchedule.from_json(state[K_GLOBAL_BATCH])
        except ConfigError as exc:
            raise ConfigError(
                f"--state: field {K_GLOBAL_BATCH!r} is not a batch schedule: {exc}"
            ) from None
        loader = DataLoader(
            made,
            global_batch_size=schedule,
            micro_batch_size=layout.get("micro_batch_size"),
            options=LoaderOptions(rank=0, world_size=world),
            seed=int(state.get(K_SEED, 0)),
        )
    if state is not None:
        loader.load_state_dict(state)
    return loader


def register(sub: Any) -> None:
    p = sub.add_parser(
        "where",
        help="every sample of a global step: rank, micro step, source, id, shard, range, blake3",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--state", required=True, help="a saved loader state (JSON file)")
    p.add_argument("--step", required=True, type=int, help="the global step")
    p.add_argument(
        "--data", required=True, metavar="MODULE:FUNCTION", help="builds the run's loader/stream"
    )
    p.add_argument("--decode", metavar="MODULE:FUNCTION", help="sample dict -> text")
    p.set_defaults(func=run_where)


def run_where(args: argparse.Namespace) -> int:
    if args.step < 0:
        raise ConfigError(f"--step must be >= 0, got {args.step}")
    loader = loader_for(args.data, read_object(args.state))
    decode = None if args.decode is None else load_callable(args.decode, "--decode")
    records = loader.provenance(args.step, decode=decode, as_saved=True)
    saved = loader.samples_consumed
    if loader.position_of_step(args.step + 1) > saved:
        last = "none" if saved == 0 else str(loader.step_of_position(saved - 1))
        print(
            f"detdata: note: step {args.step} is after the state's position {saved} (last "
            f"delivered step {last}): answered as the run delivers it if no later resume "
            "changed its data, seed or layout",
            file=sys.stderr,
        )
    for record in records:
        print(json.dumps(record.to_json(), sort_keys=True, default=str))
    return 0
