"""A real proxy refuses inline media over its decoded bounds before any encoder call.

The proxy runs beside stub backends (real aiohttp servers on 127.0.0.1, `proxy_testing`);
the media is real (a Pillow PNG), the check is `bounds.check_media`.
"""

from __future__ import annotations

import base64
import io
from typing import Any

from PIL import Image
from proxy_testing import Rig, chat

CHAT = "/v1/chat/completions"


def png_part(size: tuple[int, int]) -> dict[str, Any]:
    out = io.BytesIO()
    Image.new("1", size).save(out, "PNG")
    url = "data:image/png;base64," + base64.b64encode(out.getvalue()).decode()
    return {"type": "image_url", "image_url": {"url": url}}


def encoder_calls(rig: Rig) -> int:
    return sum(len(stub.calls) for stub in rig.encoders)


def test_a_decompression_bomb_is_refused_before_any_encoder_call(rig: Rig) -> None:
    proxy = rig.start_proxy()
    before = proxy.metric("rejected_total", reason="media_too_large")
    response = proxy.post(CHAT, chat(png_part((8000, 8000))))
    assert response.status_code == 400, response.text
    message = response.json()["error"]["message"]
    assert "8000x8000" in message and "--max-image-pixels" in message
    assert proxy.metric("rejected_total", reason="media_too_large") == before + 1
    assert encoder_calls(rig) == 0
    assert not rig.prefill_decode[0].calls


def test_an_ordinary_image_is_served(rig: Rig) -> None:
    proxy = rig.start_proxy()
    response = proxy.post(CHAT, chat(png_part((640, 480))))
    assert response.status_code == 200, response.text
    assert encoder_calls(rig) == 1
    assert proxy.metric("rejected_total", reason="media_too_large") == 0
