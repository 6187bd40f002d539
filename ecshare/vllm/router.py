"""A small EPD router for OpenAI chat completions, until a real proxy exists.

It does what vLLM's `disagg_epd_proxy` example does, as a library:

1. each media item of the request goes alone to an encoder instance (the same
   model, a one-item message, `max_tokens: 1`), all items concurrently; with
   `Route.push_to`, each encoder request asks for a push of its item to those
   prefill/decode push names (`ec_transfer_params: {"push_to": [...]}`);
2. the `ec_transfer_params` the encoders return are merged (keyed by mm_hash);
3. the original request goes to the prefill/decode instance with those params
   as its top-level `ec_transfer_params`, and its JSON answer is returned.

An encoder that fails costs only time: the prefill/decode instance encodes
whatever it was not told where to fetch. It is an HTTP client only, and
imports neither vllm nor torch.
"""

from __future__ import annotations

import asyncio
import logging
import uuid
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import aiohttp

from ecshare.vllm.pushes import PUSH_TO

log = logging.getLogger(__name__)

JSON = dict[str, Any]

# Content parts that the engine runs through an encoder.
MEDIA_PART_TYPES = frozenset({"image_url", "video_url", "audio_url", "input_audio"})
# Request fields that change how media is processed, hence its mm_hash.
_HASH_FIELDS = ("mm_processor_kwargs",)
_CHAT_PATH = "/v1/chat/completions"


class RouterError(RuntimeError):
    """The prefill/decode instance did not answer the request."""

    def __init__(self, status: int, detail: str) -> None:
        super().__init__(f"prefill/decode instance answered {status}: {detail[:500]}")
        self.status = status
        self.detail = detail


@dataclass(frozen=True)
class Route:
    """Where requests go: encoder base URLs (used in turn) and one prefill/decode base URL."""

    encoders: Sequence[str]
    prefill_decode: str
    timeout_s: float = 300.0
    # The prefill/decode instance's push name, to have the encoders push to it.
    push_to: tuple[str, ...] = ()


def media_parts(body: Mapping[str, Any]) -> Iterator[JSON]:
    """The request's media content parts, in order."""
    for message in body.get("messages") or ():
        content = message.get("content") if isinstance(message, Mapping) else None
        if not isinstance(content, list):
            continue
        for part in content:
            if isinstance(part, Mapping) and part.get("type") in MEDIA_PART_TYPES:
                yield dict(part)


def encoder_request(body: Mapping[str, Any], part: JSON, push_to: Sequence[str] = ()) -> JSON:
    """The encode-only request for one media part of `body`, asking for a push of its
    item to the `push_to` names (see ecshare.vllm.pushes)."""
    request: JSON = {
        "model": body.get("model"),
        "messages": [{"role": "user", "content": [part]}],
        "max_tokens": 1,
        "stream": False,
    }
    for key in _HASH_FIELDS:
        if key in body:
            request[key] = body[key]
    if push_to:
        request["ec_transfer_params"] = {PUSH_TO: list(push_to)}
    return request


async def encode_items(
    session: aiohttp.ClientSession,
    body: Mapping[str, Any],
    encoders: Sequence[str],
    *,
    request_id: str = "",
    push_to: Sequence[str] = (),
) -> JSON:
    """Send each media part of `body` to an encoder; the merged `ec_transfer_params`."""
    parts = list(media_parts(body))
    if not parts or not encoders:
        return {}
    request_id = request_id or uuid.uuid4().hex
    calls = [
        _encode_one(
            session,
            encoders[i % len(encoders)],
            encoder_request(body, part, push_to),
            f"{request_id}-enc{i}",
        )
        for i, part in enumerate(parts)
    ]
    merged: JSON = {}
    for params in await asyncio.gather(*calls):
        merged.update(params)
    return merged


async def _encode_one(
    session: aiohttp.ClientSession, base_url: str, request: JSON, request_id: str
) -> JSON:
    url = base_url.rstrip("/") + _CHAT_PATH
    try:
        async with session.post(url, json=request, headers={"x-request-id": request_id}) as resp:
            if resp.status != 200:
                log.warning("encoder %s answered %d: %s", url, resp.status, await resp.text())
                return {}
            answer = await resp.json()
    except (aiohttp.ClientError, asyncio.TimeoutError, ValueError) as exc:
        log.warning("encoder %s failed: %r", url, exc)
        return {}
    params = answer.get("ec_transfer_params") if isinstance(answer, dict) else None
    return dict(params) if isinstance(params, dict) else {}


async def forward(
    session: aiohttp.ClientSession,
    body: Mapping[str, Any],
    ec_transfer_params: Mapping[str, Any],
    prefill_decode: str,
    *,
    request_id: str = "",
) -> JSON:
    """Send the original request, with `ec_transfer_params`, to the prefill/decode instance."""
    request = dict(body)
    if ec_transfer_params:
        request["ec_transfer_params"] = dict(ec_transfer_params)
    url = prefill_decode.rstrip("/") + _CHAT_PATH
    headers = {"x-request-id": request_id or uuid.uuid4().hex}
    async with session.post(url, json=request, headers=headers) as resp:
        if resp.status != 200:
            raise RouterError(resp.status, await resp.text())
        answer: JSON = await resp.json()
        return answer


async def route_chat(session: aiohttp.ClientSession, body: Mapping[str, Any], route: Route) -> JSON:
    """Encode `body`'s media on the encoders, then answer it on the prefill/decode instance."""
    if body.get("stream"):
        raise ValueError("the router answers whole responses only; set stream to false")
    request_id = uuid.uuid4().hex
    params = await encode_items(
        session, body, route.encoders, request_id=request_id, push_to=route.push_to
    )
    return await forward(session, body, params, route.prefill_decode, request_id=request_id)


def route_chat_sync(body: Mapping[str, Any], route: Route) -> JSON:
    """`route_chat` for callers without an event loop (scripts, tests)."""

    async def run() -> JSON:
        timeout = aiohttp.ClientTimeout(total=route.timeout_s)
        async with aiohttp.ClientSession(timeout=timeout) as session:
            return await route_chat(session, body, route)

    return asyncio.run(run())
