"""What both ends of a control connection share: socket settings, directions, events.

A server and a client configure their sockets the same way (frame limit,
ZMTP heartbeats, handshake deadline; only the client sends PINGs, the server
answers them), accept messages of one direction only,
and learn about handshakes from a libzmq socket monitor. Keeping that in one
place keeps the two ends from drifting apart.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Final

import zmq
from zmq.utils.monitor import recv_monitor_message

from ecshare import protocol as p
from ecshare.config import Config
from ecshare.control.errors import ControlConfigError

# Who may send what. A message of the other direction is a confused or hostile
# peer (a consumer sending `Welcome`), dropped like a malformed frame.
CONSUMER_TO_PRODUCER: Final[frozenset[type]] = frozenset(
    {
        p.Hello,
        p.FetchRequest,
        p.Release,
        p.Renew,
        p.Heartbeat,
        p.Bye,
        p.StatusRequest,
        p.PushReply,
        p.PushCredit,
        p.PushCreditVoid,
    }
)
PRODUCER_TO_CONSUMER: Final[frozenset[type]] = frozenset(
    {
        p.Welcome,
        p.FetchReply,
        p.Released,
        p.Renewed,
        p.HeartbeatAck,
        p.Error,
        p.StatusReply,
        p.PushOffer,
        p.PushDone,
        p.PushCredited,
        p.Located,
    }
)

# libzmq caps HEARTBEAT_TTL at 6553599 ms and keeps it in deciseconds.
_MAX_TTL_MS: Final = 6_553_500


class Drop(enum.Enum):
    """Why an inbound frame was dropped instead of delivered."""

    MALFORMED = "malformed"  # not a valid protocol message (ProtocolError)
    FRAME_COUNT = "frame_count"  # a multipart message of the wrong shape
    OVERSIZED = "oversized"  # over max_frame_bytes (libzmq normally disconnects first)
    UNEXPECTED_KIND = "unexpected_kind"  # valid, but never sent in this direction
    NO_IDENTITY = "no_identity"  # CURVE on, yet no authenticated User-Id: fail closed


@dataclass(frozen=True)
class LinkSettings:
    """Limits and timers both ends of a control connection apply to their socket."""

    max_frame_bytes: int = p.DEFAULT_MAX_FRAME_BYTES
    heartbeat_ivl_s: float = 1.0
    heartbeat_timeout_s: float = 5.0
    # Unauthenticated connections hold server resources only this long.
    handshake_timeout_s: float = 5.0
    # Small, so close() never hangs on a dead peer, yet a final Bye usually leaves.
    linger_ms: int = 100

    def __post_init__(self) -> None:
        if self.max_frame_bytes <= 0:
            raise ControlConfigError(
                f"max_frame_bytes must be positive, got {self.max_frame_bytes}"
            )
        for name in ("heartbeat_ivl_s", "heartbeat_timeout_s", "handshake_timeout_s"):
            value = getattr(self, name)
            if not value > 0:
                raise ControlConfigError(f"{name} must be positive, got {value}")
        if self.heartbeat_timeout_s <= self.heartbeat_ivl_s:
            raise ControlConfigError(
                f"heartbeat_timeout_s ({self.heartbeat_timeout_s}) must exceed heartbeat_ivl_s "
                f"({self.heartbeat_ivl_s}), or a healthy idle link is cut between two heartbeats"
            )
        if self.linger_ms < 0:
            raise ControlConfigError(f"linger_ms must be >= 0, got {self.linger_ms}")

    @classmethod
    def of(cls, config: Config) -> LinkSettings:
        """What `config` sets, for either end; `linger_ms` is not configurable."""
        return cls(
            max_frame_bytes=config.max_frame_bytes,
            heartbeat_ivl_s=config.heartbeat_interval_s,
            heartbeat_timeout_s=config.heartbeat_timeout_s,
            handshake_timeout_s=config.handshake_timeout_s,
        )

    def apply(self, sock: zmq.Socket[bytes], *, sends_pings: bool = True) -> None:
        """Set the frame limit, ZMTP heartbeats and handshake deadline on `sock`.

        With `sends_pings` False the socket sends no ZMTP PINGs of its own (and
        so has no heartbeat timer); it still answers its peers' PINGs and drops
        a peer whose PINGs stop for their TTL. The server runs so: libzmq 4.3.5
        aborts when a heartbeat timer fires on a connection that stopped reading
        and then failed (see `ControlServer`).
        """
        # libzmq disconnects a peer that sends a larger frame before buffering it,
        # so a hostile peer cannot make us allocate more than this per frame.
        sock.setsockopt(zmq.MAXMSGSIZE, self.max_frame_bytes)
        sock.setsockopt(zmq.HEARTBEAT_IVL, _ms(self.heartbeat_ivl_s) if sends_pings else 0)
        sock.setsockopt(zmq.HEARTBEAT_TIMEOUT, _ms(self.heartbeat_timeout_s))
        # TTL asks the other end to drop us too if our heartbeats stop arriving.
        sock.setsockopt(zmq.HEARTBEAT_TTL, min(_ms(self.heartbeat_timeout_s), _MAX_TTL_MS))
        sock.setsockopt(zmq.HANDSHAKE_IVL, _ms(self.handshake_timeout_s))
        sock.setsockopt(zmq.LINGER, self.linger_ms)


def _ms(seconds: float) -> int:
    return max(1, round(seconds * 1000))


@dataclass(frozen=True)
class SocketEvent:
    """One libzmq monitor event: what happened, its value (errno, status...), where."""

    kind: int
    value: int
    endpoint: str

    @property
    def name(self) -> str:
        try:
            return zmq.Event(self.kind).name or f"EVENT_{self.kind:#x}"
        except ValueError:
            return f"EVENT_{self.kind:#x}"


def read_events(monitor: zmq.Socket[bytes]) -> list[SocketEvent]:
    """Every event waiting on a monitor socket, without blocking."""
    events: list[SocketEvent] = []
    while True:
        try:
            raw = recv_monitor_message(monitor, zmq.NOBLOCK)
        except zmq.Again:
            return events
        endpoint = raw.get("endpoint", b"")
        events.append(
            SocketEvent(
                kind=int(raw["event"]),
                value=int(raw["value"]),
                endpoint=endpoint.decode("utf-8", "replace")
                if isinstance(endpoint, bytes)
                else str(endpoint),
            )
        )


def remaining_ms(deadline: float | None, now: float) -> int | None:
    """Milliseconds left before `deadline` (None: no deadline), never negative."""
    if deadline is None:
        return None
    return max(0, int((deadline - now) * 1000))
