"""With `--route-headers`, each answer says where the proxy's time went before
prefill/decode (`Server-Timing`); without it, nothing (`test_route_headers`).

Real proxy, recording stub backends (`proxy_stubs`); the item directory is the real
`ItemDirectory`, fed through its own `apply` the stored events the instances would send
(`Feeds`)."""

from __future__ import annotations

import httpx
from proxy_stubs import stub_mm_hash
from proxy_testing import IMAGE_A, Feeds, Rig, chat

from ecshare.apps.bench.serve_client import server_timing
from ecshare.apps.proxy.routing import TIMING_HEADER


def steps_of(answer: httpx.Response) -> dict[str, float]:
    steps = server_timing(answer.headers[TIMING_HEADER])
    assert all(seconds >= 0.0 for seconds in steps.values())
    return steps


def test_a_new_item_is_timed_through_its_encode_and_a_held_one_without(rig: Rig) -> None:
    proxy = rig.start_proxy(route_headers=True)
    feeds = Feeds()
    proxy.proxy.router.directory = feeds.directory
    rig.encoders[0].behaviour.delay_s = rig.encoders[1].behaviour.delay_s = 0.2

    first = proxy.post("/v1/chat/completions", chat(IMAGE_A))
    feeds.store(rig.encoder_urls[0], stub_mm_hash(IMAGE_A), encoder=True)
    second = proxy.post("/v1/chat/completions", chat(IMAGE_A, text="again"))

    assert first.status_code == second.status_code == 200
    new, held = steps_of(first), steps_of(second)
    assert list(new) == ["parse", "key", "lookup", "encode", "render", "pd"]
    assert new["encode"] >= 0.2  # the encoder's answer came no sooner than its delay
    assert list(held) == ["parse", "key", "lookup", "render", "pd"]  # no encoder call


def test_load_routing_times_the_encoder_stage_of_every_request(rig: Rig) -> None:
    proxy = rig.start_proxy(route_headers=True, routing="load")
    rig.encoders[0].behaviour.delay_s = rig.encoders[1].behaviour.delay_s = 0.2
    answers = [proxy.post("/v1/chat/completions", chat(IMAGE_A)) for _ in range(2)]
    for answer in answers:
        steps = steps_of(answer)
        assert list(steps) == ["parse", "lookup", "encode", "render", "pd"]
        assert steps["encode"] >= 0.2


def test_a_request_without_media_carries_no_timing(rig: Rig) -> None:
    proxy = rig.start_proxy(route_headers=True)
    answer = proxy.post(
        "/v1/chat/completions",
        {"model": "stub-model", "messages": [{"role": "user", "content": "hi"}]},
    )
    assert answer.status_code == 200 and TIMING_HEADER not in answer.headers
