"""A read's destination is reusable only once the backend says the read has ended.

Over UCX TCP a NIXL READ is asynchronous: bytes move only as the target
progresses, and neither releasing the handle nor removing the peer stops a
read that the target has already been asked for. These tests pause a real
producer process (it stops progressing), abandon a read in each of the ways a
caller can, and then check the one thing that matters: no byte lands in memory
after the transport has let the caller reuse it.
"""

from __future__ import annotations

import threading
import time
import uuid
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import pytest

pytest.importorskip("nixl._api")

from nixl_peer_proc import Producer, pattern
from test_nixl_transport import SIZE, Side

from ecshare.transport import NixlTransport, ReadState, Segment, TransportError

TCP = {"UCX_TLS": "tcp"}
PAUSE_S = 1.0
pytestmark = pytest.mark.timeout(90)


@pytest.fixture
def tcp_pair() -> Iterator[tuple[Producer, Side]]:
    p = Producer(f"tcp-life-{uuid.uuid4().hex[:8]}", SIZE, seed=11, env=TCP)
    side = Side(ucx_env=TCP)
    side.t.add_peer(p.info)
    # One read first, so that the connection is wired up and the stalled read
    # below is stalled by the pause alone.
    assert side.read(p.info.agent_name, [Segment(0, 0, 4096)]).state is ReadState.DONE
    try:
        yield p, side
    finally:
        side.close()
        p.stop()


def _stalled_read(p: Producer, side: Side) -> tuple[Any, threading.Thread]:
    pause = threading.Thread(target=p.call, args=("sleep", PAUSE_S))
    pause.start()
    time.sleep(0.1)  # the producer is now asleep in its command handler
    side.mem[:] = 0
    handle = side.t.read(p.info.agent_name, [Segment(0, 0, SIZE)])
    time.sleep(0.05)
    assert side.t.poll(handle).state is ReadState.PENDING, "UCX_TLS=tcp did not take effect"
    return handle, pause


def _reuse_when_allowed(side: Side, handle: Any, pause: threading.Thread) -> int:
    """Poll until the transport lets go of the destination, reuse it, and count late bytes."""
    deadline = time.monotonic() + PAUSE_S + 10
    while side.t.poll(handle).state is ReadState.PENDING:
        assert time.monotonic() < deadline, "the read never ended after the producer resumed"
        side.t.progress()
        time.sleep(0.001)
    # The caller may reuse the destination now: it writes its own bytes there.
    side.mem[:] = 0
    pause.join()
    # Keep both sides progressing long enough for any straggling bytes to arrive.
    end = time.monotonic() + 0.5
    while time.monotonic() < end:
        side.t.progress()
        time.sleep(0.001)
    return int(np.count_nonzero(side.mem))


@pytest.mark.parametrize(
    "abandon",
    [
        pytest.param(lambda side, h, name: side.t.release(h), id="release"),
        pytest.param(lambda side, h, name: side.t.remove_peer(name), id="remove_peer"),
    ],
)
def test_abandoned_tcp_read_never_writes_memory_it_gave_back(
    tcp_pair: tuple[Producer, Side], abandon: Callable[[Side, Any, str], None]
) -> None:
    p, side = tcp_pair
    handle, pause = _stalled_read(p, side)
    abandon(side, handle, p.info.agent_name)
    # While the producer is paused the read cannot have ended, so it must not say so.
    assert side.t.poll(handle).state is ReadState.PENDING
    assert side.t.in_flight == 1
    assert _reuse_when_allowed(side, handle, pause) == 0
    assert side.t.in_flight == 0


def test_readding_a_peer_keeps_its_reads_pollable_to_their_end(
    tcp_pair: tuple[Producer, Side],
) -> None:
    p, side = tcp_pair
    handle, pause = _stalled_read(p, side)
    side.t.remove_peer(p.info.agent_name)
    assert p.info.agent_name not in side.t.peers
    side.t.add_peer(p.info)  # a re-Welcome from the same producer
    assert side.t.peers == [p.info.agent_name]
    assert side.t.poll(handle).state is ReadState.PENDING
    assert _reuse_when_allowed(side, handle, pause) == 0
    # The peer is usable as before.
    status = side.read(p.info.agent_name, [Segment(0, 0, SIZE)])
    assert status.state is ReadState.DONE, status
    assert np.array_equal(side.mem, pattern(11, SIZE))


def test_a_read_that_completes_after_release_counts_once_as_abandoned(
    tcp_pair: tuple[Producer, Side],
) -> None:
    p, side = tcp_pair
    started = side.t.reads_started
    handle, pause = _stalled_read(p, side)
    side.t.release(handle)
    assert side.t.reads_abandoned == 1
    _reuse_when_allowed(side, handle, pause)
    ended = side.t.reads_done + sum(side.t.reads_failed.values()) + side.t.reads_cancelled
    assert side.t.reads_cancelled == 1
    assert ended == side.t.reads_started == started + 1
    side.t.release(handle)  # releasing again is harmless
    assert side.t.reads_cancelled == 1


def test_new_metadata_under_a_name_with_reads_in_flight_is_refused(
    tcp_pair: tuple[Producer, Side],
) -> None:
    p, side = tcp_pair
    handle, pause = _stalled_read(p, side)
    other = Producer(p.info.agent_name, 1 << 20, seed=12, env=TCP)
    try:
        with pytest.raises(TransportError, match="still in flight"):
            side.t.add_peer(other.info)
        assert _reuse_when_allowed(side, handle, pause) == 0
        # Once the old reads have ended, the new registration is accepted.
        assert side.t.add_peer(other.info) == p.info.agent_name
    finally:
        other.stop()


def test_killed_paused_producer_ends_the_read_it_left_in_flight(
    tcp_pair: tuple[Producer, Side],
) -> None:
    p, side = tcp_pair
    handle, _pause = _stalled_read(p, side)
    side.t.release(handle)
    p.kill()
    deadline = time.monotonic() + 5
    while side.t.poll(handle).state is ReadState.PENDING:
        assert time.monotonic() < deadline, "a dead peer's read never ended"
        time.sleep(0.005)
    assert side.t.in_flight == 0


def test_close_with_a_read_in_flight_ends_it(tcp_pair: tuple[Producer, Side]) -> None:
    p, side = tcp_pair
    handle, pause = _stalled_read(p, side)
    side.t.close()  # the agent goes, and with it anything that could write
    assert side.t.poll(handle).state is ReadState.FAILED
    assert side.t.in_flight == 0
    pause.join()


def test_reads_abandoned_are_counted_in_the_transport_state(
    tcp_pair: tuple[Producer, Side],
) -> None:
    p, side = tcp_pair
    handle, pause = _stalled_read(p, side)
    assert isinstance(side.t, NixlTransport)
    side.t.release(handle)
    assert (side.t.in_flight, side.t.abandoned_in_flight) == (1, 1)
    _reuse_when_allowed(side, handle, pause)
    assert (side.t.in_flight, side.t.abandoned_in_flight) == (0, 0)
