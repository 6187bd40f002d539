"""Push: a producer writes an entry into blocks its consumer reserved, over real NIXL.

Every promise of docs/PUSH.md against real sockets, NIXL and processes: a pushed
item is local (and counted as pushed) before anyone asks; a fetch waits for a push
it was told of and pulls when the push does not come; offers are taken only from
producers this consumer allows, and a refused one learns nothing; a duplicate
offer reserves nothing twice; and no reserved or source block is reused while a
write may still touch it, whoever dies, over UCX TCP.
"""

from __future__ import annotations

import json
import select
import subprocess
import sys
import threading
import time
import uuid
from typing import Any

import numpy as np
import pytest

pytest.importorskip("nixl._api")

from peer_testing import (
    FINGERPRINT,
    HERE,
    FakeProducer,
    Keyring,
    MakeConsumer,
    MakeProducer,
    SpawnProducer,
    child_env,
    config_of,
    expected,
    flags,
    stored_bytes,
)
from waiting import wait_until

from ecshare import protocol as p
from ecshare.apps.chaos.faultproxy import FaultProxy, Faults
from ecshare.metrics import read_samples
from ecshare.peer import (
    FetchItem,
    Node,
    Producer,
    PushOutcome,
    PushState,
    start_consumer,
    start_producer,
)
from ecshare.peer.notices import Notices
from ecshare.store import EntryState, Store, StoreFull
from ecshare.transport import NixlTransport, ReadState, ReadStatus, Segment
from ecshare.transport.base import writer_of
from ecshare.vllm.servers import free_port

pytestmark = pytest.mark.timeout(90)

TCP = {"ucx_tls": "tcp", "ucx_net_devices": "lo"}
CANARY = {"store_canary": True}
# The offered path (a standing credit off); the credited path: test_peer_push_credit.py.
PUSH = {"push_name": "pd-0", "push_credit_bytes": 0, **CANARY}
CONSUMER_SCRIPT = HERE / "peer_consumer_process.py"


def push_when_connected(producer: Producer, h: str, to: str = "pd-0") -> PushOutcome:
    """Push once the consumer's session (the push channel) is up."""
    deadline = time.monotonic() + 10
    while True:
        out = producer.push(h, to=to).result(timeout=30)
        if "no push session" not in out.detail or time.monotonic() > deadline:
            return out
        time.sleep(0.02)


def ready(store: Store, h: str) -> bool:
    entry = store.get(h)
    return entry is not None and entry.state is EntryState.READY


def fill_region(store: Store) -> None:
    """Hand every free block out once, so that the canary checks each of them."""
    free = store.stats().free_blocks
    if free:
        entry = store.allocate(f"fill-{uuid.uuid4().hex}", free * store.block_size)
        store.abort(entry)


# -- the path that works -------------------------------------------------------------------------


@pytest.mark.parametrize("data_plane", ["cma", "tcp"])
def test_pushed_item_is_local_before_the_fetch_and_counts_as_pushed(
    make_producer: MakeProducer, make_consumer: MakeConsumer, keyring: Keyring, data_plane: str
) -> None:
    h, n = "push-1", 4_505_600
    dp = TCP if data_plane == "tcp" else {}
    pnode, producer = make_producer(keyring.producer_config(), dp, entries={h: n})
    cnode, consumer = make_consumer(keyring.consumer_config(), PUSH, dp)
    consumer.connect([producer.address])

    out = push_when_connected(producer, h)

    assert out.pushed, out
    wait_until(lambda: ready(cnode.store, h), timeout_s=5)
    result = consumer.fetch([FetchItem(h, pushed=True)], [producer.address])[0].result(timeout=5)
    assert result.pushed and result.peer == "local" and result.nbytes == n
    np.testing.assert_array_equal(stored_bytes(cnode, h), expected(h, n))
    # Counted as pushed. It was local already, so it exposed only the call itself;
    # no bound is asserted on that here (timing targets belong in benchmarks).
    assert sum(consumer.exposed_histograms()["pushed"].counts) == 1
    assert sum(consumer.exposed_histograms()["pulled"].counts) == 0
    assert consumer.counters["requests"] == 0  # nothing was pulled
    # The source went back once the write had ended; nothing is left pinned anywhere.
    wait_until(lambda: pnode.store.stats().pins == 0, timeout_s=5)
    assert producer.pushes_in_flight() == 0 and cnode.store.stats().allocated == 0
    samples = read_samples([], [producer], [consumer])
    assert samples["pushed_items"][()] == 1 and samples["pushed_in_bytes"][()] == n
    assert samples["pushes_written"][()] == 1 and samples["pushed_out_bytes"][()] == n
    assert samples["pushes_fenced_in_flight"][()] == 0 and samples["pushes_in_flight"][()] == 0


def test_fetch_waits_for_a_push_in_flight_and_is_served_by_it(
    make_producer: MakeProducer, make_consumer: MakeConsumer, keyring: Keyring
) -> None:
    warm, h, n = "warm", "push-2", 16 << 20
    _pnode, producer = make_producer(keyring.producer_config(), entries={warm: 4096, h: n})
    cnode, consumer = make_consumer(keyring.consumer_config(), PUSH, {"push_wait_s": 5.0})
    consumer.connect([producer.address])
    assert push_when_connected(producer, warm).pushed

    future = consumer.fetch([FetchItem(h, pushed=True)], [producer.address])[0]
    time.sleep(0.05)  # the fetch is waiting for the offer, not pulling
    assert not future.done() and consumer.counters["requests"] == 0
    assert producer.push(h, to="pd-0").result(timeout=10).pushed
    result = future.result(timeout=10)

    assert result.pushed and result.peer == producer.address
    np.testing.assert_array_equal(stored_bytes(cnode, h), expected(h, n))
    assert consumer.counters["requests"] == 0
    assert sum(consumer.exposed_histograms()["pushed"].counts) == 1  # "warm" was never asked for


def test_duplicate_push_joins_the_one_in_flight(
    make_producer: MakeProducer, make_consumer: MakeConsumer, keyring: Keyring
) -> None:
    h, n = "push-dup", 8 << 20
    pnode, producer = make_producer(keyring.producer_config(), entries={"w": 4096, h: n})
    cnode, consumer = make_consumer(keyring.consumer_config(), PUSH)
    consumer.connect([producer.address])
    assert push_when_connected(producer, "w").pushed
    # The first push's write stays in flight until let go: on one host it would end
    # inside the WRITE call, before a second call on a loaded host came at all.
    held = stall(pnode)
    held[0] = True
    first = producer.push(h, to="pd-0")
    wait_until(lambda: producer.pushes_in_flight() == 1, timeout_s=10)
    second = producer.push(h, to="pd-0")
    wait_until(lambda: producer.counters["push_joined"] == 1, timeout_s=10)
    assert not first.done() and not second.done()
    held[0] = False
    assert first.result(timeout=10).pushed and second.result(timeout=10).pushed
    assert producer.counters["push_offers"] == 2  # "w", then one for both of h
    again = producer.push(h, to="pd-0").result(timeout=10)
    assert again.state is PushState.REFUSED and again.detail == "present"
    assert consumer.counter_snapshot()["push_refused.present"] == 1
    assert cnode.store.stats().ready == 2 and pnode.store.stats().pins == 0


# -- refused, failed or late: pull --------------------------------------------------------------


def test_push_refused_falls_back_to_pull(
    make_producer: MakeProducer, make_consumer: MakeConsumer, keyring: Keyring
) -> None:
    """A consumer that allows no push from this producer's key: the producer has no one to
    push to, learns nothing of the consumer's memory, and the fetch pulls after its wait."""
    h, n = "refused-1", 1_000_003
    pnode, producer = make_producer(keyring.producer_config(), entries={h: n})
    cnode, consumer = make_consumer(
        keyring.consumer_config(),
        PUSH,
        {"push_trusted_keys": [keyring.consumer.public_text]},  # not the producer's key
    )
    consumer.connect([producer.address])
    wait_until(lambda: producer.session_count() == 1, timeout_s=5)

    out = producer.push(h, to="pd-0").result(timeout=10)
    result = consumer.fetch([FetchItem(h, pushed=True)], [producer.address])[0].result(timeout=10)

    assert out.state is PushState.REFUSED and "no push session" in out.detail
    assert cnode.transport.local_info().agent_name not in pnode.transport.peers
    assert not result.pushed and result.peer == producer.address
    np.testing.assert_array_equal(stored_bytes(cnode, h), expected(h, n))
    assert consumer.counter_snapshot()["push_waits_expired"] == 1
    assert sum(consumer.exposed_histograms()["pulled"].counts) == 1


def test_push_to_a_full_region_is_refused_and_the_item_pulled_later(
    make_producer: MakeProducer, make_consumer: MakeConsumer, keyring: Keyring
) -> None:
    h, n = "full-1", 3 << 20
    _pnode, producer = make_producer(keyring.producer_config(), entries={"w": 4096, h: n})
    cnode, consumer = make_consumer(keyring.consumer_config(), PUSH, {"region_bytes": 4 << 20})
    consumer.connect([producer.address])
    assert push_when_connected(producer, "w").pushed
    blocker = cnode.store.allocate("blocker", 2 << 20)  # being written: not evictable

    out = producer.push(h, to="pd-0").result(timeout=10)
    assert out.state is PushState.REFUSED and out.detail.startswith(f"full: {h}: need ")
    cnode.store.abort(blocker)
    result = consumer.fetch([FetchItem(h, pushed=True)], [producer.address])[0].result(timeout=10)
    assert not result.pushed
    np.testing.assert_array_equal(stored_bytes(cnode, h), expected(h, n))
    assert cnode.store.stats().canary_violations == 0


@pytest.mark.timeout(20)
def test_refused_push_a_fetch_waits_for_makes_it_pull_at_once(
    make_producer: MakeProducer,
    make_consumer: MakeConsumer,
    keyring: Keyring,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A fetch waits for an announced push (`push_wait_s` 30 s, past this test's own
    timeout); the consumer refuses the offer (region full): the fetch pulls at once."""
    h, n = "refused-wait", 3 << 20
    _pnode, producer = make_producer(keyring.producer_config(), entries={"w": 4096, h: n})
    cnode, consumer = make_consumer(
        keyring.consumer_config(), PUSH, {"region_bytes": 4 << 20, "push_wait_s": 30.0}
    )
    consumer.connect([producer.address])
    assert push_when_connected(producer, "w").pushed
    blocker = [cnode.store.allocate("blocker", 2 << 20)]  # being written: not evictable
    allocate = cnode.store.allocate

    def allocate_then_free_room(mm_hash: str, nbytes: int, meta: Any = None) -> Any:
        try:
            return allocate(mm_hash, nbytes, meta)
        except StoreFull:
            if mm_hash == h and blocker:  # the offer is refused; the pull will find room
                cnode.store.abort(blocker.pop())
            raise

    monkeypatch.setattr(cnode.store, "allocate", allocate_then_free_room)

    future = consumer.fetch([FetchItem(h, pushed=True)], [producer.address])[0]
    out = producer.push(h, to="pd-0").result(timeout=10)
    result = future.result(timeout=10)

    assert out.state is PushState.REFUSED and out.detail.startswith(f"full: {h}: need ")
    assert not result.pushed and result.peer == producer.address
    np.testing.assert_array_equal(stored_bytes(cnode, h), expected(h, n))
    counters = consumer.counter_snapshot()
    assert counters["push_refused.full"] == 1 and counters["push_fallbacks"] == 1
    assert counters.get("push_waits_expired", 0) == 0 and counters["requests"] == 1
    assert sum(consumer.exposed_histograms()["pulled"].counts) == 1
    assert cnode.store.stats().canary_violations == 0


# -- who may push -----------------------------------------------------------------------------


def test_unauthorized_pusher_is_refused_counted_and_learns_nothing(
    fake_producer: FakeProducer, make_consumer: MakeConsumer, keyring: Keyring
) -> None:
    cnode, consumer = make_consumer(
        keyring.consumer_config(), PUSH, {"push_trusted_keys": [keyring.consumer.public_text]}
    )
    consumer.connect([fake_producer.address])
    hello: p.Hello = fake_producer.recv(p.Hello)
    # Nothing of the consumer's memory in its Hello: no metadata, no region, no push.
    assert hello.data_plane is not None and hello.data_plane.agent_metadata == b""
    assert (hello.data_plane.region_address, hello.data_plane.region_size) == (0, 0)
    assert p.CAP_PUSH not in hello.capabilities and hello.push_name == ""
    fake_producer.welcome(hello, [p.CAP_RENEW, p.CAP_PUSH])
    # The session is up once its one-block warm-up read (a consumer's first read from a
    # producer) has ended and given its block back.
    wait_until(
        lambda: consumer.counters["warm_ups"] == 1 and cnode.store.stats().quarantined == 0,
        timeout_s=5.0,
    )

    reply = fake_producer.offer("x1")

    assert reply.status is p.PushStatus.FORBIDDEN and reply.extents == []
    assert consumer.counter_snapshot()["push_refused.forbidden"] == 1
    assert cnode.store.stats().allocated == 0 and cnode.store.stats().used_blocks == 0


def test_duplicate_offer_reserves_once_and_is_answered_the_same(
    fake_producer: FakeProducer, make_consumer: MakeConsumer, keyring: Keyring
) -> None:
    cnode, consumer = make_consumer(keyring.consumer_config(), PUSH)
    consumer.connect([fake_producer.address])
    hello: p.Hello = fake_producer.recv(p.Hello)
    assert p.CAP_PUSH in hello.capabilities and hello.push_name == "pd-0"
    assert hello.data_plane is not None and hello.data_plane.agent_metadata
    fake_producer.welcome(hello, [p.CAP_RENEW, p.CAP_PUSH])
    # The session is up once its one-block warm-up read (a consumer's first read from a
    # producer) has ended and given its block back.
    wait_until(
        lambda: consumer.counters["warm_ups"] == 1 and cnode.store.stats().quarantined == 0,
        timeout_s=5.0,
    )

    first = fake_producer.offer("d1", "dup", 300_000)
    second = fake_producer.offer("d1", "dup", 300_000)

    assert first.status is p.PushStatus.ACCEPTED and second == first
    assert sum(e.length for e in first.extents) == 300_000
    stats = cnode.store.stats()
    assert stats.allocated == 1 and stats.used_blocks == -(-300_000 // stats.block_size)
    assert consumer.push_pending("dup")
    # Another push id for the same item while the first is reserved: busy, no second entry.
    assert fake_producer.offer("d2", "dup", 300_000).status is p.PushStatus.BUSY
    # Not written after all: the blocks go back at once, and nothing became READY.
    fake_producer.server.send(
        fake_producer.route,
        p.PushDone(session_id=fake_producer.session_id, push_id="d1", written=False),
    )
    wait_until(lambda: cnode.store.stats().used_blocks == 0, timeout_s=5)
    assert cnode.store.get("dup") is None and not consumer.push_pending("dup")
    assert consumer.counter_snapshot()["push_duplicate_offers"] == 1


# -- lifetimes under death and deadlines, over UCX TCP -----------------------------------------


def test_late_push_is_fenced_the_fetch_pulls_and_its_blocks_wait_for_the_write(
    make_producer: MakeProducer, make_consumer: MakeConsumer, keyring: Keyring
) -> None:
    """The consumer's data plane does not progress for the push, so the write over TCP
    cannot land in time: the reservation's deadline passes, the fetch pulls, and the
    reserved blocks stay quarantined until the write has ended (the pull's own polling
    moves it along), never reused before."""
    h, n = "late-1", 8 << 20
    pnode, producer = make_producer(keyring.producer_config(), TCP, entries={"w": 4096, h: n})
    # No NIXL progress thread: it would move the write along while the test holds the
    # consumer's own progress calls (seen as a push done early under load).
    cnode, consumer = make_consumer(
        keyring.consumer_config(), PUSH, TCP,
        {"push_deadline_s": 0.3, "push_wait_s": 30.0, "nixl_progress_thread": False},
    )  # fmt: skip
    consumer.connect([producer.address])
    assert push_when_connected(producer, "w").pushed
    real_progress = cnode.transport.progress
    held = [True]
    cnode.transport.progress = lambda: [] if held[0] else real_progress()  # type: ignore[method-assign]

    push = producer.push(h, to="pd-0")
    wait_until(lambda: consumer.push_pending(h), timeout_s=5)
    time.sleep(0.1)
    assert not push.done(), push.result()
    assert pnode.store.stats().pins == 1  # the source stays pinned
    result = consumer.fetch([FetchItem(h, pushed=True)], [producer.address])[0].result(timeout=10)

    assert not result.pushed and result.peer == producer.address
    np.testing.assert_array_equal(stored_bytes(cnode, h), expected(h, n))
    counters = consumer.counter_snapshot()
    assert counters["push_deadlines"] == 1 and counters["push_fenced"] == 1
    assert counters["push_fallbacks"] == 1  # pulled once fenced, not after `push_wait_s`
    held[0] = False
    assert push.result(timeout=10).pushed  # the write did end, late
    wait_until(lambda: cnode.store.stats().quarantined == 0, timeout_s=5)
    assert consumer.counter_snapshot()["push_fenced_ended"] == 1
    wait_until(lambda: pnode.store.stats().pins == 0, timeout_s=5)
    fill_region(cnode.store)
    assert cnode.store.stats().canary_violations == 0
    np.testing.assert_array_equal(stored_bytes(cnode, h), expected(h, n))


def test_producer_sigkill_mid_push_leaves_no_block_reused_early_and_pull_still_works(
    spawn_producer: SpawnProducer, make_consumer: MakeConsumer, keyring: Keyring
) -> None:
    h, n = "sigkill-p", 16 << 20
    producer = spawn_producer(
        synthetic=f"4096:1,{n}:1", config={**keyring.producer_config(), **TCP}, hooks=True
    )
    warm, h = sorted(producer.sizes, key=producer.sizes.__getitem__)
    cnode, consumer = make_consumer(keyring.consumer_config(), PUSH, TCP)
    real_progress = cnode.transport.progress
    held = [False]
    cnode.transport.progress = lambda: [] if held[0] else real_progress()  # type: ignore[method-assign]
    consumer.connect([producer.address])
    deadline = time.monotonic() + 10
    while not ready(cnode.store, warm):
        assert time.monotonic() < deadline, producer.stderr()
        producer.command(f"push {warm} pd-0")
        time.sleep(0.05)
    held[0] = True
    producer.command(f"push {h} pd-0")
    wait_until(lambda: consumer.push_pending(h), timeout_s=5)
    producer.kill()
    held[0] = False

    # The session dies, the reservation is fenced, and only the data plane's word that
    # the producer is gone (a failed probe) gives its blocks back.
    wait_until(lambda: consumer.counter_snapshot().get("push_probes_failed", 0) >= 1, timeout_s=15)
    wait_until(lambda: cnode.store.stats().quarantined == 0, timeout_s=5)
    assert not ready(cnode.store, h)
    time.sleep(0.3)
    fill_region(cnode.store)
    assert cnode.store.stats().canary_violations == 0
    # Pull still works from a producer that is there.
    again = spawn_producer(synthetic=f"{n}:1", config={**keyring.producer_config(), **TCP})
    (h2,) = again.sizes
    result = consumer.fetch([FetchItem(h2, pushed=True)], [again.address])[0].result(timeout=15)
    np.testing.assert_array_equal(stored_bytes(cnode, h2), expected(h2, n))
    assert not result.pushed


def test_push_reservations_of_a_replaced_session_are_probed_and_none_leaks(
    spawn_producer: SpawnProducer, make_consumer: MakeConsumer, keyring: Keyring
) -> None:
    """The producer is SIGKILLed mid-push and a new process takes its endpoint within
    the heartbeat timeout: the consumer's session is not failed but replaced (the new
    process answers NO_SESSION). The old session's reservation is fenced and probed
    as on any other end of a session, and its blocks come back only once the probe
    finds the old process gone: none leaks, none is written after it is freed."""
    n = 16 << 20
    port = free_port()
    # Both sides outlast the restart: the session is replaced, never timed out.
    slow = {"heartbeat_timeout_s": 30.0}
    config = {**keyring.producer_config(), **TCP, **slow, "listen_port": port}
    old = spawn_producer(synthetic=f"4096:1,{n}:1", config=config, hooks=True)
    warm, h = sorted(old.sizes, key=old.sizes.__getitem__)
    cnode, consumer = make_consumer(
        keyring.consumer_config(), PUSH, TCP, slow, {"push_deadline_s": 30.0}
    )
    real_progress = cnode.transport.progress
    held = [False]
    cnode.transport.progress = lambda: [] if held[0] else real_progress()  # type: ignore[method-assign]
    consumer.connect([old.address])
    deadline = time.monotonic() + 10
    while not ready(cnode.store, warm):
        assert time.monotonic() < deadline, old.stderr()
        old.command(f"push {warm} pd-0")
        time.sleep(0.05)
    held[0] = True
    old.command(f"push {h} pd-0")
    wait_until(lambda: consumer.push_pending(h), timeout_s=5)
    old.kill()
    new = spawn_producer(synthetic="4096:1", config=config, hooks=True)
    assert new.address == old.address
    held[0] = False

    # The consumer says hello to the new process; the old session's push is fenced.
    wait_until(lambda: new.stats()["sessions"] == 1, timeout_s=15, detail=lambda: new.stderr())
    wait_until(lambda: consumer.counter_snapshot().get("push_sessions_lost") == 1, timeout_s=5)
    wait_until(
        lambda: cnode.store.stats().quarantined == 0,
        timeout_s=15,
        detail=lambda: consumer.counter_snapshot(),
    )
    counters = consumer.counter_snapshot()
    assert not any(k.startswith("peer_failures") for k in counters), counters
    assert counters["push_probes_failed"] >= 1 and counters["push_fenced_ended"] == 1
    assert counters.get("push_fences_leaked", 0) == 0
    assert consumer.pushes_fenced_in_flight() == 0 and not ready(cnode.store, h)
    time.sleep(0.3)
    fill_region(cnode.store)
    assert cnode.store.stats().canary_violations == 0


def test_consumer_sigkill_mid_push_keeps_the_source_pinned_until_the_write_fails(
    make_producer: MakeProducer, keyring: Keyring
) -> None:
    warm, h, n = "w", "sigkill-c", 16 << 20
    pnode, producer = make_producer(keyring.producer_config(), TCP, entries={warm: 4096, h: n})
    cmd = [
        sys.executable,
        str(CONSUMER_SCRIPT),
        producer.address,
        "--fingerprint",
        FINGERPRINT,
        *flags({**keyring.consumer_config(), **PUSH, **TCP, "prefault": False}),
    ]
    child = subprocess.Popen(
        cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=child_env()
    )
    try:
        assert child.stdout is not None and child.stdin is not None
        ready_, _, _ = select.select([child.stdout], [], [], 60)
        assert ready_ and child.stdout.readline().startswith("READY")
        assert push_when_connected(producer, warm).pushed
        child.stdin.write("hold\n")
        child.stdin.flush()
        assert json.loads(child.stdout.readline()) == {"held": True}

        push = producer.push(h, to="pd-0")
        wait_until(lambda: producer.counters["push_writes"] == 2, timeout_s=5)
        time.sleep(0.2)
        assert not push.done() and pnode.store.stats().pins == 1
        child.kill()
        child.wait(10)

        out = push.result(timeout=15)
        assert out.state is PushState.FAILED and "write failed" in out.detail
        assert pnode.store.stats().pins == 0 and producer.pushes_in_flight() == 0
        assert pnode.transport.in_flight == 0
        assert ready(pnode.store, h)
    finally:
        if child.poll() is None:
            child.kill()
            child.wait(10)


# -- control cut with both sides alive, and an offer nobody answers ------------------------------


def stall(node: Node) -> list[bool]:
    """Stop `node`'s data plane from moving anything while the flag is set: its polls say
    PENDING and its progress does nothing. Over UCX TCP a write moves only as both ends
    progress, so a write from (or a probe read of) this node stands still."""
    held = [False]
    real_poll, real_progress = node.transport.poll, node.transport.progress

    def poll(handle: object) -> ReadStatus:
        return ReadStatus(ReadState.PENDING) if held[0] else real_poll(handle)

    node.transport.poll = poll  # type: ignore[method-assign]
    node.transport.progress = lambda: [] if held[0] else real_progress()  # type: ignore[method-assign]
    return held


@pytest.mark.parametrize("word", ["notice", "push_done"])
def test_control_cut_with_both_alive_fences_the_push_until_its_write_ends(
    make_producer: MakeProducer, make_consumer: MakeConsumer, keyring: Keyring, word: str
) -> None:
    """The control path is held past both sides' heartbeat timeouts while a write is
    stalled: both end the session, the consumer fences the reservation (a probe finds
    the producer alive), the producer's write runs on. Once it ends, the consumer learns
    it from the write's notification or, where that notice never reaches the inbox,
    from the PushDone the producer kept and sends on the consumer's next session. Only
    then do the blocks come back; nothing was written into them after that."""
    h, n = "cut-1", 16 << 20
    # Its data plane moved by its own loop alone (no NIXL progress thread), so that
    # `stall` holds the write: with the thread, the write could land before the cut.
    pnode, producer = make_producer(
        keyring.producer_config(), TCP, {"nixl_progress_thread": False}, entries={"w": 4096, h: n}
    )
    proxy = FaultProxy("127.0.0.1", producer.port, faults=Faults(), seed=7)
    try:
        # A reservation deadline far off: only the lost session fences the push.
        cnode, consumer = make_consumer(
            keyring.consumer_config(), PUSH, TCP, {"push_deadline_s": 30.0}
        )
        if word == "push_done":
            real_progress = cnode.transport.progress
            cnode.transport.progress = lambda: [  # type: ignore[method-assign]
                x for x in real_progress() if not x[1].startswith(b"push:")
            ]
        consumer.connect([proxy.address])
        assert push_when_connected(producer, "w").pushed
        # Committed at the consumer too: a reservation still open at the cut is fenced.
        wait_until(lambda: ready(cnode.store, "w"), "the warm push committed")
        # The session's warm-up read has ended and given its block back: one still moving
        # at the stall would stay fenced (its block quarantined) beside the push's.
        wait_until(lambda: consumer.fences()["warm_up"] == 0, "the warm-up read ended")
        assert cnode.store.stats().quarantined == 0
        held = stall(pnode)
        held[0] = True

        push = producer.push(h, to="pd-0")
        wait_until(lambda: producer.counters["push_writes"] == 2, timeout_s=5)
        assert consumer.push_pending(h)
        proxy.hold(2.5)
        wait_until(lambda: consumer.counter_snapshot().get("push_sessions_lost") == 1, timeout_s=10)
        wait_until(lambda: producer.session_count() == 0, timeout_s=10)
        assert not consumer.push_pending(h) and cnode.store.stats().quarantined == 1
        assert not push.done() and pnode.store.stats().pins == 1  # the write runs on
        held[0] = False

        out = push.result(timeout=15)
        assert out.pushed, out  # the write did end: into blocks the consumer still holds
        wait_until(lambda: cnode.store.stats().quarantined == 0, timeout_s=15)
        counters = consumer.counter_snapshot()
        assert counters["push_fenced_ended"] == 1
        if word == "notice":
            assert counters["push_fences_ended_by_notice"] == 1
        else:
            assert counters.get("push_notices", 0) == 0
            assert counters["push_fences_ended_by_done"] == 1
            assert producer.counters["push_done_reported_late"] == 1
        assert cnode.store.get(h) is None  # a fenced push never commits
        assert pnode.store.stats().pins == 0 and producer.pushes_in_flight() == 0
        fill_region(cnode.store)
        assert cnode.store.stats().canary_violations == 0
        # The push channel comes back by itself once the path does, and pull works.
        wait_until(lambda: producer.push_names() == {"pd-0"}, timeout_s=10)
        result = consumer.fetch([FetchItem(h)], [proxy.address])[0].result(timeout=15)
        assert not result.pushed
        np.testing.assert_array_equal(stored_bytes(cnode, h), expected(h, n))
    finally:
        proxy.close()


def test_offer_never_answered_is_given_up_and_its_late_reservation_freed(
    make_producer: MakeProducer, make_consumer: MakeConsumer, keyring: Keyring
) -> None:
    """The offer reaches the consumer only after the producer's request timeout: the
    producer has already unpinned its source and said PushDone(not written), which
    follows the offer on the same path and frees the reservation the offer made."""
    h, n = "unanswered-1", 2 << 20
    # The hold outlasts the producer's request timeout, and the heartbeat timeout outlasts
    # the hold; the first offer ("w") must be answered within the request timeout even on
    # a loaded host, so that timeout is not cut to the bone.
    slow = {"heartbeat_timeout_s": 6.0}
    pnode, producer = make_producer(
        keyring.producer_config(), slow, {"request_timeout_s": 1.0}, entries={"w": 4096, h: n}
    )
    proxy = FaultProxy("127.0.0.1", producer.port, faults=Faults(), seed=8)
    try:
        cnode, consumer = make_consumer(keyring.consumer_config(), PUSH, slow)
        consumer.connect([proxy.address])
        assert push_when_connected(producer, "w").pushed
        proxy.hold(3.0, ("to_consumer",))

        out = producer.push(h, to="pd-0").result(timeout=10)

        assert out.state is PushState.FAILED and out.detail == "no answer to the offer", out
        assert pnode.store.stats().pins == 0 and producer.pushes_in_flight() == 0
        # The held offer lands, reserves, and the PushDone behind it frees the blocks.
        wait_until(lambda: consumer.counter_snapshot().get("push_not_written") == 1, timeout_s=10)
        counters = consumer.counter_snapshot()
        assert counters["push_reserved"] == 2  # "w", then the late offer
        wait_until(lambda: producer.counters["push_late_replies"] == 1, timeout_s=5)
        assert cnode.store.get(h) is None and not consumer.push_pending(h)
        assert cnode.store.stats().allocated == 0
        assert producer.session_count() == 1  # the session itself lived through it
        fill_region(cnode.store)
        assert cnode.store.stats().canary_violations == 0
        result = consumer.fetch([FetchItem(h)], [proxy.address])[0].result(timeout=10)
        assert not result.pushed
        np.testing.assert_array_equal(stored_bytes(cnode, h), expected(h, n))
    finally:
        proxy.close()


# -- a node that is both producer and consumer -----------------------------------------------


def test_notices_hands_each_kind_to_its_own_part_over_real_nixl() -> None:
    """Two data planes in this process: one writes a push and a grant's notice into the
    other, whose Producer-side taker runs first. The push's notice is kept for the
    Consumer-side taker; with no Consumer there, it goes to whoever asked."""
    config = config_of(TCP)
    a = Node.create(config, "engine")
    b = Node.create(config, "engine")
    try:
        for node in (a, b):
            node.transport.register(node.region.address, node.region.size)
        a.transport.add_peer(b.transport.local_info())
        writer = a.transport
        assert isinstance(writer, NixlTransport)
        router = Notices.of(b.transport)
        assert Notices.of(b.transport) is router  # one router per transport
        router.join("grant")
        router.join("push")
        for note in (b"push:p1", b"s1:g1"):
            handle = writer.write(b.transport.name, [Segment(0, 0, 4096)], note)
            deadline = time.monotonic() + 5
            while writer.poll(handle).state is ReadState.PENDING:
                router.take("grant")  # the target's progress, as its producer loop gives it
                assert time.monotonic() < deadline
            writer.release(handle)
        got: list[tuple[str, bytes]] = []
        wait_until(lambda: bool(got.extend(router.take("grant")) or len(got) >= 1), timeout_s=5)
        time.sleep(0.05)
        got += router.take("grant")
        assert got == [(writer.name, b"s1:g1")]
        assert router.take("push") == [(writer.name, b"push:p1")]
        router.leave("push")  # no Consumer here any more: a push's notice is unexpected
        handle = writer.write(b.transport.name, [Segment(0, 0, 4096)], b"push:p2")
        seen: list[tuple[str, bytes]] = []
        wait_until(
            lambda: bool(seen.extend(router.take("grant")) or (writer.poll(handle).state
                         is not ReadState.PENDING and seen)), timeout_s=5
        )  # fmt: skip
        writer.release(handle)
        assert seen == [(writer.name, b"push:p2")]
        router.leave("grant")
    finally:
        a.close()
        b.close()


def test_shared_node_hands_push_notices_to_its_consumer_while_its_producer_serves(
    make_producer: MakeProducer, make_consumer: MakeConsumer, keyring: Keyring
) -> None:
    """An engine that encodes and consumes runs a Producer and a Consumer over one
    transport. While its producer serves TCP reads (its loop progresses the shared data
    plane flat out), every push into its consumer commits, and every push notice the
    pushing producer's data plane sends it (the word a push whose PushDone must wait for
    a later session gets, `Pusher._notice`) reaches the consumer, never mistaken by the
    producer for a grant's."""
    items = {f"shared-push-{i}": 1 << 20 for i in range(12)}
    served = {"served-0": 4 << 20}
    remote, producer = make_producer(keyring.producer_config(), TCP, entries=items)
    pushing = writer_of(remote.transport)
    assert pushing is not None
    engine = Node.create(
        config_of(keyring.producer_config(), keyring.consumer_config(), PUSH, TCP), "engine"
    )
    for h, n in served.items():
        engine.store.put(h, expected(h, n))
    own_producer = start_producer(engine, fingerprint=FINGERPRINT)
    own_consumer = start_consumer(engine, fingerprint=FINGERPRINT)
    stop = threading.Event()
    try:
        _rnode, reader = make_consumer(keyring.consumer_config(), TCP)
        h0 = next(iter(served))

        def read_forever() -> None:
            while not stop.is_set():
                reader.fetch([h0], [own_producer.address])[0].result(timeout=15)
                _rnode.store.remove(h0)

        pulls = threading.Thread(target=read_forever, daemon=True)
        pulls.start()
        own_consumer.connect([producer.address])
        first, *rest = items
        assert push_when_connected(producer, first).pushed
        outcomes = [producer.push(h, to="pd-0") for h in rest]
        assert all(f.result(timeout=30).pushed for f in outcomes)
        # As a push's notice is sent (from the pusher's agent), while the engine's producer
        # loop still progresses the shared data plane for the reads it serves.
        for i in range(len(items)):
            assert pushing.note(engine.transport.name, f"push:n{i}".encode())
        wait_until(
            lambda: own_consumer.counter_snapshot().get("push_notices", 0) == len(items),
            timeout_s=10,
            detail=lambda: own_consumer.counter_snapshot(),
        )
        stop.set()
        pulls.join(timeout=20)

        wait_until(lambda: all(ready(engine.store, h) for h in items), timeout_s=10)
        for h, n in items.items():
            np.testing.assert_array_equal(stored_bytes(engine, h), expected(h, n))
        assert own_producer.counters["bad_notifications"] == 0
        assert own_consumer.counter_snapshot().get("unexpected_notifications", 0) == 0
        assert reader.counter_snapshot()["fetched"] >= 1  # the producer did serve meanwhile
    finally:
        stop.set()
        own_consumer.stop()
        own_producer.stop()
        engine.close()
