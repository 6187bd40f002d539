"""Who moves a read: a producer's reads move on NIXL's progress thread, not on its polls.

Over UCX TCP a READ moves only as its target progresses. A producer node runs
NIXL's progress thread, asleep until UCX has an event, so its own network thread
need not poll the data plane while grants are outstanding (and spends no CPU on
a grant nobody is reading). A consumer-only node runs no such thread: it
progresses its own reads as it polls them.
"""

from __future__ import annotations

import threading
from typing import Any

import numpy as np
import pytest

pytest.importorskip("nixl._api")

from peer_testing import Keyring, MakeConsumer, MakeProducer, expected, stored_bytes

pytestmark = pytest.mark.timeout(60)

MiB = 1 << 20
TCP: dict[str, Any] = {"ucx_tls": "tcp"}


def test_producer_reads_move_with_its_network_thread_never_progressing(
    make_producer: MakeProducer, make_consumer: MakeConsumer, keyring: Keyring
) -> None:
    h, nbytes = "moved-by-nixl", 8 * MiB
    pnode, producer = make_producer(keyring.producer_config(), TCP, entries={h: nbytes})
    assert pnode.transport.self_progressing
    calls = threading.Event()

    def never() -> list[tuple[str, bytes]]:
        calls.set()
        return []  # this thread moves nothing: NIXL's thread must

    pnode.transport.progress = never  # type: ignore[method-assign]
    cnode, consumer = make_consumer(keyring.consumer_config(), TCP)
    assert not cnode.transport.self_progressing

    result = consumer.fetch([h], peers=[producer.address])[0].result(timeout=30)

    assert result.nbytes == nbytes
    assert np.array_equal(stored_bytes(cnode, h), expected(h, nbytes))
    assert calls.is_set()  # the loop still collects notifications; it just moves nothing


def test_without_the_thread_the_producer_polls_its_reads_forward(
    make_producer: MakeProducer, make_consumer: MakeConsumer, keyring: Keyring
) -> None:
    h, nbytes = "moved-by-polls", 8 * MiB
    polled = {"nixl_progress_thread": False}
    pnode, producer = make_producer(keyring.producer_config(), TCP, polled, entries={h: nbytes})
    assert not pnode.transport.self_progressing
    cnode, consumer = make_consumer(keyring.consumer_config(), TCP)

    result = consumer.fetch([h], peers=[producer.address])[0].result(timeout=30)

    assert result.nbytes == nbytes
    assert np.array_equal(stored_bytes(cnode, h), expected(h, nbytes))
