"""Pulling: asking producers for grants, reading granted and located entries, and
moving a fetch on when a peer fails it.

`Pulls` is the consumer's pull side, driven by its network loop: it batches the
due fetches into requests (`dispatch`), reads what a reply grants (`on_item`,
`post_reads`) or what a producer said where it lies (`dispatch_direct`, see
`ecshare.peer.direct`), checks what landed, and commits it; it expires fetches
and leases and renews leases still needed. What a fetch may do next is the
fetch book's to say (`ecshare.peer.fetchbook`); the READs and their fences are
`ecshare.peer.reads`'s. A fetch that succeeds is handed to the consumer
(`succeed`), which resolves its future.

Guarantees:
- Nothing is committed that was read outside its grant's lease, or that fails
  the checksum asked for; a direct read's bytes are committed only if its tag
  or digest proves them the entry's.
- Every grant is released once its read has ended, or left to its lease.
- A fetch leaving a peer gives its read up first (fenced while it may still
  land), then goes to the next candidate or fails with the most telling reason.
"""

from __future__ import annotations

import itertools
import logging
import math
import time
from collections.abc import Callable

from ecshare import protocol as p
from ecshare.config import Config
from ecshare.peer import direct
from ecshare.peer.direct import Locations
from ecshare.peer.fetchbook import FetchBook
from ecshare.peer.landing import TAGS_PER_READ, TagLanding
from ecshare.peer.link import PeerLink, PeerLinkState
from ecshare.peer.links import LinkPool
from ecshare.peer.phases import PhaseLog
from ecshare.peer.reads import Reads
from ecshare.peer.transfer import FailureReason, FetchFailed, Transfer, TransferState
from ecshare.store import (
    EntryExists,
    EntryMeta,
    EntryState,
    EntryTooLarge,
    Hold,
    InvalidMeta,
    Store,
    StoreFull,
)
from ecshare.transport.base import DataTransport, FailureKind, ReadState, Segment, pair_segments

log = logging.getLogger(__name__)

# A READ of at least this much, over a transport that may copy inside the read call
# (`DataTransport.may_copy_in_call`), tells whether its producer's READs end inside the
# call (`PeerLink.copies_in_call`): only those are worth lending a caller's thread to.
COPY_PROBE_BYTES = 1 << 20


class Pulls:
    """Network thread only (or a caller lending its thread under the consumer's
    network lock: `on_network_thread` tells them apart)."""

    def __init__(
        self,
        store: Store,
        config: Config,
        transport: DataTransport,
        *,
        book: FetchBook,
        reads: Reads,
        locations: Locations,
        landing: TagLanding | None,
        peers: LinkPool,
        count: Callable[[str], None],
        count_add: Callable[[str, int], None],
        succeed: Callable[..., None],
        take_hold: Callable[[str, Hold], bool],
        on_network_thread: Callable[[], bool],
    ) -> None:
        """`succeed(t, endpoint, read=nbytes)`: `t` is committed (or found READY);
        `take_hold(mm_hash, hold)`: pin a READY entry for a caller."""
        self._store = store
        self._config = config
        self._transport = transport
        self._book = book
        self._reads = reads
        self._locations = locations
        self._landing = landing
        self._peers = peers
        self._links = peers.links
        self._count = count
        self._count_add = count_add
        self._succeed = succeed
        self._take_hold = take_hold
        self._on_network_thread = on_network_thread
        self.phases: PhaseLog | None = None
        self._request_ids = itertools.count(1)
        # Direct reads whose bytes have landed and whose tags are to be read back.
        self._tags_due: list[tuple[PeerLink, Transfer]] = []
        # Peers whose data plane a caller reading on its own thread found gone, for
        # the network thread to end (only it may close their sockets).
        self.peers_lost: list[tuple[str, str]] = []

    def peer_failed(self, link: PeerLink, reason: FailureReason, detail: str, now: float) -> None:
        log.warning("peer %s failed (%s): %s", link.endpoint, reason.value, detail)
        self._count(f"peer_failures.{reason.value}")
        link.quarantine(now, reason)  # its session's reservations are orphaned first
        for t in self._book.of_peer(link.endpoint):
            self.move_on(t, reason, detail)  # a read in flight is fenced on the way

    def dispatch_direct(self, now: float) -> None:
        """READ the queued fetches whose entries' places are known, one READ per peer,
        each checked as `Locations.read_of` says. Runs before the requests are
        batched, so that one that falls back (on one host a READ ends inside the
        call) is asked for in the same pass."""
        found: dict[str, tuple[PeerLink, list[tuple[Transfer, p.Location]]]] = {}
        for t in self._book.due(now):
            if t.awaiting_push:
                continue
            link = self._links.get(t.peer or "")
            if link is None or link.state is not PeerLinkState.READY:
                continue
            where = self._locations.where(t, link)
            if where is not None:
                found.setdefault(link.endpoint, (link, []))[1].append((t, where))
        for link, batch in found.values():
            by_tag = direct.by_tag(where for _, where in batch)
            reads: list[tuple[Transfer, list[Segment]]] = []
            for t, where in batch:
                t.read = self._locations.read_of(where, link, by_tag=by_tag)
                t.direct_tried = True
                if self.phases is not None:
                    self.phases.mark(t.mm_hash, "granted")
                FetchBook.describe(t, where, self._config.fetch_deadline_s(where.nbytes))
                self._start_read(link, t, reads)
            self._count_add("direct_reads", len(batch))
            self.post_reads(link, reads)

    def _read_tags(self) -> None:
        """The bytes of these direct reads have landed: read their entries' tags back.
        From a producer on this host, straight from its memory, all of them in one
        system call (`PeerLink.peek`); else one READ per producer (per
        `TAGS_PER_READ` of them), into the landing's slots (`ecshare.peer.landing`)."""
        due, self._tags_due = self._tags_due, []
        assert self._landing is not None  # no tag is asked for without one
        by_link: dict[str, tuple[PeerLink, list[Transfer]]] = {}
        for link, t in due:
            if t.state is TransferState.READING and t.read_handle is None and t.dest is not None:
                by_link.setdefault(link.endpoint, (link, []))[1].append(t)
        for link, all_due in by_link.values():
            for i in range(0, len(all_due), TAGS_PER_READ):
                batch = all_due[i : i + TAGS_PER_READ]
                words = direct.peek_tags(link, batch, self._count)
                if words is None:
                    self._read_tags_of(link, batch)
                    continue
                self._count_add("tag_peeks", len(batch))
                for t, word in zip(batch, words, strict=True):
                    assert t.direct is not None
                    t.direct.tag_read = True
                    self._read_ended(t, link, word)

    def _read_tags_of(self, link: PeerLink, batch: list[Transfer]) -> None:
        """One READ of the tags of `batch` (at most `TAGS_PER_READ`) from `link`."""
        assert self._landing is not None
        offsets = [t.direct.tag_offset for t in batch if t.direct is not None]
        landing = self._landing.take(offsets)
        if landing is None:  # every chunk is held by READs still moving
            for t in batch:
                self._reads.drop_dest(t)
                self._direct_missed(t, "tag_landing_full")
            return
        for t, slot in zip(batch, landing.slots, strict=True):
            assert t.direct is not None
            t.direct.tag_slot = slot
            t.direct.tag_read = True
        reads = [(batch[0], landing.segments)] + [(t, []) for t in batch[1:]]
        shared = self._reads.post(link.agent, reads, landing)
        self._count("tag_reads")
        self._poll_shared(reads, shared)

    def _direct_missed(self, t: Transfer, counter: str) -> None:
        """A direct read that ended without usable bytes: ask the same peer for a grant.
        Its destination is gone already (the READ has ended)."""
        self._count(counter)
        self._locations.forget(t)
        FetchBook.ask_instead(t)

    def on_item(
        self,
        link: PeerLink,
        t: Transfer,
        item: p.ItemReply,
        now: float,
        reads: list[tuple[Transfer, list[Segment]]],
    ) -> None:
        """One item of a reply; a granted one joins `reads`, posted as one READ."""
        status = item.status
        if status is p.ItemStatus.GRANTED:
            if self.phases is not None:
                self.phases.mark(t.mm_hash, "granted")
            g = self._book.grant(t, item.grant_id, item.lease_ms / 1000 or link.lease_s)
            if self._config.checksum != "none" and item.checksum is None:
                # Silently accepting it would downgrade the integrity asked for.
                link.release([item.grant_id], g.session_id)
                self._count("checksum_missing")
                self.move_on(t, FailureReason.CHECKSUM_MISSING, f"{self._config.checksum} required")
                return
            if t.give_up_at() <= now:
                link.release([item.grant_id], g.session_id)
                self._count("grants_expired_on_arrival")
                self.move_on(t, FailureReason.DEADLINE, "the grant's lease ended in transit")
                return
            FetchBook.describe(t, item, self._config.fetch_deadline_s(item.nbytes))
            self._start_read(link, t, reads)
        elif status.retryable:
            if status is p.ItemStatus.OVERLOADED:
                link.releases_ahead()  # our finished grants may be what fills the session
            cfg = self._config
            if not FetchBook.back_off(
                t,
                now,
                item.retry_after_ms / 1000,
                retries=cfg.max_retries,
                first_s=cfg.retry_initial_backoff_s,
                max_s=cfg.retry_max_backoff_s,
            ):
                self.move_on(t, FailureReason.RETRIES_EXHAUSTED, status.value)
                return
            self._count(f"retries.{status.value}")
        else:
            reason = {
                p.ItemStatus.MISSING: FailureReason.MISSING,
                p.ItemStatus.INCOMPATIBLE: FailureReason.INCOMPATIBLE,
                p.ItemStatus.TOO_LARGE: FailureReason.TOO_LARGE,
            }.get(status, FailureReason.MISSING)
            self.move_on(t, reason, item.detail or status.value)

    def _release_grant(self, link: PeerLink, t: Transfer) -> None:
        """A granted read is over: its grant goes back (a direct read has none)."""
        g = t.granted
        if g is not None:
            link.release([g.grant_id], g.session_id)

    def _start_read(
        self, link: PeerLink, t: Transfer, reads: list[tuple[Transfer, list[Segment]]]
    ) -> None:
        """Check the grant (or the location) and take the destination; the READ goes out
        with the reply's others (`_post_reads`)."""
        region_size = link.region_size
        total = sum(n for _, n in t.remote_extents)
        if (
            t.nbytes <= 0
            or total != t.nbytes
            or any(o < 0 or n <= 0 or o + n > region_size for o, n in t.remote_extents)
        ):
            # A grant we cannot trust is never read.
            self._count("bad_grants")
            self._release_grant(link, t)
            self.move_on(t, FailureReason.TRANSPORT, "grant extents invalid")
            return
        meta = EntryMeta(dtype=t.dtype or "uint8", shape=t.shape, checksum=t.checksum)
        try:
            dest = self._store.allocate(t.mm_hash, t.nbytes, meta)
        except EntryExists:
            self._release_grant(link, t)
            existing = self._store.get(t.mm_hash)
            if (
                existing is not None
                and existing.state is EntryState.READY
                and all(self._take_hold(t.mm_hash, h) for h in t.holds)
            ):
                t.move(TransferState.READING)
                self._succeed(t, link.endpoint)
            else:
                self.move_on(t, FailureReason.LOCAL_STORE_FULL, "entry being written locally")
            return
        except (StoreFull, EntryTooLarge) as exc:
            self._release_grant(link, t)
            self.move_on(t, FailureReason.LOCAL_STORE_FULL, str(exc))
            return
        except InvalidMeta as exc:
            # The grant disagrees with itself (dtype and shape against nbytes):
            # a grant we cannot trust, like one with bad extents.
            self._release_grant(link, t)
            self.move_on(t, FailureReason.TRANSPORT, f"grant meta invalid: {exc}")
            return
        t.dest = dest
        t.move(TransferState.READING)
        reads.append((t, pair_segments(dest.extents, t.remote_extents)))

    def post_reads(self, link: PeerLink, reads: list[tuple[Transfer, list[Segment]]]) -> None:
        """One READ for the destinations of a reply's granted items (`SharedRead`)."""
        reads = [
            (t, segs)
            for t, segs in reads
            if t.state is TransferState.READING and t.read_handle is None and t.dest is not None
        ]
        if not reads:
            return
        if self.phases is not None:
            start = time.monotonic()
            for t, _ in reads:
                self.phases.mark(t.mm_hash, "read_start", start)
        shared = self._reads.post(link.agent, reads)
        if self.phases is not None:
            back = time.monotonic()
            for t, _ in reads:
                self.phases.mark(t.mm_hash, "read_return", back)
        self._count_add("reads_started", len(reads))
        self._count("read_posts")
        if self._transport.may_copy_in_call and sum(t.nbytes for t, _ in reads) >= COPY_PROBE_BYTES:
            link.copies_in_call = self._reads.poll(shared).state is ReadState.DONE
        self._poll_shared(reads, shared)
        if self._tags_due:
            self._read_tags()

    def _poll_shared(self, reads: list[tuple[Transfer, list[Segment]]], shared: object) -> None:
        """Look at a READ just posted for each of its transfers: on one host it has ended
        already. A failed READ that takes its peer down moves the others on with it."""
        for t, _ in reads:
            if t.state is TransferState.READING and t.read_handle is shared:
                self._poll_read(t)

    def poll_reads(self) -> None:
        for t in self._book.reading():
            if t.state is TransferState.READING and t.read_handle is not None:
                self._poll_read(t)
        if self._tags_due:
            self._read_tags()

    def _poll_read(self, t: Transfer) -> None:
        ended = self._reads.ended(t)
        if ended is None:
            return
        status, landed = ended
        if self.phases is not None:
            self.phases.mark(t.mm_hash, "done")
        link = self._links[t.candidates[t.peer_index]]
        self._release_grant(link, t)
        if status.state is ReadState.FAILED:
            self._reads.drop_dest(t)
            if status.failure is FailureKind.PEER_DISCONNECTED:
                if not self._on_network_thread():  # `CallerThread.read_here`
                    # Ending the session closes its ZMQ sockets, which only the network
                    # thread may touch: it does so first thing in its next pass (`t`
                    # waits, READING with nothing in flight, until then).
                    self.peers_lost.append((link.endpoint, status.detail))
                    return
                # This moves every transfer of the peer on, `t` included; moving
                # `t` again would skip its next candidate.
                self.peer_failed(
                    link, FailureReason.PEER_UNREACHABLE, status.detail, time.monotonic()
                )
                return
            if t.direct is not None:
                self._direct_missed(t, "direct_reads_failed")
                return
            self.move_on(t, FailureReason.TRANSPORT, status.detail)
            return
        self._read_ended(t, link, landed)

    def _read_ended(self, t: Transfer, link: PeerLink, landed: int) -> None:
        """`t`'s READ has ended well: check, commit and succeed (`landed`: the word its
        tag's read brought back, if any)."""
        d = t.direct
        if d is not None:
            if d.tag and not d.tag_read:
                self._tags_due.append((link, t))  # `_read_tags`, with the others of this pass
                return
            if not direct.intact(self._store, t, landed) or (d.tag and not self._verify(t)):
                # Evicted and its blocks reused since it was located, or (a tag proves
                # only the blocks, not their bytes) written by another reader: not this
                # entry, and the granted read checks it again.
                self._reads.drop_dest(t)
                self._direct_missed(t, "direct_reads_stale")
                return
            if self.phases is not None:
                self.phases.mark(t.mm_hash, "checked")
        else:
            g = t.granted
            assert g is not None  # a read is direct or granted
            if time.monotonic() > g.lease_end:
                # The producer may have reused its blocks before the read finished.
                self._reads.drop_dest(t)
                self._count("lease_overruns")
                self.move_on(t, FailureReason.DEADLINE, "the read ended after the lease ran out")
                return
            if not self._verify(t):
                self._reads.drop_dest(t)
                self._count("checksum_failures")
                self.move_on(t, FailureReason.CHECKSUM_MISMATCH, "checksum differs")
                return
        holds = list(t.holds)
        assert t.dest is not None  # a READ is posted only for a transfer with its destination
        self._store.commit(t.dest, holds=holds)
        if self.phases is not None:
            self.phases.mark(t.mm_hash, "committed")
        self._succeed(t, link.endpoint, read=t.nbytes)  # no caller joins it after this
        for late in t.holds[len(holds) :]:  # joined between the commit and _succeed
            self._take_hold(t.mm_hash, late)

    def _verify(self, t: Transfer) -> bool:
        if self._config.checksum == "none" or t.dest is None:
            return True
        if t.checksum is None:  # refused at grant time; never accepted unchecked
            return False
        return self._store.checksum(t.dest) == t.checksum

    def fail(self, t: Transfer, reason: FailureReason, detail: str) -> None:
        if t.state is TransferState.READING:
            self._reads.abandon(t)
        t.move(TransferState.FAILED)
        self._count(f"failed.{reason.value}")
        self._book.finish(t)
        t.future.set_exception(FetchFailed(t.mm_hash, reason, detail))

    def move_on(self, t: Transfer, reason: FailureReason, detail: str) -> None:
        """Leave the current peer: queue for the next candidate, or fail for good."""
        if t.state in (TransferState.DONE, TransferState.FAILED):
            return
        if t.state is TransferState.READING:
            self._reads.abandon(t)
        if FetchBook.fail_over(t, reason):
            self._count("failovers")
        else:
            self.fail(t, t.final_reason(), detail)

    def dispatch(self, now: float) -> None:
        if self._locations:
            self.dispatch_direct(now)
        batches: dict[str, list[Transfer]] = {}
        for t in self._book.due(now):
            endpoint = t.peer
            assert endpoint is not None
            link = self._peers.link(endpoint)
            if link is None:
                self._count("refused_peer_links")
                self.move_on(
                    t,
                    FailureReason.PEER_UNREACHABLE,
                    f"every one of max_peer_links={self._config.max_peer_links} links is busy",
                )
                continue
            if link.state is PeerLinkState.QUARANTINED:
                self.move_on(t, link.quarantine_reason, "peer quarantined")
                continue
            if link.state is not PeerLinkState.READY:
                link.connect(now)
                continue
            batches.setdefault(endpoint, []).append(t)
        for endpoint, transfers in batches.items():
            link = self._links[endpoint]
            limit = link.max_batch_items
            for i in range(0, len(transfers), limit):
                self.request(link, transfers[i : i + limit], now)

    def request(
        self, link: PeerLink, chunk: list[Transfer], now: float, *, lane_only: bool = False
    ) -> None:
        """One FetchRequest for `chunk` (at most the link's batch)."""
        request_id = f"r{next(self._request_ids)}"
        self._book.ask(chunk, request_id, link.session_id, now)
        if self.phases is not None:
            sent = time.monotonic()  # before the send, so before the producer's marks
            for t in chunk:
                self.phases.mark(t.mm_hash, "sent", sent)
        link.request(
            request_id,
            [p.ItemRequest(t.mm_hash, t.max_nbytes) for t in chunk],
            chunk,
            now,
            lane_only=lane_only,
        )
        self._count("requests")

    def expire(self, now: float) -> None:
        late, leases_out = self._book.expired(now)
        for t in late:
            # A read in flight keeps its grant: it is fenced, and released when it ends.
            link = self._links.get(t.peer or "")
            if link is not None and t.state is not TransferState.READING:
                self._release_grant(link, t)
            self.fail(t, FailureReason.DEADLINE, f"no data within {t.deadline - t.started:.3f} s")
        for t in leases_out:
            if t.state is TransferState.READING:  # not moved on by an earlier one
                self._count("leases_run_out")
                self.move_on(t, FailureReason.DEADLINE, "the grant's lease ran out")
        for link in self._links.values():
            for request_id, transfers in link.expired_requests(now):
                for t in transfers:
                    g = t.granted
                    if (
                        t.state is TransferState.REQUESTED
                        and g is not None
                        and g.request_id == request_id
                    ):
                        self.move_on(t, FailureReason.PEER_UNREACHABLE, "request timed out")

    def renew(self, now: float) -> None:
        """Ask for more lease time for reads that need it, half-way through the lease."""
        for endpoint, transfers in self._book.renewals_due(now).items():
            granted = [g for t in transfers if (g := t.granted) is not None]
            link = self._links.get(endpoint)
            if link is None or not link.renews or link.state is not PeerLinkState.READY:
                for g in granted:
                    g.renew_at = math.inf  # no renewal to be had: the lease decides
                continue
            for g in granted:
                if g.session_id != link.session_id:
                    g.renew_at = math.inf  # a grant of an ended session: its lease decides
            granted = [g for g in granted if g.session_id == link.session_id]
            if not granted:
                continue
            for g in granted:
                g.renew_sent = now
            link.renew([g.grant_id for g in granted])
            self._count_add("renewals_sent", len(granted))

    def on_renewed(self, link: PeerLink, msg: p.Renewed) -> None:
        renewed, refused = self._book.renewed(
            link.endpoint, link.renewal_answered(), set(msg.renewed), msg.lease_ms / 1000
        )
        if renewed:
            self._count_add("renewed", renewed)
        if refused:
            self._count_add("renewals_refused", refused)

    def end_quietly(self, t: Transfer, reason: FailureReason, detail: str) -> None:
        """Fail `t`, even from state the error that killed the thread left broken."""
        try:
            self.fail(t, reason, detail)
        except Exception:
            log.exception("while failing %s", t.mm_hash)
            if not t.future.done():
                t.future.set_exception(FetchFailed(t.mm_hash, reason, detail))
