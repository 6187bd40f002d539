"""The local user: what another process on the producer's host can do to its region.

A process of the same user can do anything to it (ptrace, ``/proc/<pid>/mem``,
``process_vm_writev``, or attach the region's memfd through ``/proc/<pid>/fd``, as the
instance's own workers do): the kernel draws its line at the user, and so does ecshare.
What ecshare does promise is that the region has no name and no file mode to get wrong
(a memfd, not a file in /dev/shm), so that a process of another user (without
CAP_SYS_PTRACE) can neither attach it nor read or write it through the producer's
memory. UCX draws no such line: a process of any user holding the producer's NIXL
metadata writes the region through it (where cross-memory attach is refused, UCX takes
another of its transports), so that metadata is the key, handed out only after
authentication (docs/ARCHITECTURE.md, invariant 5), and UCX's endpoints must be reachable only by
trusted peers. Only root can run a process as another user, so the test of the
other-user half needs root; the same-user half runs anywhere.
"""

from __future__ import annotations

import mmap
import multiprocessing as mp
import os
import sys
from collections.abc import Iterator
from multiprocessing.connection import Connection
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("nixl._api")

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "transport"))

from nixl_peer_proc import LOOPBACK, address

from ecshare.store.region import Region, RegionError, RegionHandle
from ecshare.transport import NixlTransport, PeerInfo, ReadState, Segment

pytestmark = pytest.mark.timeout(120)

NOBODY = 65534
SIZE = 1 << 20


def _try_everything(conn: Connection, handle: RegionHandle, info: PeerInfo, uid: int) -> None:
    """As user `uid` (this process's own where it is the same): attach the region, write
    the producer's memory, and WRITE the region with NIXL; what each did."""
    if uid != os.getuid():
        os.setgroups([])
        os.setgid(uid)
        os.setuid(uid)
        os.environ["HOME"] = "/tmp"  # NIXL reads its config there: root's is not ours
    os.environ.update(LOOPBACK)
    did: dict[str, str] = {}
    try:
        region = Region.attach(handle, prefault=False)
        region.array[0:4096] = 0x11
        region.close()
        did["attach"] = "wrote"
    except RegionError as e:
        did["attach"] = f"refused: {e}"
    try:
        with open(f"/proc/{handle.pid}/mem", "r+b", buffering=0) as mem:
            mem.seek(info.region_address + 4096)
            mem.write(b"\x22" * 4096)
        did["mem"] = "wrote"
    except OSError as e:
        did["mem"] = f"refused: {e}"
    try:
        mm = mmap.mmap(-1, SIZE)
        np.frombuffer(mm, dtype=np.uint8)[:] = 0x33
        t = NixlTransport(f"local-user-{os.getpid()}")
        t.register(address(mm), SIZE)
        t.add_peer(info)
        h = t.write(info.agent_name, [Segment(0, 8192, 4096)])
        while t.poll(h).state is ReadState.PENDING:
            t.progress()
        did["nixl"] = "wrote" if t.poll(h).state is ReadState.DONE else f"failed: {t.poll(h)}"
        t.close()
    except Exception as e:
        did["nixl"] = f"refused: {type(e).__name__}: {e}"
    conn.send(did)


def _as_user(handle: RegionHandle, info: PeerInfo, uid: int) -> dict[str, str]:
    ctx = mp.get_context("spawn")
    conn, child = ctx.Pipe()
    proc = ctx.Process(target=_try_everything, args=(child, handle, info, uid), daemon=True)
    proc.start()
    child.close()
    try:
        assert conn.poll(60), "the other process did not answer"
        did: dict[str, str] = conn.recv()
        return did
    finally:
        proc.join(10)
        if proc.is_alive():
            proc.kill()


@pytest.fixture
def producer_region() -> Iterator[tuple[Region, NixlTransport]]:
    os.environ.update(LOOPBACK)
    region = Region.create(SIZE, name="ecshare-local-user")
    region.array[:] = 0
    t = NixlTransport("local-user-producer", progress_thread=True)
    t.register(address_of(region), SIZE)
    yield region, t
    t.close()
    region.close()


def address_of(region: Region) -> int:
    return int(region.array.ctypes.data)


def test_a_process_of_the_same_user_can_write_the_region_every_way(
    producer_region: tuple[Region, NixlTransport],
) -> None:
    region, t = producer_region
    did = _as_user(region.handle, t.local_info(), os.getuid())
    assert did == {"attach": "wrote", "mem": "wrote", "nixl": "wrote"}, did
    assert (region.array[0:4096] == 0x11).all()
    assert (region.array[4096:8192] == 0x22).all()
    assert (region.array[8192:12288] == 0x33).all()


@pytest.mark.skipif(os.geteuid() != 0, reason="only root can run a process as another user")
def test_a_process_of_another_user_cannot_attach_or_write_the_region_but_ucx_lets_it(
    producer_region: tuple[Region, NixlTransport],
) -> None:
    region, t = producer_region
    did = _as_user(region.handle, t.local_info(), NOBODY)
    assert did["attach"].startswith("refused"), did
    assert did["mem"].startswith("refused"), did
    assert not region.array[:8192].any()  # neither changed a byte
    # What the kernel's line does not cover: UCX, given the metadata, checks no user.
    assert did["nixl"] == "wrote", did
    assert (region.array[8192:12288] == 0x33).all()
