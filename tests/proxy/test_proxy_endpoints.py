"""The endpoints besides generation: models, health, metrics, and unknown routes."""

from __future__ import annotations

from proxy_stubs import MODEL
from proxy_testing import IMAGE_A, Rig, chat, dead_url
from waiting import wait_until


def test_models_lists_the_prefill_decode_models(rig: Rig) -> None:
    proxy = rig.start_proxy()
    assert [m.id for m in proxy.openai().models.list()] == [MODEL]


def test_health_reports_every_backend_and_is_ok_while_prefill_decode_is(rig: Rig) -> None:
    dead = dead_url()
    proxy = rig.start_proxy(encoders=(rig.encoder_urls[0], dead), health_interval_s=0.05)
    wait_until(lambda: not proxy.proxy.encoders.backends[1].healthy)
    response = proxy.get("/health")
    assert response.status_code == 200
    report = response.json()
    assert report["status"] == "ok"
    assert [(b["url"], b["healthy"]) for b in report["encoders"]] == [
        (rig.encoder_urls[0], True),
        (dead, False),
    ]
    assert [b["url"] for b in report["prefill_decode"]] == rig.pd_urls

    rig.prefill_decode[0].behaviour.healthy = False
    wait_until(lambda: proxy.get("/health").status_code == 503)
    assert proxy.get("/health").json()["status"] == "unavailable"


def test_metrics_are_prometheus_text_with_the_proxy_counters(rig: Rig) -> None:
    proxy = rig.start_proxy()
    proxy.openai().chat.completions.create(**chat(IMAGE_A))
    response = proxy.get("/metrics")
    assert response.status_code == 200
    assert response.headers["content-type"].startswith("text/plain")
    text = response.text
    assert 'ecshare_proxy_requests_total{endpoint="chat",status="200"} 1.0' in text
    assert 'ecshare_proxy_encoder_items_total{outcome="ok"} 1.0' in text
    assert "ecshare_proxy_request_seconds_bucket" in text
    assert "ecshare_proxy_encode_seconds_count 1.0" in text
    assert 'ecshare_proxy_encoder_fallbacks_total{reason="timeout"} 0.0' in text


def test_unknown_route_and_wrong_method_get_openai_errors(rig: Rig) -> None:
    proxy = rig.start_proxy()
    missing = proxy.get("/v1/nothing")
    assert missing.status_code == 404 and missing.json()["error"]["code"] == 404
    wrong = proxy.get("/v1/chat/completions")
    assert wrong.status_code == 405 and wrong.json()["error"]["code"] == 405
