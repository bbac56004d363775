"""The fault proxy's shared link (tests/faultproxy.py `Link`) with several connections at once,
on nginx: the bytes are the file's, all connections together never beat the bandwidth, and a
connection with a fault still gets its fault under a link (its own, unpipelined path).

Only lower bounds on time are asserted (a loaded machine can make a transfer slower, never
faster than the emulated link allows); how close to the link it gets is measured by
benchmarks/remote.py (``measured_ceiling_samples_per_s``).
"""

from __future__ import annotations

import threading
import time
import urllib.error
import urllib.request

import pytest

from tests.faultproxy import Fault, FaultProxy, Link
from tests.servers import HttpServer

SIZE = 1_600_000
BANDWIDTH = 8e6  # 1.6 MB take >= 0.2 s however many connections share the link
LATENCY = 0.01


def get(url: str, start: int, end: int) -> bytes:
    request = urllib.request.Request(url, headers={"Range": f"bytes={start}-{end - 1}"})
    with urllib.request.urlopen(request, timeout=30) as r:
        return bytes(r.read())


@pytest.fixture
def blob(http_server: HttpServer) -> tuple[str, bytes]:
    directory, _ = http_server.new_dir()
    data = bytes((i * 7 + i // 251) % 256 for i in range(SIZE))
    (directory / "blob.bin").write_bytes(data)
    return f"{directory.name}/blob.bin", data


def test_parallel_connections_share_the_bandwidth_and_get_their_bytes(
    http_server: HttpServer, blob: tuple[str, bytes]
) -> None:
    path, data = blob
    parts = 4
    bounds = [(i * SIZE // parts, (i + 1) * SIZE // parts) for i in range(parts)]
    got: dict[int, bytes] = {}
    link = Link(bandwidth_bps=BANDWIDTH, latency_s=LATENCY)
    with FaultProxy(http_server.port, link=link) as proxy:
        url = f"http://{proxy.address}/{path}"

        def fetch(i: int) -> None:
            got[i] = get(url, *bounds[i])

        threads = [threading.Thread(target=fetch, args=(i,)) for i in range(parts)]
        began = time.monotonic()
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        took = time.monotonic() - began
    assert [got[i] for i in range(parts)] == [data[a:b] for a, b in bounds]
    assert took >= SIZE / BANDWIDTH + LATENCY  # one shared pipe, not one per connection
    assert proxy.stats.requests == parts and proxy.stats.bytes_down >= SIZE


def test_a_connection_with_a_fault_keeps_it_under_a_link(
    http_server: HttpServer, blob: tuple[str, bytes]
) -> None:
    path, data = blob
    link = Link(bandwidth_bps=BANDWIDTH)

    def plan(i: int) -> Fault:
        return Fault(reset_after=50_000) if i == 0 else Fault()

    with FaultProxy(http_server.port, plan=plan, link=link) as proxy:
        url = f"http://{proxy.address}/{path}"
        with pytest.raises((ConnectionError, urllib.error.URLError, OSError)):
            get(url, 0, 400_000)  # connection 0: reset after 50 kB of the answer
        began = time.monotonic()
        assert get(url, 0, 400_000) == data[:400_000]  # connection 1: clean, pipelined
        took = time.monotonic() - began
    assert proxy.stats.resets == 1
    assert took >= 400_000 / BANDWIDTH
    assert 50_000 <= proxy.stats.bytes_down < 50_000 + 400_000 + 4096  # headers: a few hundred
