"""The fetch book: which fetches exist, what state each is in, what is due next.

A passive core (no I/O: no READ posted, no message sent, no clock read). The
consumer's network loop asks it what to do (`due`, `expired`, `renewals_due`)
and tells it what happened (`ask`, `grant`, `back_off`, `fail_over`,
`renewed`); the sockets and the data plane live around it. Its guarantees:
- One fetch per item at a time (single flight): a second fetch of an item in
  flight joins the first (`running`), its pin taken at the first's commit.
- A fetch moves only along `ecshare.peer.transfer`'s transitions, and every
  fetch that leaves the book (`finish`) leaves it whole: from the queue of new
  ones, the table, and the single-flight index alike.
- A grant's lease is counted from when its request was sent, so it can only
  end early on this side's clock; a read is given up `lease_margin` before it
  unless a renewal (asked for half-way) extended it.

`lock` guards what callers on other threads touch (`incoming`, `inflight`,
and `Transfer.holds` of a fetch they join); the rest is the network thread's.
"""

from __future__ import annotations

import collections
import math
import threading
from collections.abc import Iterable

from ecshare import protocol as p
from ecshare.peer.transfer import FailureReason, GrantedRead, Transfer, TransferState

_ENDED = (TransferState.DONE, TransferState.FAILED)


class FetchBook:
    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.incoming: collections.deque[Transfer] = collections.deque()  # under lock
        self.inflight: dict[str, Transfer] = {}  # mm_hash -> transfer; under lock
        self.transfers: list[Transfer] = []  # picked up: the network thread's

    # -- in and out ----------------------------------------------------------------------

    def running(self, mm_hash: str) -> Transfer | None:
        """The fetch of `mm_hash` in flight, if any (the caller holds `lock`)."""
        return self.inflight.get(mm_hash)

    def add(self, t: Transfer) -> None:
        """A new fetch, queued for the network thread (the caller holds `lock`)."""
        self.inflight[t.mm_hash] = t
        self.incoming.append(t)

    def take_incoming(self) -> list[Transfer]:
        """The fetches queued since the last call, from now on in the table."""
        with self.lock:
            picked = list(self.incoming)
            self.incoming.clear()
        self.transfers.extend(picked)
        return picked

    def take_stranded(self) -> list[Transfer]:
        """The queued fetches nobody will pick up (the consumer stops)."""
        with self.lock:
            stranded = list(self.incoming)
            self.incoming.clear()
        return stranded

    def finish(self, t: Transfer) -> None:
        """`t` has ended: out of the table and the single-flight index."""
        if t in self.transfers:
            self.transfers.remove(t)
        with self.lock:
            if self.inflight.get(t.mm_hash) is t:
                del self.inflight[t.mm_hash]

    def pending(self) -> int:
        with self.lock:
            return len(self.inflight)

    # -- what is due ---------------------------------------------------------------------

    def of_peer(self, endpoint: str) -> list[Transfer]:
        return [t for t in self.transfers if t.peer == endpoint]

    def due(self, now: float) -> list[Transfer]:
        """Queued fetches whose backoff or push wait is over."""
        return [
            t for t in self.transfers if t.state is TransferState.QUEUED and t.not_before <= now
        ]

    def reading(self) -> list[Transfer]:
        """Fetches whose READ is in flight."""
        return [
            t
            for t in self.transfers
            if t.state is TransferState.READING and t.read_handle is not None
        ]

    def wake_at(self, now: float, wake_at: float) -> float:
        """The earliest deadline or end of a backoff before `wake_at`."""
        for t in self.transfers:
            wake_at = min(wake_at, t.deadline, t.not_before if t.not_before > now else wake_at)
        return wake_at

    def expired(self, now: float) -> tuple[list[Transfer], list[Transfer]]:
        """Fetches past their deadline, and reads past their lease's margin."""
        late: list[Transfer] = []
        leases_out: list[Transfer] = []
        for t in self.transfers:
            if t.state in _ENDED:
                continue
            if now >= t.deadline:
                late.append(t)
            elif t.state is TransferState.READING and now >= t.give_up_at():
                leases_out.append(t)
        return late, leases_out

    def renewals_due(self, now: float) -> dict[str, list[Transfer]]:
        """Reads half-way through their lease that need more of it, per peer."""
        due: dict[str, list[Transfer]] = {}
        for t in self.transfers:
            g = t.granted
            if (
                g is not None
                and t.state is TransferState.READING
                and not g.renew_sent
                and now >= g.renew_at
                and t.deadline > t.give_up_at()
            ):
                due.setdefault(t.peer or "", []).append(t)
        return due

    # -- what happened -------------------------------------------------------------------

    def ask(self, chunk: Iterable[Transfer], request_id: str, session_id: str, now: float) -> None:
        """`chunk` goes out in one request on `session_id`."""
        for t in chunk:
            t.move(TransferState.REQUESTED)
            t.read = GrantedRead(request_id, session_id, now)
            t.attempts += 1

    @staticmethod
    def grant(t: Transfer, grant_id: str, lease_s: float) -> GrantedRead:
        """The producer granted `t` with a lease of `lease_s`, counted from the request."""
        t.move(TransferState.GRANTED)
        g = t.granted
        assert g is not None  # only a requested transfer is granted
        g.grant_id = grant_id
        g.grant_lease(g.requested_at, lease_s)
        return g

    @staticmethod
    def describe(t: Transfer, item: p.ItemReply | p.Location, deadline_s: float) -> None:
        """What a grant or a location says of the item: its size, meta, digest, extents;
        `deadline_s`: the fetch's deadline for that size."""
        t.nbytes = item.nbytes
        t.dtype = item.dtype
        t.shape = tuple(item.shape)
        t.checksum = item.checksum
        t.remote_extents = [(e.offset, e.length) for e in item.extents]
        t.deadline = max(t.deadline, t.started + deadline_s)

    @staticmethod
    def back_off(
        t: Transfer, now: float, retry_after_s: float, *, retries: int, first_s: float, max_s: float
    ) -> bool:
        """The peer asked `t` to come back later: queue it after an exponential backoff
        (at least `retry_after_s`). False once it has been refused `retries` times."""
        t.move(TransferState.QUEUED)
        t.retries_here += 1
        if t.retries_here > retries:
            return False
        backoff = min(max_s, first_s * (2 ** (t.retries_here - 1)))
        t.not_before = now + max(backoff, retry_after_s)
        return True

    @staticmethod
    def fail_over(t: Transfer, reason: FailureReason) -> bool:
        """Leave the current peer (its read already given up): queued for the next
        candidate, or False when none is left (then fail it with `final_reason`)."""
        if not t.next_peer(reason):
            return False
        if t.state is not TransferState.QUEUED:
            t.move(TransferState.QUEUED)
        t.clear_grant()
        return True

    @staticmethod
    def ask_instead(t: Transfer) -> None:
        """A direct read of `t` ended without usable bytes: ask the same peer for a grant."""
        t.move(TransferState.QUEUED)
        t.clear_grant()
        t.not_before = 0.0

    def renewed(
        self, endpoint: str, asked: frozenset[str], renewed: set[str], lease_s: float
    ) -> tuple[int, int]:
        """A peer answered a Renew of `asked`: those in `renewed` have a lease of
        `lease_s` from when we asked; the rest keep their old one. Returns how many
        were renewed, and how many refused."""
        done = refused = 0
        for t in self.transfers:
            g = t.granted
            if t.peer != endpoint or g is None or not g.renew_sent or g.grant_id not in asked:
                continue
            if g.grant_id in renewed and lease_s > 0:
                g.grant_lease(g.renew_sent, lease_s)  # counted from when we asked
                done += 1
            else:
                g.renew_at = math.inf  # refused (the grant ended): the old lease decides
                refused += 1
            g.renew_sent = 0.0
        return done, refused
