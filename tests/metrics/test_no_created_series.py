"""No ecshare exporter sends prometheus_client's `<name>_created` series.

Each counter, histogram and summary would otherwise add a second series holding its
creation time, nearly doubling what Prometheus stores; `ecshare.metrics` turns them off
for the whole process (the package root imports it). The endpoints are real: a producer
and a consumer in this process serving `metrics_port`, and an `ecshare proxy` process
serving its `/metrics`. A counter that counted is still there, as its `_total`.
"""

from __future__ import annotations

import subprocess
import sys
import urllib.error
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager

from loopback_testing import MakeLoopConsumer, MakeLoopProducer
from metrics_testing import exposition, free_port, metrics_url, parse, value
from peer_testing import Keyring

from ecshare.apps.ready import ProxyReady, parse_ready


def _created_lines(text: str) -> list[str]:
    return [line for line in text.splitlines() if "_created" in line]


def test_node_endpoint_sends_no_created_series_and_counters_keep_their_totals(
    loop_producer: MakeLoopProducer, loop_consumer: MakeLoopConsumer, keyring: Keyring
) -> None:
    port = free_port()
    _, producer = loop_producer(
        keyring.producer_config(), {"metrics_port": port}, entries={"h-created": 65536}
    )
    _, consumer = loop_consumer(keyring.consumer_config(), {"metrics_port": port})
    assert consumer.fetch(["h-created"], [producer.address])[0].result(timeout=20).nbytes == 65536

    text = exposition(metrics_url(port))
    assert not _created_lines(text)
    samples = parse(text)
    assert value(samples, "ecshare_fetched_items_total") == 1
    assert value(samples, "ecshare_grants_total") == 1
    assert value(samples, "ecshare_fetch_latency_seconds_count") == 1


@contextmanager
def _proxy(*flags: str) -> Iterator[ProxyReady]:
    cmd = [sys.executable, "-m", "ecshare", "proxy", "--port", "0", *flags]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None and proc.stderr is not None
        line = proc.stdout.readline()
        ready = parse_ready(line, ProxyReady)
        assert ready is not None, (line, proc.poll() is not None and proc.stderr.read())
        yield ready
    finally:
        proc.kill()
        proc.wait()


def _chat_status(url: str) -> int:
    body = b'{"model": "m", "messages": [{"role": "user", "content": "hi"}]}'
    request = urllib.request.Request(
        url + "/v1/chat/completions", data=body, headers={"Content-Type": "application/json"}
    )
    try:
        with urllib.request.urlopen(request, timeout=10) as resp:
            status: int = resp.status
    except urllib.error.HTTPError as error:
        status = error.code
    return status


def test_proxy_process_sends_no_created_series_and_counters_keep_their_totals() -> None:
    # Nothing listens on the prefill/decode URL: the chat request is answered with an
    # error, and counted all the same.
    with _proxy("--pd", f"http://127.0.0.1:{free_port()}") as proxy:
        status = _chat_status(proxy.url)
        text = exposition(proxy.url + "/metrics")

    assert status >= 500
    assert not _created_lines(text)
    samples = parse(text)
    assert value(samples, "ecshare_proxy_requests_total", endpoint="chat", status=str(status)) == 1
    assert "ecshare_proxy_request_seconds_count" in text
