"""The proxy's HTTP application: its routes, its guard, and the life of its client session.

Routes:

* ``POST /v1/chat/completions``: media items to the encoders first (`fanout`), asking
  them to push the items into the prefill/decode instance chosen for the request where
  it has a push name (`--pd URL=PUSH_NAME`), then the
  request, with the merged `ec_transfer_params`, to prefill/decode (`forward`): each media
  part as its placeholder metadata only where the encoder published it (`media`, unless
  `--pd-media keep`), and once more with the media if that attempt fails; a request
  without media goes to prefill/decode byte for byte as it came;
* ``POST /v1/completions``: straight to prefill/decode, byte for byte;
* ``GET /v1/models``: a prefill/decode instance's answer;
* ``GET /health``: 200 while some prefill/decode instance is in rotation, else 503, with
  every backend's state;
* ``GET /metrics``: Prometheus text.

A client's own `ec_transfer_params` (top level, or in `vllm_xargs`) would tell the
prefill/decode instance which producer to fetch from, so they are dropped from every
request body and counted (`client_params_dropped`), unless the operator passes them on
(`--pass-ec-transfer-params`); the encoders' params are the only ones prefill/decode sees.

The `/v1/*` routes need the API key when one is set (`Authorization: Bearer KEY`, compared
in constant time); `/health` and `/metrics` are for the machines that watch the proxy and
answer without it. Every error the proxy itself answers is OpenAI-shaped (`errors`).
"""

from __future__ import annotations

import asyncio
import functools
import hashlib
import hmac
import itertools
import logging
import time
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import aiohttp
import msgspec
from aiohttp import web

from ecshare.apps.proxy.backends import ENCODER, PREFILL_DECODE, Backend, BackendPool, watch_health
from ecshare.apps.proxy.config import ProxyConfig
from ecshare.apps.proxy.errors import ProxyError, error_response
from ecshare.apps.proxy.fanout import EncoderStage, scan_media
from ecshare.apps.proxy.forward import PrefillDecodeStage
from ecshare.apps.proxy.media import media_free
from ecshare.apps.proxy.metrics import ProxyMetrics

log = logging.getLogger(__name__)

CHAT_PATH = "/v1/chat/completions"
COMPLETIONS_PATH = "/v1/completions"
MODELS_PATH = "/v1/models"
# Metric label of each route; anything else is "other", so labels stay few.
_ENDPOINTS = {
    CHAT_PATH: "chat",
    COMPLETIONS_PATH: "completions",
    MODELS_PATH: "models",
    "/health": "health",
    "/metrics": "metrics",
}
_AUTHENTICATED = frozenset({"chat", "completions", "models", "other"})
_MAX_REQUEST_ID = 128
# Request ids the proxy makes: unique across proxies by the prefix, cheap by the counter.
_ID_PREFIX = uuid.uuid4().hex[:16]
_ID_COUNTER = itertools.count()

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


class BackendState(msgspec.Struct):
    url: str
    healthy: bool
    in_flight: int


class HealthReport(msgspec.Struct):
    status: str
    encoders: list[BackendState]
    prefill_decode: list[BackendState]


@dataclass
class _Stages:
    session: aiohttp.ClientSession
    encode: EncoderStage
    prefill_decode: PrefillDecodeStage
    health: asyncio.Task[None]


class Proxy:
    """One proxy: its backends, metrics and stages, and the handlers that use them."""

    def __init__(self, config: ProxyConfig, metrics: ProxyMetrics | None = None) -> None:
        self.config = config
        self.metrics = metrics or ProxyMetrics()
        eject = config.eject_after_failures
        self.encoders = BackendPool(
            ENCODER, config.encoders, eject_after=eject, metrics=self.metrics
        )
        self.prefill_decode = BackendPool(
            PREFILL_DECODE, config.prefill_decode, eject_after=eject, metrics=self.metrics
        )
        self._push_names = {
            url: name
            for url, name in zip(config.prefill_decode, config.pd_push_names, strict=False)
            if name
        }
        key = config.api_key
        self._key_digest = None if key is None else hashlib.sha256(key.encode()).digest()
        self._stages: _Stages | None = None

    @property
    def stages(self) -> _Stages:
        if self._stages is None:
            raise RuntimeError("the proxy's application has not started")
        return self._stages

    async def start(self, _app: web.Application) -> None:
        c = self.config
        # Backends get no cookies and are not asked to compress (so answers pass through as
        # they come): less work per request than a browser-like client.
        session = aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(limit=0, ttl_dns_cache=300),
            timeout=aiohttp.ClientTimeout(total=None, connect=c.connect_timeout_s),
            cookie_jar=aiohttp.DummyCookieJar(),
            skip_auto_headers=("Accept-Encoding", "User-Agent"),
            auto_decompress=False,
        )
        encode = EncoderStage(
            session,
            self.encoders,
            self.metrics,
            batch_size=c.encoder_batch_size,
            timeout_s=c.encoder_timeout_s,
            connect_timeout_s=c.connect_timeout_s,
        )
        prefill_decode = PrefillDecodeStage(
            session,
            self.prefill_decode,
            self.metrics,
            timeout_s=c.pd_timeout_s,
            connect_timeout_s=c.connect_timeout_s,
        )
        health = asyncio.create_task(
            watch_health(
                session,
                (self.encoders, self.prefill_decode),
                interval_s=c.health_interval_s,
                timeout_s=c.health_timeout_s,
            )
        )
        self._stages = _Stages(session, encode, prefill_decode, health)

    async def stop(self, _app: web.Application) -> None:
        if self._stages is None:
            return
        stages, self._stages = self._stages, None
        stages.health.cancel()
        await asyncio.gather(stages.health, return_exceptions=True)
        await stages.session.close()

    # -- the guard around every route ---------------------------------------------------------

    @web.middleware
    async def guard(self, request: web.Request, handler: Handler) -> web.StreamResponse:
        started = time.perf_counter()
        endpoint = _ENDPOINTS.get(request.path, "other")
        status = 500
        self.metrics.started()
        try:
            if endpoint in _AUTHENTICATED:
                self._authenticate(request)
            response = await handler(request)
            status = response.status
            return response
        except ProxyError as exc:
            status = exc.status
            return error_response(exc.status, exc.message)
        except web.HTTPException as exc:  # aiohttp's own: unknown route, wrong method
            status = exc.status
            return error_response(exc.status, f"{exc.reason}: {request.method} {request.path}")
        except asyncio.CancelledError:
            status = 499  # the client closed the connection; nginx's name for it
            self.metrics.client_disconnects.inc()
            raise
        except Exception:
            log.exception("request to %s failed inside the proxy", request.path)
            return error_response(500, "internal proxy error; the proxy's log has the details")
        finally:
            self.metrics.answered(endpoint, status, time.perf_counter() - started)

    def _authenticate(self, request: web.Request) -> None:
        if self._key_digest is None:
            return
        scheme, _, token = request.headers.get("Authorization", "").partition(" ")
        # Digests of equal length: the comparison's time says nothing about the key's length.
        given = hashlib.sha256(token.strip().encode()).digest()
        if not hmac.compare_digest(given, self._key_digest) or scheme.lower() != "bearer":
            self.metrics.rejected.labels("auth").inc()
            raise ProxyError(401, "missing or wrong API key (expected Authorization: Bearer)")

    # -- routes -------------------------------------------------------------------------------

    async def chat_completions(self, request: web.Request) -> web.StreamResponse:
        raw, body = self._own_params_only(*await self._read_object(request))
        request_id = _request_id(request)
        # Without encoders configured, media is prefill/decode's by design, not a fallback.
        scan = scan_media(body) if self.encoders.backends else None
        if scan is None or not scan.parts:
            return await self.stages.prefill_decode.relay(
                request, CHAT_PATH, raw, request_id=request_id
            )
        # With push, the prefill/decode instance is chosen first: the encoders write the
        # items into it while the proxy forwards the request.
        chosen = self.prefill_decode.pick() if self._push_names else None
        name = self._push_names.get(chosen.url, "") if chosen is not None else ""
        push_to = (name,) if name else ()
        encoded = await self.stages.encode.encode(body, scan.parts, request_id, push_to)
        payload: bytes = raw
        with_media: Callable[[], bytes] | None = None  # what to send if media-free fails
        media = "kept"
        if encoded.params:
            given = body.get("ec_transfer_params")
            merged = {**given, **encoded.params} if isinstance(given, dict) else encoded.params
            rendered = media_free(body, scan, encoded) if self.config.pd_media == "omit" else None
            if rendered is not None and rendered.omitted:
                rendered.body["ec_transfer_params"] = merged
                payload = msgspec.json.encode(rendered.body)
                with_media = functools.partial(with_params, raw, body, merged)
                media = "kept" if rendered.kept else "omitted"
            else:
                payload = with_params(raw, body, merged)
        self.metrics.pd_media[media].inc()
        return await self.stages.prefill_decode.relay(
            request,
            CHAT_PATH,
            payload,
            request_id=request_id,
            with_media=with_media,
            first=chosen,
        )

    async def completions(self, request: web.Request) -> web.StreamResponse:
        raw, _ = self._own_params_only(*await self._read_object(request))
        return await self.stages.prefill_decode.relay(
            request, COMPLETIONS_PATH, raw, request_id=_request_id(request)
        )

    async def models(self, request: web.Request) -> web.StreamResponse:
        return await self.stages.prefill_decode.relay(
            request, MODELS_PATH, None, request_id=_request_id(request)
        )

    async def health(self, _request: web.Request) -> web.Response:
        up = bool(self.prefill_decode.healthy())
        report = HealthReport(
            status="ok" if up else "unavailable",
            encoders=[_state(b) for b in self.encoders.backends],
            prefill_decode=[_state(b) for b in self.prefill_decode.backends],
        )
        return web.Response(
            status=200 if up else 503,
            body=msgspec.json.encode(report),
            content_type="application/json",
        )

    async def prometheus(self, _request: web.Request) -> web.Response:
        return web.Response(
            body=self.metrics.exposition(), headers={"Content-Type": self.metrics.content_type}
        )

    def _own_params_only(self, raw: bytes, body: dict[str, Any]) -> tuple[bytes, dict[str, Any]]:
        """The body without the client's own ec_transfer_params (see the module docstring)."""
        if self.config.pass_ec_transfer_params:
            return raw, body
        kept = without_client_params(body)
        if kept is body:
            return raw, body
        self.metrics.client_params_dropped.inc()
        return msgspec.json.encode(kept), kept

    async def _read_object(self, request: web.Request) -> tuple[bytes, dict[str, Any]]:
        """The body, raw and as a JSON object; 413 past the size limit, 400 if not an object."""
        limit = self.config.max_body_bytes
        too_large = ProxyError(413, f"the request body is larger than {limit} bytes")
        if request.content_length is not None and request.content_length > limit:
            self.metrics.rejected.labels("body_too_large").inc()
            raise too_large
        try:
            raw = await request.read()
        except web.HTTPRequestEntityTooLarge:
            self.metrics.rejected.labels("body_too_large").inc()
            raise too_large from None
        try:
            body = msgspec.json.decode(raw)
        except msgspec.DecodeError as exc:
            self.metrics.rejected.labels("bad_request").inc()
            raise ProxyError(400, f"the request body is not valid JSON: {exc}") from None
        if not isinstance(body, dict):
            self.metrics.rejected.labels("bad_request").inc()
            raise ProxyError(400, "the request body must be a JSON object")
        return raw, body


def with_params(raw: bytes, body: dict[str, Any], params: dict[str, Any]) -> bytes:
    """The request `raw` (whose decoding is `body`) with `params` as its ec_transfer_params.

    Where the body has none of its own, the params are written in before its closing
    brace, and the rest (megabytes of base64 media, maybe) passes as it came, not decoded
    and encoded again."""
    if "ec_transfer_params" in body or not body:
        return msgspec.json.encode({**body, "ec_transfer_params": params})
    end = raw.rindex(b"}")
    return b"".join((raw[:end], b',"ec_transfer_params":', msgspec.json.encode(params), raw[end:]))


def without_client_params(body: dict[str, Any]) -> dict[str, Any]:
    """`body` without `ec_transfer_params`, top level or in `vllm_xargs` (vLLM reads both);
    `body` itself when it has neither."""
    kept = body
    if "ec_transfer_params" in body:
        kept = {k: v for k, v in body.items() if k != "ec_transfer_params"}
    xargs = body.get("vllm_xargs")
    if isinstance(xargs, dict) and "ec_transfer_params" in xargs:
        kept = {**kept, "vllm_xargs": {k: v for k, v in xargs.items() if k != "ec_transfer_params"}}
    return kept


def _request_id(request: web.Request) -> str:
    given = request.headers.get("X-Request-Id", "")
    return given[:_MAX_REQUEST_ID] if given else f"{_ID_PREFIX}-{next(_ID_COUNTER)}"


def _state(backend: Backend) -> BackendState:
    return BackendState(url=backend.url, healthy=backend.healthy, in_flight=backend.in_flight)


PROXY_KEY = web.AppKey("proxy", Proxy)


def build_app(config: ProxyConfig, metrics: ProxyMetrics | None = None) -> web.Application:
    """The proxy as an aiohttp application (serve it with handler cancellation on)."""
    proxy = Proxy(config, metrics)
    app = web.Application(client_max_size=config.max_body_bytes, middlewares=[proxy.guard])
    app.router.add_post(CHAT_PATH, proxy.chat_completions)
    app.router.add_post(COMPLETIONS_PATH, proxy.completions)
    app.router.add_get(MODELS_PATH, proxy.models)
    app.router.add_get("/health", proxy.health)
    app.router.add_get("/metrics", proxy.prometheus)
    app.on_startup.append(proxy.start)
    app.on_cleanup.append(proxy.stop)
    app[PROXY_KEY] = proxy
    return app
