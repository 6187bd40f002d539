"""Media-free prefill/decode: encoded media reaches prefill/decode as its placeholder metadata only.

Against stub backends (`proxy_stubs`): the stub encoder publishes a
grid for images and videos and nothing for audio, as a model that declares
no audio fields; the stub prefill/decode instance records what reached it,
and can fail metadata-only requests the way vLLM does when a fetch fails.
The same path with real vLLM instances is tests/vllm/test_epd_e2e.py (`media_free_items`)
and tests/vllm/test_media_free_scheduler.py; real vLLM's refusal of mixed raw and
embedded images, which the stub copies, is tested in tests/vllm/test_launch_e2e.py.
"""

from __future__ import annotations

import pytest
from proxy_stubs import stub_mm_hash
from proxy_testing import AUDIO, IMAGE_A, IMAGE_B, VIDEO, Rig, chat

from ecshare.apps.proxy.config import ProxyConfig
from ecshare.apps.proxy.forward import _event_outcome
from ecshare.config import ConfigError

CHAT = "/v1/chat/completions"


def _media_in(body: dict) -> list[dict]:
    return [p for m in body["messages"] for p in m["content"] if p["type"] != "text"]


def _stand_in(part: dict, kind: str = "image_embeds", grid: str = "image_grid_thw") -> dict:
    value = [1, 2, 2] if grid == "image_grid_thw" else [2, 2, 2]
    return {"type": kind, kind: {grid: value}, "uuid": stub_mm_hash(part)}


def test_each_encoded_image_reaches_prefill_decode_as_its_metadata_only(rig: Rig) -> None:
    proxy = rig.start_proxy()
    body = chat(IMAGE_A, IMAGE_B, VIDEO, max_tokens=5)
    assert proxy.post(CHAT, body).json()["choices"][0]["message"]["content"] == "ok"

    (forwarded,) = rig.prefill_decode[0].bodies()
    assert _media_in(forwarded) == [
        _stand_in(IMAGE_A),
        _stand_in(IMAGE_B),
        _stand_in(VIDEO, "video_embeds", "video_grid_thw"),
    ]
    # The stand-ins are keyed by the very mm_hashes the params name; nothing else changed.
    assert set(forwarded.pop("ec_transfer_params")) == {
        stub_mm_hash(p) for p in (IMAGE_A, IMAGE_B, VIDEO)
    }
    assert forwarded["messages"][0]["content"][-1] == {"type": "text", "text": "describe"}
    assert {k: v for k, v in forwarded.items() if k != "messages"} == {
        k: v for k, v in body.items() if k != "messages"
    }
    assert proxy.metric("pd_requests_total", media="omitted") == 1
    assert proxy.metric("pd_requests_total", media="kept") == 0


def test_a_modality_without_declared_metadata_keeps_its_media(rig: Rig) -> None:
    proxy = rig.start_proxy()
    proxy.post(CHAT, chat(IMAGE_A, AUDIO))

    (forwarded,) = rig.prefill_decode[0].bodies()
    assert _media_in(forwarded) == [_stand_in(IMAGE_A), AUDIO]
    assert len(forwarded["ec_transfer_params"]) == 2  # the audio is still fetched
    assert proxy.metric("pd_requests_total", media="kept") == 1


def test_an_image_left_unannounced_keeps_every_image_of_the_request_whole(rig: Rig) -> None:
    # One encoder call (one image each) came back without params. vLLM refuses a request
    # mixing raw images and image embeddings (400), as the stub does: so both images
    # go with their media, the video still as its metadata.
    for encoder in rig.encoders:
        encoder.behaviour.unannounced = frozenset({IMAGE_B["image_url"]["url"]})
    proxy = rig.start_proxy()

    response = proxy.post(CHAT, chat(IMAGE_A, IMAGE_B, VIDEO))

    assert response.status_code == 200, response.text
    (forwarded,) = rig.prefill_decode[0].bodies()
    assert _media_in(forwarded) == [
        IMAGE_A,
        IMAGE_B,
        _stand_in(VIDEO, "video_embeds", "video_grid_thw"),
    ]
    # What was encoded is still fetched: its params go along.
    assert set(forwarded["ec_transfer_params"]) == {stub_mm_hash(p) for p in (IMAGE_A, VIDEO)}
    assert proxy.metric("pd_requests_total", media="kept") == 1


def test_the_stub_refuses_mixed_raw_and_embedded_images_as_vllm_does(rig: Rig) -> None:
    # Real vLLM's refusal: tests/vllm/test_launch_e2e.py's
    # test_real_vllm_refuses_mixed_raw_and_embedded_images.
    # Forwards the parts as the client sent them, embeddings too.
    proxy = rig.start_proxy(pd_media="keep", allow_client_embeds=True, client_uuids="strip")
    mixed = chat(IMAGE_A, max_tokens=5)
    mixed["messages"][0]["content"].insert(0, _stand_in(IMAGE_B))
    response = proxy.post(CHAT, mixed)
    assert response.status_code == 400
    assert "Mixing raw image and embedding inputs" in response.text


def test_pd_media_keep_forwards_the_media_as_sent(rig: Rig) -> None:
    proxy = rig.start_proxy(pd_media="keep")
    proxy.post(CHAT, chat(IMAGE_A, IMAGE_B))

    (forwarded,) = rig.prefill_decode[0].bodies()
    assert _media_in(forwarded) == [IMAGE_A, IMAGE_B]
    assert len(forwarded["ec_transfer_params"]) == 2
    assert proxy.metric("pd_requests_total", media="kept") == 1
    assert proxy.metric("pd_requests_total", media="omitted") == 0


def test_processor_options_keep_the_media(rig: Rig) -> None:
    # vLLM hashes a uuid together with these options: the stand-in would not be keyed by
    # the encoder's mm_hash, so the media must go.
    proxy = rig.start_proxy()
    proxy.post(CHAT, chat(IMAGE_A, mm_processor_kwargs={"max_pixels": 200704}))

    (forwarded,) = rig.prefill_decode[0].bodies()
    assert _media_in(forwarded) == [IMAGE_A]
    assert proxy.metric("pd_requests_total", media="kept") == 1


def test_batched_encoder_calls_match_items_by_item_indices(rig: Rig) -> None:
    proxy = rig.start_proxy(encoder_batch_size=3)
    proxy.post(CHAT, chat(IMAGE_B, AUDIO, IMAGE_A))

    (call,) = [b for stub in rig.encoders for b in stub.bodies()]
    assert _media_in(call) == [IMAGE_B, AUDIO, IMAGE_A]
    (forwarded,) = rig.prefill_decode[0].bodies()
    assert _media_in(forwarded) == [_stand_in(IMAGE_B), AUDIO, _stand_in(IMAGE_A)]


def test_text_only_requests_are_not_counted(rig: Rig) -> None:
    proxy = rig.start_proxy()
    proxy.post(CHAT, chat(text="hello"))
    for media in ("omitted", "kept", "retried"):
        assert proxy.metric("pd_requests_total", media=media) == 0


@pytest.mark.parametrize("stream", [False, True])
def test_a_failed_media_free_request_is_sent_again_with_its_media(
    rig: Rig, stream: bool, caplog: pytest.LogCaptureFixture
) -> None:
    rig.prefill_decode[0].behaviour.fail_media_free = True
    proxy = rig.start_proxy()
    body = chat(IMAGE_A, stream=stream)

    response = proxy.post(CHAT, body)

    assert response.status_code == 200
    if stream:
        assert b'"error"' not in response.content  # the failed attempt never reached the client
        assert response.content.endswith(b"data: [DONE]\n\n")
        assert b"tok0" in response.content
    else:
        assert response.json()["choices"][0]["message"]["content"] == "ok"
    first, second = rig.prefill_decode[0].bodies()
    assert _media_in(first) == [_stand_in(IMAGE_A)]
    assert _media_in(second) == [IMAGE_A]
    assert second["ec_transfer_params"] == first["ec_transfer_params"]
    assert proxy.metric("pd_requests_total", media="omitted") == 1
    assert proxy.metric("pd_requests_total", media="retried") == 1
    # A failed fetch is not the instance's fault: no failure is held against it.
    (backend,) = proxy.proxy.prefill_decode.backends
    assert backend.healthy and backend.failures == 0
    assert any("sending it again with the media" in r.getMessage() for r in caplog.records)


def test_a_request_that_kept_its_media_is_not_retried(rig: Rig) -> None:
    rig.prefill_decode[0].behaviour.status = 500
    proxy = rig.start_proxy(pd_media="keep")
    response = proxy.post(CHAT, chat(IMAGE_A))
    assert response.status_code == 502
    assert len(rig.prefill_decode[0].bodies()) == 1
    assert proxy.metric("pd_requests_total", media="retried") == 0


def test_a_retry_that_fails_too_is_answered_as_any_failure(rig: Rig) -> None:
    rig.prefill_decode[0].behaviour.status = 500
    proxy = rig.start_proxy()
    response = proxy.post(CHAT, chat(IMAGE_A))
    assert response.status_code == 502
    assert len(rig.prefill_decode[0].bodies()) == 2  # once without media, once with
    assert proxy.metric("pd_requests_total", media="retried") == 1


def test_stream_events_are_judged_by_what_they_carry() -> None:
    role = b'data: {"choices":[{"index":0,"delta":{"role":"assistant","content":""}}]}'
    token = b'data: {"choices":[{"index":0,"delta":{"content":"hi"},"finish_reason":null}]}'
    error = b'data: {"error": {"message": "Internal server error", "code": 500}}'
    finish = b'data: {"choices":[{"index":0,"delta":{},"finish_reason":"length"}]}'
    failed = b'data: {"choices":[{"index":0,"delta":{},"finish_reason":"error"}]}'
    assert _event_outcome(role) == "preamble"
    assert _event_outcome(b": keep-alive comment") == "preamble"
    assert _event_outcome(token) == "answer"
    assert _event_outcome(finish) == "answer"
    assert _event_outcome(b"data: [DONE]") == "answer"
    assert _event_outcome(b"data: not json") == "answer"
    assert _event_outcome(error) == "error"
    assert _event_outcome(failed) == "error"


def test_pd_media_must_be_keep_or_omit() -> None:
    assert ProxyConfig(prefill_decode=("http://x",)).pd_media == "omit"
    with pytest.raises(ConfigError, match="--pd-media"):
        ProxyConfig(prefill_decode=("http://x",), pd_media="sometimes")
