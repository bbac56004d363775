from typing import Any

# numpy arrays / writable buffers (collections.abc.Buffer is Python 3.12+)
Buffer = Any

def read_shards(
    prefix: bytes,
    names: list[bytes],
    shards: Buffer,
    file_at: Buffer,
    wants: Buffer,
    out: Buffer,
    iov_off: Buffer,
    iov_len: Buffer,
    iov_count: Buffer,
    stats: Buffer,
    threads: int = 1,
    /,
) -> int: ...
def stat_shards(prefix: bytes, names: list[bytes], shards: Buffer, stats: Buffer, /) -> int: ...

class PendingRead:
    def wait(self) -> int: ...

def start_read_shards(
    prefix: bytes,
    names: list[bytes],
    shards: Buffer,
    file_at: Buffer,
    wants: Buffer,
    out: Buffer,
    iov_off: Buffer,
    iov_len: Buffer,
    iov_count: Buffer,
    stats: Buffer,
    threads: int = 1,
    /,
) -> PendingRead: ...
