"""The prefill/decode stage: send the request on, and pass the answer back as it comes.

A non-streaming answer is passed back whole; a streaming (SSE) answer chunk by chunk, as
the instance writes it. The stage's outcomes, each honest about whose fault it is:

* a refused connection ejects the instance and the request is tried on another (it never
  reached the first); none left healthy: 503;
* a kept-alive connection the instance closes as the request goes out on it (the server's
  keep-alive ran out; the request was never read) is not the instance's fault: the request
  is sent once more, on a new connection, and counted (`upstream_errors{reason="resent"}`);
* the instance's 4xx answers (a bad request) are the client's, passed back untouched;
* a 5xx answer, a broken connection: 502 naming the instance and its answer;
* no headers, or no chunk, within `timeout_s`: 504;
* a stream that breaks after its headers were sent ends with an SSE error event;
* a client that goes away (a failed write, or the handler cancelled on disconnect) closes
  the upstream connection, which is how vLLM learns to abort the request.

A request sent without its media (`media`) fails on the instance when an item's fetch
fails, as there is nothing to encode it from: a 5xx answer, or a stream whose first event
after the role preamble is an error. That answer is not passed on. The request is sent
once more, with its media (the instance then encodes what it cannot fetch), logged and
counted (`pd_requests{media="retried"}`); it is not held against the instance. To see a
stream's outcome, its first events are held back until one carries more than the
preamble, which is never later than the first token.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping, Sequence
from types import MappingProxyType
from typing import Any

import aiohttp
import msgspec
from aiohttp import web

from ecshare.apps.proxy.backends import Backend, BackendPool, describe
from ecshare.apps.proxy.errors import ProxyError, error_body
from ecshare.apps.proxy.metrics import ProxyMetrics
from ecshare.apps.proxy.routing import ROUTE_HEADER, TIMING_HEADER, Route

log = logging.getLogger(__name__)

_SSE = "text/event-stream"
# A media-free stream's head held back to see whether the request failed: at most this much.
_MAX_HEAD_BYTES = 1 << 20
_NOTHING: Mapping[str, str] = MappingProxyType({})
# When a request reached the proxy, and its endpoint's name (the proxy's guard sets it): a
# streamed answer's first bytes to the client are timed from there (`ttft_seconds`).
ARRIVED_KEY = web.RequestKey("ecshare_arrived", tuple)


class _Choice(msgspec.Struct):
    delta: dict[str, Any] | None = None
    finish_reason: str | None = None


class _Event(msgspec.Struct):
    """What a streamed chat event says about its request's outcome (the rest is ignored)."""

    error: Any = None
    choices: list[_Choice] = []


_DECODE_EVENT = msgspec.json.Decoder(_Event)


class PrefillDecodeStage:
    """Sends requests to the prefill/decode instances and relays their answers."""

    def __init__(
        self,
        session: aiohttp.ClientSession,
        pool: BackendPool,
        metrics: ProxyMetrics,
        *,
        timeout_s: float,
        connect_timeout_s: float,
        route_headers: bool = False,
        stage: str = "pd",
    ) -> None:
        self._session = session
        self._stage = stage  # its name in the route's timings
        self._role = pool.role.replace("_", "/")  # in messages: "prefill/decode", "decode"
        self.pool = pool
        self._pool = pool
        self._metrics = metrics
        self._timeout_s = timeout_s
        self._route_headers = route_headers
        # No total: a stream may run as long as it keeps talking.
        self._timeout = aiohttp.ClientTimeout(
            total=None, connect=connect_timeout_s, sock_read=timeout_s
        )

    async def relay(
        self,
        request: web.Request,
        path: str,
        payload: bytes | None,
        *,
        request_id: str,
        with_media: Callable[[], Awaitable[bytes]] | None = None,
        first: Backend | None = None,
        route: Route | None = None,
        avoid: Sequence[Backend] = (),
        media_elsewhere: bool = False,
    ) -> web.StreamResponse:
        """Answer `request` with a prefill/decode instance's answer to `payload` at `path`,
        trying `first` first (the one routing chose) while it is healthy; if
        `with_media` is given, `payload` went without the media, and a failure of it is
        answered by sending what `with_media` makes instead. With `route`, and where the
        proxy shows routes (`--route-headers`), the answer says how the request was routed,
        to which instance and where the proxy's time went (`routing.ROUTE_HEADER`,
        `routing.TIMING_HEADER`). An instance of `avoid` is taken only where no other is
        healthy; with `media_elsewhere`, neither is the one that failed the media-free
        attempt."""
        headers = {"X-Request-Id": request_id}
        if payload is not None:
            headers["Content-Type"] = "application/json"
        tried: list[Backend] = []
        while True:
            if first is not None and first.healthy and not tried:
                backend: Backend | None = first
            else:
                backend = self._pool.pick(exclude=[*avoid, *tried]) if avoid else None
                backend = backend or self._pool.pick(exclude=tried)
            if backend is None:
                raise self._no_backend(tried)
            tried.append(backend)
            sent = time.perf_counter()
            with self._pool.call(backend):
                resp = await self._send(backend, path, payload, headers)
                if resp is None:
                    continue  # refused: try another instance
                shown: dict[str, str] = {}
                if route is not None and self._route_headers:
                    route.timed(self._stage, sent)
                    shown = {ROUTE_HEADER: route.header(backend.url)}
                    shown[TIMING_HEADER] = route.server_timing()
                try:
                    if with_media is None:
                        return await self._answer(request, backend, resp, request_id, shown)
                    answered = await self._answer_media_free(
                        request, backend, resp, request_id, shown
                    )
                    if answered is not None:
                        return answered
                finally:
                    resp.close()  # no-op when released; else the instance sees the abort
            # The media-free attempt failed: once more with the media, on any instance (the
            # failure was the fetch's, not the instance's).
            if media_elsewhere:
                avoid = [*avoid, *tried]
            payload, with_media, tried = await with_media(), None, []
            self._metrics.pd_media["retried"].inc()

    async def exchange(
        self,
        path: str,
        payload: bytes,
        *,
        request_id: str,
        with_media: Callable[[], Awaitable[bytes]] | None = None,
        first: Backend | None = None,
    ) -> tuple[Backend, bytes] | web.Response:
        """A whole 200 answer to an unstreamed `payload` and the instance that gave it, or
        an instance's 4xx answer (the client's), as the client is to get it.

        A refused connection is tried on another instance, as in `relay`. A 5xx answer or a
        broken connection is tried on another instance too, with the media where
        `with_media` is given (the failure may have been an item's fetch), and counted
        (`pd_requests{media="retried"}` where the media is added); past the last
        instance, the last failure is the client's answer (502). A timeout is 504."""
        headers = {"X-Request-Id": request_id, "Content-Type": "application/json"}
        tried: list[Backend] = []
        failure: ProxyError | None = None
        while True:
            if first is not None and first.healthy and not tried:
                backend: Backend | None = first
            else:
                backend = self._pool.pick(exclude=tried)
            if backend is None:
                raise failure or self._no_backend(tried)
            tried.append(backend)
            with self._pool.call(backend):
                try:
                    resp = await self._send(backend, path, payload, headers)
                    if resp is None:
                        continue  # refused: try another instance
                    try:
                        body = await self._read(backend, resp)
                    finally:
                        resp.close()
                except ProxyError as exc:
                    if exc.status == 504:
                        raise
                    failure = exc
                else:
                    if resp.status < 400:
                        self._pool.succeeded(backend)
                        return backend, body
                    if resp.status < 500:
                        self._pool.succeeded(backend)
                        return web.Response(
                            status=resp.status, body=body, headers=_headers(resp, request_id)
                        )
                    self._pool.failed(backend, f"answered {resp.status}")
                    self._metrics.upstream_errors.labels("status").inc()
                    detail = body[:500].decode("utf-8", "replace")
                    failure = ProxyError(
                        502,
                        f"{self._role} instance {backend.url} answered {resp.status}: {detail}",
                        upstream=backend.url,
                    )
            assert failure is not None
            log.warning("%s: %s; trying another instance", request_id, failure.message)
            self._metrics.handoff["prefill_retried"].inc()
            if with_media is not None:
                payload, with_media = await with_media(), None
                self._metrics.pd_media["retried"].inc()

    async def _answer_media_free(
        self,
        request: web.Request,
        backend: Backend,
        resp: aiohttp.ClientResponse,
        request_id: str,
        shown: Mapping[str, str],
    ) -> web.StreamResponse | None:
        """The answer to a media-free request, or None (logged) when the request failed."""
        content_type = resp.headers.get("Content-Type", "")
        if resp.status == 200 and content_type.startswith(_SSE):
            chunks = resp.content.iter_any()
            head, broken = await self._stream_head(chunks)
            if head is None:
                self._retrying(request_id, backend, "its stream began with an error")
                return None
            self._pool.succeeded(backend)
            return await self._stream(
                request, backend, resp, request_id, shown, head, chunks, broken
            )
        if resp.status < 500:
            return await self._answer(request, backend, resp, request_id, shown)
        body = await self._read(backend, resp)
        detail = body[:200].decode("utf-8", "replace")
        self._retrying(request_id, backend, f"it answered {resp.status}: {detail}")
        return None

    @staticmethod
    async def _stream_head(
        chunks: AsyncIterator[bytes],
    ) -> tuple[bytes | None, BaseException | None]:
        """A stream's bytes up to its first event past the role preamble (None if that
        event is an error), and the error that broke the stream before it, if any."""
        head = b""
        checked = 0
        while len(head) < _MAX_HEAD_BYTES:
            try:
                chunk = await chunks.__anext__()
            except StopAsyncIteration:
                break
            except (asyncio.TimeoutError, aiohttp.ClientError) as exc:
                return head, exc
            head += chunk
            while (end := head.find(b"\n\n", checked)) >= 0:
                outcome = _event_outcome(head[checked:end])
                if outcome == "error":
                    return None, None
                checked = end + 2
                if outcome == "answer":
                    return head, None
        return head, None

    def _retrying(self, request_id: str, backend: Backend, why: str) -> None:
        log.warning(
            "%s: prefill/decode %s failed the request sent without its media (%s); "
            "sending it again with the media",
            request_id,
            backend.url,
            why,
        )

    async def _send(
        self, backend: Backend, path: str, payload: bytes | None, headers: dict[str, str]
    ) -> aiohttp.ClientResponse | None:
        url = backend.url_for(path)
        method = "GET" if payload is None else "POST"
        for resend in (True, False):
            try:
                return await self._session.request(
                    method, url, data=payload, headers=headers, timeout=self._timeout
                )
            except (aiohttp.ClientConnectorError, aiohttp.ConnectionTimeoutError) as exc:
                self._pool.failed(backend, f"unreachable: {describe(exc)}", eject=True)
                log.warning("%s %s unreachable: %s", self._role, url, describe(exc))
                return None
            except (aiohttp.ServerDisconnectedError, aiohttp.ClientOSError) as exc:
                # A kept-alive connection the server closed as the request went out: it
                # could not have been answered. Once more, on a connection of its own.
                if not resend:
                    raise self._failed(backend, exc, reading=False) from None
                log.info("%s %s: %s; sending it again", self._role, url, describe(exc))
                self._metrics.upstream_errors.labels("resent").inc()
            except (asyncio.TimeoutError, aiohttp.ClientError) as exc:
                raise self._failed(backend, exc, reading=False) from None
        raise AssertionError("unreachable: the second try returns or raises")

    def _no_backend(self, tried: list[Backend]) -> ProxyError:
        if tried:
            self._metrics.upstream_errors.labels("unreachable").inc()
            urls = ", ".join(b.url for b in tried)
            return ProxyError(502, f"no {self._role} instance could be reached (tried {urls})")
        self._metrics.upstream_errors.labels("no_backend").inc()
        return ProxyError(503, f"no {self._role} instance is healthy")

    async def _answer(
        self,
        request: web.Request,
        backend: Backend,
        resp: aiohttp.ClientResponse,
        request_id: str,
        shown: Mapping[str, str] = _NOTHING,
    ) -> web.StreamResponse:
        content_type = resp.headers.get("Content-Type", "")
        if resp.status == 200 and content_type.startswith(_SSE):
            self._pool.succeeded(backend)
            return await self._stream(request, backend, resp, request_id, shown)
        body = await self._read(backend, resp)
        if resp.status >= 500:
            self._pool.failed(backend, f"answered {resp.status}")
            self._metrics.upstream_errors.labels("status").inc()
            detail = body[:500].decode("utf-8", "replace")
            raise ProxyError(
                502,
                f"{self._role} instance {backend.url} answered {resp.status}: {detail}",
                upstream=backend.url,
            )
        self._pool.succeeded(backend)
        return web.Response(
            status=resp.status, body=body, headers=_headers(resp, request_id, shown)
        )

    async def _read(self, backend: Backend, resp: aiohttp.ClientResponse) -> bytes:
        try:
            return await resp.read()
        except (asyncio.TimeoutError, aiohttp.ClientError) as exc:
            raise self._failed(backend, exc, reading=True) from None

    def _failed(self, backend: Backend, exc: BaseException, *, reading: bool) -> ProxyError:
        """What the client is told when `backend` times out (504) or breaks (502), before
        its answer began or while `reading` it; the backend is marked failed and counted."""
        url, timeout = backend.url, self._timeout_s
        if isinstance(exc, asyncio.TimeoutError):
            self._pool.failed(backend, "timed out")
            self._metrics.upstream_errors.labels("timeout").inc()
            if reading:
                return ProxyError(504, f"{self._role} instance {url} stalled for {timeout}s")
            return ProxyError(504, f"{self._role} instance {url} sent nothing in {timeout}s")
        error = describe(exc)
        self._pool.failed(backend, error)
        self._metrics.upstream_errors.labels("error").inc()
        if reading:
            return ProxyError(
                502, f"{self._role} instance {url} broke off its answer: {error}", upstream=url
            )
        return ProxyError(502, f"{self._role} instance {url} failed: {error}", upstream=url)

    async def _stream(
        self,
        request: web.Request,
        backend: Backend,
        resp: aiohttp.ClientResponse,
        request_id: str,
        shown: Mapping[str, str] = _NOTHING,
        head: bytes = b"",
        chunks: AsyncIterator[bytes] | None = None,
        broken: BaseException | None = None,
    ) -> web.StreamResponse:
        headers = _headers(resp, request_id, shown)
        headers["Cache-Control"] = "no-cache"
        out = web.StreamResponse(status=200, headers=headers)
        await out.prepare(request)
        if chunks is None:
            chunks = resp.content.iter_any()
        timed = False
        if head:
            try:
                await out.write(head)
            except ConnectionResetError:
                self._metrics.client_disconnects.inc()
                return out
            timed = self._first_bytes(request)
        if broken is not None:
            await self._broken(out, backend, broken)
            return out
        while True:
            try:
                chunk = await chunks.__anext__()
            except StopAsyncIteration:
                break
            except (asyncio.TimeoutError, aiohttp.ClientError) as exc:
                await self._broken(out, backend, exc)
                return out
            try:
                await out.write(chunk)
            except ConnectionResetError:
                self._metrics.client_disconnects.inc()
                log.info("%s: client went away mid-stream; upstream closed", request_id)
                return out  # the caller closes `resp`, which aborts the upstream request
            if not timed:
                timed = self._first_bytes(request)
        await out.write_eof()
        return out

    def _first_bytes(self, request: web.Request) -> bool:
        """A streamed answer's first bytes are written: time them from the request's arrival."""
        arrived = request.get(ARRIVED_KEY)
        if arrived is not None:
            started, endpoint = arrived
            self._metrics.ttft_seconds.labels(endpoint).observe(time.perf_counter() - started)
        return True

    async def _broken(self, out: web.StreamResponse, backend: Backend, exc: BaseException) -> None:
        """End a stream whose upstream broke after the headers were sent."""
        self._pool.failed(backend, describe(exc))
        self._metrics.upstream_errors.labels("broken_stream").inc()
        log.warning("%s %s broke off a stream: %s", self._role, backend.url, describe(exc))
        message = f"{self._role} instance {backend.url} broke off the stream: {describe(exc)}"
        event = b"data: " + error_body(502, message) + b"\n\n"
        try:
            await out.write(event)
            await out.write_eof()
        except ConnectionResetError:
            pass


def _headers(
    resp: aiohttp.ClientResponse, request_id: str, shown: Mapping[str, str] = _NOTHING
) -> dict[str, str]:
    """The answer's headers for the client: its type and encoding (passed on as they are),
    and the proxy's own `shown` ones."""
    headers = {"Content-Type": resp.headers.get("Content-Type", "application/json")}
    encoding = resp.headers.get("Content-Encoding")
    if encoding is not None:
        headers["Content-Encoding"] = encoding
    headers["X-Request-Id"] = request_id
    headers.update(shown)
    return headers


def _event_outcome(event: bytes) -> str:
    """What one SSE event of a chat stream says: "error", "preamble" (the role chunk, or
    no data), or "answer" (anything else: a token, a finish, the end)."""
    data = b"".join(line[5:].strip() for line in event.splitlines() if line.startswith(b"data:"))
    if not data:
        return "preamble"
    if data == b"[DONE]":
        return "answer"
    try:
        parsed = _DECODE_EVENT.decode(data)
    except msgspec.DecodeError:
        return "answer"  # not ours to judge: pass it on
    if parsed.error is not None:
        return "error"
    for choice in parsed.choices:
        if choice.finish_reason == "error":
            return "error"
        if choice.finish_reason is not None or _carries_output(choice.delta):
            return "answer"
    return "preamble" if parsed.choices else "answer"


def _carries_output(delta: dict[str, Any] | None) -> bool:
    return bool(delta) and any(v for k, v in delta.items() if k != "role")  # type: ignore[union-attr]
