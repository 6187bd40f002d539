"""One item's fetch on behalf of the requests that wait for it.

    started --future done--> settled: hold pinned, or error
       |                        (on the consumer's thread, as the entry becomes READY)
       +--no answer by overdue_at--> settled: error (deadline), counted fetches_overdue
       \\--every waiting request ended--> abandoned (a late result pins nothing)

The fetch asks the consumer for a hold (`FetchItem.hold`): the consumer pins
the entry in the same step as it commits it (or finds it local), so no
eviction can come before the scheduler sees it. The future's callback then
checks the pinned entry's shape against what the model expects. The scheduler
thread reads the outcome once `settled`, and hands the pin on to the waiting
requests as holds (see `pins`).

A consumer whose network thread died would never complete the future; the
scheduler side then gives up on it at `overdue_at` (past the longest deadline
the consumer itself enforces), so that no request waits for it forever.

`started_at` and `done_at` give the item's exposed latency: from the
scheduler asking for it to the entry being local (pinned), whether a producer
pushed it here or we pulled it (`FetchResult.pushed`).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from concurrent.futures import CancelledError, Future

from ecshare.peer import FailureReason, FetchFailed, FetchResult
from ecshare.store import Entry, Hold
from ecshare.vllm.pins import EnginePins

# Returns why an entry is unfit for the model (wrong shape or dtype), or None.
Check = Callable[[Entry], str | None]


class Fetch:
    def __init__(
        self,
        mm_hash: str,
        future: Future[FetchResult],
        *,
        pins: EnginePins,
        hold: Hold,
        check: Check,
        overdue_at: float,
        on_unfit: Callable[[str, str], None],
        started_at: float,
        pushed: bool = False,
    ) -> None:
        self.mm_hash = mm_hash
        self.future = future
        self.overdue_at = overdue_at
        self.started_at = started_at
        self.done_at = started_at  # set as the future completes
        self.pushed = pushed  # announced as pushed here
        self.requests: set[str] = set()  # ids of the requests waiting for it
        self._pins = pins
        self._grant = hold.grant_id  # pinned by the consumer as the entry turns READY
        self._check = check
        self._on_unfit = on_unfit
        self._lock = threading.Lock()
        self._settled = False
        self._abandoned = False
        self._hold: str | None = None
        self._error: BaseException | None = None
        future.add_done_callback(self._on_done)

    @property
    def settled(self) -> bool:
        with self._lock:
            return self._settled

    @property
    def error(self) -> BaseException | None:
        with self._lock:
            return self._error

    def take_hold(self) -> str | None:
        """The fetch's pin on the new entry (once settled); the caller releases it."""
        with self._lock:
            hold, self._hold = self._hold, None
            return hold

    def _on_done(self, future: Future[FetchResult]) -> None:
        done_at = time.monotonic()
        with self._lock:
            self.done_at = done_at
            if self._abandoned:
                self._settled = True
                self._pins.release(self._grant)  # a late result keeps nothing
                return
            try:
                error = future.exception()
            except CancelledError as exc:
                error = exc
            if error is None:
                error = self._pin()
            self._error = error
            self._settled = True

    def _pin(self) -> BaseException | None:
        grant = self._grant
        entry = self._pins.entry(grant)
        if entry is None:  # only a lease of HOLD_LEASE_S run out could end it
            return FetchFailed(
                self.mm_hash, FailureReason.LOCAL_STORE_FULL, "its hold ended as it arrived"
            )
        unfit = self._check(entry)
        if unfit is not None:
            self._pins.release(grant)
            self._on_unfit(self.mm_hash, unfit)
            return FetchFailed(self.mm_hash, FailureReason.INCOMPATIBLE, unfit)
        self._hold = grant
        return None

    def expire(self, why: str) -> bool:
        """Give up on a fetch that never settled; False if it settled meanwhile."""
        with self._lock:
            if self._settled:
                return False
            self._abandoned = True
            self._settled = True
            self._error = FetchFailed(self.mm_hash, FailureReason.DEADLINE, why)
            return True

    def abandon(self) -> None:
        """No request waits for it any more: release its pin, and pin nothing later."""
        with self._lock:
            self._abandoned = True
            hold, self._hold = self._hold, None
        if hold is not None:
            self._pins.release(hold)
