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

This module keeps the API and the loop that ties the parts together: the
endpoints requests come in on (`ecshare.peer.endpoints`), the session table
(`ecshare.peer.sessions`), the grant book (`ecshare.peer.grants`), the locator
(`ecshare.peer.locator`) and the pusher (`ecshare.peer.pusher`).
"""

from __future__ import annotations

import logging
import time
from concurrent.futures import Future

from ecshare import protocol as p
from ecshare.config import Config
from ecshare.control import KeyPair
from ecshare.counts import Counts
from ecshare.errors import IllegalTransition
from ecshare.peer.dataplane import announced, peer_info
from ecshare.peer.endpoints import Endpoints
from ecshare.peer.grants import Grants, Session
from ecshare.peer.locator import Locator
from ecshare.peer.notices import Notices
from ecshare.peer.phases import Phased
from ecshare.peer.pusher import Pusher, PushOutcome, PushState, PushTarget
from ecshare.peer.sessions import Sessions
from ecshare.peer.status import status_reply
from ecshare.peer.thread import NetworkThread
from ecshare.store import Store, StoreError
from ecshare.transport.base import DataTransport, PeerInfo, writer_of

log = logging.getLogger(__name__)


class Producer(NetworkThread, Phased):
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
        self.counters = Counts()
        self.started_at = time.time()
        self._sessions = Sessions(
            config,
            fingerprint=fingerprint,
            authorized=authorized,
            secure=keys is not None,
            count=self.counters.add,
        )
        self._grants = Grants(
            store,
            config,
            lock=self._sessions.lock,
            find=self._sessions.find,
            count=self.counters.add,
        )
        self._endpoints: Endpoints | None = None  # once serving
        self._woke_at = 0.0  # with phases: when the loop's poll last returned
        # Shared with a Consumer over the same transport: each takes its own notices.
        self._notices = Notices.of(transport)
        writer = writer_of(transport)
        self._pusher = (
            Pusher(store, config, writer, count=self.counters.add) if writer is not None else None
        )
        # The parts that mark steps in `phases` (peer/phases.py), which is off unless set.
        self._phased = (self._pusher,) if self._pusher is not None else ()
        # Direct reads need a data plane that serves them without this loop: a read
        # nobody granted gets no progress from it.
        self._direct = config.direct_reads and transport.self_progressing
        self._locator = Locator(store, self._wake_up)

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
        self._wake_up()
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
        for session in self._sessions.all():
            self._end_session(session, "shutdown", keep_leases=False)
        self._grants.end_lingering()

    @property
    def port(self) -> int:
        assert self._endpoints is not None, "producer not started"
        return self._endpoints.port

    @property
    def address(self) -> str:
        """The endpoint consumers connect to (the advertised host)."""
        host = self._config.advertised_host
        return f"tcp://{host}:{self.port}"

    @property
    def lane_port(self) -> int | None:
        """The TCP port of the fetch lane (config.fetch_lane), beside `port`; None without."""
        endpoints = self._endpoints
        lanes = endpoints.lanes if endpoints is not None else None
        return lanes.port if lanes is not None else None

    @property
    def fingerprint(self) -> str:
        return self._fingerprint

    def session_count(self) -> int:
        return self._sessions.count()

    def active_grants(self) -> int:
        return self._sessions.active_grants()

    def grants_by_session(self) -> dict[str, list[str]]:
        """Each open session's outstanding grant ids, sorted: a copy, for any thread."""
        return self._sessions.grants_by_session()

    def cached_replies(self) -> dict[str, tuple[int, int]]:
        """Each open session's cached replies and the items in them, for any thread."""
        return self._sessions.cached_replies()

    @property
    def control_stats(self) -> dict[str, int]:
        """The control server's counters (drops per reason, handshakes); empty before start."""
        endpoints = self._endpoints
        return endpoints.stats if endpoints is not None else {}

    # -- the network thread ------------------------------------------------------------------

    def _run(self) -> None:
        cfg = self._config
        try:
            endpoints = Endpoints(
                cfg,
                keys=self._keys,
                authorized=self._authorized | self._admins,
                name=self._name,
                count=self.counters.add,
            )
        except BaseException as exc:  # reported to start()'s caller
            self._started(exc)
            return
        self._endpoints = endpoints
        self._waker = endpoints.waker
        self._started(None)
        self._notices.join("grant")
        if self._direct:
            self._locator.start()
        next_reap = 0.0
        # While grants are outstanding the data plane may need target-side progress
        # (UCX over TCP does). A transport that progresses by itself (NIXL's progress
        # thread, asleep until UCX has an event) needs nothing from this loop, which
        # then sleeps in poll whatever is outstanding; otherwise the loop drives
        # progress between naps (`Endpoints.nap`) while grants are outstanding.
        polled = not self._transport.self_progressing
        try:
            pusher = self._pusher
            while not self._stop.is_set():
                active = (polled and bool(self.active_grants() or self._grants.lingering)) or (
                    pusher is not None and pusher.writing
                )
                timeout_ms = 0 if active else int(cfg.reap_interval_s * 1000)
                events = endpoints.poll(timeout_ms)
                if self.phases is not None:
                    self._woke_at = time.monotonic()
                woken = endpoints.woken(events)
                if woken and pusher is not None:
                    pusher.offer_requested()
                endpoints.serve(events, woken, self._serve, self._sessions.find)
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
                    self._grants.on_notification(agent, note)
                if pusher is not None:
                    pusher.step(time.monotonic())
                if active and not events:
                    endpoints.nap()
        except BaseException as exc:
            if self._ended_by_close(exc):
                log.info("producer stopping: its data plane was closed under it (%s)", exc)
                return
            log.exception("producer network thread failed; it serves no grants any more")
            self.failure = exc
            raise
        finally:
            self._locator.stop()
            self._notices.leave("grant")
            endpoints.close()

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
        session = self._sessions.find(session_id) if session_id else None
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
            return self._grants.fetch(session, msg)
        if isinstance(msg, p.Release):
            return p.Released(released=self._grants.release(session, msg.grant_ids))
        if isinstance(msg, p.Renew):
            return self._grants.renew(session, msg)
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
        session = self._sessions.open(route, user, msg)
        if isinstance(session, p.Error):
            return session
        session.direct = self._direct and p.CAP_READ_DIRECT in msg.capabilities
        self._listen()
        push = self._push_target(session, msg)
        info: PeerInfo = self._transport.local_info()
        endpoints = self._endpoints
        assert endpoints is not None
        welcome = p.Welcome(
            version=session.version,
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
            lane=endpoints.lanes.offer(msg.session_id) if endpoints.lanes is not None else None,
        )
        if push is not None:
            assert self._pusher is not None
            # After the Welcome: the PushDones it may be owed follow it in order.
            endpoints.server.send(route, welcome)
            self._pusher.add_target(push)
            return None
        return welcome

    def _push_target(self, session: Session, msg: p.Hello) -> PushTarget | None:
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
        assert self._endpoints is not None
        server = self._endpoints.server
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
        assert self._endpoints is not None
        counters = self.counters.snapshot()
        return status_reply(
            request_id=msg.request_id,
            server_name=self._name,
            fingerprint=self._fingerprint,
            uptime_s=time.time() - self.started_at,
            store=self._store,
            sessions=self._sessions.views(self._store),
            counters={**self._endpoints.server.stats, **counters},
            max_frame_bytes=self._config.max_frame_bytes,
        )

    # -- direct reads ------------------------------------------------------------------------

    def _listen(self) -> None:
        """The locator queues what commits while any session reads directly."""
        self._locator.listening = bool(self._sessions.direct())

    def _wake_up(self) -> None:
        if self._waker is not None:
            self._waker.wake()

    def _tell_located(self) -> None:
        """Tell each direct-reading session where the entries just committed lie."""
        assert self._endpoints is not None
        server = self._endpoints.server
        batches = self._locator.take()
        sessions = self._sessions.direct()
        for batch in batches:
            for session in sessions:
                server.send(session.route, p.Located(session_id=session.session_id, entries=batch))
            self._add("located", len(batch))
        if sessions:
            self._add("located_sent", len(batches) * len(sessions))

    # -- ends --------------------------------------------------------------------------------

    def _reap(self, now: float) -> None:
        assert self._endpoints is not None
        if self._endpoints.lanes is not None:
            self._endpoints.lanes.expire(now)
        if self._pusher is not None:
            self._pusher.renew_pins()  # a write's source stays pinned until it has ended
        self._grants.reap()
        for session in self._sessions.silent(now, self._config.heartbeat_timeout_s):
            self._end_session(session, "heartbeat timeout", keep_leases=True)

    def _end_session(self, session: Session, why: str, *, keep_leases: bool) -> None:
        if self._pusher is not None:
            self._pusher.target_ended(session.session_id)
        endpoints = self._endpoints
        if endpoints is not None and endpoints.lanes is not None:
            endpoints.lanes.forget(session.session_id)
        grants = self._grants.end(session, keep_leases=keep_leases)
        self._sessions.remove(session)
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
