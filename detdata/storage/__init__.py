"""Layer 2: bytes on storage: fsspec access, range reads, memory maps, the batched local read
loop and read-ahead (`reads`), digests of stored bytes (`digest`), file locks, retries,
atomic writes, the verified local shard cache. Imports only `detdata.base`."""
