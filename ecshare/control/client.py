"""The consumer's end of the control plane: one DEALER per producer, CURVE, reconnects.

libzmq reconnects by itself; the socket's monitor events drive a `Handshake`
state machine, so that `state` says where the link stands and `check()` turns
a refusal into `AuthenticationFailed` that names the key at fault.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from typing import Any, Final

import zmq

from ecshare import protocol as p
from ecshare.control.errors import AuthenticationFailed, ControlConfigError, ControlError
from ecshare.control.events import Watch, Watched, watch
from ecshare.control.handshake import MONITORED_EVENTS, Handshake, LinkState
from ecshare.control.keys import KeyPair, require_z85_key
from ecshare.control.link import PRODUCER_TO_CONSUMER, Drop, LinkSettings, SocketEvent, remaining_ms

log = logging.getLogger(__name__)

_STAT_NAMES: Final = (
    "received",
    *(f"dropped_{reason.value}" for reason in Drop),
    "sent",
    "send_dropped_queue_full",
)


class ControlClient(Watched):
    """A DEALER connected to one producer's control server.

    Use from one thread. Register `socket` with a `zmq.Poller` for POLLIN; when
    it is readable, call `recv(0)` until it returns None. Messages sent before
    the handshake completes are queued and go out after it. `state`, `failure`
    and `stats` may be read from any thread: a monitor thread keeps them current.
    """

    def __init__(
        self,
        endpoint: str,
        *,
        server_public_key: bytes | None,
        keys: KeyPair | None,
        insecure: bool = False,
        settings: LinkSettings = LinkSettings(),
        reconnect_ivl_s: float = 0.1,
        reconnect_ivl_max_s: float = 5.0,
        context: zmq.Context[Any] | None = None,
    ) -> None:
        _check_security(server_public_key=server_public_key, keys=keys, insecure=insecure)
        if not 0 < reconnect_ivl_s <= reconnect_ivl_max_s:
            raise ControlConfigError(
                f"need 0 < reconnect_ivl_s ({reconnect_ivl_s}) <= reconnect_ivl_max_s "
                f"({reconnect_ivl_max_s})"
            )
        self.endpoint = endpoint
        self.insecure = insecure
        self.settings = settings
        self.server_public_key = (
            None
            if server_public_key is None
            else require_z85_key(server_public_key, where=f"public key of producer {endpoint}")
        )
        self._codec = p.Codec(settings.max_frame_bytes)
        # State is written by the monitor thread and read by the owner's; the
        # condition lets wait_ready sleep until it changes.
        self._changed = threading.Condition()
        self._handshake = Handshake(
            endpoint=endpoint,
            insecure=insecure,
            client_key=keys.public if keys is not None else None,
            server_key=self.server_public_key,
        )
        self._closed = False
        # Written by the owner's thread only; the handshake's by the monitor thread.
        self._stats: dict[str, int] = dict.fromkeys(_STAT_NAMES, 0)
        self._watch: Watch | None = None

        context = context if context is not None else zmq.Context.instance()
        sock: zmq.Socket[bytes] = context.socket(zmq.DEALER)
        try:
            self.settings.apply(sock)
            # A fixed, unguessable routing id: after a reconnect the server's
            # ROUTER_HANDOVER gives us our pipe back, and no other client can claim it.
            sock.setsockopt(zmq.ROUTING_ID, _routing_id())
            sock.setsockopt(zmq.RECONNECT_IVL, max(1, round(reconnect_ivl_s * 1000)))
            sock.setsockopt(zmq.RECONNECT_IVL_MAX, max(1, round(reconnect_ivl_max_s * 1000)))
            if keys is not None and self.server_public_key is not None:
                sock.setsockopt(zmq.CURVE_SERVERKEY, self.server_public_key)
                sock.setsockopt(zmq.CURVE_PUBLICKEY, keys.public)
                sock.setsockopt(zmq.CURVE_SECRETKEY, keys.secret)
            else:
                log.warning(
                    "control client for %s runs with insecure=True: the connection is NOT "
                    "authenticated and NOT encrypted",
                    endpoint,
                )
            self._watch = watch(sock, MONITORED_EVENTS, self._apply)
            try:
                sock.connect(endpoint)
            except zmq.ZMQError as exc:
                raise ControlConfigError(
                    f"cannot connect to producer {endpoint!r}: {exc}"
                ) from None
        except BaseException:
            self._release(sock)
            raise
        self._socket = sock
        self._poller = zmq.Poller()
        self._poller.register(sock, zmq.POLLIN)

    # --- state --------------------------------------------------------------------------------

    @property
    def state(self) -> LinkState:
        """Where the connection stands, as libzmq last reported."""
        return self._handshake.state

    @property
    def failure(self) -> str | None:
        """Why the state is AUTH_FAILED, in words an operator can act on."""
        return self._handshake.failure

    def check(self) -> None:
        """Raise `AuthenticationFailed` if the producer refused this consumer (or vice versa)."""
        with self._changed:
            state, failure = self._handshake.state, self._handshake.failure
        if state is LinkState.AUTH_FAILED:
            raise AuthenticationFailed(self.endpoint, failure or "handshake failed")

    def wait_ready(self, timeout_ms: int) -> bool:
        """Wait for the handshake: True when READY, False on timeout; raises if refused."""
        deadline = time.monotonic() + timeout_ms / 1000
        with self._changed:
            while self._handshake.state not in (LinkState.READY, LinkState.AUTH_FAILED):
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._changed.wait(left)
        self.check()
        return True

    # --- messages -----------------------------------------------------------------------------

    @property
    def socket(self) -> zmq.Socket[bytes]:
        return self._socket

    @property
    def pollables(self) -> tuple[zmq.Socket[bytes], ...]:
        """The sockets to register with a poller for POLLIN.

        Just the DEALER: monitor events are read on a thread of their own.
        """
        return (self._socket,)

    def send(self, message: p.Message) -> bool:
        """Queue `message` without blocking; False (counted) if the queue is full.

        Raises `ProtocolError` if it encodes over the frame limit (a bug on this side).
        """
        self._check_open()
        frame = self._codec.encode(message)
        try:
            self._socket.send(frame, zmq.NOBLOCK)
        except zmq.Again:
            self._stats["send_dropped_queue_full"] += 1
            return False
        self._stats["sent"] += 1
        return True

    def recv(self, timeout_ms: int | None = 0) -> p.Message | None:
        """The next valid reply, waiting up to `timeout_ms` (None: forever)."""
        self._check_open()
        deadline = None if timeout_ms is None else time.monotonic() + timeout_ms / 1000
        while True:
            while True:
                taken = self._take()
                if taken is None:
                    break
                if not isinstance(taken, Drop):
                    return taken
            wait = remaining_ms(deadline, time.monotonic())
            if wait == 0:
                return None
            self._poller.poll(wait)

    @property
    def stats(self) -> dict[str, int]:
        """Counters: messages, drops per reason, connection events. Any thread may read."""
        return {**self._stats, **self._handshake.counters.snapshot()}

    # --- inside -------------------------------------------------------------------------------

    def _take(self) -> p.Message | Drop | None:
        """One queued reply: delivered, dropped (why), or None when nothing waits."""
        try:
            first = self._socket.recv(zmq.NOBLOCK, copy=False)
        except zmq.Again:
            return None
        count, more = 1, first.more
        while more:
            more = self._socket.recv(copy=False).more
            count += 1
        if count != 1:
            return self._drop(Drop.FRAME_COUNT, f"{count} frames")
        try:
            message = self._codec.decode(first.buffer)
        except p.ProtocolError as exc:
            return self._drop(Drop.MALFORMED, str(exc))
        if type(message) not in PRODUCER_TO_CONSUMER:
            return self._drop(Drop.UNEXPECTED_KIND, type(message).__name__)
        self._stats["received"] += 1
        return message

    def _drop(self, reason: Drop, detail: str) -> Drop:
        self._stats[f"dropped_{reason.value}"] += 1
        log.debug("dropped a reply from %s: %s: %s", self.endpoint, reason.value, detail)
        return reason

    def _apply(self, event: SocketEvent) -> None:
        """On the monitor thread: one libzmq event moves the state."""
        with self._changed:
            self._handshake.apply(event)
            self._changed.notify_all()

    def _check_open(self) -> None:
        if self._closed:
            raise ControlError(f"control client for {self.endpoint} is closed")


def _routing_id() -> bytes:
    # libzmq reserves routing ids that start with a zero byte for the ones it makes up.
    ident = os.urandom(16)
    return ident if ident[0] else b"\x01" + ident[1:]


def _check_security(
    *, server_public_key: bytes | None, keys: KeyPair | None, insecure: bool
) -> None:
    if insecure:
        if keys is not None or server_public_key is not None:
            raise ControlConfigError(
                "insecure=True together with CURVE keys: choose one (drop the keys, or "
                "insecure=True)"
            )
        return
    if keys is None:
        raise ControlConfigError(
            "the control client needs this consumer's CURVE key pair (keys=...); an "
            "unauthenticated connection must be asked for explicitly with insecure=True"
        )
    if server_public_key is None:
        raise ControlConfigError(
            "the control client needs the producer's CURVE public key (server_public_key=...)"
        )
