"""E→P→D through the proxy (`--prefill ... --decode ...`), against recording stub instances.

The stubs answer as vLLM does with its NixlConnector (KV params from a prefill asked for a
remote decode); the real flow, with real `vllm serve` instances handing KV over NIXL, is
tests/vllm/test_epd_kv_e2e.py.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import httpx
import pytest
from proxy_stubs import ENCODER, PREFILL_DECODE, StubBackend, serve_stubs
from proxy_testing import IMAGE_A, LoopThread, ProxyUnderTest, Rig, chat, dead_url
from waiting import wait_until

from ecshare.apps.proxy.config import ProxyConfig, add_proxy_arguments, config_from_args
from ecshare.apps.proxy.handoff import REMOTE_DECODE
from ecshare.config import ConfigError


@dataclass
class Split:
    rig: Rig
    prefill: list[StubBackend]
    decode: list[StubBackend]
    prefill_urls: list[str]
    decode_urls: list[str]

    def start(self, **overrides: Any) -> ProxyUnderTest:
        values: dict[str, Any] = {
            "prefill_decode": tuple(self.prefill_urls),
            "decode": tuple(self.decode_urls),
        }
        values.update(overrides)
        return self.rig.start_proxy(**values)


@pytest.fixture
def split() -> Iterator[Split]:
    loop = LoopThread()
    encoders = [StubBackend(ENCODER)]
    prefill = [StubBackend(PREFILL_DECODE), StubBackend(PREFILL_DECODE)]
    decode = [StubBackend(PREFILL_DECODE), StubBackend(PREFILL_DECODE)]
    started = loop.run(serve_stubs([*encoders, *prefill, *decode]))
    urls = [url for _, url in started]
    rig = Rig(loop, encoders, [], urls[:1], [], _runners=[r for r, _ in started])
    try:
        yield Split(rig, prefill, decode, urls[1:3], urls[3:])
    finally:
        rig.close()


def _calls(stubs: list[StubBackend], path: str = "/v1/chat/completions") -> list[dict[str, Any]]:
    return [body for stub in stubs for body in stub.bodies(path)]


def test_a_request_is_prefilled_for_one_token_and_decoded_with_the_prefills_kv_params(
    split: Split,
) -> None:
    proxy = split.start()
    body = chat(IMAGE_A, max_tokens=7, stream=True, stream_options={"include_usage": True})
    with httpx.stream("POST", proxy.url + "/v1/chat/completions", json=body, timeout=15) as r:
        assert r.status_code == 200
        assert r.headers["content-type"].startswith("text/event-stream")
        text = "".join(r.iter_text())
    assert "tok0" in text and text.rstrip().endswith("data: [DONE]")

    assert len(split.rig.encoders[0].calls) == 1
    [prefilled] = _calls(split.prefill)
    assert prefilled["max_tokens"] == 1
    assert "stream" not in prefilled and "stream_options" not in prefilled
    assert prefilled["kv_transfer_params"] == REMOTE_DECODE
    [decoded] = _calls(split.decode)
    assert decoded["max_tokens"] == 7 and decoded["stream"] is True
    assert decoded["stream_options"] == {"include_usage": True}
    # The KV params the prefill answered with, as they came.
    kv = decoded["kv_transfer_params"]
    assert kv["do_remote_prefill"] is True and kv["remote_block_ids"] == [1]
    # Neither instance got the media: each had the item as its metadata only, and the
    # encoder's params to fetch it by.
    for sent in (prefilled, decoded):
        part = sent["messages"][0]["content"][0]
        assert part["type"] == "image_embeds" and "uuid" in part
        assert sent["ec_transfer_params"]
    assert proxy.metric("handoffs_total", outcome="decoded") == 1
    assert proxy.metric("pd_requests_total", media="omitted") == 1


def test_an_unstreamed_request_and_a_completion_are_split_too(split: Split) -> None:
    proxy = split.start()
    answer = proxy.openai().chat.completions.create(
        model="stub-model", messages=[{"role": "user", "content": "hi"}], max_tokens=3
    )
    assert answer.choices[0].message.content == "ok"
    r = proxy.post("/v1/completions", {"model": "stub-model", "prompt": "hi", "max_tokens": 4})
    assert r.status_code == 200 and r.json()["choices"][0]["text"] == "ok"
    [prefilled] = _calls(split.prefill, "/v1/completions")
    assert prefilled["max_tokens"] == 1 and prefilled["kv_transfer_params"] == REMOTE_DECODE
    [decoded] = _calls(split.decode, "/v1/completions")
    assert decoded["max_tokens"] == 4 and decoded["kv_transfer_params"]["do_remote_prefill"]
    assert proxy.metric("handoffs_total", outcome="decoded") == 2


@pytest.mark.parametrize("where", ["top_level", "vllm_xargs"])
def test_a_clients_own_kv_params_reach_no_instance(split: Split, where: str) -> None:
    forged = {"do_remote_prefill": True, "remote_block_ids": [0, 1, 2], "remote_host": "x"}
    if where == "top_level":
        body = chat(text="hello", kv_transfer_params=forged)
    else:
        body = chat(text="hello", vllm_xargs={"kv_transfer_params": forged, "other": 1})
    proxy = split.start()
    assert proxy.post("/v1/chat/completions", body).status_code == 200
    [prefilled] = _calls(split.prefill)
    [decoded] = _calls(split.decode)
    assert prefilled["kv_transfer_params"] == REMOTE_DECODE
    assert decoded["kv_transfer_params"]["remote_block_ids"] == [1]
    for sent in (prefilled, decoded):
        assert "kv_transfer_params" not in sent.get("vllm_xargs", {})
    assert proxy.metric("client_params_dropped_total") == 1


def test_a_clients_kv_params_are_dropped_with_pd_as_well(rig: Rig) -> None:
    proxy = rig.start_proxy(pass_ec_transfer_params=True)
    body = chat(text="hello", kv_transfer_params={"remote_block_ids": [3]})
    assert proxy.post("/v1/chat/completions", body).status_code == 200
    [sent] = rig.prefill_decode[0].bodies()
    assert "kv_transfer_params" not in sent


def test_a_failed_prefill_goes_to_another_with_its_media(split: Split) -> None:
    split.prefill[0].behaviour.status = 500
    split.prefill[1].behaviour.status = 500
    proxy = split.start(eject_after_failures=100)
    r = proxy.post("/v1/chat/completions", chat(IMAGE_A))
    assert r.status_code == 502  # both failed: the last failure, naming its instance
    assert "prefill instance" in r.json()["error"]["message"]
    assert len(_calls(split.prefill)) == 2 and _calls(split.decode) == []

    split.prefill[1].behaviour.status = 200
    for stub in split.prefill:
        stub.calls.clear()
    for _ in range(4):
        r = proxy.post("/v1/chat/completions", chat(IMAGE_A))
        assert r.status_code == 200
    failed, answered = split.prefill[0].bodies(), split.prefill[1].bodies()
    assert failed  # taken in turn: some went to the failing one first
    # Each request the failing instance had went on to the other, with its media.
    with_media = [b for b in answered if b["messages"][0]["content"][0] == IMAGE_A]
    assert len(with_media) == len(failed)
    assert len(_calls(split.decode)) == 4
    assert proxy.metric("handoffs_total", outcome="prefill_retried") == 2 + len(failed)
    assert proxy.metric("pd_requests_total", media="retried") == 1 + len(failed)


def test_a_prefill_4xx_is_the_clients_answer(split: Split) -> None:
    for stub in split.prefill:
        stub.behaviour.status = 400
    proxy = split.start()
    r = proxy.post("/v1/chat/completions", chat(text="hi"))
    assert r.status_code == 400 and r.json()["error"]["message"] == "stub failure"
    assert _calls(split.decode) == []
    assert len(_calls(split.prefill)) == 1


def test_a_prefill_without_a_kv_connector_is_a_502_that_names_the_fix(split: Split) -> None:
    for stub in split.prefill:
        stub.behaviour.kv_producer = False
    proxy = split.start()
    r = proxy.post("/v1/chat/completions", chat(text="hi"))
    assert r.status_code == 502
    assert "--kv-transfer-config" in r.json()["error"]["message"]
    assert _calls(split.decode) == []
    assert proxy.metric("handoffs_total", outcome="no_kv_params") == 1


def test_a_failed_decode_is_prefilled_again_and_decoded_elsewhere(split: Split) -> None:
    split.decode[0].behaviour.status = 500
    split.decode[1].behaviour.delay_s = 0.3  # so the first pick is decode[0], the idle one
    proxy = split.start(prefill_decode=(split.prefill_urls[0],), eject_after_failures=10)
    proxy.proxy.decode.backends[1].in_flight = 1  # busier: decode[0] is picked first
    r = proxy.post("/v1/chat/completions", chat(IMAGE_A, max_tokens=5))
    proxy.proxy.decode.backends[1].in_flight = 0
    assert r.status_code == 200
    first, second = _calls(split.decode[:1]), _calls(split.decode[1:])
    assert len(first) == 1 and len(second) == 1
    # Never decoded twice from one prefill's KV params: the request was prefilled again.
    assert len(_calls(split.prefill)) == 2
    assert first[0]["kv_transfer_params"] != second[0]["kv_transfer_params"]
    assert second[0]["messages"][0]["content"][0] == IMAGE_A  # and with its media
    assert proxy.metric("handoffs_total", outcome="decode_retried") == 1


def test_a_dead_decode_instance_is_passed_over(split: Split) -> None:
    proxy = split.start(decode=(dead_url(), split.decode_urls[0]))
    for _ in range(3):
        r = proxy.post("/v1/chat/completions", chat(text="hi", max_tokens=2))
        assert r.status_code == 200
    assert len(_calls(split.decode[:1])) == 3


def test_n_above_one_is_refused(split: Split) -> None:
    proxy = split.start()
    r = proxy.post("/v1/chat/completions", chat(text="hi", n=2))
    assert r.status_code == 400 and "n=2" in r.json()["error"]["message"]
    assert _calls(split.prefill) == []


def test_health_needs_a_prefill_and_a_decode_instance_in_rotation(split: Split) -> None:
    proxy = split.start(decode=(dead_url(),))
    wait_until(lambda: proxy.get("/health").status_code == 503, timeout_s=10)
    health = proxy.get("/health").json()
    assert [b["healthy"] for b in health["decode"]] == [False]
    assert all(b["healthy"] for b in health["prefill_decode"])
    r = proxy.post("/v1/chat/completions", chat(text="hi"))
    assert r.status_code == 503 and "no decode instance" in r.json()["error"]["message"]
    assert _calls(split.prefill) == []  # no prefill instance holds KV for nobody
    assert proxy.get("/v1/models").status_code == 503


def _args(*argv: str) -> ProxyConfig:
    import argparse

    parser = argparse.ArgumentParser()
    add_proxy_arguments(parser)
    return config_from_args(parser.parse_args(list(argv)), environ={})


def test_prefill_and_decode_flags() -> None:
    c = _args("--prefill", "http://p1:1=p1", "http://p2:2", "--decode", "http://d:3")
    assert c.prefill_decode == ("http://p1:1", "http://p2:2")
    assert c.pd_push_names == ("p1", "")
    assert c.decode == ("http://d:3",)
    with pytest.raises(ConfigError, match=r"--prefill.*not both"):
        _args("--pd", "http://a:1", "--prefill", "http://p:1", "--decode", "http://d:1")
    with pytest.raises(ConfigError, match="go together"):
        _args("--prefill", "http://p:1")
    with pytest.raises(ConfigError, match="not both"):
        _args("--pd", "http://a:1", "--decode", "http://d:1")
    with pytest.raises(ConfigError, match="not both"):
        _args("--pd", "http://a:1", "--discover-pd", "p:1", "--decode", "http://d:1")
    found = _args("--discover-pd", "prefill:8000", "--discover-decode", "decode:8000")
    assert found.split and found.decode == () and found.discover_decode == "decode:8000"
    with pytest.raises(ConfigError, match="--discover-decode"):
        _args("--prefill", "http://p:1", "--discover-decode", "decode")
    with pytest.raises(ConfigError, match="--decode"):
        _args("--prefill", "http://p:1", "--decode", "ftp://d:1")


def test_route_headers_time_the_prefill_and_the_decode(split: Split) -> None:
    proxy = split.start(route_headers=True)
    r = proxy.post("/v1/chat/completions", chat(IMAGE_A, max_tokens=2))
    assert r.status_code == 200
    steps = dict(part.strip().split(";dur=") for part in r.headers["Server-Timing"].split(","))
    assert {"encode", "prefill", "decode"} <= steps.keys() and "pd" not in steps
    assert all(float(ms) >= 0 for ms in steps.values())
    assert split.decode_urls[0] in r.headers["x-ecshare-route"] or (
        split.decode_urls[1] in r.headers["x-ecshare-route"]
    )


def test_decode_instances_join_by_dns_and_by_registration(split: Split) -> None:
    """Scaling decode is one edit: instances found under a DNS name, or registered."""
    from ecshare.apps.proxy.backends import DECODE

    admin = "an-admin-key-of-some-length"
    proxy = split.start(decode=(split.decode_urls[0],), admin_key=admin)
    membership = proxy.proxy.membership
    assert membership is not None and membership.serves(DECODE)
    headers = {"Authorization": f"Bearer {admin}"}
    added = httpx.post(
        proxy.url + "/v1/members",
        json={"role": "decode", "url": split.decode_urls[1]},
        headers=headers,
        timeout=10,
    )
    assert added.status_code == 200 and added.json() == {"joined": True}
    assert [b.url for b in proxy.proxy.decode.backends] == split.decode_urls
    for _ in range(4):
        assert proxy.post("/v1/chat/completions", chat(text="hi")).status_code == 200
    assert all(stub.calls for stub in split.decode)  # both decode by load

    # A proxy without decode instances refuses the role, and counts it.
    plain = split.rig.start_proxy(prefill_decode=(split.prefill_urls[0],), admin_key=admin)
    refused = httpx.post(
        plain.url + "/v1/members",
        json={"role": "decode", "url": split.decode_urls[1]},
        headers=headers,
        timeout=10,
    )
    assert refused.status_code == 400 and "no decode instances" in refused.text

    # DNS: the name's addresses become the decode pool.
    found = split.start(
        decode=(), discover_decode="localhost:" + split.decode_urls[1].rsplit(":", 1)[1]
    )
    wait_until(lambda: len(found.proxy.decode.backends) >= 1, timeout_s=15)
    wait_until(lambda: found.get("/health").status_code == 200, timeout_s=15)
    assert found.post("/v1/chat/completions", chat(text="hi")).status_code == 200
