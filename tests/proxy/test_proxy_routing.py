"""Where a request's parts go: media to the encoders, one item per call, then prefill/decode."""

from __future__ import annotations

from proxy_stubs import stub_mm_hash
from proxy_testing import AUDIO, IMAGE_A, IMAGE_B, VIDEO, Rig, chat

from ecshare.apps.proxy.fanout import encoder_request, media_parts

CHAT = "/v1/chat/completions"


def _media_in(body: dict) -> list[dict]:
    return [p for m in body["messages"] for p in m["content"] if p["type"] != "text"]


def test_each_media_item_goes_alone_to_an_encoder_and_params_merge_by_mm_hash(rig: Rig) -> None:
    proxy = rig.start_proxy()
    answer = proxy.openai().chat.completions.create(**chat(IMAGE_A, IMAGE_B, AUDIO, VIDEO))
    assert answer.choices[0].message.content == "ok"

    calls = [body for stub in rig.encoders for body in stub.bodies()]
    assert sorted(len(_media_in(b)) for b in calls) == [1, 1, 1, 1]
    assert all(b["max_tokens"] == 1 and b["stream"] is False for b in calls)
    (forwarded,) = rig.prefill_decode[0].bodies()
    expected = {stub_mm_hash(p) for p in (IMAGE_A, IMAGE_B, AUDIO, VIDEO)}
    assert set(forwarded["ec_transfer_params"]) == expected
    assert proxy.metric("encoder_items_total", outcome="ok") == 4


def test_media_items_are_spread_across_encoder_instances(rig: Rig) -> None:
    proxy = rig.start_proxy()
    for _ in range(3):
        proxy.openai().chat.completions.create(**chat(IMAGE_A, IMAGE_B))
    assert [len(stub.bodies()) for stub in rig.encoders] == [3, 3]


def test_the_same_item_twice_in_a_request_is_encoded_once(rig: Rig) -> None:
    proxy = rig.start_proxy()
    proxy.openai().chat.completions.create(**chat(IMAGE_A, IMAGE_A))
    assert sum(len(stub.bodies()) for stub in rig.encoders) == 1
    (forwarded,) = rig.prefill_decode[0].bodies()
    # both places the item takes in the prompt stay, each as the item's metadata
    h = stub_mm_hash(IMAGE_A)
    stand_in = {"type": "image_embeds", "image_embeds": {"image_grid_thw": [1, 2, 2]}, "uuid": h}
    assert _media_in(forwarded) == [stand_in, stand_in]
    assert forwarded["ec_transfer_params"][h]["item_indices"] == [0]


def test_encoder_batch_sends_several_items_per_call(rig: Rig) -> None:
    proxy = rig.start_proxy(encoder_batch_size=2)
    proxy.openai().chat.completions.create(**chat(IMAGE_A, IMAGE_B, AUDIO))
    calls = [body for stub in rig.encoders for body in stub.bodies()]
    assert sorted(len(_media_in(b)) for b in calls) == [1, 2]
    (forwarded,) = rig.prefill_decode[0].bodies()
    assert len(forwarded["ec_transfer_params"]) == 3


def test_request_without_media_goes_straight_to_prefill_decode_unchanged(rig: Rig) -> None:
    proxy = rig.start_proxy()
    body = chat(text="hello", temperature=0.5, some_future_field={"x": [1, 2]})
    response = proxy.post(CHAT, body)
    assert response.status_code == 200
    assert all(not stub.calls for stub in rig.encoders)
    assert rig.prefill_decode[0].bodies() == [body]


def test_processor_options_and_unknown_fields_reach_both_stages_untouched(rig: Rig) -> None:
    proxy = rig.start_proxy()
    options = {
        "mm_processor_kwargs": {"max_pixels": 200704, "fps": 2},
        "media_io_kwargs": {"video": {"num_frames": 8}},
        "chat_template_kwargs": {"enable_thinking": False},
        "some_future_field": {"nested": [1, "two", None]},
    }
    body = chat(IMAGE_A, max_tokens=7, temperature=0.1, **options)
    assert proxy.post(CHAT, body).status_code == 200

    (encoded,) = [b for stub in rig.encoders for b in stub.bodies()]
    for key, value in options.items():
        assert encoded[key] == value
    (forwarded,) = rig.prefill_decode[0].bodies()
    params = forwarded.pop("ec_transfer_params")
    assert forwarded == body
    # the encoder hashed the item with the same processor options prefill/decode will use
    assert set(params) == {stub_mm_hash(IMAGE_A, options["mm_processor_kwargs"])}


def test_encoder_call_leaves_out_only_what_steers_decoding() -> None:
    body = chat(
        IMAGE_A,
        stream=True,
        max_tokens=100,
        n=2,
        tools=[{"type": "function", "function": {"name": "f"}}],
        response_format={"type": "json_object"},
        request_id="abc",
        mm_processor_kwargs={"max_pixels": 1},
        unknown={"kept": True},
    )
    request = encoder_request(body, media_parts(body))
    assert request == {
        "model": "stub-model",
        "messages": [{"role": "user", "content": [IMAGE_A]}],
        "max_tokens": 1,
        "stream": False,
        "mm_processor_kwargs": {"max_pixels": 1},
        "unknown": {"kept": True},
    }


def test_media_parts_of_every_kind_are_found_in_every_message() -> None:
    embeds = {"type": "image_embeds", "image_embeds": "Zm9v"}
    audio_url = {"type": "audio_url", "audio_url": {"url": "https://example.com/a.wav"}}
    body = {
        "messages": [
            {"role": "system", "content": "plain text"},
            {"role": "user", "content": [IMAGE_A, {"type": "text", "text": "x"}, AUDIO]},
            {"role": "assistant", "content": None},
            {"role": "user", "content": [VIDEO, embeds, audio_url, "not a part"]},
        ]
    }
    assert media_parts(body) == [IMAGE_A, AUDIO, VIDEO, embeds, audio_url]
    assert media_parts({"messages": "nonsense"}) == []


def test_completions_go_straight_to_prefill_decode(rig: Rig) -> None:
    proxy = rig.start_proxy()
    answer = proxy.openai().completions.create(model="stub-model", prompt="hi", max_tokens=3)
    assert answer.choices[0].text == "ok"
    (forwarded,) = rig.prefill_decode[0].bodies("/v1/completions")
    assert forwarded["prompt"] == "hi"
    assert all(not stub.calls for stub in rig.encoders)


def test_request_id_reaches_every_backend(rig: Rig) -> None:
    proxy = rig.start_proxy()
    proxy.post(CHAT, chat(IMAGE_A), headers={"X-Request-Id": "req-42"})
    (encoder_call,) = [c for stub in rig.encoders for c in stub.calls]
    (pd_call,) = rig.prefill_decode[0].calls
    assert encoder_call.headers["x-request-id"].startswith("req-42-enc")
    assert pd_call.headers["x-request-id"] == "req-42"


def test_ids_the_proxy_makes_share_its_prefix_and_count_nothing(rig: Rig) -> None:
    # A counter in the id would tell a caller how many requests others sent meanwhile.
    proxy = rig.start_proxy()
    for _ in range(3):
        proxy.post(CHAT, chat(IMAGE_A))
    ids = [call.headers["x-request-id"] for call in rig.prefill_decode[0].calls]
    assert len(ids) == 3 and len(set(ids)) == 3
    prefixes = {i.rsplit("-", 1)[0] for i in ids}
    tails = [i.rsplit("-", 1)[1] for i in ids]
    assert len(prefixes) == 1
    assert all(len(tail) == 16 and int(tail, 16) >= 0 for tail in tails)  # 64 random bits


def test_without_encoders_media_goes_to_prefill_decode_and_is_no_fallback(rig: Rig) -> None:
    proxy = rig.start_proxy(encoders=())
    proxy.openai().chat.completions.create(**chat(IMAGE_A))
    (forwarded,) = rig.prefill_decode[0].bodies()
    assert "ec_transfer_params" not in forwarded
    assert proxy.metric("encoder_items_total", outcome="fallback") == 0
