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
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from concurrent.futures import Future
from concurrent.futures._base import FINISHED as _FINISHED
from concurrent.futures._base import RUNNING as _RUNNING
from concurrent.futures._base import InvalidStateError
from typing import Any, Protocol, cast

from ecshare.peer.transfer import FetchResult

# A caller that blocks on a fetch's future for at least this long (or with no
# timeout) lends its thread to the fetch's direct read: a READ made there cannot be
# cut short, so a shorter wait is left to the network thread.
LEND_MIN_WAIT_S = 1.0
# ...and only to reads from a producer on this host (its memory readable from here:
# `PeerLink.peek`), or whose last READ of at least this much ended inside the read
# call (`PeerLink.copies_in_call`), over a transport that may copy inside the call at
# all (`DataTransport.may_copy_in_call`): elsewhere the network thread ends the READ
# as soon, and a lent READ of a small item over UCX TCP is slower than the thread's.
COPY_PROBE_BYTES = 1 << 20


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
