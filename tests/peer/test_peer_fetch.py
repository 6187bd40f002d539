"""Fetching: byte-exact, batched, single-flight, bounded links, holds.

Two tiers. The batch of many sizes runs across two processes over real NIXL: its
promise is the real data plane's (every size lands byte-exact from another
process). The rest is the Consumer's logic, run in this process on
`LoopbackTransport` (tests/peer/loopback_testing.py): the project's own in-process
data plane, held to NIXL's contract by tests/transport/test_transport_contract.py,
not a mock; the control plane is still ZMQ with CURVE.
"""

from __future__ import annotations

import socket
import threading
from concurrent.futures import Future

import numpy as np
import pytest

pytest.importorskip("nixl._api")

from loopback_testing import MakeLoopConsumer, MakeLoopProducer
from peer_testing import FINGERPRINT, Keyring, MakeConsumer, SpawnProducer, expected, stored_bytes
from waiting import wait_until

from ecshare.metrics import read_samples
from ecshare.peer import FailureReason, FetchFailed, FetchItem, FetchResult
from ecshare.store import EntryState, Hold

pytestmark = pytest.mark.timeout(60)

# 1 byte up to 16 MiB; most are not multiples of the 64 KiB block.
BATCH_SIZES = (
    "1:1,4095:1,4096:1,65535:1,65536:1,65537:1,100003:1,1MiB:1,1048577:1,5000000:1,16MiB:1"
)


def test_single_item_fetch_is_byte_exact(
    loop_producer: MakeLoopProducer, loop_consumer: MakeLoopConsumer, keyring: Keyring
) -> None:
    h, nbytes = "single", 1000003
    _pnode, producer = loop_producer(keyring.producer_config(), entries={h: nbytes})
    node, consumer = loop_consumer(keyring.consumer_config())

    result = consumer.fetch([h], [producer.address])[0].result(timeout=10)

    assert (result.mm_hash, result.nbytes, result.peer) == (h, nbytes, producer.address)
    assert (result.dtype, result.shape) == ("uint8", (nbytes,))
    entry = node.store.get(h)
    assert entry is not None and entry.state is EntryState.READY
    np.testing.assert_array_equal(stored_bytes(node, h), expected(h, nbytes))
    assert consumer.counters["requests"] == 1
    assert consumer.counters["reads_started"] == 1


def test_batch_of_many_sizes_is_byte_exact(
    spawn_producer: SpawnProducer, make_consumer: MakeConsumer, keyring: Keyring
) -> None:
    producer = spawn_producer(synthetic=BATCH_SIZES, config=keyring.producer_config(), hooks=True)
    sizes = producer.sizes
    assert len(sizes) == 11 and min(sizes.values()) == 1 and max(sizes.values()) == 16 << 20
    node, consumer = make_consumer(keyring.consumer_config())

    futures = consumer.fetch(list(sizes), [producer.address])
    results = [f.result(timeout=15) for f in futures]

    for result, (h, nbytes) in zip(results, sizes.items(), strict=True):
        assert (result.mm_hash, result.nbytes, result.peer) == (h, nbytes, producer.address)
        np.testing.assert_array_equal(stored_bytes(node, h), expected(h, nbytes), err_msg=h)
    # One FetchRequest for the whole batch, seen from both sides.
    assert consumer.counters["fetches"] == len(sizes)
    assert consumer.counters["requests"] == 1
    assert consumer.counters["reads_started"] == len(sizes)
    stats = producer.stats()
    assert stats["counters"]["fetch_requests"] == 1, stats
    assert stats["counters"]["granted"] == len(sizes), stats
    assert stats["counters"].get("duplicate_requests", 0) == 0, stats
    # Every grant ends once its read is done: the consumer releases them all.
    wait_until(
        lambda: producer.stats()["store"]["pins"] == 0,
        timeout_s=5.0,
        detail=lambda: producer.stats(),
    )
    assert producer.stats()["counters"]["released"] == len(sizes)


def test_concurrent_fetches_of_one_hash_share_one_transfer(
    loop_producer: MakeLoopProducer, loop_consumer: MakeLoopConsumer, keyring: Keyring
) -> None:
    h, nbytes = "shared", 16 << 20
    _pnode, producer = loop_producer(keyring.producer_config(), entries={h: nbytes})
    node, consumer = loop_consumer(keyring.consumer_config(), fingerprint=FINGERPRINT)
    threads_n = 8
    barrier = threading.Barrier(threads_n)
    futures: list[Future[FetchResult]] = []
    lock = threading.Lock()

    def fetch() -> None:
        barrier.wait()
        (future,) = consumer.fetch([h], [producer.address])
        with lock:
            futures.append(future)

    threads = [threading.Thread(target=fetch) for _ in range(threads_n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=10)
    assert len(futures) == threads_n
    results = [f.result(timeout=10) for f in futures]

    assert all(r.mm_hash == h and r.nbytes == nbytes for r in results)
    np.testing.assert_array_equal(stored_bytes(node, h), expected(h, nbytes))
    # One transfer: one request, one read, one grant; every other caller joined it
    # (or, arriving after it finished, found the entry already local).
    assert consumer.counters["fetches"] == 1
    assert consumer.counters["requests"] == 1
    assert consumer.counters["reads_started"] == 1
    joined = consumer.counters["single_flight_joins"] + consumer.counters["local_hits"]
    assert joined == threads_n - 1
    assert producer.counters["granted"] == 1


@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")
def test_dead_network_thread_fails_every_fetch_loudly(
    loop_consumer: MakeLoopConsumer, keyring: Keyring
) -> None:
    _node, consumer = loop_consumer(keyring.consumer_config())
    assert consumer.healthy
    # A producer that never answers: the fetch waits in the consumer's thread.
    with socket.socket() as quiet:
        quiet.bind(("127.0.0.1", 0))
        quiet.listen()
        waiting = consumer.fetch(["a"], peers=[f"tcp://127.0.0.1:{quiet.getsockname()[1]}"])[0]

        def broken(now: float) -> None:
            raise RuntimeError("a bug in the loop")

        consumer._dispatch = broken  # type: ignore[method-assign]  # the fault: a bug
        consumer.fetch(["b"], peers=["tcp://127.0.0.1:1"])  # wakes the thread into it
        with pytest.raises(FetchFailed) as failed:
            waiting.result(timeout=10)
    assert failed.value.reason is FailureReason.INTERNAL
    assert "a bug in the loop" in failed.value.detail
    wait_until(lambda: not consumer.healthy, timeout_s=5.0)
    # New work fails at once, never queued for a thread that is gone.
    late = consumer.fetch(["c"], peers=["tcp://127.0.0.1:1"])[0]
    assert late.done() and late.exception() is not None
    assert late.exception().reason is FailureReason.INTERNAL  # type: ignore[union-attr]
    assert read_samples(consumers=[consumer])["healthy"] == {(): 0.0}


def test_peer_links_are_bounded_and_idle_ones_closed(
    loop_producer: MakeLoopProducer, loop_consumer: MakeLoopConsumer, keyring: Keyring
) -> None:
    h = "linked"
    _pnode, producer = loop_producer(keyring.producer_config(), entries={h: 4096})
    _cnode, consumer = loop_consumer(
        keyring.consumer_config(), {"max_peer_links": 2, "peer_link_idle_s": 0.5}
    )
    consumer.fetch([h], peers=[producer.address])[0].result(timeout=10)
    assert producer.session_count() == 1
    # Endpoints nobody answers, as a hostile request body could name them: each
    # holds a link for its handshake timeout (1 s).
    with socket.socket() as quiet:
        quiet.bind(("127.0.0.1", 0))
        quiet.listen()
        first = consumer.fetch(["x"], peers=[f"tcp://127.0.0.1:{quiet.getsockname()[1]}"])[0]
        wait_until(lambda: len(consumer.peer_liveness()) == 2, timeout_s=1.0)
        # A third endpoint takes the place of the idle producer link...
        second = consumer.fetch(["y"], peers=["tcp://127.0.0.1:1"])[0]
        wait_until(lambda: producer.session_count() == 0, timeout_s=1.0)  # we said Bye
        # ...and a fourth, with both links busy, fails at once instead of adding one.
        third = consumer.fetch(["z"], peers=["tcp://127.0.0.1:2"])[0]
        refused = third.exception(timeout=0.5)
        assert isinstance(refused, FetchFailed), refused
        assert refused.reason is FailureReason.PEER_UNREACHABLE
        assert "max_peer_links=2" in refused.detail
        assert len(consumer.peer_liveness()) == 2
        for pending in (first, second):
            assert isinstance(pending.exception(timeout=10), FetchFailed)
    counters = consumer.counter_snapshot()
    assert counters["peer_links_evicted"] == 1 and counters["refused_peer_links"] == 1
    # Links nothing uses are closed once idle.
    wait_until(lambda: not consumer.peer_liveness(), timeout_s=5.0)
    assert consumer.counter_snapshot()["peer_links_closed_idle"] >= 1


def test_a_hold_is_pinned_as_the_entry_turns_ready_and_on_a_local_hit(
    loop_producer: MakeLoopProducer, loop_consumer: MakeLoopConsumer, keyring: Keyring
) -> None:
    h = "held"
    _pnode, producer = loop_producer(keyring.producer_config(), entries={h: 3 * 4096})
    cnode, consumer = loop_consumer(keyring.consumer_config())
    store = cnode.store
    first = FetchItem(h, peers=(producer.address,), hold=Hold("engine", "fetch-1", 30.0))
    consumer.fetch([first])[0].result(timeout=10)
    # Pinned by the time the future is resolved, so no eviction can take it now.
    assert store.pinned_entry("engine", "fetch-1") is not None
    assert cnode.store.evict_bytes(cnode.store.stats().total_blocks * 4096) == 0
    # A local hit pins in the same step as it finds the entry.
    again = FetchItem(h, peers=(producer.address,), hold=Hold("engine", "fetch-2", 30.0))
    assert consumer.fetch([again])[0].result(timeout=10).peer == "local"
    assert store.pinned_entry("engine", "fetch-2") is not None
    assert store.unpin("engine", "fetch-1") and store.unpin("engine", "fetch-2")
    store.check_invariants()
