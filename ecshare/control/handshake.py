"""What libzmq's socket events say about one client connection: a state and a reason.

libzmq reconnects on its own and never says why a connection does not come
up; a consumer with the wrong key would just see its requests time out. This
state machine turns monitor events into an explicit `LinkState`, and a
refusal into a sentence that names the key at fault:

    CONNECTING --handshake ok--> READY --disconnected--> DISCONNECTED --ok--> READY
         \\                                                   /
          +--refused / mismatch / closed twice--> AUTH_FAILED(reason)

AUTH_FAILED is final when libzmq stops retrying (a ZAP refusal or a mechanism
mismatch is a protocol error, after which it does not reconnect). After bare
closes it keeps retrying, and a later successful handshake moves to READY.
"""

from __future__ import annotations

import enum
import logging
from typing import Final

import zmq

from ecshare.control.link import SocketEvent
from ecshare.counts import Counts

log = logging.getLogger(__name__)

# A CURVE server that cannot decrypt our HELLO (we hold the wrong server key) just
# closes the connection, which the client sees as a bare "no detail" failure. One
# can be a producer restarting mid-handshake; this many in a row is a wrong key.
_CLOSES_MEANING_REFUSAL: Final = 2

MONITORED_EVENTS: Final = (
    zmq.EVENT_CONNECTED
    | zmq.EVENT_DISCONNECTED
    | zmq.EVENT_HANDSHAKE_SUCCEEDED
    | zmq.EVENT_HANDSHAKE_FAILED_AUTH
    | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
    | zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL
)
COUNTER_NAMES: Final = ("connected", "disconnected", "handshake_succeeded", "handshake_failed")


class LinkState(enum.Enum):
    """Where a client's connection stands."""

    CONNECTING = "connecting"  # never authenticated yet; libzmq is trying
    READY = "ready"  # handshake done: requests flow
    DISCONNECTED = "disconnected"  # was ready, lost the connection; libzmq reconnects
    AUTH_FAILED = "auth_failed"  # refused: see `failure`; the same keys will not do


class Handshake:
    """The state of one client connection, moved by `apply(event)` on one thread; its
    `counters` may be read from any."""

    def __init__(
        self,
        *,
        endpoint: str,
        insecure: bool,
        client_key: bytes | None,
        server_key: bytes | None,
    ) -> None:
        self.endpoint = endpoint
        self.insecure = insecure
        self._client_key = client_key.decode("ascii") if client_key else "?"
        self._server_key = server_key.decode("ascii") if server_key else "?"
        self.state = LinkState.CONNECTING
        self.failure: str | None = None
        self.counters = Counts(dict.fromkeys(COUNTER_NAMES, 0))
        self._closes_in_a_row = 0

    def apply(self, event: SocketEvent) -> None:
        kind = event.kind
        if kind == zmq.EVENT_CONNECTED:
            self.counters.add("connected")
        elif kind == zmq.EVENT_DISCONNECTED:
            self.counters.add("disconnected")
            if self.state is LinkState.READY:
                self.state = LinkState.DISCONNECTED
                log.info("control link to %s lost; reconnecting", self.endpoint)
        elif kind == zmq.EVENT_HANDSHAKE_SUCCEEDED:
            self.counters.add("handshake_succeeded")
            self._closes_in_a_row = 0
            if self.state is LinkState.AUTH_FAILED:
                log.info("control link to %s authenticated after all", self.endpoint)
            self.state, self.failure = LinkState.READY, None
        elif kind == zmq.EVENT_HANDSHAKE_FAILED_AUTH:
            self._fail(self._refused(event.value))
        elif kind == zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL:
            self._fail(self._protocol_error(event.value))
        elif kind == zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL:
            self._closes_in_a_row += 1
            if self._closes_in_a_row >= _CLOSES_MEANING_REFUSAL:
                self._fail(self._closed(event.value))
            else:
                self.counters.add("handshake_failed")

    def _fail(self, reason: str) -> None:
        self.counters.add("handshake_failed")
        if self.state is not LinkState.AUTH_FAILED:  # once, not at every reconnect
            log.error("control link to %s: %s", self.endpoint, reason)
        self.state, self.failure = LinkState.AUTH_FAILED, reason

    def _refused(self, status: int) -> str:
        where = f"producer at {self.endpoint}"
        if status == 400:
            return (
                f"{where} rejected this consumer's CURVE key {self._client_key}: it is not "
                "on the producer's allow-list (add it to the producer's authorized keys)"
            )
        if status == 300:
            return f"{where} temporarily refused authentication (ZAP status 300)"
        return f"{where} could not authenticate this consumer (ZAP status {status}); see its log"

    def _protocol_error(self, code: int) -> str:
        where = f"producer at {self.endpoint}"
        if code == zmq.PROTOCOL_ERROR_ZMTP_MECHANISM_MISMATCH:
            if self.insecure:
                return (
                    f"{where} requires CURVE authentication, but this consumer runs with "
                    "insecure=True: configure the producer's public key and a key pair here"
                )
            return (
                f"{where} does not use CURVE (it runs with insecure=True, or is not an "
                "ecshare control server); this consumer will not fall back to an "
                "unauthenticated, unencrypted connection"
            )
        if code == zmq.PROTOCOL_ERROR_ZMTP_CRYPTOGRAPHIC:
            return (
                f"{where} sent a handshake that does not decrypt with the server public key "
                f"configured here ({self._server_key}): that key is most likely not the "
                "producer's"
            )
        return f"handshake with {where} failed: ZMTP protocol error {_protocol_error_name(code)}"

    def _closed(self, errno_value: int) -> str:
        where = f"producer at {self.endpoint}"
        times = f"{self._closes_in_a_row} times in a row"
        if self.insecure:
            return (
                f"{where} closed the connection during the handshake {times}: it most likely "
                "requires CURVE authentication, and this consumer runs with insecure=True"
            )
        # Which of the two it is depends on which side read the other's greeting
        # first; a mechanism mismatch, when libzmq reports it, replaces this message.
        return (
            f"{where} closed the connection during the CURVE handshake {times} "
            f"(errno {errno_value}): the server public key this consumer uses for it "
            f"({self._server_key}) is most likely not the producer's (check "
            "server_public_key), or the producer runs without CURVE (insecure=True), "
            "or a TCP proxy or load balancer in front of it has no producer behind it"
        )


def _protocol_error_name(code: int) -> str:
    for name in dir(zmq):
        if name.startswith("PROTOCOL_ERROR_") and getattr(zmq, name) == code:
            return f"{name} ({code:#x})"
    return f"{code:#x}"
