"""After a loss spike: which samples were in the step, replay it, skip the bad ones from now on.

A small run trains and keeps a loader state per checkpoint. Say step SPIKE spiked:

1. ``loader.provenance(SPIKE)`` lists every sample of the step (rank, micro step,
   shard, token range, blake3): read straight from the shard files, they are the
   bytes the step trained on (checked here against the run's own trace).
2. Replay: a fresh loader restored from the checkpoint before the spike delivers
   steps SPIKE-2 .. SPIKE+2 again, byte for byte.
3. Exclude the spike's samples from the resume position on (`Excluded` with an
   `ExclusionList` whose content address enters the stream identity): they are
   never delivered again, every other position keeps its sample, and a replay of
   any earlier step still sees what it saw.

    python examples/loss_spike.py --workdir /tmp/detdata-loss-spike
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np
from _corpus import write_token_shards

import detdata
from detdata.datasets.exclusions import Excluded, ExclusionList

SPIKE = 6
CHECKPOINT = 4  # a checkpoint before the spike
STEPS = 10
GBS = 8


def digests(loader: detdata.DataLoader, steps: int) -> list[list[str]]:
    """Per step, the blake3 of each sample delivered (rows of the global batch)."""
    from detdata.loading.provenance import row_of, sample_digest

    out = []
    it = iter(loader)
    for _ in range(steps):
        batch = {k: v.numpy() for k, v in next(it).items()}
        out.append([sample_digest(row_of(batch, j)) for j in range(GBS)])
    loader.close()
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--workdir", default="/tmp/detdata-loss-spike")
    args = ap.parse_args()
    work = Path(args.workdir)
    if not (work / "manifest.json").exists():
        root = write_token_shards(work / "shards", tokens_per_shard=20_000)
        detdata.build_manifest(str(root)).save(str(work / "manifest.json"))
    dataset = detdata.TokenWindows(str(work / "manifest.json"), seq_len=64)
    stream = detdata.OrderedStream(dataset, seed=1234)

    # the run: states saved at each checkpoint (here: every step)
    run = detdata.DataLoader(stream, global_batch_size=GBS)
    states, trained = [], []
    it = iter(run)
    for _ in range(STEPS):
        states.append(json.loads(json.dumps(run.state_dict())))
        trained.append(next(it)["tokens"].numpy())
    run.close()

    # 1. where did step SPIKE come from?
    records = run.provenance(SPIKE)
    for rec in records:
        doc = rec.to_json()
        start, end = doc["tokens"]
        on_disk = np.load(doc["url"], mmap_mode="r")[start:end]
        assert (on_disk == trained[SPIKE][rec.row]).all()
        print(
            f"step {SPIKE} row {rec.row}: {doc['shard']} tokens [{start}, {end}) {rec.digest[:19]}"
        )
    print(f"provenance of step {SPIKE} matches the shard files: True")

    # 2. replay steps SPIKE-2 .. SPIKE+2 from the checkpoint before the spike
    replay = detdata.DataLoader(stream, global_batch_size=GBS)
    replay.load_state_dict(states[CHECKPOINT])
    again = digests(replay, SPIKE + 3 - CHECKPOINT)[SPIKE - 2 - CHECKPOINT :]
    original = detdata.DataLoader(stream, global_batch_size=GBS)
    reference = digests(original, SPIKE + 3)[SPIKE - 2 :]
    print(f"replayed steps {SPIKE - 2}..{SPIKE + 2} identical: {again == reference}")

    # 3. skip the spike's samples from the resume point on
    resume_at = states[SPIKE + 1]  # resume after the spike step
    bad = ExclusionList.of(rec.sample_id for rec in records)
    bad.save(work / "exclusions.json")
    position = resume_at["samples_consumed"]
    skipping = Excluded(stream, [(position, bad)])
    skipping.continue_from(resume_at["stream"], position)  # only appended exclusions
    resumed = detdata.DataLoader(skipping, global_batch_size=GBS)
    resumed.load_state_dict(resume_at, allow=["exclusions"])
    later = np.arange(position, position + 20_000)
    before, after = stream.sample_ids(later), skipping.sample_ids(later)
    hit = np.isin(before, bad.ids_of(None))
    only = bool((before[~hit] == after[~hit]).all() and (before[hit] != after[hit]).all())
    print(
        f"exclusions {bad.digest[:19]}: {int(hit.sum())} later positions held a bad sample; "
        f"only they changed: {only}; never delivered: {not np.isin(after, bad.ids_of(None)).any()}"
    )
    earlier = detdata.DataLoader(skipping, global_batch_size=GBS)
    earlier.load_state_dict(states[CHECKPOINT], allow=["exclusions"])
    same = (
        digests(earlier, SPIKE + 1 - CHECKPOINT)
        == [d for d in digests(detdata.DataLoader(stream, global_batch_size=GBS), SPIKE + 1)][
            CHECKPOINT:
        ]
    )
    print(f"earlier steps replayed through the exclusions unchanged: {same}")


if __name__ == "__main__":
    main()
