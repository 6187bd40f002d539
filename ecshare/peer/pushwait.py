"""The consumer's side of push, around its inbox: answer offers and credits, and make
fetches wait for a push or pull.

`PushWaits` owns the consumer's `Inbox` (`ecshare.peer.inbox`: reservations and
their writes) and ties it to the fetch book (`ecshare.peer.fetchbook`): it
answers a producer's offers, grants and tops up standing credit, and decides for
each fetch of a pushed item whether it waits or pulls.

Guarantees:
- A fetch of an item whose push is reserved waits for it (within the fetch's
  deadline, stretched by the push's), and one that waits for an announced push
  (`FetchItem.pushed`) gives up waiting when its `push_wait_s` ends with no offer.
- A push refused, failed or given up makes a fetch still waiting for it pull at
  once; a push committed resolves such a fetch as pushed.
- A push is reserved only while no fetch of its item has gone past waiting (its
  request would race the push).
- An item committed by a push and not yet asked for is remembered (a bounded
  number of them), so that the fetch that finds it counts as pushed.

Network thread only, like the inbox (`pending` aside).
"""

from __future__ import annotations

import collections
from collections.abc import Callable

from ecshare import protocol as p
from ecshare.config import Config
from ecshare.peer.fetchbook import FetchBook
from ecshare.peer.inbox import Inbox, Reservation
from ecshare.peer.link import PeerLink, PeerLinkState
from ecshare.peer.links import LinkPool
from ecshare.peer.phases import PhaseLog
from ecshare.peer.transfer import Transfer, TransferState
from ecshare.store import Hold, Store
from ecshare.transport.base import DataTransport

# Items committed by a push and not yet asked for, remembered (this many at most)
# so that the fetch that finds one counts as pushed.
_PUSHED_REMEMBERED = 65536


class PushWaits:
    def __init__(
        self,
        store: Store,
        config: Config,
        transport: DataTransport,
        *,
        book: FetchBook,
        peers: LinkPool,
        count: Callable[[str], None],
        count_add: Callable[[str, int], None],
        succeed: Callable[..., None],
        take_hold: Callable[[str, Hold], bool],
        woke_at: Callable[[], float],
    ) -> None:
        """`succeed(t, endpoint, pushed=True)`: `t` was committed by a push;
        `take_hold(mm_hash, hold)`: pin a READY entry for a caller; `woke_at()`: when
        the loop's poll last returned (for phases)."""
        self._book = book
        self._peers = peers
        self._links = peers.links
        self._count = count
        self._succeed = succeed
        self._take_hold = take_hold
        self._woke_at = woke_at
        self.phases: PhaseLog | None = None
        self._pushed: collections.OrderedDict[str, None] = collections.OrderedDict()
        self.inbox = Inbox(
            store,
            config,
            transport,
            count=count_add,
            may_reserve=self._may_reserve,
            holds_for=self._holds_for,
            ended=self._push_ended,
            agent_loaded=lambda agent: any(x.agent == agent for x in self._links.values()),
        )

    def was_pushed(self, mm_hash: str) -> bool:
        """A local hit on `mm_hash` was committed by a push not asked for until now."""
        return self._pushed.pop(mm_hash, 0) is None

    def await_reserved(self, t: Transfer) -> None:
        """A fetch just picked up waits for its item's push if one is being written."""
        reserved = self.inbox.reserved(t.mm_hash)
        if reserved is not None:
            _wait_for(t, reserved)

    def on_offer(self, link: PeerLink, msg: p.PushOffer, now: float) -> None:
        if (
            link.client is None
            or link.state is not PeerLinkState.READY
            or msg.session_id != link.session_id
        ):
            self._count("push_offers_off_session")  # no session to answer on: dropped
            return
        reply = self.inbox.on_offer(self._peers.push_link(link), msg, now)
        if self.phases is not None:
            self.phases.mark(msg.mm_hash, "c_offer_woke", self._woke_at())
            self.phases.mark(msg.mm_hash, "reserved")
        link.client.send(reply)
        reserved = self.inbox.reserved(msg.mm_hash)
        if reply.status is p.PushStatus.ACCEPTED:
            assert reserved is not None
            self._wait_queued(msg.mm_hash, reserved)
        elif reserved is None:
            # The push a fetch may wait for will not come (region full, busy, not
            # allowed): that fetch pulls now rather than after `push_wait_s`. Refused
            # while another push of the item is reserved, it waits for that one.
            self._pull_now(msg.mm_hash)

    def on_welcomed(self, link: PeerLink, msg: p.Message, now: float) -> None:
        """A session is up: where both sides agreed to standing credit, grant the first."""
        if isinstance(msg, p.Welcome) and p.CAP_PUSH_CREDIT in msg.capabilities:
            self.inbox.credit_agreed(link.endpoint, link.session_id)
            assert link.client is not None
            for void in self.inbox.voids_for(self._peers.push_link(link)):
                link.client.send(void)
            self._grant_credit(link, now)

    def _grant_credit(self, link: PeerLink, now: float) -> None:
        if link.client is None or link.state is not PeerLinkState.READY:
            return
        credit = self.inbox.credit_for(self._peers.push_link(link), now)
        if credit is not None:
            link.client.send(credit)

    def top_up_credits(self, now: float) -> None:
        """Sessions whose credit the region had no room for try again."""
        if self.inbox.credits_wanted:
            for link in self._links.values():
                self._grant_credit(link, now)

    def on_credited(self, link: PeerLink, msg: p.PushCredited, now: float) -> None:
        """A producer writes an item into its credit: checked as an offer would be."""
        if self.phases is not None:
            self.phases.mark(msg.mm_hash, "c_credit_woke", self._woke_at())
        taken = self.inbox.on_credited(self._peers.push_link(link), msg, now)
        self._grant_credit(link, now)  # the next push's, while this write lands
        reserved = self.inbox.reserved(msg.mm_hash)
        if taken and reserved is not None:
            self._wait_queued(msg.mm_hash, reserved)
        elif not taken and reserved is None:
            self._pull_now(msg.mm_hash)  # as for a refused offer

    def _wait_queued(self, mm_hash: str, reserved: Reservation) -> None:
        """A queued fetch of `mm_hash`, picked up or not, waits for the push reserved."""
        with self._book.lock:
            t = self._book.inflight.get(mm_hash)
            if t is not None and t in self._book.transfers and t.state is TransferState.QUEUED:
                _wait_for(t, reserved)

    def _pull_now(self, mm_hash: str) -> None:
        """A fetch of `mm_hash` still waiting for a push stops waiting and pulls, picked
        up already or not (still incoming, where a push's word may come first)."""
        with self._book.lock:
            t = self._book.inflight.get(mm_hash)
            released = t is not None and t.state is TransferState.QUEUED and t.awaiting_push
            if t is not None and released:
                t.awaiting_push = False
                t.not_before = 0.0
        if released:
            self._count("push_fallbacks")

    def _may_reserve(self, mm_hash: str) -> bool:
        """No fetch of `mm_hash` has gone past waiting (its request would race the push)."""
        with self._book.lock:
            t = self._book.inflight.get(mm_hash)
        return t is None or t.state is TransferState.QUEUED

    def _holds_for(self, mm_hash: str) -> list[Hold]:
        with self._book.lock:
            t = self._book.inflight.get(mm_hash)
        if t is None or t not in self._book.transfers:
            return []
        holds = list(t.holds)
        t.holds_taken = len(holds)
        return holds

    def _push_ended(self, r: Reservation, committed: bool) -> None:
        """A push is no longer to be waited for: committed, or refused its data."""
        with self._book.lock:
            t = self._book.inflight.get(r.mm_hash)
        waiting = t is not None and t in self._book.transfers and t.state is TransferState.QUEUED
        if committed:
            if t is not None and waiting:
                self._succeed(t, r.endpoint, pushed=True)
                for late in t.holds[t.holds_taken :]:  # joined after the commit
                    self._take_hold(t.mm_hash, late)
            else:
                self._pushed[r.mm_hash] = None
                while len(self._pushed) > _PUSHED_REMEMBERED:
                    self._pushed.popitem(last=False)
        else:
            self._pull_now(r.mm_hash)

    def release_unawaited(self, now: float) -> None:
        """A fetch that waited for an announced push whose offer never came pulls."""
        for t in self._book.transfers:
            if (
                t.awaiting_push
                and t.state is TransferState.QUEUED
                and now >= t.not_before
                and self.inbox.reserved(t.mm_hash) is None
            ):
                t.awaiting_push = False
                self._count("push_waits_expired")


def _wait_for(t: Transfer, reserved: Reservation) -> None:
    """`t` waits for the push `reserved`, its deadline stretched by the push's."""
    t.awaiting_push = True
    t.not_before = max(t.not_before, reserved.deadline)
    t.deadline = max(t.deadline, reserved.deadline + (t.deadline - t.started))
