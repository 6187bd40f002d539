"""Prometheus metrics across real fetches, read by scraping the real HTTP endpoints.

Two tiers. A fetch across processes over NIXL and CURVE on 127.0.0.1 (a producer
process, `ecshare serve` or the hook script where a grant must stay open) shows the
counts end to end. What is refused, and the endpoint's own life, are counted the
same whatever moves the bytes: those producers and consumers run in this process on
`LoopbackTransport` (tests/peer/loopback_testing.py), the project's own in-process
data plane, held to NIXL's contract by tests/transport/test_transport_contract.py,
not a mock; the control plane is real ZMQ with CURVE.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import prometheus_client
import pytest
from loopback_testing import MakeLoopConsumer, MakeLoopProducer
from metrics_testing import free_port, metrics_url, refused, scrape, scrape_until, value
from peer_testing import (
    Keyring,
    MakeConsumer,
    SpawnProducer,
    expected,
    stored_bytes,
)

from ecshare.peer import FailureReason, FetchFailed


def test_real_fetch_counts_bytes_items_latency_grants_and_releases_pins(
    spawn_producer: SpawnProducer, make_consumer: MakeConsumer, keyring: Keyring
) -> None:
    pport, cport = free_port(), free_port()
    producer = spawn_producer(
        synthetic="64KiB:2,1MiB:1", config={**keyring.producer_config(), "metrics_port": pport}
    )
    purl = metrics_url(pport)
    sizes = producer.sizes
    payload = sum(sizes.values())
    before = scrape(purl)
    assert value(before, "ecshare_grants_total") == 0
    assert value(before, "ecshare_region_entries", state="ready") == 3
    assert value(before, "ecshare_region_payload_bytes") == payload
    assert value(before, "ecshare_sessions") == 0

    node, consumer = make_consumer(keyring.consumer_config(), {"metrics_port": cport})
    assert consumer.metrics_url == metrics_url(cport)
    for future in consumer.fetch(list(sizes), [producer.address]):
        result = future.result(timeout=20)
        assert np.array_equal(
            stored_bytes(node, result.mm_hash), expected(result.mm_hash, result.nbytes)
        )

    c = scrape(metrics_url(cport))
    assert value(c, "ecshare_fetched_bytes_total") == payload
    assert value(c, "ecshare_fetched_items_total") == 3
    assert value(c, "ecshare_fetches_started_total") == 3
    assert value(c, "ecshare_fetch_latency_seconds_count") == 3
    assert value(c, "ecshare_fetch_latency_seconds_bucket", le="+Inf") == 3
    assert value(c, "ecshare_fetch_latency_seconds_sum") > 0
    assert value(c, "ecshare_checksum_failures_total") == 0
    assert not any(n == "ecshare_fetch_failures_total" and v for (n, _), v in c.items())
    assert value(c, "ecshare_fetches_in_flight") == 0
    # Every kind of fence is a series of its own; no read of these fetches was given up.
    kinds = ("given_up", "warm_up", "tag_landing")
    fenced = {k: value(c, "ecshare_fenced_reads_by_kind", kind=k) for k in kinds}
    assert fenced["given_up"] == value(c, "ecshare_fenced_reads") == 0, fenced
    # The consumer's own region now holds the items.
    assert value(c, "ecshare_region_payload_bytes") == payload
    assert value(c, "ecshare_region_entries", state="ready") == 3
    assert value(c, "ecshare_region_used_bytes") >= payload
    assert value(c, "ecshare_region_size_bytes") == node.config.region_bytes
    assert value(c, "ecshare_peer_up", peer=producer.address) == 1
    assert value(c, "ecshare_peer_quarantined", peer=producer.address) == 0
    assert value(c, "ecshare_peer_last_heard_age_seconds", peer=producer.address) >= 0

    # The producer counts the releases as they arrive; then no grant or pin is left.
    p = scrape_until(purl, lambda s: value(s, "ecshare_released_grants_total") == 3)
    assert value(p, "ecshare_released_grants_total") == 3
    assert value(p, "ecshare_grants_total") == 3
    assert value(p, "ecshare_granted_bytes_total") == payload
    assert value(p, "ecshare_active_grants") == 0
    assert value(p, "ecshare_region_pins") == 0
    assert value(p, "ecshare_region_pinned_entries") == 0
    assert value(p, "ecshare_sessions") == 1
    assert value(p, "ecshare_sessions_opened_total") == 1
    assert value(p, "ecshare_handshakes_accepted_total") >= 1
    assert value(p, "ecshare_fetch_requests_total") >= 1
    assert not any(n == "ecshare_refusals_total" and v for (n, _), v in p.items())


def test_outstanding_grant_shows_as_active_grant_and_pin_until_released(
    spawn_producer: SpawnProducer, make_consumer: MakeConsumer, keyring: Keyring
) -> None:
    pport = free_port()
    producer = spawn_producer(
        synthetic="1MiB:1",
        config={**keyring.producer_config(), "metrics_port": pport},
        hooks=True,
    )
    purl = metrics_url(pport)
    # The producer's network thread sleeps as soon as it has granted, so the grant
    # stays outstanding while the metrics endpoint (its own thread) is scraped.
    producer.command("stall-on-grant 1.5")
    # Patient enough to outlast the stall (still under its fetch deadline).
    _, consumer = make_consumer(keyring.consumer_config(), {"heartbeat_timeout_s": 4.0})
    (h,) = producer.sizes
    future = consumer.fetch([h], [producer.address])[0]

    during = scrape_until(purl, lambda s: value(s, "ecshare_active_grants") == 1)
    assert value(during, "ecshare_active_grants") == 1
    assert value(during, "ecshare_region_pins") == 1
    assert value(during, "ecshare_region_pinned_entries") == 1

    assert future.result(timeout=20).nbytes == producer.sizes[h]
    after = scrape_until(purl, lambda s: value(s, "ecshare_region_pins") == 0)
    assert value(after, "ecshare_region_pins") == 0
    assert value(after, "ecshare_active_grants") == 0
    assert value(after, "ecshare_released_grants_total") == 1


def test_missing_key_and_fingerprint_mismatch_count_as_refusals_by_reason(
    loop_producer: MakeLoopProducer, loop_consumer: MakeLoopConsumer, keyring: Keyring
) -> None:
    pport, cport = free_port(), free_port()
    _pnode, producer = loop_producer(
        keyring.producer_config(), {"metrics_port": pport}, entries={"h-metrics": 65536}
    )
    purl = metrics_url(pport)
    _, consumer = loop_consumer(keyring.consumer_config(), {"metrics_port": cport})
    with pytest.raises(FetchFailed) as missing:
        consumer.fetch(["never-stored"], [producer.address])[0].result(timeout=20)
    assert missing.value.reason is FailureReason.MISSING

    # Another model: the producer refuses the handshake itself.
    _, other = loop_consumer(keyring.consumer_config(), fingerprint="another-model")
    h = "h-metrics"
    with pytest.raises(FetchFailed) as mismatch:
        other.fetch([h], [producer.address])[0].result(timeout=20)
    assert mismatch.value.reason is FailureReason.INCOMPATIBLE

    p = scrape(purl)
    assert value(p, "ecshare_refusals_total", reason="missing") == 1
    assert value(p, "ecshare_refusals_total", reason="fingerprint") == 1
    assert value(p, "ecshare_grants_total") == 0
    c = scrape(metrics_url(cport))
    assert value(c, "ecshare_fetch_failures_total", reason="missing") == 1
    assert value(c, "ecshare_fetched_items_total") == 0
    assert value(c, "ecshare_fetch_latency_seconds_count") == 0


def test_client_with_unauthorized_key_counts_as_auth_failure(
    loop_producer: MakeLoopProducer, loop_consumer: MakeLoopConsumer, keyring: Keyring
) -> None:
    pport, cport = free_port(), free_port()
    _pnode, producer = loop_producer(
        keyring.producer_config(), {"metrics_port": pport}, entries={"h-metrics": 65536}
    )
    purl = metrics_url(pport)
    _, stranger = loop_consumer(keyring.consumer_config(stranger=True), {"metrics_port": cport})
    h = "h-metrics"
    with pytest.raises(FetchFailed) as error:
        stranger.fetch([h], [producer.address])[0].result(timeout=20)
    assert error.value.reason is FailureReason.AUTH_FAILED

    p = scrape(purl)
    assert value(p, "ecshare_auth_failures_total", reason="key_not_authorized") >= 1
    assert value(p, "ecshare_auth_failures_total", reason="not_curve") == 0
    assert value(p, "ecshare_handshakes_accepted_total") == 0
    assert value(p, "ecshare_sessions") == 0
    assert value(p, "ecshare_grants_total") == 0
    c = scrape(metrics_url(cport))
    assert value(c, "ecshare_peer_failures_total", reason="auth_failed") >= 1
    assert value(c, "ecshare_fetch_failures_total", reason="auth_failed") == 1
    assert value(c, "ecshare_peer_up", peer=producer.address) == 0


def test_client_with_wrong_server_key_counts_as_handshake_failure(
    loop_producer: MakeLoopProducer, loop_consumer: MakeLoopConsumer, keyring: Keyring
) -> None:
    pport = free_port()
    _pnode, producer = loop_producer(
        keyring.producer_config(), {"metrics_port": pport}, entries={"h-metrics": 65536}
    )
    # The consumer expects another server key: the CURVE handshake cannot complete.
    wrong_server = Path(keyring.stranger_secret).with_suffix(".key")
    _, consumer = loop_consumer(
        {**keyring.consumer_config(), "server_public_key_file": str(wrong_server)}
    )
    h = "h-metrics"
    with pytest.raises(FetchFailed):
        consumer.fetch([h], [producer.address])[0].result(timeout=20)
    p = scrape_until(
        metrics_url(pport),
        lambda s: value(s, "ecshare_auth_failures_total", reason="handshake_protocol") >= 1,
    )
    assert value(p, "ecshare_auth_failures_total", reason="handshake_protocol") >= 1
    assert value(p, "ecshare_sessions_opened_total") == 0


def test_endpoint_is_shared_in_one_process_and_closes_with_the_last_peer(
    loop_producer: MakeLoopProducer, loop_consumer: MakeLoopConsumer, keyring: Keyring
) -> None:
    port = free_port()
    url = metrics_url(port)
    pnode, producer = loop_producer(
        keyring.producer_config(), {"metrics_port": port}, entries={"h-shared": 65536}
    )
    _, consumer = loop_consumer(keyring.consumer_config(), {"metrics_port": port})
    assert consumer.fetch(["h-shared"], [producer.address])[0].result(timeout=20).nbytes == 65536
    both = scrape(url)
    # One endpoint, both peers: the producer's grants and the consumer's fetches, and
    # the two regions summed.
    assert value(both, "ecshare_grants_total") == 1
    assert value(both, "ecshare_fetched_items_total") == 1
    assert value(both, "ecshare_region_size_bytes") == 2 * pnode.config.region_bytes

    consumer.stop()
    left = scrape(url)
    assert value(left, "ecshare_grants_total") == 1
    assert value(left, "ecshare_region_size_bytes") == pnode.config.region_bytes
    assert ("ecshare_fetch_latency_seconds_count", frozenset()) not in left
    producer.stop()
    assert refused(url)


def test_metrics_use_their_own_registry_never_the_global_one(
    loop_producer: MakeLoopProducer, keyring: Keyring
) -> None:
    port = free_port()
    _, producer = loop_producer(keyring.producer_config(), {"metrics_port": port})
    assert value(scrape(metrics_url(port)), "ecshare_sessions") == 0
    global_names = {
        sample.name for family in prometheus_client.REGISTRY.collect() for sample in family.samples
    }
    assert not {n for n in global_names if n.startswith("ecshare_")}
    producer.stop()
    assert refused(metrics_url(port))
