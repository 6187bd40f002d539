"""A routed answer tells its caller nothing of the route unless the operator asks.

`x-ecshare-route` names the prefill/decode instance and says whether the request's media
was held already, and `Server-Timing` says so again by a missing `encode` step: media
another tenant may have sent. Both are sent only with `--route-headers`; the proxy's own
counters say how each request was routed either way.

Real proxy, recording stub backends (`proxy_stubs`); the item directory is the real
`ItemDirectory`, fed through its own `apply` the stored events the instances would send
(`Feeds`)."""

from __future__ import annotations

import httpx
import pytest
from proxy_stubs import stub_mm_hash
from proxy_testing import IMAGE_A, Feeds, ProxyUnderTest, Rig, chat

from ecshare.apps.proxy.routing import ROUTE_HEADER, TIMING_HEADER

CHAT = "/v1/chat/completions"


def new_then_held(rig: Rig, proxy: ProxyUnderTest, stream: bool) -> list[httpx.Response]:
    """Two answers with one image: the first encodes it, the second finds it held."""
    feeds = Feeds()
    proxy.proxy.router.directory = feeds.directory
    first = proxy.post(CHAT, chat(IMAGE_A, stream=stream))
    feeds.store(rig.encoder_urls[0], stub_mm_hash(IMAGE_A), encoder=True)
    second = proxy.post(CHAT, chat(IMAGE_A, text="again", stream=stream))
    assert first.status_code == second.status_code == 200
    # The proxy routed both, and knows the second's item was held.
    assert proxy.metric("route_total", reason="new") == 1
    assert proxy.metric("route_total", reason="held") == 1
    return [first, second]


@pytest.mark.parametrize(("pd_media", "stream"), [("omit", False), ("omit", True), ("keep", False)])
def test_by_default_an_answer_says_nothing_of_its_route_or_timing(
    rig: Rig, pd_media: str, stream: bool
) -> None:
    proxy = rig.start_proxy(pd_media=pd_media)
    for answer in new_then_held(rig, proxy, stream):
        assert ROUTE_HEADER not in answer.headers and TIMING_HEADER not in answer.headers
        shown = " ".join(f"{k}: {v}" for k, v in answer.headers.items())
        assert not any(url in shown for url in [*rig.pd_urls, *rig.encoder_urls]), shown


@pytest.mark.parametrize("stream", [False, True])
def test_with_route_headers_an_answer_names_its_route_and_steps(rig: Rig, stream: bool) -> None:
    proxy = rig.start_proxy(route_headers=True)
    first, second = new_then_held(rig, proxy, stream)
    assert first.headers[ROUTE_HEADER] == f"pd={rig.pd_urls[0]};reason=new;items_held=0/1"
    assert second.headers[ROUTE_HEADER] == f"pd={rig.pd_urls[0]};reason=held;items_held=0/1"
    assert "encode;dur=" in first.headers[TIMING_HEADER]
    assert "encode;dur=" not in second.headers[TIMING_HEADER]
