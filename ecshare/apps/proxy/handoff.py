"""Prefill, then decode: one request over two instances, its KV handed over by vLLM.

With `--prefill URL... --decode URL...` (E→P→D), a request goes, after its encodes as with
`--pd` (the prefill instances take the place of prefill/decode in `routing`: pushes and
reuse choose among them):

1. to a prefill instance, as it would go to prefill/decode (media-free where it can be),
   but asking for one token, unstreamed, with `kv_transfer_params` asking vLLM's KV
   connector to keep the prompt's KV for a decode instance to read (`do_remote_decode`);
2. to the least loaded decode instance, as the client sent it (media-free where the
   prefill request was: the decode instance runs ecshare's connector as an ec_consumer,
   which is what lets vLLM take metadata-only parts) with the `kv_transfer_params` of the
   prefill's answer. The decode instance reads the prompt's KV from the prefill instance
   and answers, streamed or not, relayed as `forward` relays any answer.

A client's own `kv_transfer_params` never reach either instance (`app`): they would let it
read blocks another request's KV is in.

Failures:

* A prefill instance that refuses the connection, answers 5xx or breaks off: the request
  goes to another prefill instance, with its media (a media-free request may have failed
  an item's fetch), counted (`handoffs{outcome="prefill_retried"}`). A 4xx answer is the
  client's, passed back as it came.
* A prefill answer without `kv_transfer_params` (an instance without a KV connector as
  kv_producer): 502 naming the instance and the flag it lacks.
* A decode instance that fails before its answer began (refused, 5xx, broken off): the
  request is prefilled again, with its media, and decoded on another decode instance,
  counted (`decode_retried`). It is never decoded twice from the same
  `kv_transfer_params`: the first decode instance may have read the KV and told the
  prefill instance to free its blocks, and a second read of those blocks would read
  whatever uses them by then. A prefill instance answers the second prefill from its
  prefix cache.
* KV the decode instance cannot read (its prefill instance died after prefilling): vLLM
  recomputes the prompt there with `kv_load_failure_policy: "recompute"`, which
  `ecshare launch` sets on decode instances, fetching the items through ecshare as a
  prefill instance would; vLLM counts it (`vllm:nixl_num_failed_transfers`, and prompt
  tokens by source `local_compute`).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Awaitable, Callable
from typing import Any

import msgspec
from aiohttp import web

from ecshare.apps.proxy.backends import Backend
from ecshare.apps.proxy.errors import ProxyError
from ecshare.apps.proxy.forward import PrefillDecodeStage
from ecshare.apps.proxy.metrics import ProxyMetrics
from ecshare.apps.proxy.routing import Route

log = logging.getLogger(__name__)

KV_PARAMS = "kv_transfer_params"
# What asks vLLM's KV connector on a prefill instance to keep the prompt's KV for a decode
# instance (the fields vLLM's NixlConnector reads; the remote ones are the decode side's).
REMOTE_DECODE: dict[str, Any] = {
    "do_remote_decode": True,
    "do_remote_prefill": False,
    "remote_engine_id": None,
    "remote_block_ids": None,
    "remote_host": None,
    "remote_port": None,
}
# Fields of the client's request a prefill request does without: it is one token, whole.
_NOT_FOR_PREFILL = frozenset(
    {"stream", "stream_options", "max_completion_tokens", "min_tokens", KV_PARAMS}
)

MakeBody = Callable[[], Awaitable[bytes]]


def prefill_body(body: dict[str, Any]) -> dict[str, Any]:
    """The request a prefill instance gets for the client's `body`."""
    out = {k: v for k, v in body.items() if k not in _NOT_FOR_PREFILL}
    out["max_tokens"] = 1
    out[KV_PARAMS] = REMOTE_DECODE
    return out


class _Answer(msgspec.Struct):
    kv_transfer_params: dict[str, Any] | None = None


_DECODE_ANSWER = msgspec.json.Decoder(_Answer)


class HandoffStage:
    """Prefills each request on one instance and decodes it on another (module docstring)."""

    def __init__(
        self, prefill: PrefillDecodeStage, decode: PrefillDecodeStage, metrics: ProxyMetrics
    ) -> None:
        self._prefill = prefill
        self._decode = decode
        self._metrics = metrics

    @property
    def decoding(self) -> PrefillDecodeStage:
        """The decode instances' stage, which answers what needs no prefill (/v1/models)."""
        return self._decode

    async def relay(
        self,
        request: web.Request,
        path: str,
        payload: bytes,
        *,
        request_id: str,
        with_media: MakeBody | None = None,
        first: Backend | None = None,
        route: Route | None = None,
    ) -> web.StreamResponse:
        """Answer `request` with `payload` prefilled on `first` (or another prefill
        instance) and decoded on a decode instance; `with_media` makes the request with
        its media, where `payload` went without it."""
        body = _object(payload)
        n = body.get("n", 1)
        if n is not None and n != 1:
            raise ProxyError(
                400,
                f"n={n}: a request split over prefill and decode instances has one choice; "
                "send n requests",
                reason="bad_request",
            )
        if not self._decode.pool.healthy():  # before a prefill instance holds KV for none
            raise ProxyError(503, "no decode instance is healthy")
        prefilled = await self._prefill_step(path, body, request_id, with_media, first, route)
        if isinstance(prefilled, web.Response):
            return prefilled  # the prefill instance's 4xx: the client's error
        prefilled_on, kv = prefilled
        whole = with_media

        async def again() -> bytes:
            """The decode request once more, prefilled once more (module docstring)."""
            nonlocal body, whole
            self._metrics.handoff["decode_retried"].inc()
            if whole is not None:  # the media go along this time
                body, whole = _object(await whole()), None
            redone = await self._prefill_step(path, body, request_id, None, prefilled_on, route)
            if isinstance(redone, web.Response):
                raise ProxyError(502, f"prefill instance {prefilled_on.url} refused a retry")
            return msgspec.json.encode({**body, KV_PARAMS: redone[1]})

        payload = msgspec.json.encode({**body, KV_PARAMS: kv})
        try:
            return await self._decode.relay(
                request,
                path,
                payload,
                request_id=request_id,
                with_media=again if with_media is not None else None,
                route=route,
                media_elsewhere=True,
            )
        except ProxyError as exc:
            if exc.status != 502 or exc.upstream is None:
                raise
            log.warning(
                "%s: decode failed before its answer began (%s); prefilling again",
                request_id,
                exc.message,
            )
            failed = [b for b in self._decode.pool.backends if b.url == exc.upstream]
        return await self._decode.relay(
            request, path, await again(), request_id=request_id, route=route, avoid=failed
        )

    async def _prefill_step(
        self,
        path: str,
        body: dict[str, Any],
        request_id: str,
        with_media: MakeBody | None,
        first: Backend | None,
        route: Route | None,
    ) -> tuple[Backend, dict[str, Any]] | web.Response:
        """The prefill instance that prefilled `body` and its KV params, or its 4xx answer."""
        began = time.perf_counter()
        prefilled = await self._prefill.exchange(
            path,
            msgspec.json.encode(prefill_body(body)),
            request_id=request_id,
            with_media=_prefill_of(with_media) if with_media is not None else None,
            first=first,
        )
        if isinstance(prefilled, web.Response):
            return prefilled
        backend, answer = prefilled
        kv = self._kv_params(backend, answer)
        if route is not None:
            route.timed("prefill", began)
        self._metrics.handoff["decoded"].inc()
        return backend, kv

    def _kv_params(self, backend: Backend, answer: bytes) -> dict[str, Any]:
        try:
            kv = _DECODE_ANSWER.decode(answer).kv_transfer_params
        except msgspec.DecodeError:
            kv = None
        if not kv:
            self._metrics.handoff["no_kv_params"].inc()
            raise ProxyError(
                502,
                f"prefill instance {backend.url} answered without kv_transfer_params: start "
                "it with --kv-transfer-config naming a KV connector with kv_role kv_producer",
            )
        return kv


def _prefill_of(with_media: MakeBody) -> MakeBody:
    async def make() -> bytes:
        return msgspec.json.encode(prefill_body(_object(await with_media())))

    return make


def _object(payload: bytes) -> dict[str, Any]:
    body = msgspec.json.decode(payload)
    if not isinstance(body, dict):
        raise ProxyError(400, "the request body must be a JSON object", reason="bad_request")
    return body
