"""The promises every `DataTransport` keeps, held against each implementation alike.

Each test runs on every rig it applies to:

- ``nixl-cma``: `NixlTransport`, the target a real process (nixl_peer_proc),
  UCX on the loopback device; a READ completes inside `read` (cross-memory
  attach), so nothing can hold one back and the stall tests do not apply;
- ``nixl-tcp``: the same over UCX_TLS=tcp, where a READ moves only as the
  target progresses; the target is stalled with SIGSTOP, killed with SIGKILL;
- ``loopback-sync``, ``loopback-polled``, ``loopback-target``:
  `LoopbackTransport` in each of its completion modes, the target serving
  from a thread of this process as the real one does from its loop, stalled
  and killed with the transport's own fault switches.

What is promised is in the test names; above all the lifetime rule: a read's
destination is the caller's again only once `poll` says the read has ended,
whatever the caller did to it before (released it, removed or re-added its
peer).
"""

from __future__ import annotations

import contextlib
import mmap
import os
import signal
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace
from typing import Any, Protocol

import numpy as np
import pytest

from ecshare.transport import (
    DataTransport,
    FailureKind,
    PeerInfo,
    ReadHandle,
    ReadState,
    ReadStatus,
    Segment,
    TransportError,
    pair_segments,
)
from ecshare.transport.loopback import Completion, Fabric, LoopbackTransport

SIZE = 4 << 20
TCP = {"UCX_TLS": "tcp"}
ALL_RIGS = ["nixl-cma", "nixl-tcp", "loopback-sync", "loopback-polled", "loopback-target"]
STALLABLE = [r for r in ALL_RIGS if r != "nixl-cma"]
HANG_GUARD_S = 10.0  # a read that never ends is a failure, not a hang
pytestmark = pytest.mark.timeout(120)


def pattern(seed: int, size: int = SIZE) -> np.ndarray[Any, np.dtype[np.uint8]]:
    return np.random.default_rng(seed).integers(0, 256, size, dtype=np.uint8)


def address(mm: mmap.mmap) -> int:
    return int(np.frombuffer(mm, dtype=np.uint8).ctypes.data)


def stalls(fn: Callable[..., None]) -> Callable[..., None]:
    """Marks a test that stalls its target: it runs on the rigs that can be stalled."""
    return pytest.mark.stalls(fn)


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    if "rig" in metafunc.fixturenames:
        rigs = STALLABLE if metafunc.definition.get_closest_marker("stalls") else ALL_RIGS
        metafunc.parametrize("rig_id", rigs, scope="module")


# ------------------------------------------------------------------- the rigs


class Target(Protocol):
    """A peer that serves a region filled with `pattern(seed)`."""

    info: PeerInfo
    seed: int

    def stall(self) -> None: ...
    def resume(self) -> None: ...
    def kill(self) -> None: ...
    def notifs(self) -> list[tuple[str, bytes]]: ...
    def stop(self) -> None: ...


class NixlTarget:
    """nixl_peer_proc's producer: a real process, stopped and killed with signals."""

    def __init__(self, name: str, seed: int, env: dict[str, str]) -> None:
        pytest.importorskip("nixl._api")
        from nixl_peer_proc import Producer

        self.proc = Producer(name, SIZE, seed=seed, env=env)
        self.info = self.proc.info
        self.seed = seed

    def stall(self) -> None:
        os.kill(self.proc.proc.pid, signal.SIGSTOP)

    def resume(self) -> None:
        os.kill(self.proc.proc.pid, signal.SIGCONT)

    def kill(self) -> None:
        self.proc.kill()

    def notifs(self) -> list[tuple[str, bytes]]:
        return self.proc.notifs()

    def stop(self) -> None:
        if self.proc.proc.is_alive():
            with contextlib.suppress(ProcessLookupError):
                self.resume()
        self.proc.stop()


class LoopbackTarget:
    """A LoopbackTransport serving from a thread, as a producer's loop does."""

    def __init__(self, fabric: Fabric, name: str, seed: int, completion: Completion) -> None:
        self.mm = mmap.mmap(-1, SIZE)
        np.frombuffer(self.mm, dtype=np.uint8)[:] = pattern(seed)
        self.t = LoopbackTransport(name, fabric=fabric, completion=completion, steps=3)
        self.t.register(address(self.mm), SIZE)
        self.info = self.t.local_info()
        self.seed = seed
        self._notes: list[tuple[str, bytes]] = []
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        while not self._stop.wait(0.0005):
            notes = self.t.progress()
            with self._lock:
                self._notes += notes

    def stall(self) -> None:
        self.t.stall()

    def resume(self) -> None:
        self.t.resume()

    def kill(self) -> None:
        self.t.kill()

    def notifs(self) -> list[tuple[str, bytes]]:
        time.sleep(0.005)  # a few turns of the serving loop, as a round trip to a process takes
        with self._lock:
            out, self._notes = self._notes, []
        return out

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(5)
        self.t.close()


@dataclass
class Rig:
    id: str
    transport: Callable[[str], DataTransport]
    target: Callable[[str, int], Target]


def make_rig(rig_id: str) -> Rig:
    if rig_id.startswith("nixl-"):
        pytest.importorskip("nixl._api")
        from nixl_peer_proc import LOOPBACK

        from ecshare.transport import NixlTransport

        env = {**LOOPBACK, **(TCP if rig_id == "nixl-tcp" else {})}
        return Rig(
            rig_id,
            lambda name: NixlTransport(name, ucx_env=env),
            lambda name, seed: NixlTarget(name, seed, env),
        )
    fabric = Fabric()
    completion = Completion(rig_id.removeprefix("loopback-"))
    return Rig(
        rig_id,
        lambda name: LoopbackTransport(name, fabric=fabric, completion=completion, steps=3),
        lambda name, seed: LoopbackTarget(fabric, name, seed, completion),
    )


class Side:
    """The reader: a transport over a zeroed region of this process."""

    def __init__(self, rig: Rig) -> None:
        self.mm = mmap.mmap(-1, SIZE)
        self.mem = np.frombuffer(self.mm, dtype=np.uint8)
        self.t: Any = rig.transport(f"reader-{uuid.uuid4().hex[:8]}")
        self.t.register(address(self.mm), SIZE)

    def wait(self, handle: ReadHandle) -> ReadStatus:
        """Poll (and progress, which drives abandoned reads) until the read has ended."""
        deadline = time.monotonic() + HANG_GUARD_S
        while True:
            status: ReadStatus = self.t.poll(handle)
            if status.state is not ReadState.PENDING:
                return status
            assert time.monotonic() < deadline, f"{handle} never ended"
            self.t.progress()
            time.sleep(0.0002)

    def read(self, peer: str, segments: list[Segment], notify: bytes = b"") -> ReadStatus:
        handle = self.t.read(peer, segments, notify)
        status = self.wait(handle)
        self.t.release(handle)
        return status

    def settled(self) -> int:
        t = self.t
        return int(t.reads_done + sum(t.reads_failed.values()) + t.reads_cancelled)

    def close(self) -> None:
        self.t.close()


def connected(rig: Rig, target: Target) -> Side:
    """A reader with `target` added and one read done, so the connection is wired up."""
    side = Side(rig)
    side.t.add_peer(target.info)
    assert side.read(target.info.agent_name, [Segment(0, 0, 4096)]).state is ReadState.DONE
    side.mem[:] = 0
    return side


@pytest.fixture(scope="module")
def rig(rig_id: str) -> Rig:
    return make_rig(rig_id)


@pytest.fixture(scope="module")
def served(rig: Rig) -> Iterator[tuple[Target, Side]]:
    """One target and one wired-up reader, shared by the tests that leave both as they were."""
    target = rig.target(f"target-{uuid.uuid4().hex[:8]}", 1)
    side = connected(rig, target)
    yield target, side
    side.close()
    target.stop()


@pytest.fixture
def clean(served: tuple[Target, Side]) -> tuple[Target, Side]:
    target, side = served
    side.mem[:] = 0
    assert side.t.in_flight == 0
    return target, side


@pytest.fixture
def fresh(rig: Rig) -> Iterator[Callable[[int], Target]]:
    """Targets of the test's own (to kill, restart or stall past the test), stopped after it."""
    made: list[Target] = []

    def make(seed: int, name: str = "") -> Target:
        made.append(rig.target(name or f"own-{uuid.uuid4().hex[:8]}", seed))
        return made[-1]

    yield make
    for target in made:
        target.stop()


# --------------------------------------------------------------- what lands


def test_a_done_read_has_landed_byte_exact_and_nothing_else(clean: tuple[Target, Side]) -> None:
    target, side = clean
    before = (side.t.reads_done, side.t.bytes_read)
    status = side.read(target.info.agent_name, [Segment(4096, 1 << 20, 1 << 20)])
    assert status.state is ReadState.DONE, status
    expected = pattern(target.seed)
    assert np.array_equal(side.mem[4096 : 4096 + (1 << 20)], expected[1 << 20 : 2 << 20])
    assert not side.mem[:4096].any() and not side.mem[4096 + (1 << 20) :].any()
    assert (side.t.reads_done, side.t.bytes_read) == (before[0] + 1, before[1] + (1 << 20))


@pytest.mark.parametrize(
    ("local", "remote"),
    [
        ([(0, 7), (100_000, 65536), (9000, 4097)], [(3 << 20, 69640)]),
        ([(2 << 20, 262144)], [(5, 1), (70_000, 131071), (1 << 20, 131072)]),
    ],
    ids=["scattered-local", "scattered-remote"],
)
def test_scattered_segments_land_where_they_say(
    clean: tuple[Target, Side], local: list[tuple[int, int]], remote: list[tuple[int, int]]
) -> None:
    target, side = clean
    segments = pair_segments(local, remote)
    assert side.read(target.info.agent_name, segments).state is ReadState.DONE
    expected = pattern(target.seed)
    written = np.zeros(SIZE, dtype=bool)
    for s in segments:
        got = side.mem[s.local_offset : s.local_offset + s.length]
        assert np.array_equal(got, expected[s.remote_offset : s.remote_offset + s.length]), s
        written[s.local_offset : s.local_offset + s.length] = True
    assert not side.mem[~written].any(), "bytes outside the segments were written"


def test_notify_reaches_the_target_exactly_once(clean: tuple[Target, Side]) -> None:
    target, side = clean
    target.notifs()
    token = uuid.uuid4().bytes
    assert side.read(target.info.agent_name, [Segment(0, 0, 65536)], token).state is ReadState.DONE
    got: list[tuple[str, bytes]] = []
    for _ in range(5):
        got += target.notifs()
        time.sleep(0.02)
    assert got == [(side.t.name, token)]


# ------------------------------------------------------------- what is refused


@pytest.mark.parametrize(
    "segment",
    [
        Segment(0, SIZE - 4096, 4097),
        Segment(SIZE - 1, 0, 2),
        Segment(-4096, 0, 4096),
        Segment(0, 0, 0),
        Segment(0, 1 << 70, 4096),
    ],
    ids=["past-peer", "past-ours", "negative", "empty", "huge"],
)
def test_out_of_bounds_segment_fails_invalid_before_any_byte_moves(
    clean: tuple[Target, Side], segment: Segment
) -> None:
    target, side = clean
    failed = side.t.reads_failed[FailureKind.INVALID]
    handle = side.t.read(target.info.agent_name, [Segment(0, 0, 4096), segment])
    status = side.t.poll(handle)
    assert (status.state, status.failure) == (ReadState.FAILED, FailureKind.INVALID)
    assert side.t.reads_failed[FailureKind.INVALID] == failed + 1
    assert not side.mem.any()
    side.t.release(handle)
    side.t.release(handle)  # twice is harmless


def test_a_peer_claiming_more_than_it_registered_cannot_be_read_past(
    rig: Rig, served: tuple[Target, Side]
) -> None:
    target, _ = served
    liar = replace(target.info, region_size=2 * SIZE)
    side = Side(rig)
    try:
        side.t.add_peer(liar)
        status = side.read(liar.agent_name, [Segment(0, SIZE, 4096)])
        assert (status.state, status.failure) == (ReadState.FAILED, FailureKind.NOT_FOUND)
        assert not side.mem.any()
    finally:
        side.close()


def test_a_read_from_an_unknown_peer_fails_not_found(clean: tuple[Target, Side]) -> None:
    _, side = clean
    status = side.read("nobody", [Segment(0, 0, 16)])
    assert (status.state, status.failure) == (ReadState.FAILED, FailureKind.NOT_FOUND)


def test_add_peer_refuses_foreign_kind_garbage_and_borrowed_metadata(
    rig: Rig, served: tuple[Target, Side]
) -> None:
    target, _ = served
    side = Side(rig)
    try:
        with pytest.raises(ValueError):
            side.t.add_peer(replace(target.info, kind="carrier-pigeon"))
        with pytest.raises(TransportError):
            side.t.add_peer(replace(target.info, agent_metadata=b"garbage"))
        with pytest.raises(ValueError):
            side.t.add_peer(replace(target.info, agent_name="impostor"))
        assert side.t.peers == []
        side.t.add_peer(target.info)
        # Another known peer's metadata under a new name must not unload that peer.
        with pytest.raises(ValueError):
            side.t.add_peer(replace(target.info, agent_name="impostor"))
        assert side.t.peers == [target.info.agent_name]
        assert side.read(target.info.agent_name, [Segment(0, 0, 4096)]).state is ReadState.DONE
    finally:
        side.close()


def test_one_region_only_and_use_after_close_raises(rig: Rig, served: tuple[Target, Side]) -> None:
    target, _ = served
    side = Side(rig)
    side.t.register(address(side.mm), SIZE)  # the same region again: a no-op
    with pytest.raises(TransportError):
        side.t.register(address(side.mm), SIZE // 2)
    side.t.add_peer(target.info)
    done = side.t.read(target.info.agent_name, [Segment(0, 0, 4096)])
    assert side.wait(done).state is ReadState.DONE
    side.close()
    side.close()
    assert side.t.poll(done).state is ReadState.DONE
    side.t.release(done)
    assert side.t.progress() == []
    with pytest.raises(TransportError):
        side.t.read(target.info.agent_name, [Segment(0, 0, 4096)])


# --------------------------------------------------------------- peers dying


def test_a_killed_target_fails_reads_without_raising(
    rig: Rig, fresh: Callable[[int], Target]
) -> None:
    target = fresh(2)
    side = connected(rig, target)
    try:
        target.kill()
        for _ in range(3):  # the first read after the death, and every one after it
            status = side.read(target.info.agent_name, [Segment(0, 0, 1 << 20)])
            assert status.state is ReadState.FAILED, status
            assert status.failure in (FailureKind.PEER_DISCONNECTED, FailureKind.NOT_FOUND)
        assert side.t.reads_failed[FailureKind.PEER_DISCONNECTED] >= 1
        assert not side.mem.any()
        assert side.t.in_flight == 0
    finally:
        side.close()


def test_a_restarted_target_readded_serves_its_new_bytes(
    rig: Rig, fresh: Callable[..., Target]
) -> None:
    name = f"phoenix-{uuid.uuid4().hex[:8]}"
    first = fresh(3, name)
    side = connected(rig, first)
    try:
        first.kill()
        second = fresh(4, name)
        assert second.info.agent_metadata != first.info.agent_metadata
        assert side.t.add_peer(second.info) == name
        assert side.t.peers == [name]
        status = side.read(name, [Segment(0, 0, SIZE)])
        assert status.state is ReadState.DONE, status
        assert np.array_equal(side.mem, pattern(4))
    finally:
        side.close()


# ------------------------------------------------- lifetimes (stalled targets)


def _stalled_read(target: Target, side: Side) -> ReadHandle:
    target.stall()
    side.mem[:] = 0
    handle = side.t.read(target.info.agent_name, [Segment(0, 0, SIZE)])
    time.sleep(0.05)
    assert side.t.poll(handle).state is ReadState.PENDING, "the stall did not hold the read"
    return handle


def _late_bytes_after_reuse(target: Target, side: Side, handle: ReadHandle) -> int:
    """Resume the target, poll until the transport lets go of the destination, reuse it,
    and count the bytes that land there afterwards."""
    target.resume()
    side.wait(handle)
    side.mem[:] = 0  # the caller reuses the destination: its own bytes go there
    end = time.monotonic() + 0.3  # both sides keep moving: any straggler would land now
    while time.monotonic() < end:
        side.t.progress()
        time.sleep(0.001)
    return int(np.count_nonzero(side.mem))


@stalls
def test_a_read_from_a_stalled_target_is_pending_until_it_resumes(
    clean: tuple[Target, Side],
) -> None:
    target, side = clean
    handle = _stalled_read(target, side)
    assert side.t.in_flight == 1
    target.resume()
    assert side.wait(handle).state is ReadState.DONE
    assert np.array_equal(side.mem, pattern(target.seed))
    side.t.release(handle)
    assert side.t.in_flight == 0


@stalls
@pytest.mark.parametrize("abandon", ["release", "remove_peer"])
def test_an_abandoned_read_never_writes_memory_it_gave_back(
    clean: tuple[Target, Side], abandon: str
) -> None:
    target, side = clean
    handle = _stalled_read(target, side)
    if abandon == "release":
        side.t.release(handle)
    else:
        side.t.remove_peer(target.info.agent_name)
    # While the target is stalled the read cannot have ended, so it must not say so.
    assert side.t.poll(handle).state is ReadState.PENDING
    assert side.t.in_flight == 1
    assert _late_bytes_after_reuse(target, side, handle) == 0
    assert side.t.in_flight == 0
    if abandon == "remove_peer":
        side.t.add_peer(target.info)
    side.t.release(handle)


@stalls
def test_readding_a_peer_keeps_its_reads_pollable_to_their_end(
    clean: tuple[Target, Side],
) -> None:
    target, side = clean
    handle = _stalled_read(target, side)
    side.t.remove_peer(target.info.agent_name)
    assert target.info.agent_name not in side.t.peers
    side.t.add_peer(target.info)  # the same registration again (a re-handshake)
    assert side.t.peers == [target.info.agent_name]
    assert side.t.poll(handle).state is ReadState.PENDING
    assert _late_bytes_after_reuse(target, side, handle) == 0
    side.t.release(handle)
    assert side.read(target.info.agent_name, [Segment(0, 0, SIZE)]).state is ReadState.DONE
    assert np.array_equal(side.mem, pattern(target.seed))


@stalls
def test_a_read_released_while_pending_counts_once_as_abandoned_and_cancelled(
    clean: tuple[Target, Side],
) -> None:
    target, side = clean
    started, cancelled = side.t.reads_started, side.t.reads_cancelled
    abandoned = side.t.reads_abandoned
    handle = _stalled_read(target, side)
    side.t.release(handle)
    assert side.t.reads_abandoned == abandoned + 1
    assert (side.t.in_flight, side.t.abandoned_in_flight) == (1, 1)
    _late_bytes_after_reuse(target, side, handle)
    assert (side.t.in_flight, side.t.abandoned_in_flight) == (0, 0)
    assert side.t.reads_cancelled == cancelled + 1
    assert side.settled() == side.t.reads_started == started + 1
    side.t.release(handle)
    assert side.t.reads_cancelled == cancelled + 1


@stalls
def test_new_metadata_under_a_name_with_reads_in_flight_is_refused(
    rig: Rig, fresh: Callable[..., Target]
) -> None:
    target = fresh(11)
    side = connected(rig, target)
    try:
        handle = _stalled_read(target, side)
        # A new process under the same agent name, while the old one's read is in flight.
        successor = fresh(12, target.info.agent_name)
        with pytest.raises(TransportError, match="still in flight"):
            side.t.add_peer(successor.info)
        assert _late_bytes_after_reuse(target, side, handle) == 0
        # Once the old read has ended, the new registration is accepted and served.
        assert side.t.add_peer(successor.info) == target.info.agent_name
        side.t.release(handle)
        assert side.read(target.info.agent_name, [Segment(0, 0, SIZE)]).state is ReadState.DONE
        assert np.array_equal(side.mem, pattern(12))
    finally:
        side.close()


@stalls
def test_a_killed_stalled_target_ends_the_read_it_left_in_flight(
    rig: Rig, fresh: Callable[[int], Target]
) -> None:
    target = fresh(21)
    side = connected(rig, target)
    try:
        handle = _stalled_read(target, side)
        side.t.release(handle)
        target.kill()
        assert side.wait(handle).state is ReadState.FAILED
        assert side.t.in_flight == 0
    finally:
        side.close()


@stalls
def test_close_with_a_read_in_flight_ends_it(rig: Rig, fresh: Callable[[int], Target]) -> None:
    target = fresh(31)
    side = connected(rig, target)
    handle = _stalled_read(target, side)
    side.close()  # the transport goes, and with it anything that could write
    assert side.t.poll(handle).state is ReadState.FAILED
    assert side.t.in_flight == 0
