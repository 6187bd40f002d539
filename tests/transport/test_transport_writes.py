"""Writes (push): our extents into a peer's region, between real processes.

A write keeps every rule of a read the other way round: the initiator's handle
ends only on the backend's word, the target learns of the data only through the
write's notification, delivered exactly once, and over UCX TCP a write released
while its target is paused is abandoned, not stopped: the transport keeps it
PENDING until it has ended, however long that takes.
"""

from __future__ import annotations

import threading
import time
import uuid
from collections.abc import Iterator

import numpy as np
import pytest

pytest.importorskip("nixl._api")

from nixl_peer_proc import Producer as Target
from nixl_peer_proc import pattern
from test_nixl_transport import SIZE, Side

from ecshare.transport import FailureKind, ReadState, Segment

TCP = {"UCX_TLS": "tcp"}
pytestmark = pytest.mark.timeout(90)


def _target_bytes(target: Target, start: int, n: int) -> np.ndarray:
    return np.frombuffer(target.call("slice", (start, start + n)), dtype=np.uint8)


def _notifs_until(target: Target, count: int, timeout_s: float = 5.0) -> list[tuple[str, bytes]]:
    got: list[tuple[str, bytes]] = []
    deadline = time.monotonic() + timeout_s
    while len(got) < count and time.monotonic() < deadline:
        got += target.notifs()
        time.sleep(0.01)
    return got


@pytest.fixture(params=["cma", "tcp"])
def pair(request: pytest.FixtureRequest) -> Iterator[tuple[Target, Side]]:
    env = TCP if request.param == "tcp" else {}
    target = Target(f"w-target-{uuid.uuid4().hex[:8]}", SIZE, seed=5, env=env)
    side = Side(ucx_env=env)
    side.mem[:] = pattern(77, SIZE)
    side.t.add_peer(target.info)
    try:
        yield target, side
    finally:
        side.close()
        target.stop()


def test_write_lands_in_peer_region_and_notifies_once(pair: tuple[Target, Side]) -> None:
    target, side = pair
    n = 1 << 20
    segments = [Segment(0, 8192, n // 2), Segment(n // 2, 8192 + n // 2 + 4096, n // 2)]
    handle = side.t.write(target.info.agent_name, segments, b"push:1")
    status = side.wait(handle)
    side.t.release(handle)
    assert status.state is ReadState.DONE, status
    assert np.array_equal(_target_bytes(target, 8192, n // 2), side.mem[: n // 2])
    assert np.array_equal(_target_bytes(target, 8192 + n // 2 + 4096, n // 2), side.mem[n // 2 : n])
    # Bytes outside the segments are the target's own pattern still.
    assert np.array_equal(_target_bytes(target, 0, 8192), pattern(5, SIZE)[:8192])
    notes = _notifs_until(target, 1)
    time.sleep(0.05)
    notes += target.notifs()
    assert notes == [(side.t.name, b"push:1")]
    assert side.t.writes_done == 1 and side.t.bytes_written == n
    assert side.t.reads_started == 0 and side.t.in_flight == 0


def test_write_outside_peer_region_fails_invalid_and_touches_nothing(
    pair: tuple[Target, Side],
) -> None:
    target, side = pair
    handle = side.t.write(target.info.agent_name, [Segment(0, SIZE - 4096, 8192)])
    status = side.t.poll(handle)
    assert status.state is ReadState.FAILED and status.failure is FailureKind.INVALID
    assert np.array_equal(_target_bytes(target, SIZE - 4096, 4096), pattern(5, SIZE)[-4096:])
    assert side.t.writes_failed[FailureKind.INVALID] == 1


def test_released_write_to_paused_target_stays_pending_until_it_ends_over_tcp() -> None:
    """The push lifetime rule on the initiator: a write released while it cannot move is
    abandoned, and its source is the caller's again only when the backend ends it."""
    target = Target(f"w-paused-{uuid.uuid4().hex[:8]}", SIZE, seed=5, env=TCP)
    side = Side(ucx_env=TCP)
    try:
        side.mem[:] = pattern(78, SIZE)
        side.t.add_peer(target.info)
        warm = side.t.write(target.info.agent_name, [Segment(0, 0, 4096)])
        assert side.wait(warm).state is ReadState.DONE
        side.t.release(warm)
        pause = threading.Thread(target=target.call, args=("sleep", 1.0))
        pause.start()
        time.sleep(0.1)
        handle = side.t.write(target.info.agent_name, [Segment(0, 0, SIZE)], b"late")
        time.sleep(0.05)
        assert side.t.poll(handle).state is ReadState.PENDING, "UCX_TLS=tcp did not take effect"
        side.t.release(handle)
        assert side.t.poll(handle).state is ReadState.PENDING
        assert side.t.in_flight == 1 and side.t.abandoned_in_flight == 1
        assert side.t.writes_abandoned == 1
        deadline = time.monotonic() + 15
        while side.t.poll(handle).state is ReadState.PENDING:
            assert time.monotonic() < deadline, "the write never ended after the target resumed"
            side.t.progress()
            time.sleep(0.001)
        pause.join()
        assert side.t.in_flight == 0 and side.t.writes_cancelled == 1
        # The abandoned write did land whole: nothing stopped it.
        assert np.array_equal(_target_bytes(target, 0, SIZE), side.mem)
        assert _notifs_until(target, 1) == [(side.t.name, b"late")]
    finally:
        side.close()
        target.stop()
