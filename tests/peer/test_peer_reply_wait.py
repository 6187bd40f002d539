"""A consumer waits awake for a request's answer, briefly, and never longer than told.

Having sent a fetch request, the consumer's network thread polls without blocking
for the answer (`reply_spin_s`, `Consumer._spin_until`) instead of sleeping, so
that an answer that comes a fraction of a millisecond later finds it awake. The
promise tested here is the bound: an answer that does not come costs at most that
spin, then the thread sleeps as before; answers that typically take longer than
the bound are not spun for at all.
"""

from __future__ import annotations

import threading
import time
from types import SimpleNamespace

import numpy as np
import pytest
from peer_testing import Keyring, MakeConsumer, SpawnProducer, expected, stored_bytes

from ecshare.config import Config
from ecshare.peer import Consumer

pytestmark = pytest.mark.timeout(60)


def _thread_cpu_s(ident: int) -> float:
    return time.clock_gettime(time.pthread_getcpuclockid(ident))


def test_an_unanswered_request_costs_a_bounded_spin_then_the_thread_sleeps(
    spawn_producer: SpawnProducer, make_consumer: MakeConsumer, keyring: Keyring
) -> None:
    producer = spawn_producer(synthetic="65536:4", config=keyring.producer_config(), hooks=True)
    *warm, late = producer.sizes
    # Patient enough that a request stays unanswered for seconds without anything
    # giving up on it.
    patient = {
        "reply_spin_s": 0.1,
        "request_timeout_s": 8.0,
        "heartbeat_timeout_s": 8.0,
        "fetch_deadline_base_s": 8.0,
        "fetch_deadline_max_s": 8.5,
        "grant_lease_s": 10.0,
    }
    node, consumer = make_consumer(keyring.consumer_config(), patient)
    for h in warm:
        consumer.fetch([h], [producer.address])[0].result(timeout=15)
    ident = consumer.thread_ident
    assert ident is not None and ident != threading.get_ident()

    assert producer.command("stall 2.0")["stalling"]  # within its lease (3 s)
    cpu0 = _thread_cpu_s(ident)
    future = consumer.fetch([late], [producer.address])[0]
    time.sleep(1.6)  # the producer does not answer meanwhile
    spent = _thread_cpu_s(ident) - cpu0
    assert not future.done()

    # At most reply_spin_s of waiting awake, then asleep: a wait without that bound
    # polls all along (about a quarter of a core here: 0.4 s of CPU).
    assert spent < 0.15, f"{spent:.3f} s of CPU waiting 1.6 s for a stalled producer"
    result = future.result(timeout=15)
    assert result.nbytes == producer.sizes[late]
    np.testing.assert_array_equal(stored_bytes(node, late), expected(late, result.nbytes))


def _waiting(limit_s: float, typical_s: float, *sent_at: float) -> SimpleNamespace:
    """What `_spin_until` reads of a consumer: its config, the typical answer's time,
    and its links' oldest unanswered requests."""
    links = {
        f"tcp://p{i}": SimpleNamespace(oldest_unanswered=lambda at=at: at)
        for i, at in enumerate(sent_at)
    }
    return SimpleNamespace(
        _config=Config(insecure=True, reply_spin_s=limit_s), _reply_s=typical_s, _links=links
    )


def test_the_spin_is_bounded_by_the_oldest_request_and_the_typical_answer() -> None:
    spin_until = Consumer._spin_until
    # Nothing unanswered: no spin.
    assert spin_until(_waiting(0.001, 0.0, 0.0), 10.0) == 0.0  # type: ignore[arg-type]
    # Before any answer was seen: up to the limit after the oldest request.
    assert spin_until(_waiting(0.001, 0.0, 9.9995, 9.9999), 10.0) == pytest.approx(10.0005)  # type: ignore[arg-type]
    # Answers typically take 0.2 ms: twice that, below the limit.
    assert spin_until(_waiting(0.001, 0.0002, 9.9999), 10.0) == pytest.approx(10.0003)  # type: ignore[arg-type]
    # Typical answers slower than the limit: spinning would not catch them.
    assert spin_until(_waiting(0.001, 0.002, 9.9999), 10.0) == 0.0  # type: ignore[arg-type]
    # Turned off.
    assert spin_until(_waiting(0.0, 0.0, 9.9999), 10.0) == 0.0  # type: ignore[arg-type]
