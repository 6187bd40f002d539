"""The proxy's listening socket: what a client connection may hold before it has earned it.

A connection is *trusted* once a request on it has shown a valid API key, or, where the
proxy asks none, once a request on it has arrived whole (body included); until then it
is *pre-auth*. A key holder's connection leaves the pool at its key because its tenant
answers for it: its bodies on their way count against the tenant's own requests in
flight (`app`). Every refusal and every close below is counted (`rejected_total{reason}`):

* **All connections** (per proxy process) are capped at `max_connections`; one past it is
  answered 503 and closed before a byte of it is read (`connections`). Each check below
  runs in the connection's `connection_made`, where its address is known, in the order
  the connections were accepted; a connection is counted from there until its
  `connection_lost`, so a burst of accepts in one loop iteration is counted exactly.
* **One client address** holds at most `max_connections_per_address` of them
  (`address`), trusted or not.
* **Pre-auth connections** are a pool of their own, `max_preauth_connections`, inside
  the cap: however many anonymous sockets a client opens, the trusted connections keep
  the rest. When the pool is full, a new connection takes the place of a pre-auth one
  with no request on it (still waiting for a whole header, or idle after an answer),
  which is closed (`evicted`): the longest idle of the address that holds the most
  places, where that address holds more than the newcomer's, so that an attacker's
  addresses yield to a client's (once it has idled `EVICT_YOUNG_S`: a younger one may
  have its request on the way); else the longest idle for at least `EVICT_AFTER_S`.
  Where there is none, the new one is refused (`preauth`).
* **Deadlines.** A new connection's first byte must arrive within `first_byte_timeout_s`
  (`first_byte_timeout`), and its whole first request header within `header_timeout_s`
  (`header_timeout`, answered 408): aiohttp alone would wait for either as long as its
  keep-alive timeout. Between requests, `keepalive_timeout_s` bounds an idle connection
  (aiohttp's own timer, which the runner is given); a body, `body_timeout_s` (`app`).
* **A pre-auth connection answered with an error is closed** after the answer (`app`
  tells it where each request begins and ends): a client without a key, or with a body refused,
  cannot park on the connection it was refused on.

The per-connection state lives in `EdgeHandler`, aiohttp's `RequestHandler` with the
deadlines and the pool's bookkeeping; `Edge` is the factory and the counts.
"""

from __future__ import annotations

import asyncio
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from operator import itemgetter
from typing import Any, cast

from aiohttp import web
from aiohttp.web_protocol import RequestHandler

from ecshare.apps.proxy.errors import error_body


def _answer(status: str, body: bytes, retry_after: bool) -> bytes:
    return (
        f"HTTP/1.1 {status}\r\n".encode()
        + b"Content-Type: application/json\r\nConnection: close\r\n"
        + (b"Retry-After: 1\r\n" if retry_after else b"")
        + b"Content-Length: "
        + str(len(body)).encode()
        + b"\r\n\r\n"
        + body
    )


REFUSAL_RESPONSE = _answer(
    "503 Service Unavailable",
    error_body(503, "the proxy has as many connections as it takes; try again later"),
    retry_after=True,
)
_ADDRESS_REFUSAL = _answer(
    "503 Service Unavailable",
    error_body(503, "this client address has as many connections as the proxy takes from one"),
    retry_after=True,
)
_PREAUTH_REFUSAL = _answer(
    "503 Service Unavailable",
    error_body(503, "the proxy has as many connections without a key as it takes"),
    retry_after=True,
)
# A pre-auth connection idle this long may be closed for a newcomer; a younger one may
# still be about to send its header (a burst of connects is accepted before any is read).
EVICT_AFTER_S = 1.0
# Younger than this, a connection is still arriving: its request may be on its way, read
# in a later turn of the loop than its accept. No newcomer takes its place, whoever's it is.
EVICT_YOUNG_S = 0.25
_HEADER_TIMEOUT = _answer(
    "408 Request Timeout",
    error_body(408, "the request header did not arrive in time (--header-timeout)"),
    retry_after=False,
)


@dataclass(frozen=True)
class EdgeLimits:
    """What a proxy process's connections may hold (`ProxyConfig`'s fields of these names)."""

    max_connections: int
    max_connections_per_address: int
    max_preauth_connections: int
    first_byte_timeout_s: float
    header_timeout_s: float

    @classmethod
    def of(cls, config: Any) -> EdgeLimits:
        return cls(**{name: getattr(config, name) for name in cls.__dataclass_fields__})


class EdgeHandler(RequestHandler):
    """aiohttp's handler of one connection, with its deadlines and its place in the pool."""

    def __init__(self, edge: Edge, server: web.Server, **kwargs: Any) -> None:
        super().__init__(server, **kwargs)
        self._edge = edge
        self.address = ""
        self.trusted = False
        self._admitted = False
        self.counted = False  # in the edge's counts (`Edge.forget`)
        self._first_byte = False
        self._header = False
        self._idle_since = time.monotonic()
        self._busy = 0  # requests inside the proxy's handlers
        self._answered = 0  # requests they have ended
        self._timers: list[asyncio.TimerHandle] = []

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        peer = transport.get_extra_info("peername")
        self.address = str(peer[0]) if isinstance(peer, tuple) and peer else ""
        refusal = self._edge.admit(self)
        if refusal is not None:
            writer = cast(asyncio.WriteTransport, transport)
            writer.write(refusal)
            writer.close()
            return
        self._admitted = True
        super().connection_made(transport)
        limits = self._edge.limits
        loop = asyncio.get_running_loop()
        self._timers = [
            loop.call_later(limits.first_byte_timeout_s, self._first_byte_due),
            loop.call_later(limits.header_timeout_s, self._header_due),
        ]

    def data_received(self, data: bytes) -> None:
        self._first_byte = True
        before = self._request_count
        super().data_received(data)
        if self._request_count != before:
            self._edge.busy(self)  # a request is read: no longer idle
            if not self._header:
                self._header = True
                self._cancel_timers()

    def connection_lost(self, exc: BaseException | None) -> None:
        if not self._admitted:
            return  # refused: aiohttp's server never knew of it
        self._admitted = False
        self._cancel_timers()
        self._edge.forget(self)
        super().connection_lost(exc)

    @property
    def idle(self) -> bool:
        """No request on it read or being answered: closing it loses no request."""
        return self._busy == 0 and self._answered == self._request_count

    @property
    def idle_since(self) -> float:
        return self._idle_since

    def began(self) -> None:
        self._busy += 1
        self._edge.busy(self)

    def ended(self) -> None:
        self._busy -= 1
        self._answered += 1
        if self.idle:
            self._idle_since = time.monotonic()
            self._edge.idle_again(self)

    def trust(self) -> None:
        if not self.trusted and self._admitted:
            self.trusted = True
            self._edge.trusted(self)

    def evict(self) -> None:
        self._close_with(None)

    def _first_byte_due(self) -> None:
        if not self._first_byte:
            self._edge.refused("first_byte_timeout")
            self._close_with(None)

    def _header_due(self) -> None:
        if not self._header:
            self._edge.refused("header_timeout")
            self._close_with(_HEADER_TIMEOUT)

    def _close_with(self, answer: bytes | None) -> None:
        transport = cast(asyncio.WriteTransport | None, self.transport)
        if transport is not None and answer is not None:
            transport.write(answer)
        self.force_close()

    def _cancel_timers(self) -> None:
        for timer in self._timers:
            timer.cancel()
        self._timers = []


class Edge:
    """A protocol factory over aiohttp's server: an `EdgeHandler` per accepted connection,
    and the counts that decide, at its `connection_made`, whether it may stay."""

    def __init__(self, server: web.Server, limits: EdgeLimits, refused: Callable[[str], None]):
        self._server = server
        self.limits = limits
        self.refused = refused
        self._open = 0
        self._by_address: dict[str, int] = {}
        # Pre-auth connections, and how many of them each client address holds.
        self._preauth: set[EdgeHandler] = set()
        self._pool_count: dict[str, int] = {}
        # The idle ones among them, longest idle first; and the same by client address.
        # Kept in order as they go busy and idle again, so that finding the connection a
        # newcomer takes the place of costs the same however full the pool is.
        self._idle: OrderedDict[EdgeHandler, None] = OrderedDict()
        self._idle_of: dict[str, OrderedDict[EdgeHandler, None]] = {}

    def __call__(self) -> asyncio.BaseProtocol:
        # `web.Server.__call__` makes its handlers with these same arguments.
        return EdgeHandler(self, self._server, loop=self._server._loop, **self._server._kwargs)

    def admit(self, handler: EdgeHandler) -> bytes | None:
        """Count a new connection in; the answer that refuses it where it may not stay."""
        address = handler.address
        if self._open >= self.limits.max_connections:
            return self._refuse("connections", REFUSAL_RESPONSE)
        if self._by_address.get(address, 0) >= self.limits.max_connections_per_address:
            return self._refuse("address", _ADDRESS_REFUSAL)
        if len(self._preauth) >= self.limits.max_preauth_connections:
            evicted = self._place_for(address)
            if evicted is None:
                return self._refuse("preauth", _PREAUTH_REFUSAL)
            self.refused("evicted")
            self.forget(evicted)  # at once: its connection_lost comes a loop turn later
            evicted.evict()
        handler.counted = True
        self._open += 1
        self._by_address[address] = self._by_address.get(address, 0) + 1
        self._preauth.add(handler)
        self._pool_count[address] = self._pool_count.get(address, 0) + 1
        self._mark_idle(handler)
        return None

    def _place_for(self, address: str) -> EdgeHandler | None:
        """The pre-auth connection a newcomer from `address` takes the place of: the longest
        idle one of the address that holds the most places, where that is more than
        `address` holds (an address that fills the pool yields to one that holds little
        of it, once its connection has idled `EVICT_YOUNG_S`, not the second the other
        rule waits); else the longest idle one, where it has been idle for
        `EVICT_AFTER_S`; None where there is none. No connection younger than
        `EVICT_YOUNG_S` is taken: its request may not have been read yet."""
        mine = self._pool_count.get(address, 0)
        now = time.monotonic()
        for other, held in sorted(self._pool_count.items(), key=itemgetter(1), reverse=True):
            if held <= mine + 1:
                break
            idle = self._idle_of.get(other)
            longest = next(iter(idle)) if idle else None
            if longest is not None and now - longest.idle_since >= EVICT_YOUNG_S:
                return longest
        oldest = next(iter(self._idle), None)
        if oldest is not None and now - oldest.idle_since >= EVICT_AFTER_S:
            return oldest
        return None

    def busy(self, handler: EdgeHandler) -> None:
        """`handler` has a request read or inside the proxy: it is no one's to evict."""
        if handler in self._idle:
            del self._idle[handler]
            self._unmark(self._idle_of, handler)

    def idle_again(self, handler: EdgeHandler) -> None:
        """`handler` has answered every request read on it: the longest idle is now another."""
        if handler in self._preauth:
            self.busy(handler)
            self._mark_idle(handler)

    def _mark_idle(self, handler: EdgeHandler) -> None:
        self._idle[handler] = None
        self._idle_of.setdefault(handler.address, OrderedDict())[handler] = None

    @staticmethod
    def _unmark(of: dict[str, OrderedDict[EdgeHandler, None]], handler: EdgeHandler) -> None:
        held = of[handler.address]
        del held[handler]
        if not held:
            del of[handler.address]

    def _refuse(self, reason: str, answer: bytes) -> bytes:
        self.refused(reason)
        return answer

    def trusted(self, handler: EdgeHandler) -> None:
        self._leave_pool(handler)

    def _leave_pool(self, handler: EdgeHandler) -> None:
        if handler in self._preauth:
            self._preauth.discard(handler)
            self.busy(handler)
            left = self._pool_count[handler.address] - 1
            if left:
                self._pool_count[handler.address] = left
            else:
                del self._pool_count[handler.address]

    def forget(self, handler: EdgeHandler) -> None:
        """Count `handler`'s connection out (once, however often it is called)."""
        if not handler.counted:
            return
        handler.counted = False
        self._open -= 1
        self._leave_pool(handler)
        left = self._by_address.get(handler.address, 0) - 1
        if left > 0:
            self._by_address[handler.address] = left
        else:
            self._by_address.pop(handler.address, None)


def began(request: web.BaseRequest) -> None:
    """`request` has reached the proxy's handlers: its connection is inside a request."""
    handler = request.protocol
    if isinstance(handler, EdgeHandler):
        handler.began()


def ended(request: web.BaseRequest, status: int, response: web.StreamResponse | None) -> None:
    """`request` is answered with `status`: a pre-auth connection answered with an error is
    closed after `response` (aiohttp closes it once the response is written)."""
    handler = request.protocol
    if not isinstance(handler, EdgeHandler):
        return
    handler.ended()
    if status >= 400 and not handler.trusted and response is not None:
        response.force_close()


def trust(request: web.BaseRequest) -> None:
    """Mark `request`'s connection trusted: it has shown a key and sent its whole body."""
    handler = request.protocol
    if isinstance(handler, EdgeHandler):
        handler.trust()


class EdgeSite(web.TCPSite):
    """`web.TCPSite` whose connections go through an `Edge`."""

    def __init__(
        self,
        runner: web.AppRunner,
        host: str,
        port: int,
        *,
        limits: EdgeLimits,
        refused: Callable[[str], None],
        backlog: int,
        reuse_port: bool,
    ) -> None:
        super().__init__(runner, host, port, backlog=backlog, reuse_port=reuse_port)
        self._limits = limits
        self._refused = refused

    async def start(self) -> None:
        self._runner._reg_site(self)  # what BaseSite.start does
        server = self._runner.server
        assert server is not None
        self._server = await asyncio.get_running_loop().create_server(
            Edge(server, self._limits, self._refused),
            self._host,
            self._port,
            backlog=self._backlog,
            reuse_address=self._reuse_address,
            reuse_port=self._reuse_port,
        )
