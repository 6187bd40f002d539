"""`Consumer.connect` opens a session ahead of the first fetch, and changes nothing else.

A session's first use costs tens of milliseconds (the CURVE handshake, Hello and
Welcome, loading the producer's NIXL metadata); a consumer told its peers early
pays that before any item is needed. Once welcomed, it also wires its data plane
to the producer with a one-byte warm-up read, so that the first fetch's READ does
not wait for the transport's connection set-up; that read's block is held until
the read has ended, as any read's destination is.
"""

from __future__ import annotations

import numpy as np
import pytest

pytest.importorskip("nixl._api")

from loopback_testing import MakeLoopConsumer, MakeLoopProducer
from peer_testing import Keyring, MakeConsumer, MakeProducer, expected, stays, stored_bytes
from waiting import wait_until

from ecshare.transport.loopback import Completion
from ecshare.vllm.servers import free_port

pytestmark = pytest.mark.timeout(60)


def test_connect_opens_the_session_before_any_fetch(
    make_producer: MakeProducer, make_consumer: MakeConsumer, keyring: Keyring
) -> None:
    h, nbytes = "after-connect", 1 << 20
    _, producer = make_producer(keyring.producer_config(), entries={h: nbytes})
    cnode, consumer = make_consumer(keyring.consumer_config())

    consumer.connect([producer.address, producer.address])  # a repeat is harmless

    wait_until(lambda: [p.up for p in consumer.peer_liveness()] == [True], timeout_s=10.0)
    assert producer.session_count() == 1
    assert consumer.counter_snapshot().get("fetches", 0) == 0
    result = consumer.fetch([h], peers=[producer.address])[0].result(timeout=10)
    assert (result.nbytes, result.attempts) == (nbytes, 1)
    assert np.array_equal(stored_bytes(cnode, h), expected(h, nbytes))
    assert producer.session_count() == 1  # the fetch used the session connect opened
    opened = producer.counters["sessions_opened"]
    consumer.connect([producer.address])  # already up: left as it is
    assert stays(
        lambda: (producer.session_count(), producer.counters["sessions_opened"]) == (1, opened),
        consumer,
    )
    # The data plane was wired up at the Welcome, and nothing of it is left over.
    assert consumer.counters["warm_ups"] == 1
    assert consumer.counters["reads_started"] == 1  # the fetch's own READ
    stats = cnode.store.stats()
    assert (stats.entries, stats.quarantined) == (1, 0)
    assert cnode.transport.in_flight == 0


def test_connect_never_takes_the_place_of_a_link(
    make_producer: MakeProducer, make_consumer: MakeConsumer, keyring: Keyring
) -> None:
    _, first = make_producer(keyring.producer_config())
    _, second = make_producer(keyring.producer_config())
    _, consumer = make_consumer(keyring.consumer_config(), {"max_peer_links": 1})

    consumer.connect([first.address])
    wait_until(lambda: [p.up for p in consumer.peer_liveness()] == [True], timeout_s=10.0)
    consumer.connect([second.address])  # no room: a warm-up evicts nobody

    def untouched() -> bool:
        links = [p.endpoint for p in consumer.peer_liveness()]
        sessions = (first.session_count(), second.session_count())
        return (links, sessions) == ([first.address], (1, 0))

    assert stays(untouched, consumer), (consumer.peer_liveness(), second.session_count())


def test_a_producer_not_up_yet_is_not_quarantined_by_an_early_connect(
    make_producer: MakeProducer, make_consumer: MakeConsumer, keyring: Keyring
) -> None:
    # A prefill/decode instance starts before its encoder: its start-up connect finds
    # nobody. Once the producer is up, the first fetch must be served, not refused as
    # quarantined for quarantine_s (it was: a media-free request then failed).
    h, nbytes = "late-producer", 1 << 16
    port = free_port()
    address = f"tcp://127.0.0.1:{port}"
    _, consumer = make_consumer(
        keyring.consumer_config(), {"handshake_timeout_s": 0.3, "quarantine_s": 600}
    )

    consumer.connect([address])
    wait_until(
        lambda: consumer.counter_snapshot().get("handshakes_retried", 0) >= 1, timeout_s=10.0
    )
    _, producer = make_producer(
        keyring.producer_config(), {"listen_port": port}, entries={h: nbytes}
    )

    result = consumer.fetch([h], peers=[address])[0].result(timeout=10)
    assert result.nbytes == nbytes
    assert consumer.counter_snapshot().get("peer_failures.peer_unreachable", 0) == 0
    assert producer.address == address


def test_a_warm_up_read_holds_its_block_until_the_read_has_ended(
    loop_producer: MakeLoopProducer, loop_consumer: MakeLoopConsumer, keyring: Keyring
) -> None:
    h, nbytes = "after-warm-up", 100_003
    # Reads from this producer move only as it progresses (UCX over TCP), and it is
    # stalled (a stopped process): the warm-up read cannot end.
    pnode, producer = loop_producer(
        keyring.producer_config(), entries={h: nbytes}, completion=Completion.TARGET
    )
    pnode.transport.stall()
    cnode, consumer = loop_consumer(keyring.consumer_config())
    consumer.connect([producer.address])
    wait_until(lambda: consumer.counters["warm_ups"] == 1, timeout_s=10.0)

    # Its destination is held, not handed out again, while the read may still land.
    def held() -> bool:
        stats = cnode.store.stats()
        return (stats.quarantined, stats.quarantined_blocks, cnode.transport.in_flight) == (1, 1, 1)

    assert stays(held, consumer), (cnode.store.stats(), cnode.transport.in_flight)
    assert consumer.fenced_reads() == (0, 0.0)  # not a read given up: a warm-up

    pnode.transport.resume()
    wait_until(lambda: cnode.store.stats().quarantined == 0, timeout_s=10.0)
    assert cnode.store.stats().entries == 0
    result = consumer.fetch([h], peers=[producer.address])[0].result(timeout=10)
    assert result.nbytes == nbytes
    assert np.array_equal(stored_bytes(cnode, h), expected(h, nbytes))
