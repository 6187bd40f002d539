"""The proxy's listening socket, with a cap on the client connections it keeps open.

A connection past `max_connections` (per proxy process) is answered at once with a 503
and closed, before a byte of its request is read, and counted
(`rejected_total{reason="connections"}`). Open connections are those aiohttp's server
holds (each until its last request's handler ends) plus those accepted in the last loop
iterations, whose `connection_made` (which the transport schedules with `call_soon` once
the factory returns) may not have run yet: a burst of accepts cannot pass the cap.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import cast

from aiohttp import web
from aiohttp.web_protocol import RequestHandler

from ecshare.apps.proxy.errors import error_body

_REFUSAL = error_body(503, "the proxy has as many connections as it takes; try again later")
REFUSAL_RESPONSE = (
    b"HTTP/1.1 503 Service Unavailable\r\n"
    b"Content-Type: application/json\r\n"
    b"Connection: close\r\n"
    b"Retry-After: 1\r\n"
    b"Content-Length: " + str(len(_REFUSAL)).encode() + b"\r\n\r\n" + _REFUSAL
)


class _Refusal(asyncio.Protocol):
    """Answers a connection past the cap with a 503 and closes it."""

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # A stream transport (uvloop's are not asyncio's classes, so no isinstance).
        writer = cast(asyncio.WriteTransport, transport)
        writer.write(REFUSAL_RESPONSE)
        writer.close()


class CappedConnections:
    """A protocol factory: aiohttp's server's handler while fewer than `limit` connections
    are open, else a refusal (`refused()` is called for each)."""

    def __init__(self, server: web.Server, limit: int, refused: Callable[[], None]) -> None:
        self._server = server
        self._limit = limit
        self._refused = refused
        self._starting: set[RequestHandler] = set()

    def open(self) -> int:
        # A handler whose connection_made has run but whose discard has not yet is in
        # both: counted once, or a connection under the cap is refused.
        held = self._server.connections
        return len(held) + len(self._starting.difference(held))

    def __call__(self) -> asyncio.BaseProtocol:
        if self.open() >= self._limit:
            self._refused()
            return _Refusal()
        handler = self._server()
        self._starting.add(handler)
        # Two turns of the loop: the transport's connection_made, scheduled after this
        # returns, has then run, and the server counts the connection (or it failed).
        loop = asyncio.get_running_loop()
        loop.call_soon(loop.call_soon, self._starting.discard, handler)
        return handler


class CappedSite(web.TCPSite):
    """`web.TCPSite` whose connections are capped (`CappedConnections`)."""

    def __init__(
        self,
        runner: web.AppRunner,
        host: str,
        port: int,
        *,
        max_connections: int,
        refused: Callable[[], None],
        backlog: int,
        reuse_port: bool,
    ) -> None:
        super().__init__(runner, host, port, backlog=backlog, reuse_port=reuse_port)
        self._max_connections = max_connections
        self._refused = refused

    async def start(self) -> None:
        self._runner._reg_site(self)  # what BaseSite.start does
        server = self._runner.server
        assert server is not None
        factory = CappedConnections(server, self._max_connections, self._refused)
        self._server = await asyncio.get_running_loop().create_server(
            factory,
            self._host,
            self._port,
            backlog=self._backlog,
            reuse_address=self._reuse_address,
            reuse_port=self._reuse_port,
        )
