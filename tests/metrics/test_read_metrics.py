"""`ecshare.vllm.servers.read_metrics` reads a live /metrics page with prometheus_client's
own parser: labelled samples summed, histogram buckets and *_created left out.

ecshare's own exporters send no *_created series (`ecshare.metrics` turns them off), but a
vLLM instance that never loaded the connector does; this test turns them back on for its
page, as such an instance's would be.
"""

from __future__ import annotations

from metrics_testing import exposition, free_port
from prometheus_client import (
    CollectorRegistry,
    Counter,
    Histogram,
    disable_created_metrics,
    enable_created_metrics,
    start_http_server,
)

from ecshare.vllm.servers import read_by_label, read_metrics


def test_read_metrics_sums_labels_and_skips_buckets_and_created() -> None:
    registry = CollectorRegistry()
    fetched = Counter("vllm:ecshare_fetched", "items", ["mode"], registry=registry)
    latency = Histogram("vllm:ecshare_latency_seconds", "s", ["mode"], registry=registry)
    Counter("vllm:other", "not ours", registry=registry).inc(5)
    fetched.labels(mode="pushed").inc(2)
    fetched.labels(mode='pu"lled').inc(3)  # an escaped quote in a label value
    latency.labels(mode="pushed").observe(0.25)
    port = free_port()
    server, thread = start_http_server(port, addr="127.0.0.1", registry=registry)
    enable_created_metrics()
    try:
        url = f"http://127.0.0.1:{port}"
        assert "vllm:ecshare_fetched_created" in exposition(url + "/metrics")
        metrics = read_metrics(url)
        by_mode = read_by_label(url, "fetched_total", "mode")
    finally:
        disable_created_metrics()
        server.shutdown()
        thread.join()

    assert metrics == {
        "fetched_total": 5.0,
        "latency_seconds_count": 1.0,
        "latency_seconds_sum": 0.25,
    }
    assert by_mode == {"pushed": 2.0, 'pu"lled': 3.0}
