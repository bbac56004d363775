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
    state: Buffer | None = None,
    ident: Buffer | None = None,
    sizes: Buffer | None = None,
    /,
) -> int: ...
def record_firsts(
    state: Buffer, ident: Buffer, ids: Buffer, now: Buffer, seen: Buffer, /
) -> None: ...

class NativeRead:
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
    state: Buffer | None = None,
    ident: Buffer | None = None,
    sizes: Buffer | None = None,
    /,
) -> NativeRead: ...
