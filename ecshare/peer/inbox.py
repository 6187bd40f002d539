"""The consumer's side of push: reserve blocks for offers, commit what was written.

    RESERVED --written (PushDone or notice), checked--> COMMITTED
       |   \\--not written (PushDone)--> RELEASED      (the blocks go back at once)
       \\--given up (deadline, session lost, bad data, stop)--> FENCED --write ended--> RELEASED

An offer is taken only on a link whose producer key this consumer allows to
push (`push_trusted_keys`), and only such a producer ever saw this consumer's
data-plane metadata (in its Hello). Anyone else's offer is refused FORBIDDEN,
counted, and learns nothing: no extents, no layout.

A reservation is an ALLOCATED entry: never announced, never READY, never a
local hit. Its blocks are the producer's to write from the ACCEPTED reply until
one of these words that the write is over, and only these:
- the push's notice on our own data plane, which the producer sends once its
  write is DONE where its `PushDone` must wait for a later session;
- the producer's `PushDone`, which it sends only once its data plane has ended
  the write (DONE or FAILED on the handle it holds) or when it never posted one;
- our own data plane's word that the producer cannot write any more: a probe
  READ from it (1 byte, into the reservation itself), posted to the producer's
  loaded agent, that the backend ends PEER_DISCONNECTED or NOT_FOUND (NIXL's
  answer once it saw that endpoint fail).
A push given up before then (its deadline, its session ended in any way, our
stop) is FENCED: the entry goes QUARANTINED, out of the index so that a pull can
fetch the item into other blocks, and its blocks come back only on one of the
words above. A probe that fails for any other reason (the agent could not be
loaded again, descriptors refused, a backend error) says nothing about the
write: the reservation stays fenced, probed again later, and is counted leaked
(`push_fences_leaked`) until a word comes. Where none ever comes they stay held:
leaked and counted, never reused.

Standing credit. On a session where both sides listed `CAP_PUSH_CREDIT`, the
inbox also keeps one reservation with no key yet (`Store.reserve`, at most
`push_credit_bytes`) granted to the producer ahead of time (`PushCredit`). A push
whose item fits it is written there with no offer: the producer says what it
writes (`PushCredited`, sent before the write), the inbox checks that word as it
checks an offer, and the credit is then a reservation like any other, except
that it commits by `Store.adopt` (which checks the digest, where one is
required, before anything is READY). A claim it refuses leaves the blocks to
the write's end, then frees them. The credit's blocks follow the same rules as
any reservation's from the moment it is granted: a session lost fences and
probes an unused credit too (the producer returns it unused with a
`PushDone(written=False)`, kept for its next session if need be; on that next
session the inbox also voids it, `PushCreditVoid`, since its grant may never
have reached the producer), and a new credit is granted once the last one is
claimed. Where a credit is due (which sessions agreed, which hold one, when to try
again) is the ledger's, `ecshare.peer.credit`.

Only the consumer's network thread calls in here, except `pending`. The module
is long because it is one state machine: every way a reservation ends, an
offer's or a credit's, goes through the same few steps here (`_written`,
`_over`, `_fence`, the probes).
"""

from __future__ import annotations

import collections
import enum
import logging
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Final

from ecshare import protocol as p
from ecshare.config import Config
from ecshare.peer.credit import Credits
from ecshare.peer.machine import Transitions
from ecshare.peer.notices import PUSH_NOTICE
from ecshare.peer.phases import PhaseLog
from ecshare.store import (
    DigestMismatch,
    Entry,
    EntryExists,
    EntryMeta,
    EntryState,
    EntryTooLarge,
    Hold,
    InvalidMeta,
    Store,
    StoreError,
    StoreFull,
)
from ecshare.transport.base import (
    DataTransport,
    FailureKind,
    PeerInfo,
    ReadState,
    Segment,
    TransportError,
)

log = logging.getLogger(__name__)

# A fenced push whose producer's data plane still answers is probed again this often.
_PROBE_INTERVAL_S: Final = 1.0
_OVER_REMEMBERED: Final = 4096
# A failed probe that is the backend's own word that the producer's endpoint is gone.
_WRITE_ENDED: Final = frozenset({FailureKind.PEER_DISCONNECTED, FailureKind.NOT_FOUND})


class ReservationState(enum.Enum):
    RESERVED = "reserved"
    COMMITTED = "committed"
    FENCED = "fenced"
    RELEASED = "released"


_LEGAL: Final[dict[ReservationState, frozenset[ReservationState]]] = {
    ReservationState.RESERVED: frozenset(
        {ReservationState.COMMITTED, ReservationState.FENCED, ReservationState.RELEASED}
    ),
    ReservationState.FENCED: frozenset({ReservationState.RELEASED}),
    ReservationState.COMMITTED: frozenset(),
    ReservationState.RELEASED: frozenset(),
}
_MOVES: Final = Transitions(_LEGAL)


@dataclass(eq=False)
class Reservation:
    endpoint: str  # the producer's control endpoint
    session_id: str
    push_id: str
    mm_hash: str
    entry: Entry
    agent: str  # the producer's data-plane name: the only source of its notification
    peer: PeerInfo  # to probe the producer's data plane once the session is gone
    checksum: int | None
    deadline: float
    reply: p.PushReply | None  # None for a credit: it was granted, not offered
    reserved_at: float
    state: ReservationState = ReservationState.RESERVED
    credit: bool = False  # a standing credit: no key until the producer claims it
    claimed: bool = False  # a credit whose PushCredited came
    refused: bool = False  # a claim refused: the blocks go back when the write ends
    written_early: bool = False  # a credit's write ended before its claim came
    meta: EntryMeta | None = None  # a claimed credit's, for `Store.adopt`
    nbytes: int = 0  # a claimed credit's: its first bytes that hold the item
    probe: object | None = None  # an outstanding probe read
    next_probe: float = 0.0
    orphaned: bool = False  # its session is gone: only the data plane can end it now
    write_ended: bool = False  # the word came while a probe was out
    leaked: bool = False  # a probe said nothing of the write: held until a word comes

    def move(self, new: ReservationState) -> None:
        _MOVES.check(f"push {self.push_id}", self.state, new)
        self.state = new


@dataclass(frozen=True)
class PushLink:
    """What the inbox needs of one producer link."""

    endpoint: str
    session_id: str
    agent: str
    peer: PeerInfo
    allowed: bool  # this producer's key may push here, and the session agreed to push


class Inbox:
    """Reservations of one consumer, keyed by (endpoint, session, push id)."""

    def __init__(
        self,
        store: Store,
        config: Config,
        transport: DataTransport,
        *,
        count: Callable[[str, int], None],
        may_reserve: Callable[[str], bool],
        holds_for: Callable[[str], list[Hold]],
        ended: Callable[[Reservation, bool], None],
        agent_loaded: Callable[[str], bool],
    ) -> None:
        """`may_reserve(mm_hash)`: no fetch of it is past waiting; `holds_for(mm_hash)`:
        pins to take as it commits; `ended(r, committed)`: a reservation is over (no
        longer a push to wait for); `agent_loaded(agent)`: a live link has it loaded."""
        self._store = store
        self._config = config
        self._transport = transport
        self._count = count
        self._may_reserve = may_reserve
        self._holds_for = holds_for
        self._ended = ended
        self._agent_loaded = agent_loaded
        self._all: dict[tuple[str, str, str], Reservation] = {}  # until RELEASED/COMMITTED
        self._by_agent: dict[tuple[str, str], Reservation] = {}  # (agent, push id)
        # mm_hash -> RESERVED reservation; read by engine threads (`pending`).
        self._reserved: dict[str, Reservation] = {}
        # Pushes over already (the notification and the PushDone both end one).
        self._over_keys: collections.OrderedDict[tuple[str, str, str], None] = (
            collections.OrderedDict()
        )
        # Producers' agents kept loaded for their orphaned reservations (how many each):
        # a probe then goes to the endpoint the write may come from, never to an agent
        # loaded anew, which may fail for reasons of its own.
        self._kept: dict[str, int] = {}
        # Where standing credit is due, and the credit each session holds unclaimed.
        self._credits: Credits[Reservation] = Credits(store, config)
        # Per-item timestamps of each step of a push (see peer/phases.py); off unless set.
        self.phases: PhaseLog | None = None

    # -- any thread --------------------------------------------------------------------------

    def pending(self, mm_hash: str) -> bool:
        """A push of `mm_hash` is reserved here and not yet over."""
        return mm_hash in self._reserved

    # -- the network thread ------------------------------------------------------------------

    def reserved(self, mm_hash: str) -> Reservation | None:
        return self._reserved.get(mm_hash)

    @property
    def awaiting_writes(self) -> bool:
        """Writes may be landing: our data plane needs progress (over TCP) and polls."""
        return bool(self._reserved)

    @property
    def fenced(self) -> int:
        return sum(1 for r in self._all.values() if r.state is ReservationState.FENCED)

    @property
    def busy(self) -> bool:
        """A push is under way; a credit nobody claimed is none (the producer is told
        of the session's end and returns it, and its blocks stay held until then)."""
        return any(not r.credit or r.claimed for r in self._all.values())

    def keeps(self, agent: str) -> bool:
        """The inbox keeps `agent` loaded for probes of orphaned reservations."""
        return agent in self._kept

    def endpoints(self) -> set[str]:
        return {r.endpoint for r in self._all.values()}

    def on_offer(self, link: PushLink, msg: p.PushOffer, now: float) -> p.PushReply:
        self._count("push_offers", 1)
        known = self._all.get((link.endpoint, msg.session_id, msg.push_id))
        if known is not None and known.reply is not None:
            self._count("push_duplicate_offers", 1)
            return known.reply
        if known is not None or (link.agent, msg.push_id) in self._by_agent:
            # It names a credit (or a push of another session): its notice is taken.
            self._count("push_refused.invalid", 1)
            return self._reply(msg, p.PushStatus.INVALID, "push id in use")
        status, detail = self._refusal(link, msg)
        if status is not None:
            self._count(f"push_refused.{status.value}", 1)
            return self._reply(msg, status, detail)
        meta = EntryMeta(dtype=msg.dtype or "uint8", shape=tuple(msg.shape), checksum=msg.checksum)
        try:
            entry = self._store.allocate(msg.mm_hash, msg.nbytes, meta)
        except EntryExists:
            self._count("push_refused.busy", 1)
            return self._reply(msg, p.PushStatus.BUSY, "being written here")
        except StoreFull as exc:
            self._count("push_refused.full", 1)
            return self._reply(msg, p.PushStatus.FULL, str(exc))
        except (InvalidMeta, EntryTooLarge) as exc:
            self._count("push_refused.invalid", 1)
            return self._reply(msg, p.PushStatus.INVALID, str(exc))
        deadline_s = self._deadline_s(msg.nbytes)
        reply = self._reply(
            msg,
            p.PushStatus.ACCEPTED,
            "",
            extents=[p.Extent(o, n) for o, n in entry.extents],
        )
        r = Reservation(
            endpoint=link.endpoint,
            session_id=msg.session_id,
            push_id=msg.push_id,
            mm_hash=msg.mm_hash,
            entry=entry,
            agent=link.agent,
            peer=link.peer,
            checksum=msg.checksum,
            deadline=now + deadline_s,
            reply=reply,
            reserved_at=now,
        )
        self._all[(r.endpoint, r.session_id, r.push_id)] = r
        self._by_agent[(r.agent, r.push_id)] = r
        self._reserved[r.mm_hash] = r
        self._count("push_reserved", 1)
        return reply

    def on_done(self, endpoint: str, msg: p.PushDone) -> None:
        key = (endpoint, msg.session_id, msg.push_id)
        r = self._all.get(key)
        if r is None:
            self._count("push_done_after_end" if key in self._over_keys else "push_unknown_done", 1)
            return
        if r.credit and not r.claimed and not msg.written:
            self._count("push_credits_returned", 1)
            self._credits.returned((r.endpoint, r.session_id))
        if self.phases is not None:
            self.phases.mark(r.mm_hash, "c_done")
        if r.state is ReservationState.FENCED:
            self._count("push_fences_ended_by_done", 1)
        if msg.written:
            self._written(r)
        else:
            self._count("push_not_written", 1)
            log.info("push of %s from %s not written: %s", r.mm_hash, endpoint, msg.detail)
            self._over(r)

    def on_notification(self, agent: str, note: bytes) -> bool:
        """A data-plane notice; True if it was a push's (taken here)."""
        if not note.startswith(PUSH_NOTICE):
            return False
        push_id = note[len(PUSH_NOTICE) :].decode("ascii", "replace")
        self._count("push_notices", 1)
        r = self._by_agent.get((agent, push_id))
        if r is None:
            self._count("push_unknown_notifications", 1)
            return True
        if self.phases is not None:
            self.phases.mark(r.mm_hash, "c_notice")
        if r.state is ReservationState.FENCED:
            self._count("push_fences_ended_by_notice", 1)
        self._written(r)
        return True

    def step(self, now: float) -> None:
        for r in list(self._all.values()):
            if r.state is ReservationState.RESERVED and now >= r.deadline:
                self._count("push_deadlines", 1)
                self._fence(r, "its deadline passed")
            if r.state is ReservationState.FENCED:
                self._probe(r, now)

    def credit_agreed(self, endpoint: str, session_id: str) -> None:
        """Both sides of this session listed `CAP_PUSH_CREDIT`."""
        self._credits.agree((endpoint, session_id))

    @property
    def credits_wanted(self) -> bool:
        """A session that agreed to credit holds none (the region had no room)."""
        return self._credits.wanted

    def voids_for(self, link: PushLink) -> list[p.PushCreditVoid]:
        """For a new session with the same producer process: the fenced credits of its
        ended sessions nobody claimed. The producer may never have had them (their
        grant lost with the connection), so only its answer to this ends them; a credit
        of a producer process gone is ended by the probe instead."""
        return [
            p.PushCreditVoid(
                session_id=link.session_id, credit_session=r.session_id, credit_id=r.push_id
            )
            for r in self._all.values()
            if r.credit
            and not r.claimed
            and r.state is ReservationState.FENCED
            and r.endpoint == link.endpoint
            and r.agent == link.agent
            and r.session_id != link.session_id
        ]

    def credit_for(self, link: PushLink, now: float) -> p.PushCredit | None:
        """A credit to grant on `link`, if it should have one and has none: reserved
        here, to be sent by the caller."""
        where = (link.endpoint, link.session_id)
        nbytes = self._credits.due(where, link.allowed, now)
        if not nbytes:
            return None
        try:
            entry = self._store.reserve(nbytes)
        except StoreError as exc:
            self._count("push_credits_unavailable", 1)
            log.info("no credit for %s now: %s", link.endpoint, exc)
            self._credits.unavailable(where, now)
            return None
        r = Reservation(
            endpoint=link.endpoint,
            session_id=link.session_id,
            push_id=self._credits.new_id(),
            mm_hash="",
            entry=entry,
            agent=link.agent,
            peer=link.peer,
            checksum=None,
            deadline=math.inf,  # standing until claimed
            reply=None,
            reserved_at=now,
            credit=True,
        )
        self._all[(r.endpoint, r.session_id, r.push_id)] = r
        self._by_agent[(r.agent, r.push_id)] = r
        self._credits.granted(where, r)
        self._count("push_credits_granted", 1)
        return p.PushCredit(
            session_id=r.session_id,
            credit_id=r.push_id,
            extents=[p.Extent(o, n) for o, n in entry.extents],
        )

    def on_credited(self, link: PushLink, msg: p.PushCredited, now: float) -> bool:
        """The producer writes an item into a credit; True when the claim was taken
        (the item's push is now reserved here, as an accepted offer's would be)."""
        key = (link.endpoint, msg.session_id, msg.credit_id)
        r = self._all.get(key)
        if r is None or not r.credit or r.claimed:
            why = "replayed" if r is not None or key in self._over_keys else "unknown"
            self._count(f"push_credit_refused.{why}", 1)
            return False
        r.claimed = True
        self._credits.forget((r.endpoint, r.session_id), r)
        deadline_s = self._deadline_s(msg.nbytes)
        why = self._credit_refusal(link, r, msg)
        if why:
            self._count(f"push_credit_refused.{why}", 1)
            log.info("credited push of %s from %s refused: %s", msg.mm_hash, r.endpoint, why)
            r.refused = True
            if r.state is ReservationState.RESERVED:
                r.deadline = now + deadline_s
                if r.written_early:
                    self._over(r)
            return False
        checksum = msg.checksum if self._config.checksum != "none" else None
        r.mm_hash = msg.mm_hash
        r.nbytes = msg.nbytes
        r.checksum = checksum
        r.meta = EntryMeta(dtype=msg.dtype or "uint8", shape=tuple(msg.shape), checksum=checksum)
        r.deadline = now + deadline_s
        r.reserved_at = now
        self._reserved[r.mm_hash] = r
        self._count("push_credit_claims", 1)
        if self.phases is not None:
            self.phases.mark(r.mm_hash, "c_claimed")
        if r.written_early:
            self._written(r)
        return True

    def session_lost(self, link: PushLink, now: float) -> None:
        """The link's session is gone: its reservations wait for the write's end,
        and a probe asks our data plane whether the producer is still there. Call
        before the link retires the producer's agent: the probe keeps it loaded."""
        self._credits.session_lost((link.endpoint, link.session_id))
        for r in list(self._all.values()):
            if r.endpoint != link.endpoint or r.session_id != link.session_id:
                continue
            if r.state is ReservationState.RESERVED:
                self._count("push_sessions_lost", 1)
                self._fence(r, "its session was lost")
            if r.state is ReservationState.FENCED and not r.orphaned:
                r.orphaned = True
                self._kept[r.agent] = self._kept.get(r.agent, 0) + 1
                r.next_probe = 0.0
                self._probe(r, now)

    def stop(self) -> None:
        """The consumer stops: every reservation still open is fenced."""
        for r in list(self._all.values()):
            if r.state is ReservationState.RESERVED:
                self._fence(r, "the consumer is stopping")

    # -- inside ------------------------------------------------------------------------------

    def _refusal(self, link: PushLink, msg: p.PushOffer) -> tuple[p.PushStatus | None, str]:
        if not link.allowed or not self._config.push_name:
            return p.PushStatus.FORBIDDEN, "this consumer takes no push from this producer"
        if self._config.checksum != "none" and msg.checksum is None:
            return p.PushStatus.INVALID, f"{self._config.checksum} checksum required"
        entry = self._store.get(msg.mm_hash)
        if entry is not None:
            if entry.state is EntryState.READY:
                return p.PushStatus.PRESENT, ""
            return p.PushStatus.BUSY, "being written here"
        if msg.mm_hash in self._reserved:
            return p.PushStatus.BUSY, "being written here"
        if not self._may_reserve(msg.mm_hash):
            return p.PushStatus.BUSY, "being fetched"
        return None, ""

    def _credit_refusal(self, link: PushLink, r: Reservation, msg: p.PushCredited) -> str:
        """Why a claim of credit `r` is not taken, the checks of an offer; "" if it is."""
        if not link.allowed or not self._config.push_name:
            return "forbidden"
        if r.state is not ReservationState.RESERVED:
            return "fenced"
        if msg.nbytes > r.entry.nbytes:
            return "too_large"
        if self._config.checksum != "none" and msg.checksum is None:
            return "invalid"
        entry = self._store.get(msg.mm_hash)
        if entry is not None:
            return "present" if entry.state is EntryState.READY else "busy"
        if msg.mm_hash in self._reserved or not self._may_reserve(msg.mm_hash):
            return "busy"
        return ""

    def _deadline_s(self, nbytes: int) -> float:
        return self._config.push_deadline_s + self._config.fetch_deadline_per_gib_s * (
            nbytes / (1 << 30)
        )

    @staticmethod
    def _reply(
        msg: p.PushOffer,
        status: p.PushStatus,
        detail: str,
        *,
        extents: list[p.Extent] | None = None,
    ) -> p.PushReply:
        return p.PushReply(
            session_id=msg.session_id,
            push_id=msg.push_id,
            status=status,
            extents=extents or [],
            detail=detail[:4000],
        )

    def _written(self, r: Reservation) -> None:
        """The write has ended with all its data in place."""
        if r.state is ReservationState.FENCED:
            self._over(r)
            return
        if r.state is not ReservationState.RESERVED:
            return
        if r.credit:
            self._adopt(r)
            return
        if self._config.checksum != "none" and (
            r.checksum is None or self._store.checksum(r.entry) != r.checksum
        ):
            self._count("push_checksum_failures", 1)
            self._over(r)  # ended: the blocks go back, the item is pulled
            return
        r.move(ReservationState.COMMITTED)
        self._drop(r)
        self._store.commit(r.entry, holds=self._holds_for(r.mm_hash))
        if self.phases is not None:
            self.phases.mark(r.mm_hash, "committed")
        self._count("push_committed", 1)
        self._count("push_committed_bytes", r.entry.nbytes)
        self._ended(r, True)

    def _adopt(self, r: Reservation) -> None:
        """A credit's write has ended: commit what it was claimed to hold, if it checks."""
        if not r.claimed:
            r.written_early = True  # its claim, sent before the write, is on its way
            return
        if r.refused or r.meta is None:
            self._over(r)
            return
        try:
            self._store.adopt(
                r.entry, r.mm_hash, r.nbytes, r.meta, holds=self._holds_for(r.mm_hash)
            )
        except StoreError as exc:  # the store freed the blocks: the write has ended
            if isinstance(exc, DigestMismatch):
                self._count("push_checksum_failures", 1)
            else:
                self._count("push_credit_refused.adopt", 1)
            log.warning("credited push of %s from %s not kept: %s", r.mm_hash, r.endpoint, exc)
            r.move(ReservationState.RELEASED)
            self._drop(r)
            self._ended(r, False)
            return
        r.move(ReservationState.COMMITTED)
        self._drop(r)
        if self.phases is not None:
            self.phases.mark(r.mm_hash, "committed")
        self._count("push_committed", 1)
        self._count("push_credit_committed", 1)
        self._count("push_committed_bytes", r.nbytes)
        self._ended(r, True)

    def _over(self, r: Reservation) -> None:
        """The write has ended (or never began): the blocks go back now."""
        if r.state is ReservationState.RESERVED:
            self._store.abort(r.entry)
        elif r.state is ReservationState.FENCED:
            if r.probe is not None:
                r.write_ended = True  # the probe reads into these blocks: wait for it
                return
            self._store.release_quarantined(r.entry)
            self._count("push_fenced_ended", 1)
        else:
            return
        was = r.state
        r.move(ReservationState.RELEASED)
        self._drop(r)
        if was is ReservationState.RESERVED and r.mm_hash:
            self._ended(r, False)

    def _fence(self, r: Reservation, why: str) -> None:
        log.info("push %s of %s from %s given up (%s)", r.push_id, r.mm_hash, r.endpoint, why)
        self._store.quarantine(r.entry)
        r.move(ReservationState.FENCED)
        if self._reserved.get(r.mm_hash) is r:
            del self._reserved[r.mm_hash]
        self._credits.forget((r.endpoint, r.session_id), r)
        self._count("push_fenced", 1)
        if r.mm_hash:
            self._ended(r, False)
        if r.written_early:
            self._over(r)  # its write's word came already: nothing writes the blocks now

    def _inconclusive(self, r: Reservation, why: str) -> None:
        """A probe said nothing of the write: the blocks stay fenced, counted leaked."""
        self._count("push_probes_inconclusive", 1)
        if not r.leaked:
            r.leaked = True
            self._count("push_fences_leaked", 1)
            log.warning("push %s of %s stays fenced: %s", r.push_id, r.mm_hash, why)

    def _drop(self, r: Reservation) -> None:
        key = (r.endpoint, r.session_id, r.push_id)
        self._over_keys[key] = None
        if len(self._over_keys) > _OVER_REMEMBERED:
            self._over_keys.popitem(last=False)
        self._all.pop(key, None)
        self._by_agent.pop((r.agent, r.push_id), None)
        if r.orphaned and r.agent in self._kept:
            self._kept[r.agent] -= 1
            if not self._kept[r.agent]:
                del self._kept[r.agent]
                if not self._agent_loaded(r.agent):
                    self._transport.remove_peer(r.agent)  # no link uses it any more
        if self._reserved.get(r.mm_hash) is r:
            del self._reserved[r.mm_hash]
        self._credits.forget((r.endpoint, r.session_id), r)

    def _probe(self, r: Reservation, now: float) -> None:
        """For an orphaned reservation, ask our data plane whether the producer can
        still write: a 1-byte READ from its region into this (fenced) reservation.
        FAILED means the backend cannot reach it any more; DONE, that it lives (its
        write's notification, or its PushDone on a later session, will come)."""
        if r.probe is not None:
            status = self._transport.poll(r.probe)
            if status.state is ReadState.PENDING:
                return
            self._transport.release(r.probe)
            r.probe = None
            if status.state is ReadState.FAILED:
                log.info("probe of %s failed: %s (%s)", r.agent, status.failure, status.detail)
            if status.state is ReadState.FAILED and status.failure in _WRITE_ENDED:
                self._count("push_probes_failed", 1)
                r.write_ended = True
            elif status.state is ReadState.FAILED:
                self._inconclusive(r, f"probe failed: {status.detail}")
            if r.write_ended:
                self._over(r)
                return
            r.next_probe = now + _PROBE_INTERVAL_S
            return
        if not r.orphaned or now < r.next_probe:
            return
        # Kept loaded since the reservation was orphaned; were it gone anyway, load it.
        added = False
        if r.agent not in self._kept and not self._agent_loaded(r.agent):
            try:
                self._transport.add_peer(r.peer)
                added = True
            except Exception as exc:
                # A read of an agent not loaded fails here, not in the backend: no word.
                self._inconclusive(r, f"cannot load {r.agent} again to probe it: {exc}")
                r.next_probe = now + _PROBE_INTERVAL_S
                return
        dest = r.entry.extents[0][0]
        try:
            r.probe = self._transport.read(r.agent, [Segment(dest, 0, 1)])
        except TransportError as exc:
            # Our data plane refused to post (its owner closed it): no word of the write.
            self._inconclusive(r, f"cannot probe {r.agent}: {exc}")
        else:
            self._count("push_probes", 1)
        if added:
            self._transport.remove_peer(r.agent)  # retired until the probe ends
        r.next_probe = now + _PROBE_INTERVAL_S
