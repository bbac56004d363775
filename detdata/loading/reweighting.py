"""Mixture weights that change during a run (`DataLoader.set_mixture_weights`, a
`MixtureController`), replayed exactly at a resume (`replay`): docs/design.md section 3,
"Weights changed during a run".
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from fractions import Fraction
from typing import Any, Protocol, runtime_checkable

from detdata.base.canonical import canonical_json
from detdata.base.errors import ConfigError, StateError
from detdata.datasets.base import Dataset, Stream
from detdata.datasets.capabilities import Reweights, reweights
from detdata.loading.history import K_WEIGHTS, Change, Plan, history_error
from detdata.order.mixing import rational


@runtime_checkable
class MixtureController(Protocol):
    """Decides the mixture weights of each global step: the loader asks
    ``mixture_weights(step)`` before the first micro batch of every global step, on every rank
    (which must answer alike); weights of every source take effect from that step's first
    position (as `DataLoader.set_mixture_weights`), None keeps those in force."""

    def mixture_weights(self, step: int) -> Mapping[str, Any] | None: ...


def weights_json(proportions: Mapping[str, Fraction]) -> dict[str, str]:
    """``{name: "p/q"}``: exact proportions as the history records them."""
    return {name: rational(f) for name, f in proportions.items()}


def effect_position(plan: Plan, consumed: int) -> int:
    """The first position of the next global step: ``consumed`` itself when it is a step's
    first position (nothing of that step delivered yet), else the start of the step after
    the one being delivered."""
    step = plan.step_of(consumed)
    start = plan.start_of(step)
    return consumed if start == consumed else plan.start_of(step + 1)


def reweightable(stream: Stream | Dataset) -> Reweights:
    """``stream`` as a `Reweights` stream that mixes, or a `ConfigError` saying what it is."""
    mixture = reweights(stream)
    if mixture is None:
        raise ConfigError(
            f"cannot change mixture weights: this loader reads a {type(stream).__name__}, not "
            "a detdata.Mixture (or an Excluded over one); hint: build the loader over "
            "Mixture(sources, weights, seed=...)"
        )
    return mixture


def agree_across_ranks(step: int, position: int, weights: Mapping[str, str]) -> None:
    """Every rank of the default process group asks for ``weights`` from ``position`` (step
    ``step``); else a `ConfigError` on every rank naming the ranks of each distinct request
    (nothing is applied). A collective: every rank must call it. Without an initialised
    process group (one process) there is nothing to compare."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return
    mine = {"step": step, "position": position, "weights": dict(weights)}
    found: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(found, mine)
    groups: dict[bytes, list[int]] = {}
    for rank, request in enumerate(found):
        groups.setdefault(canonical_json(request), []).append(rank)
    if len(groups) == 1:
        return
    shown = "; ".join(
        f"rank(s) {ranks} ask for {found[ranks[0]]['weights']} from step "
        f"{found[ranks[0]]['step']} (position {found[ranks[0]]['position']})"
        for ranks in groups.values()
    )
    raise ConfigError(
        f"mixture weights differ across ranks before step {step}: {shown}; nothing was "
        "changed on any rank; hint: compute the weights from values reduced across ranks "
        "(all_reduce the per-source losses) so that every rank passes the same weights"
    )


def recorded(plan: Plan) -> list[tuple[int, dict[str, str]]]:
    """The weight changes of ``plan``'s history as ``(position, {name: "p/q"})``, in order."""
    return [(change.position, _weights_of(change)) for change in plan.weight_changes()]


def _weights_of(change: Change) -> dict[str, str]:
    new = change.new
    if not isinstance(new, Mapping) or not all(
        isinstance(k, str) and isinstance(v, str) for k, v in new.items()
    ):
        raise history_error(
            f"loader state history: the change {change.describe()} must give the new "
            f"{K_WEIGHTS} as {{source: 'p/q'}}, found {new!r:.80}; the state was edited or "
            "corrupted"
        )
    return dict(new)


def replay(stream: Stream | Dataset, changes: Sequence[tuple[int, Mapping[str, str]]]) -> Stream:
    """``stream`` after the recorded ``changes``; a stream that cannot change its weights
    is a `StateError` naming ``mixture_weights``."""
    mixture = reweights(stream)
    if mixture is None:
        raise StateError(
            f"the saved state's history changes the mixture weights during the run "
            f"({len(changes)} changes, the first at position {changes[0][0]}), but this "
            f"loader reads a {type(stream).__name__}, not a Mixture; hint: build the loader "
            "over the run's Mixture",
            fields=(K_WEIGHTS,),
        )
    try:
        return mixture.with_weight_changes(changes)
    except ConfigError as exc:
        raise StateError(
            f"the saved state's mixture weight changes cannot be replayed on this loader's "
            f"mixture: {exc}",
            fields=(K_WEIGHTS,),
        ) from None
