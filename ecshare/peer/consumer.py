"""The Consumer: fetches entries from producers into the local store.

`fetch()` is the only call an engine makes. It is non-blocking and
thread-safe, and returns one future per item: either a `FetchResult` (the
entry is READY in the local store) or a `FetchFailed` with a typed reason, so
the caller can encode locally instead.

Everything else runs on the Consumer's own thread, whose loop ties the parts
of the peer layer together: the fetch book (`ecshare.peer.fetchbook`: which
fetches exist and what is due), the link pool (`ecshare.peer.links`:
handshakes, heartbeats, quarantine), the data-plane READs and their fences
(`ecshare.peer.reads`), direct reads (`ecshare.peer.direct`) and the push
side (`ecshare.peer.pushwait`, around the inbox, `ecshare.peer.inbox`). Two
exceptions save a hand-off between threads: when that thread sleeps in poll and
the peer's fetch lane is up, `fetch()` sends the request itself
(`CallerThread.send_now`); and a caller that blocks on a fetch's future while
its direct read is still queued makes the READ on its own thread
(`ecshare.peer.lending`, `CallerThread.read_here`).

Two promises bind the reads (docs/ARCHITECTURE.md, invariants 2 and 4):
- A read's destination blocks are handed to nobody else while the read may
  still write them: a read given up for any reason is fenced, and its blocks
  come back only when the transport says it has ended (`ecshare.peer.reads`).
- Nothing is committed that was read outside the producer's lease. A grant's
  lease (on the wire, per item) is counted from when we sent the request, so
  it can only end early on our clock. A read is given up `lease_margin`
  before that unless a renewal extended it, and a read that nevertheless
  finishes after it is discarded. A direct read runs outside any lease on
  purpose: its tag or digest, not a lease, decides what is committed.

Push (with `push_name` set, docs/PUSH.md): producers this consumer allows may
offer entries on their sessions; the `Inbox` reserves blocks and commits what
they write, and `PushWaits` answers offers and credits. A fetch of an item
whose push is reserved (or announced: `FetchItem.pushed`) waits for it, within
its deadline, and pulls if the push is refused, fails or is late. Every
fetch's exposed latency (from the call to the item being local) is recorded as
pushed or pulled.
"""

from __future__ import annotations

import bisect
import logging
import math
import threading
import time
import weakref
from collections.abc import Sequence
from concurrent.futures import Future
from dataclasses import dataclass

import msgspec
import zmq

from ecshare import protocol as p
from ecshare.config import Config
from ecshare.control import AuthenticationFailed, ClientPool, KeyPair, LinkSettings, Waker
from ecshare.counts import Counts
from ecshare.peer import direct
from ecshare.peer.fetchbook import FetchBook
from ecshare.peer.inbox import PushLink
from ecshare.peer.landing import TagLanding
from ecshare.peer.lending import LEND_MIN_WAIT_S, CallerThread, Fetching
from ecshare.peer.link import PeerLink, PeerLinkState
from ecshare.peer.links import LinkPool
from ecshare.peer.notices import Notices
from ecshare.peer.phases import Phased
from ecshare.peer.pull import Pulls
from ecshare.peer.pushwait import PushWaits
from ecshare.peer.reads import READ_NAP_S, READ_WAIT_S, FenceKind, Reads
from ecshare.peer.thread import NetworkThread
from ecshare.peer.transfer import (
    LATENCY_BUCKETS_S,
    FailureReason,
    FetchFailed,
    FetchResult,
    Transfer,
    TransferState,
)
from ecshare.store import (
    EntryState,
    Hold,
    NotFound,
    NotReady,
    Store,
)
from ecshare.transport.base import DataTransport, Segment

__all__ = ["EXPOSED_MODES", "LEND_MIN_WAIT_S", "Consumer", "FetchItem", "LatencyHistogram"]

log = logging.getLogger(__name__)

# The loop never sleeps longer than this, so stop() and new work are prompt
# even if a wake-up were lost.
_MAX_IDLE_S = 0.1
EXPOSED_MODES = ("pushed", "pulled")


def _died(exc: BaseException) -> str:
    return f"the consumer's network thread died: {type(exc).__name__}: {exc}"


@dataclass(frozen=True)
class PeerLiveness:
    """One producer as this consumer sees it, for metrics."""

    endpoint: str
    up: bool  # a session is established
    quarantined: bool
    last_heard_age_s: float | None  # since the peer last said anything; None: never


@dataclass(frozen=True)
class LatencyHistogram:
    """Fetch latencies since start: counts per bucket of LATENCY_BUCKETS_S (plus +Inf)."""

    bounds: tuple[float, ...]
    counts: tuple[int, ...]  # per bucket, not cumulative; one more than bounds
    sum_s: float


class FetchItem(msgspec.Struct, frozen=True):
    """One item to fetch. `nbytes` (when known) scales the deadline before a grant.

    `hold` is a pin the caller wants on the entry from the moment it is READY
    here: taken in the same step as the commit (or the local hit), so that
    nothing can evict the entry before the caller sees its future resolved.
    The caller releases it (`Store.unpin`), or its lease ends it.
    """

    mm_hash: str
    nbytes: int = 0
    max_nbytes: int = 0
    peers: tuple[str, ...] = ()
    hold: Hold | None = None
    # A producer was asked to push the item here: wait up to `push_wait_s` for its
    # offer (and then for the push itself) before pulling it.
    pushed: bool = False


class Consumer(NetworkThread, Phased):
    def __init__(
        self,
        store: Store,
        config: Config,
        *,
        fingerprint: str,
        transport: DataTransport,
        keys: KeyPair | None,
        server_public_key: bytes | None,
        name: str = "ecshare-consumer",
        push_keys: frozenset[bytes] = frozenset(),
    ) -> None:
        """`push_keys`: producer keys that may push here (with `config.push_name` set;
        any producer when insecure)."""
        self._store = store
        self._config = config
        self._transport = transport
        self._keys = keys
        self._server_key = server_public_key
        self._name = name
        self._init_thread()
        # Held by the network thread for everything but its wait in poll, so that a
        # caller who finds it free may take its own fast paths (`CallerThread`).
        self._net_lock = threading.Lock()
        self._weak = weakref.ref(self)  # for each fetch's `Fetching`
        self._serving = False  # under _net_lock: the network thread's loop runs
        self._book = FetchBook()
        # The book's parts, by short names.
        self._lock = self._book.lock
        self._incoming = self._book.incoming
        self._transfers = self._book.transfers
        self._connects: list[str] = []  # endpoints `connect` asked for, not yet seen to
        self._peers = LinkPool(
            config,
            transport,
            name=name,
            fingerprint=fingerprint,
            server_key=server_public_key,
            push_keys=push_keys,
            count=self._count,
            busy=self._busy_endpoints,
            ended=self._session_ended,
            retire=self._retire_agent,
        )
        self._links = self._peers.links
        # Where tags of direct reads land (none in a store without tags: only digests
        # are checked).
        self._landing = TagLanding(store) if store.landing is not None else None
        self._locations = direct.Locations(tags=self._landing is not None, count=self._count)
        self._reads = Reads(store, transport, self._landing, self._count)
        self._pulls = Pulls(
            store,
            config,
            transport,
            book=self._book,
            reads=self._reads,
            locations=self._locations,
            landing=self._landing,
            peers=self._peers,
            count=self._count,
            count_add=self._count_add,
            succeed=self._succeed,
            take_hold=self._take_hold,
            on_network_thread=lambda: threading.current_thread() is self._thread,
        )
        self._caller = CallerThread(
            net_lock=self._net_lock,
            serving=lambda: self._serving,
            book=self._book,
            peers=self._peers,
            locations=self._locations,
            pulls=self._pulls,
            take_incoming=self._take_incoming,
            deliver=self._deliver,
            count=self._count,
            count_add=self._count_add,
        )
        self.counters = Counts()
        self._counters_lock = self.counters.lock  # the latency figures share it
        # Loop passes finished, for a watcher's proof that the loop ran (one writer).
        self.passes = 0
        # Every fetch's latency, in buckets (under `_counters_lock`).
        self._latency_counts = [0] * (len(LATENCY_BUCKETS_S) + 1)
        self._latency_sum_s = 0.0
        self._woke_at = 0.0  # with phases: when the loop's poll last returned
        # Typical time from sending a request to reading its answer (see `_spin_until`).
        self._reply_s = 0.0
        # Successes of this pass of the loop, resolved just before it blocks (`_deliver`).
        self._results: list[tuple[Future[FetchResult], FetchResult]] = []
        self._pushes = PushWaits(
            store,
            config,
            transport,
            book=self._book,
            peers=self._peers,
            count=self._count,
            count_add=self._count_add,
            succeed=self._succeed,
            take_hold=self._take_hold,
            woke_at=lambda: self._woke_at,
        )
        self._inbox = self._pushes.inbox
        # The parts that mark steps in `phases` (peer/phases.py), which is off unless set.
        self._phased = (self._pulls, self._inbox, self._pushes)
        self._notes: list[tuple[str, bytes]] = []  # data-plane notices, for the inbox
        # Shared with a Producer over the same transport: each takes its own notices.
        self._notices = Notices.of(transport)
        # Exposed latency per mode (pushed, pulled), in LATENCY_BUCKETS_S buckets.
        self._exposed = {m: [0] * (len(LATENCY_BUCKETS_S) + 1) for m in EXPOSED_MODES}
        self._exposed_sum = dict.fromkeys(EXPOSED_MODES, 0.0)

    # -- engine-facing -----------------------------------------------------------------------

    def fetch(
        self,
        items: Sequence[str | FetchItem],
        peers: Sequence[str] = (),
        *,
        read_here: bool = False,
    ) -> list[Future[FetchResult]]:
        """Start fetching `items` from `peers` (in preference order). Never blocks,
        unless `read_here`.

        The futures lend: a caller that blocks on one (`result()` or `exception()`,
        with no timeout or one of at least `LEND_MIN_WAIT_S`) while the fetches'
        direct reads are still queued makes them on its own thread, as `read_here`
        does, instead of waiting for the network thread to make them and hand the
        results back; it was going to wait anyway. Only where a READ is a copy
        inside the read call (a producer on this host: its memory readable from
        here, or its last READ of a MiB or more ended in the call). A caller that
        never blocks on a future (an engine's scheduler, polling `done()` or
        waiting with `concurrent.futures.wait`) leaves every READ to the network
        thread.

        `read_here`: for a caller that will wait for the results anyway, and whose
        thread no engine step waits on. When the network thread is idle, the
        fetches of entries whose places are known (direct reads) READ from this
        thread; on one host the copy is made inside this call, and the futures of
        those that landed are resolved before it returns. That saves the two
        hand-overs between threads. The rest goes to the network thread as ever.
        """
        if self._thread is None:
            raise RuntimeError("consumer not started")
        now = time.monotonic()
        futures: list[Future[FetchResult]] = []
        located = False
        with self._lock:
            for raw in items:
                item = FetchItem(raw) if isinstance(raw, str) else raw
                futures.append(self._start_one(item, tuple(item.peers or peers), now))
                located = located or item.mm_hash in self._locations
            queued = bool(self._incoming)
        if queued and read_here and self._waker is not None:
            ended = self._caller.read_here()
            if ended is not None:
                if not ended:
                    self._waker.wake()  # what is left: a fallback, a READ still moving
                return futures
        # Sent from here or not, the network thread wakes: to send it, or to wait for
        # its answer awake (`_spin_until`) while it is on the way.
        # A located entry is read directly, by the network thread (or a lent caller),
        # never asked for: nothing to send from here.
        if (
            queued
            and self._waker is not None
            and (located or not self._caller.send_now() or self._config.reply_spin_s > 0)
        ):
            self._waker.wake()
        return futures

    def _lend(self) -> None:
        """A caller blocks on an unfinished fetch's future (`Fetching`): the direct
        reads queued now are made on its thread, as `fetch(read_here=True)` makes
        them, unless the network thread is at them already. fetch() has woken that
        thread; it waits for `_net_lock` meanwhile, and then finds them done."""
        if self._waker is not None and self._caller.read_here(lent=True) is False:
            self._waker.wake()  # what is left: a fallback, a READ still moving

    def connect(self, peers: Sequence[str]) -> None:
        """Open sessions to `peers` now, so that the first fetch from each does not
        wait for them. Never blocks; peers already connected are left as they are.

        A session's first use costs tens of milliseconds on one host (the CURVE
        handshake, Hello and Welcome, loading the producer's NIXL metadata): call
        this when peers become known (configuration, a router naming them), not
        when their first item is needed.
        """
        if self._thread is None:
            raise RuntimeError("consumer not started")
        with self._lock:
            self._connects.extend(peers)
        if self._waker is not None:
            self._waker.wake()

    def _start_one(
        self, item: FetchItem, peers: tuple[str, ...], now: float
    ) -> Future[FetchResult]:
        running = self._book.running(item.mm_hash)
        if running is not None:
            self._count("single_flight_joins")
            if item.hold is not None:
                running.holds.append(item.hold)  # the network thread reads it at commit
            return running.future
        future: Future[FetchResult] = Fetching(self._weak)
        entry = self._store.get(item.mm_hash)
        if entry is not None and entry.state is EntryState.READY and self._held(item):
            self._count("local_hits")
            pushed = self._pushes.was_pushed(item.mm_hash)
            if pushed:
                self._record_exposed("pushed", time.monotonic() - now)
            future.set_result(
                FetchResult(
                    item.mm_hash,
                    entry.nbytes,
                    entry.meta.dtype,
                    tuple(entry.meta.shape),
                    "local",
                    0.0,
                    0,
                    pushed,
                )
            )
            return future
        if self.failure is not None:
            future.set_exception(
                FetchFailed(item.mm_hash, FailureReason.INTERNAL, _died(self.failure))
            )
            return future
        if self._stop.is_set():
            future.set_exception(FetchFailed(item.mm_hash, FailureReason.SHUTDOWN))
            return future
        if not peers:
            future.set_exception(
                FetchFailed(item.mm_hash, FailureReason.PEER_UNREACHABLE, "no peer named")
            )
            return future
        wait_s = self._config.push_wait_s if item.pushed else 0.0
        transfer = Transfer(
            mm_hash=item.mm_hash,
            future=future,
            candidates=list(dict.fromkeys(peers)),
            started=now,
            deadline=now + wait_s + self._config.fetch_deadline_s(item.nbytes),
            max_nbytes=item.max_nbytes,
            holds=[item.hold] if item.hold is not None else [],
            not_before=now + wait_s,
            awaiting_push=item.pushed,
        )
        self._book.add(transfer)
        if self.phases is not None:
            self.phases.mark(item.mm_hash, "call", now)
        self._count("fetches")
        return future

    # -- lifecycle ---------------------------------------------------------------------------

    def pending(self) -> int:
        return self._book.pending()

    def push_pending(self, mm_hash: str) -> bool:
        """A producer's push of `mm_hash` is reserved here and not over: a fetch of it
        now waits for the push (within its deadline) before it would pull. Any thread."""
        return self._inbox.pending(mm_hash)

    # -- for metrics (any thread) ------------------------------------------------------------

    def counter_snapshot(self) -> dict[str, int]:
        with self._counters_lock:
            return dict(self.counters)

    def fenced_reads(self) -> tuple[int, float]:
        """Reads given up but not yet ended, and the age of the oldest (0 if none)."""
        return self._reads.held(FenceKind.GIVEN_UP)

    def fences(self) -> dict[str, int]:
        """Fenced READs not yet ended, per kind: given up, warm-up, tag landing."""
        return self._reads.by_kind()

    def tag_reads_held(self) -> int:
        """READs of tags holding a chunk of the landing: not yet ended, or not yet seen
        to (`ecshare.peer.landing`)."""
        return self._landing.held if self._landing is not None else 0

    def latency_histogram(self) -> LatencyHistogram:
        with self._counters_lock:
            return LatencyHistogram(
                LATENCY_BUCKETS_S, tuple(self._latency_counts), self._latency_sum_s
            )

    def exposed_histograms(self) -> dict[str, LatencyHistogram]:
        """Exposed latency (from `fetch` to the item being local) of every fetch that
        moved data, per mode: "pushed" (a producer wrote it here, before or while the
        fetch waited) and "pulled" (we read it)."""
        with self._counters_lock:
            return {
                mode: LatencyHistogram(
                    LATENCY_BUCKETS_S, tuple(self._exposed[mode]), self._exposed_sum[mode]
                )
                for mode in EXPOSED_MODES
            }

    def pushes_fenced_in_flight(self) -> int:
        """Push reservations given up while a write may still land: held until it ends."""
        return self._inbox.fenced

    def peer_liveness(self) -> list[PeerLiveness]:
        now = time.monotonic()
        # The network thread owns the links; copying the values is one step under the
        # GIL, and each field read is of a plain attribute, so a scrape never waits.
        links = tuple(self._links.values())
        return [
            PeerLiveness(
                endpoint=link.endpoint,
                up=link.state is PeerLinkState.READY,
                quarantined=link.state is PeerLinkState.QUARANTINED,
                last_heard_age_s=now - link.last_heard if link.last_heard else None,
            )
            for link in links
        ]

    # -- the network thread ------------------------------------------------------------------

    def _run(self) -> None:
        try:
            cfg = self._config
            self._waker = Waker()
            self._peers.pool = ClientPool(
                keys=self._keys,
                server_public_key=self._server_key,
                insecure=cfg.insecure,
                settings=LinkSettings.of(cfg),
            )
        except BaseException as exc:
            self._started(exc)
            return
        self._started(None)
        self._notices.join("push")
        self._net_lock.acquire()
        self._serving = True
        try:
            while not self._stop.is_set():
                self._step(self._wait())
                self.passes += 1
        except BaseException as exc:
            if self._ended_by_close(exc):
                log.info("consumer stopping: its data plane was closed under it (%s)", exc)
                return  # through `finally`: the shutdown still ends every fetch
            log.exception("consumer network thread failed; every fetch now fails as internal")
            with self._lock:
                self.failure = exc  # new fetches fail at once from here on
            raise
        finally:
            self._serving = False
            try:
                self._shutdown()
            finally:
                self._net_lock.release()
                self._notices.leave("push")

    def _wait(self) -> dict[object, int]:
        assert self._waker is not None
        poller = zmq.Poller()
        poller.register(self._waker, zmq.POLLIN)
        for link in self._links.values():
            for pollable, flags in link.pollables():
                poller.register(pollable, flags)
        now = time.monotonic()
        wake_at = self._book.wake_at(now, now + _MAX_IDLE_S)
        reading = [t.read_handle for t in self._book.reading()]
        if reading:
            self._deliver()
            self._reads.wait(reading)
            wake_at = now  # look at the reads (and the sockets) again at once
        if self._inbox.awaiting_writes:
            # Writes into our region over TCP land only as our data plane progresses.
            self._deliver()
            self._wait_pushes(poller)
            wake_at = now
        elif self._inbox.busy:
            wake_at = min(wake_at, now + 0.005)  # fenced pushes: their probes and notices
        for link in self._links.values():
            wake_at = min(wake_at, link.next_deadline(now))
        # Rounded up: a timer due in under 1 ms must not turn into a busy loop.
        timeout_ms = max(0, math.ceil((wake_at - now) * 1000))
        self._deliver()
        spin_until = self._spin_until(now) if timeout_ms else 0.0
        self._net_lock.release()  # a caller may send its own requests meanwhile
        try:
            events = {}
            while time.monotonic() < spin_until:
                events = dict(poller.poll(0))
                if events:
                    break
                time.sleep(0)  # the shortest nap there is; the GIL goes meanwhile
            if not events:
                events = dict(poller.poll(timeout_ms))
        finally:
            self._net_lock.acquire()
        if self.phases is not None:
            self._woke_at = time.monotonic()
        # zmq.Poller reports a non-socket (the waker) by its file descriptor.
        if self._waker.fileno() in events:
            self._waker.clear()
        return events

    def _spin_until(self, now: float) -> float:
        """Until when the loop waits awake, polling without blocking, for the answer
        to a request it has sent; 0.0: it blocks in poll as usual.

        A thread that blocks in poll sleeps deeply, and on a small host an answer that
        comes a fraction of a millisecond later finds it asleep with its caches cold.
        So while a request is unanswered the loop polls without blocking, napping the
        shortest time the OS gives between polls (`time.sleep(0)`), for at most
        `reply_spin_s` after the oldest was sent, and for twice the typical answer's
        time once there is one; never where answers typically take longer than that
        bound. Each nap gives the GIL away, so an engine thread of the same process
        is not held up.
        """
        limit = self._config.reply_spin_s
        if limit <= 0 or self._reply_s > limit:
            return 0.0
        sent = [s for link in self._links.values() if (s := link.oldest_unanswered())]
        if not sent:
            return 0.0
        return min(sent) + min(limit, 2 * self._reply_s or limit)

    def _answered(self, transfers: list[Transfer], now: float) -> None:
        """Learn how long answers take (a moving average, for `_spin_until`)."""
        g = transfers[0].granted if transfers else None
        if g is not None and g.requested_at:
            took = now - g.requested_at
            self._reply_s = took if not self._reply_s else 0.8 * self._reply_s + 0.2 * took

    def _wait_pushes(self, poller: zmq.Poller) -> None:
        """Progress our data plane for up to `READ_WAIT_S`, napping between, and keep
        the notices for the inbox; returns early on the first one, or once a socket of
        `poller` is ready: a push's word is its PushDone, on the control plane."""
        until = time.monotonic() + READ_WAIT_S
        while True:
            notes = self._notices.take("push")
            if notes:
                self._notes.extend(notes)
                return
            if time.monotonic() >= until or poller.poll(0):
                return
            time.sleep(READ_NAP_S)

    def _take_incoming(self) -> list[Transfer]:
        """The fetches `fetch` queued, from now on the network thread's."""
        picked = self._book.take_incoming()
        for t in picked:
            if self.phases is not None:
                self.phases.mark(t.mm_hash, "picked")
            self._pushes.await_reserved(t)  # a push is being written: wait for it
        return picked

    def _step(self, events: dict[object, int]) -> None:
        now = time.monotonic()
        lost, self._pulls.peers_lost = self._pulls.peers_lost, []
        for endpoint, detail in lost:
            link = self._links.get(endpoint)
            if link is not None and link.state is PeerLinkState.READY:
                self._pulls.peer_failed(link, FailureReason.PEER_UNREACHABLE, detail, now)
                continue
            for t in self._book.of_peer(endpoint):  # the session is gone already: on with them
                if t.state is TransferState.READING and t.dest is None:
                    self._pulls.move_on(t, FailureReason.PEER_UNREACHABLE, detail)
        taken = self._take_incoming()
        if taken and self._locations:
            # New fetches of located entries are read before anything else here: the
            # rest of the pass is cold code after an idle gap.
            self._pulls.dispatch_direct(now)
            woken_by_fetch = self._waker is not None and set(events) <= {self._waker.fileno()}
            done = all(t.state is TransferState.DONE for t in taken)
            if woken_by_fetch and done and not self._connects:
                # Only `fetch` woke us, and its reads are done (on one host a READ ends
                # inside the call): answer before the rest of the pass, whose
                # GIL-holding work the woken caller would wait out. Nothing else
                # arrived (no message, no `connect`), and what is due by time `_wait`
                # schedules as ever.
                return
        with self._lock:
            connects, self._connects = self._connects, []
        for endpoint in dict.fromkeys(connects):
            # A warm-up never takes the room of a link in use or evicts one.
            if endpoint in self._links or len(self._links) < self._config.max_peer_links:
                link = self._peers.link(endpoint)
                if link is not None and link.state is PeerLinkState.IDLE:
                    link.connect(now)
        if self._config.push_name:
            # Producers push over these sessions: one lost (a dead peer, a cut) is made
            # again as soon as its quarantine ends, not at the next fetch from it.
            for link in self._links.values():
                if link.state is PeerLinkState.IDLE:
                    link.connect(now)
        for link in list(self._links.values()):
            lane = link.lane
            if lane is not None and lane.fileno() in events:
                for msg in link.receive_lane(events[lane.fileno()]):
                    self._on_message(link, msg, now)
            if link.client is not None and any(s in events for s in link.client.pollables):
                for msg in link.receive():
                    self._on_message(link, msg, now)
            self._check_link(link, now)
        self._pulls.poll_reads()
        self._poll_fenced()
        # Idle, we leave progress to the producer side (if any): notices it took for
        # our pushes (a late one, after a PushDone committed) are picked up all the same.
        self._notes.extend(self._notices.take("push", progress=self._inbox.busy))
        notes, self._notes = self._notes, []
        for agent, note in notes:
            if not self._inbox.on_notification(agent, note):
                self._count("unexpected_notifications")
        self._inbox.step(now)
        self._pushes.top_up_credits(now)
        self._pushes.release_unawaited(now)
        self._dispatch(now)
        self._pulls.expire(now)
        self._pulls.renew(now)
        self._peers.close_idle(now)
        for link in self._links.values():
            if link.releases_due(now):
                link.flush_releases()

    # -- peers -------------------------------------------------------------------------------

    def _busy_endpoints(self) -> set[str]:
        return (
            {t.peer or "" for t in self._transfers}
            | self._reads.endpoints()
            | self._inbox.endpoints()
        )

    def _push_link(self, link: PeerLink) -> PushLink:
        return self._peers.push_link(link)

    def _session_ended(self, link: PeerLink) -> None:
        """However a session ends (a dead peer, NO_SESSION, a new handshake, a close),
        its push reservations wait for their writes' end, probed from now on; called
        while the producer's agent is still loaded, which a probe keeps so."""
        self._inbox.session_lost(self._push_link(link), time.monotonic())

    def _retire_agent(self, agent: str) -> None:
        """A link is done with a producer's agent: unloaded, unless fenced pushes still
        probe it (the inbox unloads it after them)."""
        if not self._inbox.keeps(agent):
            self._transport.remove_peer(agent)

    def _check_link(self, link: PeerLink, now: float) -> None:
        try:
            problem = link.tick(now)
        except AuthenticationFailed as exc:
            self._pulls.peer_failed(link, FailureReason.AUTH_FAILED, str(exc), now)
            return
        if problem is None:
            return
        if link.state is PeerLinkState.HELLO_SENT and not self._book.of_peer(link.endpoint):
            # A session opened ahead of any fetch (connect(), a push consumer's start-up)
            # to a producer not up yet: start over instead of quarantining it, or the
            # first fetches after it comes up would be refused for quarantine_s.
            log.info("peer %s: %s; trying again", link.endpoint, problem[1])
            self._count("handshakes_retried")
            link.close()
            return
        self._pulls.peer_failed(link, problem[0], problem[1], now)

    def _on_message(self, link: PeerLink, msg: p.Message, now: float) -> None:
        link.heard(now)
        if isinstance(msg, p.FetchReply):
            session_id = link.answered(msg.request_id)
            transfers = link.pending.pop(msg.request_id, None)
            if transfers is None:
                # A reply we stopped waiting for: give its grants straight back (if
                # its session is still ours).
                self._count("late_replies")
                link.release([i.grant_id for i in msg.items if i.grant_id], session_id)
                return
            by_hash = {t.mm_hash: t for t in transfers}
            self._answered(transfers, now)
            if self.phases is not None:
                for t in transfers:
                    self.phases.mark(t.mm_hash, "c_woke", self._woke_at)
            reads: list[tuple[Transfer, list[Segment]]] = []
            for item in msg.items:
                t = by_hash.pop(item.mm_hash, None)
                if t is None or t.state is not TransferState.REQUESTED:
                    if item.grant_id:
                        link.release([item.grant_id], session_id)
                    continue
                self._pulls.on_item(link, t, item, now, reads)
            self._pulls.post_reads(link, reads)
            for t in by_hash.values():  # the producer skipped an item: treat as missing
                if t.state is TransferState.REQUESTED:
                    self._pulls.move_on(t, FailureReason.MISSING, "not in reply")
        elif isinstance(msg, p.Located):
            self._locations.heard(link, msg)
        elif isinstance(msg, p.Renewed):
            self._pulls.on_renewed(link, msg)
        elif isinstance(msg, p.PushOffer):
            self._pushes.on_offer(link, msg, now)
        elif isinstance(msg, p.PushDone):
            self._inbox.on_done(link.endpoint, msg)
        elif isinstance(msg, p.PushCredited):
            self._pushes.on_credited(link, msg, now)
        elif isinstance(msg, p.Error) and msg.request_id:
            link.answered(msg.request_id)
            transfers = link.pending.pop(msg.request_id, None) or []
            for t in transfers:
                if t.state is TransferState.REQUESTED:
                    self._pulls.move_on(t, FailureReason.PEER_UNREACHABLE, msg.message)
        else:
            welcomed = link.state is PeerLinkState.HELLO_SENT
            problem = link.on_message(msg, now)
            if problem is not None:
                self._pulls.peer_failed(link, problem[0], problem[1], now)
            elif welcomed and link.state is PeerLinkState.READY:
                if link.region_size and link.agent:
                    self._reads.warm_up(link.agent, link.session_id, link.endpoint)
                self._pushes.on_welcomed(link, msg, now)

    # -- items -------------------------------------------------------------------------------

    def _record_exposed(self, mode: str, latency: float) -> None:
        with self._counters_lock:
            self._exposed[mode][bisect.bisect_left(LATENCY_BUCKETS_S, latency)] += 1
            self._exposed_sum[mode] += latency

    def _held(self, item: FetchItem) -> bool:
        """Pin a local hit for the caller, if it asked; False if it is gone meanwhile."""
        return item.hold is None or self._take_hold(item.mm_hash, item.hold)

    def _take_hold(self, mm_hash: str, hold: Hold) -> bool:
        try:
            self._store.pin(mm_hash, hold.owner, hold.grant_id, hold.lease_s)
        except (NotFound, NotReady):
            return False
        return True

    def _succeed(self, t: Transfer, peer: str, *, pushed: bool = False, read: int = 0) -> None:
        """`t` is done; `read`: the bytes this side read for it (`fetched_bytes`)."""
        t.move(TransferState.DONE)
        latency = time.monotonic() - t.started
        mode = "pushed" if pushed else "pulled"
        bucket = bisect.bisect_left(LATENCY_BUCKETS_S, latency)
        with self._counters_lock:  # once for all of them: every lock taken costs, cold
            self.counters["fetched_by_push" if pushed else "fetched"] += 1
            if read:
                self.counters["fetched_bytes"] += read
            self._latency_counts[bucket] += 1
            self._latency_sum_s += latency
            self._exposed[mode][bucket] += 1
            self._exposed_sum[mode] += latency
        self._finish(t)
        if pushed:
            entry = self._store.get(t.mm_hash)
            if entry is not None:
                t.nbytes, t.dtype, t.shape = entry.nbytes, entry.meta.dtype, entry.meta.shape
        result = FetchResult(
            t.mm_hash, t.nbytes, t.dtype, t.shape, peer, latency, t.attempts, pushed
        )
        self._results.append((t.future, result))

    def _deliver(self) -> None:
        """Resolve the futures of fetches that succeeded in this pass of the loop.

        Done last, just before the thread blocks: a caller woken by its future needs
        the GIL, which this thread holds until it blocks, and a caller that wakes to
        find it held sleeps again and needs a second wake-up. (A caller that read on
        its own thread, `CallerThread.read_here`, resolves its own at the end of its turn.)
        """
        results, self._results = self._results, []
        for future, result in results:
            future.set_result(result)
            if self.phases is not None:
                self.phases.mark(result.mm_hash, "result")

    def _finish(self, t: Transfer) -> None:
        self._book.finish(t)

    def _poll_fenced(self) -> None:
        for f in self._reads.poll_fences():
            link = self._links.get(f.endpoint)
            if link is not None:
                link.release([f.grant_id], f.session_id)  # its pin can go before its lease

    # -- dispatch and expiry -----------------------------------------------------------------

    def _dispatch(self, now: float) -> None:
        self._pulls.dispatch(now)

    def _shutdown(self) -> None:
        self._deliver()  # fetches that succeeded before the end keep their results
        if self.failure is not None:
            why, detail = FailureReason.INTERNAL, _died(self.failure)
        else:
            why, detail = FailureReason.SHUTDOWN, "consumer stopping"
        for t in list(self._transfers):
            self._pulls.end_quietly(t, why, detail)
        for t in self._book.take_stranded():
            self._pulls.end_quietly(t, why, detail)
        self._inbox.stop()
        deadline = time.monotonic() + self._config.shutdown_timeout_s
        while (self._reads.fences or self._inbox.busy) and time.monotonic() < deadline:
            self._poll_fenced()
            if self._inbox.busy:
                for agent, note in self._notices.take("push"):
                    self._inbox.on_notification(agent, note)
                self._inbox.step(time.monotonic())
            time.sleep(0.001)
        if self._reads.fences:
            # Their blocks (and landing slots) stay held; closing the transport ends them.
            log.warning(
                "%d reads still in flight at shutdown; what they write stays held: %s",
                len(self._reads.fences),
                self._reads.by_kind(),
            )
        self._peers.close()
        if self._waker is not None:
            self._waker.close()

    def _count(self, key: str) -> None:
        self.counters.add(key)

    def _count_add(self, key: str, n: int) -> None:
        self.counters.add(key, n)
