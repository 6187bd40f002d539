"""An authorized peer can touch only its own session: grants, releases, renewals, replays.

The producer runs in this process (real sockets, real NIXL agent) so that the tests
can watch its pins; every peer is a real CURVE client, and one is a real NIXL agent.
"""

from __future__ import annotations

import time
import uuid
from typing import Any

import pytest

pytest.importorskip("nixl._api")

from peer_testing import FINGERPRINT, Keyring, MakeProducer, MakeRawSession, config_of, granted
from security_testing import both_authorized
from waiting import wait_until

from ecshare import protocol as p
from ecshare.control import KeyPair
from ecshare.peer import Node
from ecshare.transport.base import PeerInfo, ReadState, pair_segments

pytestmark = pytest.mark.timeout(60)

MiB = 1 << 20


def _pins(node: Node) -> int:
    return node.store.stats().pins


def test_rival_cannot_release_renew_or_replay_another_sessions_grant(
    make_producer: MakeProducer,
    raw_session: MakeRawSession,
    rival_session: Any,
    keyring: Keyring,
    rival: KeyPair,
) -> None:
    h = "victim-item"
    node, producer = make_producer(both_authorized(keyring, rival), entries={h: 1 * MiB})
    victim = raw_session(producer.address)
    assert isinstance(victim.hello(), p.Welcome)
    grant = granted(victim.fetch("victim-request", h))
    attacker = rival_session(producer.address)
    assert isinstance(attacker.hello(), p.Welcome)  # authorized, with a session of its own
    before = dict(producer.counters)

    # Naming the victim's session: told it does not exist.
    for forged in (
        p.Release(session_id=victim.session_id, grant_ids=[grant.grant_id]),
        p.Renew(session_id=victim.session_id, grant_ids=[grant.grant_id]),
        p.FetchRequest(
            session_id=victim.session_id, request_id="victim-request", items=[p.ItemRequest(h)]
        ),
        p.Heartbeat(session_id=victim.session_id),
        p.Bye(session_id=victim.session_id),
    ):
        reply = attacker.call(forged)
        assert isinstance(reply, p.Error) and reply.code is p.ErrorCode.NO_SESSION, forged
    # Hello with the victim's session id does not take it over.
    hijack = attacker.call(
        p.Hello(
            versions=[2],
            session_id=victim.session_id,
            client_name="hijack",
            fingerprint=FINGERPRINT,
        )
    )
    assert isinstance(hijack, p.Error) and hijack.code is p.ErrorCode.NO_SESSION
    # Naming the victim's grant and request ids under its own session: nothing.
    own = attacker.session_id
    assert attacker.call(p.Release(session_id=own, grant_ids=[grant.grant_id])) == p.Released(
        released=[]
    )
    renewed = attacker.call(p.Renew(session_id=own, grant_ids=[grant.grant_id]))
    assert isinstance(renewed, p.Renewed) and renewed.renewed == []
    # The victim's request id, from the attacker's session: a fresh grant of its own,
    # not the victim's cached reply.
    replay = granted(attacker.fetch("victim-request", h))
    assert replay.grant_id != grant.grant_id

    assert producer.counters["no_session"] - before.get("no_session", 0) == 6
    assert producer.counters["released"] == before.get("released", 0)
    assert producer.counters["renewed"] == before.get("renewed", 0)
    assert producer.grants_by_session() == {
        victim.session_id: [grant.grant_id],
        attacker.session_id: [replay.grant_id],
    }
    assert _pins(node) == 2
    # The victim's grant is whole: it renews and releases, once.
    victim_renew = victim.call(p.Renew(session_id=victim.session_id, grant_ids=[grant.grant_id]))
    assert isinstance(victim_renew, p.Renewed) and victim_renew.renewed == [grant.grant_id]
    done = victim.call(p.Release(session_id=victim.session_id, grant_ids=[grant.grant_id]))
    assert done == p.Released(released=[grant.grant_id])
    assert _pins(node) == 1
    node.store.check_invariants()


def test_same_key_other_session_cannot_touch_the_first_sessions_grants(
    make_producer: MakeProducer, raw_session: MakeRawSession, keyring: Keyring
) -> None:
    # Two sessions under one key (two consumers sharing a role key): a grant is
    # still its own session's.
    h = "shared-key-item"
    node, producer = make_producer(keyring.producer_config(), entries={h: 256 * 1024})
    first, second = raw_session(producer.address), raw_session(producer.address)
    assert isinstance(first.hello(), p.Welcome) and isinstance(second.hello(), p.Welcome)
    grant = granted(first.fetch("r1", h))

    released = second.call(p.Release(session_id=second.session_id, grant_ids=[grant.grant_id]))
    renewed = second.call(p.Renew(session_id=second.session_id, grant_ids=[grant.grant_id]))
    second.client.send(p.Bye(session_id=second.session_id))

    assert released == p.Released(released=[])
    assert isinstance(renewed, p.Renewed) and renewed.renewed == []
    wait_until(lambda: producer.session_count() == 1, timeout_s=5.0)
    assert producer.grants_by_session() == {first.session_id: [grant.grant_id]}
    assert _pins(node) == 1


def test_forged_completion_notices_do_nothing(
    make_producer: MakeProducer,
    raw_session: MakeRawSession,
    rival_session: Any,
    keyring: Keyring,
    rival: KeyPair,
) -> None:
    h = "noticed-item"
    nbytes = 1 * MiB
    node, producer = make_producer(both_authorized(keyring, rival), entries={h: nbytes})
    victim = raw_session(producer.address)
    victim_agent = f"victim-agent-{uuid.uuid4().hex}"
    hello = p.Hello(
        versions=[2],
        session_id=victim.session_id,
        client_name="victim",
        fingerprint=FINGERPRINT,
        data_plane=p.DataPlaneInfo(kind="nixl", agent_name=victim_agent),
    )
    assert isinstance(victim.call(hello), p.Welcome)
    grant = granted(victim.fetch("r1", h))
    attacker = rival_session(producer.address)
    welcome = attacker.hello()
    assert isinstance(welcome, p.Welcome)

    # Control-plane releases of grants never issued, of odd ids, of the victim's.
    own = attacker.session_id
    for ids in (["g999999"], ["g0", "g-1", "x" * 128], [grant.grant_id], [grant.grant_id] * 50):
        assert attacker.call(p.Release(session_id=own, grant_ids=ids)) == p.Released(released=[])

    # Data-plane notices: a real NIXL agent with the producer's metadata (as any
    # authorized peer has) reads the victim's extents and attaches notices naming
    # the victim's session and grant, and garbage.
    agent = Node.create(config_of({"region_bytes": 4 * MiB}), "attacker")
    try:
        agent.transport.register(agent.store.region.address, agent.store.region.size)
        dp = welcome.data_plane
        peer = agent.transport.add_peer(
            PeerInfo(
                kind=dp.kind,
                agent_name=dp.agent_name,
                agent_metadata=dp.agent_metadata,
                region_address=dp.region_address,
                region_size=dp.region_size,
            )
        )
        notes = [
            f"{victim.session_id}:{grant.grant_id}".encode(),
            f"{own}:{grant.grant_id}".encode(),
            b"no-colon",
            b"\xff\xfe:\x00",
        ]
        before = producer.counters["bad_notifications"]
        for note in notes:
            segments = pair_segments([(0, nbytes)], [(e.offset, e.length) for e in grant.extents])
            handle = agent.transport.read(peer, segments, notify=note)
            wait_until(
                lambda handle=handle: agent.transport.poll(handle).state is ReadState.DONE,
                timeout_s=10.0,
            )
            agent.transport.release(handle)
        # The victim's-session notice and the garbage ones count as bad; the one
        # naming the attacker's own session names a grant it does not hold.
        wait_until(
            lambda: producer.counters["bad_notifications"] - before >= 3,
            timeout_s=10.0,
            detail=lambda: producer.counters,
        )
    finally:
        agent.close()

    assert producer.counters["released"] == 0
    assert producer.grants_by_session()[victim.session_id] == [grant.grant_id]
    assert _pins(node) == 1
    node.store.check_invariants()


def test_replayed_request_pins_once_and_releases_once(
    make_producer: MakeProducer, raw_session: MakeRawSession, keyring: Keyring
) -> None:
    h = "replayed-item"
    node, producer = make_producer(keyring.producer_config(), entries={h: 2 * MiB + 3})
    session = raw_session(producer.address)
    assert isinstance(session.hello(), p.Welcome)
    request = p.FetchRequest(
        session_id=session.session_id, request_id="r-replayed", items=[p.ItemRequest(h)]
    )

    replies = [session.call(request) for _ in range(20)]

    assert all(r == replies[0] for r in replies)
    grant = granted(replies[0])
    assert _pins(node) == 1 and producer.active_grants() == 1
    assert producer.counters["granted"] == 1 and producer.counters["duplicate_requests"] == 19
    release = p.Release(session_id=session.session_id, grant_ids=[grant.grant_id])
    assert session.call(release) == p.Released(released=[grant.grant_id])
    assert session.call(release) == p.Released(released=[])
    assert producer.counters["released"] == 1
    assert _pins(node) == 0


def test_replay_after_release_never_hands_out_the_ended_grant(
    make_producer: MakeProducer, raw_session: MakeRawSession, keyring: Keyring
) -> None:
    # Regression: a duplicate of a request whose grant had been released answered
    # with the cached GRANTED extents, though nothing pinned those blocks any more.
    h = "ended-item"
    node, producer = make_producer(keyring.producer_config(), entries={h: 1 * MiB})
    session = raw_session(producer.address)
    assert isinstance(session.hello(), p.Welcome)
    grant = granted(session.fetch("r1", h))
    session.call(p.Release(session_id=session.session_id, grant_ids=[grant.grant_id]))

    replay = session.fetch("r1", h)

    assert isinstance(replay, p.FetchReply), replay
    (item,) = replay.items
    assert item.status is not p.ItemStatus.GRANTED and not item.extents and not item.grant_id
    assert _pins(node) == 0 and producer.active_grants() == 0
    assert producer.counters["granted"] == 1
    # A new request is a new grant, as usual.
    assert granted(session.fetch("r2", h)).grant_id != grant.grant_id


def test_renewing_an_expired_grant_before_the_reaper_forgets_it(
    make_producer: MakeProducer, raw_session: MakeRawSession, keyring: Keyring
) -> None:
    # Regression: a Renew (or a replayed request) that found the lease already run
    # out let the table drop the pin, but the session kept the grant: it counted
    # against max_grants_per_session and kept the producer polling until the
    # session ended. The reaper is slowed down here so that the Renew comes first.
    h = "expiring-item"
    config = {
        "grant_lease_s": 0.6,
        "fetch_deadline_base_s": 0.3,
        "fetch_deadline_max_s": 0.5,
        "reap_interval_s": 60.0,
        "max_grants_per_session": 1,
    }
    node, producer = make_producer(keyring.producer_config(), config, entries={h: 1 * MiB})
    session = raw_session(producer.address)
    assert isinstance(session.hello(), p.Welcome)
    grant = granted(session.fetch("r1", h))
    granted_at = time.monotonic()
    session.keep_alive_until(lambda: time.monotonic() - granted_at > 0.9, 5.0)

    renewed = session.call(p.Renew(session_id=session.session_id, grant_ids=[grant.grant_id]))

    assert isinstance(renewed, p.Renewed) and renewed.renewed == []
    assert _pins(node) == 0
    assert producer.active_grants() == 0
    assert producer.grants_by_session() == {session.session_id: []}
    # The session's one grant slot is free again.
    granted(session.fetch("r2", h))


def test_unknown_session_ids_are_refused_whatever_their_shape(
    make_producer: MakeProducer, raw_session: MakeRawSession, keyring: Keyring
) -> None:
    node, producer = make_producer(keyring.producer_config(), entries={"x": 64 * 1024})
    session = raw_session(producer.address)
    assert isinstance(session.hello(), p.Welcome)
    for sid in (uuid.uuid4().hex, session.session_id.upper(), session.session_id + " ", "x"):
        reply = session.call(
            p.FetchRequest(session_id=sid, request_id="r", items=[p.ItemRequest("x")])
        )
        assert isinstance(reply, p.Error) and reply.code is p.ErrorCode.NO_SESSION, sid
    assert _pins(node) == 0 and producer.counters["no_session"] == 4
