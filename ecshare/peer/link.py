"""A consumer's link to one producer: session, liveness and quarantine.

    IDLE -> HELLO_SENT -> READY
      ^         |          |
      +--- QUARANTINED <---+   (auth or handshake failure, dead peer, repeated errors)

Only the Consumer's network thread touches a link.

A session the producer offers a fetch lane (ecshare/control/lane.py) sends its
FetchRequests and Releases there once the lane has connected, and reads their
answers there; everything else stays on ZMQ. A lane that breaks leaves the
session on ZMQ: the requests it had carried and not seen answered are sent again
over ZMQ with their request ids (the producer answers a repeat from its reply
cache, pinning nothing twice), and so are its unanswered Releases (releasing a
released grant does nothing), so a lost lane costs a round trip, never a fetch.

A grant is the session's that made it, and so are its Releases (docs/ARCHITECTURE.md,
invariant 4): `release` takes the session a grant was made on and drops the
Releases of any other, and a new session (`connect`) drops every Release still
queued, carried or unanswered from the one it replaces: that session's grants end
with their leases, or with the producer process that made them. Every way a session
ends is told to the consumer once (`ended`), so that nothing it held (push
reservations) outlives it unseen.
"""

from __future__ import annotations

import collections
import enum
import logging
import math
import time
import uuid
from collections.abc import Callable
from typing import Any

import zmq

from ecshare import protocol as p
from ecshare.config import Config
from ecshare.control import ClientPool, ControlClient, LaneClient, lane_host
from ecshare.peer.dataplane import peer_info
from ecshare.peer.peek import Peek
from ecshare.peer.transfer import FailureReason
from ecshare.transport.base import DataTransport, PeerInfo

log = logging.getLogger(__name__)

Problem = tuple[FailureReason, str]

# A Release waits up to this long for another message to this producer (the next
# FetchRequest, a heartbeat) and goes out right after it, so that the producer
# wakes once for both and the tail of a fetch is not spent on a round trip whose
# answer nobody waits for. Measured on 2 cores with a fetch every ~12 ms
# (benchmarks/ab_sporadic.py): the producer's thread spends about a quarter less
# CPU per fetch (530 against 700 us), with fetch latency unchanged; sent ahead of
# the request instead, the Release and its answer delayed the grant by 0.35 ms.
# Holding a finished grant a little longer only keeps the producer's pin that
# much longer; its lease still bounds it. It also counts against the session's
# limits on the producer for that long, so once a producer refuses for load, the
# link's Releases go at once and ahead of requests (`releases_ahead`).
RELEASE_DELAY_S = 0.05
# Requests remembered with their session past their timeout, for a late answer.
_REQUESTS_REMEMBERED = 4096


class PeerLinkState(enum.Enum):
    IDLE = "idle"
    HELLO_SENT = "hello_sent"
    READY = "ready"
    QUARANTINED = "quarantined"


class PeerLink:
    def __init__(
        self,
        endpoint: str,
        *,
        config: Config,
        pool: ClientPool,
        transport: DataTransport,
        hello: Callable[[str], p.Hello],
        count: Callable[[str], None] = lambda key: None,
        ended: Callable[[PeerLink], None] = lambda link: None,
        retire: Callable[[str], None] | None = None,
    ) -> None:
        """`ended(link)`: the session `link.session_id` has just ended, for good; the
        producer's agent is still loaded. `retire(agent)`: the link is done with that
        agent (default: the transport's `remove_peer`)."""
        self.endpoint = endpoint
        self._count = count
        self._ended = ended
        self._ended_session = ""  # the last session `ended` was told of
        self._retire_with = retire
        self._config = config
        self._pool = pool
        self._transport = transport
        self._hello = hello
        self.state = PeerLinkState.IDLE
        self.client: ControlClient | None = None
        self.session_id = ""
        self.agent = ""  # the producer's data-plane name, once welcomed
        self.server_name = ""  # the producer's own name, once welcomed
        self.region_size = 0
        self.max_batch_items = 1
        # From the producer's Welcome: the lease it grants and whether it renews.
        self.lease_s = 0.0
        self.renews = False
        self.releases_in_request = False  # Releases may ride in a FetchRequest
        self.direct = False  # the producer tells where entries lie (`p.Located`)
        # The producer is on this host (`peek`), or its last READ of at least a MiB
        # ended inside the read call, on a transport that may copy inside it: what a
        # caller's thread lent to a fetch can make there (`Consumer._lend`). Never set
        # where the transport cannot; a READ of a MiB that does not end in the call
        # unsets it.
        self.copies_in_call = False
        # The producer's region read straight from its memory, where it runs on this
        # host: how a direct read's tag is checked (`ecshare.peer.peek`).
        self.peek: Peek | None = None
        self.pushes = False  # both sides agreed to push on this session
        self.peer_info: PeerInfo | None = None  # the producer's data plane, as welcomed
        self._ping_interval_s = config.heartbeat_interval_s
        self.quarantine_reason = FailureReason.PEER_UNREACHABLE
        self.pending: dict[str, list[Any]] = {}  # request id -> transfers
        self._sent_at: dict[str, float] = {}
        # Releases riding in a request not yet answered: queued again if it times out.
        self._carried: dict[str, list[str]] = {}
        # The session each request of this session went out on, until answered (or the
        # session is replaced): the session its grants belong to.
        self._request_session: dict[str, str] = {}
        self._hello_at = 0.0
        # When the first ping the peer has not yet answered went out (0: none).
        self._unanswered_since = 0.0
        self._next_ping = 0.0
        self._quarantined_until = 0.0
        self._releases: list[str] = []
        self._releases_since = 0.0  # when the oldest queued release was queued
        self._releases_first = False  # see `releases_ahead`
        # Grant ids of each Renew sent, oldest first: the session answers in order.
        self._renewals: collections.deque[frozenset[str]] = collections.deque()
        # When the peer last said anything (monotonic; 0: never), for liveness metrics.
        self.last_heard = 0.0
        self.last_used = 0.0  # when a fetch last went to this peer
        self.created = time.monotonic()  # idle since then, until a first fetch
        self.lane: LaneClient | None = None
        self._lane_since = 0.0  # when the lane started connecting
        # Sent on the lane and not yet answered there: requests by id, Releases in order.
        self._on_lane: dict[str, p.FetchRequest] = {}
        self._lane_releases: collections.deque[p.Release] = collections.deque()

    # -- the session -------------------------------------------------------------------------

    def connect(self, now: float) -> None:
        """Start (or restart) the handshake; a no-op unless IDLE."""
        if self.state is not PeerLinkState.IDLE:
            return
        if self.client is None:
            self.client = self._pool.get(self.endpoint)
        self._close_lane(resend_requests=False)  # an old session's lane
        self._end_session()
        self._drop_releases()  # the old session's: its grants end with their leases
        self.session_id = uuid.uuid4().hex
        self._renewals.clear()  # answers of an old session never come on this one
        self.client.send(self._hello(self.session_id))
        self.state = PeerLinkState.HELLO_SENT
        self._hello_at = now

    def receive(self) -> list[p.Message]:
        assert self.client is not None
        out = []
        for _ in range(1024):
            msg = self.client.recv(timeout_ms=0)
            if msg is None:
                break
            out.append(msg)
        return out

    def on_message(self, msg: p.Message, now: float) -> Problem | None:
        """Session-level messages; returns a problem that should quarantine the peer."""
        self.heard(now)
        if isinstance(msg, p.Welcome):
            if self.state is not PeerLinkState.HELLO_SENT or msg.session_id != self.session_id:
                return None  # a stale welcome from an earlier handshake
            if msg.version not in p.SUPPORTED_VERSIONS:
                return (
                    FailureReason.INCOMPATIBLE,
                    f"producer {msg.server_name!r} answered in protocol version {msg.version},"
                    f" which this consumer did not offer ({list(p.SUPPORTED_VERSIONS)})",
                )
            dp = msg.data_plane
            if dp.kind != self._transport.kind:
                return (FailureReason.INCOMPATIBLE, f"producer data plane is {dp.kind}")
            if self._config.checksum != "none" and p.CAP_CHECKSUM_XXH3_64 not in msg.capabilities:
                return (
                    FailureReason.CHECKSUM_MISSING,
                    f"this consumer requires {self._config.checksum} checksums; "
                    "the producer does not compute them",
                )
            if msg.lease_ms <= 0:
                return (FailureReason.INCOMPATIBLE, "the producer grants no lease")
            info = peer_info(dp)
            try:
                agent = self._transport.add_peer(info)
            except Exception as exc:  # the transport names what it rejected
                return (FailureReason.TRANSPORT, f"cannot load producer data plane: {exc}")
            if self.agent and self.agent != agent:
                self._retire(self.agent)  # a restarted producer's old agent
            self.agent = agent
            self.peer_info = info
            self.pushes = p.CAP_PUSH in msg.capabilities
            self.region_size = dp.region_size
            self.max_batch_items = max(1, min(msg.max_batch_items, self._config.max_batch_items))
            self.lease_s = msg.lease_ms / 1000
            self.renews = p.CAP_RENEW in msg.capabilities
            self.releases_in_request = p.CAP_RELEASE_IN_REQUEST in msg.capabilities
            self.direct = self._config.direct_reads and p.CAP_READ_DIRECT in msg.capabilities
            self.drop_peek()
            self.peek = Peek.open(dp) if self.direct and self._config.tag_peek else None
            # A producer whose memory this process reads is on this host: over a
            # transport that may copy inside the call, its READs do (cross-memory
            # attach needs what the reader needed). Else: until a READ says so.
            self.copies_in_call = self.peek is not None and self._transport.may_copy_in_call
            # Ping at least as often as the producer pings its own side: it judges
            # our liveness on its own heartbeat settings.
            self._ping_interval_s = min(
                self._config.heartbeat_interval_s, msg.heartbeat_ms / 1000 or math.inf
            )
            self.state = PeerLinkState.READY
            self._next_ping = now + self._ping_interval_s
            self.server_name = msg.server_name
            log.info(
                "session with producer %r at %s open (protocol v%d)",
                msg.server_name,
                self.endpoint,
                msg.version,
            )
            if msg.lane is not None and self._config.fetch_lane and self.lane is None:
                self.lane = LaneClient(
                    lane_host(self.endpoint),
                    msg.lane,
                    session_id=self.session_id,
                    max_frame_bytes=self._config.max_frame_bytes,
                )
                self._lane_since = now
                self._count("lanes_opened")
                if self.lane.broken is not None:
                    self.lane_lost()
            return None
        if isinstance(msg, p.Released):
            self._count_n("releases_confirmed", len(msg.released))
            return None
        if isinstance(msg, p.HeartbeatAck | p.Renewed):
            return None
        if isinstance(msg, p.Error):
            if msg.code in (p.ErrorCode.VERSION_MISMATCH, p.ErrorCode.FINGERPRINT_MISMATCH):
                return (FailureReason.INCOMPATIBLE, msg.message)
            if msg.code is p.ErrorCode.NO_SESSION:
                # The producer restarted or expired us: a new handshake, same link.
                log.info("producer %s lost our session; saying hello again", self.endpoint)
                self._end_session()
                self.state = PeerLinkState.IDLE
                return None
            return (FailureReason.PEER_UNREACHABLE, f"{msg.code.value}: {msg.message}")
        return None

    def tick(self, now: float) -> Problem | None:
        """Timers: quarantine end, handshake timeout, heartbeats, liveness."""
        if self.state is PeerLinkState.QUARANTINED:
            if now >= self._quarantined_until:
                self.state = PeerLinkState.IDLE
            return None
        if self.client is not None:
            self.client.check()  # raises AuthenticationFailed with the reason
        cfg = self._config
        if (
            self.state is PeerLinkState.HELLO_SENT
            and now - self._hello_at > cfg.handshake_timeout_s
        ):
            return (
                FailureReason.PEER_UNREACHABLE,
                f"no welcome within {cfg.handshake_timeout_s} s",
            )
        lane = self.lane
        if lane is not None and lane.broken is not None:
            self.lane_lost()  # broken on a send from another thread (`request`)
        elif (
            lane is not None
            and not lane.connected
            and now - self._lane_since > cfg.handshake_timeout_s
        ):
            self.lane_lost("connect_timeout")
        if self.state is PeerLinkState.READY:
            # Silence counts from a ping left unanswered, not from when we last heard
            # the peer: while this thread was stalled (a long data-plane call) it sent
            # no pings, and the peer owed it nothing.
            unanswered = self._unanswered_since
            if unanswered and now - unanswered > cfg.heartbeat_timeout_s:
                return (FailureReason.PEER_UNREACHABLE, f"silent for {cfg.heartbeat_timeout_s} s")
            if now >= self._next_ping:
                assert self.client is not None
                self.flush_releases()  # the producer wakes for the ping anyway
                self.client.send(p.Heartbeat(session_id=self.session_id))
                self._next_ping = now + self._ping_interval_s
                self._unanswered_since = unanswered or now
        return None

    def next_deadline(self, now: float) -> float:
        if self.state is PeerLinkState.QUARANTINED:
            return self._quarantined_until
        if self.state is PeerLinkState.HELLO_SENT:
            return self._hello_at + self._config.handshake_timeout_s
        if self.state is PeerLinkState.READY:
            soonest = self._next_ping
            if self._releases:
                soonest = min(soonest, self._releases_since + RELEASE_DELAY_S)
            if self._unanswered_since:
                soonest = min(soonest, self._unanswered_since + self._config.heartbeat_timeout_s)
            for sent in self._sent_at.values():
                soonest = min(soonest, sent + self._config.request_timeout_s)
            return soonest
        return now + 1.0

    def quarantine(self, now: float, reason: FailureReason) -> None:
        # Say goodbye properly where the session still stands: grants whose reads
        # have ended go back now, rather than when the producer's lease runs out.
        self.flush_releases()
        self.close()
        self.quarantine_reason = reason
        self.state = PeerLinkState.QUARANTINED
        self._quarantined_until = now + self._config.quarantine_s
        self.pending.clear()
        self._sent_at.clear()
        self._renewals.clear()
        self._drop_releases()  # the session is gone: the producer's leases end them

    def close(self) -> None:
        # Its Releases go again ahead of the Bye: the producer ends the session, and
        # closes the lane unread, when the Bye comes.
        self._end_session()
        self._close_lane(resend_requests=False)
        if self.client is not None:
            if self.session_id and self.state is PeerLinkState.READY:
                self.flush_releases()
                self.client.send(p.Bye(session_id=self.session_id))
            self._pool.close(self.endpoint)
            self.client = None
        if self.agent:
            self._retire(self.agent)
            self.agent = ""
        self.drop_peek()
        if self.state is not PeerLinkState.QUARANTINED:
            self.state = PeerLinkState.IDLE

    def _retire(self, agent: str) -> None:
        (self._retire_with or self._transport.remove_peer)(agent)

    def _end_session(self) -> None:
        """Tell `ended` that the current session has ended (once per session)."""
        if self.session_id and self._ended_session != self.session_id:
            self._ended_session = self.session_id
            self._ended(self)

    def _drop_releases(self) -> None:
        """Forget every Release of the current session not yet known to have arrived."""
        dropped = len(self._releases) + sum(len(c) for c in self._carried.values())
        dropped += sum(len(r.grant_ids) for r in self._lane_releases)
        self._releases.clear()
        self._carried.clear()
        self._lane_releases.clear()
        self._request_session.clear()
        if dropped:
            self._count_n("releases_dropped_with_session", dropped)

    def _count_n(self, key: str, n: int) -> None:
        for _ in range(n):
            self._count(key)

    def drop_peek(self) -> None:
        """Close the reader of the producer's memory, if any: tags are READ from then on."""
        if self.peek is not None:
            self.peek.close()
            self.peek = None

    # -- requests and grants -----------------------------------------------------------------

    def request(
        self,
        request_id: str,
        items: list[p.ItemRequest],
        transfers: list[Any],
        now: float,
        *,
        lane_only: bool = False,
    ) -> None:
        """Send a FetchRequest: on the lane if it is up, else over ZMQ. With `lane_only`
        (another thread than the network thread, which may be polling the DEALER) ZMQ
        is not touched: what the lane fails to take, the network thread sends again
        over ZMQ when it sees the lane broken (`tick`)."""
        assert self.client is not None and self.state is PeerLinkState.READY
        self.pending[request_id] = transfers
        self._sent_at[request_id] = now
        self._request_session[request_id] = self.session_id
        if len(self._request_session) > _REQUESTS_REMEMBERED:  # requests never answered
            del self._request_session[next(iter(self._request_session))]
        self.last_used = now
        releases: list[str] = []
        if self.releases_in_request:
            # They ride in the request, applied before its grants and never answered:
            # one message each way instead of two.
            releases = self._releases[: p.MAX_BATCH_ITEMS]
            del self._releases[: p.MAX_BATCH_ITEMS]
            if releases:
                self._carried[request_id] = releases
        elif self._releases_first:
            self.flush_releases(lane_only=lane_only)
        request = p.FetchRequest(
            session_id=self.session_id, request_id=request_id, items=items, releases=releases
        )
        lane = self.lane
        if lane is not None and (lane.usable or lane_only):
            # Kept for a resend even if the send fails: the lane's loss resends it.
            self._on_lane[request_id] = request
            if lane.send(request):
                self._count("lane_requests")
            elif not lane_only:
                self.lane_lost()  # sends it again over ZMQ, with the others
        else:
            self.client.send(request)
        # Without the capability (or beyond one message's worth), after the request,
        # which the producer then answers first; its Released answer follows the grant
        # back, with no wake-up of its own on either side.
        self.flush_releases(lane_only=lane_only)

    def expired_requests(self, now: float) -> list[tuple[str, list[Any]]]:
        timeout = self._config.request_timeout_s
        expired = [rid for rid, sent in self._sent_at.items() if now - sent > timeout]
        out = []
        for rid in expired:
            del self._sent_at[rid]
            out.append((rid, self.pending.pop(rid, [])))
            # Unanswered, it may never have arrived: its Releases go again with the
            # next message (a second release of a grant does nothing).
            carried = self._carried.pop(rid, None)
            if carried:
                self.release(carried, self.session_id)
        return out

    def heard(self, now: float) -> None:
        self._unanswered_since = 0.0
        self.last_heard = now

    def oldest_unanswered(self) -> float:
        """When the oldest request still waiting for its answer was sent; 0.0: none."""
        return min(self._sent_at.values(), default=0.0)

    def answered(self, request_id: str) -> str:
        """An answer to `request_id` came: the session it was sent on ("" if not this
        link's current session, whose grants are then no longer ours to release)."""
        self._sent_at.pop(request_id, None)
        self._carried.pop(request_id, None)
        self._on_lane.pop(request_id, None)
        return self._request_session.pop(request_id, "")

    def release(self, grant_ids: list[str], session_id: str) -> None:
        """Queue Releases of grants made on `session_id` whose reads have ended (see
        `RELEASE_DELAY_S`). Those of another session than the current one are dropped:
        their session has ended, and a grant id names a grant only on its own session."""
        grant_ids = [g for g in grant_ids if g]
        if not grant_ids:
            return
        if not session_id or session_id != self.session_id:
            self._count_n("releases_dropped_stale", len(grant_ids))
            return
        if not self._releases:
            self._releases_since = time.monotonic()
        self._releases.extend(grant_ids)

    def releases_ahead(self) -> None:
        """The producer refused for load: from now on queued Releases go out at once
        and ahead of each request, so that its per-session limits see them first."""
        self._releases_first = True
        self.flush_releases()

    def releases_due(self, now: float) -> bool:
        """Queued releases have waited long enough, or fill a message."""
        return bool(self._releases) and (
            self._releases_first
            or now >= self._releases_since + RELEASE_DELAY_S  # as next_deadline computes it
            or len(self._releases) >= p.MAX_BATCH_ITEMS
        )

    def renew(self, grant_ids: list[str]) -> None:
        """Ask for longer leases on grants still being read (the caller checked `renews`)."""
        assert self.client is not None and self.state is PeerLinkState.READY
        for i in range(0, len(grant_ids), p.MAX_BATCH_ITEMS):
            batch = grant_ids[i : i + p.MAX_BATCH_ITEMS]
            self._renewals.append(frozenset(batch))
            self.client.send(p.Renew(session_id=self.session_id, grant_ids=batch))

    def renewal_answered(self) -> frozenset[str]:
        """The grant ids of the Renew that a Renewed just answered."""
        return self._renewals.popleft() if self._renewals else frozenset()

    def flush_releases(self, *, lane_only: bool = False) -> None:
        """Send the queued Releases (on the lane if up). With `lane_only` they wait
        for the network thread unless the lane is up (see `request`)."""
        if not self._releases or self.client is None or self.state is not PeerLinkState.READY:
            return
        lane = self.lane if self.lane is not None and self.lane.usable else None
        if lane is None and lane_only:
            return
        batch, self._releases = self._releases, []
        for i in range(0, len(batch), p.MAX_BATCH_ITEMS):
            release = p.Release(
                session_id=self.session_id, grant_ids=batch[i : i + p.MAX_BATCH_ITEMS]
            )
            if lane is not None and (lane.send(release) or lane_only):
                self._lane_releases.append(release)  # a failed one goes with the lane's loss
            else:
                self.client.send(release)
        if lane is not None and lane.broken is not None and not lane_only:
            self.lane_lost()

    # -- the fetch lane ----------------------------------------------------------------------

    def pollables(self) -> list[tuple[object, int]]:
        """What to poll for this link, with the flags: the DEALER, and the lane's socket."""
        out: list[tuple[object, int]] = []
        if self.client is not None:
            out.extend((s, zmq.POLLIN) for s in self.client.pollables)
        if self.lane is not None:
            out.append((self.lane.fileno(), self.lane.poll_flags))
        return out

    def receive_lane(self, flags: int) -> list[p.Message]:
        """What came on the lane (the poll said `flags`); a lane that broke is given up."""
        lane = self.lane
        assert lane is not None
        out = lane.on_event(flags)
        for msg in out:
            if isinstance(msg, p.Released) and self._lane_releases:
                self._lane_releases.popleft()
        if lane.broken is not None:
            self.lane_lost()
        return out

    def lane_lost(self, reason: str = "") -> None:
        """The lane is gone: the session goes on over ZMQ, and what the lane carried
        unanswered goes again there."""
        lane = self.lane
        if lane is None:
            return
        self._count(f"lanes_lost.{reason or lane.broken or 'closed'}")
        resent = self._close_lane(resend_requests=True)
        if resent:
            self._count("lane_resent")

    def _close_lane(self, *, resend_requests: bool) -> bool:
        """Close the lane; send its unanswered Releases (and requests, if asked) over
        ZMQ. True if there were any."""
        lane, self.lane = self.lane, None
        if lane is None:
            return False
        lane.close()
        requests = [r for rid, r in self._on_lane.items() if rid in self.pending]
        if not resend_requests:
            requests = []
        releases = list(self._lane_releases)
        self._on_lane.clear()
        self._lane_releases.clear()
        if self.client is None or self.state is not PeerLinkState.READY:
            return False
        for request in requests:
            self.client.send(request)
        for release in releases:
            self.client.send(release)
        return bool(requests or releases)
