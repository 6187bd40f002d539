"""Leases bind both ends, over UCX TCP where reads are asynchronous.

The producer runs in this process (so a test can slow or stop its progress,
which is what moves a TCP read), the consumer too, each on its own NIXL agent.
"""

from __future__ import annotations

import time
from typing import Any

import numpy as np
import pytest

pytest.importorskip("nixl._api")

from peer_testing import (
    FAST,
    FINGERPRINT,
    STALLABLE_TCP,
    Keyring,
    MakeConsumer,
    MakeProducer,
    MakeRawSession,
    config_of,
    expected,
    granted,
    stays,
    stored_bytes,
    throttle_progress,
)
from waiting import wait_until

from ecshare import protocol as p
from ecshare.control import ClientPool, LinkSettings, load_keypair, load_public_key
from ecshare.peer import FailureReason, FetchFailed
from ecshare.peer.grants import pin_owner
from ecshare.peer.link import PeerLink, PeerLinkState

pytestmark = pytest.mark.timeout(90)

MiB = 1 << 20
TCP = STALLABLE_TCP  # the stalls below hold back the producer's own progress calls


def test_consumer_gives_up_before_the_lease_the_producer_granted(
    make_producer: MakeProducer, make_consumer: MakeConsumer, keyring: Keyring, gate: Any
) -> None:
    # The producer grants 1 s; the consumer alone would wait 2.5 s. Only the
    # lease on the wire tells it to stop sooner.
    short = {"grant_lease_s": 1.0, "fetch_deadline_base_s": 0.5, "fetch_deadline_max_s": 0.8}
    h, nbytes = "short-lease", 8 * MiB
    pnode, producer = make_producer(keyring.producer_config(), TCP, short, entries={h: nbytes})
    throttle_progress(pnode, producer, lambda: gate.wait(10.0))  # stalled: nothing moves
    cnode, consumer = make_consumer(
        keyring.consumer_config(),
        TCP,
        {"fetch_deadline_base_s": 2.5, "fetch_deadline_max_s": 2.5, "grant_lease_s": 3.0},
    )
    assert config_of(TCP).fetch_deadline_s(nbytes) > 1.0

    t0 = time.monotonic()
    future = consumer.fetch([h], peers=[producer.address])[0]
    with pytest.raises(FetchFailed) as failed:
        future.result(timeout=10)
    took = time.monotonic() - t0
    assert failed.value.reason is FailureReason.DEADLINE, failed.value
    assert "lease" in failed.value.detail
    # The bound is its own deadline: the lease (the detail, the counter) ended it sooner.
    assert took < 2.5, f"gave up after {took:.2f} s, at its own deadline, not the lease"
    assert consumer.counter_snapshot()["leases_run_out"] == 1
    # Beside it, the session's one-block warm-up read, waiting on the producer too.
    assert consumer.counter_snapshot()["warm_ups"] == 1

    # The read is still in flight: its blocks stay held, not reused, pass after pass.
    def held() -> bool:
        stats = cnode.store.stats()
        return (stats.quarantined, consumer.fenced_reads()[0]) == (1 + 1, 1)

    assert stays(held, consumer), cnode.store.stats()
    assert cnode.store.get(h) is None

    gate.set()  # the producer progresses; the read ends and its blocks come back
    wait_until(lambda: cnode.store.stats().quarantined == 0, timeout_s=10.0)
    counters = consumer.counter_snapshot()
    assert counters["reads_fenced"] == counters["fenced_reads_ended"] == 1
    assert cnode.store.stats().canary_violations == 0
    cnode.store.check_invariants()


def test_slow_healthy_read_renews_its_lease_and_lands_intact(
    make_producer: MakeProducer, make_consumer: MakeConsumer, keyring: Keyring
) -> None:
    short = {"grant_lease_s": 1.0, "fetch_deadline_base_s": 0.5, "fetch_deadline_max_s": 0.8}
    h, nbytes = "slow-read", 32 * MiB
    pnode, producer = make_producer(keyring.producer_config(), TCP, short, entries={h: nbytes})
    # A slow network, not a dead producer: the data plane stands still for the
    # read's first 1.5 s (longer than the lease), the control plane answers at once.
    progress = pnode.transport.progress
    granted_at: list[float] = []

    def slow_data_plane() -> list[tuple[str, bytes]]:
        if producer.active_grants():
            if not granted_at:
                granted_at.append(time.monotonic())
            if time.monotonic() - granted_at[0] < 1.5:
                return []
        return progress()

    pnode.transport.progress = slow_data_plane  # type: ignore[method-assign]
    cnode, consumer = make_consumer(
        keyring.consumer_config(),
        TCP,
        {"fetch_deadline_base_s": 20.0, "fetch_deadline_max_s": 20.0, "grant_lease_s": 30.0},
    )

    result = consumer.fetch([h], peers=[producer.address])[0].result(timeout=30)
    assert result.latency_s > 1.5, f"read took {result.latency_s:.2f} s: no renewal was needed"
    assert np.array_equal(stored_bytes(cnode, h), expected(h, nbytes))
    counters = consumer.counter_snapshot()
    assert counters["renewed"] >= 1 and counters.get("renewals_refused", 0) == 0, counters
    assert producer.counters["renewed"] >= 1
    wait_until(lambda: pnode.store.stats().pins == 0, timeout_s=2.0)  # released once read


def test_bye_leaves_grants_pinned_until_their_lease_ends(
    make_producer: MakeProducer, raw_session: MakeRawSession, keyring: Keyring
) -> None:
    lease = {"grant_lease_s": 1.0, "fetch_deadline_base_s": 0.5, "fetch_deadline_max_s": 0.8}
    h = "after-bye"
    node, producer = make_producer(keyring.producer_config(), lease, entries={h: MiB})
    session = raw_session(producer.address)
    assert isinstance(session.hello(), p.Welcome)
    item = granted(session.fetch("r1", h))
    t0 = time.monotonic()
    session.client.send(p.Bye(session_id=session.session_id))
    wait_until(lambda: producer.session_count() == 0, timeout_s=1.0)
    # A read of it may still be moving over the data plane: the pin stays.
    assert node.store.stats().pins == 1
    assert node.store.pinned_entry(pin_owner(session.session_id), item.grant_id) is not None
    wait_until(lambda: node.store.stats().pins == 0, timeout_s=3.0)
    assert time.monotonic() - t0 >= 0.9
    assert producer.counters["leases_expired"] == 1


def test_quarantine_releases_what_has_ended_and_says_bye(
    make_producer: MakeProducer, make_consumer: MakeConsumer, keyring: Keyring
) -> None:
    h = "quarantined-peer"
    # Its heartbeat timeout is far off: only the link's Bye can end the session in time.
    silent = {"heartbeat_interval_s": 10.0, "heartbeat_timeout_s": 120.0}
    _pnode, producer = make_producer(keyring.producer_config(), silent, entries={h: MiB})
    cnode, _consumer = make_consumer(keyring.consumer_config())
    cfg = config_of(keyring.consumer_config())
    pool = ClientPool(
        keys=load_keypair(keyring.consumer_secret),
        server_public_key=load_public_key(str(keyring.producer_public)),
        insecure=False,
        settings=LinkSettings.of(cfg),
    )
    agent = cnode.transport.local_info().agent_name
    link = PeerLink(
        producer.address,
        config=cfg,
        pool=pool,
        transport=cnode.transport,
        hello=lambda sid: p.Hello(
            versions=list(p.SUPPORTED_VERSIONS),
            session_id=sid,
            client_name="link-test",
            fingerprint=FINGERPRINT,
            capabilities=list(p.LOCAL_CAPABILITIES),
            data_plane=p.DataPlaneInfo(kind="nixl", agent_name=agent),
        ),
    )
    try:
        link.connect(time.monotonic())
        replies: list[p.Message] = []

        def pump() -> bool:
            for msg in link.receive():
                if isinstance(msg, p.FetchReply):
                    replies.append(msg)
                else:
                    assert link.on_message(msg, time.monotonic()) is None, msg
            return link.state is PeerLinkState.READY and (not link.pending or bool(replies))

        wait_until(pump, timeout_s=5.0)
        link.request("r1", [p.ItemRequest(h)], [], time.monotonic())
        wait_until(lambda: pump() and bool(replies), timeout_s=5.0)
        grant = granted(replies[0])
        assert producer.active_grants() == 1

        link.release([grant.grant_id], link.session_id)  # its read ended; still queued
        link.quarantine(time.monotonic(), FailureReason.PEER_UNREACHABLE)
        assert link.state is PeerLinkState.QUARANTINED
        wait_until(lambda: producer.session_count() == 0, timeout_s=10.0)
        assert producer.counters["released"] == 1
        assert _pnode.store.stats().pins == 0
    finally:
        link.close()
        pool.close_all()


def test_required_checksum_is_never_silently_dropped(
    make_producer: MakeProducer, make_consumer: MakeConsumer, keyring: Keyring
) -> None:
    h = "no-digest"
    # A producer that computes no checksums is refused as a whole...
    _n1, plain = make_producer(keyring.producer_config(), entries={h: MiB})
    _c1, strict = make_consumer(keyring.consumer_config(), {"checksum": "xxh3_64"})
    with pytest.raises(FetchFailed) as failed:
        strict.fetch([h], peers=[plain.address])[0].result(timeout=10)
    assert failed.value.reason is FailureReason.CHECKSUM_MISSING, failed.value

    # ...and so is an item without one from a producer that does compute them
    # (this entry was put without its digest).
    _n2, checking = make_producer(
        keyring.producer_config(), {"checksum": "xxh3_64"}, entries={h: MiB}
    )
    _c2, strict2 = make_consumer(keyring.consumer_config(), {"checksum": "xxh3_64"})
    with pytest.raises(FetchFailed) as failed:
        strict2.fetch([h], peers=[checking.address])[0].result(timeout=10)
    assert failed.value.reason is FailureReason.CHECKSUM_MISSING, failed.value
    assert strict2.counter_snapshot()["checksum_missing"] == 1
    assert _c2.store.get(h) is None
    wait_until(lambda: _n2.store.stats().pins == 0, timeout_s=2.0)  # the grant went back


def test_fast_timing_keeps_the_lease_longer_than_the_deadline() -> None:
    cfg = config_of(TCP)
    assert cfg.fetch_deadline_max_s < cfg.grant_lease_s == FAST["grant_lease_s"]
