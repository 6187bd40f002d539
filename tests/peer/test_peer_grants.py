"""Grants and pins, watched from inside a producer that runs in this process.

The producer serves real sockets (ZMQ with CURVE); the peers that talk to it are a
raw control-plane client (driven message by message) and real Consumers. Grants and
pins are the producer's logic, so its data plane is `LoopbackTransport`
(tests/peer/loopback_testing.py): the project's own in-process transport, held to
NIXL's contract by tests/transport/test_transport_contract.py, not a mock. The
stalled producer stays a real process over NIXL: a whole process stopping is what
it checks.
"""

from __future__ import annotations

import contextlib
import threading
import time

import numpy as np
import pytest

pytest.importorskip("nixl._api")

from loopback_testing import MakeLoopConsumer, MakeLoopProducer
from peer_testing import (
    FAST,
    Keyring,
    MakeRawSession,
    SpawnProducer,
    expected,
    granted,
    stored_bytes,
)
from waiting import wait_until

from ecshare import protocol as p
from ecshare.peer import FailureReason, FetchFailed
from ecshare.peer.grants import pin_owner
from ecshare.store import EntryMeta, EntryState, StoreFull

pytestmark = pytest.mark.timeout(60)

KiB = 1 << 10
MiB = 1 << 20


def test_duplicate_request_pins_once(
    loop_producer: MakeLoopProducer, raw_session: MakeRawSession, keyring: Keyring
) -> None:
    h, nbytes = "dup-item", 3 * MiB + 17
    node, producer = loop_producer(keyring.producer_config(), entries={h: nbytes})
    session = raw_session(producer.address)
    welcome = session.hello()
    assert isinstance(welcome, p.Welcome), welcome

    first = session.fetch("attempt-1", h)
    second = session.fetch("attempt-1", h)

    assert first == second  # the same grant, not a second one
    item = granted(first)
    assert item.grant_id
    assert node.store.stats().pins == 1
    assert node.store.stats().pinned_entries == 1
    assert producer.active_grants() == 1
    assert producer.counters["granted"] == 1
    assert producer.counters["duplicate_requests"] == 1
    # The grant is the item's extents relative to the region: a few dozen bytes,
    # and no memory address (those came once, in the Welcome).
    region = welcome.data_plane
    assert item.extents and sum(e.length for e in item.extents) == nbytes
    assert all(e.offset >= 0 and e.offset + e.length <= region.region_size for e in item.extents)
    assert all(e.offset < region.region_address for e in item.extents)
    assert len(p.encode(first)) < 200
    assert b"agent_metadata" not in p.encode(first)
    # A new attempt is a new grant; releasing both leaves nothing pinned.
    third = granted(session.fetch("attempt-2", h))
    assert third.grant_id != item.grant_id
    assert node.store.stats().pins == 2
    released = session.call(p.Release(session_id=session.session_id, grant_ids=[item.grant_id]))
    assert released == p.Released(released=[item.grant_id])
    again = session.call(p.Release(session_id=session.session_id, grant_ids=[item.grant_id]))
    assert again == p.Released(released=[])  # a second release of one grant does nothing
    session.call(p.Release(session_id=session.session_id, grant_ids=[third.grant_id]))
    assert node.store.stats().pins == 0
    assert producer.active_grants() == 0
    node.store.check_invariants()


def test_lease_expiry_releases_pins(
    loop_producer: MakeLoopProducer, raw_session: MakeRawSession, keyring: Keyring
) -> None:
    lease_s = 1.5
    short = {"grant_lease_s": lease_s, "fetch_deadline_base_s": 1.0, "fetch_deadline_max_s": 1.0}
    h, nbytes = "leased-item", 1 * MiB
    node, producer = loop_producer(keyring.producer_config(), short, entries={h: nbytes})
    session = raw_session(producer.address)
    assert isinstance(session.hello(), p.Welcome)

    granted_at = time.monotonic()
    item = granted(session.fetch("r1", h))
    assert node.store.stats().pins == 1
    # Never released; the session stays alive (heartbeats), so only the lease can end it.
    assert session.keep_alive_until(lambda: time.monotonic() - granted_at > lease_s / 2, 5.0)
    assert node.store.stats().pins == 1, "the pin ended before its lease"
    assert session.keep_alive_until(lambda: node.store.stats().pins == 0, lease_s + 2.0)
    held_s = time.monotonic() - granted_at

    assert held_s >= lease_s - 0.05, f"pin ended after {held_s:.2f} s, lease is {lease_s}"
    assert producer.counters["leases_expired"] == 1
    assert producer.session_count() == 1  # the session did not end: the lease did
    assert producer.active_grants() == 0
    late = session.call(p.Release(session_id=session.session_id, grant_ids=[item.grant_id]))
    assert late == p.Released(released=[])
    # The entry is evictable again: eviction takes it.
    assert node.store.stats().pinned_entries == 0
    assert node.store.evict_bytes(nbytes) >= nbytes
    assert node.store.get(h) is None
    node.store.check_invariants()


def test_pinned_entry_is_never_evicted_while_granted(
    loop_producer: MakeLoopProducer,
    loop_consumer: MakeLoopConsumer,
    raw_session: MakeRawSession,
    keyring: Keyring,
) -> None:
    # A region of 32 blocks, filled by four entries of 8 blocks; the granted one
    # is the least recently used, so it is what a careless eviction would take.
    block = 64 * KiB
    entry_bytes = 8 * block - 5
    small = {"region_bytes": 2 * MiB, "block_bytes": block}
    names = ["granted", "b", "c", "d"]
    node, producer = loop_producer(
        keyring.producer_config(), small, entries=dict.fromkeys(names, entry_bytes)
    )
    store = node.store
    assert store.stats().free_blocks == 0
    session = raw_session(producer.address)
    assert isinstance(session.hello(), p.Welcome)
    granted(session.fetch("r1", "granted"))
    original = expected("granted", entry_bytes)

    # Eviction pressure evicts the others, in LRU order, never the pinned entry.
    store.put("e", np.zeros(entry_bytes, np.uint8))
    assert store.get("b") is None and store.get("granted") is not None
    store.put("f", np.zeros(3 * 8 * block, np.uint8))
    assert [h for h in names if store.get(h) is not None] == ["granted"]
    # Only the pinned entry's blocks would do: StoreFull, and nothing is evicted.
    before = store.stats()
    with pytest.raises(StoreFull):
        store.put("whole-region", np.zeros(32 * block, np.uint8))
    assert store.stats().evictions == before.evictions
    assert store.get("f") is not None

    # Now eviction races real grants: a writer churns the region while a consumer
    # fetches the granted entry over and over. Every fetch that gets a grant must
    # read exactly the original bytes.
    stop = threading.Event()
    churned = [0]

    def churn() -> None:
        rng = np.random.default_rng(7)
        while not stop.is_set():
            n = int(rng.integers(1, 24)) * block
            with contextlib.suppress(StoreFull):
                store.put(f"churn-{churned[0]}", rng.integers(0, 256, n, dtype=np.uint8))
            churned[0] += 1

    cnode, consumer = loop_consumer(keyring.consumer_config())
    writer = threading.Thread(target=churn, daemon=True)
    writer.start()
    try:
        fetched = 0
        deadline = time.monotonic() + 1.0
        while time.monotonic() < deadline:
            session.heartbeat()
            result = consumer.fetch(["granted"], [producer.address])[0].result(timeout=10)
            assert result.nbytes == entry_bytes
            np.testing.assert_array_equal(stored_bytes(cnode, "granted"), original)
            cnode.store.remove("granted")
            fetched += 1
    finally:
        stop.set()
        writer.join(timeout=10)

    assert fetched >= 3 and churned[0] >= 3
    assert store.stats().evictions > before.evictions
    np.testing.assert_array_equal(stored_bytes(node, "granted"), original)
    entry = store.get("granted")
    assert entry is not None and entry.state is EntryState.READY
    store.check_invariants()


def test_allocated_entry_is_never_granted(
    loop_producer: MakeLoopProducer,
    loop_consumer: MakeLoopConsumer,
    raw_session: MakeRawSession,
    keyring: Keyring,
) -> None:
    node, producer = loop_producer(keyring.producer_config())
    writing = node.store.allocate("half-written", 256 * KiB)
    session = raw_session(producer.address)
    assert isinstance(session.hello(), p.Welcome)

    reply = session.fetch("r1", "half-written")

    assert isinstance(reply, p.FetchReply)
    (item,) = reply.items
    assert item.status is p.ItemStatus.NOT_READY and not item.grant_id and not item.extents
    assert node.store.stats().pins == 0
    _, consumer = loop_consumer(keyring.consumer_config())
    with pytest.raises(FetchFailed) as failed:
        consumer.fetch(["half-written"], [producer.address])[0].result(timeout=10)
    assert failed.value.reason is FailureReason.RETRIES_EXHAUSTED
    assert producer.counters["granted"] == 0
    # Once committed, the same entry is granted.
    node.store.write(writing, expected("half-written", 256 * KiB))
    node.store.commit(writing)
    wait_until(lambda: not consumer.pending(), timeout_s=5.0)
    result = consumer.fetch(["half-written"], [producer.address])[0].result(timeout=10)
    assert result.nbytes == 256 * KiB


def test_grant_whose_meta_disagrees_with_its_size_fails_as_a_bad_grant_not_store_full(
    loop_producer: MakeLoopProducer,
    loop_consumer: MakeLoopConsumer,
    keyring: Keyring,
) -> None:
    node, producer = loop_producer(keyring.producer_config(), entries={"misdescribed": 256 * KiB})
    entry = node.store.get("misdescribed")
    assert entry is not None
    # The producer's own store refuses such meta; a peer that lies about it is
    # what this stands for: 3 float32 are 12 bytes, the grant says 256 KiB.
    entry.meta = EntryMeta(dtype="float32", shape=(3,))
    consumer_node, consumer = loop_consumer(keyring.consumer_config())

    with pytest.raises(FetchFailed) as failed:
        consumer.fetch(["misdescribed"], [producer.address])[0].result(timeout=10)

    assert failed.value.reason is FailureReason.TRANSPORT
    assert "grant meta invalid" in failed.value.detail
    assert consumer_node.store.get("misdescribed") is None
    assert consumer_node.store.stats().used_blocks == 0
    wait_until(lambda: node.store.stats().pins == 0, timeout_s=5.0)


def test_stalled_producer_keeps_live_sessions_and_their_pins(
    spawn_producer: SpawnProducer, raw_session: MakeRawSession, keyring: Keyring
) -> None:
    # The producer's network thread stalls (as in a long data-plane progress call)
    # for longer than the heartbeat timeout, while the consumer keeps sending
    # heartbeats. Those are waiting in its socket: the session is alive, and its
    # grant must stay pinned.
    producer = spawn_producer(synthetic="1MiB:1", config=keyring.producer_config(), hooks=True)
    (h,) = producer.sizes
    session = raw_session(producer.address)
    assert isinstance(session.hello(), p.Welcome)
    granted(session.fetch("r1", h))
    assert producer.stats()["store"]["pins"] == 1

    stall_s = FAST["heartbeat_timeout_s"] + 0.6
    assert producer.command(f"stall {stall_s}")["stalling"]
    stalled_at = time.monotonic()
    session.keep_alive_until(lambda: time.monotonic() - stalled_at > stall_s + 0.6, 5.0)
    stats = producer.stats()

    assert stats["store"]["pins"] == 1, stats
    assert stats["sessions"] == 1, stats
    assert stats["counters"].get("sessions_closed", 0) == 0, stats
    # The session still works.
    reply = session.fetch("r2", h)
    assert isinstance(reply, p.FetchReply) and reply.items[0].status is p.ItemStatus.GRANTED


def test_session_named_like_another_pin_owner_cannot_touch_its_pins(
    loop_producer: MakeLoopProducer, raw_session: MakeRawSession, keyring: Keyring
) -> None:
    h = "shared-entry"
    lease = {"grant_lease_s": 1.0, "fetch_deadline_base_s": 0.5, "fetch_deadline_max_s": 0.8}
    node, producer = loop_producer(keyring.producer_config(), lease, entries={h: MiB})
    engine = "ecshare.vllm.load"  # an engine sharing the store pins under its own owner
    node.store.pin(h, engine, "load-1", lease_s=60.0)
    session = raw_session(producer.address)
    session.session_id = engine  # client-chosen: the same string as that owner
    assert isinstance(session.hello(), p.Welcome)
    assert granted(session.fetch("r1", h)).grant_id
    released = session.call(p.Release(session_id=engine, grant_ids=["load-1"]))
    assert isinstance(released, p.Released) and released.released == []
    session.client.send(p.Bye(session_id=engine))
    wait_until(lambda: producer.session_count() == 0, timeout_s=1.0)
    # The session's own grant runs out with its lease; the engine's pin stays.
    wait_until(lambda: node.store.stats().pins == 1, timeout_s=3.0)
    assert node.store.pinned_entry(engine, "load-1") is not None


def test_releases_inside_a_request_free_pins_before_it_grants_and_only_once(
    loop_producer: MakeLoopProducer, raw_session: MakeRawSession, keyring: Keyring
) -> None:
    first_h, next_h = "released-in-request", "granted-after"
    # One grant per session: the second request is granted only if its Release
    # of the first is applied before it grants.
    node, producer = loop_producer(
        keyring.producer_config(),
        {"max_grants_per_session": 1},
        entries={first_h: MiB, next_h: MiB},
    )
    session = raw_session(producer.address)
    welcome = session.call(
        p.Hello(
            versions=list(p.SUPPORTED_VERSIONS),
            session_id=session.session_id,
            client_name="raw-test-client",
            fingerprint=session.fingerprint,
            capabilities=[p.CAP_RELEASE_IN_REQUEST],
        )
    )
    assert isinstance(welcome, p.Welcome) and p.CAP_RELEASE_IN_REQUEST in welcome.capabilities
    other = raw_session(producer.address)
    assert isinstance(other.hello(), p.Welcome)
    theirs = granted(other.fetch("theirs", first_h)).grant_id
    mine = granted(session.fetch("r1", first_h)).grant_id
    assert node.store.stats().pins == 2

    def request_releasing(request_id: str, *grant_ids: str) -> p.Message:
        return session.call(
            p.FetchRequest(
                session_id=session.session_id,
                request_id=request_id,
                items=[p.ItemRequest(next_h)],
                releases=list(grant_ids),
            )
        )

    # Another session's grant named here is not ours to release: it stays.
    reply = request_releasing("r2", mine, theirs)
    assert isinstance(reply, p.FetchReply), reply
    second = granted(reply).grant_id
    assert node.store.pinned_entry(pin_owner(other.session_id), theirs) is not None
    assert producer.counters["releases_in_requests"] == 1
    assert producer.counters["released"] == 1
    assert node.store.stats().pins == 2  # theirs and the new grant; mine is gone
    # Nothing else was said: the next message is the answer to the next call.
    assert session.client.recv(timeout_ms=100) is None
    # The same attempt again (a resend after a lost lane): same grant, nothing
    # released twice, nothing pinned twice.
    assert request_releasing("r2", mine, theirs) == reply
    assert producer.counters["released"] == 1
    assert producer.counters["duplicate_requests"] == 1
    assert node.store.stats().pins == 2
    assert second != mine


def test_a_release_from_before_a_restart_never_ends_the_new_process_grants(
    loop_producer: MakeLoopProducer, raw_session: MakeRawSession, keyring: Keyring
) -> None:
    """Two producer processes in turn (here: two producers of one test) grant the same
    first grant of a session; the ids differ, so a Release carrying the first one's
    ids, on a session of the second, ends nothing there and is counted."""
    h = "granted-twice"
    _, before = loop_producer(keyring.producer_config(), entries={h: MiB})
    old = raw_session(before.address)
    assert isinstance(old.hello(), p.Welcome)
    old_id = granted(old.fetch("r1", h)).grant_id

    node, after = loop_producer(keyring.producer_config(), entries={h: MiB})
    new = raw_session(after.address)
    assert isinstance(new.hello(), p.Welcome)
    new_id = granted(new.fetch("r1", h)).grant_id
    assert new_id != old_id  # each names the process that made it

    reply = new.call(p.Release(session_id=new.session_id, grant_ids=[old_id]))
    assert reply == p.Released(released=[])
    assert after.counters["releases_unmatched"] == 1
    assert node.store.pinned_entry(pin_owner(new.session_id), new_id) is not None
    reply = new.call(p.Release(session_id=new.session_id, grant_ids=[new_id]))
    assert reply == p.Released(released=[new_id])
    assert node.store.stats().pins == 0
