"""LoopbackTransport's own knobs: completion modes step by step, faults on demand, writes.

What it shares with NIXL is held in test_transport_contract.py; these tests
pin down what a logic test can rely on when it drives the loopback by hand:
exactly when bytes move, and exactly which fault it gets.
"""

from __future__ import annotations

import mmap
import threading
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest

from ecshare.transport import FailureKind, ReadState, Segment, TransportError
from ecshare.transport.base import writer_of
from ecshare.transport.loopback import Completion, Fabric, LoopbackTransport

SIZE = 1 << 20


class Node:
    """A transport over a region of its own, filled with `seed`'s pattern (0: zeros)."""

    def __init__(self, fabric: Fabric, name: str, seed: int = 0, **kw: Any) -> None:
        self.mm = mmap.mmap(-1, SIZE)
        self.mem = np.frombuffer(self.mm, dtype=np.uint8)
        if seed:
            self.mem[:] = np.random.default_rng(seed).integers(0, 256, SIZE, dtype=np.uint8)
        self.t = LoopbackTransport(name, fabric=fabric, **kw)
        self.t.register(int(self.mem.ctypes.data), SIZE)


@pytest.fixture
def fabric() -> Iterator[Fabric]:
    yield Fabric()


def pair(fabric: Fabric, completion: Completion, steps: int = 1) -> tuple[Node, Node]:
    target = Node(fabric, "target", seed=7, completion=completion, steps=steps)
    reader = Node(fabric, "reader")
    reader.t.add_peer(target.t.local_info())
    return target, reader


def test_a_sync_read_is_done_when_read_returns(fabric: Fabric) -> None:
    target, reader = pair(fabric, Completion.SYNC)
    handle = reader.t.read("target", [Segment(0, 0, SIZE)])
    assert handle.status.state is ReadState.DONE
    assert np.array_equal(reader.mem, target.mem)
    assert reader.t.self_progressing and target.t.self_progressing


def test_a_polled_read_moves_a_share_per_drive_and_is_done_on_the_last(fabric: Fabric) -> None:
    target, reader = pair(fabric, Completion.POLLED, steps=4)
    quarter = SIZE // 4
    handle = reader.t.read("target", [Segment(0, 0, SIZE)])  # `read` is the first drive
    for polls in (1, 2):
        assert reader.t.poll(handle).state is ReadState.PENDING
        # A PENDING read has written part of its destination, as a real transfer does.
        moved = (polls + 1) * quarter
        assert np.array_equal(reader.mem[:moved], target.mem[:moved])
        assert not reader.mem[moved:].any()
    assert reader.t.poll(handle).state is ReadState.DONE
    assert np.array_equal(reader.mem, target.mem)


def test_a_target_driven_read_moves_only_as_the_target_progresses(fabric: Fabric) -> None:
    target, reader = pair(fabric, Completion.TARGET, steps=2)
    assert not target.t.self_progressing
    handle = reader.t.read("target", [Segment(0, 0, SIZE)], notify=b"note")
    for _ in range(10):
        assert reader.t.poll(handle).state is ReadState.PENDING
    assert not reader.mem.any()
    assert target.t.progress() == []
    assert np.array_equal(reader.mem[: SIZE // 2], target.mem[: SIZE // 2])
    assert not reader.mem[SIZE // 2 :].any()
    # The second step moves the rest and hands out the notification, which ends the read.
    assert target.t.progress() == [("reader", b"note")]
    assert reader.t.poll(handle).state is ReadState.DONE
    assert np.array_equal(reader.mem, target.mem)


def test_a_target_read_with_notify_is_done_once_the_target_takes_it(fabric: Fabric) -> None:
    target, reader = pair(fabric, Completion.TARGET)
    handle = reader.t.read("target", [Segment(0, 0, 4096)], notify=b"note")
    assert reader.t.poll(handle).state is ReadState.PENDING
    assert target.t.progress() == [("reader", b"note")]
    assert reader.t.poll(handle).state is ReadState.DONE
    assert target.t.progress() == []
    assert target.t.notifications == 1


@pytest.mark.parametrize("completion", list(Completion))
def test_a_stalled_target_moves_nothing_until_it_resumes(
    fabric: Fabric, completion: Completion
) -> None:
    target, reader = pair(fabric, completion)
    target.t.stall()
    handle = reader.t.read("target", [Segment(0, 0, SIZE)], notify=b"n")
    for _ in range(5):
        target.t.progress()
        assert reader.t.poll(handle).state is ReadState.PENDING
    assert not reader.mem.any()
    target.t.resume()
    notes = []
    while reader.t.poll(handle).state is ReadState.PENDING:
        notes += target.t.progress()
    notes += target.t.progress()
    assert reader.t.poll(handle).state is ReadState.DONE
    assert notes == [("reader", b"n")]
    assert np.array_equal(reader.mem, target.mem)


def test_killing_a_target_fails_its_reads_in_flight_and_later_ones(fabric: Fabric) -> None:
    target, reader = pair(fabric, Completion.TARGET)
    handle = reader.t.read("target", [Segment(0, 0, SIZE)])
    target.t.kill()
    status = reader.t.poll(handle)
    assert (status.state, status.failure) == (ReadState.FAILED, FailureKind.PEER_DISCONNECTED)
    later = reader.t.poll(reader.t.read("target", [Segment(0, 0, 16)]))
    assert later.failure is FailureKind.PEER_DISCONNECTED
    assert reader.t.in_flight == 0
    with pytest.raises(TransportError, match="killed"):
        target.t.read("reader", [Segment(0, 0, 16)])


@pytest.mark.parametrize("torn", [False, True])
def test_injected_failures_hit_the_next_reads_from_the_named_peer_only(
    fabric: Fabric, torn: bool
) -> None:
    target, reader = pair(fabric, Completion.SYNC)
    other = Node(fabric, "other", seed=8)
    reader.t.add_peer(other.t.local_info())
    reader.t.fail_next(2, FailureKind.INVALID, peer="target", torn=torn)
    ok = reader.t.read("other", [Segment(0, 0, 4096)])
    assert ok.status.state is ReadState.DONE
    reader.mem[:] = 0
    for _ in range(2):
        status = reader.t.poll(reader.t.read("target", [Segment(0, 0, 8192)]))
        assert (status.state, status.failure) == (ReadState.FAILED, FailureKind.INVALID)
        assert "injected" in status.detail
    # A torn transfer moved half its bytes before it failed, as a broken one can.
    assert int(np.count_nonzero(reader.mem[:8192] == target.mem[:8192])) >= (4096 if torn else 0)
    if torn:
        assert np.array_equal(reader.mem[:4096], target.mem[:4096])
        assert not reader.mem[4096:8192].any()
    else:
        assert not reader.mem.any()
    assert reader.t.reads_failed[FailureKind.INVALID] == 2
    assert reader.t.read("target", [Segment(0, 0, 16)]).status.state is ReadState.DONE


def test_a_write_lands_in_the_peer_and_keeps_the_read_books(fabric: Fabric) -> None:
    target = Node(fabric, "target", completion=Completion.TARGET)
    source = Node(fabric, "source", seed=9)
    writer = writer_of(source.t)
    assert writer is source.t
    source.t.add_peer(target.t.local_info())
    handle = source.t.write("target", [Segment(4096, 8192, 65536)], notify=b"pushed")
    assert source.t.poll(handle).state is ReadState.PENDING
    source.t.release(handle)  # abandoned: it still lands, and counts as cancelled
    assert source.t.writes_abandoned == 1
    assert target.t.progress() == [("source", b"pushed")]
    assert np.array_equal(target.mem[8192 : 8192 + 65536], source.mem[4096 : 4096 + 65536])
    assert not target.mem[:8192].any() and not target.mem[8192 + 65536 :].any()
    assert (source.t.in_flight, source.t.writes_cancelled, source.t.writes_started) == (0, 1, 1)
    assert source.t.reads_started == 0
    done = source.t.write("target", [Segment(0, 0, 16)])
    target.t.progress()
    assert source.t.poll(done).state is ReadState.DONE
    assert (source.t.writes_done, source.t.bytes_written) == (1, 16)


def test_a_closed_target_is_never_touched_again(fabric: Fabric) -> None:
    target, reader = pair(fabric, Completion.TARGET)
    handle = reader.t.read("target", [Segment(0, 0, SIZE)])
    target.t.close()
    del target  # its memory may go: nothing will read it
    assert reader.t.poll(handle).failure is FailureKind.PEER_DISCONNECTED
    assert not reader.mem.any()


def test_metadata_from_another_fabric_is_refused(fabric: Fabric) -> None:
    elsewhere = Node(Fabric(), "target")
    reader = Node(fabric, "reader")
    with pytest.raises(TransportError, match="cannot load metadata"):
        reader.t.add_peer(elsewhere.t.local_info())


def test_many_threads_reading_at_once_all_land(fabric: Fabric) -> None:
    target, reader = pair(fabric, Completion.POLLED, steps=2)
    errors: list[str] = []

    def worker(base: int) -> None:
        for i in range(50):
            off = base + i * 4096
            handle = reader.t.read("target", [Segment(off, off, 4096)])
            while (status := reader.t.poll(handle)).state is ReadState.PENDING:
                pass
            reader.t.release(handle)
            if status.state is not ReadState.DONE:
                errors.append(str(status))

    threads = [threading.Thread(target=worker, args=(b,)) for b in (0, SIZE // 2)]
    for th in threads:
        th.start()
    for th in threads:
        th.join(30)
    assert errors == []
    assert reader.t.reads_done == reader.t.reads_started == 100
    span = 50 * 4096
    for base in (0, SIZE // 2):
        assert np.array_equal(reader.mem[base : base + span], target.mem[base : base + span])
