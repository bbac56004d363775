"""Layer 4: pure functions of (seed, position): the `feistel-v1` and `locality-v1` orders
and their inverses, the `mixture-v1` assignment, `packing-v1`, batch-size schedules, per-sample
generator keys, the chunk memo. No datasets, no torch, no I/O."""
