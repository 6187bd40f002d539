"""A push given up stays fenced until the write has ended, whatever else fails.

A fenced reservation's blocks come back only on the write's own notification, the
producer's PushDone, or our data plane's own word that the producer is gone (a probe
READ of it that the backend ends PEER_DISCONNECTED). A probe that fails for any other
reason (descriptors refused, a backend error) says nothing of the write, which may
still land: the blocks stay fenced and are counted leaked, and they come back only
once a word does come. The producer's agent stays loaded for the probes (never
loaded anew, which could fail for reasons of its own) until the last one is over.

On `LoopbackTransport` (the project's in-process data plane, held to NIXL's contract;
see loopback_testing.py), whose own fault injection (`stall`, `fail_next`) makes a
write stand still and a probe fail on demand; the control plane is real ZMQ through a
`FaultProxy`.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from concurrent.futures import Future
from typing import Any

import pytest
from loopback_testing import MakeLoopConsumer, MakeLoopProducer
from peer_testing import Keyring
from waiting import wait_until

from ecshare.apps.chaos.faultproxy import FaultProxy, Faults
from ecshare.metrics import read_samples
from ecshare.peer import Consumer, FailureReason, FetchFailed, FetchItem, Producer
from ecshare.store import Store
from ecshare.transport import FailureKind
from ecshare.transport.loopback import Completion

pytestmark = pytest.mark.timeout(60)

# The offered path (a standing credit off); the credited path: test_peer_push_credit.py.
PUSH = {
    "push_name": "pd-0",
    "push_credit_bytes": 0,
    "store_canary": True,
    "push_deadline_s": 30.0,
}


def _push_when_connected(producer: Producer, h: str) -> bool:
    wait_until(lambda: producer.push_names() == {"pd-0"}, "the push session", timeout_s=10)
    return producer.push(h, to="pd-0").result(timeout=10).pushed


def _fill_region(store: Store) -> None:
    """Hand every free block out once, so that the canary checks each of them."""
    free = store.stats().free_blocks
    if free:
        store.abort(store.allocate("fill", free * store.block_size))


def _fenced_metrics(consumer: Consumer) -> tuple[float, float]:
    """The exported counter of pushes ever fenced, and the gauge of those held now."""
    samples = read_samples([], [], [consumer])
    return samples["pushes_fenced"][()], samples["pushes_fenced_in_flight"][()]


@pytest.fixture
def proxy_of() -> Iterator[list[FaultProxy]]:
    proxies: list[FaultProxy] = []
    yield proxies
    for proxy in proxies:
        proxy.close()


def _pushing_pair(
    loop_producer: MakeLoopProducer,
    loop_consumer: MakeLoopConsumer,
    keyring: Keyring,
    proxy_of: list[FaultProxy],
    h: str,
    *,
    seed: int,
    consumer_config: dict[str, object] = PUSH,
) -> tuple[Any, Producer, FaultProxy, Any, Any]:
    """A producer holding `h` (1 MiB), a push consumer behind a fault proxy, one warm
    push done: (producer node, producer, proxy, consumer node, consumer)."""
    pnode, producer = loop_producer(
        keyring.producer_config(), entries={"w": 4096, h: 1 << 20}, completion=Completion.SYNC
    )
    proxy = FaultProxy("127.0.0.1", producer.port, faults=Faults(), seed=seed)
    proxy_of.append(proxy)
    cnode, consumer = loop_consumer(keyring.consumer_config(), consumer_config)
    consumer.connect([proxy.address])
    assert _push_when_connected(producer, "w")
    return pnode, producer, proxy, cnode, consumer


def _push_standing_still(cnode: Any, producer: Producer, consumer: Any, h: str) -> Future[Any]:
    """Push `h` with the write into the consumer's region standing still, once posted:
    else a session lost first ends the offer unwritten, and its PushDone (a word)
    rightly frees the blocks."""
    cnode.transport.stall()
    push = producer.push(h, to="pd-0")
    wait_until(lambda: consumer.push_pending(h), timeout_s=5)
    wait_until(lambda: producer.counters["push_writes"] == 2, timeout_s=5)
    return push


@pytest.mark.parametrize("kind", [FailureKind.BACKEND, FailureKind.INVALID])
def test_a_probe_failing_for_another_reason_leaves_the_push_fenced_and_counted(
    loop_producer: MakeLoopProducer,
    loop_consumer: MakeLoopConsumer,
    keyring: Keyring,
    proxy_of: list[FaultProxy],
    kind: FailureKind,
) -> None:
    h = "fenced-1"
    pnode, producer, proxy, cnode, consumer = _pushing_pair(
        loop_producer, loop_consumer, keyring, proxy_of, h, seed=3
    )
    # Every READ from the producer fails, for a reason that is not its being gone.
    producer_agent = pnode.transport.name
    cnode.transport.fail_next(10_000, kind, peer=producer_agent)
    push = _push_standing_still(cnode, producer, consumer, h)

    # The session is lost, and stays lost for a while: probes run, and say nothing.
    proxy.hold(3.0)
    wait_until(lambda: consumer.counter_snapshot().get("push_sessions_lost") == 1, timeout_s=10)

    def probed_or_over() -> bool:
        c = consumer.counter_snapshot()
        tries = c.get("push_probes", 0) + c.get("push_probes_inconclusive", 0)
        return tries >= 3 or consumer.pushes_fenced_in_flight() == 0

    wait_until(probed_or_over, timeout_s=10)
    assert cnode.store.stats().quarantined == 1, consumer.counter_snapshot()  # never freed
    assert consumer.pushes_fenced_in_flight() == 1
    assert _fenced_metrics(consumer) == (1, 1)  # fenced once, held now
    counters = consumer.counter_snapshot()
    assert counters.get("push_probes_failed", 0) == 0
    assert counters.get("push_fenced_ended", 0) == 0
    assert counters["push_fences_leaked"] == 1 and counters["push_probes_inconclusive"] >= 1
    assert not push.done()

    # The write does land, then its own notification gives the blocks back.
    assert producer_agent in cnode.transport.peers  # kept loaded for the probes
    cnode.transport.resume()
    assert push.result(timeout=15).pushed
    wait_until(lambda: cnode.store.stats().quarantined == 0, timeout_s=15)
    assert consumer.counter_snapshot()["push_fences_ended_by_notice"] == 1
    assert _fenced_metrics(consumer) == (1, 0)  # still counted, no longer held
    assert cnode.store.get(h) is None  # a fenced push never commits
    _fill_region(cnode.store)
    assert cnode.store.stats().canary_violations == 0
    # The last fence over, the agent goes with the link that no longer uses it, or
    # stays with the link that does.
    links = consumer.counter_snapshot()
    wait_until(
        lambda: (producer_agent in cnode.transport.peers) == bool(producer.push_names()),
        timeout_s=10,
        detail=lambda: links,
    )


@pytest.mark.filterwarnings("error::pytest.PytestUnhandledThreadExceptionWarning")
def test_a_data_plane_closed_while_the_consumer_stops_ends_its_thread_without_a_failure(
    loop_producer: MakeLoopProducer,
    loop_consumer: MakeLoopConsumer,
    keyring: Keyring,
    proxy_of: list[FaultProxy],
) -> None:
    # The owner closes the transport once `stop()` returns, and the network thread may
    # still be in its last steps, probing a fenced push: that probe, or any other use of
    # the closed data plane after the stop, ends the thread quietly (a CI run saw
    # `TransportError: transport is closed` kill it).
    h = "fenced-2"
    _pnode, producer, proxy, cnode, consumer = _pushing_pair(
        loop_producer, loop_consumer, keyring, proxy_of, h, seed=4,
        consumer_config={**PUSH, "shutdown_timeout_s": 4.0},
    )  # fmt: skip
    _push_standing_still(cnode, producer, consumer, h)
    proxy.hold(30.0)  # the session is lost: the reservation is orphaned and probed
    wait_until(lambda: consumer.counter_snapshot().get("push_probes", 0) >= 1, timeout_s=10)

    stopping = threading.Thread(target=consumer.stop)
    stopping.start()

    def stop_asked() -> bool:
        future = consumer.fetch([FetchItem("other", pushed=False)], [proxy.address])[0]
        with contextlib.suppress(FetchFailed):
            future.result(timeout=5)
        return isinstance(future.exception(), FetchFailed) and (
            future.exception().reason is FailureReason.SHUTDOWN  # type: ignore[union-attr]
        )

    wait_until(stop_asked, "the stop asked")
    inconclusive = consumer.counter_snapshot().get("push_probes_inconclusive", 0)
    cnode.transport.close()  # while the thread waits on the fenced push
    stopping.join(timeout=15)
    assert not stopping.is_alive()
    assert consumer.failure is None and not consumer.healthy
    counters = consumer.counter_snapshot()
    assert counters.get("push_probes_inconclusive", 0) > inconclusive, counters
