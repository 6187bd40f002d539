"""Content keys of media parts, and the bounded memory of the items they name."""

from __future__ import annotations

import math

import pytest
from proxy_testing import AUDIO, IMAGE_A, IMAGE_B, chat

from ecshare.apps.proxy.identity import KnownItems, content_key
from ecshare.apps.proxy.parts import salted
from ecshare.apps.proxy.tenants import scoped_uuid, tenant_salt
from ecshare.protocol import TransferParam

IMAGE_A2 = {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAB"}}


def param(**fields: object) -> TransferParam:
    values: dict[str, object] = {
        "peer": "tcp://127.0.0.1:1",
        "fingerprint": "f",
        "nbytes": 64,
        "dtype": "bfloat16",
        "shape": (4, 8),
    }
    values.update(fields)
    return TransferParam(**values)  # type: ignore[arg-type]


def test_same_inline_bytes_give_one_key_other_bytes_another() -> None:
    body = chat(IMAGE_A)
    assert content_key(IMAGE_A, body) == content_key(dict(IMAGE_A), chat(IMAGE_A, text="other"))
    assert content_key(IMAGE_A, body) != content_key(IMAGE_A2, chat(IMAGE_A2))
    assert len(content_key(IMAGE_A, body) or "") == 64


def test_same_bytes_of_two_tenants_key_apart_under_isolation() -> None:
    plain = chat(IMAGE_A)
    secret = "s" * 32
    one = salted(plain, {"image"}, tenant_salt(secret, "team-a"))
    two = salted(plain, {"image"}, tenant_salt(secret, "team-b"))
    assert content_key(IMAGE_A, one) != content_key(IMAGE_A, two)
    again = salted(plain, {"image"}, tenant_salt(secret, "team-a"))
    assert content_key(IMAGE_A, one) == content_key(IMAGE_A, again)
    # Without isolation there is no salt: one key for everyone, as one mm_hash.
    assert content_key(IMAGE_A, plain) not in (content_key(IMAGE_A, one), None)


def test_scoped_client_uuids_of_two_tenants_key_apart() -> None:
    one = {**IMAGE_A, "uuid": scoped_uuid("team-a", "mine")}
    two = {**IMAGE_A, "uuid": scoped_uuid("team-b", "mine")}
    assert content_key(one, chat(one)) != content_key(two, chat(two))
    assert content_key(one, chat(one)) != content_key(IMAGE_A, chat(IMAGE_A))


def test_processor_options_change_the_key_but_not_their_order() -> None:
    a = chat(IMAGE_A, mm_processor_kwargs={"min_pixels": 1, "max_pixels": 9})
    b = chat(IMAGE_A, mm_processor_kwargs={"max_pixels": 9, "min_pixels": 1})
    c = chat(IMAGE_A, mm_processor_kwargs={"min_pixels": 2, "max_pixels": 9})
    d = chat(IMAGE_A, media_io_kwargs={"image": {"x": 1}})
    assert content_key(IMAGE_A, a) == content_key(IMAGE_A, b)
    keys = {content_key(IMAGE_A, body) for body in (a, c, d, chat(IMAGE_A))}
    assert len(keys) == 4


def test_the_model_changes_the_key() -> None:
    assert content_key(IMAGE_A, chat(IMAGE_A)) != content_key(
        IMAGE_A, {**chat(IMAGE_A), "model": "another"}
    )


def test_a_fetched_url_has_no_key_unless_the_operator_sets_a_ttl() -> None:
    assert content_key(IMAGE_B, chat(IMAGE_B)) is None
    assert content_key(IMAGE_B, chat(IMAGE_B), url_ttl_s=60) is not None


@pytest.mark.parametrize(
    "part",
    [
        {"type": "image_embeds", "image_embeds": "Zm9v"},
        {"type": "image_url", "image_url": {"url": "file:///etc/passwd"}},
        {"type": "image_url", "image_url": {"url": 7}},
        {"type": "input_audio", "input_audio": "UklGRg=="},
        {"type": "text", "text": "data:image/png;base64,AAAA"},
    ],
    ids=["embeds", "file_url", "not_a_url", "audio_not_an_object", "text"],
)
def test_parts_without_inline_media_have_no_key(part: dict[str, object]) -> None:
    assert content_key(part, chat(part)) is None


def test_inline_audio_is_keyed_by_its_data_and_format() -> None:
    mp3 = {"type": "input_audio", "input_audio": {"data": "UklGRg==", "format": "mp3"}}
    other = {"type": "input_audio", "input_audio": {"data": "UklGRh==", "format": "wav"}}
    keys = {content_key(p, chat(p)) for p in (AUDIO, mp3, other)}
    assert None not in keys and len(keys) == 3


def test_known_items_are_bounded_least_recently_used_out_first_and_counted() -> None:
    counted: list[str] = []
    known = KnownItems(2, counted.append)
    known.put("k1", "h1", param())
    known.put("k2", "h2", param())
    assert known.get("k1", 0.0) is not None  # k2 is now the least recently used
    known.put("k3", "h3", param())
    assert len(known) == 2
    assert known.get("k2", 0.0) is None
    assert [known.get(k, 0.0).mm_hash for k in ("k1", "k3")] == ["h1", "h3"]  # type: ignore[union-attr]
    assert counted == ["hit", "evicted", "miss", "hit", "hit"]


def test_a_known_item_expires_at_its_ttl() -> None:
    counted: list[str] = []
    known = KnownItems(4, counted.append)
    known.put("url", "h", param(), expires=10.0)
    known.put("inline", "g", param(), expires=math.inf)
    assert known.get("url", 9.9) is not None
    assert known.get("url", 10.0) is None
    assert known.get("inline", 1e12) is not None
    assert counted == ["hit", "expired", "hit"]


def test_a_stale_key_is_forgotten_only_while_it_names_the_failed_item() -> None:
    counted: list[str] = []
    known = KnownItems(4, counted.append)
    known.put("k", "h-new", param())
    known.stale("k", "h-old")  # a request that used an earlier item under this key
    assert known.get("k", 0.0) is not None
    known.stale("k", "h-new")
    assert known.get("k", 0.0) is None
    assert counted == ["hit", "stale", "miss"]


def test_a_remembered_item_carries_no_push_of_the_request_that_encoded_it() -> None:
    known = KnownItems(4)
    known.put("k", "h", param(pushed_to=("pd0",), metadata={"image_grid_thw": [1, 2, 2]}))
    found = known.get("k", 0.0)
    assert found is not None
    assert found.param.pushed_to == ()
    assert found.param.metadata == {"image_grid_thw": [1, 2, 2]}
