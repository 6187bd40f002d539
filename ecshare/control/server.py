"""The producer's end of the control plane: one ROUTER socket, CURVE and an allow-list.

The server only moves messages: it authenticates peers, enforces the frame
limit, decodes strictly and drops (and counts) everything that is not a valid
consumer-to-producer message. What a message means is `peer/`'s business.

A malformed frame from an authenticated peer is answered with
`Error(BAD_MESSAGE)` (with the decoder's explanation), because it is almost
always version skew or a bug that the other side's operator needs to see. The
answers are rate-limited globally (a token bucket), so a peer sending garbage
in a loop costs one encode per token, not one per frame. Unauthenticated
peers never get that far: CURVE refuses them in the handshake.
"""

from __future__ import annotations

import errno
import logging
import time
from dataclasses import dataclass
from typing import Any, Final

import zmq

from ecshare import protocol as p
from ecshare.control.auth import AllowList, ZapRegistration, register_allow_list
from ecshare.control.errors import ControlConfigError, ControlError
from ecshare.control.events import Watch, Watched, watch
from ecshare.control.keys import KeyPair
from ecshare.control.link import CONSUMER_TO_PRODUCER, Drop, LinkSettings, SocketEvent, remaining_ms

log = logging.getLogger(__name__)

# Error answers to bad frames: a burst of this many, then this many per second.
_ERROR_REPLY_BURST: Final = 20.0
_ERROR_REPLY_RATE: Final = 20.0
_ERROR_DETAIL_CHARS: Final = 300

_HANDSHAKE_EVENTS: Final[dict[int, str]] = {
    zmq.EVENT_HANDSHAKE_SUCCEEDED: "handshake_succeeded",
    zmq.EVENT_HANDSHAKE_FAILED_AUTH: "handshake_failed_auth",
    zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL: "handshake_failed_protocol",
    zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL: "handshake_failed_no_detail",
    zmq.EVENT_DISCONNECTED: "disconnected",
}
_MONITORED: Final = (
    zmq.EVENT_HANDSHAKE_SUCCEEDED
    | zmq.EVENT_HANDSHAKE_FAILED_AUTH
    | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
    | zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL
    | zmq.EVENT_DISCONNECTED
)


@dataclass(frozen=True)
class Inbound:
    """A valid message from an authenticated consumer.

    `peer` is the ROUTER routing id to reply to. The client picks it, so bind
    sessions to `user` (the authenticated client key, Z85; "" when insecure),
    and treat `peer` only as a return address.
    """

    peer: bytes
    user: str
    message: p.Message


class ControlServer(Watched):
    """A ROUTER bound to tcp://host:port that delivers only valid, authenticated messages.

    Use from one thread (ZMQ sockets are not thread-safe). Register `socket` with
    a `zmq.Poller` for POLLIN; when it is readable, call `recv(0)` until it
    returns None.

    The ROUTER sends no ZMTP PINGs: a consumer's PINGs carry a TTL
    (`settings.heartbeat_timeout_s`) after which we drop a consumer that went silent,
    and we answer them, so the consumer still notices a dead producer. Our own
    PINGs would arm a heartbeat timer per connection, and libzmq 4.3.5 (pyzmq
    27.3.0 bundles it; no release has a fix, zeromq/libzmq#4841) aborts the
    process with ``Assertion failed: !_io_error (stream_engine_base.cpp:310)``
    when that timer fires on a connection that had stopped reading and then
    failed: ``in_event_internal`` marks it failed but keeps it and its timers,
    and ``timer_event`` calls ``out_event``, which asserts. ROUTER_HANDOVER
    leaves the connection a consumer reconnected from without a pipe, so
    whatever still arrives on it stops its reading, and a reset fails it (the
    chaos harness's ``delay_control``). `settings.heartbeat_ivl_s` is kept for
    the consumers, who send at that interval.
    """

    def __init__(
        self,
        *,
        host: str = "127.0.0.1",
        port: int = 0,
        keys: KeyPair | None,
        authorized: frozenset[bytes] = frozenset(),
        insecure: bool = False,
        settings: LinkSettings = LinkSettings(),
        answer_bad_messages: bool = True,
        context: zmq.Context[Any] | None = None,
        name: str = "ecshare control server",
    ) -> None:
        _check_security(keys=keys, authorized=authorized, insecure=insecure)
        self.settings = settings
        self.insecure = insecure
        self.name = name
        self.answer_bad_messages = answer_bad_messages
        self._codec = p.Codec(settings.max_frame_bytes)
        self._closed = False
        # Two counter sets with one writer each (the serving thread, the monitor
        # thread), so that neither needs a lock; every key exists from the start,
        # so a copy taken on another thread never sees the dict change size.
        self._stats: dict[str, int] = dict.fromkeys(_STAT_NAMES, 0)
        self._events: dict[str, int] = dict.fromkeys(_HANDSHAKE_EVENTS.values(), 0)
        self._watch: Watch | None = None
        self._tokens = _ERROR_REPLY_BURST
        self._tokens_at = time.monotonic()
        self._allow_list: AllowList | None = None
        self._zap: ZapRegistration | None = None

        context = context if context is not None else zmq.Context.instance()
        sock: zmq.Socket[bytes] = context.socket(zmq.ROUTER)
        try:
            self.settings.apply(sock, sends_pings=False)  # see the class docstring
            # Unroutable replies raise EHOSTUNREACH instead of vanishing, so they can
            # be counted; sends are non-blocking, so a slow peer never stalls us.
            sock.setsockopt(zmq.ROUTER_MANDATORY, 1)
            # A consumer that reconnects with its (random, unguessable) routing id
            # takes over its old pipe at once, instead of being refused until the
            # dead one times out.
            sock.setsockopt(zmq.ROUTER_HANDOVER, 1)
            if keys is not None:
                self._allow_list = AllowList(frozenset(authorized), server=name)
                self._zap = register_allow_list(context, self._allow_list)
                sock.setsockopt(zmq.CURVE_SERVER, 1)
                sock.setsockopt(zmq.CURVE_SECRETKEY, keys.secret)
                sock.setsockopt(zmq.CURVE_PUBLICKEY, keys.public)
                sock.setsockopt_string(zmq.ZAP_DOMAIN, self._zap.domain)
                _enforce_zap(sock)
            self._watch = watch(sock, _MONITORED, self._count_event)
            address = f"tcp://[{host}]:{port}" if ":" in host else f"tcp://{host}:{port}"
            if ":" in host:
                sock.setsockopt(zmq.IPV6, 1)
            try:
                sock.bind(address)
            except zmq.ZMQError as exc:
                raise ControlConfigError(f"{name}: cannot bind to {address}: {exc}") from None
        except BaseException:
            self._release(sock)
            raise
        self._socket = sock
        self._poller = zmq.Poller()
        self._poller.register(sock, zmq.POLLIN)
        self.endpoint: str = _last_endpoint(sock)
        self.port: int = int(self.endpoint.rsplit(":", 1)[1])
        self._log_startup(keys, authorized)

    # --- serving ------------------------------------------------------------------------------

    @property
    def socket(self) -> zmq.Socket[bytes]:
        return self._socket

    @property
    def pollables(self) -> tuple[zmq.Socket[bytes], ...]:
        """The sockets to register with a poller for POLLIN.

        Just the ROUTER: monitor events are read on a thread of their own.
        """
        return (self._socket,)

    def recv(self, timeout_ms: int | None = 0) -> Inbound | None:
        """The next valid message, waiting up to `timeout_ms` (None: forever)."""
        self._check_open()
        deadline = None if timeout_ms is None else time.monotonic() + timeout_ms / 1000
        while True:
            while True:
                taken = self._take()
                if taken is None:
                    break
                if isinstance(taken, Inbound):
                    return taken
            wait = remaining_ms(deadline, time.monotonic())
            if wait == 0:
                return None
            self._poller.poll(wait)

    def send(self, peer: bytes, message: p.Message) -> bool:
        """Queue `message` for `peer` without blocking; False (counted) if it cannot go.

        Raises `ProtocolError` if the message encodes over the frame limit: that is a
        bug on this side, not something a peer did.
        """
        self._check_open()
        return self._send_frame(peer, self._codec.encode(message))

    @property
    def stats(self) -> dict[str, int]:
        """Counters: messages, drops per reason, send failures, handshakes. Any thread."""
        allow_list = self._allow_list
        refused = allow_list.refused_by_reason() if allow_list is not None else {}
        return {
            **self._stats,
            **self._events,
            "auth_accepted": allow_list.accepted if allow_list is not None else 0,
            "auth_rejected": allow_list.rejected if allow_list is not None else 0,
            **{f"auth_refused.{reason}": n for reason, n in refused.items()},
        }

    # --- inside -------------------------------------------------------------------------------

    def _take(self) -> Inbound | Drop | None:
        """One queued multipart: delivered, dropped (why), or None when nothing waits."""
        try:
            routing_id = self._socket.recv(zmq.NOBLOCK, copy=False)
        except zmq.Again:
            return None
        frames = [routing_id]
        more = routing_id.more
        while more:
            part = self._socket.recv(copy=False)
            more = part.more
            if len(frames) < 3:  # enough to tell a wrong count; the rest is discarded
                frames.append(part)
        peer = routing_id.bytes
        if len(frames) != 2:
            return self._drop(peer, Drop.FRAME_COUNT, "expected exactly one frame per message")
        payload = frames[1]
        if len(payload) > self.settings.max_frame_bytes:
            return self._drop(peer, Drop.OVERSIZED, "frame over the size limit", answer=False)
        user = _user_id(payload)
        if not self.insecure and not user:
            return self._drop(peer, Drop.NO_IDENTITY, "no authenticated identity", answer=False)
        try:
            message = self._codec.decode(payload.buffer)
        except p.ProtocolError as exc:
            return self._drop(peer, Drop.MALFORMED, str(exc))
        if type(message) not in CONSUMER_TO_PRODUCER:
            kind = type(message).__name__
            return self._drop(peer, Drop.UNEXPECTED_KIND, f"a producer does not accept {kind}")
        self._stats["received"] += 1
        return Inbound(peer=peer, user=user, message=message)

    def _drop(self, peer: bytes, reason: Drop, detail: str, *, answer: bool = True) -> Drop:
        self._stats[f"dropped_{reason.value}"] += 1
        log.debug("%s: dropped a message from %r: %s: %s", self.name, peer, reason.value, detail)
        if answer and self.answer_bad_messages:
            if self._take_token():
                error = p.Error(code=p.ErrorCode.BAD_MESSAGE, message=detail[:_ERROR_DETAIL_CHARS])
                if self._send_frame(peer, self._codec.encode(error)):
                    self._stats["error_replies"] += 1
            else:
                self._stats["error_replies_suppressed"] += 1
        return reason

    def _send_frame(self, peer: bytes, frame: bytes) -> bool:
        try:
            self._socket.send_multipart([peer, frame], zmq.NOBLOCK)
        except zmq.Again:
            self._stats["send_dropped_queue_full"] += 1
            return False
        except zmq.ZMQError as exc:
            if exc.errno != errno.EHOSTUNREACH:
                raise
            self._stats["send_dropped_unreachable"] += 1
            return False
        self._stats["sent"] += 1
        return True

    def _take_token(self) -> bool:
        now = time.monotonic()
        self._tokens = min(
            _ERROR_REPLY_BURST, self._tokens + (now - self._tokens_at) * _ERROR_REPLY_RATE
        )
        self._tokens_at = now
        if self._tokens < 1.0:
            return False
        self._tokens -= 1.0
        return True

    def _count_event(self, event: SocketEvent) -> None:
        """On the monitor thread."""
        counter = _HANDSHAKE_EVENTS.get(event.kind)
        if counter is not None:
            self._events[counter] += 1
        if event.kind in (
            zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL,
            zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL,
        ):
            # DEBUG: anyone who can reach the port can cause these; the counters show them.
            log.debug(
                "%s: a client handshake failed (%s, value %#x)", self.name, event.name, event.value
            )

    def _check_open(self) -> None:
        if self._closed:
            raise ControlError(f"{self.name} is closed")

    def _release(self, sock: zmq.Socket[bytes]) -> None:
        super()._release(sock)
        if self._zap is not None:
            self._zap.close()
            self._zap = None

    def _log_startup(self, keys: KeyPair | None, authorized: frozenset[bytes]) -> None:
        if keys is None:
            log.warning(
                "%s on %s runs with insecure=True: connections are NOT authenticated and NOT "
                "encrypted; anyone who can reach this port can talk to it",
                self.name,
                self.endpoint,
            )
            return
        log.info(
            "%s on %s: CURVE server key %s, %d authorized client key(s)",
            self.name,
            self.endpoint,
            keys.public_text,
            len(authorized),
        )
        if not authorized:
            log.warning("%s: no client keys are authorized; every consumer is refused", self.name)


_STAT_NAMES: Final = (
    "received",
    *(f"dropped_{reason.value}" for reason in Drop),
    "sent",
    "send_dropped_unreachable",
    "send_dropped_queue_full",
    "error_replies",
    "error_replies_suppressed",
)


def _check_security(*, keys: KeyPair | None, authorized: frozenset[bytes], insecure: bool) -> None:
    if insecure and keys is not None:
        raise ControlConfigError(
            "insecure=True together with a CURVE key pair: choose one (drop the keys, or "
            "insecure=True)"
        )
    if insecure and authorized:
        raise ControlConfigError(
            "insecure=True together with authorized client keys, which would be ignored: choose one"
        )
    if not insecure and keys is None:
        raise ControlConfigError(
            "the control server needs a CURVE key pair (keys=...); an unauthenticated, "
            "unencrypted server must be asked for explicitly with insecure=True"
        )


def _enforce_zap(sock: zmq.Socket[bytes]) -> None:
    # Without this, a CURVE server whose ZAP handler is gone admits every client
    # with a well-formed key. Not every libzmq build knows the option; there the
    # handler is bound before the server, and lives as long as it.
    try:
        sock.setsockopt(zmq.ZAP_ENFORCE_DOMAIN, 1)
    except (zmq.ZMQError, AttributeError):
        log.debug("libzmq lacks ZMQ_ZAP_ENFORCE_DOMAIN; relying on the ZAP handler's lifetime")


def _user_id(frame: zmq.Frame) -> str:
    try:
        user = frame.get("User-Id")
    except zmq.ZMQError:  # no such property: an unauthenticated (NULL) connection
        return ""
    return user if isinstance(user, str) else ""


def _last_endpoint(sock: zmq.Socket[bytes]) -> str:
    raw = sock.getsockopt(zmq.LAST_ENDPOINT)
    return raw.decode("ascii") if isinstance(raw, bytes) else str(raw)
