"""NixlTransport between real processes over real NIXL (UCX on the loopback device)."""

from __future__ import annotations

import mmap
import threading
import time
import uuid
from collections.abc import Iterator
from dataclasses import replace
from typing import Any

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

pytest.importorskip("nixl._api")

from nixl_peer_proc import LOOPBACK, Producer, address, pattern

from ecshare.transport import (
    FailureKind,
    NixlTransport,
    PeerInfo,
    ReadState,
    ReadStatus,
    Segment,
    TransportError,
    pair_segments,
)

SIZE = 8 << 20
pytestmark = pytest.mark.timeout(60)


class Side:
    """The consumer: a transport over a zeroed local region, in this process."""

    def __init__(self, **kw: Any) -> None:
        self.mm = mmap.mmap(-1, SIZE)
        self.mem = np.frombuffer(self.mm, dtype=np.uint8)
        env = {**LOOPBACK, **kw.pop("ucx_env", {})}
        self.t = NixlTransport(f"consumer-{uuid.uuid4().hex[:8]}", ucx_env=env, **kw)
        self.t.register(address(self.mm), SIZE)

    def wait(self, handle: Any, timeout: float = 5.0) -> ReadStatus:
        deadline = time.monotonic() + timeout
        while True:
            status = self.t.poll(handle)
            if status.state is not ReadState.PENDING or time.monotonic() > deadline:
                return status

    def read(self, peer: str, segments: list[Segment], notify: bytes = b"") -> ReadStatus:
        handle = self.t.read(peer, segments, notify)
        status = self.wait(handle)
        self.t.release(handle)
        return status

    def close(self) -> None:
        self.t.close()


def _settled(t: NixlTransport) -> int:
    return t.reads_done + sum(t.reads_failed.values()) + t.reads_cancelled


@pytest.fixture(scope="module")
def producer() -> Iterator[Producer]:
    p = Producer(f"producer-{uuid.uuid4().hex[:8]}", SIZE, seed=1)
    yield p
    p.stop()


@pytest.fixture(scope="module")
def consumer(producer: Producer) -> Iterator[Side]:
    side = Side()
    side.t.add_peer(producer.info)
    yield side
    side.close()


@pytest.fixture
def clean(consumer: Side) -> Side:
    consumer.mem[:] = 0
    return consumer


def test_single_segment_read_is_byte_exact(producer: Producer, clean: Side) -> None:
    expected = pattern(producer.seed, SIZE)
    before = (clean.t.reads_done, clean.t.bytes_read)
    status = clean.read(producer.info.agent_name, [Segment(4096, 1 << 20, 3 << 20)])
    assert status.state is ReadState.DONE, status
    assert np.array_equal(clean.mem[4096 : 4096 + (3 << 20)], expected[1 << 20 : 4 << 20])
    assert not clean.mem[:4096].any() and not clean.mem[4096 + (3 << 20) :].any()
    assert (clean.t.reads_done, clean.t.bytes_read) == (before[0] + 1, before[1] + (3 << 20))


@st.composite
def _scattered(draw: st.DrawFn) -> list[Segment]:
    """Extents of mixed sizes (1 B to 256 KiB) placed anywhere, paired across both sides."""

    def extents(lengths: list[int]) -> list[tuple[int, int]]:
        spare = (SIZE - sum(lengths)) // len(lengths)
        out, offset = [], 0
        for n in lengths:
            offset += draw(st.integers(0, spare))
            out.append((offset, n))
            offset += n
        return draw(st.permutations(out))

    sizes = st.sampled_from([1, 7, 4096, 4097, 65536, 262144])
    local_lengths = draw(st.lists(sizes, min_size=1, max_size=16))
    total = sum(local_lengths)
    cuts = sorted(draw(st.lists(st.integers(1, total - 1), max_size=8))) if total > 1 else []
    remote_lengths = [b - a for a, b in zip([0, *cuts], [*cuts, total], strict=True) if b > a]
    return pair_segments(extents(local_lengths), extents(remote_lengths))


@settings(
    max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(segments=_scattered())
def test_scattered_segments_land_byte_exact(
    producer: Producer, consumer: Side, segments: list[Segment]
) -> None:
    consumer.mem[:] = 0
    expected = pattern(producer.seed, SIZE)
    status = consumer.read(producer.info.agent_name, segments)
    assert status.state is ReadState.DONE, status
    written = np.zeros(SIZE, dtype=bool)
    for s in segments:
        got = consumer.mem[s.local_offset : s.local_offset + s.length]
        assert np.array_equal(got, expected[s.remote_offset : s.remote_offset + s.length]), s
        written[s.local_offset : s.local_offset + s.length] = True
    assert not consumer.mem[~written].any(), "bytes outside the segments were written"


def test_notify_reaches_producer_progress_exactly_once(producer: Producer, clean: Side) -> None:
    producer.notifs()  # drain
    token = uuid.uuid4().bytes
    status = clean.read(producer.info.agent_name, [Segment(0, 0, 65536)], notify=token)
    assert status.state is ReadState.DONE, status
    got: list[tuple[str, bytes]] = []
    for _ in range(5):
        got += producer.notifs()
        time.sleep(0.02)
    assert got == [(clean.t.name, token)]


@pytest.mark.parametrize(
    "segment",
    [
        Segment(0, SIZE - 4096, 4097),  # past the end of the peer's region
        Segment(SIZE - 1, 0, 2),  # past the end of ours
        Segment(0, SIZE, 1),
        Segment(-4096, 0, 4096),
        Segment(0, -1, 16),
        Segment(0, 0, 0),
        Segment(0, 1 << 70, 4096),
    ],
)
def test_out_of_bounds_segment_is_rejected_before_any_read(
    producer: Producer, clean: Side, segment: Segment
) -> None:
    failed = clean.t.reads_failed[FailureKind.INVALID]
    good = Segment(0, 0, 4096)
    handle = clean.t.read(producer.info.agent_name, [good, segment])
    status = clean.t.poll(handle)
    assert (status.state, status.failure) == (ReadState.FAILED, FailureKind.INVALID)
    assert clean.t.reads_failed[FailureKind.INVALID] == failed + 1
    assert not clean.mem.any(), "a rejected read must not move any byte"
    clean.t.release(handle)
    clean.t.release(handle)


def test_peer_claiming_more_than_it_registered_cannot_be_read_past(
    producer: Producer, clean: Side
) -> None:
    # The bounds check trusts the peer's claimed size; NIXL still checks what it registered.
    liar = replace(producer.info, region_size=2 * SIZE)
    side = Side()
    try:
        side.t.add_peer(liar)
        status = side.read(liar.agent_name, [Segment(0, SIZE, 4096)])
        assert (status.state, status.failure) == (ReadState.FAILED, FailureKind.NOT_FOUND)
        assert not side.mem.any()
    finally:
        side.close()


def test_read_from_unknown_peer_fails_not_found(clean: Side) -> None:
    status = clean.read("nobody", [Segment(0, 0, 16)])
    assert (status.state, status.failure) == (ReadState.FAILED, FailureKind.NOT_FOUND)


def test_add_peer_rejects_foreign_kind_garbage_and_borrowed_metadata(producer: Producer) -> None:
    side = Side()
    try:
        with pytest.raises(ValueError):
            side.t.add_peer(replace(producer.info, kind="tcp"))
        with pytest.raises(TransportError):
            side.t.add_peer(replace(producer.info, agent_metadata=b"garbage"))
        with pytest.raises(ValueError):
            side.t.add_peer(replace(producer.info, agent_name="impostor"))
        assert side.t.peers == []
        # A peer presenting another known peer's metadata must not unload that peer.
        side.t.add_peer(producer.info)
        with pytest.raises(ValueError):
            side.t.add_peer(replace(producer.info, agent_name="impostor"))
        assert side.t.peers == [producer.info.agent_name]
        assert side.read(producer.info.agent_name, [Segment(0, 0, 4096)]).state is ReadState.DONE
    finally:
        side.close()


def test_register_one_region_only_and_use_after_close_raise(producer: Producer) -> None:
    side = Side()
    # The same region again is a no-op: a node's Producer and Consumer share it.
    side.t.register(address(side.mm), SIZE)
    with pytest.raises(TransportError):
        side.t.register(address(side.mm), SIZE // 2)
    side.t.add_peer(producer.info)
    done = side.t.read(producer.info.agent_name, [Segment(0, 0, 4096)])
    assert side.wait(done).state is ReadState.DONE
    side.close()
    side.close()
    assert side.t.poll(done).state is ReadState.DONE
    side.t.release(done)
    assert side.t.progress() == []
    with pytest.raises(TransportError):
        side.t.read(producer.info.agent_name, [Segment(0, 0, 4096)])


def test_concurrent_reads_from_two_threads_all_land(producer: Producer, clean: Side) -> None:
    expected = pattern(producer.seed, SIZE)
    started = clean.t.reads_started
    errors: list[str] = []

    def worker(base: int) -> None:
        for i in range(40):
            off = base + i * 16384
            status = clean.read(producer.info.agent_name, [Segment(off, off, 16384)])
            if status.state is not ReadState.DONE:
                errors.append(str(status))

    threads = [threading.Thread(target=worker, args=(b,)) for b in (0, 4 << 20)]
    for th in threads:
        th.start()
    for th in threads:
        th.join(30)
    assert errors == []
    assert np.array_equal(clean.mem[: 640 << 10], expected[: 640 << 10])
    assert np.array_equal(
        clean.mem[4 << 20 : (4 << 20) + (640 << 10)], expected[4 << 20 :][: 640 << 10]
    )
    assert clean.t.reads_started == started + 80
    assert _settled(clean.t) == clean.t.reads_started


def test_prepared_lists_serve_aligned_reads_and_fall_back_for_others(producer: Producer) -> None:
    side = Side(prepared_block_size=65536)
    try:
        side.t.add_peer(producer.info)
        expected = pattern(producer.seed, SIZE)
        aligned = pair_segments([(65536, 65536), (0, 65536)], [(1 << 20, 131072)])
        unaligned = [Segment(2 << 20, 100, 5000)]
        for segs in (aligned, unaligned):
            assert side.read(producer.info.agent_name, segs).state is ReadState.DONE
            for s in segs:
                got = side.mem[s.local_offset : s.local_offset + s.length]
                assert np.array_equal(got, expected[s.remote_offset : s.remote_offset + s.length])
        assert side.t.reads_prepped == 1
    finally:
        side.close()


def test_killed_producer_fails_reads_within_2s_without_raising() -> None:
    p = Producer(f"doomed-{uuid.uuid4().hex[:8]}", SIZE, seed=2)
    side = Side()
    try:
        side.t.add_peer(p.info)
        assert side.read(p.info.agent_name, [Segment(0, 0, 4096)]).state is ReadState.DONE
        p.kill()
        t0 = time.monotonic()
        for _ in range(3):  # the first read after the death, and every one after it
            handle = side.t.read(p.info.agent_name, [Segment(0, 0, 1 << 20)])
            status = side.wait(handle, timeout=2.0)
            side.t.release(handle)
            assert status.state is ReadState.FAILED, status
            assert status.failure in (FailureKind.PEER_DISCONNECTED, FailureKind.NOT_FOUND)
        assert time.monotonic() - t0 < 2.0
        assert side.t.reads_failed[FailureKind.PEER_DISCONNECTED] >= 1
        assert not side.mem[4096:].any()
    finally:
        side.close()
        p.stop()


def test_restarted_producer_readded_serves_its_new_bytes() -> None:
    name = f"phoenix-{uuid.uuid4().hex[:8]}"
    first = Producer(name, SIZE, seed=3)
    side = Side()
    second = None
    try:
        side.t.add_peer(first.info)
        assert side.read(name, [Segment(0, 0, SIZE)]).state is ReadState.DONE
        assert np.array_equal(side.mem, pattern(3, SIZE))
        first.kill()
        second = Producer(name, SIZE, seed=4)
        assert second.info.agent_metadata != first.info.agent_metadata
        assert side.t.add_peer(second.info) == name
        assert side.t.peers == [name]
        side.mem[:] = 0
        status = side.read(name, [Segment(0, 0, SIZE)])
        assert status.state is ReadState.DONE, status
        assert np.array_equal(side.mem, pattern(4, SIZE))
    finally:
        side.close()
        first.stop()
        if second is not None:
            second.stop()


def test_tcp_reads_move_as_the_producer_progresses() -> None:
    tcp = {"UCX_TLS": "tcp"}
    p = Producer(f"tcp-{uuid.uuid4().hex[:8]}", SIZE, seed=5, env=tcp)
    side = Side(ucx_env=tcp)
    try:
        side.t.add_peer(p.info)
        expected = pattern(5, SIZE)
        segs = pair_segments([(0, 1 << 20), (3 << 20, 3 << 20)], [(4 << 20, 4 << 20)])
        status = side.read(p.info.agent_name, segs)
        assert status.state is ReadState.DONE, status
        assert np.array_equal(side.mem[: 1 << 20], expected[4 << 20 : 5 << 20])
        assert np.array_equal(side.mem[3 << 20 : 6 << 20], expected[5 << 20 : 8 << 20])

        # While the producer does not progress, a TCP read cannot finish (proof that
        # UCX_TLS=tcp took effect: cross memory attach would finish inside read()).
        pause = threading.Thread(target=p.call, args=("sleep", 1.0))
        pause.start()
        time.sleep(0.1)
        side.mem[:] = 0
        stalled = side.t.read(p.info.agent_name, [Segment(0, 0, SIZE)])
        time.sleep(0.1)
        assert side.t.poll(stalled).state is ReadState.PENDING
        pause.join()
        # It finishes once the producer progresses again (what happens to reads
        # given up meanwhile is in test_transport_lifetimes.py).
        assert side.wait(stalled).state is ReadState.DONE
        side.t.release(stalled)
        side.mem[:] = 0

        status = side.read(p.info.agent_name, [Segment(0, 0, SIZE)])
        assert status.state is ReadState.DONE, status
        assert np.array_equal(side.mem, expected)
        assert side.t.unreleased == 0
        assert _settled(side.t) == side.t.reads_started
    finally:
        side.close()
        p.stop()


def test_peer_info_is_what_was_registered(producer: Producer) -> None:
    info: PeerInfo = producer.info
    assert info.kind == "nixl"
    assert info.region_size == SIZE
    assert info.agent_metadata
