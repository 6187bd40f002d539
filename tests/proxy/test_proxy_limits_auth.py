"""Limits and the keys: refused before any backend sees the request, OpenAI-shaped; what
names the backends (`/metrics`, `/health`'s details) only for a caller with a key."""

from __future__ import annotations

import httpx
import openai
import pytest
from proxy_testing import IMAGE_A, ProxyUnderTest, Rig, chat

CHAT = "/v1/chat/completions"
KEY = "sk-proxy-test-0123456789"
ADMIN_KEY = "an-admin-key-of-some-length"


def test_oversized_body_is_refused_with_413(rig: Rig) -> None:
    proxy = rig.start_proxy(max_body_bytes=64 * 1024)
    big = chat(text="x" * (200 * 1024))
    response = proxy.post(CHAT, big)
    assert response.status_code == 413
    assert response.json()["error"]["type"] == "invalid_request_error"
    assert not rig.prefill_decode[0].calls
    assert proxy.metric("rejected_total", reason="body_too_large") == 1


def test_oversized_chunked_body_without_length_is_refused_with_413(rig: Rig) -> None:
    proxy = rig.start_proxy(max_body_bytes=64 * 1024)
    chunks = (b"x" * 16384 for _ in range(16))  # no Content-Length: chunked encoding
    response = httpx.post(proxy.url + CHAT, content=chunks, timeout=15)
    assert response.status_code == 413
    assert not rig.prefill_decode[0].calls


def test_body_at_the_limit_is_accepted(rig: Rig) -> None:
    proxy = rig.start_proxy(max_body_bytes=64 * 1024)
    assert proxy.post(CHAT, chat(text="x" * (60 * 1024))).status_code == 200


def test_body_that_is_not_a_json_object_is_refused_with_400(rig: Rig) -> None:
    proxy = rig.start_proxy()
    for content in (b"{not json", b"[1, 2]"):
        response = httpx.post(proxy.url + CHAT, content=content, timeout=15)
        assert response.status_code == 400
        assert response.json()["error"]["type"] == "invalid_request_error"
    assert not rig.prefill_decode[0].calls


def test_wrong_api_key_is_refused_with_401(rig: Rig) -> None:
    proxy = rig.start_proxy(api_key=KEY)
    with pytest.raises(openai.AuthenticationError) as info:
        proxy.openai(api_key=KEY + "x").chat.completions.create(**chat(IMAGE_A))
    assert info.value.status_code == 401
    assert info.value.response.headers["www-authenticate"] == "Bearer"
    assert not rig.prefill_decode[0].calls and not any(s.calls for s in rig.encoders)
    assert proxy.metric("rejected_total", reason="auth") == 1


@pytest.mark.parametrize(
    "header",
    [None, "", "Bearer", f"Basic {KEY}", f"bearer {KEY[:-1]}", f"Bearer {KEY} extra"],
)
def test_missing_or_malformed_api_key_is_refused(rig: Rig, header: str | None) -> None:
    proxy = rig.start_proxy(api_key=KEY)
    headers = {} if header is None else {"Authorization": header}
    for path in ("/v1/models", "/v1/anything"):
        assert httpx.get(proxy.url + path, headers=headers, timeout=15).status_code == 401
    assert httpx.post(proxy.url + CHAT, json=chat(), headers=headers).status_code == 401


def test_right_api_key_is_accepted_and_not_passed_on(rig: Rig) -> None:
    proxy = rig.start_proxy(api_key=KEY)
    answer = proxy.openai().chat.completions.create(**chat(IMAGE_A))
    assert answer.choices[0].message.content == "ok"
    for stub in [*rig.encoders, *rig.prefill_decode]:
        for call in stub.calls:
            assert KEY not in str(call.headers)


def test_health_status_answers_without_the_api_key(rig: Rig) -> None:
    proxy = rig.start_proxy(api_key=KEY)
    assert httpx.get(proxy.url + "/health", timeout=15).status_code == 200


def scrape(proxy: ProxyUnderTest, key: str | None) -> httpx.Response:
    headers = {} if key is None else {"Authorization": f"Bearer {key}"}
    return httpx.get(proxy.url + "/metrics", headers=headers, timeout=15)


def test_metrics_naming_the_backends_need_an_api_key_or_the_admin_key(rig: Rig) -> None:
    proxy = rig.start_proxy(api_keys={KEY: "team-a"}, admin_key=ADMIN_KEY)
    for refused in (scrape(proxy, None), scrape(proxy, KEY + "x"), scrape(proxy, ADMIN_KEY[1:])):
        assert refused.status_code == 401
        assert refused.json()["error"]["type"] == "authentication_error"
        assert rig.pd_urls[0] not in refused.text
    assert proxy.metric("rejected_total", reason="auth") == 3
    for key in (KEY, ADMIN_KEY):
        shown = scrape(proxy, key)
        assert shown.status_code == 200
        assert f'url="{rig.pd_urls[0]}"' in shown.text  # what the key was needed for
        assert 'ecshare_proxy_rejected_total{reason="auth"} 3.0' in shown.text


@pytest.mark.parametrize(
    "keys", [{"api_key": KEY}, {"admin_key": ADMIN_KEY}], ids=["api-key", "admin-key"]
)
def test_with_any_key_set_metrics_and_health_details_need_one(
    rig: Rig, keys: dict[str, str]
) -> None:
    proxy = rig.start_proxy(**keys)
    (key,) = keys.values()
    assert scrape(proxy, None).status_code == 401
    assert scrape(proxy, key).status_code == 200
    anonymous = httpx.get(proxy.url + "/health", timeout=15)
    assert anonymous.status_code == 200 and anonymous.json() == {"status": "ok"}
    bearer = {"Authorization": f"Bearer {key}"}
    shown = httpx.get(proxy.url + "/health", headers=bearer, timeout=15)
    assert [b["url"] for b in shown.json()["prefill_decode"]] == rig.pd_urls


def test_without_keys_metrics_stay_open(rig: Rig) -> None:
    proxy = rig.start_proxy()
    answer = scrape(proxy, None)
    assert answer.status_code == 200 and f'url="{rig.pd_urls[0]}"' in answer.text
    assert proxy.metric("rejected_total", reason="auth") == 0
