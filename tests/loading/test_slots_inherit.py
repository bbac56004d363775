"""Slot rings (`detdata.loading.slots`) and process boundaries: a forked child does not keep
the rings it inherits, and a worker sent a ring it already holds does not map it again.

Observed from outside the code under test: the child's ``/proc/self/fd`` and
``/proc/self/maps``, and this process's mappings of the ring's memory file.
"""

from __future__ import annotations

import os
import pickle
import sys
from pathlib import Path

import pytest

from detdata.loading import slots
from detdata.loading.slots import Receipt, SlotTransport

pytestmark = pytest.mark.skipif(
    not sys.platform.startswith("linux"), reason="memfd rings and /proc are Linux"
)
NAME = "detdata-slots"  # the memory file's name (memfd_create)


def ring_fds(inode: int | None = None) -> list[str]:
    """Descriptors of ring memory files (of the one with ``inode`` only, when given)."""
    out = []
    for fd in os.listdir("/proc/self/fd"):
        try:
            if NAME in os.readlink(f"/proc/self/fd/{fd}") and (
                inode is None or os.stat(f"/proc/self/fd/{fd}").st_ino == inode
            ):
                out.append(fd)
        except OSError:
            continue
    return out


def ring_maps(inode: int | None = None) -> int:
    """Mappings of ring memory files (``/proc/self/maps``: the 5th field is the inode)."""
    lines = Path("/proc/self/maps").read_text().splitlines()
    return sum(NAME in line and (inode is None or int(line.split()[4]) == inode) for line in lines)


def transport_with_a_ring() -> SlotTransport:
    transport = SlotTransport(2, 2)
    # a worker reported a group of 4 KiB: the ring is made for it
    transport.settle(Receipt(transport.id, None, None, 0, None, 4096))
    assert transport._current is not None
    return transport


def test_a_forked_child_drops_the_rings_it_inherits() -> None:
    """Observed by the ring's memory file inode: other tests of this process may leave
    rings of their own, which are not this test's subject."""
    transport = transport_with_a_ring()
    try:
        assert transport._current is not None
        inode = os.fstat(transport._current.fd).st_ino
        assert ring_fds(inode) and ring_maps(inode) > 0
        read, write = os.pipe()
        pid = os.fork()
        if pid == 0:  # the child: no descriptor, no mapping of the parent's ring
            fds, maps = ring_fds(inode), ring_maps(inode)
            os.write(write, f"fds {fds} maps {maps}".encode())
            os._exit(0 if not fds and maps == 0 else 1)
        os.close(write)
        _, status = os.waitpid(pid, 0)
        found = os.read(read, 4096).decode()
        os.close(read)
        assert os.waitstatus_to_exitcode(status) == 0, f"the child kept the ring: {found}"
        # the parent's ring is untouched by the fork
        ring = transport._current
        assert ring is not None
        ring.array[:4] = 7
        assert ring_fds() and ring_maps() > 0
        assert transport.task([]).slot is not None
    finally:
        transport.close()


def test_a_worker_sent_a_ring_it_holds_does_not_map_it_again() -> None:
    transport = transport_with_a_ring()
    ring = transport._current
    assert ring is not None
    try:
        first = pickle.loads(pickle.dumps(ring))  # as a worker unpickles
        slots._HELD[transport.id] = first  # what `SlotTask.held` records in the worker
        inode = os.fstat(ring.fd).st_ino
        maps, fds = ring_maps(inode), len(ring_fds(inode))  # this ring's only: other tests of
        again = pickle.loads(pickle.dumps(ring))  # the process run too
        assert again is first
        assert ring_maps(inode) == maps  # no second mapping
        assert len(ring_fds(inode)) == fds  # the sent descriptor was closed
    finally:
        slots._HELD.pop(transport.id, None)
        transport.close()
