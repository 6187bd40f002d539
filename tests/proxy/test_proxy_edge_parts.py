"""Content parts a client may not send as it likes: uuids, embeddings, too many items.

Each refusal is a 400 naming the field and the option that changes it, counted by reason,
before any backend sees the request; the uuids the proxy lets through (stripped, or
scoped to the tenant) reach the encoders and prefill/decode alike.
"""

from __future__ import annotations

from typing import Any

import httpx
import pytest
from proxy_testing import AUDIO, IMAGE_A, IMAGE_B, VIDEO, ProxyUnderTest, Rig, chat

from ecshare.apps.proxy.tenants import SALT_FIELD, scoped_uuid, tenant_salt

CHAT = "/v1/chat/completions"
KEYS = {"key-of-team-a-0123": "team-a", "key-of-team-b-0123": "team-b"}
SECRET = "a-tenant-secret-of-32-characters-or-more"
AS = {tenant: {"Authorization": f"Bearer {key}"} for key, tenant in KEYS.items()}


def with_uuid(part: dict[str, Any], uuid: Any) -> dict[str, Any]:
    return {**part, "uuid": uuid}


def uuids(bodies: list[dict[str, Any]]) -> list[Any]:
    return [
        part.get("uuid")
        for body in bodies
        for message in body["messages"]
        for part in message["content"]
        if "uuid" in part
    ]


def nothing_reached_a_backend(rig: Rig) -> bool:
    return not any(stub.calls for stub in [*rig.encoders, *rig.prefill_decode])


def refused_with(proxy: ProxyUnderTest, body: dict[str, Any], reason: str, *needles: str) -> None:
    """`body` is refused with a 400 whose message holds `needles`, counted under `reason`."""
    before = proxy.metric("rejected_total", reason=reason)
    response = proxy.post(CHAT, body)
    assert response.status_code == 400, response.text
    message = response.json()["error"]["message"]
    for needle in needles:
        assert needle in message
    assert proxy.metric("rejected_total", reason=reason) == before + 1


# -- client uuids ----------------------------------------------------------------------------


def test_a_client_uuid_is_refused_by_default_naming_the_field_and_the_option(rig: Rig) -> None:
    proxy = rig.start_proxy()
    body = chat(IMAGE_A, with_uuid(IMAGE_B, "0" * 64))
    refused_with(proxy, body, "client_uuid", "messages[0].content[1].uuid", "--client-uuids")
    assert nothing_reached_a_backend(rig)


@pytest.mark.parametrize(
    ("part", "reason"),
    [
        ({"type": "text", "text": "hi", "uuid": "u", "image_url": {"url": "x"}}, "client_uuid"),
        ({"image_url": {"url": "https://example.com/a.png"}, "uuid": "u"}, "client_uuid"),
        ({"type": "text", "text": "hi", "uuid": "u", "image_embeds": "AAAA"}, "client_embeds"),
        ({"image_embeds": {"image_grid_thw": [1, 2, 2]}}, "client_embeds"),
    ],
    ids=["typed_text_with_uuid", "untyped_with_uuid", "typed_text_embeds", "untyped_embeds"],
)
def test_parts_are_read_as_vllm_reads_them_not_by_their_type(
    rig: Rig, part: dict[str, Any], reason: str
) -> None:
    proxy = rig.start_proxy()
    refused_with(proxy, chat(part), reason)
    assert nothing_reached_a_backend(rig)


@pytest.mark.parametrize("mode", ["refuse", "strip", "tenant"])
@pytest.mark.parametrize("uuid", ["u" * 257, 7, ""], ids=["too_long", "not_a_string", "empty"])
def test_a_bad_uuid_is_refused_in_every_mode(rig: Rig, mode: str, uuid: Any) -> None:
    proxy = rig.start_proxy(client_uuids=mode)
    refused_with(proxy, chat(with_uuid(IMAGE_A, uuid)), "bad_uuid", "--max-uuid-chars")
    assert nothing_reached_a_backend(rig)


def test_stripped_uuids_reach_no_instance_and_are_counted(rig: Rig) -> None:
    proxy = rig.start_proxy(client_uuids="strip", pd_media="keep")
    body = chat(with_uuid(IMAGE_A, "a"), with_uuid(IMAGE_B, "b"))
    assert proxy.post(CHAT, body).status_code == 200
    sent = [b for stub in [*rig.encoders, *rig.prefill_decode] for b in stub.bodies()]
    assert len(sent) == 3 and uuids(sent) == []
    assert proxy.metric("client_uuids_total", action="stripped") == 2


def test_a_tenants_uuid_is_one_key_for_it_and_another_for_another_tenant(rig: Rig) -> None:
    proxy = rig.start_proxy(client_uuids="tenant", api_keys=KEYS, pd_media="keep")
    for tenant in ("team-a", "team-b", "team-a"):
        response = proxy.post(CHAT, chat(with_uuid(IMAGE_A, "mine")), headers=AS[tenant])
        assert response.status_code == 200
    encoded = uuids([b for stub in rig.encoders for b in stub.bodies()])
    a, b = scoped_uuid("team-a", "mine"), scoped_uuid("team-b", "mine")
    assert sorted(encoded) == sorted([a, b, a]) and a != b  # two encoders: any order
    # Prefill/decode gets the same key the encoder did, so that the two agree.
    assert uuids(rig.prefill_decode[0].bodies()) == [a, b, a]
    assert proxy.metric("client_uuids_total", action="scoped") == 3


# -- client embeddings -----------------------------------------------------------------------


@pytest.mark.parametrize("kind", ["image_embeds", "audio_embeds", "video_embeds"])
def test_client_embeddings_are_refused_by_default(rig: Rig, kind: str) -> None:
    proxy = rig.start_proxy()
    for value in ({"image_grid_thw": [1, 2, 2]}, "AAAA"):
        part = {"type": kind, kind: value}
        refused_with(proxy, chat(part), "client_embeds", kind, "--allow-client-embeds")
    assert nothing_reached_a_backend(rig)


def test_prompt_embeds_on_completions_are_refused_by_default(rig: Rig) -> None:
    proxy = rig.start_proxy()
    before = proxy.metric("rejected_total", reason="client_embeds")
    response = proxy.post("/v1/completions", {"model": "m", "prompt_embeds": "AAAA"})
    assert response.status_code == 400
    assert "--allow-client-embeds" in response.json()["error"]["message"]
    assert proxy.metric("rejected_total", reason="client_embeds") == before + 1
    assert nothing_reached_a_backend(rig)


def test_client_embeddings_pass_where_the_operator_trusts_every_client(rig: Rig) -> None:
    proxy = rig.start_proxy(allow_client_embeds=True)
    part = {"type": "image_embeds", "image_embeds": "AAAA"}
    assert proxy.post(CHAT, chat(part)).status_code == 200
    assert rig.prefill_decode[0].bodies()[-1]["messages"][0]["content"][0] == part


# -- media items per request -----------------------------------------------------------------


def test_more_media_items_than_the_limit_are_refused_before_any_encoder_call(rig: Rig) -> None:
    proxy = rig.start_proxy(limit_mm_per_prompt={"image": 2, "video": 0})
    # Every occurrence counts, as vLLM counts them: the same image twice is two items.
    refused_with(proxy, chat(IMAGE_A, IMAGE_B, IMAGE_A), "too_many_parts", "3 image items")
    refused_with(proxy, chat(VIDEO), "too_many_parts", "--limit-mm-per-prompt")
    assert nothing_reached_a_backend(rig)
    # At the limit, and for a modality it does not name (vLLM's 999), it passes.
    assert proxy.post(CHAT, chat(IMAGE_A, IMAGE_B, AUDIO)).status_code == 200


def test_client_embeddings_count_toward_the_media_limit(rig: Rig) -> None:
    # As vLLM counts them: an `image_embeds` part is an image item, trusted or not.
    proxy = rig.start_proxy(allow_client_embeds=True, limit_mm_per_prompt={"image": 2})
    embeds = {"type": "image_embeds", "image_embeds": "AAAA"}
    refused_with(proxy, chat(IMAGE_A, IMAGE_B, embeds), "too_many_parts", "3 image items")
    refused_with(proxy, chat(embeds, embeds, embeds), "too_many_parts", "3 image items")
    assert nothing_reached_a_backend(rig)
    assert proxy.post(CHAT, chat(IMAGE_A, embeds)).status_code == 200


def test_the_media_limit_defaults_to_vllms(rig: Rig) -> None:
    proxy = rig.start_proxy()
    many = [{"type": "image_url", "image_url": {"url": f"https://e.com/{i}"}} for i in range(1000)]
    refused_with(proxy, chat(*many), "too_many_parts", "999")
    assert nothing_reached_a_backend(rig)


# -- tenant isolation ------------------------------------------------------------------------


def test_with_tenant_isolation_each_tenant_salts_what_the_encoders_hash(rig: Rig) -> None:
    proxy = rig.start_proxy(tenant_isolation=True, api_keys=KEYS, tenant_secret=SECRET)
    for tenant in ("team-a", "team-b"):
        response = proxy.post(CHAT, chat(IMAGE_A, AUDIO), headers=AS[tenant])
        assert response.status_code == 200
    encoded = [body for stub in rig.encoders for body in stub.bodies()]
    assert len(encoded) == 4
    salts = {
        tuple(body["media_io_kwargs"][modality][SALT_FIELD] for modality in ("image", "audio"))
        for body in encoded
    }
    salt_a, salt_b = tenant_salt(SECRET, "team-a"), tenant_salt(SECRET, "team-b")
    assert salts == {(salt_a, salt_a), (salt_b, salt_b)}
    # Media-free, prefill/decode takes the encoder's (salted) key as the image's uuid,
    # unsalted; the audio keeps its media (the stub gives it no metadata), salted.
    for body, salt in zip(rig.prefill_decode[0].bodies(), (salt_a, salt_b), strict=True):
        assert body["messages"][0]["content"][0]["type"] == "image_embeds"
        assert body["media_io_kwargs"] == {"audio": {SALT_FIELD: salt}}


def test_with_tenant_isolation_kept_media_is_salted_as_the_encoder_was(rig: Rig) -> None:
    proxy = rig.start_proxy(
        tenant_isolation=True, api_keys=KEYS, pd_media="keep", tenant_secret=SECRET
    )
    assert proxy.post(CHAT, chat(IMAGE_A), headers=AS["team-b"]).status_code == 200
    (encoded,) = rig.encoders[0].bodies() or rig.encoders[1].bodies()
    (sent,) = rig.prefill_decode[0].bodies()
    assert sent["media_io_kwargs"] == encoded["media_io_kwargs"]
    assert sent["media_io_kwargs"]["image"][SALT_FIELD] == tenant_salt(SECRET, "team-b")


@pytest.mark.parametrize(
    "fields",
    [
        {"media_io_kwargs": {"image": {SALT_FIELD: tenant_salt(SECRET, "team-a")}}},
        {"media_io_kwargs": {"image": 3}},
        {"mm_processor_kwargs": {"max_pixels": 1 << 20}},
    ],
    ids=["forged_salt", "malformed", "processor_kwargs"],
)
def test_with_tenant_isolation_a_clients_own_mm_kwargs_are_refused(
    rig: Rig, fields: dict[str, Any]
) -> None:
    proxy = rig.start_proxy(tenant_isolation=True, api_keys=KEYS, tenant_secret=SECRET)
    before = proxy.metric("rejected_total", reason="client_mm_kwargs")
    response = proxy.post(CHAT, chat(IMAGE_A, **fields), headers=AS["team-b"])
    assert response.status_code == 400
    assert "--tenant-isolation" in response.json()["error"]["message"]
    assert proxy.metric("rejected_total", reason="client_mm_kwargs") == before + 1
    assert nothing_reached_a_backend(rig)


# -- API keys and tenants --------------------------------------------------------------------


def test_each_key_of_the_file_is_accepted_and_others_refused(rig: Rig) -> None:
    proxy = rig.start_proxy(api_keys=KEYS)
    for headers in AS.values():
        assert proxy.post(CHAT, chat(), headers=headers).status_code == 200
    bad = {"Authorization": "Bearer key-of-team-c-0123"}
    assert proxy.post(CHAT, chat(), headers=bad).status_code == 401
    assert proxy.metric("rejected_total", reason="auth") == 1


def test_health_shows_its_backends_only_to_a_caller_with_a_key(rig: Rig) -> None:
    proxy = rig.start_proxy(api_keys=KEYS)
    anonymous = httpx.get(proxy.url + "/health", timeout=15)
    assert anonymous.status_code == 200 and anonymous.json() == {"status": "ok"}
    assert rig.pd_urls[0] not in anonymous.text
    shown = httpx.get(proxy.url + "/health", headers=AS["team-b"], timeout=15)
    assert shown.status_code == 200
    assert [b["url"] for b in shown.json()["prefill_decode"]] == rig.pd_urls
