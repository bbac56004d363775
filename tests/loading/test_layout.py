"""`Layout`: the micro-step grid of one rank, against the layout rule written out by hand."""

from __future__ import annotations

import pytest

from detdata.base.errors import ConfigError, StateError
from detdata.loading.layout import Layout


@pytest.mark.parametrize("anchor", [0, 5, 168, 20_480_000, 20_480_000 + 504])
def test_grid_through_the_anchor_partitions_positions_by_rank(anchor: int) -> None:
    """From ``anchor`` on, micro step k covers [anchor + k*m*D, anchor + (k+1)*m*D) and rank r
    takes its r-th slice of m (docs/design.md section 4)."""
    m, d = 24, 7
    ranks = [Layout.create(None, m, d, r, anchor=anchor) for r in range(d)]
    first = anchor // (m * d)
    for k in range(4):
        expected = [anchor + k * m * d + r * m + i for r in range(d) for i in range(m)]
        got = [int(p) for lay in ranks for p in lay.positions(first + k)]
        assert got == expected


def test_resume_position_is_counted_from_its_step_start() -> None:
    lay = Layout.create(None, 24, 7, 0, anchor=20_480_000)
    lay.check_resume_position(20_480_000 + 168, 20_480_000)
    with pytest.raises(StateError, match=r"not a micro-step boundary \(100 samples into"):
        lay.check_resume_position(20_480_100, 20_480_000)


def test_bad_layouts_are_refused() -> None:
    with pytest.raises(ConfigError, match="needs micro_batch_size"):
        Layout.create(None, None, 2, 0)
    with pytest.raises(ConfigError, match="offset"):
        Layout(micro_batch_size=2, world_size=2, rank=0, offset=4)
    with pytest.raises(ConfigError, match="rank"):
        Layout.create(8, None, 2, 2)
