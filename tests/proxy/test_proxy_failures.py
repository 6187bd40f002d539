"""Backend failures: encoders cost only time, prefill/decode failures get honest errors."""

from __future__ import annotations

import time

import openai
import pytest
from proxy_testing import IMAGE_A, IMAGE_B, Rig, chat, dead_url
from waiting import wait_until

CHAT = "/v1/chat/completions"


def _fallbacks(proxy: object) -> float:
    return proxy.metric("encoder_items_total", outcome="fallback")  # type: ignore[attr-defined]


def test_encoder_down_request_goes_to_prefill_decode_without_params(rig: Rig) -> None:
    proxy = rig.start_proxy(encoders=(dead_url(),))
    answer = proxy.openai().chat.completions.create(**chat(IMAGE_A, IMAGE_B))
    assert answer.choices[0].message.content == "ok"
    (forwarded,) = rig.prefill_decode[0].bodies()
    assert "ec_transfer_params" not in forwarded
    assert _fallbacks(proxy) == 2
    reasons = {
        r: proxy.metric("encoder_fallbacks_total", reason=r) for r in ("unreachable", "no_encoder")
    }
    assert sum(reasons.values()) == 2


def test_refused_encoder_is_ejected_at_once_and_its_item_tried_on_another(rig: Rig) -> None:
    dead = dead_url()
    proxy = rig.start_proxy(encoders=(dead, rig.encoder_urls[0]))
    proxy.openai().chat.completions.create(**chat(IMAGE_A))
    assert len(rig.encoders[0].bodies()) == 1
    (forwarded,) = rig.prefill_decode[0].bodies()
    assert len(forwarded["ec_transfer_params"]) == 1
    assert _fallbacks(proxy) == 0
    assert not proxy.proxy.encoders.backends[0].healthy
    assert proxy.metric("backend_up", role="encoder", url=dead) == 0


def test_slow_encoder_times_out_and_the_item_is_encoded_on_prefill_decode(rig: Rig) -> None:
    for stub in rig.encoders:
        stub.behaviour.delay_s = 10
    proxy = rig.start_proxy(encoder_timeout_s=0.3)
    started = time.monotonic()
    answer = proxy.openai().chat.completions.create(**chat(IMAGE_A))
    # Before the encoders' answer: the proxy did not wait for it.
    assert time.monotonic() - started < 10
    assert answer.choices[0].message.content == "ok"
    (forwarded,) = rig.prefill_decode[0].bodies()
    assert "ec_transfer_params" not in forwarded
    assert proxy.metric("encoder_fallbacks_total", reason="timeout") == 1


def test_one_failed_encoder_call_keeps_the_params_of_the_others(rig: Rig) -> None:
    rig.encoders[1].behaviour.status = 500
    proxy = rig.start_proxy()
    proxy.openai().chat.completions.create(**chat(IMAGE_A, IMAGE_B))
    (forwarded,) = rig.prefill_decode[0].bodies()
    assert len(forwarded["ec_transfer_params"]) == 1
    assert proxy.metric("encoder_fallbacks_total", reason="status") == 1


def test_prefill_decode_500_returns_502_with_an_openai_error(rig: Rig) -> None:
    rig.prefill_decode[0].behaviour.status = 500
    proxy = rig.start_proxy()
    with pytest.raises(openai.InternalServerError) as info:
        proxy.openai().chat.completions.create(**chat(IMAGE_A))
    assert info.value.status_code == 502
    error = info.value.response.json()["error"]
    assert error["code"] == 502 and error["type"] == "upstream_error"
    assert "prefill/decode instance" in error["message"] and "500" in error["message"]
    assert proxy.metric("upstream_errors_total", reason="status") == 1


def test_prefill_decode_client_error_is_passed_back_untouched(rig: Rig) -> None:
    rig.prefill_decode[0].behaviour.status = 400
    proxy = rig.start_proxy()
    response = proxy.post(CHAT, chat())
    assert response.status_code == 400
    assert response.json()["error"]["message"] == "stub failure"
    assert proxy.proxy.prefill_decode.backends[0].healthy


def test_silent_prefill_decode_returns_504(rig: Rig) -> None:
    rig.prefill_decode[0].behaviour.delay_s = 10
    proxy = rig.start_proxy(pd_timeout_s=0.3)
    response = proxy.post(CHAT, chat())
    assert response.status_code == 504
    assert response.json()["error"]["type"] == "upstream_timeout"
    wait_until(rig.prefill_decode[0].aborted.is_set)


def test_unreachable_prefill_decode_instance_is_skipped(rig: Rig) -> None:
    proxy = rig.start_proxy(prefill_decode=(dead_url(), rig.pd_urls[0]))
    for _ in range(3):
        assert proxy.post(CHAT, chat()).status_code == 200
    assert len(rig.prefill_decode[0].bodies()) == 3


def test_unreachable_prefill_decode_returns_502_or_503_never_hangs(rig: Rig) -> None:
    proxy = rig.start_proxy(prefill_decode=(dead_url(),))
    first = proxy.post(CHAT, chat())
    # 502 if the request found it first, 503 if the start-up health check did
    assert first.status_code in (502, 503) and first.json()["error"]["code"] == first.status_code
    second = proxy.post(CHAT, chat())
    assert second.status_code == 503
    assert second.json()["error"]["message"] == "no prefill/decode instance is healthy"
    assert proxy.get("/health").status_code == 503


def test_dead_backends_are_ejected_and_recovered_ones_brought_back(rig: Rig) -> None:
    proxy = rig.start_proxy(health_interval_s=0.05)
    first = proxy.proxy.encoders.backends[0]
    url = rig.encoder_urls[0]
    rig.encoders[0].behaviour.healthy = False
    wait_until(lambda: not first.healthy)
    assert proxy.metric("backend_up", role="encoder", url=url) == 0
    proxy.openai().chat.completions.create(**chat(IMAGE_A, IMAGE_B))
    assert [len(stub.bodies()) for stub in rig.encoders] == [0, 2]

    rig.encoders[0].behaviour.healthy = True
    wait_until(lambda: first.healthy)
    assert proxy.metric("backend_up", role="encoder", url=url) == 1
    proxy.openai().chat.completions.create(**chat(IMAGE_A, IMAGE_B))
    assert [len(stub.bodies()) for stub in rig.encoders] == [1, 3]


def test_repeated_failures_eject_a_backend_before_the_next_health_check(rig: Rig) -> None:
    rig.encoders[0].behaviour.status = 503
    proxy = rig.start_proxy(eject_after_failures=2)
    for _ in range(2):  # each request's two items go one to each encoder
        proxy.openai().chat.completions.create(**chat(IMAGE_A, IMAGE_B))
    assert not proxy.proxy.encoders.backends[0].healthy
    proxy.openai().chat.completions.create(**chat(IMAGE_A, IMAGE_B))
    assert [len(stub.bodies()) for stub in rig.encoders] == [2, 4]


def test_repeated_failures_never_eject_the_last_backend_in_rotation(rig: Rig) -> None:
    rig.prefill_decode[0].behaviour.status = 500
    proxy = rig.start_proxy(eject_after_failures=2)
    for _ in range(4):
        assert proxy.post(CHAT, chat()).status_code == 502
    assert proxy.proxy.prefill_decode.backends[0].healthy
    rig.prefill_decode[0].behaviour.status = 200
    assert proxy.post(CHAT, chat()).status_code == 200  # no 503 while waiting for a check


def test_a_request_on_a_connection_its_instance_closed_is_sent_again(rig: Rig) -> None:
    """The instance closes a kept-alive connection as the next request arrives on it (as
    vLLM's server does past its keep-alive): that request never reached it, and is sent
    once more on a new connection, not answered 502."""
    pd = rig.prefill_decode[0]
    pd.behaviour.drop_reused = True
    proxy = rig.start_proxy(encoders=())
    text = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
    for _ in range(3):
        answer = proxy.post(CHAT, text)
        assert answer.status_code == 200, answer.text
    assert pd.dropped >= 1
    assert proxy.metric("upstream_errors_total", reason="resent") == pd.dropped
    assert len(pd.calls) == 3 + pd.dropped
