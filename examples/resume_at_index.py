"""Resume a run at a given global sample index (e.g. after losing the loader state).

The loader state is one integer plus identity fields, so the position can be
set directly: the next batch starts at global sample ``--at`` in O(1), whatever
the position (try --at 1000000000000).

    python examples/resume_at_index.py --at 4096
"""

from __future__ import annotations

import argparse
import tempfile

import numpy as np
from _corpus import write_token_shards

import detdata


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument(
        "--at", type=int, default=4096, help="global sample index (multiple of the global batch)"
    )
    ap.add_argument("--global-batch", type=int, default=32)
    args = ap.parse_args()
    root = write_token_shards(tempfile.mkdtemp(prefix="detdata-resume-"))
    dataset = detdata.TokenWindows(detdata.build_manifest(str(root)), seq_len=128)
    loader = detdata.DataLoader(dataset, global_batch_size=args.global_batch, seed=7)

    state = loader.state_dict()
    state["samples_consumed"] = args.at  # the one integer that matters
    loader.load_state_dict(state)
    batch = next(iter(loader))

    order = detdata.GlobalOrder(dataset.num_samples, 7)
    expected = dataset.read(order.ids(np.arange(args.at, args.at + args.global_batch)))["tokens"]
    same = bool(np.array_equal(batch["tokens"].numpy(), expected))
    print(
        f"resumed at {args.at} (epoch {args.at // dataset.num_samples}): batch equals positions "
        f"[{args.at}, {args.at + args.global_batch}) -> {same}"
    )
    if not same:
        raise SystemExit(1)


if __name__ == "__main__":
    main()
