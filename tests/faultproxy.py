"""A TCP proxy on 127.0.0.1 that injects network faults on a deterministic schedule.

`FaultProxy(target_port)` forwards every accepted connection to the target
server (a real SeaweedFS or nginx). A *plan* maps the 0-based number of each
accepted connection to a `Fault`, so a test states exactly which connections
break and how:

* ``reset_after=n``: forward ``n`` bytes of the server's answer, then close both
  sides with a TCP RST (``0``: reset right after accept, before any byte);
* ``stall_after=n, stall_s=x``: after ``n`` bytes of the answer, hold the rest
  for ``x`` seconds (a stalled connection; the client's timeout should fire);
* ``rate_bps=r``: forward the answer at about ``r`` bytes/second (a slow link).

Independently of the plan, a `Link` emulates the network between client and server
for ALL connections together: ``bandwidth_bps`` caps the answer bytes of every
connection combined (one shared pipe: a transfer of ``X`` bytes takes at least
``X / bandwidth_bps`` seconds, however many connections share it), and ``latency_s``
delays every piece of a client's request (and the connection set-up) by that much
before it reaches the server, so each request waits at least ``latency_s`` for its
first answer byte. Each answer piece books the next free slot of the shared link and
reaches the client at the end of that slot, never earlier; a connection without faults
books a few milliseconds ahead of writing (`_BOOK_AHEAD_S`), so the event loop's ~1 ms
timer granularity delays single pieces, not the link's schedule (without that, a link
emulated at 200 MB/s carried 90-150 MB/s).

The proxy runs an asyncio loop in a daemon thread; `stats` counts connections,
HTTP requests (request lines seen from clients), bytes in each direction and the
faults actually injected, and ``accept_times`` records when each connection
arrived (monotonic clock), so a test can check backoff spacing.
"""

from __future__ import annotations

import asyncio
import contextlib
import re
import socket
import struct
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class Fault:
    """What happens to one connection (see the module docstring)."""

    reset_after: int | None = None
    stall_after: int | None = None
    stall_s: float = 0.0
    rate_bps: float | None = None


CLEAN = Fault()
#: How far (seconds of link time) a connection books the link ahead of writing to its client.
_BOOK_AHEAD_S = 0.004
_REQUEST_LINE = re.compile(rb"(?:GET|HEAD|PUT|POST|DELETE|OPTIONS|PATCH) \S+ HTTP/1\.[01]\r\n")


@dataclass(frozen=True)
class Link:
    """An emulated network: shared answer bandwidth (bytes/s, None: unlimited) and a delay
    added to every request piece and connection set-up (seconds)."""

    bandwidth_bps: float | None = None
    latency_s: float = 0.0


Plan = Callable[[int], Fault]


def clean(_: int) -> Fault:
    return CLEAN


def reset_all(_: int) -> Fault:
    return Fault(reset_after=0)


def schedule(
    *,
    reset_every: int | None = None,
    reset_after: int = 0,
    stall_at: tuple[int, ...] = (),
    stall_s: float = 0.0,
    stall_after: int = 0,
    rate_bps: float | None = None,
) -> Plan:
    """Connection ``i`` (0-based) is reset if ``(i + 1) % reset_every == 0`` (after
    ``reset_after`` answer bytes), stalled for ``stall_s`` if ``i in stall_at``, and
    every connection is throttled to ``rate_bps`` if given."""

    def plan(i: int) -> Fault:
        reset = reset_after if reset_every and (i + 1) % reset_every == 0 else None
        stalled = i in stall_at
        return Fault(
            reset_after=reset,
            stall_after=stall_after if stalled else None,
            stall_s=stall_s if stalled else 0.0,
            rate_bps=rate_bps,
        )

    return plan


@dataclass
class Stats:
    connections: int = 0
    resets: int = 0
    stalls: int = 0
    bytes_down: int = 0
    bytes_up: int = 0
    requests: int = 0
    accept_times: list[float] = field(default_factory=list)


def _rst(writer: asyncio.StreamWriter) -> None:
    """Close with a TCP RST (SO_LINGER 0), not a FIN."""
    sock = writer.get_extra_info("socket")
    if sock is not None:
        with contextlib.suppress(OSError):
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    writer.transport.abort()


class FaultProxy:
    """Forward 127.0.0.1:<port> to 127.0.0.1:<target_port>, breaking connections per plan."""

    def __init__(self, target_port: int, plan: Plan = clean, link: Link | None = None) -> None:
        self.target_port = target_port
        self.plan = plan
        self.link = link or Link()
        self._link_free_at = 0.0  # monotonic time the emulated link is free again
        self.stats = Stats()
        self.port = 0
        self._loop = asyncio.new_event_loop()
        self._ready = threading.Event()
        self._server: asyncio.AbstractServer | None = None
        self._tasks: set[asyncio.Task[None]] = set()
        self._clients: set[asyncio.StreamWriter] = set()
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._main, name="faultproxy", daemon=True)

    # lifecycle -----------------------------------------------------------------
    def start(self) -> FaultProxy:
        self._thread.start()
        if not self._ready.wait(10):
            raise RuntimeError("fault proxy did not start")
        return self

    def stop(self) -> None:
        if not self._thread.is_alive():
            return
        fut = asyncio.run_coroutine_threadsafe(self._shutdown(), self._loop)
        fut.result(timeout=10)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=10)

    def __enter__(self) -> FaultProxy:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def set_plan(self, plan: Plan) -> None:
        """Switch the schedule; connection numbers and stats start again from zero.

        Open connections (e.g. kept alive by a client's pool) are reset, so every
        later request goes through a connection the new plan governs.
        """
        with self._lock:
            self.plan = plan
            self.stats = Stats()
        done = threading.Event()

        def reset_open() -> None:
            for writer in list(self._clients):
                _rst(writer)
            done.set()

        if self._thread.is_alive():
            self._loop.call_soon_threadsafe(reset_open)
            done.wait(5)

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    # internals -----------------------------------------------------------------
    def _main(self) -> None:
        asyncio.set_event_loop(self._loop)

        async def serve() -> None:
            self._server = await asyncio.start_server(self._handle, "127.0.0.1", 0)
            self.port = self._server.sockets[0].getsockname()[1]
            self._ready.set()

        self._loop.run_until_complete(serve())
        self._loop.run_forever()
        self._loop.close()

    async def _shutdown(self) -> None:
        if self._server is not None:
            self._server.close()
        for task in list(self._tasks):
            task.cancel()
        if self._tasks:
            await asyncio.gather(*self._tasks, return_exceptions=True)

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        self._tasks.add(task)
        self._clients.add(writer)
        with self._lock:
            stats = self.stats
            index = stats.connections
            stats.connections += 1
            stats.accept_times.append(time.monotonic())
            fault = self.plan(index)
        upstream: asyncio.StreamWriter | None = None
        pumps: list[asyncio.Future[Any]] = []
        try:
            if fault.reset_after == 0:
                stats.resets += 1
                _rst(writer)
                return
            if self.link.latency_s:
                await asyncio.sleep(self.link.latency_s)  # connection set-up crosses the link
            up_reader, upstream = await asyncio.open_connection("127.0.0.1", self.target_port)
            up = asyncio.ensure_future(self._pipe(reader, upstream, stats))
            if self.link.bandwidth_bps is not None and fault == CLEAN:
                down = asyncio.ensure_future(self._down_link(up_reader, writer, stats))
            else:
                down = asyncio.ensure_future(self._down(up_reader, writer, fault, stats))
            pumps += [up, down]
            done, pending = await asyncio.wait({up, down}, return_when=asyncio.FIRST_COMPLETED)
            if down in done and down.result():  # a reset was injected
                up.cancel()
                _rst(upstream)
                return
            for p in pending:
                if p is up:  # the server finished its answer: let the client finish sending
                    p.cancel()
                else:
                    with contextlib.suppress(Exception):
                        await asyncio.wait_for(p, timeout=30)
        except (ConnectionError, OSError, asyncio.CancelledError):
            pass
        finally:
            for pump in pumps:
                pump.cancel()
            for w in (writer, upstream):
                if w is not None and not w.transport.is_closing():
                    w.close()
            self._tasks.discard(task)
            self._clients.discard(writer)

    async def _pipe(
        self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, stats: Stats
    ) -> None:
        """Client -> server, unchanged but for the link's latency; counts requests."""
        try:
            while data := await reader.read(65536):
                stats.bytes_up += len(data)
                stats.requests += len(_REQUEST_LINE.findall(data))
                if self.link.latency_s:
                    await asyncio.sleep(self.link.latency_s)
                writer.write(data)
                await writer.drain()
        except (ConnectionError, OSError):
            pass
        finally:
            with contextlib.suppress(Exception):
                writer.write_eof()

    async def _cross_link(self, nbytes: int) -> None:
        """Wait for ``nbytes`` to cross the shared link (all connections queue on it)."""
        bandwidth = self.link.bandwidth_bps
        if bandwidth is None:
            return
        now = time.monotonic()
        start = max(now, self._link_free_at)
        self._link_free_at = start + nbytes / bandwidth
        if self._link_free_at - now > 0.0005:
            await asyncio.sleep(self._link_free_at - now)

    async def _down_link(
        self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, stats: Stats
    ) -> bool:
        """Server -> client over the shared link, for a connection without faults.

        Each piece books the next free slot of the link (``_link_free_at``, shared by all
        connections) and is written to the client at the *end* of its slot, as in `_down`;
        but the booking runs ahead of the writing (by at most `_BOOK_AHEAD_S`), so a late
        wake-up of the writer (the event loop's timers have ~1 ms granularity) delays that
        piece only, and the link's schedule stays back to back while there is data. A byte
        still never reaches the client before the link could have carried it.
        """
        bandwidth = self.link.bandwidth_bps
        assert bandwidth is not None
        piece = max(1, int(bandwidth / 1000))  # ~1 ms pieces
        booked: asyncio.Queue[tuple[float, bytes] | None] = asyncio.Queue()

        async def send() -> None:
            while (item := await booked.get()) is not None:
                due, data = item
                delay = due - time.monotonic()
                if delay > 0:
                    await asyncio.sleep(delay)
                # counted before the write: a client may read the bytes and the test read the
                # stats before this coroutine runs again after drain()
                stats.bytes_down += len(data)
                writer.write(data)
                await writer.drain()

        sender = asyncio.ensure_future(send())
        try:
            while not sender.done() and (data := await reader.read(65536)):
                for offset in range(0, len(data), piece):
                    chunk = data[offset : offset + piece]
                    now = time.monotonic()
                    due = max(now, self._link_free_at) + len(chunk) / bandwidth
                    self._link_free_at = due
                    booked.put_nowait((due, chunk))
                    if due - now > 2 * _BOOK_AHEAD_S:  # booked far enough: wait a little
                        await asyncio.sleep(due - now - _BOOK_AHEAD_S)
            booked.put_nowait(None)
            await sender
        except (ConnectionError, OSError):
            pass
        finally:
            sender.cancel()
        with contextlib.suppress(Exception):
            writer.write_eof()
        return False

    async def _down(
        self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, fault: Fault, stats: Stats
    ) -> bool:
        """Server -> client with the fault applied; True if the connection was reset."""
        sent = 0
        stalled = False
        piece = 65536 if fault.rate_bps is None else max(1, int(fault.rate_bps / 50))
        if self.link.bandwidth_bps is not None:
            piece = min(piece, max(1, int(self.link.bandwidth_bps / 1000)))  # ~1 ms pieces
        try:
            while data := await reader.read(65536):
                while data:
                    limit = len(data)
                    if fault.reset_after is not None:
                        limit = min(limit, fault.reset_after - sent)
                    if fault.stall_after is not None and not stalled:
                        limit = min(limit, max(0, fault.stall_after - sent))
                    limit = min(limit, piece)
                    if limit > 0:
                        await self._cross_link(limit)
                        stats.bytes_down += limit  # before the write (see above)
                        writer.write(data[:limit])
                        await writer.drain()
                        sent += limit
                        data = data[limit:]
                        if fault.rate_bps is not None:
                            await asyncio.sleep(limit / fault.rate_bps)
                    if fault.reset_after is not None and sent >= fault.reset_after:
                        stats.resets += 1
                        _rst(writer)
                        return True
                    if fault.stall_after is not None and not stalled and sent >= fault.stall_after:
                        stalled = True
                        stats.stalls += 1
                        await asyncio.sleep(fault.stall_s)
        except (ConnectionError, OSError):
            pass
        with contextlib.suppress(Exception):
            writer.write_eof()
        return False
