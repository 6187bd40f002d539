"""The proxy in front of real vLLM instances: skipped until the hook is wired.

`real_vllm_backends` (proxy_testing.py) is the hook: once it yields the URLs of real
encoder and prefill/decode instances sharing through ecshare (the e2e fixture of
tests/vllm), these tests run as they are.
"""

from __future__ import annotations

import base64
import struct
import zlib

from proxy_testing import LoopThread

from ecshare.proxy.config import ProxyConfig
from ecshare.proxy.server import start_proxy


def _png(width: int = 64, height: int = 64) -> str:
    """A data URL of a small gradient PNG, made without an imaging library."""

    def chunk(kind: bytes, data: bytes) -> bytes:
        body = kind + data
        return struct.pack(">I", len(data)) + body + struct.pack(">I", zlib.crc32(body))

    pixels = (bytes((x * 4 % 256, y * 4 % 256, 128)) for y in range(height) for x in range(width))
    flat = b"".join(pixels)
    rows = b"".join(b"\x00" + flat[y * width * 3 : (y + 1) * width * 3] for y in range(height))
    header = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    png = b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header)
    png += chunk(b"IDAT", zlib.compress(rows)) + chunk(b"IEND", b"")
    return "data:image/png;base64," + base64.b64encode(png).decode()


def test_image_request_is_encoded_on_the_encoder_and_answered_by_prefill_decode(
    real_vllm_backends: tuple[list[str], list[str]],
) -> None:
    encoders, prefill_decode = real_vllm_backends
    config = ProxyConfig(encoders=tuple(encoders), prefill_decode=tuple(prefill_decode), port=0)
    loop = LoopThread()
    running = loop.run(start_proxy(config))
    try:
        import openai

        client = openai.OpenAI(base_url=running.url + "/v1", api_key="unused", max_retries=0)
        model = client.models.list().data[0].id
        image = {"type": "image_url", "image_url": {"url": _png()}}
        answer = client.chat.completions.create(
            model=model,
            messages=[{"role": "user", "content": [image, {"type": "text", "text": "Colour?"}]}],
            max_tokens=8,
        )
        assert answer.choices[0].message.content is not None
        metrics = running.proxy.metrics
        assert metrics.value("encoder_items_total", outcome="ok") == 1
        assert metrics.value("encoder_items_total", outcome="fallback") == 0
    finally:
        loop.run(running.stop())
        loop.close()
