"""Reuse-aware routing through the real proxy, in front of recording stub backends.

The item directory here is the real one (`ItemDirectory`), fed through its own `apply` the
stored and pushed events each test says the instances sent (`Feeds`)."""

from __future__ import annotations

import threading
from typing import Any

import httpx
import msgspec
from aiohttp import web
from proxy_stubs import PREFILL_DECODE, StubBackend, serve_stubs, stub_mm_hash
from proxy_testing import IMAGE_A, Feeds, ProxyUnderTest, Rig, chat
from waiting import wait_until

from ecshare.apps.bench.instant import encoder_answer, json_response, serve_apps
from ecshare.apps.proxy.routing import ROUTE_HEADER, SingleFlight

IMAGE_C = {"type": "image_url", "image_url": {"url": "data:image/png;base64,CCCC"}}


def with_directory(proxy: ProxyUnderTest) -> Feeds:
    feeds = Feeds()
    proxy.proxy.router.directory = feeds.directory
    return feeds


def encoder_calls(rig: Rig) -> int:
    return sum(len(stub.bodies()) for stub in rig.encoders)


def media_of(body: dict[str, Any]) -> list[dict[str, Any]]:
    return [
        part
        for message in body["messages"]
        for part in (message["content"] if isinstance(message["content"], list) else [])
        if part.get("type") != "text"
    ]


def test_a_repeated_inline_image_held_somewhere_skips_the_encoders(rig: Rig) -> None:
    proxy = rig.start_proxy(route_headers=True)
    feeds = with_directory(proxy)
    first = proxy.post("/v1/chat/completions", chat(IMAGE_A))
    assert first.status_code == 200
    assert "reason=new" in first.headers[ROUTE_HEADER]
    assert encoder_calls(rig) == 1
    h = stub_mm_hash(IMAGE_A)
    feeds.store(rig.encoder_urls[0], h, encoder=True)  # the encoder's "stored" event

    second = proxy.post("/v1/chat/completions", chat(IMAGE_A, text="again"))

    assert second.status_code == 200
    assert encoder_calls(rig) == 1  # no encoder saw the second request
    sent = rig.prefill_decode[0].bodies()[-1]
    assert media_of(sent) == [
        {"type": "image_embeds", "image_embeds": {"image_grid_thw": [1, 2, 2]}, "uuid": h}
    ]
    assert sent["ec_transfer_params"][h]["peer"] == "tcp://127.0.0.1:1"
    assert second.headers[ROUTE_HEADER] == f"pd={rig.pd_urls[0]};reason=held;items_held=0/1"
    assert proxy.metric("route_total", reason="held") == 1
    assert proxy.metric("route_total", reason="new") == 1
    assert proxy.metric("encoder_calls_saved_total") == 1


def test_a_repeated_image_no_instance_holds_is_encoded_again(rig: Rig) -> None:
    proxy = rig.start_proxy()
    with_directory(proxy)  # hears of nothing held: evicted everywhere
    for _ in range(2):
        assert proxy.post("/v1/chat/completions", chat(IMAGE_A)).status_code == 200
    assert encoder_calls(rig) == 2
    assert proxy.metric("route_total", reason="new") == 2
    assert proxy.metric("encoder_calls_saved_total") == 0


def test_a_stale_hint_costs_an_encode_never_a_wrong_embedding(rig: Rig) -> None:
    proxy = rig.start_proxy()
    feeds = with_directory(proxy)
    proxy.post("/v1/chat/completions", chat(IMAGE_A))
    h = stub_mm_hash(IMAGE_A)
    feeds.store(rig.encoder_urls[0], h, encoder=True)  # ...and then the encoder evicts it, unheard
    pd = rig.prefill_decode[0]
    pd.behaviour.fail_media_free = True  # as vLLM fails a fetch of an item it cannot find

    answer = proxy.post("/v1/chat/completions", chat(IMAGE_A, text="again"))

    assert answer.status_code == 200
    # Sent once without the media, then with it: the instance encodes the item itself.
    assert media_of(pd.bodies()[-2])[0]["type"] == "image_embeds"
    assert media_of(pd.bodies()[-1]) == [IMAGE_A]
    assert proxy.metric("pd_requests_total", media="retried") == 1
    assert proxy.metric("content_keys_total", outcome="stale") == 1
    # The hint is gone: the next request encodes the image again.
    pd.behaviour.fail_media_free = False
    assert proxy.post("/v1/chat/completions", chat(IMAGE_A)).status_code == 200
    assert encoder_calls(rig) == 2


def test_concurrent_requests_with_one_new_image_make_one_encode(rig: Rig) -> None:
    proxy = rig.start_proxy()
    for encoder in rig.encoders:
        encoder.behaviour.delay_s = 2.0  # every request arrives while the first encodes
    answers: list[httpx.Response] = []

    def send(text: str) -> None:
        answers.append(proxy.post("/v1/chat/completions", chat(IMAGE_A, text=text)))

    threads = [threading.Thread(target=send, args=(f"q{i}",)) for i in range(3)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(20)

    assert [a.status_code for a in answers] == [200, 200, 200]
    assert encoder_calls(rig) == 1
    h = stub_mm_hash(IMAGE_A)
    assert all(h in body["ec_transfer_params"] for body in rig.prefill_decode[0].bodies())
    assert proxy.metric("encoder_calls_saved_total") == 2
    assert proxy.metric("route_total", reason="mixed") == 2


def test_a_worker_that_waited_for_another_workers_encode_reuses_its_item(rig: Rig) -> None:
    """Two workers (two proxies sharing one flight table, as the supervisor links them):
    the one that waited learns the item too, so its next request with the image skips
    the encoders."""
    first, second = rig.start_proxy(route_headers=True), rig.start_proxy(route_headers=True)
    flights = SingleFlight()
    feeds = with_directory(first)
    for proxy in (first, second):
        proxy.proxy.router.flights = flights
        proxy.proxy.router.directory = feeds.directory
    for encoder in rig.encoders:
        encoder.behaviour.delay_s = 1.0
    answers: dict[str, httpx.Response] = {}

    def send(proxy: ProxyUnderTest, name: str) -> None:
        answers[name] = proxy.post("/v1/chat/completions", chat(IMAGE_A, text=name))

    leader = threading.Thread(target=send, args=(first, "lead"))
    leader.start()
    wait_until(lambda: encoder_calls(rig) == 1 or len(flights) == 1, "the first encode began")
    send(second, "wait")
    leader.join(20)
    assert answers["lead"].status_code == answers["wait"].status_code == 200
    assert "reason=mixed" in answers["wait"].headers[ROUTE_HEADER]  # it waited for the lead
    feeds.store(rig.encoder_urls[0], stub_mm_hash(IMAGE_A), encoder=True)

    again = second.post("/v1/chat/completions", chat(IMAGE_A, text="again"))

    assert again.status_code == 200
    assert "reason=held" in again.headers[ROUTE_HEADER]
    assert encoder_calls(rig) == 1


def test_every_proxy_sends_a_new_content_to_the_same_encoder(rig: Rig) -> None:
    proxies = [rig.start_proxy(), rig.start_proxy()]  # as two workers, each its own memory
    # The encoders' addresses (free ports) are hashed with each content: with 8 contents all
    # landed on one encoder in 1 run of 128 by chance; with 32, in 1 of 2 billion.
    images = [
        {"type": "image_url", "image_url": {"url": f"data:image/png;base64,{i:04d}"}}
        for i in range(32)
    ]
    for image in images:
        for proxy in proxies:
            assert proxy.post("/v1/chat/completions", chat(image)).status_code == 200
    where = [
        [
            i
            for i, stub in enumerate(rig.encoders)
            if image in (p for b in stub.bodies() for p in media_of(b))
        ]
        for image in images
    ]
    assert all(len(encoders) == 1 for encoders in where), where  # both calls, one encoder
    assert {encoders[0] for encoders in where} == {0, 1}  # and the contents spread


def test_a_content_whose_encoder_is_out_of_rotation_goes_by_load(rig: Rig) -> None:
    proxy = rig.start_proxy()
    proxy.post("/v1/chat/completions", chat(IMAGE_A))
    home = next(i for i, stub in enumerate(rig.encoders) if stub.bodies())
    proxy.proxy.encoders.backends[home].healthy = False
    answer = proxy.post("/v1/chat/completions", chat(IMAGE_A, text="again"))
    assert answer.status_code == 200
    assert len(rig.encoders[1 - home].bodies()) == 1


def test_routing_load_sends_every_media_part_to_an_encoder(rig: Rig) -> None:
    proxy = rig.start_proxy(route_headers=True, routing="load")
    feeds = with_directory(proxy)
    feeds.store(rig.encoder_urls[0], stub_mm_hash(IMAGE_A), encoder=True)
    feeds.store(rig.encoder_urls[1], stub_mm_hash(IMAGE_A), encoder=True)
    answers = [proxy.post("/v1/chat/completions", chat(IMAGE_A)) for _ in range(2)]
    assert encoder_calls(rig) == 2
    assert [len(stub.bodies()) for stub in rig.encoders] == [1, 1]  # by load, in turn
    assert all("reason=load;items_held=0/1" in a.headers[ROUTE_HEADER] for a in answers)
    assert proxy.metric("route_total", reason="load") == 2
    assert proxy.metric("encoder_calls_saved_total") == 0


def test_a_chats_later_turns_land_where_its_earlier_image_is(rig: Rig) -> None:
    extra = StubBackend(PREFILL_DECODE)
    started = rig.loop.run(serve_stubs([extra]))
    rig._runners.extend(runner for runner, _ in started)
    pd_urls = (rig.pd_urls[0], started[0][1])
    stubs = {pd_urls[0]: rig.prefill_decode[0], pd_urls[1]: extra}
    proxy = rig.start_proxy(route_headers=True, prefill_decode=pd_urls)
    feeds = with_directory(proxy)
    turns: list[dict[str, Any]] = [
        {"role": "user", "content": [IMAGE_A, {"type": "text", "text": "t0"}]}
    ]
    first = proxy.post("/v1/chat/completions", {"model": "stub-model", "messages": turns})
    home = first.headers[ROUTE_HEADER].split(";")[0].removeprefix("pd=")
    feeds.store(home, stub_mm_hash(IMAGE_A))  # fetched into its region: its event
    for t in range(1, 5):
        turns = [
            *turns,
            {"role": "assistant", "content": "ok"},
            {"role": "user", "content": [{"type": "text", "text": f"t{t}"}]},
        ]
        answer = proxy.post("/v1/chat/completions", {"model": "stub-model", "messages": turns})
        assert answer.headers[ROUTE_HEADER] == f"pd={home};reason=held;items_held=1/1"
    assert len(stubs[home].bodies()) == 5
    assert [u for u in pd_urls if u != home and stubs[u].bodies()] == []


def test_params_an_encoder_gets_wrong_are_counted_and_left_to_prefill_decode(rig: Rig) -> None:
    async def bad_encoder(request: web.Request) -> web.Response:
        answer = encoder_answer(msgspec.json.decode(await request.read()))
        for where in answer["ec_transfer_params"].values():
            where["region_address"] = 0x7F0000000000  # not a field of the schema
        return json_response(answer)

    async def health(_request: web.Request) -> web.Response:
        return web.Response()

    app = web.Application()
    app.router.add_post("/v1/chat/completions", bad_encoder)
    app.router.add_get("/health", health)
    started = rig.loop.run(serve_apps([app]))
    rig._runners.extend(runner for runner, _ in started)
    proxy = rig.start_proxy(encoders=(started[0][1],))

    answer = proxy.post("/v1/chat/completions", chat(IMAGE_A))

    assert answer.status_code == 200
    sent = rig.prefill_decode[0].bodies()[-1]
    assert "ec_transfer_params" not in sent and media_of(sent) == [IMAGE_A]
    assert proxy.metric("encoder_fallbacks_total", reason="params") == 1
