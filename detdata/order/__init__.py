"""Layer 4: pure functions of (seed, position): the `feistel-v1` order, per-sample
generator keys, the chunk memo. No datasets, no torch, no I/O."""
