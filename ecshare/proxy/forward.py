"""The prefill/decode stage: send the request on, and pass the answer back as it comes.

A non-streaming answer is passed back whole; a streaming (SSE) answer chunk by chunk, as
the instance writes it. The stage's outcomes, each honest about whose fault it is:

* a refused connection ejects the instance and the request is tried on another (it never
  reached the first); none left healthy: 503;
* the instance's 4xx answers (a bad request) are the client's, passed back untouched;
* a 5xx answer, a broken connection: 502 naming the instance and its answer;
* no headers, or no chunk, within `timeout_s`: 504;
* a stream that breaks after its headers were sent ends with an SSE error event;
* a client that goes away (a failed write, or the handler cancelled on disconnect) closes
  the upstream connection, which is how vLLM learns to abort the request.
"""

from __future__ import annotations

import asyncio
import logging

import aiohttp
from aiohttp import web

from ecshare.proxy.backends import Backend, BackendPool, describe
from ecshare.proxy.errors import ProxyError, error_body
from ecshare.proxy.metrics import ProxyMetrics

log = logging.getLogger(__name__)

_SSE = "text/event-stream"


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
    ) -> None:
        self._session = session
        self._pool = pool
        self._metrics = metrics
        self._timeout_s = timeout_s
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
    ) -> web.StreamResponse:
        """Answer `request` with a prefill/decode instance's answer to `payload` at `path`."""
        headers = {"X-Request-Id": request_id}
        if payload is not None:
            headers["Content-Type"] = "application/json"
        tried: list[Backend] = []
        while True:
            backend = self._pool.pick(exclude=tried)
            if backend is None:
                raise self._no_backend(tried)
            tried.append(backend)
            with self._pool.call(backend):
                resp = await self._send(backend, path, payload, headers)
                if resp is None:
                    continue  # refused: try another instance
                try:
                    return await self._answer(request, backend, resp, request_id)
                finally:
                    resp.close()  # no-op when released; else the instance sees the abort

    async def _send(
        self, backend: Backend, path: str, payload: bytes | None, headers: dict[str, str]
    ) -> aiohttp.ClientResponse | None:
        url = backend.url_for(path)
        method = "GET" if payload is None else "POST"
        try:
            return await self._session.request(
                method, url, data=payload, headers=headers, timeout=self._timeout
            )
        except (aiohttp.ClientConnectorError, aiohttp.ConnectionTimeoutError) as exc:
            self._pool.failed(backend, f"unreachable: {describe(exc)}", eject=True)
            log.warning("prefill/decode %s unreachable: %s", url, describe(exc))
            return None
        except asyncio.TimeoutError:
            self._pool.failed(backend, "timed out")
            self._metrics.upstream_errors.labels("timeout").inc()
            raise ProxyError(
                504, f"prefill/decode instance {backend.url} sent nothing in {self._timeout_s}s"
            ) from None
        except aiohttp.ClientError as exc:
            self._pool.failed(backend, describe(exc))
            self._metrics.upstream_errors.labels("error").inc()
            raise ProxyError(
                502, f"prefill/decode instance {backend.url} failed: {describe(exc)}"
            ) from None

    def _no_backend(self, tried: list[Backend]) -> ProxyError:
        if tried:
            self._metrics.upstream_errors.labels("unreachable").inc()
            urls = ", ".join(b.url for b in tried)
            return ProxyError(502, f"no prefill/decode instance could be reached (tried {urls})")
        self._metrics.upstream_errors.labels("no_backend").inc()
        return ProxyError(503, "no prefill/decode instance is healthy")

    async def _answer(
        self,
        request: web.Request,
        backend: Backend,
        resp: aiohttp.ClientResponse,
        request_id: str,
    ) -> web.StreamResponse:
        content_type = resp.headers.get("Content-Type", "")
        if resp.status == 200 and content_type.startswith(_SSE):
            self._pool.succeeded(backend)
            return await self._stream(request, backend, resp, request_id)
        body = await self._read(backend, resp)
        if resp.status >= 500:
            self._pool.failed(backend, f"answered {resp.status}")
            self._metrics.upstream_errors.labels("status").inc()
            detail = body[:500].decode("utf-8", "replace")
            raise ProxyError(
                502, f"prefill/decode instance {backend.url} answered {resp.status}: {detail}"
            )
        self._pool.succeeded(backend)
        return web.Response(status=resp.status, body=body, headers=_headers(resp, request_id))

    async def _read(self, backend: Backend, resp: aiohttp.ClientResponse) -> bytes:
        try:
            return await resp.read()
        except asyncio.TimeoutError:
            self._pool.failed(backend, "timed out")
            self._metrics.upstream_errors.labels("timeout").inc()
            raise ProxyError(
                504, f"prefill/decode instance {backend.url} stalled for {self._timeout_s}s"
            ) from None
        except aiohttp.ClientError as exc:
            self._pool.failed(backend, describe(exc))
            self._metrics.upstream_errors.labels("error").inc()
            raise ProxyError(
                502, f"prefill/decode instance {backend.url} broke off its answer: {describe(exc)}"
            ) from None

    async def _stream(
        self,
        request: web.Request,
        backend: Backend,
        resp: aiohttp.ClientResponse,
        request_id: str,
    ) -> web.StreamResponse:
        headers = _headers(resp, request_id)
        headers["Cache-Control"] = "no-cache"
        out = web.StreamResponse(status=200, headers=headers)
        await out.prepare(request)
        chunks = resp.content.iter_any()
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
        await out.write_eof()
        return out

    async def _broken(self, out: web.StreamResponse, backend: Backend, exc: BaseException) -> None:
        """End a stream whose upstream broke after the headers were sent."""
        self._pool.failed(backend, describe(exc))
        self._metrics.upstream_errors.labels("broken_stream").inc()
        log.warning("prefill/decode %s broke off a stream: %s", backend.url, describe(exc))
        message = f"prefill/decode instance {backend.url} broke off the stream: {describe(exc)}"
        event = b"data: " + error_body(502, message) + b"\n\n"
        try:
            await out.write(event)
            await out.write_eof()
        except ConnectionResetError:
            pass


def _headers(resp: aiohttp.ClientResponse, request_id: str) -> dict[str, str]:
    """The answer's headers for the client: its type and encoding (passed on as they are)."""
    headers = {"Content-Type": resp.headers.get("Content-Type", "application/json")}
    encoding = resp.headers.get("Content-Encoding")
    if encoding is not None:
        headers["Content-Encoding"] = encoding
    headers["X-Request-Id"] = request_id
    return headers
