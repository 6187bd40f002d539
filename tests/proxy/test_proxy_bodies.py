"""How the proxy handles request bodies without decoding and encoding them again."""

from __future__ import annotations

import msgspec

from ecshare.apps.proxy.app import with_params
from ecshare.apps.proxy.fanout import scan_media


def _image(url: str) -> dict:
    return {"type": "image_url", "image_url": {"url": url}}


def test_params_are_written_into_the_body_as_it_came() -> None:
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "n": 1}
    raw = b' {"model":"m" , "messages":[{"role":"user","content":"hi"}],"n":1}\n '
    params = {"h1": {"peer": "tcp://127.0.0.1:1", "metadata": {"image_grid_thw": [1, 2, 2]}}}

    out = with_params(raw, body, params)

    assert out.startswith(raw[: raw.rindex(b"}")])  # the client's bytes, untouched
    assert msgspec.json.decode(out) == {**body, "ec_transfer_params": params}


def test_params_replace_those_a_body_already_has() -> None:
    body = {"model": "m", "ec_transfer_params": {"old": {}}}
    raw = msgspec.json.encode(body)
    assert msgspec.json.decode(with_params(raw, body, {"new": {}})) == {
        "model": "m",
        "ec_transfer_params": {"new": {}},
    }


def test_long_media_parts_are_told_apart_by_all_their_bytes() -> None:
    payload = "A" * 5000
    same_ends = payload[:2000] + "B" + payload[2001:]  # same length, start and end
    first, again, other = _image(payload), _image(str(payload)), _image(same_ends)
    body = {"messages": [{"role": "user", "content": [first, other, again]}]}

    scan = scan_media(body)

    assert scan.parts == [first, other]
    assert scan.where == [(0, 0, 0), (0, 1, 1), (0, 2, 0)]


def test_parts_differing_only_in_json_type_are_different_items() -> None:
    body = {
        "messages": [
            {"role": "user", "content": [_image("u") | {"x": True}, _image("u") | {"x": 1}]}
        ]
    }
    assert len(scan_media(body).parts) == 2
