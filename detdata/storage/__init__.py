"""Layer 2: bytes on storage: fsspec access, range reads, retries, atomic writes, the
verified local shard cache. Imports only `detdata.base`."""
