"""What the proxy workers share through their supervisor (`ecshare.apps.proxy.shared`):
the coordinator's promises, and the supervisor's channel (`workers._Hub`) on real
Unix sockets, refusing what a channel must not carry."""

from __future__ import annotations

import asyncio
import contextlib
import socket
from collections.abc import Callable

import pytest

from ecshare.apps.proxy.backends import ENCODER, BackendPool
from ecshare.apps.proxy.discovery import Membership
from ecshare.apps.proxy.link import SupervisorLink
from ecshare.apps.proxy.metrics import ProxyMetrics
from ecshare.apps.proxy.shared import (
    MAX_TO_SUPERVISOR_BYTES,
    Change,
    Changed,
    Claim,
    Claimed,
    Coordinator,
    FrameError,
    Land,
    Landed,
    Members,
    decode_to_supervisor,
    decode_to_worker,
    frame,
    split_frames,
)
from ecshare.apps.proxy.workers import _Hub
from ecshare.protocol import TransferParam

PD = "prefill_decode"
PARAM = TransferParam(
    peer="tcp://e:1", fingerprint="f" * 32, nbytes=4, dtype="bfloat16", shape=(2,)
)


def test_every_worker_gets_each_change_in_one_order_before_the_asker_is_answered() -> None:
    core = Coordinator(max_per_role=8)
    assert core.attach(1) == [(1, Members(0, []))]
    core.attach(2)
    out = core.receive(2, Change(7, True, PD, "http://pd:1"))
    members = Members(1, [(PD, "http://pd:1")])
    assert out == [(1, members), (2, members), (2, Changed(7, True))]
    # Registered again, or unregistering what is not registered: nothing changes.
    assert core.receive(1, Change(8, True, PD, "http://pd:1")) == [(1, Changed(8, False))]
    assert core.receive(1, Change(9, False, PD, "http://x:1")) == [(1, Changed(9, False))]
    # A worker that (re)starts gets the set as it is now.
    assert core.attach(3) == [(3, members)]
    out = core.receive(1, Change(10, False, PD, "http://pd:1"))
    assert out == [*((w, Members(2, [])) for w in (1, 2, 3)), (1, Changed(10, True))]


def test_registrations_past_the_cap_are_refused_and_counted() -> None:
    core = Coordinator(max_per_role=1)
    core.attach(1)
    core.receive(1, Change(1, True, PD, "http://a:1"))
    assert core.receive(1, Change(2, True, PD, "http://b:1")) == [(1, Changed(2, False))]
    assert core.stats["refused"] == 1
    assert core.registered() == [(PD, "http://a:1")]


def test_the_first_claim_leads_and_the_others_get_what_it_found() -> None:
    core = Coordinator(max_per_role=8)
    for w in (1, 2, 3):
        core.attach(w)
    assert core.receive(1, Claim("k")) == [(1, Claimed("k", lead=True))]
    assert core.receive(2, Claim("k")) == [(2, Claimed("k", lead=False))]
    assert core.receive(3, Claim("k")) == [(3, Claimed("k", lead=False))]
    # Only the leader lands it; a waiter's Land (it gave up) ends only its own wait.
    assert core.receive(3, Land("k")) == []
    assert core.receive(1, Land("k", "h", PARAM)) == [(2, Landed("k", "h", PARAM))]
    # Landed: the next claim leads a flight of its own.
    assert core.receive(2, Claim("k")) == [(2, Claimed("k", lead=True))]


def test_a_flight_whose_leader_ends_lands_with_nothing() -> None:
    core = Coordinator(max_per_role=8)
    for w in (1, 2):
        core.attach(w)
    core.receive(1, Claim("k"))
    core.receive(2, Claim("k"))
    assert core.detach(1) == [(2, Landed("k"))]
    assert core.stats["orphaned"] == 1
    assert core.receive(2, Claim("k")) == [(2, Claimed("k", lead=True))]


@pytest.mark.parametrize(
    "body",
    [
        b"\x93not a map",
        frame(Members(1, []))[4:],  # the supervisor's message, not a worker's
        frame(Change(1, True, "router", "http://x:1"))[4:],  # type: ignore[arg-type]
        frame(Claim("k" * 300))[4:],
    ],
    ids=["garbage", "wrong_direction", "unknown_role", "oversized_key"],
)
def test_a_frame_that_does_not_decode_is_a_frame_error(body: bytes) -> None:
    with pytest.raises(FrameError):
        decode_to_supervisor(body)


def test_frames_split_whole_and_refuse_an_oversized_length() -> None:
    buffer = bytearray(frame(Claim("a")) + frame(Claim("b"))[:3])
    assert [decode_to_supervisor(b) for b in split_frames(buffer, 1024)] == [Claim("a")]
    assert len(buffer) == 3  # the partial frame waits for the rest
    with pytest.raises(FrameError):
        list(split_frames(bytearray((1 << 30).to_bytes(4, "big")), 1024))
    assert decode_to_worker(frame(Landed("k", "h", PARAM))[4:]) == Landed("k", "h", PARAM)


def _read_frames(sock: socket.socket, count: int) -> list[object]:
    buffer = bytearray()
    out: list[object] = []
    while len(out) < count:
        chunk = sock.recv(1 << 16)
        assert chunk, "the channel closed"
        buffer += chunk
        out += [decode_to_worker(b) for b in split_frames(buffer, 1 << 20)]
    return out


def test_the_hub_answers_claims_and_drops_a_channel_that_sends_a_bad_frame() -> None:
    hub = _Hub()
    hub.start()
    pairs = [socket.socketpair() for _ in range(2)]
    try:
        for ours, _ in pairs:
            hub.attach(ours)
        one, two = (theirs for _, theirs in pairs)
        for sock in (one, two):
            sock.settimeout(10)
            assert _read_frames(sock, 1) == [Members(0, [])]
        one.sendall(frame(Claim("k")))
        assert _read_frames(one, 1) == [Claimed("k", lead=True)]
        two.sendall(frame(Claim("k")))
        assert _read_frames(two, 1) == [Claimed("k", lead=False)]

        one.sendall((MAX_TO_SUPERVISOR_BYTES + 1).to_bytes(4, "big"))
        assert one.recv(16) == b""  # dropped: that worker ends, and is replaced
        assert hub.bad_frames == 1
        # Its flight landed with nothing for the worker that waited on it.
        assert _read_frames(two, 1) == [Landed("k")]
    finally:
        hub.stop()
        for _, theirs in pairs:
            theirs.close()


def _pools() -> dict[str, BackendPool]:
    metrics = ProxyMetrics()
    return {role: BackendPool(role, [], eject_after=3, metrics=metrics) for role in (ENCODER, PD)}


def test_linked_workers_share_registrations_and_flights_through_a_real_hub() -> None:
    """Two workers' links in one loop, on real socket pairs to a real hub."""

    async def run() -> None:
        hub = _Hub()
        hub.start()
        links: list[SupervisorLink] = []
        memberships: list[Membership] = []
        try:
            for _ in range(2):
                ours, theirs = socket.socketpair()
                hub.attach(ours)
                membership = Membership(_pools(), health_timeout_s=0.5)
                link = SupervisorLink(theirs)
                await link.start(membership)
                links.append(link)
                memberships.append(membership)
            one, two = memberships

            # Registered through one worker: a member of both once the answer came.
            assert await one.register(PD, "http://127.0.0.1:9") is True
            for membership in (one, two):
                await _until(lambda m=membership: bool(m.held_by("registered")[PD]))
            assert await two.register(PD, "http://127.0.0.1:9") is False  # already
            assert await two.unregister(PD, "http://127.0.0.1:9") is True
            await _until(lambda: not one.held_by("registered")[PD])

            # One flight across both: the second worker waits for what the first found.
            first, second = links[0].flights, links[1].flights
            assert await first.join("k") is None
            waiting = await second.join("k")
            assert waiting is not None
            first.land("k", ("h", PARAM))
            assert await asyncio.wait_for(waiting, 10) == ("h", PARAM)

            # A claim given up before its answer ends its flight: the next one leads.
            claim = asyncio.ensure_future(first.join("j"))
            await asyncio.sleep(0)
            claim.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await claim
            assert await second.join("j") is None
            second.land("j", None)
        finally:
            for link in links:
                await link.close()
            hub.stop()

    asyncio.run(run())


async def _until(check: Callable[[], bool]) -> None:
    async with asyncio.timeout(10):
        while not check():
            await asyncio.sleep(0.01)
