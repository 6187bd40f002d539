"""The core metrics (ecshare.metrics) reach vLLM's Prometheus hooks as `vllm:ecshare_*`.

Real vLLM Schedulers with the connector (see conftest.py) fetch over NIXL and CURVE;
the stats payloads they emit, exactly as vLLM ships them to its frontend, are fed to
the connector's own `build_prom_metrics` object, whose metrics live on a private
registry that is scraped and parsed with prometheus_client's parser.
"""

from __future__ import annotations

import functools
import time
from typing import Any

import torch
from conftest import EC, HIDDEN
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.parser import text_string_to_metric_families
from vllm.v1.core.sched.scheduler import Scheduler

from ecshare.vllm import ECShareConnector, ECShareStats

QUICK_FAILURE = {
    "handshake_timeout_s": 0.3,
    "request_timeout_s": 0.3,
    "fetch_deadline_base_s": 0.5,
    "fetch_deadline_max_s": 1.0,
}
Scrape = dict[tuple[str, frozenset[tuple[str, str]]], float]
ENGINE = {"model_name": "tiny", "engine": "0"}


def exported(scheduler: Scheduler, samples: list[dict[str, Any]]) -> Scrape:
    """What vLLM's frontend would show for these stats payloads of engine 0."""
    registry = CollectorRegistry()
    types: dict[type, Any] = {
        cls: functools.partial(cls, registry=registry) for cls in (Counter, Gauge, Histogram)
    }
    prom = ECShareConnector.build_prom_metrics(
        scheduler.vllm_config, types, list(ENGINE), {0: list(ENGINE.values())}
    )
    for sample in samples:
        prom.observe(sample, 0)
    out: Scrape = {}
    text = generate_latest(registry).decode()
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out[(s.name, frozenset(s.labels.items()))] = s.value
    return out


def value(samples: Scrape, name: str, **labels: str) -> float:
    return samples.get((name, frozenset({**ENGINE, **labels}.items())), float("nan"))


def total(samples: list[dict[str, Any]]) -> dict[str, Any]:
    stats = ECShareStats(data={})
    for sample in samples:
        stats.aggregate(ECShareConnector.build_ec_connector_stats(sample))
    return stats.data


def test_core_metrics_reach_vllm_as_vllm_ecshare_names(ec: EC) -> None:
    producer = ec.scheduler("ec_producer")
    consumer = ec.scheduler("ec_consumer", **QUICK_FAILURE)
    params = ec.encode(producer, "p1", "h-metrics", torch.randn(12, HIDDEN))
    nbytes = 12 * HIDDEN * 4
    address = params["h-metrics"]["peer"]
    consumer.add_request(ec.request("c1", "h-metrics", params=params, max_tokens=1))
    # An item the producer never held: a refusal with reason "missing".
    lost = {"h-lost": params["h-metrics"]}
    consumer.add_request(ec.request("c2", "h-lost", params=lost, max_tokens=1))
    seen: set[str] = set()

    def both_scheduled(step: Any) -> bool:
        seen.update(step.scheduled)
        return {"c1", "c2"} <= seen

    ec.step_until(consumer, both_scheduled, encoder_outputs={"h-lost": torch.randn(12, HIDDEN)})

    # The core metrics are read about once a second; step both engines until the
    # producer's refusal and released pin, and the consumer's region, were shipped.
    def shipped() -> bool:
        made, used = total(ec.stats[id(producer)]), total(ec.stats[id(consumer)])
        return (
            made.get("c:refusals|missing") == 1
            and made.get("c:grants") == 1
            and made.get("g:region_pins") == 0
            and used.get("g:region_entries|ready") == 1
        )

    deadline = time.monotonic() + 15.0
    while not shipped() and time.monotonic() < deadline:
        ec.step(producer)
        ec.step(consumer)
        time.sleep(0.05)
    assert shipped(), (total(ec.stats[id(producer)]), total(ec.stats[id(consumer)]))

    made = exported(producer, ec.stats[id(producer)])
    assert value(made, "vllm:ecshare_refusals_total", reason="missing") == 1
    assert value(made, "vllm:ecshare_grants_total") == 1
    assert value(made, "vllm:ecshare_granted_bytes_total") == nbytes
    assert value(made, "vllm:ecshare_active_grants") == 0
    assert value(made, "vllm:ecshare_region_pins") == 0
    assert value(made, "vllm:ecshare_auth_failures_total", reason="key_not_authorized") == 0
    assert value(made, "vllm:ecshare_region_size_bytes") == 8 << 20
    # The producer's region holds the encoder output it saved.
    assert value(made, "vllm:ecshare_region_payload_bytes") == nbytes
    assert value(made, "vllm:ecshare_saved_bytes_total") == nbytes

    used = exported(consumer, ec.stats[id(consumer)])
    assert value(used, "vllm:ecshare_fetched_bytes_total") == nbytes
    assert value(used, "vllm:ecshare_fetched_items_total") == 1
    assert value(used, "vllm:ecshare_fetch_latency_seconds_count") == 1
    # The latency buckets are the core ones, down to 0.1 ms.
    assert value(used, "vllm:ecshare_fetch_latency_seconds_bucket", le="0.0001") <= 1
    assert value(used, "vllm:ecshare_region_entries", state="ready") == 1
    assert value(used, "vllm:ecshare_region_payload_bytes") == nbytes
    assert value(used, "vllm:ecshare_peer_up", peer=address) == 1
    assert value(used, "vllm:ecshare_peer_quarantined", peer=address) == 0
    assert value(used, "vllm:ecshare_checksum_failures_total") == 0


def test_gauges_keep_their_latest_value_and_counters_add_up_across_steps() -> None:
    stats = ECShareStats(data={})
    for sample in (
        {"g:region_pins": 2, "c:refusals|missing": 1, "fetched_items": 1},
        {"g:region_pins": 0, "c:refusals|missing": 2, "fetched_items": 1},
    ):
        stats.aggregate(ECShareConnector.build_ec_connector_stats(sample))
    assert stats.data == {"g:region_pins": 0, "c:refusals|missing": 3, "fetched_items": 2}
    assert stats.reduce() == {"region_pins": 0, "refusals[missing]": 3, "fetched_items": 2}


def test_unknown_shipped_keys_are_ignored_not_fatal(ec: EC) -> None:
    consumer = ec.scheduler("ec_consumer")
    # A newer engine process may ship metrics this frontend does not know.
    out = exported(consumer, [{"c:no_such_metric|x": 1, "g:refusals": 3, "c:refusals": 1}])
    assert not [name for name, _ in out if "no_such_metric" in name]
    assert ("vllm:ecshare_refusals_total", frozenset()) not in out
