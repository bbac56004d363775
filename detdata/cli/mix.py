"""``detdata mix``: show which source, index in source and sample each global position reads.

Config (JSON)::

    {"seed": 1234,
     "sources": {"web": {"num_samples": 1000000}, "code": {"num_samples": 50000}},
     "weights": {"web": 0.7, "code": "3/10"},          # or:
     "schedule": [[0, {"web": 1, "code": 1}], [100000, {"web": 3, "code": 1}]],
     "allow_zero": false}                                # optional

Exactly one of ``weights`` / ``schedule``. ``--state STATE.json`` (a saved
``loader.state_dict()`` of a run over this mixture): the mixture in force in that run
instead, the weights changed during the run (``set_mixture_weights``, a controller) and at
resumes included, so each position is answered, and ``--plot`` draws the target, with the
weights in force there (the config then gives the seed and sources only; the state's seed
must be the config's). Output: a header line, then one
tab-separated line per position: ``position source index_in_source sample_id``.
With ``--plot OUT.png``: instead, a picture of each source's cumulative share against
its target over the positions, and one line per source with its share at the end.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Mapping
from typing import Any, Final

import numpy as np

from detdata.base.checks import check_count
from detdata.base.errors import ConfigError
from detdata.base.types import MAX_POSITION, Batch, IntArray
from detdata.cli.where import read_object
from detdata.datasets.capabilities import DatasetInfo
from detdata.datasets.mixture import Mixture

HEADER: Final = "position\tsource\tindex_in_source\tsample_id"
_CHUNK: Final = 1 << 16
_CONFIG_KEYS: Final = frozenset({"seed", "sources", "weights", "schedule", "allow_zero"})


class CountDataset(DatasetInfo):
    """A dataset known only by its size: enough to compute a mixture's assignment (no reads).
    Declares its (empty) `schema` through `DatasetInfo`, so a `Mixture` over it never reads."""

    def __init__(self, num_samples: int, *, name: str) -> None:
        if isinstance(num_samples, int) and num_samples == 0:
            raise ConfigError(
                f"source {name!r} is empty (num_samples == 0); hint: drop it from the config"
            )
        self._n = check_count(num_samples, f"source {name!r} num_samples")
        self.name = name

    @property
    def num_samples(self) -> int:
        return self._n

    def schema(self) -> dict[str, str]:
        """No columns: a count-only source is never read (`Mixture` asks before reading
        sample 0)."""
        return {}

    def read(self, ids: IntArray) -> Batch:
        raise ConfigError(
            f"source {self.name!r} is described by num_samples only and has no data to read; "
            f"hint: build the Mixture over real datasets to fetch samples"
        )

    def identity(self) -> dict[str, Any]:
        return {"type": "count", "num_samples": self._n}


def load_config(path: str) -> dict[str, Any]:
    """Read and shape-check a mix config file (JSON object)."""
    doc = read_object(path, "mix config")
    unknown = sorted(set(doc) - _CONFIG_KEYS)
    if unknown:
        raise ConfigError(
            f"mix config {path!r}: unknown key(s) {unknown}; known: {sorted(_CONFIG_KEYS)}"
        )
    return doc


def mixture_from_config(doc: Mapping[str, Any]) -> Mixture:
    """A `Mixture` over `CountDataset` sources described by a mix config."""
    if "seed" not in doc:
        raise ConfigError("mix config needs a 'seed' (integer)")
    sources = doc.get("sources")
    if not isinstance(sources, dict) or not sources:
        raise ConfigError("mix config needs 'sources': {name: {\"num_samples\": int}, ...}")
    datasets = {}
    for name, spec in sources.items():
        if not isinstance(spec, dict) or set(spec) != {"num_samples"}:
            raise ConfigError(
                f'mix config source {name!r} must be {{"num_samples": int}}, got {spec!r:.80}'
            )
        datasets[name] = CountDataset(spec["num_samples"], name=name)
    allow_zero = doc.get("allow_zero", False)
    if not isinstance(allow_zero, bool):
        raise ConfigError(f"mix config 'allow_zero' must be true or false, got {allow_zero!r}")
    return Mixture(
        datasets,
        doc.get("weights"),
        seed=doc["seed"],
        schedule=doc.get("schedule"),
        allow_zero=allow_zero,
    )


def schedule_of_state(path: str, seed: object) -> list[Any]:
    """The schedule of the mixture in force in a saved loader state (`ConfigError` when the
    state's stream is no mixture or has another seed than ``seed``)."""
    from detdata.datasets.exclusions import split_identity
    from detdata.loading.state import LoaderState

    core, _ = split_identity(LoaderState.from_json(read_object(path, "--state")).stream)
    if core.get("type") != "mixture" or not isinstance(core.get("schedule"), list):
        raise ConfigError(
            f"--state {path!r}: the saved run did not read a Mixture (its stream is "
            f"{core.get('type')!r}); hint: pass the state of a loader over the mixture"
        )
    if core.get("seed") != seed:
        raise ConfigError(
            f"--state {path!r}: the saved mixture's seed is {core.get('seed')!r}, the "
            f"config's {seed!r}; hint: use the config of that run"
        )
    return list(core["schedule"])


def run(args: argparse.Namespace) -> int:
    """Print the assignment of positions ``[at, at + count)``."""
    doc = load_config(args.config)
    if args.state is not None:
        schedule = schedule_of_state(args.state, doc.get("seed"))
        doc = {k: v for k, v in doc.items() if k not in ("weights", "schedule")}
        doc = {**doc, "schedule": schedule, "allow_zero": True}
    mixture = mixture_from_config(doc)
    at = check_count(args.at, "--at", minimum=0, maximum=MAX_POSITION - 1)
    count = check_count(args.count, "--count", minimum=0, maximum=MAX_POSITION - at)
    if args.plot is not None:
        return plot_shares(mixture, at, count, args.plot)
    out = sys.stdout
    out.write(HEADER + "\n")
    names = mixture.source_names
    for start in range(at, at + count, _CHUNK):
        positions = np.arange(start, min(start + _CHUNK, at + count), dtype=np.int64)
        src, index, ids = mixture.locate(positions)
        rows = zip(positions.tolist(), src.tolist(), index.tolist(), ids.tolist(), strict=True)
        out.write("".join(f"{g}\t{names[s]}\t{i}\t{d}\n" for g, s, i, d in rows))
    return 0


def plot_shares(mixture: Mixture, at: int, count: int, path: str) -> int:
    """``--plot``: draw the shares of positions ``[at, at + count)`` and print each source's."""
    from detdata.cli.plots import mixture_shares, plot_mixture_shares

    if count == 0:
        raise ConfigError("--plot needs --count of at least 1 (positions to draw)")
    shares = mixture_shares(mixture, start=at, count=count)
    plot_mixture_shares(shares, path)
    print(f"positions {at:,} .. {at + count - 1:,}: source, samples, share, target share")
    for name, counts, targets in zip(shares.names, shares.counts, shares.targets, strict=True):
        print(f"{name}\t{counts[-1]}\t{counts[-1] / count:.6f}\t{float(targets[-1]) / count:.6f}")
    print(f"plot: {path}")
    return 0


def register(subparsers: Any) -> None:
    parser = subparsers.add_parser(
        "mix",
        help="show the source, index in source and sample id of global positions of a mixture",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--config", required=True, help="mix config JSON file")
    parser.add_argument("--at", type=int, default=0, help="first global position (default 0)")
    parser.add_argument("--count", type=int, default=16, help="number of positions (default 16)")
    parser.add_argument(
        "--state",
        metavar="STATE.json",
        help="a saved loader state of a run over this mixture: answer with the weights in "
        "force in that run (changed during it or at resumes) instead of the config's",
    )
    parser.add_argument(
        "--plot",
        metavar="OUT.png",
        help="draw each source's cumulative share against its target over the positions, as a "
        "PNG, instead of listing them (needs matplotlib: pip install 'detdata[plots]')",
    )
    parser.set_defaults(func=run)
