"""OpenAI-shaped stub backends, real aiohttp servers, for the proxy's tests and benchmark.

A stub answers like a vLLM instance in the role it plays, instantly unless told otherwise:

* an encoder (`ENCODER`) answers a chat request with `ec_transfer_params` holding one entry
  per media part, keyed by a stand-in mm_hash of the part and its `mm_processor_kwargs`,
  with the part's `item_indices` and, for images and videos, placeholder `metadata` (a
  grid, as Qwen2-VL's); audio gets none, as for a model that declares no audio fields;
* a prefill/decode instance (`PREFILL_DECODE`) answers chat and completion requests whole
  or as SSE chunks, and `/v1/models`; with `fail_media_free` it fails, as vLLM does when a
  fetch fails, every request that carries an item as metadata only.

Its `behaviour` can be changed while it serves, to produce what real servers rarely do on
demand: a delay, an error status, a failed health check, a stream that never ends or that
breaks. It records every request (`calls`) and sets `aborted` when its client goes away
before the answer ended. `canned=True` answers with prepared bytes and records nothing, so
that a benchmark measures the proxy, not the stub.

`python -m ecshare.proxy.stubs --role prefill_decode --role encoder` serves one stub per
role on 127.0.0.1 and prints one line, `READY_PREFIX` and a JSON object of their URLs.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import hashlib
import threading
from dataclasses import dataclass, field
from typing import Any

import msgspec
from aiohttp import web

from ecshare.proxy.backends import ENCODER, PREFILL_DECODE

READY_PREFIX = "ecshare-stubs-ready "
MODEL = "stub-model"

# Written out again rather than taken from `fanout`: the stub plays vLLM, not the proxy.
_MEDIA_TYPES = ("image_url", "image_embeds", "input_audio", "audio_url", "video_url")
_ENCODE = msgspec.json.Encoder(order="sorted")


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


@dataclass
class Call:
    """One request a stub received."""

    path: str
    body: dict[str, Any]
    headers: dict[str, str]  # names lower-cased


def stub_mm_hash(part: dict[str, Any], mm_processor_kwargs: Any = None) -> str:
    """The stand-in mm_hash of a media part: changes with the part and its processor options."""
    return hashlib.sha256(_ENCODE.encode([part, mm_processor_kwargs])).hexdigest()[:32]


@dataclass
class StubBackend:
    """One stub instance in `role`; `app()` is its aiohttp application."""

    role: str
    behaviour: Behaviour = field(default_factory=Behaviour)
    canned: bool = False
    calls: list[Call] = field(default_factory=list)
    aborted: threading.Event = field(default_factory=threading.Event)

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
        models = {"object": "list", "data": [{"id": MODEL, "object": "model", "owned_by": "stub"}]}
        return _json(models)

    async def _generate(self, request: web.Request) -> web.StreamResponse:
        body = msgspec.json.decode(await request.read())
        if self.canned:
            if self.role == ENCODER:
                return web.Response(body=_CANNED_ENCODED, content_type="application/json")
            if body.get("stream"):
                return web.Response(body=_CANNED_STREAM, content_type="text/event-stream")
            return web.Response(body=_CANNED_ANSWER, content_type="application/json")
        headers = {k.lower(): v for k, v in request.headers.items()}
        self.calls.append(Call(request.path, body, headers))
        try:
            return await self._answer(request, body)
        except (asyncio.CancelledError, ConnectionResetError):
            self.aborted.set()
            raise

    async def _answer(self, request: web.Request, body: dict[str, Any]) -> web.StreamResponse:
        b = self.behaviour
        if b.delay_s:
            await asyncio.sleep(b.delay_s)
        if b.status != 200:
            error = {"error": {"message": "stub failure", "type": "stub", "code": b.status}}
            return _json(error, status=b.status)
        if self.role == ENCODER:
            return _json(_encoder_answer(body))
        if b.fail_media_free and _metadata_only_items(body):
            return await self._fail(request, body)
        if body.get("stream"):
            return await self._stream(request)
        return _json(_answer(request.path))

    async def _fail(self, request: web.Request, body: dict[str, Any]) -> web.StreamResponse:
        error = {"error": {"message": "Internal server error", "type": "InternalServerError"}}
        if not body.get("stream"):
            return _json(error, status=500)
        out = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await out.prepare(request)
        role = _chunk(request.path, "")
        role["choices"][0]["delta"] = {"role": "assistant", "content": ""}
        await out.write(_sse(role) + _sse(error) + b"data: [DONE]\n\n")
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
            await out.write(_sse(_chunk(request.path, f"tok{sent} ")))
            sent += 1
            if b.chunk_interval_s:
                await asyncio.sleep(b.chunk_interval_s)
        await out.write(b"data: [DONE]\n\n")
        await out.write_eof()
        return out


# A stand-in placeholder grid per modality; audio declares none.
_METADATA = {
    "image_url": {"image_grid_thw": [1, 2, 2]},
    "video_url": {"video_grid_thw": [2, 2, 2]},
}


def _encoder_answer(body: dict[str, Any]) -> dict[str, Any]:
    params: dict[str, Any] = {}
    kwargs = body.get("mm_processor_kwargs")
    index = 0
    for message in body.get("messages", []):
        content = message.get("content")
        for part in content if isinstance(content, list) else []:
            kind = part.get("type")
            if kind in _MEDIA_TYPES:
                h = stub_mm_hash(part, kwargs)
                where = params.setdefault(
                    h,
                    {
                        "peer": "tcp://127.0.0.1:1",
                        "fingerprint": "stub",
                        "nbytes": 64,
                        "metadata": _METADATA.get(kind, {}),
                        "item_indices": [],
                    },
                )
                where["item_indices"].append(index)
                index += 1
    answer = _answer("/v1/chat/completions")
    answer["ec_transfer_params"] = params
    return answer


def _metadata_only_items(body: dict[str, Any]) -> int:
    """The items of a chat request sent as pre-computed-embedding parts with metadata only."""
    count = 0
    for message in body.get("messages", []):
        content = message.get("content")
        for part in content if isinstance(content, list) else []:
            kind = part.get("type", "")
            if kind.endswith("_embeds") and isinstance(part.get(kind), dict):
                count += 1
    return count


def _answer(path: str) -> dict[str, Any]:
    if path == "/v1/completions":
        choice: dict[str, Any] = {"index": 0, "text": "ok", "finish_reason": "stop"}
        kind = "text_completion"
    else:
        message = {"role": "assistant", "content": "ok"}
        choice = {"index": 0, "message": message, "finish_reason": "stop"}
        kind = "chat.completion"
    usage = {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2}
    return {
        "id": "stub-1",
        "object": kind,
        "created": 0,
        "model": MODEL,
        "choices": [choice],
        "usage": usage,
    }


def _chunk(path: str, text: str) -> dict[str, Any]:
    if path == "/v1/completions":
        choice: dict[str, Any] = {"index": 0, "text": text, "finish_reason": None}
        kind = "text_completion"
    else:
        choice = {"index": 0, "delta": {"content": text}, "finish_reason": None}
        kind = "chat.completion.chunk"
    return {"id": "stub-1", "object": kind, "created": 0, "model": MODEL, "choices": [choice]}


def _sse(obj: Any) -> bytes:
    return b"data: " + msgspec.json.encode(obj) + b"\n\n"


def _json(obj: Any, status: int = 200) -> web.Response:
    return web.Response(
        status=status, body=msgspec.json.encode(obj), content_type="application/json"
    )


_CANNED_ANSWER = msgspec.json.encode(_answer("/v1/chat/completions"))
_CANNED_ENCODED = msgspec.json.encode(
    _encoder_answer({"messages": [{"role": "user", "content": [{"type": "image_url"}]}]})
)
_CANNED_STREAM = _sse(_chunk("/v1/chat/completions", "ok")) + b"data: [DONE]\n\n"


async def serve_stubs(
    stubs: list[StubBackend], host: str = "127.0.0.1"
) -> list[tuple[web.AppRunner, str]]:
    """Serve each stub on its own free port of `host`; their runners and base URLs."""
    started = []
    for stub in stubs:
        runner = web.AppRunner(stub.app(), handler_cancellation=True, access_log=None)
        await runner.setup()
        site = web.TCPSite(runner, host, 0, backlog=1024)
        await site.start()
        port = runner.addresses[0][1]
        started.append((runner, f"http://{host}:{port}"))
    return started


class _Ready(msgspec.Struct):
    urls: dict[str, str]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m ecshare.proxy.stubs", description=__doc__)
    parser.add_argument("--role", action="append", choices=[ENCODER, PREFILL_DECODE], required=True)
    parser.add_argument("--canned", action="store_true", help="answer with prepared bytes")
    args = parser.parse_args(argv)
    from ecshare.proxy.server import use_uvloop

    use_uvloop()

    async def run() -> None:
        stubs = [StubBackend(role, canned=args.canned) for role in args.role]
        started = await serve_stubs(stubs)
        urls = {stub.role: url for stub, (_, url) in zip(stubs, started, strict=True)}
        print(READY_PREFIX + msgspec.json.encode(_Ready(urls)).decode(), flush=True)
        await asyncio.Event().wait()

    with contextlib.suppress(KeyboardInterrupt):
        asyncio.run(run())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
