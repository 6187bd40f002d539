"""A producer SIGKILLed and restarted on the same endpoint, within the heartbeat
timeout, over UCX TCP: no Release made for a grant of the process that died ends a
grant of the one that took its place (docs/ARCHITECTURE.md, invariant 4), so no block is
reused while a READ may still move it (invariant 2).

The consumer keeps a Release for the dead process queued across the restart: it
rode in a FetchRequest the dead producer never answered, and goes again once that
request times out, by then on the consumer's new session with the new process,
whose first grant is being read at that moment. The new producer then frees and
reuses every block it can, and the read must still bring the entry's own bytes.
"""

from __future__ import annotations

import time
from typing import Any

import numpy as np
import pytest

pytest.importorskip("nixl._api")

from peer_testing import (
    FAST,
    STALLABLE_TCP,
    Keyring,
    MakeConsumer,
    SpawnProducer,
    expected,
    stored_bytes,
)
from waiting import wait_until

from ecshare.peer import link as link_module
from ecshare.peer.transfer import FailureReason, FetchFailed
from ecshare.vllm.servers import free_port

pytestmark = pytest.mark.timeout(180)

MiB = 1 << 20
# Pings are rare and a Release waits for the next request to its producer, so that
# one queued before the kill is still queued (then carried) when the producer dies;
# the sessions outlive the restart (heartbeat timeout), and the request that carries
# that Release times out only once the new process has granted.
REQUEST_TIMEOUT_S = 15.0
TIMING: dict[str, Any] = {
    "heartbeat_interval_s": 30.0,
    "heartbeat_timeout_s": 60.0,
    "request_timeout_s": REQUEST_TIMEOUT_S,
    "grant_lease_s": 50.0,
    "fetch_deadline_base_s": 40.0,
    "fetch_deadline_max_s": 45.0,
}


def _rewrite_region(producer: Any) -> None:
    """Commit new entries on `producer` over its whole region (each put evicts the
    least recently used entries it needs room from): every block not held is rewritten."""
    for i in range(FAST["region_bytes"] // (16 * MiB)):
        producer.command(f"put fill-{i} {16 * MiB}")


def test_releases_queued_across_a_producer_restart_never_free_the_new_process_grants(
    spawn_producer: SpawnProducer,
    make_consumer: MakeConsumer,
    keyring: Keyring,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # A tuning constant, not a mock: Releases go only with the next request here.
    monkeypatch.setattr(link_module, "RELEASE_DELAY_S", 3600.0)
    port = free_port()
    config = {**keyring.producer_config(), **STALLABLE_TCP, **TIMING, "listen_port": port}
    old = spawn_producer(synthetic="64KiB:2", config=config, hooks=True)
    a, b = old.sizes
    node, consumer = make_consumer(
        keyring.consumer_config(),
        STALLABLE_TCP,
        TIMING,
        # The bytes are kept as read: a wrong read shows as wrong bytes, not a failure.
        {"checksum": "none", "fetch_lane": False},
    )
    address = old.address

    # 1. A grant of the old process is read; its Release is queued.
    consumer.fetch([a], [address])[0].result(timeout=30)
    assert old.command("stall 120")["stalling"]
    # 2. It rides in the next request, which the stalled producer never answers...
    requests = consumer.counters["requests"]
    consumer.fetch([b], [address])
    wait_until(lambda: consumer.counters["requests"] > requests, timeout_s=5)
    sent_at = time.monotonic()
    # 3. ...for it dies, and a new process takes its endpoint.
    old.kill()
    new = spawn_producer(synthetic="16MiB:1", config=config, hooks=True)
    assert new.address == address
    (c,) = new.sizes
    # 4. The consumer's next message finds its session gone, and it makes a new one.
    consumer.fetch(["gone-with-the-old-session"], [address])
    wait_until(lambda: new.stats()["counters"].get("no_session", 0) >= 1, timeout_s=10)
    assert new.command("hold")["held"]  # the new grant's READ stays in flight
    fetch_c = consumer.fetch([c], [address])[0]
    wait_until(lambda: new.stats()["active_grants"] == 1, timeout_s=10, detail=lambda: new.stderr())
    wait_until(lambda: consumer.counters["reads_started"] >= 2, timeout_s=10)
    # What the test is about happens only if the old request is still unanswered now.
    assert time.monotonic() < sent_at + REQUEST_TIMEOUT_S, "the producer took too long to start"

    # 5. The old request times out; its Release would go with the next request.
    time.sleep(max(0.0, sent_at + REQUEST_TIMEOUT_S + 1.0 - time.monotonic()))
    missing = consumer.fetch(["not-held-anywhere"], [address])[0].exception(timeout=15)
    assert isinstance(missing, FetchFailed) and missing.reason is FailureReason.MISSING
    before = new.stats()

    # 6. The new producer reuses every block it may; the READ then moves.
    assert new.command(f"remove {c}")["removed"] == c
    _rewrite_region(new)
    assert not fetch_c.done()
    assert new.command("resume")["held"] is False
    fetch_c.result(timeout=30)
    np.testing.assert_array_equal(stored_bytes(node, c), expected(c, 16 * MiB))
    # The read's grant stood until the read had ended, and no Release matched it.
    assert before["active_grants"] == 1, before
    assert before["counters"].get("released", 0) == 0, before
    assert node.store.stats().canary_violations == 0
    assert new.stats()["store"]["canary_violations"] == 0
    assert consumer.counters["releases_dropped_with_session"] >= 1
