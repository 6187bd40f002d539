"""The producer's side of push: offer READY entries to consumers and WRITE them.

    OFFERED --accepted--> WRITING --backend DONE--> PUSHED
       |                     \\--backend FAILED--> FAILED(reason)
       \\--refused / no answer / session ended--> REFUSED or FAILED   (nothing written)

A push goes to a consumer session that announced `CAP_PUSH` under a name
(`Hello.push_name`); only such a session, authenticated by CURVE and on the
producer's allow-list like any other, can be pushed to. The push pins its
source entry (owner ``push:<session>``) from the offer until the data plane
has ended the write: DONE or FAILED on the handle we hold, never a timeout, a
session ending or a word from the consumer. Only then is the consumer told
(`PushDone`), and only then may it reuse the blocks it reserved. The write
carries no NIXL notification: one would hold its DONE, and the next transfer's
on that endpoint, until the consumer's thread polls its data plane. Where the
`PushDone` must wait for a later session, the push's notice is sent on the data
plane once the write is DONE (`_notice`), so that a consumer that fenced the
blocks hears of the write's end without that session. An accepted
offer we decide not to write (we gave up waiting for the answer) is answered
`PushDone(written=False)` at once, so the consumer's blocks go back.

Where the session that asked is gone when the write ends, the `PushDone` is
kept (bounded) and sent to the next session of the same key and push name,
so that a consumer that only lost its control connection hears of it.

Standing credit. A consumer may grant a session a credit (`PushCredit`): blocks
reserved ahead of time. A push whose item fits the credit held skips the offer:
it says what it writes (`PushCredited`, before the write, on the same session)
and writes into the credit's first bytes at once; the rest is as above, its
`PushDone` (and notice) naming the credit. A credit is used once; the
consumer grants the next. Otherwise (none held, the item too large) the push
offers, as ever. A credit still unused when its session ends is returned with a
`PushDone(written=False)`, kept for the consumer's next session like any other;
one the consumer says is void (`PushCreditVoid`: its grant or return may have been
lost with a cut connection) is dropped, answered so, and never written after.

All of it runs on the producer's network thread; `Producer.push` only queues.
"""

from __future__ import annotations

import collections
import enum
import itertools
import logging
import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Final

from ecshare import protocol as p
from ecshare.config import Config
from ecshare.peer.machine import Transitions
from ecshare.peer.notices import PUSH_NOTICE
from ecshare.peer.phases import PhaseLog
from ecshare.store import EntryState, NotFound, NotReady, Store
from ecshare.transport.base import ReadState, WritingTransport, pair_segments

log = logging.getLogger(__name__)

PUSH_OWNER_PREFIX: Final = "push:"
# PushDones kept for consumers whose session ended before the write did.
_UNREPORTED_PER_CONSUMER: Final = 1024
# Credit ids a session remembers as used, so that a repeated grant is never written.
_USED_CREDITS: Final = 1024
# A write still moving when its call returns is polled this long, napping between,
# before the loop goes on (see `Pusher._write`).
_WRITE_WAIT_S: Final = 0.0005
_WRITE_NAP_S: Final = 0.00005


class PushState(enum.Enum):
    OFFERED = "offered"
    WRITING = "writing"
    PUSHED = "pushed"
    REFUSED = "refused"
    FAILED = "failed"


_LEGAL: Final[dict[PushState, frozenset[PushState]]] = {
    PushState.OFFERED: frozenset({PushState.WRITING, PushState.REFUSED, PushState.FAILED}),
    PushState.WRITING: frozenset({PushState.PUSHED, PushState.FAILED}),
    PushState.PUSHED: frozenset(),
    PushState.REFUSED: frozenset(),
    PushState.FAILED: frozenset(),
}
_MOVES: Final = Transitions(_LEGAL)


@dataclass(frozen=True)
class PushOutcome:
    """How one push ended. `pushed` is True only when the whole write completed;
    otherwise the consumer pulls the item as it would have without push."""

    mm_hash: str
    to: str
    state: PushState
    detail: str = ""
    nbytes: int = 0
    elapsed_s: float = 0.0

    @property
    def pushed(self) -> bool:
        return self.state is PushState.PUSHED


@dataclass(eq=False)
class PushTarget:
    """What the pusher needs of one consumer session (the producer's `grants.Session`)."""

    session_id: str
    user: str
    push_name: str
    agent: str  # the consumer's data-plane name, loaded into our transport
    region_size: int
    send: Callable[[p.Message], bool]
    credits: bool = False  # the session agreed to standing credit
    credit: p.PushCredit | None = None  # the one held now, unused
    used_credits: collections.OrderedDict[str, None] = field(
        default_factory=collections.OrderedDict
    )


@dataclass(eq=False)
class _Push:
    push_id: str
    mm_hash: str
    to: str
    target: PushTarget
    owner: str
    started: float
    futures: list[Future[PushOutcome]] = field(default_factory=list)
    state: PushState = PushState.OFFERED
    nbytes: int = 0
    offered_at: float = 0.0
    handle: object | None = None
    session_gone: bool = False
    pin_id: str = ""  # the source's pin: the push id, or for a credited push its own

    def __post_init__(self) -> None:
        self.pin_id = self.pin_id or self.push_id

    def move(self, new: PushState) -> None:
        _MOVES.check(f"push {self.push_id}", self.state, new)
        self.state = new


class Pusher:
    """Pushes of one producer. Only its network thread calls it, except `request`."""

    def __init__(
        self,
        store: Store,
        config: Config,
        transport: WritingTransport,
        *,
        count: Callable[[str, int], None],
    ) -> None:
        self._store = store
        self._config = config
        self._transport = transport
        self._count = count
        self._ids = itertools.count(1)
        self._requests: collections.deque[tuple[str, str, Future[PushOutcome], float]] = (
            collections.deque()
        )
        self._pushes: dict[str, _Push] = {}  # push id -> push, until it has ended
        self._single: dict[tuple[str, str], _Push] = {}  # (to, mm_hash) -> push
        self._targets: dict[str, PushTarget] = {}  # session id -> target
        # (user, push name) -> PushDones whose session ended before the write did.
        self._unreported: dict[tuple[str, str], collections.deque[p.PushDone]] = {}
        # Credit ids a consumer said are void: never written, whenever their grant comes.
        self._void_credits: collections.OrderedDict[str, None] = collections.OrderedDict()
        # Per-item timestamps of each step of a push (see peer/phases.py); off unless set.
        self.phases: PhaseLog | None = None

    # -- any thread --------------------------------------------------------------------------

    def request(self, mm_hash: str, to: str) -> Future[PushOutcome]:
        future: Future[PushOutcome] = Future()
        future.set_running_or_notify_cancel()
        asked = time.monotonic()
        if self.phases is not None:
            self.phases.mark(mm_hash, "push_call", asked)
        self._requests.append((mm_hash, to, future, asked))  # deque: thread-safe
        return future

    @property
    def in_flight(self) -> int:
        return len(self._pushes)

    def largest_in_flight(self) -> int:
        # The network thread owns the dict; copying its values is one step under the GIL.
        return max((x.nbytes for x in tuple(self._pushes.values())), default=0)

    def target_names(self) -> frozenset[str]:
        """The push names of the consumer sessions that accept pushes now."""
        # The network thread owns the dict; copying its values is one step under the GIL.
        return frozenset(t.push_name for t in tuple(self._targets.values()))

    # -- the network thread ------------------------------------------------------------------

    @property
    def writing(self) -> bool:
        """A write is outstanding: the loop must poll it to learn when it ends."""
        return any(x.state is PushState.WRITING for x in self._pushes.values())

    def add_target(self, target: PushTarget) -> None:
        # A repeated Hello of a session keeps the target its pushes refer to.
        kept = self._targets.pop(target.session_id, None)
        target = kept if kept is not None else target
        self._targets[target.session_id] = target  # the newest last
        for done in self._unreported.pop((target.user, target.push_name), ()):
            target.send(done)
            self._count("push_done_reported_late", 1)

    def target_ended(self, session_id: str) -> None:
        """The session is gone: offers end unwritten, writes run on to the backend's end.
        The consumer's agent is unloaded once no session uses it and no write to it is
        moving (`_retire_unused`)."""
        target = self._targets.pop(session_id, None)
        if target is None:
            return
        if target.credit is not None:
            # Unused: its blocks are the consumer's again, which it hears on its next session.
            self._report_later(target, self._returned(target.session_id, target.credit))
            target.credit = None
        for push in list(self._pushes.values()):
            if push.target is not target:
                continue
            push.session_gone = True
            if push.state is PushState.OFFERED:
                # It may have reserved blocks whose answer never came: it hears
                # PushDone on its next session, if it has one.
                self._end(push, PushState.FAILED, "the consumer's session ended", tell=True)
        self._retire_unused(target.agent)

    def _retire_unused(self, agent: str) -> None:
        """Unload a consumer's agent that no session uses, once no write to it moves (the
        last such write, ending after its session, calls this again): a write ending after
        its session sends its notice first (`_notice`), which an unloaded agent could not
        take."""
        if any(t.agent == agent for t in self._targets.values()) or any(
            x.target.agent == agent and x.handle is not None for x in self._pushes.values()
        ):
            return
        self._transport.remove_peer(agent)

    def offer_requested(self) -> None:
        """Offer what `request` queued: first thing once woken, as each push's write
        waits on its offer's answer."""
        while self._requests:
            mm_hash, to, future, asked = self._requests.popleft()
            self._start(mm_hash, to, future, asked)

    def step(self, now: float) -> None:
        self.offer_requested()
        self.poll()
        timeout = self._config.request_timeout_s
        for push in list(self._pushes.values()):
            if push.state is PushState.OFFERED and now - push.offered_at > timeout:
                self._end(push, PushState.FAILED, "no answer to the offer", tell=True)

    def poll(self) -> None:
        for push in list(self._pushes.values()):
            if push.state is PushState.WRITING:
                self._poll_write(push)

    def renew_pins(self) -> None:
        """Keep every source pinned while its write may read it: leases never end them."""
        for push in self._pushes.values():
            self._store.renew(push.owner, push.pin_id, self._config.push_pin_s)

    def on_reply(self, session_id: str, msg: p.PushReply, woke_at: float = 0.0) -> None:
        """`woke_at`: when the loop's poll returned with it (for `phases` only)."""
        push = self._pushes.get(msg.push_id)
        if self.phases is not None and push is not None:
            self.phases.mark(push.mm_hash, "p_reply_woke", woke_at)
            self.phases.mark(push.mm_hash, "reply_read")
        if push is None or push.target.session_id != session_id:
            if msg.status is p.PushStatus.ACCEPTED:
                # A reservation for a push we no longer write: let its blocks go.
                target = self._targets.get(session_id)
                if target is not None:
                    target.send(
                        p.PushDone(
                            session_id=session_id,
                            push_id=msg.push_id,
                            written=False,
                            detail="this push was given up before its answer came",
                        )
                    )
            self._count("push_late_replies", 1)
            return
        if push.state is not PushState.OFFERED:
            self._count("push_duplicate_replies", 1)
            return
        if msg.status is not p.PushStatus.ACCEPTED:
            self._count(f"push_refused.{msg.status.value}", 1)
            why = f"{msg.status.value}: {msg.detail}" if msg.detail else msg.status.value
            self._end(push, PushState.REFUSED, why, tell=False)
            return
        self._write(push, [(e.offset, e.length) for e in msg.extents])

    def on_credit(self, session_id: str, msg: p.PushCredit | p.PushCreditVoid) -> p.Message | None:
        """A consumer's standing credit, or its word that one is void; the answer to send
        back, if any (the credit returned unused)."""
        if isinstance(msg, p.PushCreditVoid):
            return self._void(msg)
        if msg.credit_id in self._void_credits:
            self._count("push_credits_refused", 1)  # voided before it came: never written
            return self._returned(session_id, msg, "void")
        target = self._targets.get(session_id)
        if target is None or not target.credits:
            self._count("push_credits_refused", 1)
            return self._returned(session_id, msg, "no credited push on this session")
        if msg.credit_id in target.used_credits or (
            target.credit is not None and target.credit.credit_id == msg.credit_id
        ):
            self._count("push_credits_repeated", 1)  # never written twice
            return None
        if msg.credit_id in self._pushes or msg.credit_id.startswith("p"):
            # Our own offers' ids start with "p": a credit never takes one of theirs.
            self._count("push_bad_extents", 1)
            return self._returned(session_id, msg, "credit id in use")
        if any(e.length <= 0 or e.offset + e.length > target.region_size for e in msg.extents):
            self._count("push_bad_extents", 1)
            return self._returned(session_id, msg, "credit extents invalid")
        old, target.credit = target.credit, msg
        self._count("push_credits", 1)
        return self._returned(session_id, old, "replaced") if old is not None else None

    def _void(self, msg: p.PushCreditVoid) -> p.Message | None:
        self._count("push_credit_voids", 1)
        if msg.credit_id in self._pushes:
            return None  # being written: its PushDone follows the write
        self._void_credits[msg.credit_id] = None
        while len(self._void_credits) > _USED_CREDITS:
            self._void_credits.popitem(last=False)
        for target in self._targets.values():
            if target.credit is not None and target.credit.credit_id == msg.credit_id:
                target.credit = None
        return p.PushDone(
            session_id=msg.credit_session, push_id=msg.credit_id, written=False, detail="void"
        )

    def stop(self) -> None:
        """The producer is stopping: its data plane closes after this, ending every write."""
        for push in list(self._pushes.values()):
            if push.handle is not None:
                self._transport.release(push.handle)  # closing the data plane ends it
                push.handle = None
            push.session_gone = True
            self._end(push, PushState.FAILED, "producer stopping", tell=False)
        while self._requests:
            mm_hash, to, future, _ = self._requests.popleft()
            future.set_result(PushOutcome(mm_hash, to, PushState.FAILED, "producer stopping"))

    # -- inside ------------------------------------------------------------------------------

    def _start(self, mm_hash: str, to: str, future: Future[PushOutcome], asked: float) -> None:
        self._count("push_requests", 1)
        if self.phases is not None:
            self.phases.mark(mm_hash, "p_picked")
        running = self._single.get((to, mm_hash))
        if running is not None:
            self._count("push_joined", 1)
            running.futures.append(future)
            return
        target = self._target(to)
        why = ""
        if target is None:
            why = f"no push session from a consumer named {to!r}"
            self._count("push_refused.no_session", 1)
        elif len(self._pushes) >= self._config.max_pushes_in_flight:
            why = f"max_pushes_in_flight={self._config.max_pushes_in_flight} reached"
            self._count("push_refused.busy", 1)
        if target is None or why:
            future.set_result(PushOutcome(mm_hash, to, PushState.REFUSED, why))
            return
        pin_id = f"p{next(self._ids)}"
        owner = PUSH_OWNER_PREFIX + target.session_id
        try:
            self._store.pin(mm_hash, owner, pin_id, self._config.push_pin_s)
        except (NotFound, NotReady) as exc:
            self._count("push_refused.not_ready", 1)
            future.set_result(PushOutcome(mm_hash, to, PushState.REFUSED, str(exc)))
            return
        entry = self._store.pinned_entry(owner, pin_id)
        assert entry is not None and entry.state is EntryState.READY
        credit = self._credit_for(target, entry.nbytes)
        push_id = credit.credit_id if credit is not None else pin_id
        push = _Push(
            push_id, mm_hash, to, target, owner, asked, [future], nbytes=entry.nbytes, pin_id=pin_id
        )
        push.offered_at = time.monotonic()
        self._pushes[push_id] = push
        self._single[(to, mm_hash)] = push
        if credit is not None:
            # Said before the write, on the session the write's PushDone will follow.
            target.send(
                p.PushCredited(
                    session_id=target.session_id,
                    credit_id=credit.credit_id,
                    mm_hash=mm_hash,
                    nbytes=entry.nbytes,
                    dtype=entry.meta.dtype,
                    shape=list(entry.meta.shape),
                    checksum=entry.meta.checksum,
                )
            )
            if self.phases is not None:
                self.phases.mark(mm_hash, "credited")
            self._count("push_credit_writes", 1)
            self._write(push, _first_bytes(credit.extents, entry.nbytes))
            return
        if self.phases is not None:
            self.phases.mark(mm_hash, "offer_sent")
        target.send(
            p.PushOffer(
                session_id=target.session_id,
                push_id=push_id,
                mm_hash=mm_hash,
                nbytes=entry.nbytes,
                dtype=entry.meta.dtype,
                shape=list(entry.meta.shape),
                checksum=entry.meta.checksum,
            )
        )
        self._count("push_offers", 1)

    def _target(self, to: str) -> PushTarget | None:
        """The newest session of consumer `to` (a consumer that reconnected may
        still have an older one that has not timed out)."""
        found = [t for t in self._targets.values() if t.push_name == to]
        return found[-1] if found else None

    def _credit_for(self, target: PushTarget, nbytes: int) -> p.PushCredit | None:
        """The target's credit, taken for a push of `nbytes`, if it fits; else None (the
        push offers, counted)."""
        credit = target.credit
        if not target.credits:
            return None
        if credit is None:
            self._count("push_credit_fallbacks.none_held", 1)
            return None
        if nbytes > sum(e.length for e in credit.extents):
            self._count("push_credit_fallbacks.too_large", 1)
            return None
        target.credit = None
        target.used_credits[credit.credit_id] = None
        while len(target.used_credits) > _USED_CREDITS:
            target.used_credits.popitem(last=False)
        return credit

    @staticmethod
    def _returned(session_id: str, credit: p.PushCredit, why: str = "unused") -> p.PushDone:
        return p.PushDone(
            session_id=session_id, push_id=credit.credit_id, written=False, detail=why
        )

    def _write(self, push: _Push, dest: list[tuple[int, int]]) -> None:
        entry = self._store.pinned_entry(push.owner, push.pin_id)
        if (
            entry is None
            or sum(n for _, n in dest) != entry.nbytes
            or any(n <= 0 or o + n > push.target.region_size for o, n in dest)
        ):
            # Extents we cannot trust are never written to.
            self._count("push_bad_extents", 1)
            self._end(push, PushState.FAILED, "reserved extents invalid", tell=True)
            return
        segments = pair_segments(entry.extents, dest)
        push.move(PushState.WRITING)
        push.handle = self._transport.write(push.target.agent, segments)
        if self.phases is not None:
            self.phases.mark(push.mm_hash, "write_posted")
        self._count("push_writes", 1)
        # A write that the call did not end (a small one over cma, any over TCP) ends
        # within a fraction of a millisecond; polled only by the loop's passes, its end
        # is seen late, and the consumer's commit waits for the PushDone it sends.
        until = time.monotonic() + _WRITE_WAIT_S
        while True:
            self._poll_write(push)
            if push.handle is None or time.monotonic() >= until:
                return
            time.sleep(_WRITE_NAP_S)

    def _poll_write(self, push: _Push) -> None:
        status = self._transport.poll(push.handle)
        if status.state is ReadState.PENDING:
            return
        if self.phases is not None:
            self.phases.mark(push.mm_hash, "write_done")
        self._transport.release(push.handle)
        push.handle = None
        if status.state is ReadState.DONE:
            self._count("pushed", 1)
            self._count("pushed_bytes", push.nbytes)
            self._end(push, PushState.PUSHED, "", tell=True)
        else:
            self._count("push_write_failures", 1)
            self._end(push, PushState.FAILED, f"write failed: {status.detail}", tell=True)
        if push.session_gone:
            self._retire_unused(push.target.agent)

    def _notice(self, push: _Push) -> None:
        """The written push's word on the data plane, for a push whose PushDone must wait
        for a later session: the consumer may have fenced its blocks (see `inbox`). Not
        sent otherwise: a NIXL notification makes the next transfer on the endpoint wait
        for the consumer's progress (docs/PUSH.md, "Performance")."""
        if self._transport.note(push.target.agent, PUSH_NOTICE + push.push_id.encode()):
            self._count("push_notices", 1)
        else:
            self._count("push_notices_unsent", 1)  # the kept PushDone still says it

    def _report_later(self, gone: PushTarget, done: p.PushDone) -> None:
        """The session that asked is gone: tell the consumer's newest session of the
        same key and name, if one is up (it may have reconnected while the write ran),
        else keep the word for its next one (`add_target`)."""
        for target in reversed(self._targets.values()):
            if (
                target is not gone
                and (target.user, target.push_name) == (gone.user, gone.push_name)
                and target.send(done)
            ):
                self._count("push_done_reported_late", 1)
                return
        key = (gone.user, gone.push_name)
        queue = self._unreported.setdefault(key, collections.deque(maxlen=_UNREPORTED_PER_CONSUMER))
        queue.append(done)

    def _end(self, push: _Push, state: PushState, detail: str, *, tell: bool) -> None:
        """The push is over: the backend has ended its write, or none was posted."""
        assert push.handle is None, "a push ends only once its write has"
        push.move(state)
        self._store.unpin(push.owner, push.pin_id)
        del self._pushes[push.push_id]
        if self._single.get((push.to, push.mm_hash)) is push:
            del self._single[(push.to, push.mm_hash)]
        if tell:
            done = p.PushDone(
                session_id=push.target.session_id,
                push_id=push.push_id,
                written=state is PushState.PUSHED,
                detail=detail[:4000],
            )
            if self.phases is not None:
                self.phases.mark(push.mm_hash, "done_sent")
            if push.session_gone or not push.target.send(done):
                self._report_later(push.target, done)
                if state is PushState.PUSHED:
                    self._notice(push)
        if state is not PushState.PUSHED:
            self._count("push_failed" if state is PushState.FAILED else "push_refused", 1)
        outcome = PushOutcome(
            push.mm_hash,
            push.to,
            state,
            detail,
            push.nbytes,
            time.monotonic() - push.started,
        )
        for future in push.futures:
            future.set_result(outcome)


def _first_bytes(extents: list[p.Extent], nbytes: int) -> list[tuple[int, int]]:
    """The first `nbytes` of `extents`, in order."""
    out = []
    for e in extents:
        if nbytes <= 0:
            break
        out.append((e.offset, min(e.length, nbytes)))
        nbytes -= e.length
    return out
