"""Layer 3: what the bytes are: shard formats, shard digests, manifests (content-addressed by
blake3: the model, building, verifying), the registry. Imports only `detdata.base` and
`detdata.storage`."""
