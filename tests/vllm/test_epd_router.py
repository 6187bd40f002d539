"""`ecshare.vllm.router` against stand-in encoder and prefill/decode HTTP servers (aiohttp)."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any

import pytest

aiohttp = pytest.importorskip("aiohttp")
from aiohttp import web  # noqa: E402

from ecshare.vllm.router import Route, RouterError, route_chat  # noqa: E402

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


def image(url: str) -> dict[str, Any]:
    return {"type": "image_url", "image_url": {"url": url}}


def body(*parts: dict[str, Any], **extra: Any) -> dict[str, Any]:
    content = [*parts, {"type": "text", "text": "Describe."}]
    return {"model": "tiny", "messages": [{"role": "user", "content": content}], **extra}


class Fakes:
    """An encoder and a prefill/decode instance that record what they receive."""

    def __init__(self, encoder_status: int = 200, pd_status: int = 200) -> None:
        self.encoder_status = encoder_status
        self.pd_status = pd_status
        self.encoded: list[dict[str, Any]] = []
        self.answered: list[dict[str, Any]] = []

    async def encoder(self, request: web.Request) -> web.StreamResponse:
        payload = await request.json()
        self.encoded.append(payload)
        if self.encoder_status != 200:
            return web.Response(status=self.encoder_status, text="encoder broke")
        url = payload["messages"][0]["content"][0]["image_url"]["url"]
        return web.json_response({"ec_transfer_params": {f"hash-of-{url}": {"nbytes": 6144}}})

    async def prefill_decode(self, request: web.Request) -> web.StreamResponse:
        payload = await request.json()
        self.answered.append(payload)
        if self.pd_status != 200:
            return web.Response(status=self.pd_status, text="pd broke")
        return web.json_response({"choices": [{"token_ids": [1, 2, 3]}]})


async def _serve(handler: Handler) -> tuple[web.AppRunner, str]:
    app = web.Application()
    app.router.add_post("/v1/chat/completions", handler)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = runner.addresses[0][1]
    return runner, f"http://127.0.0.1:{port}"


def run(fakes: Fakes, request_body: dict[str, Any], encoders: int = 1) -> dict[str, Any]:
    async def go() -> dict[str, Any]:
        servers = [await _serve(fakes.encoder) for _ in range(encoders)]
        pd_runner, pd_url = await _serve(fakes.prefill_decode)
        try:
            route = Route(encoders=[url for _, url in servers], prefill_decode=pd_url)
            async with aiohttp.ClientSession() as session:
                return await route_chat(session, request_body, route)
        finally:
            for runner, _ in servers:
                await runner.cleanup()
            await pd_runner.cleanup()

    return asyncio.run(go())


def test_each_image_is_encoded_alone_and_params_merge_by_hash() -> None:
    fakes = Fakes()
    original = body(image("a"), image("b"), mm_processor_kwargs={"x": 1}, max_tokens=16)

    answer = run(fakes, original, encoders=2)

    assert answer == {"choices": [{"token_ids": [1, 2, 3]}]}
    assert sorted(e["messages"][0]["content"][0]["image_url"]["url"] for e in fakes.encoded) == [
        "a",
        "b",
    ]
    for request in fakes.encoded:
        assert request["max_tokens"] == 1 and request["model"] == "tiny"
        assert len(request["messages"]) == 1 and len(request["messages"][0]["content"]) == 1
        assert request["mm_processor_kwargs"] == {"x": 1}  # it changes the mm_hash
    (forwarded,) = fakes.answered
    assert forwarded["messages"] == original["messages"]
    assert forwarded["max_tokens"] == 16
    assert forwarded["ec_transfer_params"] == {
        "hash-of-a": {"nbytes": 6144},
        "hash-of-b": {"nbytes": 6144},
    }


def test_text_only_request_skips_the_encoder() -> None:
    fakes = Fakes()
    run(fakes, body())
    assert fakes.encoded == []
    assert "ec_transfer_params" not in fakes.answered[0]


def test_failed_encoder_leaves_the_item_to_the_prefill_decode_instance() -> None:
    fakes = Fakes(encoder_status=500)
    answer = run(fakes, body(image("a")))
    assert answer["choices"][0]["token_ids"] == [1, 2, 3]
    assert len(fakes.encoded) == 1
    assert "ec_transfer_params" not in fakes.answered[0]


def test_prefill_decode_failure_raises_router_error() -> None:
    with pytest.raises(RouterError) as info:
        run(Fakes(pd_status=503), body(image("a")))
    assert info.value.status == 503 and "pd broke" in info.value.detail


def test_streaming_request_is_refused() -> None:
    with pytest.raises(ValueError, match="stream"):
        run(Fakes(), body(image("a"), stream=True))
