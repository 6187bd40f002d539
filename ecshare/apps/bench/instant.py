"""Instant OpenAI-shaped backends, the far side of `ecshare bench proxy`.

Each answers like a vLLM instance in its role, at once, with prepared bytes, so that the
benchmark measures the proxy and not its backends:

* an encoder (`ENCODER`) answers a chat request with `ec_transfer_params` holding one
  entry per media part, keyed by a stand-in mm_hash of the part and its
  `mm_processor_kwargs` (`stub_mm_hash`), with the part's `item_indices` and, for images
  and videos, placeholder `metadata` (a grid, as Qwen2-VL's); audio gets none, as for a
  model that declares no audio fields;
* a prefill/decode instance (`PREFILL_DECODE`) answers chat and completion requests whole
  or as one SSE chunk, and `/v1/models`.

The answers' shapes (`chat_answer`, `encoder_answer`, `chunk`, `sse`) are also what the
proxy tests' recording stubs send.

`python -m ecshare.apps.bench.instant --role prefill_decode --role encoder` serves one backend
per role on 127.0.0.1 and prints its ready line (`ecshare.apps.ready.StubsReady`).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import hashlib
from typing import Any

import msgspec
from aiohttp import web

from ecshare.apps.proxy.backends import ENCODER, PREFILL_DECODE
from ecshare.apps.proxy.parts import MEDIA_PART_TYPES
from ecshare.apps.proxy.server import use_uvloop
from ecshare.apps.ready import StubsReady, print_ready

MODEL = "stub-model"
CHAT_PATH = "/v1/chat/completions"
COMPLETIONS_PATH = "/v1/completions"

_ENCODE = msgspec.json.Encoder(order="sorted")
# A stand-in placeholder grid per modality; audio declares none.
_METADATA = {
    "image_url": {"image_grid_thw": [1, 2, 2]},
    "video_url": {"video_grid_thw": [2, 2, 2]},
}


def stub_mm_hash(part: dict[str, Any], mm_processor_kwargs: Any = None) -> str:
    """The stand-in mm_hash of a media part: changes with the part and its processor options."""
    return hashlib.sha256(_ENCODE.encode([part, mm_processor_kwargs])).hexdigest()[:32]


def encoder_answer(body: dict[str, Any]) -> dict[str, Any]:
    """An encoder's answer to the encode-only chat request `body`."""
    params: dict[str, Any] = {}
    kwargs = body.get("mm_processor_kwargs")
    index = 0
    for message in body.get("messages", []):
        content = message.get("content")
        for part in content if isinstance(content, list) else []:
            kind = part.get("type")
            if kind in MEDIA_PART_TYPES:
                h = stub_mm_hash(part, kwargs)
                where = params.setdefault(
                    h,
                    {
                        "peer": "tcp://127.0.0.1:1",
                        "fingerprint": "stub",
                        "nbytes": 64,
                        "dtype": "bfloat16",
                        "shape": [4, 8],
                        "metadata": _METADATA.get(kind, {}),
                        "item_indices": [],
                    },
                )
                where["item_indices"].append(index)
                index += 1
    answer = chat_answer(CHAT_PATH)
    answer["ec_transfer_params"] = params
    return answer


def chat_answer(path: str) -> dict[str, Any]:
    """A whole answer at `path` (chat or completions)."""
    if path == COMPLETIONS_PATH:
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


def chunk(path: str, text: str) -> dict[str, Any]:
    """One streamed chunk carrying `text` at `path` (chat or completions)."""
    if path == COMPLETIONS_PATH:
        choice: dict[str, Any] = {"index": 0, "text": text, "finish_reason": None}
        kind = "text_completion"
    else:
        choice = {"index": 0, "delta": {"content": text}, "finish_reason": None}
        kind = "chat.completion.chunk"
    return {"id": "stub-1", "object": kind, "created": 0, "model": MODEL, "choices": [choice]}


def sse(obj: Any) -> bytes:
    """`obj` as one server-sent event."""
    return b"data: " + msgspec.json.encode(obj) + b"\n\n"


def json_response(obj: Any, status: int = 200) -> web.Response:
    return web.Response(
        status=status, body=msgspec.json.encode(obj), content_type="application/json"
    )


def models_response() -> web.Response:
    """The `/v1/models` answer: the one model."""
    models = {"object": "list", "data": [{"id": MODEL, "object": "model", "owned_by": "stub"}]}
    return json_response(models)


_CANNED_ANSWER = msgspec.json.encode(chat_answer(CHAT_PATH))
_CANNED_ENCODED = msgspec.json.encode(
    encoder_answer({"messages": [{"role": "user", "content": [{"type": "image_url"}]}]})
)
_CANNED_STREAM = sse(chunk(CHAT_PATH, "ok")) + b"data: [DONE]\n\n"


def instant_app(role: str) -> web.Application:
    """A backend in `role` that answers every request with prepared bytes."""

    async def health(_request: web.Request) -> web.Response:
        return web.Response()

    async def models(_request: web.Request) -> web.Response:
        return models_response()

    async def generate(request: web.Request) -> web.Response:
        body = msgspec.json.decode(await request.read())
        if role == ENCODER:
            return web.Response(body=_CANNED_ENCODED, content_type="application/json")
        if body.get("stream"):
            return web.Response(body=_CANNED_STREAM, content_type="text/event-stream")
        return web.Response(body=_CANNED_ANSWER, content_type="application/json")

    app = web.Application(client_max_size=1 << 30)
    app.router.add_get("/health", health)
    app.router.add_get("/v1/models", models)
    app.router.add_post(CHAT_PATH, generate)
    app.router.add_post(COMPLETIONS_PATH, generate)
    return app


async def serve_apps(
    apps: list[web.Application], host: str = "127.0.0.1"
) -> list[tuple[web.AppRunner, str]]:
    """Serve each app on its own free port of `host`; their runners and base URLs."""
    started = []
    for app in apps:
        runner = web.AppRunner(app, handler_cancellation=True, access_log=None)
        await runner.setup()
        site = web.TCPSite(runner, host, 0, backlog=1024)
        await site.start()
        port = runner.addresses[0][1]
        started.append((runner, f"http://{host}:{port}"))
    return started


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m ecshare.apps.bench.instant", description=__doc__
    )
    parser.add_argument("--role", action="append", choices=[ENCODER, PREFILL_DECODE], required=True)
    args = parser.parse_args(argv)
    use_uvloop()

    async def run() -> None:
        started = await serve_apps([instant_app(role) for role in args.role])
        urls = {role: url for role, (_, url) in zip(args.role, started, strict=True)}
        print_ready(StubsReady(urls))
        await asyncio.Event().wait()

    with contextlib.suppress(KeyboardInterrupt):
        asyncio.run(run())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
