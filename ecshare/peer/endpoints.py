"""Where the producer's requests come in: its control server, fetch lane and waker.

The ZMQ ROUTER (CURVE, the allow-list), the TLS fetch lane (`fetch_lane`) and a
`Waker` for other threads are polled together by the producer's loop. A message
that came on a session's lane is served as if from that session's own ROUTER
route and key, and answered on the lane. Without a lane port asked for, a lane
that cannot bind leaves the producer serving over ZMQ alone (counted
`lane_unavailable`); one asked for and not had fails the start.

While a transport needs this loop's progress (`nap`), the loop waits well under
a millisecond, which zmq's poll cannot (whole milliseconds); it selects on the
sockets' descriptors instead. A ZMQ_FD turns readable when the socket may have
news, so a request that comes mid-wait is answered at once rather than after a
blind sleep; a spurious wake-up costs one more empty poll.
"""

from __future__ import annotations

import logging
import select
from collections.abc import Callable

import zmq

from ecshare import protocol as p
from ecshare.config import Config
from ecshare.control import ControlServer, KeyPair, LaneServer, LinkSettings, Waker
from ecshare.peer.grants import Session

log = logging.getLogger(__name__)

# The longest wait between progress calls while a transport needs them; it ends
# early when a message or wake-up arrives.
_ACTIVE_POLL_S = 0.0002
# Messages read off the ROUTER per pass at most, so that reaping is never starved.
_DRAIN_MAX = 1024

# Answers one request: (route, user, message) -> the reply, or None.
Serve = Callable[[bytes, str, p.Message], p.Message | None]


class Endpoints:
    """The producer's sockets, bound on creation; use from the producer's thread only."""

    def __init__(
        self,
        config: Config,
        *,
        keys: KeyPair | None,
        authorized: frozenset[bytes],
        name: str,
        count: Callable[[str, int], None],
    ) -> None:
        """Binds the control server and (with `fetch_lane`) the lane; raises what stops
        either, having closed whatever it bound."""
        cfg = config
        server: ControlServer | None = None
        waker: Waker | None = None
        try:
            server = ControlServer(
                host=cfg.listen_host,
                port=cfg.listen_port,
                keys=keys,
                authorized=authorized,
                insecure=cfg.insecure,
                settings=LinkSettings.of(cfg),
                name=f"{name} control server",
            )
            waker = Waker()
            self._poller = zmq.Poller()
            self.lanes: LaneServer | None = None
            if cfg.fetch_lane:
                try:
                    self.lanes = LaneServer(
                        host=cfg.listen_host,
                        port=cfg.lane_port,
                        poller=self._poller,
                        max_frame_bytes=cfg.max_frame_bytes,
                        bind_timeout_s=cfg.handshake_timeout_s,
                        name=f"{name} lane server",
                    )
                except OSError as exc:  # sessions go on over ZMQ, as without a lane
                    if cfg.lane_port:  # a port asked for and not had: start() says so
                        raise
                    log.warning("%s: no fetch lane (%s); serving over ZMQ only", name, exc)
                    count("lane_unavailable", 1)
        except BaseException:
            for part in (server, waker):  # their ports and descriptors go with it
                if part is not None:
                    part.close()
            raise
        self.server = server
        self.waker = waker
        for pollable in server.pollables:
            self._poller.register(pollable, zmq.POLLIN)
        self._poller.register(waker, zmq.POLLIN)
        self._wait_fds = [int(s.getsockopt(zmq.FD)) for s in server.pollables]
        self._wait_fds.append(waker.fileno())

    @property
    def port(self) -> int:
        return self.server.port

    @property
    def stats(self) -> dict[str, int]:
        """The control server's counters (drops per reason, handshakes), and the lane's."""
        stats = self.server.stats
        return {**stats, **self.lanes.stats} if self.lanes is not None else stats

    def poll(self, timeout_ms: int) -> dict[object, int]:
        return dict(self._poller.poll(timeout_ms))

    def woken(self, events: dict[object, int]) -> bool:
        """Whether another thread woke the loop (and clear it)."""
        woken = self.waker.fileno() in events  # zmq.Poller reports it by descriptor
        if woken:
            self.waker.clear()
        return woken

    def serve(
        self,
        events: dict[object, int],
        woken: bool,
        serve: Serve,
        find: Callable[[str], Session | None],
    ) -> None:
        """Answer what came in: on the ROUTER, and on lanes (`find` names their sessions)."""
        # zmq.Poller reports the ROUTER while messages wait (level, not edge), so a
        # pass woken by a lane alone skips the empty ROUTER read (tens of us cold).
        if woken or self.server.socket in events:
            self._drain(serve)
        if self.lanes is not None and events:
            self._drain_lanes(events, serve, find)

    def _drain(self, serve: Serve) -> None:
        for _ in range(_DRAIN_MAX):
            inbound = self.server.recv(timeout_ms=0)
            if inbound is None:
                return
            reply = serve(inbound.peer, inbound.user, inbound.message)
            if reply is not None:
                self.server.send(inbound.peer, reply)

    def _drain_lanes(
        self,
        events: dict[object, int],
        serve: Serve,
        find: Callable[[str], Session | None],
    ) -> None:
        lanes = self.lanes
        assert lanes is not None
        for session_id, msg in lanes.receive(events):
            session = find(session_id)
            if session is None:  # ended while its lane still had frames queued
                lanes.forget(session_id)
                continue
            reply = serve(session.route, session.user, msg)
            if reply is not None:
                lanes.send(session_id, reply)

    def nap(self) -> None:
        """Wait at most `_ACTIVE_POLL_S`, less if anything comes in meanwhile."""
        lane_fds = self.lanes.fds() if self.lanes is not None else []
        select.select(self._wait_fds + lane_fds, [], [], _ACTIVE_POLL_S)

    def close(self) -> None:
        if self.lanes is not None:
            self.lanes.close()
        self.server.close()
        self.waker.close()
