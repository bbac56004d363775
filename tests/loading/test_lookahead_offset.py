"""The shard cache filled ahead after a global-batch change: the planned micro steps end
where delivery ends.

After DP 8 -> DP 7 at a resume the micro-step grid starts at an offset (`Layout.offset`);
the lookahead's last planned micro step must be the last one the loader delivers (counted
by running the loader to its ``total_samples``), never one past it. Real shards on a real
nginx through a shard cache, so the lookahead is active.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

import detdata
from detdata import Storage
from detdata.datasets.tokens import TokenWindows
from detdata.loading.iteration import open_cache_ahead
from detdata.loading.loader import DataLoader
from detdata.storage.retry import RetryPolicy
from tests.servers import HttpServer

SEQ = 7
PATIENT = RetryPolicy(deadline_s=20.0, attempt_timeout_s=2.0, base_delay_s=0.01, max_delay_s=0.1)


def test_lookahead_stops_at_the_last_delivered_micro_step_on_an_offset_grid(
    http_server: HttpServer, tmp_path: Path
) -> None:
    directory, _ = http_server.new_dir()
    rng = np.random.default_rng(4)
    for i, n in enumerate((900, 700, 1100)):
        np.save(directory / f"s{i}.npy", rng.integers(0, 60_000, n).astype(np.uint16))
    manifest = detdata.build_manifest(str(directory), pattern="*.npy", progress=False)
    data = TokenWindows(
        manifest.with_root(f"{http_server.base}/{directory.name}"),
        SEQ,
        storage=Storage(
            verify="off", retry=PATIENT, cache_dir=tmp_path / "cache", shard_cache_bytes=1 << 24
        ),
    )

    def loader(world: int, gbs: int, micro: int, **kw: object) -> DataLoader:
        return DataLoader(
            data,
            global_batch_size=gbs,
            micro_batch_size=micro,
            seed=2,
            options=detdata.LoaderOptions(
                rank=0,
                world_size=world,
                read=detdata.ReadOptions(**kw),  # type: ignore[arg-type]
            ),
        )

    old = loader(8, 16, 1)
    it = iter(old)
    for _ in range(2 * 3):  # three steps of 16 (two micro steps of 8)
        next(it)
    state = old.state_dict()
    old.close()
    new = loader(7, 14, 2, steps_ahead=1000)
    new.load_state_dict(state, allow=("global_batch_size",))
    total = 48 + 4 * 14
    new.set_total_samples(total)
    assert new.layout.offset != 0  # 48 is not a multiple of 14: the grid is offset
    per = new.layout.samples_per_micro_step
    first = new.samples_consumed // per
    plan = open_cache_ahead(new._cursor, new.options.read)
    assert plan is not None and plan.active
    delivered = [new.positions_of_next().tolist()]
    for _ in new:
        delivered.append(new.positions_of_next().tolist())
    delivered.pop()  # the positions after the last batch: never read
    new.close()
    assert len(delivered) == 4 and max(delivered[-1]) < total
    assert plan.stop == first + len(delivered)
    planned = [plan.positions_of(j).tolist() for j in range(first, plan.stop)]
    assert planned == delivered
    plan.advance(first)
    try:
        assert max(j for j, _ in plan._plan) == plan.stop - 1  # the window ends at the last one
    finally:
        plan.close()
