"""Resource exhaustion is bounded: sessions, grants, batch sizes, pinned bytes, request floods.

Each limit is an operator-set Config key; going over it is a typed refusal that the
producer counts, and the producer goes on serving everyone within their limits.
"""

from __future__ import annotations

from typing import Any

import msgspec
import pytest
import zmq

pytest.importorskip("nixl._api")

from peer_testing import Keyring, MakeProducer, MakeRawSession
from security_testing import both_authorized, curve_dealer
from waiting import wait_until

from ecshare import protocol as p
from ecshare.config import Config, ConfigError
from ecshare.control import KeyPair

pytestmark = pytest.mark.timeout(60)

MiB = 1 << 20


def _statuses(reply: p.Message) -> list[p.ItemStatus]:
    assert isinstance(reply, p.FetchReply), reply
    return [item.status for item in reply.items]


def test_sessions_are_bounded_by_max_sessions(
    make_producer: MakeProducer, raw_session: MakeRawSession, keyring: Keyring
) -> None:
    _, producer = make_producer(
        keyring.producer_config(), {"max_sessions": 4}, entries={"h": 64 * 1024}
    )
    # Twelve clients at once, each opening a session.
    sessions = [raw_session(producer.address) for _ in range(12)]
    for s in sessions:
        s.client.send(
            p.Hello(
                versions=[2],
                session_id=s.session_id,
                client_name="many",
                fingerprint=s.fingerprint,
            )
        )
    replies = [s.client.recv(timeout_ms=5000) for s in sessions]

    welcomed = [s for s, r in zip(sessions, replies, strict=True) if isinstance(r, p.Welcome)]
    refused = [r for r in replies if isinstance(r, p.Error)]
    assert len(welcomed) == 4 and len(refused) == 8, replies
    assert all(r.code is p.ErrorCode.TOO_MANY_SESSIONS for r in refused)
    assert producer.session_count() == 4
    assert producer.counters["refused_sessions"] == 8
    # A refused client holds nothing: it cannot fetch.
    loser = next(s for s, r in zip(sessions, replies, strict=True) if isinstance(r, p.Error))
    no = loser.fetch("r1", "h")
    assert isinstance(no, p.Error) and no.code is p.ErrorCode.NO_SESSION
    # The sessions that got in are served; when one leaves, a newcomer gets its place.
    assert _statuses(welcomed[0].fetch("r1", "h")) == [p.ItemStatus.GRANTED]
    welcomed[1].client.send(p.Bye(session_id=welcomed[1].session_id))
    wait_until(lambda: producer.session_count() == 3, timeout_s=5.0)
    assert isinstance(loser.hello(), p.Welcome)


def test_one_key_cannot_take_every_session_when_max_sessions_per_key_is_set(
    make_producer: MakeProducer,
    raw_session: MakeRawSession,
    rival_session: Any,
    keyring: Keyring,
    rival: KeyPair,
) -> None:
    config = {"max_sessions": 8, "max_sessions_per_key": 2}
    _, producer = make_producer(both_authorized(keyring, rival), config, entries={"h": 64 * 1024})
    mine = [raw_session(producer.address) for _ in range(3)]
    replies = [s.hello() for s in mine]

    assert [type(r) for r in replies[:2]] == [p.Welcome, p.Welcome]
    refused = replies[2]
    assert isinstance(refused, p.Error) and refused.code is p.ErrorCode.TOO_MANY_SESSIONS
    assert "this key holds its maximum of 2 sessions" in refused.message
    assert producer.counters["refused_sessions_per_key"] == 1
    # Another key still gets in, and the first key's sessions are served.
    other = rival_session(producer.address)
    assert isinstance(other.hello(), p.Welcome)
    assert producer.session_count() == 3
    assert _statuses(mine[0].fetch("r1", "h")) == [p.ItemStatus.GRANTED]
    # When one of the key's sessions ends, the key may open another.
    mine[1].client.send(p.Bye(session_id=mine[1].session_id))
    wait_until(lambda: producer.session_count() == 2, timeout_s=5.0)
    assert isinstance(mine[2].hello(), p.Welcome)


def test_grants_per_session_are_bounded(
    make_producer: MakeProducer, raw_session: MakeRawSession, keyring: Keyring
) -> None:
    entries = {f"g{i}": 64 * 1024 for i in range(5)}
    node, producer = make_producer(
        keyring.producer_config(), {"max_grants_per_session": 3}, entries=entries
    )
    session = raw_session(producer.address)
    assert isinstance(session.hello(), p.Welcome)

    reply = session.fetch("r1", *entries)

    assert _statuses(reply) == [p.ItemStatus.GRANTED] * 3 + [p.ItemStatus.OVERLOADED] * 2
    assert all(item.retry_after_ms > 0 for item in reply.items[3:])  # type: ignore[attr-defined]
    assert node.store.stats().pins == 3
    assert producer.counters["refused_overloaded"] == 2
    # Another session has its own allowance.
    other = raw_session(producer.address)
    assert isinstance(other.hello(), p.Welcome)
    assert _statuses(other.fetch("r1", "g4")) == [p.ItemStatus.GRANTED]


def test_batches_are_bounded_and_a_100k_item_request_is_dropped(
    make_producer: MakeProducer, raw_session: MakeRawSession, keyring: Keyring
) -> None:
    node, producer = make_producer(
        keyring.producer_config(), {"max_batch_items": 8}, entries={"b": 64 * 1024}
    )
    session = raw_session(producer.address)
    assert isinstance(session.hello(), p.Welcome)

    too_many = session.fetch("r1", *["b"] * 9)
    assert isinstance(too_many, p.Error) and too_many.code is p.ErrorCode.BATCH_TOO_LARGE
    assert too_many.request_id == "r1"
    assert producer.counters["refused_batch"] == 1

    # 100k items (fits the 1 MiB frame limit), and items declaring giant sizes: the
    # decoder refuses them before anything is looked up; the sender learns why.
    context: zmq.Context[Any] = zmq.Context()
    dealer = curve_dealer(
        context, producer.address, server_public=keyring.producer.public, client=keyring.consumer
    )
    try:
        sid = session.session_id
        frames = [
            msgspec.msgpack.encode(
                {"t": "fetch", "session_id": sid, "request_id": "r2", "items": [["b", 0]] * 100_000}
            ),
            msgspec.msgpack.encode(
                {"t": "fetch", "session_id": sid, "request_id": "r3", "items": [["b", 1 << 60]]}
            ),
            msgspec.msgpack.encode(
                {"t": "fetch", "session_id": sid, "request_id": "r4", "items": [["b", -1]]}
            ),
        ]
        assert len(frames[0]) < 1 << 20
        for frame in frames:
            dealer.send(frame)
        answers = []
        while len(answers) < 3 and dealer.poll(5000):
            answers.append(p.decode(dealer.recv()))
    finally:
        dealer.close(linger=0)
        context.term()
    assert all(isinstance(a, p.Error) and a.code is p.ErrorCode.BAD_MESSAGE for a in answers)
    assert len(answers) == 3
    assert producer.control_stats["dropped_malformed"] == 3
    assert node.store.stats().pins == 0 and producer.active_grants() == 0
    # Within the limits, the same session is served.
    assert _statuses(session.fetch("r5", "b")) == [p.ItemStatus.GRANTED]


def test_pinned_bytes_per_session_are_bounded(
    make_producer: MakeProducer, raw_session: MakeRawSession, keyring: Keyring
) -> None:
    entries = {"a": 1 * MiB, "b": 1 * MiB, "c": 1 * MiB, "big": 3 * MiB}
    node, producer = make_producer(
        keyring.producer_config(), {"max_pinned_bytes_per_session": 2 * MiB}, entries=entries
    )
    session = raw_session(producer.address)
    assert isinstance(session.hello(), p.Welcome)

    reply = session.fetch("r1", "a", "b", "c", "big")

    assert _statuses(reply) == [
        p.ItemStatus.GRANTED,
        p.ItemStatus.GRANTED,
        p.ItemStatus.OVERLOADED,  # retryable: once some of its grants end
        p.ItemStatus.TOO_LARGE,  # never: over the limit on its own
    ]
    assert isinstance(reply, p.FetchReply)
    assert "max_pinned_bytes_per_session" in reply.items[3].detail
    assert producer.counters["refused_pinned_bytes"] == 2
    assert node.store.stats().pins == 2
    # The limit is per session: another one gets "c" now.
    other = raw_session(producer.address)
    assert isinstance(other.hello(), p.Welcome)
    assert _statuses(other.fetch("r1", "c")) == [p.ItemStatus.GRANTED]
    # Releasing a grant gives the bytes back; lease expiry and session end do too
    # (they go through the same bookkeeping).
    (first, *_) = reply.items
    session.call(p.Release(session_id=session.session_id, grant_ids=[first.grant_id]))
    assert _statuses(session.fetch("r2", "c")) == [p.ItemStatus.GRANTED]
    assert _statuses(session.fetch("r3", "a")) == [p.ItemStatus.OVERLOADED]


def test_pinned_bytes_limit_is_validated() -> None:
    with pytest.raises(ConfigError, match="max_pinned_bytes_per_session"):
        Config.from_dict({"max_pinned_bytes_per_session": 100})
    assert Config.from_dict({}).max_pinned_bytes_per_session is None
    assert Config.from_dict({"max_pinned_bytes_per_session": 1 << 30}).max_pinned_bytes_per_session


def test_request_flood_leaves_no_pins(
    make_producer: MakeProducer, raw_session: MakeRawSession, keyring: Keyring
) -> None:
    # Thousands of requests in flight from one session, none waited for: each is
    # answered, nothing is pinned for the ones that name nothing held here, and the
    # grants for the one that exists stay within max_grants_per_session.
    node, producer = make_producer(
        keyring.producer_config(), {"max_grants_per_session": 16}, entries={"held": 64 * 1024}
    )
    session = raw_session(producer.address)
    assert isinstance(session.hello(), p.Welcome)
    count = 3000
    answered = 0

    def take(timeout_ms: int) -> bool:
        nonlocal answered
        reply = session.client.recv(timeout_ms=timeout_ms)
        answered += isinstance(reply, p.FetchReply)
        return reply is not None

    for i in range(count):
        items = [p.ItemRequest(f"missing-{i}-{j}") for j in range(7)] + [p.ItemRequest("held")]
        request = p.FetchRequest(session_id=session.session_id, request_id=f"r{i}", items=items)
        # The client's own queue is bounded too: when it is full, read answers and resend.
        while not session.client.send(request):
            take(100)
        if i % 200 == 0:
            while take(0):
                pass
    while answered < count:
        assert take(10_000), f"{answered} of {count} answered"
    assert producer.control_stats["send_dropped_queue_full"] == 0
    assert node.store.stats().pins == 16 and producer.active_grants() == 16
    assert producer.counters["refused_missing"] == 7 * count
    assert producer.counters["refused_overloaded"] == count - 16


def test_reply_cache_is_bounded_and_keeps_only_replies_that_granted(
    make_producer: MakeProducer, raw_session: MakeRawSession, keyring: Keyring
) -> None:
    # Duplicate replies are cached so that a retried request pins nothing twice; a peer
    # sending many large distinct requests must not make that cache grow without bound.
    node, producer = make_producer(
        keyring.producer_config(), {"max_batch_items": 64}, entries={"held": 64 * 1024}
    )
    session = raw_session(producer.address)
    assert isinstance(session.hello(), p.Welcome)
    for i in range(40):  # 40 x 64 granted items, far past the cache's 1024 items
        reply = session.fetch(f"g{i}", *["held"] * 64)
        assert _statuses(reply) == [p.ItemStatus.GRANTED] * 64
        assert isinstance(reply, p.FetchReply)
        grant_ids = [item.grant_id for item in reply.items]
        released = session.call(p.Release(session_id=session.session_id, grant_ids=grant_ids))
        assert isinstance(released, p.Released)
    replies, items = producer.cached_replies()[session.session_id]
    assert items <= 1024 and replies == items // 64 and replies > 0
    assert node.store.stats().pins == 0

    # A reply that granted nothing is not kept: its repeat is answered afresh.
    duplicates = producer.counters["duplicate_requests"]
    for _ in range(2):
        assert _statuses(session.fetch("nothing", "absent")) == [p.ItemStatus.MISSING]
    assert producer.counters["duplicate_requests"] == duplicates
    assert producer.cached_replies()[session.session_id] == (replies, items)
    # The newest granting reply is still answered from the cache.
    again = session.fetch("g39", *["held"] * 64)
    assert producer.counters["duplicate_requests"] == duplicates + 1
    assert _statuses(again) == [p.ItemStatus.MISSING] * 64  # its grants have ended
