"""Layer 6: from positions to delivered batches: layout, state, the `DataLoader`, reader
threads, the device feed, traces, the batch sampler."""
