"""The thread-lending fast path: a fetch's future that lends its waiter's thread.

A caller that blocks on a fetch's future (`result` or `exception`, with no
timeout or one of at least `LEND_MIN_WAIT_S`) while the fetch's direct read is
still queued lends its thread to the fetch: the consumer makes the READ, the
check and the commit there (`Lender._lend`), rather than on its network thread
with the result handed back. It was going to wait anyway, and on one host a
READ is a copy made inside the read call. A caller that never blocks on a
future (an engine's scheduler, polling `done()` or waiting with
`concurrent.futures.wait`) is never lent, and so never makes a copy.
`Fetching` keeps every other promise of a `concurrent.futures.Future`.

`CallerThread` holds the paths a caller's thread takes while the network thread
sleeps in poll, each under the consumer's network lock (only tried, never
waited for): the direct reads of new fetches (`read_here`, for a lent thread or
`fetch(read_here=True)`), and the requests of new fetches sent on a fetch lane
(`send_now`). Anything they cannot finish is left to the network thread.
Lending is only to reads from a producer on this host (its memory readable from
here: `PeerLink.peek`), or whose last READ of a MiB or more ended inside the
read call (`PeerLink.copies_in_call`): elsewhere the network thread ends the
READ as soon.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from concurrent.futures._base import FINISHED as _FINISHED
from concurrent.futures._base import RUNNING as _RUNNING
from concurrent.futures._base import InvalidStateError
from typing import Any, Protocol, cast

import zmq

from ecshare.peer.direct import Locations
from ecshare.peer.fetchbook import FetchBook
from ecshare.peer.link import PeerLinkState
from ecshare.peer.links import LinkPool
from ecshare.peer.pull import Pulls
from ecshare.peer.transfer import FetchResult, Transfer, TransferState

# A caller that blocks on a fetch's future for at least this long (or with no
# timeout) lends its thread to the fetch's direct read: a READ made there cannot be
# cut short, so a shorter wait is left to the network thread.
LEND_MIN_WAIT_S = 1.0


class Lender(Protocol):
    def _lend(self) -> None:
        """Make the queued direct reads on the calling thread, if they can be."""


class Fetching(Future[FetchResult]):
    """A fetch's future. A caller that blocks on it (`result` or `exception`) while
    its direct read is still queued lends its thread to the fetch: the READ, the
    check and the commit are made there (`Lender._lend`), rather than handed to
    the network thread and the result handed back, where a READ from its producer
    is a copy made inside the read call (one host). A caller
    that polls `done()`, or waits with `concurrent.futures.wait` (as an engine's
    scheduler, which must not make copies, would), or waits less than
    `LEND_MIN_WAIT_S` (a READ made on its thread cannot be cut short), is never
    lent."""

    def __init__(self, consumer: Callable[[], Lender | None]) -> None:
        # Future's fields, set here rather than by its __init__: running from the start
        # (no executor queues it), and without the condition, which is made on first
        # use (`_condition`): most fetches end without anyone waiting on them (a lent
        # one, a local hit), and a condition is costly to make after an idle gap.
        self._state = _RUNNING
        self._result: FetchResult | None = None
        self._exception: BaseException | None = None
        self._waiters: list[Any] = []
        self._done_callbacks: list[Callable[[Future[FetchResult]], object]] = []
        self._consumer = consumer  # weak: a future kept after its consumer is gone lends nothing

    @property
    def _condition(self) -> threading.Condition:  # type: ignore[override]
        """The future's condition, made by whichever thread first needs it (one wins,
        `dict.setdefault` being atomic). Every waiter (`result`, `wait`, `as_completed`,
        `add_done_callback`) takes it before it reads the state; `_end` stores the state
        before it looks for the condition; so a waiter either sees the fetch ended or
        is there to be woken."""
        cond = self.__dict__.get("_cond")
        if cond is None:
            cond = self.__dict__.setdefault("_cond", threading.Condition())
        return cast(threading.Condition, cond)

    def set_result(self, result: FetchResult) -> None:
        self._end(result, None)

    def set_exception(self, exception: BaseException | None) -> None:
        self._end(None, exception)

    def _end(self, result: FetchResult | None, exception: BaseException | None) -> None:
        """Future.set_result and set_exception, with the condition only if one was made.
        One thread ends a fetch (the network thread, or the caller it lends to)."""
        if self._state == _FINISHED:
            raise InvalidStateError(f"{self._state}: {self!r}")
        self._result, self._exception = result, exception
        self._state = _FINISHED
        cond = self.__dict__.get("_cond")
        if cond is not None:  # someone may wait: wake them, as Future does
            with cond:
                for waiter in self._waiters:
                    if exception is None:
                        waiter.add_result(self)
                    else:
                        waiter.add_exception(self)
                cond.notify_all()
        self._invoke_callbacks()  # type: ignore[attr-defined]

    def result(self, timeout: float | None = None) -> FetchResult:
        self._lent(timeout)
        # A fetch that has ended well (the lent one, most often) is answered without
        # the future's lock: its result is set before its state, once, and never
        # changes. This too runs cold, after the copy.
        if self._state == _FINISHED and self._exception is None:
            return cast(FetchResult, self._result)
        return super().result(timeout)

    def exception(self, timeout: float | None = None) -> BaseException | None:
        self._lent(timeout)
        return super().exception(timeout)

    def _lent(self, timeout: float | None) -> None:
        # Its state read unlocked (`done()` takes the future's lock): one that ends
        # meanwhile finds nothing queued to lend to. This runs cold, after an idle gap.
        if (timeout is None or timeout >= LEND_MIN_WAIT_S) and self._state == _RUNNING:
            consumer = self._consumer()
            if consumer is not None:
                consumer._lend()


class CallerThread:
    """The fast paths of a caller's thread (see the module's docstring)."""

    def __init__(
        self,
        *,
        net_lock: threading.Lock,
        serving: Callable[[], bool],
        book: FetchBook,
        peers: LinkPool,
        locations: Locations,
        pulls: Pulls,
        take_incoming: Callable[[], list[Transfer]],
        deliver: Callable[[], None],
        count: Callable[[str], None],
        count_add: Callable[[str, int], None],
    ) -> None:
        """`serving()`: the network thread's loop runs; `take_incoming()`: the new
        fetches, from now on in the book's table; `deliver()`: resolve the futures
        of those that succeeded."""
        self._net_lock = net_lock
        self._serving = serving
        self._book = book
        self._links = peers.links
        self._locations = locations
        self._pulls = pulls
        self._take_incoming = take_incoming
        self._deliver = deliver
        self._count = count
        self._count_add = count_add

    def read_here(self, lent: bool = False) -> bool | None:
        """`fetch(read_here=True)`: the direct reads of the new fetches, made on the
        caller's thread while the network thread sleeps in poll (under the network lock,
        as `send_now`). True: every new fetch has ended here; False: some are left
        to the network thread (a fallback to a grant, a READ still moving); None:
        nothing was done here (the network thread is busy, or no place is known).
        `lent`: for `Lender._lend`, only at a producer whose READs end inside the call, and
        counted `read_lent` rather than `read_here`."""
        if not self._net_lock.acquire(blocking=False):
            return None
        try:
            if not self._serving() or not self._any_located(copies_only=lent):
                return None
            taken = self._take_incoming()
            self._pulls.dispatch_direct(time.monotonic())
            self._deliver()  # first: the caller waits for it, not for the counts
            ended = [t for t in taken if t.state in (TransferState.DONE, TransferState.FAILED)]
            here = sum(t.state is TransferState.DONE for t in ended)
            if here:
                self._count_add("read_lent" if lent else "read_here", here)
            return len(ended) == len(taken)
        finally:
            self._net_lock.release()

    def send_now(self) -> bool:
        """Send the new fetches' requests from the caller's thread when the network
        thread sleeps in poll and each can go out at once on its peer's fetch lane;
        True if they all went.

        It saves the hand-off: waking the network thread, and its pass through the
        loop before the request goes out. It never blocks (the lock is only tried, a
        lane send does not wait) and touches no ZMQ socket, which the sleeping thread
        polls: the lane's answers wake that thread as ever. Anything else (no lane
        up, a peer not ready, a push to wait for, a lane that breaks on the way) is
        left to the network thread, as without this.
        """
        if not self._net_lock.acquire(blocking=False):
            return False
        try:
            if not self._serving() or self._any_located():
                return False  # left in the queue: the network thread reads them first
            now = time.monotonic()
            picked = self._take_incoming()
            batches: dict[str, list[Transfer]] = {}
            for t in picked:
                link = self._links.get(t.peer or "")
                if (
                    t.state is not TransferState.QUEUED
                    or t.not_before > now
                    or t.awaiting_push
                    or link is None
                    or link.state is not PeerLinkState.READY
                    or link.lane is None
                    or not link.lane.usable
                ):
                    return False
                batches.setdefault(link.endpoint, []).append(t)
            for endpoint, transfers in batches.items():
                link = self._links[endpoint]
                if len(transfers) > link.max_batch_items:
                    return False
            for endpoint, transfers in batches.items():
                self._pulls.request(self._links[endpoint], transfers, now, lane_only=True)
            self._count("requests_sent_by_caller")
            # A lane that broke on the way (the network thread sends again over ZMQ),
            # or one with bytes left to write (its poll now needs POLLOUT): wake it.
            return all(
                (lane := self._links[endpoint].lane) is not None
                and lane.usable
                and lane.poll_flags == zmq.POLLIN
                for endpoint in batches
            )
        finally:
            self._net_lock.release()

    def _any_located(self, copies_only: bool = False) -> bool:
        """A queued fetch's entry is located: the network thread is to read it directly
        (a READ is never made on the caller's thread), at the start of its next pass.
        `copies_only`: only from a producer whose READs end inside the call."""
        if not self._locations:
            return False
        with self._book.lock:
            queued = list(self._book.incoming)
        return self._locations.readable(queued, self._links, copies_only)
