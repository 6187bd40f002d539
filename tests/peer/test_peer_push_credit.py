"""Push's standing credit, over real NIXL between real processes (docs/PUSH.md, "Standing
credit"): a push that fits the credit a consumer granted is written with no offer and
committed only as the producer said and the checks allow; bad, unknown or replayed
claims are refused and counted and never commit; and a credit's blocks, used or not,
are never reused while a write may still land in them, over UCX TCP.
"""

from __future__ import annotations

import time

import numpy as np
import pytest
import xxhash

pytest.importorskip("nixl._api")

from peer_testing import (
    FakeProducer,
    Keyring,
    MakeConsumer,
    MakeProducer,
    SpawnProducer,
    expected,
    stored_bytes,
)
from test_peer_push import fill_region, push_when_connected, ready, stall
from waiting import wait_until

from ecshare import protocol as p
from ecshare.apps.chaos.faultproxy import FaultProxy, Faults
from ecshare.peer import Consumer, FetchItem, Node

pytestmark = pytest.mark.timeout(90)

TCP = {"ucx_tls": "tcp", "ucx_net_devices": "lo"}
CREDIT = {"push_name": "pd-0", "store_canary": True, "push_credit_bytes": 8 << 20}


@pytest.mark.parametrize("data_plane", ["cma", "tcp"])
def test_credited_push_lands_with_no_offer_and_the_credit_is_topped_up(
    make_producer: MakeProducer, make_consumer: MakeConsumer, keyring: Keyring, data_plane: str
) -> None:
    h, n = "credit-1", 4_505_600
    dp = TCP if data_plane == "tcp" else {}
    pnode, producer = make_producer(keyring.producer_config(), dp, entries={h: n})
    cnode, consumer = make_consumer(keyring.consumer_config(), CREDIT, dp)
    consumer.connect([producer.address])
    wait_until(lambda: producer.counters["push_credits"] == 1, timeout_s=10)

    out = push_when_connected(producer, h)

    assert out.pushed, out
    wait_until(lambda: ready(cnode.store, h), timeout_s=5)
    np.testing.assert_array_equal(stored_bytes(cnode, h), expected(h, n))
    result = consumer.fetch([FetchItem(h, pushed=True)], [producer.address])[0].result(timeout=5)
    assert result.pushed and result.peer == "local" and consumer.counters["requests"] == 0
    # No offer crossed: the write went straight into the credit, named by its claim.
    assert producer.counters["push_offers"] == 0 and producer.counters["push_credit_writes"] == 1
    counters = consumer.counter_snapshot()
    assert counters.get("push_offers", 0) == 0 and counters["push_credit_claims"] == 1
    assert counters["push_credit_committed"] == 1 and counters["push_committed"] == 1
    # The next credit stands: granted once the last one was claimed, held by the producer.
    wait_until(lambda: producer.counters["push_credits"] == 2, timeout_s=5)
    stats = cnode.store.stats()
    assert stats.allocated == stats.reserved == 1 and stats.quarantined == 0
    assert stats.canary_violations == 0
    cnode.store.check_invariants()
    wait_until(lambda: pnode.store.stats().pins == 0, timeout_s=5)


def test_item_larger_than_the_credit_is_offered_and_a_small_one_still_credited(
    make_producer: MakeProducer, make_consumer: MakeConsumer, keyring: Keyring
) -> None:
    big, small = "credit-big", "credit-small"
    _pnode, producer = make_producer(
        keyring.producer_config(), entries={big: 4_505_600, small: 65536}
    )
    cnode, consumer = make_consumer(
        keyring.consumer_config(), CREDIT, {"push_credit_bytes": 1 << 20}
    )
    consumer.connect([producer.address])
    wait_until(lambda: producer.counters["push_credits"] == 1, timeout_s=10)

    assert push_when_connected(producer, big).pushed
    assert producer.counters["push_credit_fallbacks.too_large"] == 1
    assert producer.counters["push_offers"] == 1
    assert producer.push(small, to="pd-0").result(timeout=10).pushed
    assert producer.counters["push_credit_writes"] == 1 and producer.counters["push_offers"] == 1
    wait_until(lambda: ready(cnode.store, big) and ready(cnode.store, small), timeout_s=5)
    np.testing.assert_array_equal(stored_bytes(cnode, big), expected(big, 4_505_600))
    np.testing.assert_array_equal(stored_bytes(cnode, small), expected(small, 65536))


def test_consumer_with_credit_off_offers_none_and_pushes_are_offered(
    make_producer: MakeProducer, make_consumer: MakeConsumer, keyring: Keyring
) -> None:
    h = "credit-off"
    _pnode, producer = make_producer(keyring.producer_config(), entries={h: 65536})
    cnode, consumer = make_consumer(keyring.consumer_config(), CREDIT, {"push_credit_bytes": 0})
    consumer.connect([producer.address])

    assert push_when_connected(producer, h).pushed
    assert producer.counters["push_offers"] == 1 and producer.counters["push_credits"] == 0
    assert consumer.counter_snapshot().get("push_credits_granted", 0) == 0
    wait_until(lambda: ready(cnode.store, h), timeout_s=5)
    assert cnode.store.stats().allocated == 0


def _credited_session(
    fake: FakeProducer, make_consumer: MakeConsumer, keyring: Keyring
) -> tuple[Node, Consumer, p.PushCredit]:
    cnode, consumer = make_consumer(keyring.consumer_config(), CREDIT, {"checksum": "xxh3_64"})
    consumer.connect([fake.address])
    hello: p.Hello = fake.recv(p.Hello)
    assert p.CAP_PUSH_CREDIT in hello.capabilities
    fake.welcome(hello, [p.CAP_RENEW, p.CAP_PUSH, p.CAP_PUSH_CREDIT, p.CAP_CHECKSUM_XXH3_64])
    credit: p.PushCredit = fake.recv(p.PushCredit)
    assert sum(e.length for e in credit.extents) == 8 << 20
    return cnode, consumer, credit


def _claim(fake: FakeProducer, credit_id: str, mm_hash: str, nbytes: int, **kw: object) -> None:
    fake.server.send(
        fake.route,
        p.PushCredited(
            session_id=kw.pop("session_id", fake.session_id),  # type: ignore[arg-type]
            credit_id=credit_id,
            mm_hash=mm_hash,
            nbytes=nbytes,
            dtype="uint8",
            shape=[nbytes],
            **kw,  # type: ignore[arg-type]
        ),
    )


def _done(fake: FakeProducer, credit_id: str, written: bool) -> None:
    fake.server.send(
        fake.route, p.PushDone(session_id=fake.session_id, push_id=credit_id, written=written)
    )


def test_unknown_replayed_oversized_and_unverified_claims_are_refused_and_never_commit(
    fake_producer: FakeProducer, make_consumer: MakeConsumer, keyring: Keyring
) -> None:
    cnode, consumer, credit = _credited_session(fake_producer, make_consumer, keyring)
    some = np.arange(100_000, dtype=np.uint8)
    digest = xxhash.xxh3_64_intdigest(some.tobytes())  # of bytes never written there

    # A credit this consumer never granted, and one of another session: nothing moves.
    _claim(fake_producer, "k-unknown", "u1", 100_000, checksum=digest)
    _claim(fake_producer, credit.credit_id, "u2", 100_000, checksum=digest, session_id="other")
    wait_until(
        lambda: consumer.counter_snapshot().get("push_credit_refused.unknown") == 2, timeout_s=5
    )
    # More than the credit holds: refused; its blocks wait for the write's end, then go back.
    _claim(fake_producer, credit.credit_id, "big", (8 << 20) + 1, checksum=digest)
    second: p.PushCredit = fake_producer.recv(p.PushCredit)  # topped up at the claim
    assert consumer.counter_snapshot()["push_credit_refused.too_large"] == 1
    assert not consumer.push_pending("big") and cnode.store.stats().allocated == 2
    _done(fake_producer, credit.credit_id, written=True)
    wait_until(lambda: cnode.store.stats().allocated == 1, timeout_s=5)
    # Claimed again: a replay, refused; the credit is over already.
    _claim(fake_producer, credit.credit_id, "again", 100_000, checksum=digest)
    wait_until(
        lambda: consumer.counter_snapshot().get("push_credit_refused.replayed") == 1, timeout_s=5
    )
    # A claim whose bytes do not have its digest: reserved, then never committed.
    _claim(fake_producer, second.credit_id, "forged", 100_000, checksum=digest)
    wait_until(lambda: consumer.push_pending("forged"), timeout_s=5)
    _claim(fake_producer, second.credit_id, "forged2", 100_000, checksum=digest)  # replay
    third: p.PushCredit = fake_producer.recv(p.PushCredit)
    _done(fake_producer, second.credit_id, written=True)
    wait_until(lambda: consumer.counter_snapshot().get("push_checksum_failures") == 1, timeout_s=5)
    # No digest where one is required: refused, its blocks back once the write has ended.
    _claim(fake_producer, third.credit_id, "bare", 100_000)
    fake_producer.recv(p.PushCredit)
    assert consumer.counter_snapshot()["push_credit_refused.invalid"] == 1
    _done(fake_producer, third.credit_id, written=True)
    wait_until(lambda: cnode.store.stats().allocated == 1, timeout_s=5)

    counters = consumer.counter_snapshot()
    assert counters["push_credit_refused.replayed"] == 2
    assert counters.get("push_credit_committed", 0) == 0
    for h in ("u1", "u2", "big", "again", "forged", "forged2", "bare"):
        assert cnode.store.get(h) is None and not consumer.push_pending(h)
    # Only the standing credit is left (once the session's one-block warm-up read ended).
    wait_until(lambda: cnode.store.stats().quarantined == 0, timeout_s=5)
    stats = cnode.store.stats()
    assert stats.allocated == 1 and stats.ready == 0
    cnode.store.check_invariants()


def test_unused_credit_of_a_cut_session_is_held_until_the_producer_returns_it(
    make_producer: MakeProducer, make_consumer: MakeConsumer, keyring: Keyring
) -> None:
    """Both alive, the control path cut while a credited write is stalled: the consumer
    fences the write's credit and the unused one granted after it; the producer returns
    the unused one and reports the write on the consumer's next session, and only then
    do their blocks come back, unwritten after."""
    h, n = "credit-cut", 16 << 20  # large enough that the stall holds its write over TCP
    pnode, producer = make_producer(
        keyring.producer_config(), TCP, {"nixl_progress_thread": False}, entries={"w": 4096, h: n}
    )
    proxy = FaultProxy("127.0.0.1", producer.port, faults=Faults(), seed=7)
    try:
        cnode, consumer = make_consumer(
            keyring.consumer_config(),
            CREDIT,
            TCP,
            {"push_deadline_s": 30.0, "push_credit_bytes": n, "region_bytes": 128 << 20},
        )
        consumer.connect([proxy.address])
        wait_until(lambda: producer.counters["push_credits"] == 1, timeout_s=10)
        assert push_when_connected(producer, "w").pushed  # by credit, like the next
        wait_until(lambda: producer.counters["push_credits"] == 2, timeout_s=5)
        held = stall(pnode)
        held[0] = True

        push = producer.push(h, to="pd-0")
        wait_until(lambda: consumer.push_pending(h), timeout_s=5)
        assert producer.counters["push_credit_writes"] == 2
        wait_until(lambda: producer.counters["push_credits"] == 3, timeout_s=5)
        proxy.hold(2.5)
        wait_until(lambda: consumer.counter_snapshot().get("push_sessions_lost") == 2, timeout_s=10)
        wait_until(lambda: producer.session_count() == 0, timeout_s=10)
        # The write's credit and the unused one: both fenced, out of reach of the store.
        assert cnode.store.stats().quarantined == 2 and consumer.pushes_fenced_in_flight() == 2
        assert not push.done() and pnode.store.stats().pins == 1  # the write runs on
        held[0] = False

        assert push.result(timeout=15).pushed
        wait_until(lambda: cnode.store.stats().quarantined == 0, timeout_s=15)
        counters = consumer.counter_snapshot()
        assert counters["push_fenced_ended"] == 2 and counters["push_credits_returned"] == 1
        assert counters.get("push_fences_leaked", 0) == 0
        assert cnode.store.get(h) is None  # a fenced push never commits
        fill_region(cnode.store)
        assert cnode.store.stats().canary_violations == 0
        # The push channel comes back with a credit of its own, and pull works.
        wait_until(lambda: producer.push_names() == {"pd-0"}, timeout_s=10)
        result = consumer.fetch([FetchItem(h)], [proxy.address])[0].result(timeout=15)
        assert not result.pushed
        np.testing.assert_array_equal(stored_bytes(cnode, h), expected(h, n))
    finally:
        proxy.close()


def test_producer_sigkill_mid_credited_write_gives_the_blocks_back_only_once_probed(
    spawn_producer: SpawnProducer, make_consumer: MakeConsumer, keyring: Keyring
) -> None:
    n = 4 << 20
    producer = spawn_producer(
        synthetic=f"4096:1,{n}:1", config={**keyring.producer_config(), **TCP}, hooks=True
    )
    warm, h = sorted(producer.sizes, key=producer.sizes.__getitem__)
    cnode, consumer = make_consumer(keyring.consumer_config(), CREDIT, TCP)
    real_progress = cnode.transport.progress
    held = [False]
    cnode.transport.progress = lambda: [] if held[0] else real_progress()  # type: ignore[method-assign]
    consumer.connect([producer.address])
    deadline = time.monotonic() + 10
    while not ready(cnode.store, warm):
        assert time.monotonic() < deadline, producer.stderr()
        producer.command(f"push {warm} pd-0")
        time.sleep(0.05)
    # A credit stands once the producer's session is up; held by it a moment later.
    wait_until(lambda: consumer.counter_snapshot().get("push_credits_granted", 0) >= 1, timeout_s=5)
    time.sleep(0.3)
    claims = consumer.counter_snapshot().get("push_credit_claims", 0)
    held[0] = True
    producer.command(f"push {h} pd-0")
    wait_until(lambda: consumer.push_pending(h), timeout_s=5)
    assert consumer.counter_snapshot()["push_credit_claims"] == claims + 1
    producer.kill()
    held[0] = False

    # The session dies: the credit being written and the one granted after it are
    # fenced, and only the data plane's word that the producer is gone frees them.
    wait_until(lambda: consumer.counter_snapshot().get("push_probes_failed", 0) >= 2, timeout_s=15)
    wait_until(lambda: cnode.store.stats().quarantined == 0, timeout_s=5)
    assert not ready(cnode.store, h) and consumer.pushes_fenced_in_flight() == 0
    time.sleep(0.3)
    fill_region(cnode.store)
    assert cnode.store.stats().canary_violations == 0
    cnode.store.check_invariants()


def test_credit_whose_grant_may_be_lost_is_voided_on_the_next_session_and_only_then_freed(
    fake_producer: FakeProducer, make_consumer: MakeConsumer, keyring: Keyring
) -> None:
    """The session ends (here: the producer says it does not know it) with a credit
    unused: the consumer cannot tell whether the grant ever reached the producer, so
    the credit stays fenced, its producer alive (the probe says so), until the same
    producer process, asked on the next session, says it is void."""
    cnode, consumer, credit = _credited_session(fake_producer, make_consumer, keyring)
    old_session = fake_producer.session_id
    fake_producer.server.send(
        fake_producer.route,
        p.Error(code=p.ErrorCode.NO_SESSION, message="unknown session; say hello"),
    )
    hello: p.Hello = fake_producer.recv(p.Hello)
    assert hello.session_id != old_session
    assert cnode.store.stats().quarantined_blocks >= 128  # the credit, fenced
    fake_producer.welcome(
        hello, [p.CAP_RENEW, p.CAP_PUSH, p.CAP_PUSH_CREDIT, p.CAP_CHECKSUM_XXH3_64]
    )
    void: p.PushCreditVoid = fake_producer.recv(p.PushCreditVoid)
    assert (void.session_id, void.credit_session, void.credit_id) == (
        hello.session_id,
        old_session,
        credit.credit_id,
    )
    fake_producer.recv(p.PushCredit)  # the new session's own
    time.sleep(0.2)
    assert consumer.pushes_fenced_in_flight() == 1  # nothing but the producer's word frees it
    fake_producer.server.send(
        fake_producer.route,
        p.PushDone(session_id=old_session, push_id=credit.credit_id, written=False),
    )
    wait_until(lambda: cnode.store.stats().quarantined == 0, timeout_s=5)
    assert (
        consumer.pushes_fenced_in_flight() == 0
        and consumer.counter_snapshot()["push_fenced_ended"] == 1
    )
    stats = cnode.store.stats()
    assert stats.reserved == 1 and stats.canary_violations == 0
    cnode.store.check_invariants()
