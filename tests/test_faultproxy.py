"""The fault proxy's link emulation (tests/faultproxy.py `Link`) and its counters, on nginx.

Only lower bounds on time are asserted (a loaded machine can make a transfer slower,
never faster than the emulated link allows); speeds are measured in benchmarks/remote.py.
"""

from __future__ import annotations

import time
import urllib.request
from collections.abc import Iterator

import pytest

from tests.faultproxy import FaultProxy, Link
from tests.servers import HttpServer

SIZE = 2_000_000
BANDWIDTH = 20e6  # 2 MB take >= 0.1 s
LATENCY = 0.05


@pytest.fixture
def served(http_server: HttpServer) -> Iterator[str]:
    directory, _ = http_server.new_dir()
    (directory / "blob.bin").write_bytes(bytes(range(256)) * (SIZE // 256))
    yield directory.name


def get(url: str, byte_range: str | None = None) -> bytes:
    headers = {} if byte_range is None else {"Range": f"bytes={byte_range}"}
    with urllib.request.urlopen(urllib.request.Request(url, headers=headers), timeout=30) as r:
        return bytes(r.read())


def test_bandwidth_cap_bounds_a_transfer_from_below_and_bytes_are_counted(
    http_server: HttpServer, served: str
) -> None:
    with FaultProxy(http_server.port, link=Link(bandwidth_bps=BANDWIDTH)) as proxy:
        began = time.monotonic()
        data = get(f"http://{proxy.address}/{served}/blob.bin")
        took = time.monotonic() - began
    assert len(data) == SIZE - SIZE % 256
    assert took >= len(data) / BANDWIDTH
    assert proxy.stats.requests == 1 and proxy.stats.bytes_down >= len(data)
    assert proxy.stats.bytes_up > 0


def test_latency_delays_every_request_and_requests_are_counted(
    http_server: HttpServer, served: str
) -> None:
    with FaultProxy(http_server.port, link=Link(latency_s=LATENCY)) as proxy:
        began = time.monotonic()
        for i in range(3):
            assert len(get(f"http://{proxy.address}/{served}/blob.bin", f"{i}-{i + 9}")) == 10
        took = time.monotonic() - began
    assert took >= 3 * LATENCY
    assert proxy.stats.requests == 3 and proxy.stats.connections == 3
