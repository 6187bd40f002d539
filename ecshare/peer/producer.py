"""The Producer: grants authenticated consumers reads of READY entries.

All network work runs on the Producer's own thread, which blocks in a ZMQ
poll and answers within microseconds whatever the engine is doing. The engine
only writes entries into the shared `Store`; nothing here blocks it.

A grant pins one entry under (session, grant id). It ends on the consumer's
Release (sent once the read has ended) or on lease expiry, whichever comes
first, and a block is never reused while a grant on its entry may still be
read. A session ending (Bye, or heartbeats stopping) does not end its grants:
a read may still be moving over the data plane while the control plane is
cut, so they run to their leases (the consumer gives up before then).

A Release ends only a grant of the process and session that made it (docs/ARCHITECTURE.md,
invariant 4): a grant id is never reused, not even by a later process on the same
endpoint, since each carries this producer's random epoch; and a session's Release
(or completion notice) names only that session's grants. A consumer's Releases that
outlive a restart of ours match nothing here and are counted (`releases_unmatched`).

Sessions that agreed to direct reads (`read.direct`) are also told, unasked,
where each entry committed from then on lies, with its tag and (small ones) its
digest (`Located`, made by `peer.locator.Locator`); such a consumer reads it with
no grant and keeps it only if the tag or the digest says the bytes were the
entry's. Nothing is pinned for those reads: the blocks of an entry evicted
meanwhile may be reused, which those checks catch.
"""

from __future__ import annotations

import itertools
import logging
import secrets
import select
import threading
import time
from collections import OrderedDict
from concurrent.futures import Future
from dataclasses import dataclass, field

import zmq

from ecshare import protocol as p
from ecshare.config import Config
from ecshare.control import ControlServer, KeyPair, LaneServer, LinkSettings, Waker
from ecshare.counts import Counts
from ecshare.errors import IllegalTransition
from ecshare.peer.dataplane import announced, peer_info
from ecshare.peer.locator import Locator
from ecshare.peer.notices import Notices
from ecshare.peer.phases import PhaseLog
from ecshare.peer.pusher import Pusher, PushOutcome, PushState, PushTarget
from ecshare.peer.status import SessionView, status_reply
from ecshare.peer.thread import NetworkThread
from ecshare.store import EntryState, NotFound, NotReady, Store, StoreError
from ecshare.transport.base import DataTransport, PeerInfo, writer_of

log = logging.getLogger(__name__)

# Cached replies per session, so that a duplicate FetchRequest (a retry after a
# lost reply) returns the same grants instead of pinning again. Only replies that
# granted something are kept: a refusal pins nothing, so a repeat is answered
# afresh. A session's cache is bounded in replies and in items (at least one full
# batch), so that no peer makes the producer hold more than that for it.
_REPLY_CACHE_PER_SESSION = 256
_REPLY_CACHE_ITEMS_PER_SESSION = 1024
# While grants are outstanding the data plane may need target-side progress
# (UCX over TCP does). A transport that progresses by itself (NIXL's progress
# thread, asleep until UCX has an event) needs nothing from this loop, which then
# sleeps in poll whatever is outstanding. Otherwise the loop drives progress at
# least this often while grants are outstanding; the wait between progress calls
# ends early when a message or wake-up arrives (see `_run`).
_ACTIVE_POLL_S = 0.0002


SESSION_OWNER_PREFIX = "session:"


def pin_owner(session_id: str) -> str:
    """The entry-table owner of a session's grants."""
    return SESSION_OWNER_PREFIX + session_id


@dataclass(eq=False)
class _Session:
    session_id: str
    user: str  # the authenticated CURVE public key (Z85); "" when insecure
    route: bytes
    client_name: str
    agent_name: str
    version: int
    last_seen: float
    grants: dict[str, int] = field(default_factory=dict)  # grant id -> bytes it pins
    # Pins are held under this owner name in the entry table: session ids are
    # chosen by clients, so they get a namespace of their own that no other
    # owner (the engine's own load pins, say) can share.
    owner: str = ""

    def __post_init__(self) -> None:
        self.owner = pin_owner(self.session_id)

    pinned_bytes: int = 0  # the sum of `grants`, kept as they come and go
    push_name: str = ""  # the consumer accepts pushes under this name ("": none)
    replies: OrderedDict[str, p.FetchReply] = field(default_factory=OrderedDict)
    cached_items: int = 0  # items in `replies`
    direct: bool = False  # reads directly: told where each committed entry lies

    def cache(self, reply: p.FetchReply, max_items: int) -> None:
        """Keep `reply` for repeats of its request, dropping the oldest past the bounds."""
        self.replies[reply.request_id] = reply
        self.cached_items += len(reply.items)
        while len(self.replies) > _REPLY_CACHE_PER_SESSION or self.cached_items > max_items:
            _, old = self.replies.popitem(last=False)
            self.cached_items -= len(old.items)

    def forget(self, grant_id: str) -> bool:
        """Drop a grant from the books (the caller holds the producer's lock)."""
        nbytes = self.grants.pop(grant_id, None)
        if nbytes is None:
            return False
        self.pinned_bytes -= nbytes
        return True


class Producer(NetworkThread):
    """Serves grants on `config.listen_host:listen_port` from its own thread."""

    def __init__(
        self,
        store: Store,
        config: Config,
        *,
        fingerprint: str,
        transport: DataTransport,
        keys: KeyPair | None,
        authorized: frozenset[bytes],
        admins: frozenset[bytes] = frozenset(),
        name: str = "ecshare-producer",
    ) -> None:
        self._store = store
        self._config = config
        self._fingerprint = fingerprint
        self._transport = transport
        self._keys = keys
        self._authorized = authorized
        # May query status (see peer/status.py); not a licence to open sessions.
        self._admins = admins
        self._name = name
        self._init_thread()
        self._sessions: dict[str, _Session] = {}
        self._grant_ids = itertools.count(1)
        # Names this process in its grant ids: a restarted producer reuses no id.
        self._epoch = secrets.token_hex(8)
        # Grants of ended sessions, left to run to their leases (session, grant id).
        # While any remain, reads may still be moving and need our progress.
        self._lingering: set[tuple[str, str]] = set()
        self._server: ControlServer | None = None
        self._lanes: LaneServer | None = None  # with config.fetch_lane, once serving
        self._lock = threading.Lock()  # guards the session snapshot
        self.counters = Counts()
        self.started_at = time.time()
        # Per-item timestamps of each step (see peer/phases.py); off unless set.
        self._phases: PhaseLog | None = None
        self._woke_at = 0.0  # with phases: when the loop's poll last returned
        # Shared with a Consumer over the same transport: each takes its own notices.
        self._notices = Notices.of(transport)
        writer = writer_of(transport)
        self._pusher = (
            Pusher(store, config, writer, count=self._add) if writer is not None else None
        )
        # Direct reads need a data plane that serves them without this loop: a read
        # nobody granted gets no progress from it.
        self._direct = config.direct_reads and transport.self_progressing
        self._locator = Locator(store, self._wake_up)

    @property
    def phases(self) -> PhaseLog | None:
        """Per-item timestamps of each step of a fetch and a push (peer/phases.py)."""
        return self._phases

    @phases.setter
    def phases(self, log: PhaseLog | None) -> None:
        self._phases = log
        if self._pusher is not None:
            self._pusher.phases = log

    # -- engine-facing -----------------------------------------------------------------------

    def push(self, mm_hash: str, to: str) -> Future[PushOutcome]:
        """Offer the READY entry `mm_hash` to the consumer that accepts pushes as `to`,
        and write it into the region it reserves. Never blocks: the offer, the write
        and the report run on the network thread; the future says how it ended.

        A push that is refused, fails or is late costs nothing but its own time: the
        consumer pulls the item as it would have. Pushing the same item to the same
        consumer again while the first push runs joins it.
        """
        if self._thread is None:
            raise RuntimeError("producer not started")
        if self._pusher is None:
            future: Future[PushOutcome] = Future()
            future.set_result(
                PushOutcome(mm_hash, to, PushState.REFUSED, "this data plane cannot write")
            )
            return future
        future = self._pusher.request(mm_hash, to)
        if self._waker is not None:
            self._waker.wake()
        return future

    def pushes_in_flight(self) -> int:
        return self._pusher.in_flight if self._pusher is not None else 0

    def largest_push_in_flight(self) -> int:
        """The size of the largest push offered or being written now, 0 if none (any
        thread): the source entry of each stays pinned until its write has ended."""
        return self._pusher.largest_in_flight() if self._pusher is not None else 0

    def push_names(self) -> frozenset[str]:
        """The names of the consumers that hold a session accepting pushes now (any
        thread): a `push` to any other name is refused at once ("no push session")."""
        return self._pusher.target_names() if self._pusher is not None else frozenset()

    # -- lifecycle ---------------------------------------------------------------------------

    def stop(self) -> None:
        super().stop()
        if self._pusher is not None:
            self._pusher.stop()
        # Every grant ends with the producer: its data plane closes with it.
        for session in list(self._sessions.values()):
            self._end_session(session, "shutdown", keep_leases=False)
        for owner, grant_id in list(self._lingering):
            self._store.unpin(owner, grant_id)
        self._lingering.clear()

    @property
    def port(self) -> int:
        assert self._server is not None, "producer not started"
        return self._server.port

    @property
    def address(self) -> str:
        """The endpoint consumers connect to (the advertised host)."""
        host = self._config.advertised_host
        return f"tcp://{host}:{self.port}"

    @property
    def lane_port(self) -> int | None:
        """The TCP port of the fetch lane (config.fetch_lane), beside `port`; None without."""
        lanes = self._lanes
        return lanes.port if lanes is not None else None

    @property
    def fingerprint(self) -> str:
        return self._fingerprint

    def session_count(self) -> int:
        with self._lock:
            return len(self._sessions)

    def active_grants(self) -> int:
        with self._lock:
            return sum(len(s.grants) for s in self._sessions.values())

    def grants_by_session(self) -> dict[str, list[str]]:
        """Each open session's outstanding grant ids, sorted: a copy, for any thread."""
        with self._lock:
            return {sid: sorted(s.grants) for sid, s in self._sessions.items()}

    def _sessions_of(self, user: str) -> int:
        return sum(1 for s in self._sessions.values() if s.user == user)

    def cached_replies(self) -> dict[str, tuple[int, int]]:
        """Each open session's cached replies and the items in them, for any thread."""
        with self._lock:
            return {sid: (len(s.replies), s.cached_items) for sid, s in self._sessions.items()}

    @property
    def control_stats(self) -> dict[str, int]:
        """The control server's counters (drops per reason, handshakes); empty before start."""
        server, lanes = self._server, self._lanes
        stats = server.stats if server is not None else {}
        return {**stats, **lanes.stats} if lanes is not None else stats

    # -- the network thread ------------------------------------------------------------------

    def _run(self) -> None:
        try:
            cfg = self._config
            self._server = ControlServer(
                host=cfg.listen_host,
                port=cfg.listen_port,
                keys=self._keys,
                authorized=self._authorized | self._admins,
                insecure=cfg.insecure,
                settings=LinkSettings.of(cfg),
                name=f"{self._name} control server",
            )
            self._waker = Waker()
            poller = zmq.Poller()
            if cfg.fetch_lane:
                try:
                    self._lanes = LaneServer(
                        host=cfg.listen_host,
                        port=cfg.lane_port,
                        poller=poller,
                        max_frame_bytes=cfg.max_frame_bytes,
                        bind_timeout_s=cfg.handshake_timeout_s,
                        name=f"{self._name} lane server",
                    )
                except OSError as exc:  # sessions go on over ZMQ, as without a lane
                    if cfg.lane_port:  # a port asked for and not had: start() says so
                        raise
                    log.warning("%s: no fetch lane (%s); serving over ZMQ only", self._name, exc)
                    self._count("lane_unavailable")
        except BaseException as exc:  # reported to start()'s caller
            for part in (self._server, self._waker):  # their ports and descriptors go with it
                if part is not None:
                    part.close()
            self._started(exc)
            return
        self._started(None)
        self._notices.join("grant")
        if self._direct:
            self._locator.start()
        for pollable in self._server.pollables:
            poller.register(pollable, zmq.POLLIN)
        poller.register(self._waker, zmq.POLLIN)
        # zmq polls in whole milliseconds, so the sub-millisecond wait while
        # grants are active selects on the sockets' descriptors instead. A
        # ZMQ_FD turns readable when the socket may have news, so a request
        # that comes in mid-wait is answered at once rather than after a blind
        # sleep; a spurious wake-up costs one more empty poll.
        wait_fds = [int(s.getsockopt(zmq.FD)) for s in self._server.pollables]
        wait_fds.append(self._waker.fileno())
        next_reap = 0.0
        polled = not self._transport.self_progressing
        try:
            pusher = self._pusher
            while not self._stop.is_set():
                active = (polled and bool(self.active_grants() or self._lingering)) or (
                    pusher is not None and pusher.writing
                )
                timeout_ms = 0 if active else int(cfg.reap_interval_s * 1000)
                events = dict(poller.poll(timeout_ms))
                if self.phases is not None:
                    self._woke_at = time.monotonic()
                woken = self._waker.fileno() in events  # zmq.Poller reports it by descriptor
                if woken:
                    self._waker.clear()
                    if pusher is not None:
                        pusher.offer_requested()
                # zmq.Poller reports the ROUTER while messages wait (level, not edge), so a
                # pass woken by a lane alone skips the empty ROUTER read (tens of us cold).
                if woken or self._server.socket in events:
                    self._drain()
                if self._lanes is not None and events:
                    self._drain_lanes(events)
                if self._locator.pending:
                    self._tell_located()
                # Reap right after draining, never after progress: a progress call
                # that stalled the thread must not make sessions whose heartbeats
                # wait unread in the socket look dead, and free their pins.
                now = time.monotonic()
                if now >= next_reap:
                    self._reap(now)
                    next_reap = now + cfg.reap_interval_s
                for agent, note in self._notices.take("grant"):
                    self._on_notification(agent, note)
                if pusher is not None:
                    pusher.step(time.monotonic())
                if active and not events:
                    lane_fds = self._lanes.fds() if self._lanes is not None else []
                    select.select(wait_fds + lane_fds, [], [], _ACTIVE_POLL_S)
        except BaseException as exc:
            log.exception("producer network thread failed; it serves no grants any more")
            self.failure = exc
            raise
        finally:
            self._locator.stop()
            self._notices.leave("grant")
            if self._lanes is not None:
                self._lanes.close()
            self._server.close()
            self._waker.close()

    def _drain(self) -> None:
        assert self._server is not None
        for _ in range(1024):  # bounded, so reaping is never starved
            inbound = self._server.recv(timeout_ms=0)
            if inbound is None:
                return
            reply = self._serve(inbound.peer, inbound.user, inbound.message)
            if reply is not None:
                self._server.send(inbound.peer, reply)

    def _drain_lanes(self, events: dict[object, int]) -> None:
        """Serve what came on fetch lanes, as from the session's own ZMQ route and key."""
        lanes = self._lanes
        assert lanes is not None
        for session_id, msg in lanes.receive(events):
            session = self._sessions.get(session_id)
            if session is None:  # ended while its lane still had frames queued
                lanes.forget(session_id)
                continue
            reply = self._serve(session.route, session.user, msg)
            if reply is not None:
                lanes.send(session_id, reply)

    def _serve(self, route: bytes, user: str, msg: p.Message) -> p.Message | None:
        received = time.monotonic() if self.phases is not None else 0.0
        try:
            reply = self._handle(route, user, msg)
        # A bug, not the peer's fault: answer, count, go on.
        except (StoreError, IllegalTransition) as exc:
            log.exception("store error while serving %s", type(msg).__name__)
            self._count("internal_error")
            reply = p.Error(code=p.ErrorCode.INTERNAL, message=str(exc)[:4000])
        if self.phases is not None and isinstance(reply, p.FetchReply):
            replied = time.monotonic()  # before the send, so before the consumer's marks
            for item in reply.items:
                self.phases.mark(item.mm_hash, "p_woke", self._woke_at)
                self.phases.mark(item.mm_hash, "recv", received)
                self.phases.mark(item.mm_hash, "replied", replied)
        return reply

    # -- messages ----------------------------------------------------------------------------

    def _handle(self, route: bytes, user: str, msg: p.Message) -> p.Message | None:
        if isinstance(msg, p.Hello):
            return self._on_hello(route, user, msg)
        if isinstance(msg, p.StatusRequest):
            return self._on_status(user, msg)
        session_id = getattr(msg, "session_id", None)
        session = self._sessions.get(session_id) if session_id else None
        # A session belongs to the key that opened it: another authenticated
        # peer naming it is told it does not exist, and nothing changes.
        if session is None or session.user != user:
            self._count("no_session")
            if isinstance(msg, p.PushCredit):  # never to be written: the blocks go back
                return p.PushDone(session_id=msg.session_id, push_id=msg.credit_id, written=False)
            return p.Error(code=p.ErrorCode.NO_SESSION, message="unknown session; say hello")
        session.last_seen = time.monotonic()
        session.route = route
        if isinstance(msg, p.FetchRequest):
            return self._on_fetch(session, msg)
        if isinstance(msg, p.Release):
            return p.Released(released=self._release(session, msg.grant_ids))
        if isinstance(msg, p.Renew):
            return self._on_renew(session, msg)
        if isinstance(msg, p.Heartbeat):
            return p.HeartbeatAck()
        if isinstance(msg, p.PushReply):
            if self._pusher is not None:
                self._pusher.on_reply(session.session_id, msg, self._woke_at)
            return None
        if isinstance(msg, p.PushCredit | p.PushCreditVoid):
            if self._pusher is not None:
                return self._pusher.on_credit(session.session_id, msg)
            return (
                None
                if isinstance(msg, p.PushCreditVoid)
                else p.PushDone(session_id=msg.session_id, push_id=msg.credit_id, written=False)
            )
        if isinstance(msg, p.Bye):
            self._end_session(session, "bye", keep_leases=True)
            return None
        self._count("unexpected_message")
        return None

    def _on_hello(self, route: bytes, user: str, msg: p.Hello) -> p.Message | None:
        cfg = self._config
        if self._keys is not None and user.encode("ascii") not in self._authorized:
            # Admitted by CURVE as an admin only: it may ask for status, not fetch.
            self._count("refused_not_authorized")
            return p.Error(
                code=p.ErrorCode.FORBIDDEN,
                message="this key is an admin key, not an authorized consumer key",
            )
        version = p.negotiate_version(msg.versions)
        if version is None:
            self._count("refused_version")
            return p.Error(
                code=p.ErrorCode.VERSION_MISMATCH,
                message=f"no common protocol version: peer speaks {msg.versions}, "
                f"this producer speaks {list(p.SUPPORTED_VERSIONS)}",
            )
        if msg.fingerprint != self._fingerprint:
            self._count("refused_fingerprint")
            return p.Error(
                code=p.ErrorCode.FINGERPRINT_MISMATCH,
                message=f"compatibility fingerprint differs (producer {self._fingerprint}, "
                f"consumer {msg.fingerprint}): different model, revision, encoder config "
                "or dtype",
            )
        existing = self._sessions.get(msg.session_id)
        if existing is not None and existing.user != user:
            self._count("no_session")
            return p.Error(code=p.ErrorCode.NO_SESSION, message="session id in use")
        if existing is None:
            if len(self._sessions) >= cfg.max_sessions:
                self._count("refused_sessions")
                return p.Error(
                    code=p.ErrorCode.TOO_MANY_SESSIONS,
                    message=f"producer holds its maximum of {cfg.max_sessions} sessions",
                )
            per_key = cfg.max_sessions_per_key
            if per_key is not None and self._sessions_of(user) >= per_key:
                self._count("refused_sessions_per_key")
                return p.Error(
                    code=p.ErrorCode.TOO_MANY_SESSIONS,
                    message=f"this key holds its maximum of {per_key} sessions here",
                )
            agent = msg.data_plane.agent_name if msg.data_plane else ""
            with self._lock:
                self._sessions[msg.session_id] = _Session(
                    session_id=msg.session_id,
                    user=user,
                    route=route,
                    client_name=msg.client_name,
                    agent_name=agent,
                    version=version,
                    last_seen=time.monotonic(),
                )
            self._count("sessions_opened")
        else:
            existing.route = route
            existing.last_seen = time.monotonic()
        session = self._sessions[msg.session_id]
        session.direct = self._direct and p.CAP_READ_DIRECT in msg.capabilities
        self._listen()
        push = self._push_target(session, msg)
        info: PeerInfo = self._transport.local_info()
        welcome = p.Welcome(
            version=version,
            session_id=msg.session_id,
            server_name=self._name,
            capabilities=[
                c
                for c in p.negotiate_capabilities(msg.capabilities)
                if (c != p.CAP_CHECKSUM_XXH3_64 or cfg.checksum != "none")
                and (c not in (p.CAP_PUSH, p.CAP_PUSH_CREDIT) or push is not None)
                and (c != p.CAP_READ_DIRECT or self._direct)
            ],
            lease_ms=int(cfg.grant_lease_s * 1000),
            heartbeat_ms=int(cfg.heartbeat_interval_s * 1000),
            max_batch_items=min(cfg.max_batch_items, p.MAX_BATCH_ITEMS),
            data_plane=announced(info),
            # The key goes only to the key that opened the session, CURVE-encrypted.
            lane=self._lanes.offer(msg.session_id) if self._lanes is not None else None,
        )
        if push is not None:
            assert self._pusher is not None and self._server is not None
            # After the Welcome: the PushDones it may be owed follow it in order.
            self._server.send(route, welcome)
            self._pusher.add_target(push)
            return None
        return welcome

    def _push_target(self, session: _Session, msg: p.Hello) -> PushTarget | None:
        """The session as a push target, if both sides can push on it; loads the
        consumer's data plane into ours."""
        dp = msg.data_plane
        if (
            self._pusher is None
            or p.CAP_PUSH not in msg.capabilities
            or not msg.push_name
            or dp is None
            or not dp.agent_metadata
        ):
            return None
        try:
            agent = self._transport.add_peer(peer_info(dp))
        except Exception as exc:  # the transport names what it rejected
            log.warning("consumer %s offers push, but its data plane: %s", msg.client_name, exc)
            self._count("push_peer_refused")
            return None
        session.push_name = msg.push_name
        server = self._server
        assert server is not None
        return PushTarget(
            session_id=session.session_id,
            user=session.user,
            push_name=msg.push_name,
            agent=agent,
            region_size=dp.region_size,
            send=lambda message: server.send(session.route, message),
            credits=p.CAP_PUSH_CREDIT in msg.capabilities,
        )

    def _on_status(self, user: str, msg: p.StatusRequest) -> p.Message:
        # Insecure mode authenticates nobody, so there is no one to refuse.
        if self._keys is not None and user.encode("ascii") not in self._admins:
            self._count("refused_status")
            return p.Error(
                code=p.ErrorCode.FORBIDDEN,
                message="status is only answered to admin keys (admin_keys, admin_keys_file)",
                request_id=msg.request_id,
            )
        self._count("status_requests")
        now = time.monotonic()
        sessions = []
        for s in self._sessions.values():
            pinned = (self._store.pinned_entry(s.owner, g) for g in s.grants)
            sessions.append(
                SessionView(
                    user=s.user,
                    client_name=s.client_name,
                    version=s.version,
                    grants=len(s.grants),
                    pinned_bytes=sum(e.nbytes for e in pinned if e is not None),
                    idle_s=now - s.last_seen,
                )
            )
        assert self._server is not None
        counters = self.counters.snapshot()
        return status_reply(
            request_id=msg.request_id,
            server_name=self._name,
            fingerprint=self._fingerprint,
            uptime_s=time.time() - self.started_at,
            store=self._store,
            sessions=sessions,
            counters={**self._server.stats, **counters},
            max_frame_bytes=self._config.max_frame_bytes,
        )

    def _on_fetch(self, session: _Session, msg: p.FetchRequest) -> p.Message:
        cfg = self._config
        self._count("fetch_requests")
        if msg.releases:
            # First, so that the grants below see the session's limits without them.
            self._add("releases_in_requests", len(self._release(session, msg.releases)))
        cached = session.replies.get(msg.request_id)
        if cached is not None:
            # The same attempt again: same grants, leases renewed, nothing pinned twice.
            self._count("duplicate_requests")
            replayed = [self._replayed(session, item) for item in cached.items]
            if replayed != cached.items:
                cached = p.FetchReply(request_id=msg.request_id, items=replayed)
                session.replies[msg.request_id] = cached
            return cached
        if len(msg.items) > cfg.max_batch_items:
            self._count("refused_batch")
            return p.Error(
                code=p.ErrorCode.BATCH_TOO_LARGE,
                message=f"{len(msg.items)} items, limit {cfg.max_batch_items}",
                request_id=msg.request_id,
            )
        items = [self._grant_one(session, req) for req in msg.items]
        reply = p.FetchReply(request_id=msg.request_id, items=items)
        if any(item.status is p.ItemStatus.GRANTED for item in items):
            with self._lock:
                session.cache(reply, max(_REPLY_CACHE_ITEMS_PER_SESSION, cfg.max_batch_items))
        return reply

    def _grant_one(self, session: _Session, req: p.ItemRequest) -> p.ItemReply:
        cfg = self._config
        entry = self._store.get(req.mm_hash)
        if entry is None or entry.state in (EntryState.EVICTING, EntryState.FREED):
            self._count("refused_missing")
            return p.ItemReply(mm_hash=req.mm_hash, status=p.ItemStatus.MISSING)
        if entry.state is EntryState.ALLOCATED:
            self._count("refused_not_ready")
            return p.ItemReply(
                mm_hash=req.mm_hash,
                status=p.ItemStatus.NOT_READY,
                retry_after_ms=int(cfg.retry_initial_backoff_s * 1000),
            )
        if req.max_nbytes and entry.nbytes > req.max_nbytes:
            self._count("refused_too_large")
            return p.ItemReply(
                mm_hash=req.mm_hash,
                status=p.ItemStatus.TOO_LARGE,
                nbytes=entry.nbytes,
                detail=f"{entry.nbytes} bytes > {req.max_nbytes}",
            )
        if len(session.grants) >= cfg.max_grants_per_session:
            self._count("refused_overloaded")
            return p.ItemReply(
                mm_hash=req.mm_hash,
                status=p.ItemStatus.OVERLOADED,
                retry_after_ms=int(cfg.retry_max_backoff_s * 1000),
            )
        cap = cfg.max_pinned_bytes_per_session
        if cap is not None and session.pinned_bytes + entry.nbytes > cap:
            self._count("refused_pinned_bytes")
            if entry.nbytes > cap:  # never grantable to anyone: not worth a retry
                return p.ItemReply(
                    mm_hash=req.mm_hash,
                    status=p.ItemStatus.TOO_LARGE,
                    nbytes=entry.nbytes,
                    detail=f"{entry.nbytes} bytes > max_pinned_bytes_per_session {cap}",
                )
            return p.ItemReply(
                mm_hash=req.mm_hash,
                status=p.ItemStatus.OVERLOADED,
                retry_after_ms=int(cfg.retry_max_backoff_s * 1000),
                detail=f"session holds {session.pinned_bytes} pinned bytes, limit {cap}",
            )
        grant_id = f"g{next(self._grant_ids)}.{self._epoch}"
        try:
            self._store.pin(req.mm_hash, session.owner, grant_id, cfg.grant_lease_s)
        except NotReady:
            self._count("refused_not_ready")
            return p.ItemReply(mm_hash=req.mm_hash, status=p.ItemStatus.NOT_READY)
        except NotFound:
            self._count("refused_missing")
            return p.ItemReply(mm_hash=req.mm_hash, status=p.ItemStatus.MISSING)
        # Re-read under the pin: the entry cannot change or move from here on.
        pinned = self._store.pinned_entry(session.owner, grant_id)
        assert pinned is not None
        with self._lock:
            session.grants[grant_id] = pinned.nbytes
            session.pinned_bytes += pinned.nbytes
        self._count("granted")
        self._add("granted_bytes", pinned.nbytes)
        return p.ItemReply(
            mm_hash=req.mm_hash,
            status=p.ItemStatus.GRANTED,
            grant_id=grant_id,
            extents=[p.Extent(o, n) for o, n in pinned.extents],
            nbytes=pinned.nbytes,
            dtype=pinned.meta.dtype,
            shape=list(pinned.meta.shape),
            checksum=pinned.meta.checksum,
            lease_ms=int(cfg.grant_lease_s * 1000),
        )

    def _on_renew(self, session: _Session, msg: p.Renew) -> p.Message:
        lease_s = self._config.grant_lease_s
        renewed = [g for g in msg.grant_ids if self._renew(session, g)]
        self._add("renewed", len(renewed))
        return p.Renewed(renewed=renewed, lease_ms=int(lease_s * 1000))

    def _renew(self, session: _Session, grant_id: str) -> bool:
        """Extend one of the session's grants; False if it is not (or no longer) live."""
        if grant_id not in session.grants:
            return False
        if self._store.renew(session.owner, grant_id, self._config.grant_lease_s):
            return True
        # The lease ran out before the reaper saw it, and the table has just let the
        # pin go: forget the grant too, or it would count against the session's
        # limits (and keep the loop polling) until the session ends.
        with self._lock:
            session.forget(grant_id)
        self._count("leases_expired")
        return False

    def _replayed(self, session: _Session, item: p.ItemReply) -> p.ItemReply:
        """A cached answer, again: never a grant whose pin has ended."""
        if not item.grant_id or self._renew(session, item.grant_id):
            return item
        # Released or expired: its blocks may hold another entry by now, so the
        # extents must not go out again, and pinning anew would pin twice for
        # one request.
        self._count("replayed_ended_grants")
        return p.ItemReply(
            mm_hash=item.mm_hash,
            status=p.ItemStatus.MISSING,
            detail=f"grant {item.grant_id} of this request has ended; send a new request",
        )

    def _release(self, session: _Session, grant_ids: list[str]) -> list[str]:
        released = []
        unmatched = 0
        for grant_id in grant_ids:
            with self._lock:
                if not session.forget(grant_id):
                    # Another session's or process's grant, or released already.
                    unmatched += 1
                    continue
            if self._store.unpin(session.owner, grant_id):
                released.append(grant_id)
        self._add("released", len(released))
        if unmatched:
            self._add("releases_unmatched", unmatched)
        return released

    def _listen(self) -> None:
        """The locator queues what commits while any session reads directly."""
        self._locator.listening = any(s.direct for s in self._sessions.values())

    def _wake_up(self) -> None:
        if self._waker is not None:
            self._waker.wake()

    def _tell_located(self) -> None:
        """Tell each direct-reading session where the entries just committed lie."""
        assert self._server is not None
        batches = self._locator.take()
        sessions = [s for s in self._sessions.values() if s.direct]
        for batch in batches:
            for session in sessions:
                self._server.send(
                    session.route, p.Located(session_id=session.session_id, entries=batch)
                )
            self._add("located", len(batch))
        if sessions:
            self._add("located_sent", len(batches) * len(sessions))

    def _on_notification(self, agent: str, note: bytes) -> None:
        # A data-plane completion notice "<session>:<grant>" counts only from
        # the agent that session announced, so forged notices do nothing.
        try:
            session_id, grant_id = note.decode("ascii").split(":", 1)
        except (UnicodeDecodeError, ValueError):
            self._count("bad_notifications")
            return
        session = self._sessions.get(session_id)
        if session is None or not session.agent_name or session.agent_name != agent:
            self._count("bad_notifications")
            return
        self._release(session, [grant_id])

    # -- expiry ------------------------------------------------------------------------------

    def _reap(self, now: float) -> None:
        if self._lanes is not None:
            self._lanes.expire(now)
        if self._pusher is not None:
            self._pusher.renew_pins()  # a write's source stays pinned until it has ended
        # Every expired pin of the table, not only our sessions': an engine sharing
        # this store (vLLM's connector) leaves its own lost pins to this reaper.
        for owner, grant_id in self._store.reap_expired():
            if not owner.startswith(SESSION_OWNER_PREFIX):
                continue
            session = self._sessions.get(owner.removeprefix(SESSION_OWNER_PREFIX))
            if session is not None:
                with self._lock:
                    session.forget(grant_id)
            self._lingering.discard((owner, grant_id))
            self._count("leases_expired")
        # Anyone may end a pin whose lease ran out (the table does, on sight).
        self._lingering = {k for k in self._lingering if self._store.pinned_entry(*k)}
        dead_after = self._config.heartbeat_timeout_s
        for session in list(self._sessions.values()):
            if now - session.last_seen > dead_after:
                self._end_session(session, "heartbeat timeout", keep_leases=True)

    def _end_session(self, session: _Session, why: str, *, keep_leases: bool) -> None:
        if self._pusher is not None:
            agent = self._pusher.target_ended(session.session_id)
            if agent:
                # Retired, not dropped: writes still moving keep it until they end.
                self._transport.remove_peer(agent)
        if self._lanes is not None:
            self._lanes.forget(session.session_id)
        grants = list(session.grants)
        if keep_leases:
            self._lingering.update((session.owner, g) for g in grants)
            self._add("grants_left_to_lease", len(grants))
        else:
            self._store.unpin_owner(session.owner)
        with self._lock:
            self._sessions.pop(session.session_id, None)
            session.grants.clear()
            session.pinned_bytes = 0
        self._listen()
        self._count("sessions_closed")
        if grants:
            log.info(
                "session %s (%s) ended (%s): %d grants %s",
                session.session_id,
                session.client_name,
                why,
                len(grants),
                "left to run to their leases" if keep_leases else "released",
            )

    def _count(self, key: str) -> None:
        self.counters.add(key)

    def _add(self, key: str, n: int) -> None:
        self.counters.add(key, n)
