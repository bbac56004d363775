"""Layer 3: what the bytes are: shard formats, manifests (content-addressed by blake3),
the registry. Imports only `detdata.base` and `detdata.storage`."""
