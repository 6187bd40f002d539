"""`Consumer.connect` opens a session ahead of the first fetch, and changes nothing else.

A session's first use costs tens of milliseconds (the CURVE handshake, Hello and
Welcome, loading the producer's NIXL metadata); a consumer told its peers early
pays that before any item is needed.
"""

from __future__ import annotations

import numpy as np
import pytest

pytest.importorskip("nixl._api")

from peer_testing import Keyring, MakeConsumer, MakeProducer, expected, stored_bytes, wait_until

pytestmark = pytest.mark.timeout(60)


def test_connect_opens_the_session_before_any_fetch(
    make_producer: MakeProducer, make_consumer: MakeConsumer, keyring: Keyring
) -> None:
    h, nbytes = "after-connect", 1 << 20
    _, producer = make_producer(keyring.producer_config(), entries={h: nbytes})
    cnode, consumer = make_consumer(keyring.consumer_config())

    consumer.connect([producer.address, producer.address])  # a repeat is harmless

    assert wait_until(lambda: [p.up for p in consumer.peer_liveness()] == [True], 10.0)
    assert producer.session_count() == 1
    assert consumer.counter_snapshot().get("fetches", 0) == 0
    result = consumer.fetch([h], peers=[producer.address])[0].result(timeout=10)
    assert (result.nbytes, result.attempts) == (nbytes, 1)
    assert np.array_equal(stored_bytes(cnode, h), expected(h, nbytes))
    assert producer.session_count() == 1  # the fetch used the session connect opened
    consumer.connect([producer.address])  # already up: left as it is
    assert wait_until(lambda: producer.session_count() == 1, 0.2)


def test_connect_never_takes_the_place_of_a_link(
    make_producer: MakeProducer, make_consumer: MakeConsumer, keyring: Keyring
) -> None:
    _, first = make_producer(keyring.producer_config())
    _, second = make_producer(keyring.producer_config())
    _, consumer = make_consumer(keyring.consumer_config(), {"max_peer_links": 1})

    consumer.connect([first.address])
    assert wait_until(lambda: [p.up for p in consumer.peer_liveness()] == [True], 10.0)
    consumer.connect([second.address])  # no room: a warm-up evicts nobody

    assert wait_until(lambda: first.session_count() == 1, 0.5)
    assert [p.endpoint for p in consumer.peer_liveness()] == [first.address]
    assert second.session_count() == 0
