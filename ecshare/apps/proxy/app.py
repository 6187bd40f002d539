"""The proxy's HTTP application: its routes, its guard, and the life of its client session.

Routes:

* ``POST /v1/chat/completions``: media items to the encoders first (`fanout`), but for
  items some instance holds (`routing`, `--routing reuse`), asking
  them to push the items into the prefill/decode instance chosen for the request where
  it has a push name (`--pd URL=PUSH_NAME`), then the
  request, with the merged `ec_transfer_params`, to prefill/decode (`forward`): each media
  part as its placeholder metadata only where the encoder published it (`media`, unless
  `--pd-media keep`), and once more with the media if that attempt fails; a request
  without media goes to prefill/decode byte for byte as it came;
* ``POST /v1/completions``: straight to prefill/decode, byte for byte;
* ``GET /v1/models``: a prefill/decode instance's answer;
* ``GET /health``: 200 while some prefill/decode instance is in rotation, else 503; with
  every backend's state only for a caller with a key (below);
* ``GET /metrics``: Prometheus text, whose labels name the backends: only for a caller with
  a key (below), else 401;
* ``GET/POST/DELETE /v1/members``: run-time membership (`discovery`), only with an admin
  key (`--admin-key-file`), which it checks itself: the API keys do not apply to it.

With `--events-port`, the proxy subscribes to every member's item feed, and the routing
asks the item directory they feed (`directory`, `feeds`) where items are; without it,
routing knows of nothing held (`routing.NoDirectory`). The membership (`discovery`) is
kept where it has a use (an events port, an admin key or a `--discover-*` name): the
backends on the command line, those registered and those discovered. A worker of
`--workers N` shares the registered members and its encodes in flight with the others
through its supervisor (`link`).

A client's own `ec_transfer_params` (top level, or in `vllm_xargs`) would tell the
prefill/decode instance which producer to fetch from, so they are dropped from every
request body and counted (`client_params_dropped`), unless the operator passes them on
(`--pass-ec-transfer-params`); the encoders' params are the only ones prefill/decode sees.
Its `kv_transfer_params` would tell an instance with a KV connector which blocks to read,
and are dropped always.

With `--prefill URL... --decode URL...`, each request is prefilled on a prefill instance
and decoded on a decode instance, its KV handed over by vLLM's KV connector (`handoff`);
the prefill instances take prefill/decode's place in everything above.

The `/v1/*` routes need an API key when keys are set (`Authorization: Bearer KEY`), and
the key says the request's tenant (`tenants`; without keys every request is the tenant
`default`'s). What names the backends (`/metrics`, `/health`'s details) is for the
operator: where API keys or an admin key are set, it needs one of them as
`Authorization: Bearer KEY` (a refusal is counted, `rejected_total{reason="auth"}`);
where none is set, it is open, as `/health`'s status always is. Routed answers say
nothing of the route unless the operator asks (`--route-headers`, `routing`). Every
error the proxy itself answers is OpenAI-shaped (`errors`).

The edge is bounded, each refusal counted by reason (`rejected_total{reason}`) before any
backend sees the request: a chat request's content parts obey the proxy's rules
(`parts`: client uuids, client embeddings, media items per request), and its inline media
is bounded by what it decodes to (`bounds`); a tenant has at most `max_tenant_in_flight`
requests in flight (429), counted at its key, or without keys once its body has arrived
(`_admit`); a body must arrive within `body_timeout_s` (408) and be at most
`max_body_bytes` (413); connections are bounded before they have shown a key and sent a
body (`edge`, told by the guard where each request begins, is trusted and ends); encoder
calls per request, in flight and per tenant are bounded (`fanout`, `slots`). With
`tenant_isolation`, each tenant's media are keyed apart (`tenants`).
"""

from __future__ import annotations

import asyncio
import functools
import logging
import secrets
import time
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import aiohttp
import msgspec
from aiohttp import web

from ecshare.apps.proxy import edge
from ecshare.apps.proxy.backends import (
    DECODE,
    ENCODER,
    PREFILL,
    PREFILL_DECODE,
    Backend,
    BackendPool,
    watch_health,
)
from ecshare.apps.proxy.bounds import MediaBounds, carries_video, check_media
from ecshare.apps.proxy.config import ProxyConfig
from ecshare.apps.proxy.discovery import (
    Membership,
    discovery_from_config,
    member_routes,
    membership_from_config,
)
from ecshare.apps.proxy.errors import ProxyError, error_response
from ecshare.apps.proxy.fanout import EncoderStage, scan_media
from ecshare.apps.proxy.forward import ARRIVED_KEY, PrefillDecodeStage
from ecshare.apps.proxy.handoff import KV_PARAMS, HandoffStage
from ecshare.apps.proxy.link import SupervisorLink
from ecshare.apps.proxy.media import media_free
from ecshare.apps.proxy.metrics import ProxyMetrics
from ecshare.apps.proxy.parts import PartRules, check_parts, media_modalities, salted
from ecshare.apps.proxy.routing import Directory, Router
from ecshare.apps.proxy.slots import StageSlots
from ecshare.apps.proxy.tenants import DEFAULT_TENANT, Keyring, holds_key

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
    "/v1/members": "members",  # its own admin key, not the API keys
}
_AUTHENTICATED = frozenset({"chat", "completions", "models", "other"})
_GENERATING = frozenset({"chat", "completions"})  # counted against the tenant's in-flight
_MAX_REQUEST_ID = 128
# Request ids the proxy makes: the process's prefix (for its logs), then random bits: a
# counter would tell a caller how many requests others sent between two of its own.
_ID_PREFIX = uuid.uuid4().hex[:16]

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


class BackendState(msgspec.Struct):
    url: str
    healthy: bool
    in_flight: int


class HealthReport(msgspec.Struct, omit_defaults=True):
    status: str
    encoders: list[BackendState] | None = None
    prefill_decode: list[BackendState] | None = None
    decode: list[BackendState] | None = None


TENANT_KEY = web.RequestKey("ecshare_tenant", str)  # a request's tenant, kept on it
# The tenant whose requests in flight a request counts against, once its body has arrived.
IN_FLIGHT_KEY = web.RequestKey("ecshare_in_flight", str)


@dataclass
class _Stages:
    session: aiohttp.ClientSession
    encode: EncoderStage
    prefill_decode: PrefillDecodeStage | HandoffStage
    health: asyncio.Task[None]
    membership_sync: asyncio.Task[None] | None = None


# An idle connection to a backend is dropped sooner than vLLM's server closes its end
# (VLLM_HTTP_TIMEOUT_KEEP_ALIVE, 5 s): a request sent on one the server is closing fails
# before it arrives ("Can not write request body").
BACKEND_KEEPALIVE_S = 4.0


class Proxy:
    """One proxy: its backends, metrics and stages, and the handlers that use them."""

    def __init__(
        self,
        config: ProxyConfig,
        metrics: ProxyMetrics | None = None,
        directory: Directory | None = None,
        link: SupervisorLink | None = None,
    ) -> None:
        self.config = config
        self.link = link
        self.metrics = metrics or ProxyMetrics()
        eject = config.eject_after_failures
        self.encoders = BackendPool(
            ENCODER, config.encoders, eject_after=eject, metrics=self.metrics
        )
        # With decode instances, prefill_decode holds the prefill ones (`handoff`).
        self.prefill_decode = BackendPool(
            PREFILL if config.split else PREFILL_DECODE,
            config.prefill_decode,
            eject_after=eject,
            metrics=self.metrics,
        )
        self.decode = BackendPool(DECODE, config.decode, eject_after=eject, metrics=self.metrics)
        self._push_names = {
            url: name
            for url, name in zip(config.prefill_decode, config.pd_push_names, strict=False)
            if name
        }
        self._keyring = Keyring(config.keys())
        self._rules = PartRules.of(config)
        self._bounds = MediaBounds.of(config)
        self._tenant_in_flight: dict[str, int] = {}
        self.pd_slots = StageSlots(
            self.prefill_decode,
            per_backend=config.max_in_flight_per_pd,
            max_total=None,
            tenant_share=None,
            wait_s=config.pd_slot_wait_s,
            calls="requests",
            wait_flag="--pd-slot-wait",
            reason="pd_busy",
        )
        self._stages: _Stages | None = None
        self.membership: Membership | None = None
        if wants_membership(config):
            pools = {ENCODER: self.encoders, PREFILL_DECODE: self.prefill_decode}
            if config.split:
                pools[DECODE] = self.decode
            self.membership = membership_from_config(config, pools)
            if directory is None and config.events_port is not None:
                directory = self.membership.directory
        self.metrics.track_membership(self._membership_counts)
        self.router = Router(
            config,
            self.encoders,
            self.prefill_decode,
            self.metrics,
            directory=directory,
            push_names=self._push_names,
        )
        if link is not None:  # one encode per content across the workers too
            self.router.flights = link.flights

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
            connector=aiohttp.TCPConnector(
                limit=0, ttl_dns_cache=300, keepalive_timeout=BACKEND_KEEPALIVE_S
            ),
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
            max_calls=c.max_encoder_calls,
            max_in_flight=c.max_encoder_in_flight,
            per_encoder=c.max_in_flight_per_encoder,
            max_tenant_in_flight=c.max_tenant_encoder_in_flight or None,
            slot_wait_s=c.encoder_slot_wait_s,
        )
        forward = functools.partial(
            PrefillDecodeStage,
            session,
            metrics=self.metrics,
            timeout_s=c.pd_timeout_s,
            connect_timeout_s=c.connect_timeout_s,
            route_headers=c.route_headers,
        )
        first = forward(self.prefill_decode)
        prefill_decode: PrefillDecodeStage | HandoffStage = first
        if c.split:
            prefill_decode = HandoffStage(first, forward(self.decode, stage="decode"), self.metrics)
        health = asyncio.create_task(
            watch_health(
                session,
                (self.encoders, self.prefill_decode, self.decode),
                interval_s=c.health_interval_s,
                timeout_s=c.health_timeout_s,
            )
        )
        self._stages = _Stages(session, encode, prefill_decode, health)
        if self.membership is not None:
            await self.membership.start(
                session, discovery_from_config(c), interval_s=c.discover_interval_s
            )
        if self.link is not None:  # the registered members, before serving
            await self.link.start(self.membership)
        if self.metrics.multiprocess:  # a scrape reaches one worker: keep all of them current
            self._stages.membership_sync = asyncio.create_task(self._sync_membership())

    async def stop(self, _app: web.Application) -> None:
        if self._stages is None:
            return
        stages, self._stages = self._stages, None
        tasks = [t for t in (stages.health, stages.membership_sync) if t is not None]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        if self.link is not None:
            await self.link.close()
        if self.membership is not None:
            await self.membership.close()
        await stages.session.close()

    def _membership_counts(self) -> tuple[dict[str, int], dict[str, int]]:
        stats = self.membership.stats() if self.membership is not None else {}
        counts = {ENCODER: len(self.encoders), PREFILL_DECODE: len(self.prefill_decode)}
        if self.config.split:
            counts[DECODE] = len(self.decode)
        return stats, counts

    async def _sync_membership(self) -> None:
        while True:
            await asyncio.sleep(1.0)
            self.metrics.sync_membership()

    # -- the guard around every route ---------------------------------------------------------

    @web.middleware
    async def guard(self, request: web.Request, handler: Handler) -> web.StreamResponse:
        started = time.perf_counter()
        endpoint = _ENDPOINTS.get(request.path, "other")
        request[ARRIVED_KEY] = (started, endpoint)
        status = 500
        response: web.StreamResponse | None = None
        self.metrics.started()
        edge.began(request)
        try:
            if endpoint in _AUTHENTICATED:
                request[TENANT_KEY] = self._authenticate(request)
                if self._keyring:  # a key shown: its tenant answers for what it holds
                    self._admit(request, endpoint in _GENERATING)
                elif endpoint not in _GENERATING and not request.body_exists:
                    edge.trust(request)  # no body to wait for
            elif self._operator(request):
                edge.trust(request)
            response = await handler(request)
        except ProxyError as exc:
            if exc.reason is not None:
                self.metrics.refused(exc.reason)
            response = error_response(exc.status, exc.message, exc.retry_after)
        except web.HTTPException as exc:  # aiohttp's own: unknown route, wrong method
            response = error_response(exc.status, f"{exc.reason}: {request.method} {request.path}")
        except asyncio.CancelledError:
            status = 499  # the client closed the connection; nginx's name for it
            self.metrics.client_disconnects.inc()
            raise
        except Exception:
            log.exception("request to %s failed inside the proxy", request.path)
            response = error_response(500, "internal proxy error; the proxy's log has the details")
        finally:
            tenant = request.get(IN_FLIGHT_KEY)
            if tenant is not None:
                self._tenant_in_flight[tenant] -= 1
            if response is not None:
                status = response.status
            edge.ended(request, status, response)
            self.metrics.answered(endpoint, status, time.perf_counter() - started)
        return response

    def _authenticate(self, request: web.Request) -> str:
        """The request's tenant; 401 when keys are set and it has none of them."""
        if not self._keyring:
            return DEFAULT_TENANT
        tenant = self._keyring.tenant(request.headers.get("Authorization", ""))
        if tenant is None:
            raise ProxyError(
                401, "missing or wrong API key (expected Authorization: Bearer)", reason="auth"
            )
        return tenant

    def _operator(self, request: web.Request) -> bool:
        """Whether `request` may see the backends: any caller where no key is set, else one
        with an API key or the admin key."""
        admin = self.config.admin_key
        if not self._keyring and not admin:
            return True
        given = request.headers.get("Authorization", "")
        return self._keyring.tenant(given) is not None or bool(admin and holds_key(given, admin))

    def _admit(self, request: web.Request, generating: bool = True) -> None:
        """Trust `request`'s connection, and count a generating request against its
        tenant's requests in flight (the guard ends it); 429 past the cap.

        With API keys, at the key: a tenant's slow bodies then hold its own requests in
        flight, and leave the pool of connections without a key to anonymous clients.
        Without keys, once the body has arrived (`_read_object`): every client is the
        tenant `default`, whose requests in flight a slow body would take from all."""
        edge.trust(request)
        if not generating:
            return
        tenant: str = request[TENANT_KEY]
        busy = self._tenant_in_flight.get(tenant, 0)
        limit = self.config.max_tenant_in_flight
        if busy >= limit:
            raise ProxyError(
                429,
                f"this API key's tenant has {busy} requests in flight, the most the proxy "
                f"takes (--max-tenant-in-flight {limit}); retry when one has ended",
                reason="tenant_busy",
            )
        self._tenant_in_flight[tenant] = busy + 1
        request[IN_FLIGHT_KEY] = tenant

    # -- routes -------------------------------------------------------------------------------

    async def chat_completions(self, request: web.Request) -> web.StreamResponse:
        began = time.perf_counter()
        raw, body = self._own_params_only(*await self._read_object(request))
        tenant: str = request[TENANT_KEY]
        checked = check_parts(body, self._rules, tenant)
        if carries_video(checked.body):  # FFmpeg's probe: off the event loop
            await asyncio.to_thread(check_media, checked.body, self._bounds)
        else:
            check_media(checked.body, self._bounds)
        self.metrics.client_uuids.labels("stripped").inc(checked.stripped)
        self.metrics.client_uuids.labels("scoped").inc(checked.scoped)
        plain = checked.body  # what media_free works from: no salt, which it leaves out
        isolated = self.config.tenant_isolation
        body = salted(plain, checked.modalities, self._rules.salt(tenant)) if isolated else plain
        if body is not checked.body or checked.changed:
            raw = msgspec.json.encode(body)
        request_id = _request_id(request)
        # Without encoders configured, media is prefill/decode's by design, not a fallback.
        scan = scan_media(body) if self.encoders.backends else None
        if scan is None or not scan.parts:
            async with self.pd_slots.slot(tenant):
                return await self.stages.prefill_decode.relay(
                    request, CHAT_PATH, raw, request_id=request_id
                )
        parsed = time.perf_counter() - began
        routed = await self.router.route(self.stages.encode, body, scan, request_id, tenant)
        encoded, chosen = routed.encoded, routed.chosen
        routed.route.steps = {"parse": parsed, **routed.route.steps}
        began = time.perf_counter()
        payload: bytes = raw
        with_media: Callable[[], Awaitable[bytes]] | None = None  # if media-free fails
        media = "kept"
        if encoded.params:
            given = body.get("ec_transfer_params")
            merged: dict[str, Any] = (
                {**given, **encoded.params} if isinstance(given, dict) else dict(encoded.params)
            )
            omit = self.config.pd_media == "omit"
            rendered = media_free(plain, scan, encoded) if omit else None
            if rendered is not None and rendered.omitted:
                free = rendered.body
                if self.config.tenant_isolation:  # salt what still carries media, only
                    free = salted(free, media_modalities(free), self._rules.salt(tenant))
                free["ec_transfer_params"] = merged
                payload = msgspec.json.encode(free)
                with_media = functools.partial(self._with_media, raw, body, merged, routed.reused)
                media = "kept" if rendered.kept else "omitted"
            else:
                payload = with_params(raw, body, merged)
        self.metrics.pd_media[media].inc()
        routed.route.timed("render", began)
        async with self.pd_slots.slot(tenant):
            return await self.stages.prefill_decode.relay(
                request,
                CHAT_PATH,
                payload,
                request_id=request_id,
                with_media=with_media,
                first=chosen,
                route=routed.route,
            )

    async def _with_media(
        self,
        raw: bytes,
        body: dict[str, Any],
        params: dict[str, Any],
        reused: list[tuple[str, str]],
    ) -> bytes:
        """The request with its media, after the attempt without failed: the items taken
        from memory were not where the directory said (`routing`)."""
        self.router.forget(reused)
        return with_params(raw, body, params)

    async def completions(self, request: web.Request) -> web.StreamResponse:
        raw, body = self._own_params_only(*await self._read_object(request))
        check_parts(body, self._rules, request[TENANT_KEY])  # its prompt_embeds
        async with self.pd_slots.slot(request[TENANT_KEY]):
            return await self.stages.prefill_decode.relay(
                request, COMPLETIONS_PATH, raw, request_id=_request_id(request)
            )

    async def models(self, request: web.Request) -> web.StreamResponse:
        stage = self.stages.prefill_decode
        if isinstance(stage, HandoffStage):
            stage = stage.decoding
        return await stage.relay(request, MODELS_PATH, None, request_id=_request_id(request))

    async def health(self, request: web.Request) -> web.Response:
        up = bool(self.prefill_decode.healthy()) and (
            not self.config.split or bool(self.decode.healthy())
        )
        report = HealthReport(status="ok" if up else "unavailable")
        if self._operator(request):
            report.encoders = [_state(b) for b in self.encoders.backends]
            report.prefill_decode = [_state(b) for b in self.prefill_decode.backends]
            if self.config.split:
                report.decode = [_state(b) for b in self.decode.backends]
        return web.Response(
            status=200 if up else 503,
            body=msgspec.json.encode(report),
            content_type="application/json",
        )

    async def prometheus(self, request: web.Request) -> web.Response:
        if not self._operator(request):
            raise ProxyError(
                401,
                "/metrics needs an API key or the admin key (expected Authorization: Bearer)",
                reason="auth",
            )
        return web.Response(
            body=self.metrics.exposition(), headers={"Content-Type": self.metrics.content_type}
        )

    def _own_params_only(self, raw: bytes, body: dict[str, Any]) -> tuple[bytes, dict[str, Any]]:
        """The body without the client's own ec_transfer_params (see the module docstring)
        and kv_transfer_params (always: they name KV blocks to read, `handoff`)."""
        kept = without_client_params(body, ec=not self.config.pass_ec_transfer_params)
        if kept is body:
            return raw, body
        self.metrics.client_params_dropped.inc()
        return msgspec.json.encode(kept), kept

    async def _read_object(self, request: web.Request) -> tuple[bytes, dict[str, Any]]:
        """The body, raw and as a JSON object, admitted where no key did it (`_admit`);
        413 past the size limit, 408 past the time limit, 400 if not an object."""
        limit = self.config.max_body_bytes
        too_large = ProxyError(
            413, f"the request body is larger than {limit} bytes", reason="body_too_large"
        )
        if request.content_length is not None and request.content_length > limit:
            raise too_large
        timeout = self.config.body_timeout_s
        try:
            async with asyncio.timeout(timeout):
                raw = await request.read()
        except web.HTTPRequestEntityTooLarge:
            raise too_large from None
        except TimeoutError:
            raise ProxyError(
                408,
                f"the request body did not arrive within {timeout:g} s (--body-timeout)",
                reason="body_timeout",
            ) from None
        try:
            body = msgspec.json.decode(raw)
        except msgspec.DecodeError as exc:
            raise ProxyError(
                400, f"the request body is not valid JSON: {exc}", reason="bad_request"
            ) from None
        if not isinstance(body, dict):
            raise ProxyError(400, "the request body must be a JSON object", reason="bad_request")
        if not self._keyring:
            self._admit(request)
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


def without_client_params(body: dict[str, Any], *, ec: bool = True) -> dict[str, Any]:
    """`body` without `kv_transfer_params`, and without `ec_transfer_params` where `ec`,
    top level or in `vllm_xargs` (vLLM reads both); `body` itself when it has none."""
    names = ("ec_transfer_params", KV_PARAMS) if ec else (KV_PARAMS,)
    kept = body
    if any(name in body for name in names):
        kept = {k: v for k, v in body.items() if k not in names}
    xargs = body.get("vllm_xargs")
    if isinstance(xargs, dict) and any(name in xargs for name in names):
        kept = {**kept, "vllm_xargs": {k: v for k, v in xargs.items() if k not in names}}
    return kept


def _request_id(request: web.Request) -> str:
    given = request.headers.get("X-Request-Id", "")
    return given[:_MAX_REQUEST_ID] if given else f"{_ID_PREFIX}-{secrets.token_hex(8)}"


def _state(backend: Backend) -> BackendState:
    return BackendState(url=backend.url, healthy=backend.healthy, in_flight=backend.in_flight)


PROXY_KEY = web.AppKey("proxy", Proxy)


def wants_membership(config: ProxyConfig) -> bool:
    """Whether `config` gives run-time membership a use: item feeds, registration or DNS."""
    return (
        config.events_port is not None
        or bool(config.admin_key)
        or config.discover_encoders is not None
        or config.discover_pd is not None
        or config.discover_decode is not None
    )


def build_app(
    config: ProxyConfig, metrics: ProxyMetrics | None = None, *, link: SupervisorLink | None = None
) -> web.Application:
    """The proxy as an aiohttp application (serve it with handler cancellation on); `link`:
    a worker's channel to its supervisor, through which it shares members and flights."""
    proxy = Proxy(config, metrics, link=link)
    app = web.Application(client_max_size=config.max_body_bytes, middlewares=[proxy.guard])
    app.router.add_post(CHAT_PATH, proxy.chat_completions)
    app.router.add_post(COMPLETIONS_PATH, proxy.completions)
    app.router.add_get(MODELS_PATH, proxy.models)
    app.router.add_get("/health", proxy.health)
    app.router.add_get("/metrics", proxy.prometheus)
    if proxy.membership is not None and config.admin_key:
        app.router.add_routes(member_routes(proxy.membership, config.admin_key))
    app.on_startup.append(proxy.start)
    app.on_cleanup.append(proxy.stop)
    app[PROXY_KEY] = proxy
    return app
